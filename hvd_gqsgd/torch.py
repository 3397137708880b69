"""PyTorch adapter: translates :mod:`hvd_gqsgd.core` primitives into torch ops and Horovod's
torch collectives.  No formula lives here.

Importing this module imports ``torch`` and ``horovod.torch``.  Do not import it in a
TensorFlow program (importing ``horovod.torch`` after ``horovod.tensorflow`` is initialised
breaks TensorFlow's global process set); ``hvd_gqsgd.GlobalQSGD`` loads it only when a torch
tensor arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import horovod.torch as hvd
import torch

from . import core
from .compressor import GlobalQSGD

__all__ = ["GlobalQSGD", "TorchBackend"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TorchBackend:
    """:class:`hvd_gqsgd.engine.Backend` for PyTorch tensors (CPU or CUDA)."""

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # one noise stream per device

    # --- core.TensorOps
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

    # --- tensors
    def is_compressible(self, t: Any) -> bool:
        return t.dtype in _FLOATS and t.numel() > 0

    def dtype_name(self, t: Any) -> str:
        return str(t.dtype).replace("torch.", "")

    def numel(self, t: Any) -> int:
        return t.numel()

    def nbytes(self, t: Any) -> int:
        return t.numel() * t.element_size()

    def probe(self, values: Sequence[float], like: Any) -> Any:
        return torch.tensor(values, dtype=torch.float64, device=like.device)

    def probe_factor(self, reduced: Any, world_size: int) -> Any:
        return core.check_probe(reduced.tolist(), world_size)

    def local_norms(self, tensors: Sequence[Any], norm: str, extra: Sequence[float]) -> Any:
        norms: Sequence[torch.Tensor]
        if norm == "max":
            norms = torch._foreach_norm(list(tensors), float("inf"))
        else:  # fp64: a finite fp16/fp32 gradient must not overflow its own L2 norm
            norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
        vec = torch.stack([n.to(torch.float64) for n in norms])
        # MAX drops NaN in some reductions (a > b is false); +inf always wins the MAX.
        vec = torch.nan_to_num(vec, nan=float("inf"))
        return torch.cat([vec, torch.tensor(extra, dtype=torch.float64, device=vec.device)])

    def check_layout(self, reduced: Any) -> Any:
        high, neg_low = reduced[-2:].tolist()
        if high != -neg_low:
            raise RuntimeError(
                "GlobalQSGD: ranks compressed different tensors (sizes or dtypes differ at the "
                "same position). Every rank must call compress() on the same tensors in the same "
                "order, e.g. the same model with the same parameters requiring gradients."
            )
        return reduced[:-2]

    def repeat(self, per_tensor: Any, counts: Sequence[int], like: Any) -> Any:
        counts_t = torch.tensor(list(counts), device=like.device)
        return torch.repeat_interleave(per_tensor.to(like.dtype), counts_t,
                                       output_size=like.numel())

    def flat_concat(self, tensors: Sequence[Any]) -> Any:
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        return torch.cat([t.reshape(-1).to(dtype) for t in tensors])

    def uniform(self, like: Any, rank: int) -> Any:
        gen = self._generators.get(like.device)
        if gen is None:
            gen = torch.Generator(device=like.device)
            gen.manual_seed(core.rank_seed(self._seed, rank))
            self._generators[like.device] = gen
        return torch.rand(like.shape, dtype=like.dtype, device=like.device, generator=gen)

    def segment(self, sums: Any, offset: int, like: Any) -> Any:
        compute = torch.float64 if like.dtype == torch.float64 else torch.float32
        return sums[offset:offset + like.numel()].to(compute)

    def finish(self, values: Any, scale: Any, like: Any) -> Any:
        return (values * scale).to(like.dtype).view(like.shape)

    def stable_names(self) -> bool:
        return True

    # --- Horovod
    def world(self, process_set: Any) -> tuple[int, int, Any]:
        pset = hvd.global_process_set if process_set is None else process_set
        if not pset.included():
            raise ValueError(f"this rank is not in GlobalQSGD's process set {pset}")
        return pset.rank(), pset.size(), pset

    def allreduce_max(self, vec: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce(vec, op=hvd.Max, name=name, process_set=process_set)

    def allreduce_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce_async(words, op=hvd.Sum, name=name, process_set=process_set)

    def wait(self, handle: Any) -> Any:
        return hvd.synchronize(handle)
