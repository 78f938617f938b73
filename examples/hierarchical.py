"""Hierarchical all-reduce with split(): reduce within each "node", all-reduce across the node
leaders, broadcast back down. The shape NCCL uses across machines (fast links inside a node,
one slow link per node between them), built from three sub-communicators.

    gpucoll run -n 4 examples/hierarchical.py [--per-node 2] [--device]
"""

from __future__ import annotations

import sys

import numpy as np
from _example import finish, parse_args, start, to_host


def extra(parser) -> None:
    parser.add_argument("--per-node", type=int, default=2, help="ranks per pretend node")


def hierarchical_all_reduce(node, leaders, x):
    """Sum ``x`` over the whole job: node reduce -> leaders all_reduce -> node broadcast."""
    node.reduce(x, root=0)
    if leaders is not None:  # only the node leaders (node rank 0) are in this communicator
        leaders.all_reduce(x)
    node.broadcast(x, root=0)
    return x


def main() -> int:
    args = parse_args(__doc__, extra)
    comm, xp = start(args.device)
    node_id = comm.rank // args.per_node
    node = comm.split(color=node_id, key=comm.rank)
    leaders = comm.split(color=0 if node.rank == 0 else None, key=comm.rank)
    print(f"node {node_id}: rank {node.rank} of {node.size} in its node"
          + (f", leader {leaders.rank} of {leaders.size}" if leaders else ""), flush=True)

    data = np.random.default_rng(comm.rank).integers(0, 1 << 20, size=4096)
    ours = to_host(hierarchical_all_reduce(node, leaders, xp.array(data)))  # copies: in place
    flat = to_host(comm.all_reduce(xp.array(data)))
    ok = np.array_equal(ours, flat)
    nodes = (comm.size + args.per_node - 1) // args.per_node
    detail = (f"{nodes} nodes of up to {args.per_node} ranks: node reduce + leader all_reduce + "
              f"node broadcast equals all_reduce on all {comm.size} ranks: {ok}")
    return finish(comm, xp, "hierarchical", ok, detail)


if __name__ == "__main__":
    sys.exit(main())
