"""What every example shares: the ``--device`` flag, NumPy or CuPy, and the agreed final check.

Each example runs as ``gpucoll run -n 4 examples/NAME.py`` (NumPy arrays, host ring) or with
``--device`` (CuPy arrays on this rank's GPU, NCCL). It checks its own result on every rank; the
ranks agree on the verdict, rank 0 prints one ``CHECK`` line, and a wrong result exits with 1.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import gpucoll


def parse_args(description: str, extra=None) -> argparse.Namespace:
    """The example's command line: ``--device`` plus whatever ``extra(parser)`` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", action="store_true",
                        help="use CuPy arrays on this rank's GPU (NCCL) instead of NumPy")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def start(device: bool):
    """Join the job; return (communicator, array module: numpy or cupy)."""
    if not device:
        return gpucoll.init(), np
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        sys.exit(f"--device needs a CUDA GPU, and CuPy finds none here ({exc})")
    gpu = local_gpu(count)
    cupy.cuda.Device(gpu).use()
    return gpucoll.init(device=gpu), cupy


def local_gpu(count: int) -> int:
    """This rank's GPU among ``count``: local rank i uses GPU i, whichever launcher started it
    (gpucoll run, torchrun, srun, mpirun), and GPU 0 without one."""
    return gpucoll.rendezvous.local_rank(0) % count


def to_host(a) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array (for checking and printing)."""
    return a.get() if hasattr(a, "get") else np.array(a)


def finish(comm, xp, name: str, ok: bool, detail: str) -> int:
    """Agree on the verdict across ranks; rank 0 prints the CHECK line. The exit status."""
    flag = xp.asarray([1 if ok else 0], dtype=xp.int32)
    comm.all_reduce(flag, op="min")
    everyone = bool(to_host(flag)[0])
    if not ok:
        print(f"rank {comm.rank}: wrong result: {detail}", file=sys.stderr, flush=True)
    if comm.rank == 0:
        verdict = "passed" if everyone else "FAILED"
        print(f"CHECK {name}: {verdict} ({detail})", flush=True)
    comm.close()
    return 0 if everyone else 1
