"""Deterministic per-rank inputs shared by tests/workers/fsdp_checks.py and tests/test_fsdp.py
(inputs only: no expected values are computed here)."""

from __future__ import annotations

import numpy as np
from ddp_inputs import digits_split as train_data  # noqa: F401

from gqsgd_lab.two_stage_oracle import stage_levels
from hvd_gqsgd import core

BLOCK = core.DEFAULT_SCALE_BLOCK  # the grid's period; every default scale block divides it
# parameter shapes whose dim 0 does not divide by 2, 3, 4 or 8 (FSDP pads them), a tiny one
SHAPES = [(3001,), (41, 50), (7,), (1499, 3)]
# (bits, reduce dtype, shard size): partial blocks, a one-element shard, whole blocks
GRID_CASES = [(8, "float32", 3000), (8, "bfloat16", 3000), (4, "float32", 2048),
              (16, "float32", 1), (8, "float32", 1), (8, "float16", 1500)]


def grid(numel: int) -> np.ndarray:
    """Grid spacing of each element of a row: block b uses 2**(-3 - b % 4)."""
    return 2.0 ** (-3 - (np.arange(numel) // BLOCK) % 4)


def grid_rows(rank: int, n: int, bits: int, shard: int) -> np.ndarray:
    """``n`` rows of ``shard`` elements: integers k in [-L1, L1] times their grid, every
    block's max |x| = L1 * grid on every rank (its first element), so x * L1 / s is an exact
    integer and rounding is deterministic (blocks of ``core.default_scale_block(bits)``
    elements, the size the runs use).  Elements 1 and 2 of each row hold +L1 and -L1
    on every rank: their sums reach the lane bound +-n L1."""
    level = stage_levels(bits, n)[0]
    k = np.random.default_rng([bits, n, rank, shard]).integers(-level, level + 1, (n, shard))
    k[:, ::core.default_scale_block(bits)] = level * (-1) ** rank
    k[:, 1:3] = [level, -level][:max(0, shard - 1)]
    return (k * grid(shard)).astype(np.float32)


def random_rows(rank: int, n: int, step: int, shard: int, heavy: bool = False) -> np.ndarray:
    gen = np.random.default_rng([13, rank, step, shard])
    if heavy:  # Student's t with 3 degrees of freedom: a few large outliers per block
        return gen.standard_t(3, (n, shard)).astype(np.float32)
    return gen.normal(0, 1 + rank, (n, shard)).astype(np.float32)


def params_input(rank: int, step: int) -> list[np.ndarray]:
    return [np.random.default_rng([17, rank, step, i]).normal(0, 1 + rank, shape)
            .astype(np.float32) for i, shape in enumerate(SHAPES)]
