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
import numpy as np
import torch

from . import core, kernels
from .compressor import GlobalQSGD
from .qprsgd import QPRSGD
from .torch_ops import TorchOps, host_empty

__all__ = ["GlobalQSGD", "QPRSGD", "TorchBackend"]


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TorchBackend(TorchOps):
    """:class:`hvd_gqsgd.engine.Backend` for PyTorch tensors (CPU or CUDA)."""

    # Each tensor is rescaled with its own probe: a torch bucket may hold tensors that
    # separate allreduce_async calls reduce with different ops.
    rescales_buckets = False

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # generic path, per device
        self._keys = core.NoiseKeys(seed)  # fused path: counter-based noise, keyed per bucket
        self._probes: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}

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
        # A fresh tensor every time (Horovod reduces it in place), cloned from a cached one:
        # cloning costs a fifth of building a tensor from a list, once per gradient tensor.
        key = (tuple(values), like.device)
        template = self._probes.get(key)
        if template is None:
            template = torch.tensor(values, dtype=torch.float64, device=like.device)
            self._probes[key] = template
        return template.clone()

    def probe_factor(self, reduced: Any, world_size: int) -> Any:
        return core.check_probe(reduced.tolist(), world_size)

    def local_norms(self, tensors: Sequence[Any], flat: Any, counts: Sequence[int], norm: str,
                    extra: Sequence[float]) -> Any:
        tail = torch.tensor(extra, dtype=torch.float64, device=flat.device)
        if self._fused(flat):
            vec = torch.from_numpy(kernels.segment_norms(flat.numpy(), np.asarray(counts), norm))
            return torch.cat([vec, tail])
        parts = list(tensors) if len(counts) == len(tensors) else torch.split(flat, list(counts))
        norms: Sequence[torch.Tensor]
        if norm == "max":
            norms = torch._foreach_norm(list(parts), float("inf"))
        else:  # fp64: a finite fp16/fp32 gradient must not overflow its own L2 norm
            norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in parts]
        vec = torch.stack([n.to(torch.float64) for n in norms])
        # MAX drops NaN in some reductions (a > b is false); +inf always wins the MAX.
        return torch.cat([torch.nan_to_num(vec, nan=float("inf")), tail])

    def check_layout(self, reduced: Any) -> Any:
        high, neg_low = reduced[-2:].tolist()
        if high != -neg_low:
            raise RuntimeError(
                "GlobalQSGD: ranks compressed different tensors (sizes or dtypes differ at the "
                "same position). Every rank must call compress() on the same tensors in the same "
                "order, e.g. the same model with the same parameters requiring gradients."
            )
        return reduced[:-2]

    def flat_concat(self, tensors: Sequence[Any]) -> Any:
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        if len(tensors) == 1:  # no copy when already flat and in dtype
            return tensors[0].detach().reshape(-1).to(dtype)
        return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])

    def encode(self, flat: Any, mult: Any, counts: Sequence[int], n_levels: int, bits: int,
               rank: int, after: Any = None) -> Any:  # eager: runs in call order anyway
        if self._fused(flat):
            words = host_empty(core.packed_words(flat.numel(), bits), np.int64)
            kernels.quantize_pack(flat.numpy(), np.asarray(counts), mult.numpy(), n_levels, bits,
                                  self._keys.next(rank), words.numpy())
            return words
        counts_t = torch.tensor(list(counts), device=flat.device)
        per_element = torch.repeat_interleave(mult.to(flat.dtype), counts_t,
                                              output_size=flat.numel())
        return core.encode(self, flat, per_element, self._uniform(flat, rank), n_levels, bits)

    def auto_chunk_bytes(self, flat: Any) -> int:
        # One Sum allreduce per bucket: chunks measured no faster here (docs/BENCHMARKS.md),
        # as the summed words are joined and decoded only after the last chunk arrives.
        return 0

    def decoder(self, words: Any, bits: int, total: int) -> Any:
        if self._fused(words):
            return kernels.Summed(words.numpy(), bits)  # words are ours: rewritten in place
        return core.unpack(self, words, bits, total)

    def decode(self, state: Any, offset: int, like: Any, scale: Any, block: int) -> Any:
        compute = torch.float64 if like.dtype == torch.float64 else torch.float32
        numel = like.numel()
        if isinstance(state, kernels.Summed):
            # allocated in its final shape: no reshape per tensor on the way out
            out = host_empty(tuple(like.shape),
                              np.float64 if compute == torch.float64 else np.float32)
            state.unpack_scale(offset, out.numpy().reshape(-1), scale.numpy(), block)
            return out.to(like.dtype)
        out = state[offset:offset + numel].to(compute)
        if block:  # in place, block by block: element i times scale[i // block]
            full = numel // block
            out[:full * block].view(full, block).mul_(scale[:full, None].to(compute))
            if full * block < numel:
                out[full * block:].mul_(scale[full].to(compute))
        else:
            out = out * scale
        return out.to(like.dtype).view(like.shape)

    def _fused(self, t: Any) -> bool:
        """The numba kernels serve CPU tensors; CUDA (and CPU without numba) use core.encode."""
        return t.device.type == "cpu" and kernels.available()

    def _uniform(self, like: Any, rank: int) -> Any:
        gen = self._generators.get(like.device)
        if gen is None:
            gen = torch.Generator(device=like.device)
            gen.manual_seed(core.rank_seed(self._seed, rank))
            self._generators[like.device] = gen
        return torch.rand(like.shape, dtype=like.dtype, device=like.device, generator=gen)

    def stable_names(self) -> bool:
        return True

    # --- Horovod
    def global_process_set(self) -> Any:
        return hvd.global_process_set

    def allreduce_max(self, vec: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce(vec, op=hvd.Max, name=name, process_set=process_set)

    def allreduce_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        # in place: the words are ours, and a second buffer would cost another allocation
        return hvd.allreduce_async_(words, op=hvd.Sum, name=name, process_set=process_set)

    def allgather_async(self, tensor: Any, name: str, process_set: Any) -> Any:
        return hvd.allgather_async(tensor, name=name, process_set=process_set)

    def wait(self, handle: Any) -> Any:
        return hvd.synchronize(handle)

    # --- hierarchical (hvd_gqsgd.hierarchical)
    def topology(self) -> tuple[int, int, int, int]:
        return hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()

    def alltoall(self, t: Any, splits: Sequence[int], name: str, process_set: Any) -> Any:
        handle = hvd.alltoall_async(t, torch.tensor(list(splits), dtype=torch.int32), name=name,
                                    process_set=process_set)
        return hvd.synchronize(handle)[0]  # (output, received splits)

    def placed(self, part: Any, start: int, length: int) -> Any:
        out = part.new_zeros(length)  # zeros around part, which lands at [start, start + len)
        out[start:start + part.numel()] = part
        return out

    def sum_rows(self, x: Any, rows: int) -> Any:  # floats add in float64, integers in int64
        return x.view(rows, -1).sum(0, dtype=torch.float64 if x.is_floating_point() else None)

    def host_list(self, t: Any) -> list[float]:
        return t.tolist()

    def concat_words(self, words: Sequence[Any]) -> Any:
        if words[0].device.type == "cpu":
            out = host_empty(sum(w.numel() for w in words), np.int64)
            return torch.cat(list(words), out=out)
        return torch.cat(list(words))
