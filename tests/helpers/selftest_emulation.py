"""The self-check's ranks on the emulation: ``setup(store_address)`` installs an emulated
runtime with two devices in a rank's process and returns its device-array maker."""

from __future__ import annotations

from typing import Any

import numpy as np
from nccl_emulation import EmulatedRuntime, FakeDeviceArray

from gpucoll import cuda


class EmulatedArrays:
    """``gpucoll.selftest.CupyArrays`` on the emulation."""

    def __init__(self, rt: EmulatedRuntime):
        self.rt = rt

    def put(self, host: np.ndarray) -> FakeDeviceArray:
        return FakeDeviceArray(host, self.rt)

    def get(self, x: FakeDeviceArray, stream: int | None = None) -> np.ndarray:
        return x.get(stream)

    def new_stream(self) -> int:
        return self.rt.new_stream()

    def current(self, stream: int) -> Any:
        return self.rt.use_stream(stream)


class WrongArrays(EmulatedArrays):
    """Reads back one element off: every check that compares results must fail."""

    def get(self, x: FakeDeviceArray, stream: int | None = None) -> np.ndarray:
        got = super().get(x, stream)
        if got.size:
            got.reshape(-1)[0] = not got.reshape(-1)[0] if got.dtype == bool else 99
        return got


def setup(addr: str) -> EmulatedArrays:
    rt = EmulatedRuntime(addr, devices=2)
    cuda.set_runtime(rt)
    return EmulatedArrays(rt)


def setup_wrong(addr: str) -> EmulatedArrays:
    rt = EmulatedRuntime(addr, devices=2)
    cuda.set_runtime(rt)
    return WrongArrays(rt)


def setup_one_gpu(addr: str) -> EmulatedArrays:
    """One emulated device, for ``gpucoll selftest --ranks N``: every rank shares it."""
    rt = EmulatedRuntime(addr, devices=1)
    cuda.set_runtime(rt)
    return EmulatedArrays(rt)


def setup_one_gpu_nccl_2_28(addr: str) -> EmulatedArrays:
    """``setup_one_gpu`` with an NCCL older than 2.30 (ranks on one GPU need NCCL_HOSTID)."""
    rt = EmulatedRuntime(addr, devices=1, nccl_version="2.28.9")
    cuda.set_runtime(rt)
    return EmulatedArrays(rt)
