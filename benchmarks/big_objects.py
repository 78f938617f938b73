"""Objects larger than 2 GiB through the object collectives, by hand (needs about 3x the size
in memory per rank): rank 0 broadcasts a dict holding a ``--gb`` GB uint8 array (out of band),
then sends rank 1 a ``--bytes-gb`` GB bytes object (inside the pickle stream). Each rank prints
whether what it got is right, how long it took and its peak memory.

    gpucoll run -n 2 --timeout 900 benchmarks/big_objects.py [--gb 2.5] [--bytes-gb 2.2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np

import gpucoll


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.5)
    parser.add_argument("--bytes-gb", type=float, default=2.2)
    args = parser.parse_args()
    comm = gpucoll.init("ring", timeout=600)
    r, n, m = comm.rank, int(args.gb * 1e9), int(args.bytes_gb * 1e9)
    ok = True

    obj = {"a": np.full(n, 7, np.uint8), "tag": "big"} if r == 0 else None
    comm.barrier()
    start = time.perf_counter()
    got = comm.broadcast_object(obj, root=0)
    took = time.perf_counter() - start
    right = got["a"].size == n and got["tag"] == "big" and int(got["a"][::1 << 20].min()) == 7
    ok &= right
    how = "root: its own object" if r == 0 else \
        f"received out of band: {not got['a'].flags.owndata}"
    print(f"rank {r}: broadcast_object of a {n / 1e9:.2f} GB array: {took:.1f} s, right: "
          f"{right}, {how}", flush=True)
    del obj, got

    if comm.size > 1:
        comm.barrier()
        start = time.perf_counter()
        if r == 0:
            comm.send_object(b"z" * m, 1)
        elif r == 1:
            data = comm.recv_object(0)
            right = len(data) == m and data[:1] == data[-1:] == b"z"
            ok &= right
            print(f"rank 1: recv_object of {m / 1e9:.2f} GB of bytes: "
                  f"{time.perf_counter() - start:.1f} s, right: {right}", flush=True)
            del data
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"rank {r}: peak memory {peak:.1f} GB", flush=True)
    comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
