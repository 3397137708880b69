"""Inputs shared by tests/test_cuda.py and its rank worker (tests/workers/cuda_checks.py):
values on a Global-QSGD grid, so that every step of a round is exact and its result is plain
arithmetic on the inputs, in fp32, fp16 and bf16 alike.  Inputs only: the expected values
are computed in the test.

A grid for ``L`` levels holds ``k * STEP`` with integers ``|k| <= L <= 127`` (7 significant
bits: exact in fp16 and bf16), and every ``MARK``-th element is ``+-L``.  Scale blocks start
at multiples of ``MARK`` inside each tensor (or FSDP row), so every block's max ``|x|`` is
``s = L * STEP`` on every rank, ``L / s = 1 / STEP`` and ``s / L = STEP`` are exact powers of
two, and ``x * L / s = k`` is an integer: stochastic rounding has nothing to round.
"""

from __future__ import annotations

import os

import numpy as np
import torch

STEP = 2.0**-7
MARK = 8
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# tensors of the engine rounds and of the DDP probe model: several scale blocks, a
# partial block, a matrix
SHAPES = [(3000,), (20, 50), (40,)]
FSDP_SHAPES = [(37, 5), (64,)]  # 37 rows: FSDP pads dim 0 to a multiple of the world size
FSDP_ROW = 3000  # elements per rank of the direct reduce-scatter calls (a multiple of MARK)
BENCH_BYTES = 64 << 20  # the benchmark's fp32 gradient, on CUDA
REHEARSAL_BENCH_BYTES = 4 << 20  # the same on CPU (GQSGD_TEST_DEVICE=cpu): seconds, not minutes


def device_kind() -> str:
    """``cuda`` (default) or ``cpu``: ``GQSGD_TEST_DEVICE=cpu`` rehearses the CUDA checks on
    CPU tensors (with ``HVD_GQSGD_KERNELS=0``, the torch-ops path CUDA tensors take) and Gloo,
    so a change that breaks them shows on a machine without a GPU."""
    kind = os.environ.get("GQSGD_TEST_DEVICE", "cuda")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"GQSGD_TEST_DEVICE must be 'cuda' or 'cpu', got {kind!r}")
    return kind


def codes(numel: int, levels: int, seed: tuple[int, ...]) -> np.ndarray:
    """int64 ``k`` in ``[-levels, levels]``, ``+-levels`` at every MARK-th element."""
    rng = np.random.default_rng(list(seed))
    k = rng.integers(-levels, levels + 1, numel)
    k[::MARK] = levels * rng.choice([-1, 1], size=len(k[::MARK]))
    return k


def values(k: np.ndarray, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """float64 ``k * STEP`` in ``shape`` (default: flat)."""
    out = k.astype(np.float64) * STEP
    return out if shape is None else out.reshape(shape)


def tensor(x: np.ndarray, dtype: str, device: torch.device | str) -> torch.Tensor:
    """``x`` (grid values: exact in every dtype here) as a tensor of ``dtype`` on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=DTYPES[dtype])


def host(t: torch.Tensor) -> np.ndarray:
    """float64 copy on the host (via fp32: exact for fp16 and bf16, which NumPy lacks)."""
    return t.detach().float().cpu().numpy().astype(np.float64)


def inputs(rank: int, levels: int, step: int) -> list[np.ndarray]:
    """One rank's tensors (SHAPES) of one round or step: grid values for ``levels``."""
    return [values(codes(int(np.prod(s)), levels, (1, rank, step, i)), s)
            for i, s in enumerate(SHAPES)]


def fsdp_inputs(rank: int, levels: int) -> list[np.ndarray]:
    """One rank's gradients of the FSDP probe model (FSDP_SHAPES)."""
    return [values(codes(int(np.prod(s)), levels, (2, rank, i)), s)
            for i, s in enumerate(FSDP_SHAPES)]


def fsdp_rows(rank: int, world: int, levels: int, case: int) -> np.ndarray:
    """One rank's input of a direct reduce-scatter call: ``world`` rows of FSDP_ROW."""
    return values(codes(world * FSDP_ROW, levels, (3, rank, case)))
