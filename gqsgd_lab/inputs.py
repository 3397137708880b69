"""Deterministic per-rank inputs shared by the multi-process workers and the tests that
simulate them.  Inputs only: no expected values are computed here."""

from __future__ import annotations

import numpy as np

from hvd_gqsgd import core

# (bits, dtype, op) for grid_exact; fp16/bf16 only where every grid value is representable
GRID_CASES = [
    (bits, dtype, op)
    for bits in (4, 8, 16)
    for dtype in ("float32", "float64", "float16", "bfloat16")
    for op in ("sum", "average")
    if bits <= 8 or dtype in ("float32", "float64")
]
GRID_EXPONENT = -3  # grid spacing 2**-3: the scale is L * 2**-3, so L / s is exact


def grid_input(rank: int, n: int, bits: int, numel: int = 200) -> np.ndarray:
    """Multiples k * 2**e with k in [-L, L], and rank 0 holding +L * 2**e (the global max),
    so that x * L / s is an exact integer and rounding is deterministic."""
    level = core.levels(bits, n)
    k = np.random.default_rng([bits, n, rank]).integers(-level, level + 1, numel)
    if rank == 0:
        k[0] = level
    k[1:4] = [level, -level, 0]  # extremes on every rank at the same positions
    return k.astype(np.float64) * 2.0 ** GRID_EXPONENT


def block_grid_input(rank: int, n: int, bits: int, numel: int, block: int) -> np.ndarray:
    """Like :func:`grid_input`, but block ``b`` (``block`` elements) of the tensor uses the
    grid ``2**(GRID_EXPONENT - b % 4)`` and holds +-L on every rank: with one scale per block
    rounding is deterministic; with one scale per tensor the finer blocks would round."""
    level = core.levels(bits, n)
    k = np.random.default_rng([bits, n, rank, block]).integers(-level, level + 1, numel)
    k[::block] = level * (-1) ** rank  # the block's max |x| is L * grid on every rank
    exponent = GRID_EXPONENT - (np.arange(numel) // block) % 4
    return k.astype(np.float64) * 2.0 ** exponent


def random_input(rank: int, numel: int) -> np.ndarray:
    return np.random.default_rng([7, rank, numel]).normal(0, 1 + rank, numel)


def training_data(rank: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random regression task, different rows on each rank."""
    w = np.random.default_rng(0).normal(size=(8, 1))
    x = np.random.default_rng([1, rank]).normal(size=(rows, 8))
    return x.astype(np.float32), np.tanh(x @ w).astype(np.float32)


TWO_STAGE_NUMELS = [5, 130, 1, 4097, 3000]  # small, odd, scalar, block-straddling tensors
TWO_STAGE_SEED = 11


def two_stage_input(rank: int, n: int, kind: str = "random",
                    numels: list[int] = TWO_STAGE_NUMELS) -> np.ndarray:
    """One rank's flat float32 bucket for the two-stage checks: a shared signal plus noise
    three times as large ("random"), or +-0.75 and zeros at the same places on every rank
    with every seventh element's sign alternating between ranks ("extremes")."""
    total = sum(numels)
    if kind == "extremes":
        x = np.tile([1.0, -1.0, 0.0, 1.0], -(-total // 4))[:total] * 0.75
        x[::7] = 0.75 * (-1) ** rank
        return x.astype(np.float32)
    common = np.random.default_rng([n, len(numels)]).normal(0, 1, total)
    noise = np.random.default_rng([rank, 17]).normal(0, 1, total)
    return (common + 3.0 * noise).astype(np.float32)
