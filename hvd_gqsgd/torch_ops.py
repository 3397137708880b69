"""The core's tensor primitives (:class:`hvd_gqsgd.core.TensorOps`) as torch ops, with no
Horovod: shared by the Horovod adapter (:mod:`hvd_gqsgd.torch`) and the DDP hook
(:mod:`hvd_gqsgd.ddp`), which must not import Horovod.  Each method is one torch call; no
formula lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import kernels

__all__ = ["TorchOps", "host_empty"]


def host_empty(shape: int | tuple[int, ...], dtype: type) -> torch.Tensor:
    """An uninitialised CPU tensor on :func:`hvd_gqsgd.kernels.host_array` memory: NumPy's
    (huge pages on large buffers, where a fresh 64 MB torch.empty buffer filled once cost
    30 ms more here), and recycled once nothing holds it."""
    return torch.from_numpy(kernels.host_array(shape, dtype))


class TorchOps:
    """:class:`hvd_gqsgd.core.TensorOps` for torch tensors (CPU or CUDA)."""

    def floor(self, x: Any) -> Any:
        return torch.floor(x)

    def clamp(self, x: Any, low: float, high: float) -> Any:
        return torch.clamp(x, low, high)

    def less(self, a: Any, b: Any) -> Any:
        return a < b

    def to_int64(self, x: Any) -> Any:
        return x.to(torch.int64)

    def pad_reshape(self, x: Any, rows: int, cols: int) -> Any:
        return torch.nn.functional.pad(x, (0, rows * cols - x.numel())).view(rows, cols)

    def column(self, x: Any, k: int) -> Any:
        return x[:, k]

    def stack_columns(self, cols: Sequence[Any], numel: int) -> Any:
        return torch.stack(list(cols), dim=1).reshape(-1)[:numel]

    def isfinite(self, x: Any) -> Any:
        return torch.isfinite(x)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return torch.where(cond, a, b)

    def bitand(self, x: Any, mask: int) -> Any:
        return torch.bitwise_and(x, mask)

    def rshift(self, x: Any, shift: int) -> Any:
        return torch.bitwise_right_shift(x, shift)
