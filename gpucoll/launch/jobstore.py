"""The job's key-value store: node 0's launcher hosts it; the ranks (and other nodes) connect.

The launcher, not rank 0, hosts the store, so it is up before any rank starts and outlives a
rank that fails. A fresh random token keeps other jobs' ranks out of it.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
from collections.abc import Iterator

from gpucoll.launch.config import LaunchConfig

JOIN_TIMEOUT = 300.0  # how long another node's launcher waits for node 0's store


def new_token() -> str:
    return secrets.token_hex(16)


@contextlib.contextmanager
def job_store(cfg: LaunchConfig, token: str) -> Iterator[tuple[str, int]]:
    """Host (node 0) or reach (other nodes) the job's store; yield the address ranks use."""
    from gpucoll.store import TCPStore

    if cfg.node_rank == 0:
        bind = cfg.master_addr if cfg.nnodes == 1 else "0.0.0.0"
        store = TCPStore(bind, cfg.master_port, is_server=True, token=token)
        address = (cfg.master_addr, store.port)
    else:
        store = TCPStore(cfg.master_addr, cfg.master_port, token=token, timeout=JOIN_TIMEOUT)
        address = (cfg.master_addr, cfg.master_port)
    try:
        yield address
    finally:
        store.close()


def torch_port(cfg: LaunchConfig, store_port: int) -> int:
    """``MASTER_PORT`` for torch.distributed scripts: next to the store's port, or a free one.

    Every node must compute the same value, so a job of several nodes uses store port + 1.
    """
    if cfg.nnodes > 1 or cfg.master_port:
        return store_port + 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((cfg.master_addr, 0))
        return s.getsockname()[1]
