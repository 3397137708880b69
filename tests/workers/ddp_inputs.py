"""Deterministic per-rank inputs shared by tests/workers/ddp_checks.py and tests/test_ddp.py
(inputs only: no expected values are computed here)."""

from __future__ import annotations

import numpy as np

from hvd_gqsgd import core

# parameter shapes of the probe model: several scale blocks, a partial block, a tiny tensor
SHAPES = [(3000,), (40, 50), (7,), (1500,)]
BLOCK = core.DEFAULT_SCALE_BLOCK  # the grid's period; every default scale block divides it
GRID_EXPONENT = -3
CHUNK_BYTES = 256  # chunk_bytes of the chunked runs: 256 codes at 8 bits, cut mid block
EXACT_CASES = [(bits, dtype) for bits in (4, 8) for dtype in ("float32", "float16", "bfloat16")
               ] + [(16, "float32"), (8, "float64")]


def grid(numel: int) -> np.ndarray:
    """Grid spacing of each element: block b of a tensor uses 2**(GRID_EXPONENT - b % 4)."""
    return 2.0 ** (GRID_EXPONENT - (np.arange(numel) // BLOCK) % 4)


def exact_inputs(rank: int, n: int, bits: int) -> list[np.ndarray]:
    """Per tensor: integers k in [-L, L] times its grid, every scale block's max |x| = L *
    grid on every rank (the first element of each block of ``core.default_scale_block(bits)``
    elements, the size the runs use), so x * L / s is an exact integer and rounding is
    deterministic.  Elements 1
    and 2 hold +L and -L on every rank: their sums reach the overflow bound +-nL."""
    level = core.levels(bits, n)
    out = []
    for i, shape in enumerate(SHAPES):
        numel = int(np.prod(shape))
        k = np.random.default_rng([bits, n, rank, i]).integers(-level, level + 1, numel)
        k[::core.default_scale_block(bits)] = level * (-1) ** rank
        k[1:3] = [level, -level][:max(0, numel - 1)]
        out.append((k * grid(numel)).reshape(shape))
    return out


def random_inputs(rank: int, step: int) -> list[np.ndarray]:
    return [np.random.default_rng([11, rank, step, i]).normal(0, 1 + rank, shape)
            .astype(np.float32) for i, shape in enumerate(SHAPES)]


def digits_split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """sklearn's 1,797 digits, pixels scaled to [0, 1]: 1,347 train rows, 450 held out."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = (x[order] / 16).astype(np.float32), y[order].astype(np.int64)
    return (x[:1347], y[:1347]), (x[1347:], y[1347:])
