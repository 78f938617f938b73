"""How the launcher tells what happened: exit codes, signal names, the root-cause report."""

from __future__ import annotations

import signal

TIMEOUT_EXIT = 124  # like coreutils `timeout`


def exit_status(returncode: int) -> int:
    """The shell's view of a return code: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGSEGV (exit 139)``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"signal {name} (exit {exit_status(returncode)})"


def root_cause(rank: int, local_rank: int, node_rank: int, pid: int | None, returncode: int,
               elapsed: float, stderr_tail: list[str], others: list[str]) -> str:
    """The block printed when a rank fails: the first failure, then what became of the rest."""
    bar = "=" * 72
    lines = [
        bar,
        f"gpucoll run: rank {rank} failed first (root cause: first observed failure)",
        bar,
        f"  rank        : {rank} (local rank {local_rank} on node {node_rank}, pid {pid})",
        f"  exit        : {describe(returncode)}",
        f"  after       : {elapsed:.1f} s",
    ]
    if stderr_tail:
        lines.append(f"  last {len(stderr_tail)} line(s) of its stderr:")
        lines += [f"    {line}" for line in stderr_tail]
    else:
        lines.append("  its stderr was empty")
    if others:
        lines.append("  other ranks:")
        lines += [f"    {line}" for line in others]
    lines.append(bar)
    return "\n".join(lines)
