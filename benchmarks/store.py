#!/usr/bin/env python3
"""Store benchmark: single-client latency and the rendezvous of K clients, gpucoll vs torch.

The server runs in a process of its own (as rank 0's would); clients never share its process.
Rendezvous: K clients (threads spread over --procs worker processes, one connection each) are
released together; each connects, sets its own key, waits for all K keys, then passes an
add-counter barrier (the client that counts K sets "done"; everyone waits for "done").
wall_ms = last client done - release. Impls are interleaved run by run; medians over runs.
Large values (--big): one client's set/get of each size, median latency and GB/s (a run of
sets is timed until a round trip confirms the server has applied them all). All-gather
(--gather K:SIZE): K clients each set a SIZE value, wait for all K keys, multi_get them all.

torch.distributed.TCPStore is measured beside gpucoll's when torch is installed. Its client
does a reverse DNS lookup per connection; RES_OPTIONS=attempts:0 (set here) makes a resolver
that cannot be reached fail at once instead of stalling 5 s per lookup.

    python benchmarks/store.py                      # both impls, 3 runs, K = 64 256 1024
    python benchmarks/store.py --impls gpucoll --runs 1 --clients 64
    python benchmarks/store.py --big 1M,64M --gather 16:1M --clients '' --lat-ops 0
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

from gpucoll.store.server import raise_fd_limit

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- implementations
class GpucollImpl:
    name = "gpucoll"

    @staticmethod
    def prepare() -> None:
        import gpucoll.store  # noqa: F401 - imported before the clock starts

    @staticmethod
    def serve():
        from gpucoll import TCPStore

        return TCPStore(HOST, 0, is_server=True, timeout=600)

    @staticmethod
    def connect(port: int, timeout: float):
        from gpucoll import TCPStore

        return TCPStore(HOST, port, timeout=timeout)


class TorchImpl:
    name = "torch"

    @staticmethod
    def prepare() -> None:
        import torch.distributed  # noqa: F401 - imported before the clock starts

    @staticmethod
    def serve():
        import torch.distributed as dist

        return dist.TCPStore(HOST, 0, None, True, datetime.timedelta(seconds=600),
                             wait_for_workers=False)

    @staticmethod
    def connect(port: int, timeout: float):
        import torch.distributed as dist

        # world_size=None: no random pre-connect delay (torch adds one when it knows the size)
        return dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=timeout),
                             wait_for_workers=False)


IMPLS = {"gpucoll": GpucollImpl, "torch": TorchImpl}


def torch_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- child processes
def serve_main(impl_name: str) -> int:
    """Server process: print the port, serve until stdin closes."""
    raise_fd_limit()
    store = IMPLS[impl_name].serve()
    print(store.port, flush=True)
    sys.stdin.read()
    return 0


def worker_main(impl_name: str) -> int:
    """Client process: for each JSON spec on stdin run its clients' rendezvous, print results."""
    raise_fd_limit()
    threading.stack_size(256 << 10)
    impl = IMPLS[impl_name]
    impl.prepare()
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_clients(impl, json.loads(line))), flush=True)
    return 0


def run_clients(impl, spec: dict) -> list[dict]:
    """Start this process's share of clients, report READY, run them on GO, return timings."""
    k, tag, port, gather = spec["k"], spec["tag"], spec["port"], spec.get("gather", False)
    keys = [f"{tag}/{i}" for i in range(k)]
    value = b"v" * spec["value_bytes"]
    go = threading.Event()
    out: list[dict] = []
    held = []

    def client(i: int) -> None:
        rec: dict = {"id": i}
        try:
            go.wait()
            c = impl.connect(port, spec["timeout"])
            held.append(c)
            rec["t_conn"] = time.monotonic()
            c.set(keys[i], value)
            rec["t_set"] = time.monotonic()
            c.wait(keys)
            if gather:  # all-gather: everyone fetches every value
                values = c.multi_get(keys)
                if len(values) != k or any(len(v) != len(value) for v in values):
                    raise RuntimeError("multi_get returned values of the wrong sizes")
                del values
                rec["t_gathered"] = time.monotonic()
            else:  # rendezvous: then an add-counter barrier
                rec["t_gathered"] = time.monotonic()
                if c.add(f"{tag}/count", 1) == k:
                    c.set(f"{tag}/done", b"1")
                c.wait([f"{tag}/done"])
            rec["t_done"] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - reported in the results
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(rec)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in spec["ids"]]
    for t in threads:
        t.start()
    print("READY", flush=True)
    sys.stdin.readline()
    go.set()
    for t in threads:
        t.join()
    for c in held:
        close = getattr(c, "close", None)
        if close is not None:
            close()
    return out


def child(role: str, impl_name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--{role}", impl_name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:  # our own children, by their handles
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- tests
def latency(impl, port: int, ops: int) -> list[dict]:
    """Median and p99 of set/get/add/check on a 64-byte value, each op timed alone."""
    c = impl.connect(port, 60)
    value = b"v" * 64
    c.set("lat/k", value)
    tests = [("set", lambda: c.set("lat/k", value)), ("get", lambda: c.get("lat/k")),
             ("add", lambda: c.add("lat/n", 1)), ("check", lambda: c.check(["lat/k"]))]
    out = []
    for op, fn in tests:
        for _ in range(max(100, ops // 20)):
            fn()
        samples = []
        for _ in range(ops):
            t = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t) / 1e3)
        samples.sort()
        out.append({"test": "latency", "op": op, "us": samples[len(samples) // 2],
                    "p99_us": samples[int(len(samples) * 0.99)]})
    c.add("lat/n", 0)  # the fire-and-forget sets are all applied before we go on
    close = getattr(c, "close", None)
    if close is not None:
        close()
    return out


def big_values(impl, port: int, sizes: list[int]) -> list[dict]:
    """set/get of large values, one client: median latency of single ops and GB/s. A size
    the store refuses (torch's libuv server caps a value at 8 MiB) is recorded as an error."""
    out = []
    for size in sizes:
        c = impl.connect(port, 300)
        try:
            out += _big_value(c, size)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            out.append({"test": "big", "op": "set", "bytes": size,
                        "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"[store] {size} bytes refused: {out[-1]['error']}", file=sys.stderr)
        close = getattr(c, "close", None)
        if close is not None:
            close()
    return out


def loopback_stream(size: int) -> dict:
    """GB/s of one loopback TCP stream carrying ``size``-byte messages into fresh bytes
    objects: the most any store's get can reach on this machine at this moment (the load of
    a shared machine moves it a lot; it is measured next to each impl's large values)."""
    data = b"x" * size
    reps = max(5, min(200, (512 << 20) // size))  # as many as big_values times
    with socket.create_server((HOST, 0)) as listener:
        tx = socket.create_connection(listener.getsockname()[:2], timeout=60)
        rx, _ = listener.accept()
        with tx, rx, rx.makefile("rb") as reader:
            sender = threading.Thread(target=lambda: [tx.sendall(data) for _ in range(reps + 1)])
            sender.start()
            reader.read(size)  # the first message also waits for the thread to start
            t0 = time.perf_counter()
            for _ in range(reps):
                if len(reader.read(size)) != size:
                    raise RuntimeError("loopback stream ended early")
            elapsed = time.perf_counter() - t0
            sender.join()
    return {"test": "stream", "bytes": size, "GBps": size * reps / elapsed / 1e9}


def _big_value(c, size: int) -> list[dict]:
    value = b"B" * size
    ops = max(5, min(200, (512 << 20) // size))
    c.set("big/k", value)
    c.check(["big/k"])
    samples, t0 = [], time.perf_counter()
    for _ in range(ops):
        t = time.perf_counter_ns()
        c.set("big/k", value)
        samples.append((time.perf_counter_ns() - t) / 1e3)
    c.check(["big/k"])  # a round trip: every set before it has been applied
    applied = time.perf_counter() - t0
    samples.sort()
    out = [{"test": "big", "op": "set", "bytes": size, "ops": ops,
            "us": samples[len(samples) // 2], "GBps": size * ops / applied / 1e9}]
    for _ in range(2):
        c.get("big/k")
    samples = []
    for _ in range(ops):
        t = time.perf_counter_ns()
        got = c.get("big/k")
        samples.append((time.perf_counter_ns() - t) / 1e3)
    if len(got) != size:
        raise RuntimeError(f"get returned {len(got)} bytes, not {size}")
    del got
    samples.sort()
    med = samples[len(samples) // 2]
    out.append({"test": "big", "op": "get", "bytes": size, "ops": ops, "us": med,
                "GBps": size / med / 1e3})
    return out


def rendezvous(workers: list[subprocess.Popen], port: int, k: int, tag: str,
               timeout: float, value_bytes: int = 64, gather: bool = False) -> dict:
    procs = workers[:min(len(workers), k)]
    for j, p in enumerate(procs):
        spec = {"k": k, "tag": tag, "port": port, "ids": list(range(j, k, len(procs))),
                "value_bytes": value_bytes, "timeout": timeout, "gather": gather}
        p.stdin.write(json.dumps(spec) + "\n")
        p.stdin.flush()
    for p in procs:
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError("a client process did not get ready")
    t0 = time.monotonic()
    for p in procs:
        p.stdin.write("GO\n")
        p.stdin.flush()
    recs = [r for p in procs for r in json.loads(p.stdout.readline())]
    errors = [r["error"] for r in recs if "error" in r]
    done = [r["t_done"] - t0 for r in recs if "t_done" in r]
    conn = [r["t_conn"] - t0 for r in recs if "t_conn" in r]
    sets = [r["t_set"] - t0 for r in recs if "t_set" in r]
    gathered = [r["t_gathered"] - t0 for r in recs if "t_gathered" in r]
    return {"test": "allgather" if gather else "rendezvous", "clients": k,
            "value_bytes": value_bytes, "procs": len(procs),
            "wall_ms": max(done) * 1e3 if len(done) == k else None,
            "connected_ms": max(conn) * 1e3 if conn else None,
            "last_set_ms": max(sets) * 1e3 if sets else None,
            "first_gathered_ms": min(gathered) * 1e3 if gathered else None,
            "last_gathered_ms": max(gathered) * 1e3 if gathered else None,
            "errors": len(errors), "first_error": errors[0] if errors else None}


def one_run(impl_name: str, args, run: int) -> list[dict]:
    impl = IMPLS[impl_name]
    server = child("serve", impl_name)
    workers: list[subprocess.Popen] = []
    try:
        port = int(server.stdout.readline())
        recs = latency(impl, port, args.lat_ops) if args.lat_ops else []
        recs += [loopback_stream(size) for size in args.big]
        recs += big_values(impl, port, args.big) if args.big else []
        workers = [child("worker", impl_name) for _ in range(args.procs)] \
            if args.clients or args.gather else []
        for k in args.clients:
            recs.append(rendezvous(workers, port, k, f"rdv{run}k{k}", args.client_timeout))
            print(f"[store] {impl_name} run {run} K={k}: {recs[-1]['wall_ms']} ms",
                  file=sys.stderr)
        for k, size in args.gather:
            recs.append(rendezvous(workers, port, k, f"gather{run}k{k}s{size}",
                                   args.client_timeout, value_bytes=size, gather=True))
            print(f"[store] {impl_name} run {run} gather {k} x {size}: "
                  f"{recs[-1]['wall_ms']} ms", file=sys.stderr)
    finally:
        stop(workers + [server])
    for r in recs:
        r.update(impl=impl_name, run=run)
    return recs


# --------------------------------------------------------------------------- report
def summarize(records: list[dict], impls: list[str]) -> list[list[str]]:
    def med(key, **match):
        vals = [r[key] for r in records
                if all(r.get(a) == b for a, b in match.items()) and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for op in ("set", "get", "add", "check"):
        vals = [med("us", impl=i, test="latency", op=op) for i in impls]
        rows.append([f"{op} latency (us)", *vals])
    for k in sorted({r["clients"] for r in records if r["test"] == "rendezvous"}):
        vals = [med("wall_ms", impl=i, test="rendezvous", clients=k) for i in impls]
        rows.append([f"rendezvous {k} clients (ms)", *vals])
    for size in sorted({r["bytes"] for r in records if r["test"] == "big"}):
        vals = [med("GBps", impl=i, test="stream", bytes=size) for i in impls]
        rows.append([f"loopback TCP {_size(size)} GB/s (ceiling)", *vals])
        for op in ("set", "get"):
            for key, unit in (("us", "latency (us)"), ("GBps", "GB/s")):
                vals = [med(key, impl=i, test="big", op=op, bytes=size) for i in impls]
                rows.append([f"{op} {_size(size)} {unit}", *vals])
    for k, size in sorted({(r["clients"], r["value_bytes"]) for r in records
                           if r["test"] == "allgather"}):
        vals = [med("wall_ms", impl=i, test="allgather", clients=k, value_bytes=size)
                for i in impls]
        rows.append([f"allgather {k} x {_size(size)} (ms)", *vals])
    for row in rows:
        ratio = row[1] / row[2] if len(row) == 3 and row[1] and row[2] else None
        row[1:] = [_fmt(v) for v in row[1:]]
        if len(impls) == 2:
            row.append(f"{ratio:.2f}" if ratio is not None else "-")
    return rows


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """'64', '1K', '1M', '64M', '1G' -> bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    shift = {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
    return int(text[:-1] if shift else text) << shift


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def print_table(rows: list[list[str]], impls: list[str]) -> None:
    head = ["measure", *impls] + (["gpucoll/torch"] if len(impls) == 2 else [])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True))
              + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default=None,
                   help="comma-separated: gpucoll,torch (default: torch too when installed)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", default="64,256,1024", help="rendezvous sizes; '' for none")
    p.add_argument("--procs", type=int, default=8, help="client processes for rendezvous")
    p.add_argument("--lat-ops", type=int, default=5000, help="timed ops per latency op")
    p.add_argument("--big", default="1M,64M",
                   help="large value sizes for single-client set/get; '' for none")
    p.add_argument("--gather", default="16:1M",
                   help="all-gathers K:SIZE (comma-separated); '' for none")
    p.add_argument("--client-timeout", type=float, default=120.0)
    p.add_argument("--out", default=None, help="JSON path (default results/store-<time>.json)")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve_main(args.serve)
    if args.worker:
        return worker_main(args.worker)
    os.environ.setdefault("RES_OPTIONS", "attempts:0")  # inherited by the torch children
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    raise_fd_limit()
    impls = args.impls.split(",") if args.impls else (
        ["gpucoll", "torch"] if torch_available() else ["gpucoll"])
    args.clients = [int(k) for k in args.clients.split(",") if k]
    args.big = [parse_size(s) for s in args.big.split(",") if s]
    args.gather = [(int(k), parse_size(s)) for k, s in
                   (g.split(":") for g in args.gather.split(",") if g)]
    records: list[dict] = []
    for run in range(args.runs):
        for name in impls:
            records += one_run(name, args, run)
    rows = summarize(records, impls)
    print_table(rows, impls)
    out = args.out or os.path.join("results", time.strftime("store-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from gpucoll.bench.libraries import versions  # here: worker processes stay light

    with open(out, "w") as f:
        json.dump({"argv": sys.argv, "versions": versions(*impls),
                   "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                   "env": {"RES_OPTIONS": os.environ.get("RES_OPTIONS")},
                   "impls": impls, "records": records, "table": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
