"""The torch-ops path of the core's steps, for tensors the numba kernels do not serve (CUDA,
or CPU with ``HVD_GQSGD_KERNELS=0``), with memory bounded per chunk.

Each step walks its buffer in chunks of at most :data:`CHUNK` elements, cut at word
boundaries (:func:`hvd_gqsgd.core.chunk_plan`), so that the per-element temporaries of
:func:`hvd_gqsgd.core.encode` and :func:`hvd_gqsgd.core.unpack` (the multiplier, the
uniform, the codes, the unpacked lanes) exist for one chunk at a time, never for a whole
bucket.  What outlives a call is per segment at most (:class:`Segments`: one int64 per scale
block, 1/1024 of the elements at 8 bits' default block), never per element.

No device-to-host copy happens here: the per-segment tables go to the device once per
layout (a host-to-device copy from pageable memory waits for the stream, so doing it per
call would be a hidden synchronisation on CUDA), and every index is computed on the device.

Bit for bit, these steps compute what :mod:`hvd_gqsgd.core` defines: chunks change where
the work is cut, not a single value, given the same uniforms.  No formula lives here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import core

__all__ = ["CHUNK", "LaneSums", "Segments", "decode_parts", "encode", "lanes_at", "noise",
           "part_max", "segment_norms", "unpack_scaled"]

CHUNK = 1 << 18  # elements per chunk: about 10 MB of temporaries at 40 bytes an element
_TABLES = 64  # layouts whose device tables are kept


class Segments:
    """Device copies of per-segment (or per-part) integer tables, made once per layout and
    device and kept for the last ``_TABLES`` layouts.  A layout is known by its Python
    sequence object (the engine and the hooks keep one per layout), which the cache holds so
    that its ``id`` cannot be reused while cached."""

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple[int, str, torch.device], tuple[Any, torch.Tensor]] = (
            OrderedDict())

    def table(self, values: Sequence[int], device: torch.device, name: str = "") -> torch.Tensor:
        key = (id(values), name, device)
        hit = self._tables.get(key)
        if hit is not None and hit[0] is values:
            self._tables.move_to_end(key)
            return hit[1]
        table = torch.tensor(list(values), dtype=torch.int64, device=device)
        self._tables[key] = (values, table)
        if len(self._tables) > _TABLES:
            self._tables.popitem(last=False)
        return table


def per_element(values: torch.Tensor, table: torch.Tensor, counts: Sequence[int],
                c: core.Chunk) -> torch.Tensor:
    """``values`` of segments ``c.first:c.stop`` (one each), repeated over the chunk's
    elements.  ``table`` is ``counts`` (the whole layout's segment sizes) on the device; the
    chunk's first and last segments, when the chunk cuts them (``c.counts``), get their cut
    sizes written on the device, with no host copy."""
    cut = table[c.first:c.stop]
    if c.counts[0] != counts[c.first] or c.counts[-1] != counts[c.stop - 1]:
        cut = cut.clone()
        cut[0] = c.counts[0]
        cut[-1] = c.counts[-1]
    return torch.repeat_interleave(values[c.first:c.stop], cut, output_size=c.hi - c.lo)


def chunks(counts: Sequence[int], bits: int) -> list[core.Chunk]:
    """The chunks of a buffer with segments of ``counts`` elements: at most :data:`CHUNK`
    elements each, starting at word boundaries of ``bits``-wide lanes."""
    k = core.lanes_per_word(bits)
    return core.chunk_plan(counts, bits, max(1, CHUNK // k) * 8)


def noise(ops: Any, key: int, start: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """The uniforms that the kernels draw for elements ``start .. start + count`` of a piece
    keyed by ``key`` (:func:`hvd_gqsgd.core.uniforms`), in ``like``'s dtype on its device:
    the torch-ops path rounds exactly as the fused path does, whatever the chunks."""
    index = torch.arange(start, start + count, dtype=torch.int64, device=like.device)
    return core.uniforms(ops, key, index, like)


def encode(ops: Any, flat: Any, mult: torch.Tensor, counts: Sequence[int],
           table: torch.Tensor, n_levels: int, bits: int,
           uniform: Callable[[int, int, Any], torch.Tensor], out: torch.Tensor) -> None:
    """:func:`hvd_gqsgd.core.encode` of ``flat`` (a tensor, or :class:`LaneSums`) into
    ``out`` (int64, at least ``packed_words`` long; the rest is zeroed), chunk by chunk.
    ``mult``: L/s per segment in ``flat``'s dtype; ``table``: the segments' counts on the
    device; ``uniform(start, count, like)``: the uniforms of elements ``start ..
    start + count`` of the piece, in ``like``'s dtype."""
    k = core.lanes_per_word(bits)
    size = core.packed_words(flat.shape[0], bits)
    for c in chunks(counts, bits):
        part = flat[c.lo:c.hi]
        words = core.encode(ops, part, per_element(mult, table, counts, c),
                            uniform(c.lo, c.hi - c.lo, part), n_levels, bits)
        out[c.lo // k:c.lo // k + words.shape[0]] = words
    out[size:] = 0


def unpack_scaled(ops: Any, words: torch.Tensor, bits: int, out: torch.Tensor,
                  counts: Sequence[int], table: torch.Tensor, scales: torch.Tensor) -> None:
    """The lane sums of summed ``words`` times their segment's entry of ``scales`` (in
    ``out``'s dtype) into the flat ``out``, chunk by chunk: ``lane * scale`` rounded once,
    as the kernels compute it."""
    k = core.lanes_per_word(bits)
    for c in chunks(counts, bits):
        n = c.hi - c.lo
        sums = core.unpack(ops, words[c.lo // k:c.lo // k + core.packed_words(n, bits)], bits, n)
        torch.mul(sums.to(out.dtype), per_element(scales, table, counts, c),
                  out=out[c.lo:c.hi])


def lanes_at(words: torch.Tensor, positions: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 lane values at lane indices ``positions`` of (unsummed or summed) signed-digit
    words whose every lane lies in ``(-2**(bits-1), 2**(bits-1))``: adding the offset word
    ``H = sum_k 2**(bits-1) * 2**(bits k)`` makes every lane a plain bit field (the kernels'
    ``_unpack_scale`` trick), which a shift and a mask read on its own."""
    k = core.lanes_per_word(bits)
    half = 1 << (bits - 1)
    offset = sum(half << (bits * j) for j in range(k))
    offset -= (offset >> 63) << 64  # the same 64 bits as a signed int64
    u = words[torch.div(positions, k, rounding_mode="floor")] + offset  # wraps: fine
    field = torch.bitwise_right_shift(u, (positions % k) * bits) & ((1 << bits) - 1)
    return field - half


class LaneSums:
    """A shard's exact lane sums (float64, exact below 2**53), unpacked chunk by chunk on
    demand instead of whole: slicing ``[lo:hi]`` gives elements ``lo .. hi``.  What
    ``TorchLocal.lane_sums`` returns on the torch-ops path for two-stage's requantize."""

    dtype = torch.float64

    def __init__(self, ops: Any, words: torch.Tensor, bits: int, numel: int) -> None:
        self.ops, self.words, self.bits = ops, words, bits
        self.shape = (numel,)
        self.device = words.device

    def numel(self) -> int:
        return self.shape[0]

    def __getitem__(self, span: slice) -> torch.Tensor:
        lo, hi, _ = span.indices(self.shape[0])
        k = core.lanes_per_word(self.bits)
        first = lo // k
        sums = core.unpack(self.ops, self.words[first:-(-hi // k)], self.bits,
                           hi - first * k)
        return sums[lo - first * k:].to(torch.float64)


def part_max(sums: LaneSums, counts: Sequence[int], table: torch.Tensor) -> torch.Tensor:
    """Every part's max ``|sum|`` (float64), chunk by chunk; a part cut by a chunk edge
    keeps the max of its pieces."""
    out = torch.zeros(len(counts), dtype=torch.float64, device=sums.device)
    ids = torch.arange(len(counts), device=sums.device)
    for c in chunks(counts, sums.bits):
        which = per_element(ids, table, counts, c)
        out.scatter_reduce_(0, which, sums[c.lo:c.hi].abs(), "amax")
    return out


def decode_parts(gathered: torch.Tensor, layout: core.MessageLayout, tables: Any,
                 scales: torch.Tensor, p0: int, p1: int, out: torch.Tensor) -> None:
    """Parts ``p0 .. p1`` of a two-stage bucket's gathered messages (``layout``), which fill
    the flat ``out`` in order, each code times its part's entry of ``scales`` (``p1 - p0``
    values in ``out``'s dtype); chunk by chunk.  ``tables(name)`` gives the layout's
    per-part device tables: ``counts`` and ``shift``, the part's first lane minus its first
    bucket element, so that bucket element ``e`` of part ``p`` is lane ``shift[p] + e``."""
    counts, shift = tables("counts")[p0:p1], tables("shift")[p0:p1]
    sub = layout.counts[p0:p1]
    start = sum(layout.counts[:p0])  # bucket element of out[0]
    for c in core.chunk_plan(sub, 64, CHUNK * 8):  # 64-bit "lanes": chunks of CHUNK elements
        positions = per_element(shift, counts, sub, c) + torch.arange(
            start + c.lo, start + c.hi, device=out.device)
        codes = lanes_at(gathered, positions, layout.bits)
        torch.mul(codes.to(out.dtype), per_element(scales, counts, sub, c),
                  out=out[c.lo:c.hi])


def segment_norms(flat: torch.Tensor, counts: Sequence[int], table: torch.Tensor,
                  norm: str) -> torch.Tensor:
    """Every segment's local norm (float64): max ``|x|`` (``norm="max"``) or the L2 norm in
    float64; ``inf`` for a segment holding NaN/Inf (it wins the MAX exchange on every rank,
    where a NaN could be dropped).  Chunk by chunk, as :func:`part_max`."""
    out = torch.zeros(len(counts), dtype=torch.float64, device=flat.device)
    ids = torch.arange(len(counts), device=flat.device)
    for c in chunks(counts, 64):  # any element boundary
        which = per_element(ids, table, counts, c)
        x = flat[c.lo:c.hi].double()
        if norm == "max":
            out.scatter_reduce_(0, which, torch.where(torch.isfinite(x), x.abs(), torch.inf),
                                "amax")
        else:  # squares in fp64: a finite fp32 segment must not overflow its own norm
            out.index_add_(0, which, x.square())
    if norm == "max":
        return out
    return torch.nan_to_num(out.sqrt(), nan=torch.inf)  # inf - inf in a sum is NaN
