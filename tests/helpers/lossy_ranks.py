"""One rank of the network-fault tests (tests/test_faults_network.py), started inside a simulated
host: exact all_reduces in a loop until rank 0 has run for ``SECONDS``, then one JSON line in
``OUT/rank-R.json``: the calls made, whether every result was exact, and the error that ended the
loop (its kind, text, the rank it names, and when it was raised, in ``time.time()``). An empty
``OUT/ready-R`` says the rank has made its first call.

    python lossy_ranks.py SECONDS OUT     # rank, size and store from the GPUCOLL_* variables
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import gpucoll
from gpucoll.errors import GpucollError


def main(seconds: float, out: str) -> None:
    report = {"calls": 0, "exact": True, "error": None, "kind": None, "peer": None, "at": None}
    with gpucoll.init(timeout=120) as comm:
        me, n = comm.rank, comm.size
        report["rank"] = me
        end = time.monotonic() + seconds
        try:
            while True:
                i = report["calls"]
                x = np.full(2000 + 97 * (i % 50), me + i, np.float64)  # one to a few segments
                x[-1] = float(me == 0 and time.monotonic() >= end)  # rank 0 says when to stop
                comm.all_reduce(x)
                report["calls"] += 1
                if i == 0:  # the test acts on the network once every rank is here
                    open(os.path.join(out, f"ready-{me}"), "w").close()
                if not np.all(x[:-1] == n * i + n * (n - 1) / 2):
                    report["exact"] = False
                if x[-1]:
                    break
        except GpucollError as exc:
            report.update(error=str(exc), kind=type(exc).__name__,
                          peer=getattr(exc, "peer", None), at=time.time())
    with open(os.path.join(out, f"rank-{me}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
