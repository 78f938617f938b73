"""The ring order that keeps neighbours on the fastest links.

A ring collective runs at the speed of its slowest hop, so orders are compared by their slowest
hop first, then by the sum of all hops, then lexicographically (so the answer is deterministic).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import permutations

EXACT_UP_TO = 9  # (n-1)!/2 rings: 20160 for 9 nodes, checked in well under a second


def best_ring(nodes: Sequence[int], weight: Callable[[int, int], int]) -> list[int]:
    """The best ring over ``nodes`` (higher weight = faster hop), starting at the smallest node."""
    nodes = sorted(nodes)
    if len(nodes) <= 3:
        return nodes
    if len(nodes) <= EXACT_UP_TO:
        return _exhaustive(nodes, weight)
    return _two_opt(_greedy(nodes, weight), weight)


def ring_key(order: Sequence[int], weight: Callable[[int, int], int]) -> tuple[int, int]:
    """(slowest hop, sum of hops) of the closed ring ``order``: larger is better."""
    hops = [weight(a, b) for a, b in zip(order, [*order[1:], order[0]], strict=True)]
    return min(hops), sum(hops)


def _exhaustive(nodes: list[int], weight: Callable[[int, int], int]) -> list[int]:
    first, rest = nodes[0], nodes[1:]
    best, best_key = None, None
    for perm in permutations(rest):
        if perm[0] > perm[-1]:  # the same ring walked backwards
            continue
        order = [first, *perm]
        key = ring_key(order, weight)
        if best_key is None or key > best_key:  # permutations come in lexicographic order
            best, best_key = order, key
    return best


def _greedy(nodes: list[int], weight: Callable[[int, int], int]) -> list[int]:
    """Nearest-neighbour tour from the smallest node: always step to the fastest unvisited one."""
    order, left = [nodes[0]], set(nodes[1:])
    while left:
        here = order[-1]
        order.append(max(sorted(left), key=lambda n: weight(here, n)))
        left.remove(order[-1])
    return order


def _two_opt(order: list[int], weight: Callable[[int, int], int]) -> list[int]:
    """Reverse segments while that improves the ring; bounded, and deterministic."""
    key = ring_key(order, weight)
    for _ in range(len(order) ** 2):
        improved = False
        for i in range(1, len(order) - 1):
            for j in range(i + 1, len(order)):
                cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                cand_key = ring_key(cand, weight)
                if cand_key > key:
                    order, key, improved = cand, cand_key, True
        if not improved:
            break
    return order
