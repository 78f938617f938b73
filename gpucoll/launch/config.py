"""What one ``gpucoll run`` was asked to do, checked once before any process starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

from gpucoll.launch.devices import visible_gpus


class LaunchError(ValueError):
    """The command line asks for something that cannot run; nothing has been started."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The job: which program, how many ranks where, and how to supervise them."""

    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    tee: str | None = None
    timeout: float | None = None
    grace: float = 5.0
    device: bool = False
    isolate_gpus: bool = False
    token: str | None = None
    keep_going: bool = False

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    def command(self) -> list[str]:
        """The argv each rank runs: this Python on the script or module."""
        if self.module:
            return [sys.executable, "-m", self.program, *self.args]
        return [sys.executable, self.program, *self.args]


def validate(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> list[str]:
    """Raise LaunchError for an impossible job; return the GPUs the ranks will use."""
    _check_counts(cfg)
    _check_program(cfg)
    if cfg.nnodes > 1 and not cfg.token:
        raise LaunchError(
            "a job of several nodes needs one store token shared by every node: "
            "export GPUCOLL_STORE_TOKEN=<same secret on each node> (or pass --token)")
    gpus = visible_gpus(environ)
    if cfg.device and len(gpus) < cfg.nproc:
        raise LaunchError(
            f"--device gives each rank its own GPU, but this node has {len(gpus)} visible "
            f"GPU(s) for -n {cfg.nproc} ranks")
    return gpus


def _check_counts(cfg: LaunchConfig) -> None:
    if cfg.nproc < 1:
        raise LaunchError(f"-n must be at least 1, got {cfg.nproc}")
    if cfg.nnodes < 1:
        raise LaunchError(f"--nnodes must be at least 1, got {cfg.nnodes}")
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise LaunchError(f"--node-rank must be in [0, {cfg.nnodes}), got {cfg.node_rank}")
    if not 0 <= cfg.master_port < 65536:
        raise LaunchError(f"--master-port must be in [0, 65535], got {cfg.master_port}")
    if cfg.nnodes > 1 and cfg.node_rank > 0 and cfg.master_port == 0:
        raise LaunchError("--master-port is required on nodes other than node 0 "
                          "(node 0 prints the store address it listens on)")
    if cfg.timeout is not None and cfg.timeout <= 0:
        raise LaunchError(f"--timeout must be positive, got {cfg.timeout}")
    if cfg.grace < 0:
        raise LaunchError(f"--grace must not be negative, got {cfg.grace}")


def _check_program(cfg: LaunchConfig) -> None:
    if not cfg.module:
        if not os.path.isfile(cfg.program):
            raise LaunchError(f"script not found: {cfg.program!r} (looked in {os.getcwd()})")
        return
    # The ranks run `python -m` from this directory, so look there too.
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(cfg.program) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise LaunchError(f"module not found: {cfg.program!r} (for -m)")
