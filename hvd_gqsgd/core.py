"""Framework-free math of Global-QSGD: levels, overflow bound, rounding, lane packing, rescale.

Everything numeric that hvd_gqsgd does is written once here.  The functions that touch tensors
take an ``ops`` object (see :class:`TensorOps`) whose methods are one-line translations into
PyTorch or TensorFlow; they never re-derive a formula.  This module imports neither framework.
The one exception is speed: :mod:`hvd_gqsgd.kernels` fuses :func:`quantize`, :func:`pack`
and :func:`unpack` into CPU loops, and tests/test_kernels.py checks them bit for bit against
the functions here.

The overflow bound
------------------
Each of ``n`` ranks sends integer codes ``q`` in ``[-L, L]``.  A lane of ``bits`` bits holds
signed values in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``, so choosing::

    L = floor((2**(bits-1) - 1) / n)

makes every partial sum of up to ``n`` codes fit its lane, whatever order the allreduce adds
them in.  ``L == 0`` means ``bits`` is too small for ``n`` ranks and is an error.

Signed-digit packing
--------------------
``K = 64 // bits`` codes share one int64 word as ``W = sum_k q_k * 2**(bits*k)``.  ``W`` is
an ordinary integer (lanes are signed digits, not bit fields), so adding words adds lanes, and
because every lane sum stays inside ``(-2**(bits-1), 2**(bits-1))``:

* no partial sum of words leaves the int64 range (``|W| < 2**63``), so nothing wraps;
* the lane sums are recovered exactly, lowest lane first, by taking the centred residue
  modulo ``2**bits`` and shifting it out (:func:`unpack`).

A lane never carries into the next because there is nothing to carry: the arithmetic is exact.

Two-stage
---------
:mod:`hvd_gqsgd.two_stage` sums codes in a reduce-scatter instead, in lanes of
``w = two_stage_bits(bits, n)`` bits with ``L1 = two_stage_levels(bits, n)`` levels (the
same bound with ``w``), then requantizes each shard's exact sum once to ``bits``
(``requantize``, ``stage_two_multipliers``, ``stage_two_steps``); ``two_stage_plan`` and
``message_layout`` say which rank owns which words and where each part's codes land.

Rotation
--------
With ``Settings.rotation`` every full scale block is multiplied by a shared-seed randomized
Walsh-Hadamard matrix before its norm is taken, and by the inverse after decoding, so that
one large coordinate no longer sets the scale of the whole block.  The definition, which
the fused kernels (``kernels.rotate_norms``, ``kernels.unrotate`` and the decodes fused with
it, ``kernels.Summed.unpack_bucket(..., rotation=)`` and two-stage's
``kernels.Messages.unpack_parts(..., rotation=)``), the generic path (:func:`rotate`, on
every framework's :class:`TensorOps`) and gqsgd_lab/rotation_oracle.py follow bit for bit in
float32 and float64:

* **What rotates.**  The bucket's scale segments (:func:`segments` with ``block``) whose
  count equals ``block``: the *full blocks* (:func:`full_blocks`).  Shorter segments are
  left as they are.  ``block`` is a power of two in [2, ``MAX_ROTATION_BLOCK``].
* **Signs.**  Element ``t`` of the full block whose first element is bucket element ``g``
  (its global index: ``start`` plus its offset in the array at hand) takes ``d_t = -1`` if
  bit ``t mod 32`` of ``h_{g + floor(t / 32)}`` is set, else ``+1``, where
  ``h_i = mix32((low32(i) + seed(key, i >> 32)) mod 2**32)`` is the hash that keys the
  rounding noise (``kernels.noise`` takes its top 24 bits; ``kernels.signs`` is the NumPy
  twin): one hash signs 32 elements.  ``key`` (:func:`rotation_key`) is the same on every
  rank, so every rank rotates by the same matrix and the sum of rotated vectors is the
  rotation of their sum.
* **Forward** (unnormalized).  ``y_b = H_B (d_b * x_b)`` for each full block ``b``, where
  ``H_B`` is the Sylvester Hadamard matrix, applied by butterflies in this order, in the
  vector's own dtype::

      for h = 1, 2, 4, ..., B/2:
          for every j in [0, B) with (j // h) even:
              a, b = v[j], v[j + h]
              v[j], v[j + h] = a + b, a - b

  The pairs of one stage are independent, so any loop order within a stage gives the same
  bits; the order of the stages is what every implementation keeps.
* **Inverse.**  ``x_b = d_b * ((H_B y_b) * (1/B))``: the same butterflies, then the exact
  power of two ``1/B``, then the signs.  Global-QSGD divides by a scale taken after the
  rotation, so a common factor cancels (up to rounding): the ``1/sqrt(B)`` of the
  orthonormal transform is left out of the forward, and the inverse's ``1/B`` is exact
  where ``1/sqrt(B)`` would not be.  The round trip is exact in float64 wherever the butterflies
  are (small integers, say); elsewhere each stage may round, so it returns ``x`` to
  within a few ulps times ``log2(B)``.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

__all__ = [
    "MIN_BITS",
    "MIN_SCALE",
    "MAX_BITS",
    "WORD_BITS",
    "NORMS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_SCALE_BLOCK",
    "LOW_BITS_SCALE_BLOCK",
    "Settings",
    "TensorOps",
    "levels",
    "min_bits",
    "lanes_per_word",
    "packed_words",
    "wire_bytes",
    "Chunk",
    "chunk_plan",
    "segments",
    "PROBE_BYTES",
    "scale_exchange_bytes",
    "rank_seed",
    "noise_key",
    "NoiseKeys",
    "probe_values",
    "check_probe",
    "quantize",
    "pack",
    "unpack",
    "encode",
    "multipliers",
    "step_sizes",
    "layout_fingerprint",
    "round_fingerprint",
    "shard_plan",
    "MAX_LANE_BITS",
    "MAX_CODE",
    "AUTO_MIN_LEVELS",
    "AUTO_BUCKET_BYTES",
    "flat_levels",
    "use_two_stage",
    "two_stage_bits",
    "two_stage_levels",
    "TwoStagePlan",
    "two_stage_plan",
    "MessageLayout",
    "message_layout",
    "stage_two_multipliers",
    "requantize",
    "stage_two_steps",
    "ROTATIONS",
    "MAX_ROTATION_BLOCK",
    "AUTO_ROTATION_MAX_BITS",
    "ROTATE_CHUNK_ROWS",
    "ROTATE_CHUNK_ELEMENTS",
    "rotation_block",
    "default_scale_block",
    "rotation_key",
    "full_blocks",
    "rotate",
    "hash32",
    "uniforms",
]

MIN_BITS = 2
MAX_BITS = 16
WORD_BITS = 64
NORMS = ("max", "l2")
# Packed bytes per Sum allreduce of a large bucket (Settings.chunk_bytes).  None: the adapter
# chooses (Backend.auto_chunk_bytes): chunks where they overlap the wire (TensorFlow graphs,
# AUTO_CHUNK_BYTES), one allreduce per bucket elsewhere (docs/BENCHMARKS.md, the @...k rows)
DEFAULT_CHUNK_BYTES = None
AUTO_CHUNK_BYTES = 1 << 21
# Input bytes per bucket when Settings.bucket_bytes is None and the adapter seals buckets
# from compress (PyTorch: Backend.auto_bucket_bytes): a deep model's gradients go on the wire
# in buckets of this size while backward still runs (docs/BENCHMARKS.md, the deep model)
AUTO_BUCKET_BYTES = 8 << 20
# Elements per global scale (Settings.scale_block) above AUTO_ROTATION_MAX_BITS bits, and at
# that many bits and fewer, where the coarse grid needs smaller blocks to train within 2% of
# fp32 at 16 ranks (256 missed it on four seeds; default_scale_block; docs/CONVERGENCE.md
# and LOW_BITS.md)
DEFAULT_SCALE_BLOCK = 1024
LOW_BITS_SCALE_BLOCK = 64
# Settings.rotation: the rotations there are, and the largest block one acts on
ROTATIONS = ("hadamard",)
MAX_ROTATION_BLOCK = 1 << 16
# rotation="auto" rotates at this many bits and fewer (rotation_block)
AUTO_ROTATION_MAX_BITS = 4


def levels(bits: int, world_size: int) -> int:
    """Levels per sign ``L`` such that the sum of ``world_size`` codes fits a ``bits``-bit lane.

    Raises ``ValueError`` when ``L`` would be 0, naming the smallest ``bits`` that works.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n_levels = ((1 << (bits - 1)) - 1) // world_size
    if n_levels < 1:
        raise ValueError(
            f"GlobalQSGD(bits={bits}) leaves 0 quantization levels per rank at world size "
            f"{world_size}: the sum of {world_size} codes would overflow a {bits}-bit lane. "
            f"Use bits >= {min_bits(world_size)}."
        )
    return n_levels


def min_bits(world_size: int) -> int:
    """Smallest lane width that gives at least one level per rank for ``world_size`` ranks."""
    # Need 2**(bits-1) - 1 >= n, i.e. bits - 1 >= log2(n + 1).
    return max(MIN_BITS, 1 + (world_size).bit_length())


def lanes_per_word(bits: int) -> int:
    """Codes packed into one int64 word."""
    return WORD_BITS // bits


def packed_words(numel: int, bits: int) -> int:
    """int64 words needed for ``numel`` codes."""
    return -(-numel // lanes_per_word(bits))


def wire_bytes(numel: int, bits: int) -> int:
    """Bytes of packed payload that ``numel`` codes put on the wire (per rank, per allreduce)."""
    return packed_words(numel, bits) * (WORD_BITS // 8)


@dataclass(frozen=True)
class Chunk:
    """Elements ``[lo, hi)`` of a bucket's flat buffer, packed and summed on their own.

    ``first:stop`` are the bucket's tensors that the chunk touches and ``counts`` how many of
    each tensor's elements it holds, so ``encode(flat[lo:hi], mult[first:stop], counts)``
    produces exactly the words ``[lo // K, ceil(hi / K))`` of packing the whole bucket.
    """

    lo: int
    hi: int
    first: int
    stop: int
    counts: tuple[int, ...]


def shard_plan(counts: Sequence[int], bits: int, parts: int) -> list[Chunk]:
    """The bucket's ``parts`` shards for a reduce-scatter of its ``bits``-lane words: chunks
    (:func:`chunk_plan`) of ``ceil(words / parts)`` whole words each, the last one shorter,
    padded with empty shards when the bucket has fewer words than ``parts``.  Shard
    boundaries are word boundaries, so the shards' words concatenate to the bucket's words,
    and every scale segment that a boundary cuts becomes two *parts* (``Chunk.counts``)."""
    total = sum(counts)
    per_shard = -(-packed_words(total, bits) // parts)
    plan = chunk_plan(counts, bits, per_shard * (WORD_BITS // 8))
    empty = Chunk(total, total, len(counts), len(counts), ())
    return plan + [empty] * (parts - len(plan))


def segments(numels: Sequence[int], block: int) -> tuple[tuple[int, ...], list[int]]:
    """Scale segments of a bucket: one per tensor (``block == 0``), or each tensor cut into
    blocks of ``block`` elements (the last one shorter), each with its own global scale.
    Returns the segments' element counts and, per tensor, the index of its first segment
    (plus a final entry: the total), so tensor ``i`` owns segments ``first[i]:first[i+1]``.
    The counts are a tuple: the fused kernels keep what they derive from an immutable one
    (kernels._derived), where a list would be converted again at every call."""
    if block == 0:
        return tuple(numels), list(range(len(numels) + 1))
    counts: list[int] = []
    first = [0]
    for n in numels:
        full, rest = divmod(n, block)
        counts += [block] * full + ([rest] if rest else [])
        first.append(len(counts))
    return tuple(counts), first


def chunk_plan(counts: Sequence[int], bits: int, chunk_bytes: int) -> list[Chunk]:
    """Split a bucket of tensors with ``counts`` elements into chunks of about ``chunk_bytes``
    packed bytes, cut at word boundaries (so the chunks' words concatenate to the bucket's
    words).  ``chunk_bytes == 0`` or a bucket that fits in one chunk gives a single chunk.
    Every count must be positive (scale segments are never empty)."""
    total = sum(counts)
    step = max(1, chunk_bytes // (WORD_BITS // 8)) * lanes_per_word(bits)
    if chunk_bytes <= 0 or total <= step:
        return [Chunk(0, total, 0, len(counts), tuple(counts))]
    # Python work per chunk, not per segment: with scale blocks a 64 MB bucket has 16k
    # segments, and a per-segment loop here cost more than quantizing the bucket.
    ends = list(itertools.accumulate(counts, initial=0))
    plan = []
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        first = bisect.bisect_right(ends, lo) - 1  # the segment holding element lo
        stop = bisect.bisect_left(ends, hi, first)  # one past the segment holding hi - 1
        parts = list(counts[first:stop])
        parts[0] = min(hi, ends[first + 1]) - lo
        if stop - first > 1:
            parts[-1] = hi - ends[stop - 1]
        plan.append(Chunk(lo, hi, first, stop, tuple(parts)))
    return plan


PROBE_BYTES = 16  # the float64 pair each tensor sends through Horovod's own allreduce


def scale_exchange_bytes(n_segments: int) -> int:
    """Bytes of one batch's MAX allreduce: a float64 scale per segment (tensor, or block with
    ``scale_block``) plus the layout pair."""
    return 8 * (n_segments + 2)


def rank_seed(seed: int | None, rank: int) -> int:
    """A 63-bit generator seed for ``rank``.

    With ``seed=None`` the seed comes from the OS, so ranks are independent even when the
    training script seeds every framework RNG identically.  With a ``seed`` the streams are
    reproducible and still differ between ranks (a hash of ``(seed, rank)``).
    """
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 1
    digest = hashlib.blake2b(f"gqsgd:{seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def noise_key(base: int, serial: int) -> int:
    """The 64-bit key of bucket ``serial`` in a rank's counter-based noise stream."""
    digest = hashlib.blake2b(f"{base}:{serial}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class NoiseKeys:
    """One rank's stream of bucket keys for the kernels' counter-based rounding noise.

    Every call of :meth:`next` returns a fresh 64-bit key (``noise_key(base, 1)``, ``(base,
    2)``, ...), ``base = rank_seed(seed, rank)`` fixed at the first call.  Thread-safe and
    order-free: concurrent buckets (TensorFlow runs per-tensor chains in parallel) each get
    their own key, and which one gets which does not matter since all are independent.
    """

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._base: int | None = None  # rank_seed(seed, rank), set on first use
        self._serial = itertools.count(1)  # next() of a count is atomic under the GIL

    def next(self, rank: int) -> int:
        if self._base is None:
            self._base = rank_seed(self._seed, rank)
        return noise_key(self._base, next(self._serial))


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Validated, immutable compressor settings.  All argument checking lives here.

    Attributes:
        bits: lane width of one code on the wire, 2..16.
        norm: ``"max"`` (global scale = max over ranks of max |x|) or ``"l2"`` (max over ranks
            of the local L2 norm).
        seed: ``None`` for OS-seeded rounding noise, or an int >= 0 for reproducible noise.
        bucket_bytes: seal a bucket from ``compress`` once this many input bytes are queued,
            and start its scale exchange (0 = one bucket, sealed when the first result is
            needed; None = the adapter's choice, see ``AUTO_BUCKET_BYTES``).
        scale_block: give every ``scale_block`` elements of a tensor their own global scale
            (0 = one scale per tensor; None = by bits, :func:`default_scale_block`: 1024,
            and 64 at ``AUTO_ROTATION_MAX_BITS`` bits and fewer).  Settings holds the
            resolved int.
        chunk_bytes: send a bucket's packed codes as Sum allreduces of about this many bytes
            each, so that quantizing one chunk overlaps sending the previous (0 = one
            allreduce per bucket; None = the adapter's choice, see ``AUTO_CHUNK_BYTES``).
        hierarchical: sum in full precision inside each node and quantize only across
            nodes, so ``levels`` counts nodes, not ranks (:mod:`hvd_gqsgd.hierarchical`).
        two_stage: ``True``: sum the codes in a reduce-scatter with lanes wide enough for
            ``levels(bits, 1)`` levels per rank, requantize each shard once and allgather it
            (:mod:`hvd_gqsgd.two_stage`); ``False``: flat Global-QSGD; ``None``: two-stage
            where flat would leave fewer than ``AUTO_MIN_LEVELS`` levels
            (:func:`use_two_stage`).
        rotation: ``"hadamard"``: rotate every full scale block by a shared-seed randomized
            Walsh-Hadamard matrix before quantizing and back after decoding (the module
            docstring's "Rotation"; needs ``scale_block`` a power of two in [2,
            ``MAX_ROTATION_BLOCK``]); ``None``: no rotation; ``"auto"``: ``"hadamard"`` at
            ``AUTO_ROTATION_MAX_BITS`` bits and fewer when ``scale_block`` allows it, else
            none (:func:`rotation_block`).
    """

    bits: int = 8
    norm: str = "max"
    seed: int | None = None
    bucket_bytes: int | None = None
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES
    # None (the default) is replaced on init by default_scale_block(bits); the adapters'
    # scale_block=None passes it on (their type: ignore)
    scale_block: int = cast(int, None)
    hierarchical: bool = False
    two_stage: bool | None = None
    rotation: str | None = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {self.bits!r}")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(
                f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.bits}; "
                "8 is the usual choice (4x fewer bytes than fp32)"
            )
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")
        if self.bucket_bytes is not None and (
            isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes < 0
        ):
            raise ValueError(f"bucket_bytes must be None (automatic) or an int >= 0, got "
                             f"{self.bucket_bytes!r}")
        if self.chunk_bytes is not None and (
            isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes < 0
        ):
            raise ValueError(f"chunk_bytes must be None (automatic) or an int >= 0, got "
                             f"{self.chunk_bytes!r}")
        if self.scale_block is None:
            object.__setattr__(self, "scale_block", default_scale_block(self.bits))
        if isinstance(self.scale_block, bool) or not isinstance(self.scale_block, int) or (
            self.scale_block < 0
        ):
            raise ValueError(
                f"scale_block must be None (by bits) or an int >= 0 (elements per scale; 0 = "
                f"per tensor), got "
                f"{self.scale_block!r}")
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"hierarchical must be True or False, got {self.hierarchical!r}")
        if self.two_stage is not None and not isinstance(self.two_stage, bool):
            raise ValueError(f"two_stage must be True, False or None (chosen by world size), "
                             f"got {self.two_stage!r}")
        if self.two_stage and self.chunk_bytes:
            raise ValueError(
                f"two_stage=True sends each bucket as one reduce-scatter and one allgather, not "
                f"in chunks; got chunk_bytes={self.chunk_bytes}: use chunk_bytes=None or 0")
        if self.hierarchical and self.chunk_bytes:
            raise ValueError(
                f"hierarchical=True sends each bucket as one shard per rank, not in chunks; "
                f"got chunk_bytes={self.chunk_bytes}: use chunk_bytes=0 with it")
        self._check_rotation()

    def _check_rotation(self) -> None:
        named = ("auto", *ROTATIONS)
        if self.rotation is not None and not (isinstance(self.rotation, str)
                                              and self.rotation in named):
            raise ValueError(f"rotation must be None (off) or one of {named}, got "
                             f"{self.rotation!r}")
        if self.rotation == "hadamard" and not _rotatable(self.scale_block):
            raise ValueError(
                f"rotation='hadamard' rotates each scale block, so scale_block must be a power "
                f"of two in [2, {MAX_ROTATION_BLOCK}], got scale_block={self.scale_block}: use "
                f"scale_block=None (the default, {default_scale_block(self.bits)} at "
                f"bits={self.bits}) with rotation='hadamard'")


# --------------------------------------------------------------------------- tensor ops


class TensorOps(Protocol):
    """The primitives the core needs from a framework.  Each adapter method is a line or two."""

    def floor(self, x: Any) -> Any: ...
    def clamp(self, x: Any, low: float, high: float) -> Any: ...
    def less(self, a: Any, b: Any) -> Any: ...
    def to_int64(self, x: Any) -> Any: ...
    def pad_reshape(self, x: Any, rows: int, cols: int) -> Any: ...
    def column(self, x: Any, k: int) -> Any: ...
    def stack_columns(self, cols: Sequence[Any], numel: int) -> Any: ...
    def bitand(self, x: Any, mask: int) -> Any: ...
    def rshift(self, x: Any, shift: Any) -> Any: ...  # shift: int or int64 tensor
    def isfinite(self, x: Any) -> Any: ...
    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    # rotation (see rotate): int64 index rows (row r: starts[r] + 0 .. width - 1), gathering
    # and placing them (scatter_rows may write into out, rotate's own copy, and returns it),
    # one butterfly stage over the last dim, and the sign hash's bit arithmetic (int64
    # tensors holding uint32 values)
    def copy(self, x: Any) -> Any: ...
    def row_index(self, starts: Sequence[int], width: int, like: Any) -> Any: ...
    def gather_rows(self, x: Any, index: Any) -> Any: ...
    def scatter_rows(self, out: Any, index: Any, rows: Any) -> Any: ...
    def butterfly(self, rows: Any, h: int) -> Any: ...
    def bitxor(self, x: Any, y: Any) -> Any: ...
    def cast_like(self, x: Any, like: Any) -> Any: ...


def quantize(ops: TensorOps, x: Any, mult: Any, noise: Any, n_levels: int) -> Any:
    """Unbiased stochastic rounding of ``x * mult`` to integers in ``[-L, L]`` (int64).

    ``y = clamp(x * mult, -L, L)`` then ``q = floor(y) + (u < y - floor(y))`` with ``u``
    uniform in [0, 1).  ``E[q] = y``.  Written this way rather than ``floor(y + u)`` because
    ``y + u`` can round up to ``floor(y) + 1`` (even to ``L + 1``) in floating point; the
    fractional part ``y - floor(y)`` is exact, so the comparison is exact too.  The clamp only
    bites when ``|x| == s`` and ``x * (L/s)`` rounds a hair above ``L``.
    """
    y = ops.clamp(x * mult, -float(n_levels), float(n_levels))
    # A NaN/Inf input has mult 0 (its global scale is inf) and x * 0 is NaN; its codes are
    # discarded (the result is all-NaN), but NaN cast to int64 is undefined and could spill
    # into neighbouring lanes of other tensors, so it becomes code 0 here.
    y = ops.where(y == y, y, 0.0)
    low = ops.floor(y)
    up = ops.less(noise, y - low)
    return ops.to_int64(low) + ops.to_int64(up)


def pack(ops: TensorOps, codes: Any, bits: int) -> Any:
    """Pack flat int64 ``codes`` into int64 words, ``lanes_per_word(bits)`` codes per word.

    Word ``j`` is ``sum_k codes[j*K + k] * 2**(bits*k)`` (signed digits; see module docstring).
    The tail is padded with zeros.
    """
    k_lanes = lanes_per_word(bits)
    numel = _numel_of(codes)
    grid = ops.pad_reshape(codes, packed_words(numel, bits), k_lanes)
    word = ops.column(grid, k_lanes - 1)
    for k in range(k_lanes - 2, -1, -1):  # Horner: every partial value is itself a valid word
        word = word * (1 << bits) + ops.column(grid, k)
    return word


def unpack(ops: TensorOps, words: Any, bits: int, numel: int) -> Any:
    """Inverse of :func:`pack` for a *sum* of packed words: the flat int64 lane sums.

    Exact whenever every lane sum lies in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``, which the
    choice of :func:`levels` guarantees.
    """
    half, mask = 1 << (bits - 1), (1 << bits) - 1
    cols = []
    for _ in range(lanes_per_word(bits) - 1):
        lane = ops.bitand(words + half, mask) - half  # centred residue mod 2**bits
        cols.append(lane)
        words = ops.rshift(words - lane, bits)  # exact: words - lane is a multiple of 2**bits
    cols.append(words)
    return ops.stack_columns(cols, numel)


def encode(ops: TensorOps, flat: Any, mult: Any, noise: Any, n_levels: int, bits: int) -> Any:
    """Generic path: :func:`quantize` then :func:`pack` (``mult`` per element)."""
    return pack(ops, quantize(ops, flat, mult, noise, n_levels), bits)


def _numel_of(x: Any) -> int:
    shape = x.shape
    return int(math.prod(int(d) for d in shape))


# --------------------------------------------------------------------------- scale and probe


MIN_SCALE = 2.0**-100
"""Global scales below this quantize to all-zero codes (see :func:`multipliers`)."""


def multipliers(ops: TensorOps, scales: Any, n_levels: int) -> Any:
    """Per-segment quantization multiplier ``L / s``; 0 where ``s`` is 0 (an all-zero tensor on
    every rank) or not finite (a NaN/Inf somewhere: the result is poisoned in
    :func:`step_sizes` instead), so no NaN or Inf ever enters the integer codes.

    Also 0 where ``s < MIN_SCALE`` (2**-100, about 8e-31): such a segment is sent as zeros.
    Inputs are quantized in float32, where ``L / s`` overflows once ``s`` is below about
    ``L * 3e-39``; infinite multipliers would round every nonzero element to +-L, and values
    that small (vanishing gradients deep in a network) are far below what any optimizer step
    resolves.  With the floor, ``L / s <= 2**115`` fits float32 for every ``bits``."""
    ok = ops.isfinite(scales) & (scales >= MIN_SCALE)
    return ops.where(ok, n_levels / ops.where(ok, scales, 1.0), 0.0)


def step_sizes(ops: TensorOps, scales: Any, n_levels: int) -> Any:
    """Per-segment value of one summed code, ``s / L``.  NaN where the global scale is not
    finite, so a NaN/Inf gradient on any rank yields an all-NaN segment on every rank (AMP's
    loss scaler then skips the step everywhere)."""
    return ops.where(ops.isfinite(scales), scales / n_levels, math.nan)


def probe_values(rank: int) -> tuple[float, float]:
    """What each rank hands Horovod's own allreduce in place of the gradient.

    Horovod may apply ``Average`` (sum, then a postscale truncated into integers), pre/post
    scale factors, or an op that cannot work on integer sums; ``compress`` is never told which.
    So the integer codes travel in a separate ``Sum`` allreduce, and Horovod's allreduce gets
    this 2-element probe ``[1, rank + 1]``.  A reduction that yields ``alpha * sum_i x_i`` for
    gradients (Sum: alpha = 1; Average: 1/n; times any pre/postscale) returns
    ``alpha * [n, n(n+1)/2]`` for the probe, so ``probe[0] / n`` is the factor to apply to the
    decoded sum, and ``probe[1]`` checks that the reduction really was such a sum.
    """
    return (1.0, float(rank + 1))


def check_probe(reduced: Sequence[float], world_size: int) -> float:
    """Validate a reduced probe and return the factor to apply to the sum of gradients.

    Raises ``ValueError`` when the reduction was not a (scaled) sum over ``world_size`` ranks
    -- Adasum, Min, Max, Product, or a process set that differs from the compressor's.
    """
    total, ranks = float(reduced[0]), float(reduced[1])
    expected = total * (world_size + 1) / 2.0
    if not (math.isfinite(total) and total > 0 and math.isclose(ranks, expected, rel_tol=1e-9)):
        raise ValueError(
            "GlobalQSGD needs Horovod to reduce with op=Sum or op=Average (optionally with "
            "pre/postscale factors) over the same process set as GlobalQSGD(process_set=...); "
            f"the probe came back as [{total!r}, {ranks!r}] at world size {world_size}, which "
            "no such reduction produces. Adasum, Min, Max and Product cannot act on "
            "integer-summed codes: use Compression.none or fp16 with those ops."
        )
    return total / world_size


def round_fingerprint(fingerprint: float, count: int) -> float:
    """``fingerprint`` (of :func:`layout_fingerprint`) combined with a round counter, still
    float64-exact: what ranks compare when the round enters the computation (the rotation's
    keys), so that ranks at different rounds fail the layout check."""
    mixed = hashlib.blake2b(f"{count}".encode(), digest_size=8).digest()
    return float((int(fingerprint) ^ int.from_bytes(mixed, "little")) >> 12)


def layout_fingerprint(numels: Sequence[int], dtypes: Sequence[str]) -> float:
    """A float64-exact (< 2**52) hash of a bucket's layout, compared across ranks.

    Ranks must compress tensors in the same order; a mismatch that changes sizes or dtypes is
    caught by exchanging this value alongside the scales.
    """
    text = ",".join(f"{n}:{d}" for n, d in zip(numels, dtypes)).encode()
    return float(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 12)



# --------------------------------------------------------------------------- two-stage


MAX_LANE_BITS = 32
"""Widest lane of a two-stage reduce-scatter word (2 lanes per int64 word)."""
MAX_CODE = (1 << 15) - 1
"""Largest code magnitude: the kernels hold codes in int16, so stage-1 levels stop here."""
AUTO_MIN_LEVELS = 15
"""``two_stage=None`` runs two-stage Global-QSGD wherever flat Global-QSGD would leave a rank
fewer levels per sign than this (8 bits: from 9 ranks on; 4 bits: always)."""


def flat_levels(bits: int, world_size: int) -> int:
    """:func:`levels` without the error: 0 where ``bits`` is too narrow for ``world_size``."""
    return max(0, ((1 << (bits - 1)) - 1) // world_size)


def use_two_stage(two_stage: bool | None, bits: int, world_size: int) -> bool:
    """Whether a bucket summed over ``world_size`` ranks (nodes, with ``hierarchical``) goes
    two-stage: as asked, or with ``None`` where flat levels fall below AUTO_MIN_LEVELS."""
    if two_stage is not None:
        return two_stage
    return world_size > 1 and flat_levels(bits, world_size) < AUTO_MIN_LEVELS


def two_stage_bits(bits: int, world_size: int) -> int:
    """Lane width ``w`` of the two-stage reduce-scatter for ``world_size`` ranks.

    The narrowest ``w`` with ``levels(w, n) >= levels(bits, 1)``, so that every rank keeps the
    levels it would have alone at ``bits`` (``w <= bits + ceil(log2 n)``), then widened to the
    widest lane with as many lanes per word: the extra bits of a word are free levels (8 bits
    at 8 ranks: 11 bits are needed, 5 lanes fit either way, so 12-bit lanes and 255 levels).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    need, width = levels(bits, 1), bits
    while flat_levels(width, world_size) < need:
        width += 1
    if width > MAX_LANE_BITS:
        raise ValueError(
            f"two-stage GlobalQSGD(bits={bits}) at world size {world_size} needs {width}-bit "
            f"lanes in its reduce-scatter; at most {MAX_LANE_BITS} fit an int64 word twice. "
            f"Use fewer bits or hierarchical=True (lanes then count nodes).")
    return WORD_BITS // lanes_per_word(width)


def two_stage_levels(bits: int, world_size: int) -> int:
    """Stage-1 levels per sign ``L1 = levels(two_stage_bits(bits, n), n)``, at most MAX_CODE:
    the sum of ``n`` codes in ``[-L1, L1]`` fits a lane of :func:`two_stage_bits`."""
    return min(levels(two_stage_bits(bits, world_size), world_size), MAX_CODE)


@dataclass(frozen=True)
class TwoStagePlan:
    """How one bucket travels in two-stage Global-QSGD over ``world_size`` ranks
    (:mod:`hvd_gqsgd.two_stage` has the algorithm).

    Stage 1: each rank packs its codes (``levels1`` per sign) into ``lane_bits``-wide lanes
    and pads them to ``scatter_words``; a Sum reduce-scatter leaves rank ``r`` the exact lane
    sums of ``shards[r]`` (``shard_words`` words; its elements, segments and *parts*: its
    scale segments, cut at the shard's edges).  Stage 2: rank ``r`` requantizes its sums to
    ``levels2`` per sign in ``bits``-wide lanes and sends ``message_words``: ``code_words``
    words of codes, then ``part_slots`` words, one per part holding the part's max |sum| as
    an int64 (zeros past its own parts).  An allgather gives every rank every message.
    """

    world_size: int
    bits: int
    lane_bits: int
    levels1: int
    levels2: int
    shard_words: int
    shards: tuple[Chunk, ...]
    code_words: int
    part_slots: int

    @property
    def total(self) -> int:
        return self.shards[-1].hi

    @property
    def scatter_words(self) -> int:
        """int64 words each rank hands the reduce-scatter (its codes, zero-padded)."""
        return self.world_size * self.shard_words

    @property
    def message_words(self) -> int:
        return self.code_words + self.part_slots

    @property
    def gather_words(self) -> int:
        """int64 words each rank receives from the allgather (every rank's message)."""
        return self.world_size * self.message_words

    def wire_bytes(self) -> int:
        """Bytes of the Sum allreduce that moves as much per rank as both phases do: a ring
        reduce-scatter moves ``(n-1)/n`` of its input, an allgather ``(n-1)/n`` of its output
        and an allreduce of ``B`` bytes ``2(n-1)/n B``, so ``(scatter + gather) / 2`` words."""
        return 4 * (self.scatter_words + self.gather_words)


def two_stage_plan(counts: Sequence[int], world_size: int, bits: int) -> TwoStagePlan:
    """The :class:`TwoStagePlan` of a bucket whose scale segments hold ``counts`` elements."""
    width = two_stage_bits(bits, world_size)
    shards = shard_plan(counts, width, world_size)
    per_shard = -(-packed_words(sum(counts), width) // world_size)
    return TwoStagePlan(
        world_size=world_size, bits=bits, lane_bits=width,
        levels1=two_stage_levels(bits, world_size), levels2=levels(bits, 1),
        shard_words=per_shard, shards=tuple(shards),
        code_words=packed_words(per_shard * lanes_per_word(width), bits),
        part_slots=max(len(s.counts) for s in shards))


@dataclass(frozen=True, eq=False)
class MessageLayout:
    """Where each part of a two-stage bucket lies in the words every rank gathered.

    Parts (scale segments cut at shard edges) in bucket order: part ``p`` holds ``counts[p]``
    elements of segment ``segments[p]``, its first code is lane ``lanes[p]`` (``bits``-wide
    lanes counted over all gathered words) and its max |sum| is word ``slots[p]``.  Segment
    ``g`` owns parts ``first[g]:first[g + 1]``.  ``derived`` caches what an adapter computes
    from the layout once (index tensors, kernel work items)."""

    bits: int
    levels2: int
    words: int
    counts: tuple[int, ...]
    segments: tuple[int, ...]
    lanes: tuple[int, ...]
    slots: tuple[int, ...]
    first: tuple[int, ...]
    derived: dict = field(default_factory=dict, repr=False)


def message_layout(blocks: Sequence[tuple[TwoStagePlan, int, int]], words: int,
                   n_segments: int) -> MessageLayout:
    """The :class:`MessageLayout` of ``words`` gathered words holding, for each
    ``(plan, word_offset, segment_offset)`` of ``blocks`` (in bucket order), ``plan``'s
    messages from word ``word_offset`` on, its segment ``k`` being the bucket's segment
    ``segment_offset + k``.  Flat two-stage has one block; hierarchical one per node shard."""
    counts, segs, lanes, slots = [], [], [], []
    bits = blocks[0][0].bits
    k_lanes = lanes_per_word(bits)
    for plan, word_offset, segment_offset in blocks:
        for r, shard in enumerate(plan.shards):
            base = word_offset + r * plan.message_words
            lane = base * k_lanes
            for p, count in enumerate(shard.counts):
                counts.append(count)
                segs.append(segment_offset + shard.first + p)
                lanes.append(lane)
                slots.append(base + plan.code_words + p)
                lane += count
    first = [0] * (n_segments + 1)
    for g in segs:
        first[g + 1] += 1
    first = list(itertools.accumulate(first))
    return MessageLayout(bits=bits, levels2=blocks[0][0].levels2, words=words,
                         counts=tuple(counts), segments=tuple(segs), lanes=tuple(lanes),
                         slots=tuple(slots), first=tuple(first))


def stage_two_multipliers(ops: TensorOps, part_max: Any, bits: int) -> Any:
    """Per part ``L2 / max|sum|`` (0 for an all-zero part), ``L2 = levels(bits, 1)``: the
    multiplier that requantizes a shard's exact lane sums (:func:`requantize`).  Every
    ``|sum| <= max|sum|``, so codes stay in ``[-L2, L2]`` and nothing clamps: unbiased."""
    return multipliers(ops, part_max, levels(bits, 1))


def requantize(ops: TensorOps, sums: Any, mult: Any, noise: Any, bits: int) -> Any:
    """Stage 2, generic path: a shard's exact lane sums (float64 holding integers, so ``sums
    * mult`` is rounded once, as in the kernels) times their part's
    :func:`stage_two_multipliers` (per element), rounded without bias to ``levels(bits, 1)``
    levels and packed in ``bits``-wide lanes.  :func:`hvd_gqsgd.kernels.quantize_pack` on
    the same float64 sums is its fused twin, bit for bit."""
    return encode(ops, sums, mult, noise, levels(bits, 1), bits)


def stage_two_steps(part_max: Any, steps1: Any, bits: int) -> Any:
    """Per part, the value of one stage-2 code: ``max|sum| / L2`` (in units of one summed
    stage-1 code) times ``s / L1`` of the part's segment (:func:`step_sizes` with L1; NaN for
    a non-finite scale, which poisons the part as in flat Global-QSGD)."""
    return part_max / levels(bits, 1) * steps1


# --------------------------------------------------------------------------- rotation
# The definition is the module docstring's "Rotation" section.


# The generic rotate transforms at most this many blocks, and this many elements (one block
# at least), at once: its transient tensors (int64 index rows, gathered rows, the sign hash)
# stay bounded per chunk instead of growing with the bucket
ROTATE_CHUNK_ROWS = 1024
ROTATE_CHUNK_ELEMENTS = 1 << 20
_MASK32 = 0xFFFFFFFF


def _rotatable(block: int) -> bool:
    """Whether a rotation can act on scale blocks of ``block`` elements."""
    return (not isinstance(block, bool) and isinstance(block, int)
            and 2 <= block <= MAX_ROTATION_BLOCK and block & (block - 1) == 0)


def default_scale_block(bits: int) -> int:
    """``Settings.scale_block`` when it is None: ``LOW_BITS_SCALE_BLOCK`` at
    ``AUTO_ROTATION_MAX_BITS`` bits and fewer, where the coarse grid trains nearer fp32 with
    smaller blocks (their scales cost 8 bytes per block: 1 bit per element at 64),
    ``DEFAULT_SCALE_BLOCK`` above (docs/LOW_BITS.md, "smaller blocks")."""
    return LOW_BITS_SCALE_BLOCK if bits <= AUTO_ROTATION_MAX_BITS else DEFAULT_SCALE_BLOCK


def rotation_block(settings: Settings) -> int:
    """The block the rotation acts on (``settings.scale_block``), 0 when it is off:
    ``"hadamard"`` always rotates (Settings checked the block), ``None`` never, ``"auto"``
    at ``AUTO_ROTATION_MAX_BITS`` bits and fewer when ``scale_block`` is a power of two in
    [2, MAX_ROTATION_BLOCK] (so ``scale_block=0``, one scale per tensor, turns it off)."""
    if settings.rotation == "hadamard":
        return settings.scale_block
    if (settings.rotation == "auto" and settings.bits <= AUTO_ROTATION_MAX_BITS
            and _rotatable(settings.scale_block)):
        return settings.scale_block
    return 0


def rotation_key(seed: int | None, stream: int, count: int) -> int:
    """The 64-bit sign key of one rotation, the same on every rank (it must not depend on the
    rank: every rank rotates by the same matrix, so that summing commutes with it).
    ``stream`` names the bucket position or call site and ``count`` the round, so every
    bucket of every round gets fresh signs; with ``seed=None`` they are still shared, as
    the stream and round counters are."""
    text = f"gqsgd-rotation:{'none' if seed is None else seed}:{stream}:{count}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def full_blocks(counts: Sequence[int], block: int) -> list[int]:
    """Start offsets (in the bucket, from 0) of the segments of ``counts`` elements that hold
    exactly ``block`` elements: the blocks a rotation transforms."""
    ends = itertools.accumulate(counts, initial=0)  # one Python step per segment
    return list(itertools.compress(ends, [c == block for c in counts]))


def rotate(ops: TensorOps, x: Any, counts: Sequence[int], block: int, key: int,
           start: int = 0, inverse: bool = False) -> Any:
    """Generic path: the flat float32/64 bucket ``x`` (segments of ``counts`` elements; its
    element 0 is bucket element ``start``) with every full block rotated forward, or back
    with ``inverse``, as the module docstring defines it.  Returns a new tensor; ``x``
    (which may be a user's tensor) is never modified.

    Chunks of at most ``ROTATE_CHUNK_ROWS`` blocks (and ``ROTATE_CHUNK_ELEMENTS``
    elements): each is gathered into a ``(k, block)`` matrix, signed and transformed
    (forward) or transformed, scaled by ``1/block`` and signed (inverse), and placed into the
    copy.  :func:`hvd_gqsgd.kernels.rotate_norms`, :func:`~hvd_gqsgd.kernels.unrotate` and
    ``kernels.Summed.unpack_bucket(..., rotation=)`` are its fused CPU twins, bit for bit.

    Example::

        key = rotation_key(seed, stream=0, count=step)
        y = rotate(ops, flat, counts, 1024, key)              # before the norms
        back = rotate(ops, y, counts, 1024, key, inverse=True)  # after decoding
    """
    if block & (block - 1) or not 2 <= block <= MAX_ROTATION_BLOCK:
        raise ValueError(f"a rotation acts on blocks of a power of two in [2, "
                         f"{MAX_ROTATION_BLOCK}] elements, got block={block}")
    starts = full_blocks(counts, block)
    rows_per_chunk = max(1, min(ROTATE_CHUNK_ROWS, ROTATE_CHUNK_ELEMENTS // block))
    out = ops.copy(x)
    t = ops.row_index([0], block, x)  # each element's place in its block
    for c in range(0, len(starts), rows_per_chunk):
        index = ops.row_index(starts[c:c + rows_per_chunk], block, x)
        rows = ops.gather_rows(x, index)
        word = index + (start - t + ops.rshift(t, 5))  # g + t // 32
        bit = ops.bitand(ops.rshift(hash32(ops, word, key), ops.bitand(t, 31)), 1)
        signs = ops.cast_like(1 - 2 * bit, rows)
        if not inverse:
            rows = rows * signs  # exact: a sign flip
        h = 1
        while h < block:
            rows = ops.butterfly(rows, h)
            h *= 2
        if inverse:
            rows = rows * (1.0 / block) * signs  # a power of two, then the signs: as defined
        out = ops.scatter_rows(out, index, rows)
    return out


def hash32(ops: TensorOps, index: Any, key: int) -> Any:
    """The 32-bit hash (int64 holding uint32) of every element ``index`` (int64) of a piece
    keyed by ``key``: kernels._seed and kernels._mix32, spelled with TensorOps.  The
    kernels' rounding noise is its top 24 bits (:func:`uniforms`); a rotation signs 32
    elements with the 32 bits of one hash."""
    high = ops.bitand(ops.rshift(index, 32) + (key >> 32), _MASK32)
    seed = ops.bitxor(_mix32(ops, high), key & _MASK32)
    return _mix32(ops, ops.bitand(ops.bitand(index, _MASK32) + seed, _MASK32))


def uniforms(ops: TensorOps, key: int, index: Any, like: Any) -> Any:
    """The rounding noise of elements ``index`` of a piece keyed by ``key``, in ``like``'s
    dtype: ``kernels.noise`` bit for bit (multiples of 2**-24, exact in float32), so a
    framework's tensor ops round exactly as the fused kernels do."""
    return ops.cast_like(ops.rshift(hash32(ops, index, key), 8), like) * 2.0**-24


def _mix32(ops: TensorOps, z: Any) -> Any:
    """kernels._mix32 on int64 tensors holding values in [0, 2**32)."""
    z = _mul32(ops, ops.bitxor(z, ops.rshift(z, 16)), 0x7FEB352D)
    z = _mul32(ops, ops.bitxor(z, ops.rshift(z, 15)), 0x846CA68B)
    return ops.bitxor(z, ops.rshift(z, 16))


def _mul32(ops: TensorOps, z: Any, c: int) -> Any:
    """``z * c mod 2**32`` for ``z`` in [0, 2**32) without leaving int64: ``c`` in 16-bit
    halves, each product below 2**48 (a wrapping int64 multiply would do as well in torch,
    but signed overflow is undefined behaviour in the C++ under TF's kernels)."""
    low = z * (c & 0xFFFF)
    high = ops.bitand(z * (c >> 16), 0xFFFF)  # only its low 16 bits reach bits 16..31
    return ops.bitand(low + high * 0x10000, _MASK32)
