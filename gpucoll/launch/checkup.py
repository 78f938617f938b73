"""The launcher asks ``gpucoll doctor`` about its own job: when ``--timeout`` passes, and when
the launcher gets SIGUSR1.

It first writes what it knows of its ranks' processes (``launcher.json`` in the job's trace
directory: pid, running or stopped, how a finished one ended), then runs the doctor against the
job's store in a process of its own (the doctor is a command above the launcher), which asks
every rank for its flight recorder; each rank also writes its dump into the trace directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

FACTS_FILE = "launcher.json"
DOCTOR_WAIT_S = 5.0  # how long the ranks get to answer (a loaded machine is slow to)
DOCTOR_LIMIT_S = 30.0  # the doctor's whole run, at most


def process_state(pid: int | None) -> str:
    """``running``, ``stopped`` (SIGSTOP or a debugger) or ``gone``, from /proc."""
    if pid is None:
        return "gone"
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def clear_dumps(trace_dir: str) -> None:
    """Remove the dumps and facts an earlier job left in ``trace_dir`` (and nothing else)."""
    try:
        names = os.listdir(trace_dir)
    except OSError:
        return
    for name in names:
        if name == FACTS_FILE or (name.startswith("rank-") and name.endswith(".trace.jsonl")):
            try:
                os.unlink(os.path.join(trace_dir, name))
            except OSError:
                pass


def save_facts(trace_dir: str, known: dict[str, Any]) -> str:
    """Write ``known`` (the launcher's facts about its ranks) where ``gpucoll doctor DIR``
    finds it; its path."""
    path = os.path.join(trace_dir, FACTS_FILE)
    os.makedirs(trace_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(known, f, indent=1)
    return path


def run_doctor(store_url: str, token: str, trace_dir: str, known: dict[str, Any]) -> str:
    """The doctor's report on the job (its stdout and stderr), with ``known`` facts saved
    beside the ranks' dumps first."""
    try:
        path = save_facts(trace_dir, known)
    except OSError as exc:
        return f"gpucoll doctor: could not write the launcher's facts in {trace_dir}: {exc}"
    argv = [sys.executable, "-m", "gpucoll", "doctor", store_url, "--facts", path,
            "--wait", str(DOCTOR_WAIT_S)]
    env = {**os.environ, "GPUCOLL_STORE_TOKEN": token}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=DOCTOR_LIMIT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"gpucoll doctor: did not finish: {exc}"
    return (done.stdout + done.stderr).rstrip("\n")
