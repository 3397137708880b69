"""The core's tensor primitives as torch ops, with no Horovod: :class:`TorchOps`
(:class:`hvd_gqsgd.core.TensorOps`, each method one torch call) and :class:`TorchLocal`, the
local (non-collective) half of the torch backend, which the Horovod adapter
(:mod:`hvd_gqsgd.torch`) extends with Horovod's collectives and the DDP and FSDP2 hooks
(:mod:`hvd_gqsgd.torch_dist`, which must not import Horovod) use as is.  No formula lives
here.  CPU tensors run the fused kernels (:mod:`hvd_gqsgd.kernels`); CUDA tensors (and CPU
with ``HVD_GQSGD_KERNELS=0``) the torch-ops path (:mod:`hvd_gqsgd.torch_generic`), whose
memory is bounded per chunk.

Host synchronisations on CUDA.  A round copies from the device to the host only what the
algorithm must read there, once per bucket, never per tensor or per element:

* the layout pair at the end of the exchanged scales (:meth:`TorchLocal.check_layout`:
  ranks that queued different tensors must fail, not sum them);
* the bucket's first probe (:meth:`TorchLocal.rescale_bucket`: the op's factor, checked);
* the bucket's other probes, together, when its last tensor is taken
  (:meth:`TorchLocal.take`);
* with ``hierarchical``, the node table (:meth:`TorchLocal.host_list`).

Tables that go the other way (segment sizes, part offsets) are copied to the device once per
layout and kept, since a copy from pageable host memory waits for the stream too.  The
DDP and FSDP2 hooks read nothing back at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import core, kernels
from . import torch_generic as generic

__all__ = ["FlatRows", "ProbeRows", "Rescaled", "TorchLocal", "TorchOps", "TwoStageSums",
           "host_empty"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PROBE_BLOCK = 64  # ProbeRows' first block
_FLAT_LAYOUTS = 64  # FlatRows kept at most (one per bucket layout)
# Larger buckets are built in recycled memory (host_empty), where a round's next bucket
# reuses the last one's buffer while it is still in cache: a buffer kept per bucket made the
# deep model's eight 8 MiB buckets (64 MB, out of cache) slower to fill and read
# (studies/engine_cpu.py), and it saves a call per tensor, which only many small tensors
# feel.
FLAT_ROWS_MAX_BYTES = 2 << 20
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def host_empty(shape: int | tuple[int, ...], dtype: type) -> torch.Tensor:
    """An uninitialised CPU tensor on :func:`hvd_gqsgd.kernels.host_array` memory: NumPy's
    (huge pages on large buffers, which torch.empty's do not get), and recycled once nothing
    holds it."""
    return torch.from_numpy(kernels.host_array(shape, dtype))


class ProbeRows:
    """Horovod's per-tensor probes of one value and device, kept from round to round.

    Horovod reduces each probe in place, so no two tensors of a round may share one; but a
    freshly built 2-element tensor per gradient tensor per step costs a many-tensor model
    about as much as Horovod's own fp16 cast adds (``benchmarks/small_tensors.py``:
    ``floorfresh`` against ``floor``).  So the probes are
    rows of blocks made once (``PROBE_BLOCK`` rows, then doubling); ``take`` hands out the
    next row, and ``refill``, once the round's results are all taken, writes the values back
    into the rows used (one copy per block), which the next round hands out again in the
    same order."""

    def __init__(self, values: Sequence[float], device: torch.device) -> None:
        self.template = torch.tensor(values, dtype=torch.float64, device=device)
        self.blocks: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.used = 0

    def take(self) -> torch.Tensor:
        if self.used == len(self.rows):
            block = self.template.repeat(max(PROBE_BLOCK, len(self.rows)), 1)
            self.blocks.append(block)
            self.rows.extend(block.unbind(0))
        row = self.rows[self.used]
        self.used += 1
        return row

    def refill(self) -> None:
        start = 0
        for block in self.blocks:
            if start >= self.used:
                break
            block.copy_(self.template.expand_as(block))
            start += block.shape[0]
        self.used = 0


class FlatRows:
    """Flat bucket buffers of one layout (the tensors' shapes and dtypes), kept from round to
    round, each with a view of it in every tensor's shape, so that filling one is a single
    ``torch._foreach_copy_``: building the flat buffer from the tensors afresh, one reshape
    per tensor and a ``torch.cat``, costs a 300-tensor bucket about twice this with its
    lookup.  Used like :class:`ProbeRows`: ``take`` fills and hands out the next buffer (two
    buckets of a round with one layout get two), ``reset`` once the round is over makes them
    all free."""

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        self.numels = [t.numel() for t in tensors]
        self.host = np.float64 if dtype == torch.float64 else np.float32
        self.rows: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.used = 0

    def take(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.used == len(self.rows):
            flat = host_empty(sum(self.numels), self.host)
            self.rows.append((flat, [v.view_as(t) for v, t in zip(flat.split(self.numels),
                                                                  tensors)]))
        flat, views = self.rows[self.used]
        self.used += 1
        with torch.no_grad():
            torch._foreach_copy_(views, list(tensors))  # casts to the buffer's dtype
        return flat

    def reset(self) -> None:
        self.used = 0


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

    def rshift(self, x: Any, shift: Any) -> Any:
        return torch.bitwise_right_shift(x, shift)

    def copy(self, x: Any) -> Any:
        return x.clone()

    def row_index(self, starts: Sequence[int], width: int, like: Any) -> Any:
        first = torch.tensor(list(starts), dtype=torch.int64, device=like.device)
        return first[:, None] + torch.arange(width, dtype=torch.int64, device=like.device)

    def gather_rows(self, x: Any, index: Any) -> Any:
        return x[index]

    def scatter_rows(self, out: Any, index: Any, rows: Any) -> Any:
        out[index] = rows  # out is rotate's own copy: written in place
        return out

    def butterfly(self, rows: Any, h: int) -> Any:
        pairs = rows.view(rows.shape[0], -1, 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        return torch.stack((a + b, a - b), dim=2).view(rows.shape)

    def bitxor(self, x: Any, y: Any) -> Any:
        return torch.bitwise_xor(x, y)

    def cast_like(self, x: Any, like: Any) -> Any:
        return x.to(like.dtype)


@dataclass
class TwoStageSums:
    """A two-stage bucket's gathered messages, ready to decode (:meth:`TorchLocal.messages`):
    the kernels' view of them (CPU) or every element's stage-2 code (generic path), and the
    value of one code per part (float64, ``core.stage_two_steps``)."""

    layout: core.MessageLayout
    steps: torch.Tensor
    fused: kernels.Messages | None = None
    gathered: torch.Tensor | None = None  # torch-ops path: the gathered words themselves


@dataclass
class Rescaled:
    """A decoded bucket (:meth:`TorchLocal.rescale_bucket`), times the op's factor that its
    first tensor's probe gave: each tensor's view of it in the tensor's shape, by the
    tensor's offset."""

    parts: dict[int, torch.Tensor]
    factor: float
    probe: torch.Tensor  # that probe, checked already (core.check_probe)
    taken: list[torch.Tensor]  # the other tensors' probes, checked once all are taken


class TorchLocal(TorchOps):
    """The local half of :class:`hvd_gqsgd.engine.Backend` for torch tensors (CPU or CUDA):
    everything but the collectives.

    ``keys``: the rank's noise-key stream for the fused kernels (default
    ``core.NoiseKeys(seed)``; the DDP hook passes its checkpointed one)."""

    def __init__(self, seed: int | None, keys: Any = None) -> None:
        self._seed = seed
        # fused path: counter-based noise, keyed per bucket (core.NoiseKeys or alike)
        self._keys = core.NoiseKeys(seed) if keys is None else keys
        self._probes: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}
        self._rows: dict[tuple[tuple[float, ...], torch.device], ProbeRows] = {}
        self._flats: dict[tuple[Any, ...], FlatRows] = {}
        # torch-ops path: per-segment tables on the device, made once per layout
        self._tables = generic.Segments()
        self._tails: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}

    def is_compressible(self, t: Any) -> bool:
        return t.dtype in _FLOATS and t.numel() > 0

    def dtype_name(self, t: Any) -> str:
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
        return name

    def numel(self, t: Any) -> int:
        return t.numel()

    def nbytes(self, t: Any) -> int:
        return t.nbytes

    def probe(self, values: Sequence[float], like: Any) -> Any:
        # A fresh tensor every time (a collective may reduce it in place), cloned from a
        # cached one: cloning costs a fifth of building a tensor from a list.
        key = (tuple(values), like.device)
        template = self._probes.get(key)
        if template is None:
            template = torch.tensor(values, dtype=torch.float64, device=like.device)
            self._probes[key] = template
        return template.clone()

    def round_probe(self, values: Sequence[float], like: Any) -> Any:
        key = (tuple(values), like.device)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = ProbeRows(values, like.device)
        return rows.take()

    def end_round(self, clean: bool) -> None:
        if clean:
            for rows in self._rows.values():
                rows.refill()
            for flats in self._flats.values():
                flats.reset()
        else:  # some may still be in a collective: never hand those out again
            self._rows.clear()
            self._flats.clear()

    def probe_factor(self, reduced: Any, world_size: int) -> Any:
        return core.check_probe(reduced.tolist(), world_size)

    def local_norms(self, tensors: Sequence[Any] | None, flat: Any, counts: Sequence[int],
                    norm: str, extra: Sequence[float]) -> Any:
        tail = self._tail(extra, flat.device)
        if self._fused(flat):
            vec = torch.from_numpy(kernels.segment_norms(flat.numpy(), counts, norm))
            return torch.cat([vec, tail])
        table = self._tables.table(counts, flat.device)
        return torch.cat([generic.segment_norms(flat, counts, table, norm), tail])

    def _tail(self, extra: Sequence[float], device: torch.device) -> torch.Tensor:
        """``extra`` as a float64 tensor on ``device``, made once per value: a host copy per
        call would wait for the CUDA stream."""
        key = (tuple(extra), device)
        tail = self._tails.get(key)
        if tail is None:
            if len(self._tails) >= _FLAT_LAYOUTS:
                self._tails.clear()
            tail = self._tails[key] = torch.tensor(extra, dtype=torch.float64, device=device)
        return tail

    def check_layout(self, reduced: Any) -> Any:
        high, neg_low = reduced[-2:].tolist()
        if high != -neg_low:
            raise RuntimeError(
                "GlobalQSGD: ranks compressed different tensors (sizes or dtypes differ at the "
                "same position), or, with rotation, are at different rounds (a rank that "
                "Horovod elastic added between steps). Every rank must call compress() on the "
                "same tensors in the same order, e.g. the same model with the same parameters "
                "requiring gradients."
            )
        return reduced[:-2]

    def flat_concat(self, tensors: Sequence[Any]) -> Any:
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        if len(tensors) == 1:  # no copy when already flat and in dtype
            return tensors[0].detach().reshape(-1).to(dtype)
        parts = [t.reshape(-1) for t in tensors]  # one call per tensor (a deep model has hundreds)
        with torch.no_grad():
            if tensors[0].device.type == "cpu":  # recycled memory: no page faults every step
                total = sum(p.numel() for p in parts)
                out = host_empty(total, np.float64 if dtype == torch.float64 else np.float32)
                return torch.cat(parts, out=out)  # casts each part to out's dtype
            flat = torch.cat(parts)  # promotes mixed dtypes
        return flat if flat.dtype == dtype else flat.to(dtype)

    def round_flat(self, tensors: Sequence[Any]) -> Any:
        """:meth:`flat_concat` into a buffer of :class:`FlatRows` for a CPU bucket of several
        tensors and at most ``FLAT_ROWS_MAX_BYTES`` of input; the others as flat_concat."""
        if (len(tensors) == 1 or tensors[0].device.type != "cpu"
                or sum(t.nbytes for t in tensors) > FLAT_ROWS_MAX_BYTES):
            return self.flat_concat(tensors)
        key = tuple((t.shape, t.dtype) for t in tensors)
        flats = self._flats.get(key)
        if flats is None:
            if len(self._flats) >= _FLAT_LAYOUTS:  # layouts that never repeat: keep none
                self._flats.clear()
            wide = any(t.dtype == torch.float64 for t in tensors)
            flats = self._flats[key] = FlatRows(tensors, torch.float64 if wide else torch.float32)
        return flats.take(tensors)

    def encode(self, flat: Any, mult: Any, counts: Sequence[int], n_levels: int, bits: int,
               rank: int, after: Any = None, pad_to: int | None = None,
               out: Any = None) -> Any:
        """Quantize and pack ``flat`` with one key of the rank's noise stream; ``out``: the
        int64 words to write (at least ``packed_words`` long, the rest zeroed), else new
        ones, ``pad_to`` long when given."""
        # eager: runs in call order anyway, so ``after`` needs no dependency here
        size = core.packed_words(flat.numel(), bits)
        if self._fused(flat):  # a longer buffer gets zero codes, hence zero words, at its end
            words = host_empty(pad_to or size, np.int64) if out is None else out
            kernels.quantize_pack(flat.numpy(), counts, mult.numpy(), n_levels, bits,
                                  self._keys.next(rank), words.numpy())
            return words
        words = out if out is not None else torch.empty(pad_to or size, dtype=torch.int64,
                                                        device=flat.device)
        generic.encode(self, flat, mult.to(flat.dtype), counts,
                       self._tables.table(counts, flat.device), n_levels, bits,
                       self._uniform(flat.device, rank), words)
        return words

    def unpack_scaled(self, words: Any, bits: int, out: Any, counts: Sequence[int],
                      scales: Any) -> None:
        """The lane sums of summed ``words`` (which may be rewritten) times their segment's
        entry of ``scales`` (``counts``: elements per segment; ``out``'s dtype) into the flat
        float32/64 ``out``: each product rounded once, as the kernels compute it."""
        if self._fused(words):
            kernels.Summed(words.numpy(), bits).unpack_bucket(out.numpy(), counts,
                                                              scales.numpy())
            return
        generic.unpack_scaled(self, words, bits, out, counts,
                              self._tables.table(counts, out.device), scales)

    def auto_chunk_bytes(self, flat: Any) -> int:
        # One Sum allreduce per bucket: chunks were no faster (docs/BENCHMARKS.md),
        # as the summed words are joined and decoded only after the last chunk arrives.
        return 0

    def decoder(self, words: Any, bits: int, total: int) -> Any:
        if isinstance(words, list):  # a bucket sent in chunks: decoded once all are back
            words = self.concat_words(words)
        if self._fused(words):
            return kernels.Summed(words.numpy(), bits)  # words are ours: rewritten in place
        return generic.LaneSums(self, words, bits, total)

    def decode(self, state: Any, offset: int, like: Any, scale: Any, block: int) -> Any:
        compute = torch.float64 if like.dtype == torch.float64 else torch.float32
        numel = like.numel()
        if isinstance(state, kernels.Summed):
            # allocated in its final shape: no reshape per tensor on the way out
            out = host_empty(tuple(like.shape),
                              np.float64 if compute == torch.float64 else np.float32)
            state.unpack_scale(offset, out.numpy().reshape(-1), scale.numpy(), block)
            return out.to(like.dtype)
        out = state[offset:offset + numel].to(compute)  # this tensor's lanes only
        if block:  # in place, block by block: element i times scale[i // block]
            full = numel // block
            out[:full * block].view(full, block).mul_(scale[:full, None].to(compute))
            if full * block < numel:
                out[full * block:].mul_(scale[full].to(compute))
        else:
            out = out * scale
        return out.to(like.dtype).view(like.shape)

    def rescale_bucket(self, state: Any, steps: Any, counts: Sequence[int],
                       likes: Sequence[Any], reduced_probe: Any, world_size: int,
                       rotation: tuple[int, int] | None = None) -> Rescaled:
        """The whole bucket, flat, in one call: every segment's lane sums times its step
        times the factor of this (the bucket's first) probe, in float64 when one of the
        bucket's tensors is float64, else float32; with ``rotation`` rotated back."""
        factor = core.check_probe(reduced_probe.tolist(), world_size)  # a host copy per bucket
        wide = any(t.dtype == torch.float64 for t in likes)
        compute, host = (torch.float64, np.float64) if wide else (torch.float32, np.float32)
        total, device = sum(counts), likes[0].device
        if isinstance(state, kernels.Summed):  # the inverse rotation fused into the decode
            out = host_empty(total, host)
            state.unpack_bucket(out.numpy(), counts, (steps * factor).numpy(),
                                rotation=rotation)
        elif isinstance(state, TwoStageSums):  # here too, on CPU
            out = self.decode_into(state, host_empty(total, host) if state.fused is not None
                                   else torch.empty(total, dtype=compute, device=device),
                                   factor, rotation=rotation)
        else:
            out = torch.empty(total, dtype=compute, device=device)
            generic.unpack_scaled(self, state.words, state.bits, out, counts,
                                  self._tables.table(counts, device),
                                  (steps * factor).to(compute))
            if rotation is not None:
                out = self.unrotate(out, counts, *rotation)
        # every tensor's view in its shape, made here for the whole bucket
        numels = [t.numel() for t in likes]
        views = [v.view_as(t) for v, t in zip(out.split(numels), likes)]
        return Rescaled(dict(zip(itertools.accumulate(numels, initial=0), views)), factor,
                        reduced_probe, [])

    def rotate_norms(self, flat: Any, counts: Sequence[int], block: int, key: int, norm: str,
                     extra: Sequence[float], in_place: bool = False) -> tuple[Any, Any]:
        """``flat`` rotated (:func:`hvd_gqsgd.core.rotate`) into a new buffer, or into
        ``flat`` itself with ``in_place`` (only for a buffer of the caller's own), and the
        local norms of the result as :meth:`local_norms` gives them; one fused pass on
        CPU."""
        if self._fused(flat):
            out = flat if in_place else host_empty(flat.numel(), flat.numpy().dtype)
            vec = kernels.rotate_norms(flat.numpy(), counts, block, key, norm,
                                       out.numpy())
            return out, torch.cat([torch.from_numpy(vec), self._tail(extra, flat.device)])
        rotated = core.rotate(self, flat, counts, block, key)
        if in_place:
            flat.copy_(rotated)
            rotated = flat
        return rotated, self.local_norms(None, rotated, counts, norm, extra)

    def unrotate(self, x: Any, counts: Sequence[int], block: int, key: int,
                 start: int = 0) -> Any:
        """The inverse rotation of the decoded (flat, float32/64) ``x``, which is ours:
        in place on CPU, a new tensor on the torch-ops path.  ``start``: the bucket element
        of ``x[0]``."""
        if self._fused(x):
            kernels.unrotate(x.numpy(), counts, block, key, start)
            return x
        return core.rotate(self, x, counts, block, key, start, inverse=True)

    def take(self, rescaled: Rescaled, offset: int, like: Any, reduced_probe: Any,
             world_size: int) -> Any:
        """``like``'s elements of the decoded bucket: a view in its shape (a copy when its
        dtype differs).  Its probe is kept, not read: once every tensor of the bucket is
        taken, all probes are checked against the first one at once (one host copy per
        bucket, where a copy per tensor would each wait for CUDA), and a bucket whose
        tensors were reduced with different ops or scale factors raises ``ValueError``."""
        part = rescaled.parts[offset]
        if reduced_probe is not rescaled.probe:
            rescaled.taken.append(reduced_probe)
        if len(rescaled.taken) == len(rescaled.parts) - 1 and rescaled.taken:
            others = torch.stack(rescaled.taken)
            if not bool((others == rescaled.probe).all()):  # a host copy per bucket
                first = rescaled.probe.tolist()
                bad = next(p for p in others.tolist() if p != first)
                core.check_probe(bad, world_size)  # ValueError naming the ops that work
                raise ValueError(
                    f"GlobalQSGD: the tensors of one bucket were reduced with different scale "
                    f"factors (probes {first} and {bad}); give tensors reduced differently "
                    "compressors of their own")
        return part if part.dtype == like.dtype else part.to(like.dtype)

    def _fused(self, t: Any) -> bool:
        """The numba kernels serve CPU tensors; CUDA (and CPU without numba) use core.encode."""
        return t.device.type == "cpu" and kernels.available()

    def _uniform(self, device: torch.device, rank: int) -> Any:
        """Torch-ops path: the uniforms of one encode, keyed by the next key of the rank's
        noise stream and drawn chunk by chunk (``uniform(start, count, like)``): the fused
        path's counter-based noise, so both paths round identically."""
        key = self._keys.next(rank)

        def uniform(start: int, count: int, like: Any) -> Any:
            return generic.noise(self, key, start, count, like)

        return uniform

    def stable_names(self) -> bool:
        return True

    # --- hierarchical (hvd_gqsgd.hierarchical), local steps
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

    # --- two-stage (hvd_gqsgd.two_stage)
    def lane_sums(self, words: Any, bits: int, numel: int) -> Any:
        if self._fused(words):
            out = host_empty(numel, np.float64)
            kernels.lane_sums(words.numpy(), bits, out.numpy())  # the words are ours
            return out
        return generic.LaneSums(self, words, bits, numel)

    def part_max(self, sums: Any, counts: Sequence[int]) -> Any:
        if self._fused(sums):
            return torch.from_numpy(kernels.segment_norms(sums.numpy(), counts, "max"))
        return generic.part_max(sums, counts, self._tables.table(counts, sums.device))

    def message(self, codes: Any, part_max: Any, code_words: int, slots: int) -> Any:
        out = torch.zeros(code_words + slots, dtype=torch.int64, device=part_max.device)
        if codes is not None:
            out[:code_words] = codes
        if part_max.numel():  # none past the bucket's end (there part_max is the empty sums)
            out[code_words:code_words + part_max.numel()] = part_max.to(torch.int64)  # exact
        return out

    def messages(self, gathered: Any, layout: core.MessageLayout, steps1: Any) -> TwoStageSums:
        device = gathered.device
        segments = _derived(layout, ("segments", device),
                            lambda: torch.tensor(layout.segments, device=device))
        if self._fused(gathered):
            fused = kernels.Messages(gathered.numpy(), layout)
            part_max = torch.from_numpy(fused.part_max())
            return TwoStageSums(layout, core.stage_two_steps(part_max, steps1[segments],
                                                             layout.bits), fused=fused)
        slots = _derived(layout, ("slots", device), lambda: torch.tensor(layout.slots,
                                                                         device=device))
        part_max = gathered[slots].to(torch.float64)
        return TwoStageSums(layout, core.stage_two_steps(part_max, steps1[segments],
                                                         layout.bits), gathered=gathered)

    def decode_into(self, state: TwoStageSums, out: Any, factor: float, p0: int = 0,
                    p1: int | None = None, rotation: tuple[int, int] | None = None) -> Any:
        """Parts ``p0 .. p1`` (default: all) of a two-stage bucket into the flat float32/64
        ``out``, which they fill in order; returns the decoded tensor.  ``rotation=(block,
        key)``: rotated back as well, fused into the decode on CPU (the result is ``out``);
        on the torch-ops path the result is a new tensor (:meth:`unrotate`).  A window that
        cuts a full block is refused (``ValueError``)."""
        layout = state.layout
        p1 = len(layout.counts) if p1 is None else p1
        scale = (state.steps[p0:p1] * factor).to(out.dtype)
        start = sum(layout.counts[:p0])
        if state.fused is not None:
            state.fused.unpack_parts(p0, p1, out.numpy(), scale.numpy(), start, rotation)
            return out
        assert state.gathered is not None
        device = out.device

        def tables(name: str) -> torch.Tensor:
            if name == "counts":
                return _derived(layout, ("counts", device),
                                lambda: torch.tensor(layout.counts, device=device))
            starts = itertools.accumulate(layout.counts, initial=0)
            return _derived(layout, ("shift", device), lambda: torch.tensor(
                [lane - start for lane, start in zip(layout.lanes, starts)], device=device))

        generic.decode_parts(state.gathered, layout, tables, scale, p0, p1, out)
        if rotation is None:
            return out
        block, _ = rotation
        lo, hi, _ = kernels.window_segments(kernels.segment_counts(layout), start,
                                            out.numel(), block)
        return self.unrotate(out, (hi - lo).tolist(), *rotation, start=start)


def _derived(layout: core.MessageLayout, key: Any, make: Any) -> Any:
    """``layout.derived[key]``, made once (per-part index tensors on one device)."""
    value = layout.derived.get(key)
    if value is None:
        value = layout.derived[key] = make()
    return value
