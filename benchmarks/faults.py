"""How soon the surviving ranks raise after a fault: the bounds the README's Errors section
states, measured on the host ring.

Each scenario starts a fresh group of ``--ranks`` processes on one transport, makes one rank
fail (killed with SIGKILL, stopped with SIGSTOP, or calling something else), and records on
every other rank the error it raised, the rank it named and the seconds from the fault (the
faulty rank writes the time to the store just before it happens) to the error. A stopped rank
is only found at the call's deadline (``--deadline``), so for it the table shows the seconds
past that deadline: the time spent naming the rank that is behind.

``--cost`` measures instead what the always-on guards cost a call, each on its own, as the
communicator's lean path runs them (best of several timeit repeats, so other load on the
machine counts little): the frame header built for the call's messages, its check against a
received header, the progress record's marks, and the fork and second-thread guard.

``--share`` puts the frame header's cost beside a large call: two ranks on shared memory run
``--share-mib`` MiB float32 all_reduces, counting in each rank the messages one call sends and
receives (each carries a header of 32 bytes, each received one is checked) and timing the calls;
the header's share of a call is then one build plus a check per received message, from
``--cost``'s figures, over the call's median time, and its bytes over the bytes the call sends.
That share of the time is the share of busbw it costs.

    python benchmarks/faults.py [--ranks 3] [--repeats 5] [--json results/faults.json]
    python benchmarks/faults.py --cost
    python benchmarks/faults.py --share [--share-mib 32] [--calls 40]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import time
from pathlib import Path

import numpy as np

import gpucoll
from gpucoll.errors import GpucollError
from gpucoll.store import TCPStore
from gpucoll.transport.engine import FRAME_BYTES

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "results" / "faults.json"


def _killed_in_all_reduce(comm, side, deadline):
    """The last rank dies (SIGKILL) while the others are inside all_reduce."""
    x = np.ones(1 << 18, np.float32)
    for i in range(1_000_000):
        if comm.rank == comm.size - 1 and i == 20:
            _mark(side)
            os.kill(os.getpid(), signal.SIGKILL)
        comm.all_reduce(x)
    raise AssertionError("the dead rank was never noticed")


def _killed_before_split(comm, side, deadline):
    """The last rank dies while the others agree on a split's colours."""
    comm.barrier()
    if comm.rank == comm.size - 1:
        _mark(side)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.split(0)


def _killed_in_debug_check(comm, side, deadline):
    """With GPUCOLL_DEBUG=1, the last rank dies while the others wait in the store's check."""
    comm.barrier()
    if comm.rank == comm.size - 1:
        _mark(side)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(np.ones(4))


def _stopped(comm, side, deadline):
    """The last rank stops (SIGSTOP); the others time out and name it. It is killed after."""
    comm.barrier()
    if comm.rank == comm.size - 1:
        _mark(side, time.time() + deadline)  # the others' deadline, the reference point
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.all_reduce(np.ones(1 << 16), timeout=deadline)


def _size_disagreement(comm, side, deadline):
    """Rank 0 sends 4 floats where the others expect 5, then closes."""
    comm.barrier()
    if comm.rank == 0:
        _mark(side)
        comm.broadcast(np.ones(4), root=0)
        comm.close()  # the others learn of it here, if not before
        return
    comm.broadcast(np.ones(5), root=0)


SCENARIOS = {
    "killed in all_reduce": (_killed_in_all_reduce, {}),
    "killed before split": (_killed_before_split, {}),
    "killed in debug check": (_killed_in_debug_check, {"GPUCOLL_DEBUG": "1"}),
    "stopped (past deadline)": (_stopped, {}),
    "size disagreement": (_size_disagreement, {}),
}


def _mark(side, when: float | None = None) -> None:
    side.set("t", repr(time.time() if when is None else when))
    side.close()


def _rank(name, rank, size, port, env, deadline, results):
    os.environ.update(env)
    side = TCPStore("127.0.0.1", port, timeout=60)
    comm = gpucoll.init("ring", rank=rank, world_size=size,
                        store=f"tcp://127.0.0.1:{port}", timeout=60)
    try:
        SCENARIOS[name][0](comm, side, deadline)
    except GpucollError as exc:
        since = time.time() - float(side.get("t", timeout=60))
        results.put((rank, type(exc).__name__, exc.peer, round(since, 4)))
    finally:
        try:
            comm.close()
        except GpucollError:
            pass


def run_once(name: str, size: int, transport: str, deadline: float) -> list[tuple]:
    """One group of ``size`` fresh processes through scenario ``name``; each survivor's
    (rank, error, rank named, seconds)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=60) as server:
        env = {"GPUCOLL_TRANSPORT": transport, **SCENARIOS[name][1]}
        procs = [ctx.Process(target=_rank, args=(name, r, size, server.port, env, deadline,
                                                 results)) for r in range(size)]
        for p in procs:
            p.start()
        got = []
        try:
            for _ in range(size - 1):
                got.append(results.get(timeout=deadline + 60))
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
    return sorted(got)


def _share_rank(rank: int, port: int, mib: int, calls: int, results) -> None:
    """One rank of ``--share``: (messages sent, received, bytes sent) in one call, and the
    calls' median seconds."""
    from gpucoll.backends import ring_algos

    counts = {"send": 0, "recv": 0, "bytes": 0}

    def counting(method, kind):
        def wrapper(self, peer, arr, *args, **kwargs):
            counts[kind] += 1
            if kind == "send":
                counts["bytes"] += arr.nbytes + FRAME_BYTES
            return method(self, peer, arr, *args, **kwargs)
        return wrapper

    step = ring_algos.Step
    step.send = counting(step.send, "send")
    step.recv = counting(step.recv, "recv")
    step.reduce_from = counting(step.reduce_from, "recv")
    os.environ["GPUCOLL_TRANSPORT"] = "shm"
    x = np.ones(mib << 18, np.float32)
    with gpucoll.init("ring", rank=rank, world_size=2, store=f"tcp://127.0.0.1:{port}",
                      timeout=60) as comm:
        comm.all_reduce(x)  # one call, counted (and a warm-up)
        one = dict(counts)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - start)
    results.put((rank, one, statistics.median(times)))


def header_share(mib: int, calls: int) -> dict:
    """The frame header's share of a ``mib`` MiB all_reduce at 2 ranks (see ``--share``)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with TCPStore("127.0.0.1", 0, is_server=True, timeout=60) as server:
        procs = [ctx.Process(target=_share_rank, args=(r, server.port, mib, calls, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = sorted(results.get(timeout=600) for _ in procs)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    costs = dict(guard_costs(number=100_000, repeat=5))
    build, check = costs["frame header (build)"], costs["frame header (check)"]
    rows = []
    for rank, one, seconds in got:
        ns = build + one["recv"] * check
        rows.append({"rank": rank, "sent": one["send"], "received": one["recv"],
                     "call_s": seconds, "header_ns": ns,
                     "time_share": ns / (seconds * 1e9),
                     "byte_share": one["send"] * FRAME_BYTES / one["bytes"]})
    return {"mib": mib, "calls": calls, "build_ns": build, "check_ns": check, "ranks": rows}


def print_share(report: dict, json_path: Path) -> None:
    print(f"# The frame header's share of a {report['mib']} MiB float32 all_reduce, 2 ranks, "
          f"shm ({report['calls']} calls; header build {report['build_ns']:.0f} ns, check "
          f"{report['check_ns']:.0f} ns; load average {os.getloadavg()[0]:.1f})")
    print(f"  {'rank':<6}{'sent':>6}{'recvd':>7}{'call ms':>10}{'header ns':>11}"
          f"{'time share':>12}{'byte share':>12}")
    for r in report["ranks"]:
        print(f"  {r['rank']:<6}{r['sent']:>6}{r['received']:>7}{r['call_s'] * 1e3:>10.2f}"
              f"{r['header_ns']:>11.0f}{r['time_share']:>12.5%}{r['byte_share']:>12.6%}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    print(f"# wrote {json_path}")


def guard_costs(number: int = 200_000, repeat: int = 7) -> list[tuple[str, float]]:
    """Nanoseconds per call of each always-on guard (best of ``repeat`` timeit runs)."""
    import threading
    import timeit

    from gpucoll.backends.ring_algos import FRAME, frame
    from gpucoll.ops import ReduceOp
    from gpucoll.progress import KIND, Progress

    x = np.ones(2, np.float32)
    kind, op, dtype = KIND["all_reduce"], ReduceOp.SUM, x.dtype
    hdr = frame(kind, 7, dtype, x.size, -1, op)
    ring = memoryview(np.frombuffer(bytearray(hdr + bytes(64)), np.uint8))  # a received message
    progress, entry = Progress(), threading.Lock()

    class Comm:  # the attributes the guard reads
        _forked = False

    comm = Comm()
    pieces = {
        "frame header (build)": lambda: frame(kind, 7, dtype, x.size, -1, op),
        "frame header (check)": lambda: ring[:FRAME.size] != hdr,
        "progress record (enter, leave)": lambda: (progress.enter(7, kind),
                                                   progress.leave(True)),
        "fork and thread guard": lambda: (comm._forked or not entry.acquire(False)
                                          or entry.release()),
        "nothing (the timing loop itself)": lambda: None,
    }
    best = {name: min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9
            for name, fn in pieces.items()}
    loop = best.pop("nothing (the timing loop itself)")
    return [(name, max(ns - loop, 0.0)) for name, ns in best.items()]


def print_costs(json_path: Path) -> None:
    costs = guard_costs()
    print("# Cost of the always-on guards per call (ns, best of 7 timeit runs, the loop's own "
          "cost taken off)")
    for name, ns in costs:
        print(f"  {name:<34}{ns:>8.0f}")
    total = sum(ns for _, ns in costs)
    print(f"  {'total':<34}{total:>8.0f}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"guard_costs_ns": dict(costs), "total_ns": total},
                                    indent=1))
    print(f"# wrote {json_path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=2.0,
                        help="the call deadline in the stopped-rank scenario (s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--cost", action="store_true",
                        help="measure what the always-on guards cost a call instead")
    parser.add_argument("--share", action="store_true",
                        help="measure the frame header's share of a large call instead")
    parser.add_argument("--share-mib", type=int, default=32)
    parser.add_argument("--calls", type=int, default=40, help="timed calls for --share")
    args = parser.parse_args(argv)
    if args.share:
        print_share(header_share(args.share_mib, args.calls),
                    args.json.with_name("header_share.json") if args.json == DEFAULT_JSON
                    else args.json)
        return
    if args.cost:
        print_costs(args.json.with_name("guard_costs.json") if args.json == DEFAULT_JSON
                    else args.json)
        return
    rows = []
    print(f"# Seconds from a fault to the error on every other rank ({args.ranks} ranks, "
          f"{args.repeats} groups each; 'stopped': seconds past the {args.deadline:g} s "
          f"deadline)")
    print(f"# {'scenario':<26}{'transport':<11}{'error':<20}{'names':>6}{'median':>9}{'max':>9}")
    for name in SCENARIOS:
        for transport in ("shm", "tcp"):
            seen = [o for _ in range(args.repeats)
                    for o in run_once(name, args.ranks, transport, args.deadline)]
            times = [s for _, _, _, s in seen]
            kinds = sorted({k for _, k, _, _ in seen})
            named = sorted({str(p) for _, _, p, _ in seen})
            row = {"scenario": name, "transport": transport, "ranks": args.ranks,
                   "errors": kinds, "named": named, "median_s": statistics.median(times),
                   "max_s": max(times), "samples": len(times)}
            rows.append(row)
            print(f"  {name:<26}{transport:<11}{'/'.join(kinds):<20}{','.join(named):>6}"
                  f"{row['median_s']:>9.3f}{row['max_s']:>9.3f}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "argv": argv}, indent=1))
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
