"""The environment of one rank: gpucoll's variables and torchrun's, so either kind of script runs.

torchrun's ``MASTER_PORT`` is not the gpucoll store's port: a torch.distributed script hosts its
own store there (rank 0 binds it), so the two must not collide.
"""

from __future__ import annotations

from gpucoll.launch.config import LaunchConfig
from gpucoll.launch.devices import device_env
from gpucoll.rendezvous import store_url


def rank_env(cfg: LaunchConfig, local_rank: int, store: tuple[str, int], token: str,
             torch_port: int, gpus: list[str]) -> dict[str, str]:
    """Variables to add to the launcher's own environment for ``local_rank`` of this node."""
    host, port = store
    rank = cfg.global_rank(local_rank)
    env = {
        "GPUCOLL_RANK": str(rank),
        "GPUCOLL_WORLD_SIZE": str(cfg.world_size),
        "GPUCOLL_LOCAL_RANK": str(local_rank),
        "GPUCOLL_LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GPUCOLL_NODE_RANK": str(cfg.node_rank),
        "GPUCOLL_STORE": store_url(host, port),
        "GPUCOLL_STORE_TOKEN": token,
        # torchrun's names
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": str(cfg.node_rank),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(torch_port),
        # prefixed output is only useful if it arrives while the job runs
        "PYTHONUNBUFFERED": "1",
    }
    env.update(device_env(local_rank, gpus, cfg.isolate_gpus))
    return env
