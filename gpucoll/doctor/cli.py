"""``gpucoll doctor``: read every rank's flight recorder and say what went wrong.

    gpucoll doctor DIR                      the dumps ranks wrote (GPUCOLL_TRACE_DIR, --tee DIR)
    gpucoll doctor tcp://host:port          a live job, through its store, while it hangs
    gpucoll doctor SOURCE --timeline t.json also write a Chrome trace of every rank's calls

Exit status: 0 when nothing is wrong, 1 when the doctor found a problem, 2 when it could not
read anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gpucoll.doctor.diagnosis import PATIENCE_S, diagnose
from gpucoll.doctor.records import EvidenceError, ask_store, read_dir, read_facts
from gpucoll.errors import GpucollError

WAIT_S = 3.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucoll doctor", description="Say which rank is stuck where, which ranks "
        "disagree, and which failed first, from the ranks' flight recorders.",
        epilog="Exit status: 0 nothing wrong, 1 a problem found, 2 nothing could be read.")
    p.add_argument("source", metavar="DIR|tcp://HOST:PORT",
                   help="a directory of rank-R.trace.jsonl dumps, or a running job's store")
    p.add_argument("--timeline", metavar="FILE",
                   help="also write every rank's calls as a Chrome trace (Perfetto, "
                   "chrome://tracing)")
    p.add_argument("--job", default=None,
                   help="the job's id in the store (default: GPUCOLL_JOB_ID, else the one "
                   "`gpucoll run` and plain init use, 'anonymous')")
    p.add_argument("--token", default=None,
                   help="the store's token (default: GPUCOLL_STORE_TOKEN)")
    p.add_argument("--wait", type=float, default=WAIT_S, metavar="S",
                   help=f"how long a live job's ranks get to answer (default {WAIT_S:g})")
    p.add_argument("--patience", type=float, default=PATIENCE_S, metavar="S",
                   help="ranks at different calls are a problem once one has waited this "
                   f"long (default {PATIENCE_S:g})")
    p.add_argument("--facts", metavar="FILE",
                   help="what a launcher knows of its ranks' processes (JSON, as `gpucoll "
                   "run` writes it to launcher.json)")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        evidence = _read(args)
    except (EvidenceError, GpucollError, OSError) as exc:
        print(f"gpucoll doctor: {exc}", file=sys.stderr)
        return 2
    verdicts = diagnose(evidence, args.patience)
    if args.timeline:
        from gpucoll.doctor.timeline import chrome_trace

        with open(args.timeline, "w") as f:
            json.dump(chrome_trace(evidence), f)
    if args.json:
        print(json.dumps([{"group": v.group, "size": v.size, "backend": v.backend,
                           "problem": v.problem, "headline": v.headline,
                           "details": dict(v.details)} for v in verdicts], indent=2))
    else:
        print(_text(evidence, verdicts, args.timeline))
    return 1 if any(v.problem for v in verdicts) else 0


def _read(args: argparse.Namespace):
    if args.source.startswith("tcp://"):
        from gpucoll.rendezvous import job_id
        from gpucoll.store import TCPStore, parse_address

        host, port = parse_address(args.source)
        job = args.job or job_id() or "anonymous"
        with TCPStore(host, port, timeout=5.0 + max(args.wait, 0.0), token=args.token) as store:
            evidence = ask_store(store, job.replace("/", "_"), args.wait)
        if not evidence.groups:
            raise EvidenceError(f"no rank of job {job!r} answered at {args.source}, and the "
                                f"store holds no communicator of it (another --job?)")
    else:
        evidence = read_dir(args.source)
    if args.facts:
        evidence.facts = read_facts(args.facts)
    return evidence


def _text(evidence, verdicts, timeline: str | None) -> str:
    problems = sum(v.problem for v in verdicts)
    head = (f"gpucoll doctor: {len(verdicts)} communicator(s) in {evidence.source}: "
            f"{problems} with a problem" if problems else
            f"gpucoll doctor: {len(verdicts)} communicator(s) in {evidence.source}: "
            f"no problem found")
    first = next((v for v in verdicts if v.problem), verdicts[0] if verdicts else None)
    lines = [head] + ([f"  {first.headline}"] if first is not None else []) + [""]
    lines += [v.text(headline=v is not first) for v in verdicts]
    if evidence.unreadable:
        lines.append(f"\n({evidence.unreadable} answer(s) or summaries in the store were not "
                     f"flight records and were left out)")
    if timeline:
        lines.append(f"\ntimeline written to {os.path.abspath(timeline)} (open it in "
                     f"https://ui.perfetto.dev or chrome://tracing)")
    return "\n".join(lines)
