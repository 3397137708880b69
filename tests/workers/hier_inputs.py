"""Deterministic per-rank inputs for the hierarchical tests (tests/test_hierarchical.py and
tests/workers/hier_checks.py).  Inputs only: no expected values are computed here.

``rank_grid`` makes every *node sum* a multiple ``k * 2**-3`` with ``k`` in ``[-L, L]``,
``L = floor((2**(bits-1) - 1) / nodes)``, and puts ``+-L`` at the start of every scale block
on every node, so the hierarchical scale of each block is ``L * 2**-3`` and rounding is
deterministic.  The ranks of a node split their node's ``k`` between them at random.
"""

from __future__ import annotations

import numpy as np

GRID = 2.0**-3
GRID_BITS = (3, 4, 8, 16)
GROUP_NUMELS = (70, 45, 1, 3)  # several tensors in one bucket; 1 and 3 leave shards empty
BLOCK = 16  # scale_block of the grouped cases: blocks straddle shard boundaries
TWO_STAGE_NUMELS = (*GROUP_NUMELS, 5000)  # tensors that leave shards empty, and a big one


def node_levels(bits: int, nodes: int) -> int:
    """The overflow bound with one code per node, written out here independently of core."""
    return (2 ** (bits - 1) - 1) // nodes


def node_codes(c: int, nodes: int, bits: int, numel: int, block: int) -> np.ndarray:
    """The integers ``k`` of node ``c``'s sum (``block == 0``: one block per tensor)."""
    level = node_levels(bits, nodes)
    k = np.random.default_rng([bits, nodes, c, numel, block]).integers(-level, level + 1, numel)
    k[::block or numel] = level if c == 0 else -level  # each block's max |sum| is L
    if numel > 2:
        k[1:3] = [level, -level]  # every node at +L, then -L: the lane's extreme sums
    return k


def rank_grid(c: int, j: int, local_size: int, nodes: int, bits: int, numel: int,
              block: int) -> np.ndarray:
    """Rank ``(c, j)``'s input: the ranks of node ``c`` sum exactly to ``k * GRID``."""
    k = node_codes(c, nodes, bits, numel, block)
    level = node_levels(bits, nodes)
    parts = np.random.default_rng([bits, nodes, c, numel, block, 1]).integers(
        -level, level + 1, (local_size - 1, numel))
    mine = parts[j] if j < local_size - 1 else k - parts.sum(axis=0)
    return mine.astype(np.float64) * GRID


def random_input(rank: int, numel: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([11, seed, rank, numel]).normal(0, 1 + rank % 3, numel)
