"""Fused CPU kernels (numba) for the hot loops of :mod:`hvd_gqsgd.core`.

* ``segment_norms``: every tensor's local norm of a flat bucket in one pass.
* ``quantize_pack``: clamp and stochastic rounding, then signed-digit packing into the int64
  words.  With 8- and 16-bit lanes the codes are written straight into the words' bytes and
  one pass over the words fixes their form (see :func:`_byte_lanes`); other widths go
  through a reused int16 buffer and a packing pass.
* :class:`Summed`: a bucket's summed words, decoded one tensor at a time straight to floats.
* :class:`WireWatch`: quantizes a chunk while earlier ones are on the wire, optionally at
  lower priority (``HVD_GQSGD_OVERLAP_NICE``).
* ``rotate_norms`` / ``unrotate``: the shared-seed Hadamard rotation of every full scale
  block (``core``'s "Rotation"), forward with the segment norms in the same pass, and back;
  ``Summed.unpack_bucket(rotation=...)`` fuses the inverse into the decode.

They compute exactly what ``core.quantize`` + ``core.pack`` and ``core.unpack`` + rescale
compute (tests/test_kernels.py checks this bit for bit), with one difference: the rounding
noise comes from a counter-based generator (:func:`noise`), so it needs no state, threads can
draw it in any order, and it can be regenerated for any element.  Element ``i`` of a bucket
takes as its uniform ``u`` the top 24 bits of a 32-bit hash of ``i`` and the bucket's key.
The comparison ``u < frac(y)`` is exact, so the rounding bias is below ``2**-24`` of a step,
and zero wherever ``|y| >= 1/2`` in float32 (``frac(y)`` is then a multiple of ``2**-24``).
A 32-bit hash vectorizes eight lanes wide on AVX2, where a 64-bit hash does not
(``benchmarks/cpu_cost.py`` measures the kernels).

Framework-free: arguments are NumPy arrays (the torch adapter passes zero-copy views of CPU
tensors).  Importing this module compiles nothing; each kernel is compiled on first use and
cached on disk by numba.  ``HVD_GQSGD_KERNELS=0`` disables them (generic path everywhere).
Big inputs run threaded, on at most :func:`thread_budget` threads per process (one per CPU
share of each rank on the host, or ``OMP_NUM_THREADS``); with a budget of 1 every kernel runs
serially and numba never starts its thread pool.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

try:
    import numba
except ImportError:  # the generic path in core still works
    numba = None  # type: ignore[assignment]

__all__ = ["Summed", "WireWatch", "available", "noise", "overlap_nice", "quantize_pack",
           "rotate_norms", "segment_norms", "signs", "thread_budget", "unrotate"]

_UNIT = 2.0**-24  # the rounding noise's resolution
BLOCK = 1 << 14  # elements per work item: big enough to amortise, small enough for L2
_LITTLE_ENDIAN = sys.byteorder == "little"  # a compile-time constant in the kernels
PARALLEL_MIN = 1 << 18  # elements below which the serial twin of a kernel runs
_LANES = 8  # elements per vector in the rotation's intrinsics
_FLT_MIN, _FLT_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def available() -> bool:
    """True when numba imports and ``HVD_GQSGD_KERNELS`` is not ``0``."""
    return numba is not None and os.environ.get("HVD_GQSGD_KERNELS", "1") != "0"


def noise(key: int, start: int, count: int) -> np.ndarray:
    """The float64 uniforms in [0, 1) (multiples of 2**-24) that the kernels use for elements
    ``start .. start + count`` of a bucket keyed by ``key`` (NumPy, for tests and oracles)."""
    return (_hash_np(key, start, count) >> np.uint32(8)) * _UNIT


def signs(key: int, start: int, count: int) -> np.ndarray:
    """The rotation's float64 signs (+1 or -1) of the ``count`` elements of one full block
    whose first element is bucket element ``start``, keyed by ``key``: element ``t`` takes
    -1 where bit ``t % 32`` of the hash (:func:`noise`'s) of index ``start + t // 32`` is
    set (the definition: :mod:`hvd_gqsgd.core`, "Rotation")."""
    t = np.arange(count, dtype=np.uint64)
    words = _hash_np(key, start, -(-count // 32))[t >> np.uint64(5)]
    return 1.0 - 2.0 * ((words >> (t & np.uint64(31)).astype(np.uint32)) & np.uint32(1))


def _hash_np(key: int, start: int, count: int) -> np.ndarray:
    """The kernels' 32-bit hash of every index ``start .. start + count`` (uint32)."""
    i = np.arange(start, start + count, dtype=np.uint64)
    k = np.uint64(key)
    key_low, key_high = np.uint32(k & np.uint64(0xFFFFFFFF)), np.uint32(k >> np.uint64(32))
    with np.errstate(over="ignore"):
        high = (i >> np.uint64(32)).astype(np.uint32)
        seed = key_low ^ _mix32_np(key_high + high)
        return _mix32_np(i.astype(np.uint32) + seed)


def _mix32_np(z: np.ndarray) -> np.ndarray:
    """The kernels' 32-bit hash (``_mix32``) on uint32 arrays."""
    z = np.asarray(z, dtype=np.uint32)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint32(16))) * np.uint32(0x7FEB352D)
        z = (z ^ (z >> np.uint32(15))) * np.uint32(0x846CA68B)
        return z ^ (z >> np.uint32(16))



if numba is not None:
    import numba.core.cgutils
    import numba.core.errors
    import numba.extending
    from llvmlite import ir

    _U = numba.uint32

    @numba.njit(inline="always")
    def _mix32(z):
        # A 32-bit integer hash: two multiply-xorshift rounds, full avalanche.  Every step is
        # cast back to uint32: numba widens integer arithmetic to 64 bits otherwise, and
        # 32-bit lanes are what AVX2 multiplies eight at a time.
        z = _U(z ^ (z >> _U(16)))
        z = _U(z * _U(0x7FEB352D))
        z = _U(z ^ (z >> _U(15)))
        z = _U(z * _U(0x846CA68B))
        return _U(z ^ (z >> _U(16)))

    @numba.njit(inline="always")
    def _seed(key, high):
        """The 32-bit seed of bucket elements ``high * 2**32 .. (high + 1) * 2**32``."""
        return _U(_U(key) ^ _mix32(_U(_U(key >> numba.uint64(32)) + _U(high))))

    # Hand-vectorized butterflies of the rotation, as numba intrinsics emitting LLVM vector IR
    # (_LANES elements of the array's dtype per vector; LLVM splits it into the registers
    # the CPU has).  Float arrays are 1-D, C-contiguous, float32 or float64; offsets are
    # element indices and, like numba's own indexing here, unchecked.

    _I32 = ir.IntType(32)

    def _ir_ints(values, width=_I32):
        return ir.Constant(ir.VectorType(width, len(values)), list(values))

    def _ir_splat(builder, value):
        vec = ir.VectorType(value.type, _LANES)
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, _I32(0))
        return builder.shuffle_vector(one, one, _ir_ints([0] * _LANES))

    def _check_lanes(*arrays):
        for a in arrays:
            if not (isinstance(a, numba.types.Array) and a.ndim == 1 and a.layout == "C"
                    and a.dtype in (numba.types.float32, numba.types.float64)
                    and a.dtype == arrays[0].dtype):
                raise numba.core.errors.TypingError(
                    f"the rotation's vector kernels take 1-D C-contiguous float32 or float64 "
                    f"arrays of one dtype, got {arrays}")

    def _ir_at(context, builder, arrty, arr, index, vector=True):
        """Pointer to arr[index] (index: an intp), as a vector of _LANES elements."""
        ptr = builder.gep(context.make_array(arrty)(context, builder, arr).data, [index])
        if not vector:
            return ptr
        vec = ir.VectorType(context.get_data_type(arrty.dtype), _LANES)
        return builder.bitcast(ptr, vec.as_pointer())

    def _ir_flip(builder, v, mask):
        # v with the sign bit flipped in the lanes where mask (a vector of i1) is set: the
        # bits of a negation
        ints = ir.VectorType(ir.IntType(64 if isinstance(v.type.element, ir.DoubleType)
                                        else 32), _LANES)
        zero = _ir_ints([0] * _LANES, ints.element)
        top = _ir_ints([1 << (ints.element.width - 1)] * _LANES, ints.element)
        flip = builder.select(mask, top, zero)
        return builder.bitcast(builder.xor(builder.bitcast(v, ints), flip), v.type)

    def _ir_in_lanes(builder, v):
        # Stages h = 1, 2, 4 inside one vector: lane j pairs with j + h where bit h of j is
        # clear.  With u the lanes swapped in pairs (u_j = v_(j xor h)), the pair's sum is
        # v_j + u_j in lane j and its difference u_j - v_j in lane j + h: u + c * v with
        # c_j = -1 in the upper lanes, one swap and one multiply-add per stage.  c * v is
        # exact, so fused or not (llvm.fmuladd leaves that to the target) it rounds once,
        # as u_j + v_j and u_j - v_j do.
        vec = v.type
        width = 32 if isinstance(vec.element, ir.FloatType) else 64
        fmuladd = numba.core.cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fmuladd.v{_LANES}f{width}")
        h = 1
        while h < _LANES:
            u = builder.shuffle_vector(v, v, _ir_ints([j ^ h for j in range(_LANES)]))
            c = ir.Constant(vec, [-1.0 if j & h else 1.0 for j in range(_LANES)])
            v = builder.call(fmuladd, [v, c, u])
            h += h
        return v

    def _ir_across(builder, vs):
        # log2(len(vs)) stages across the vectors vs: vector k pairs with k + h, h = 1, 2, ...
        vs, h = list(vs), 1
        while h < len(vs):
            for k in range(len(vs)):
                if not k & h:
                    a, b = vs[k], vs[k + h]
                    vs[k], vs[k + h] = builder.fadd(a, b), builder.fsub(a, b)
            h += h
        return vs

    def _ir_signed(context, builder, v, sig, args, at):
        # v times the scale (args[7], where given), then the signs of the block's 8 elements
        # from ``at`` (an intp, a multiple of 8): bit (at % 32) + k of the sign words'
        # (args[5]) word at / 32 flips lane k
        if len(args) > 7:
            scale = context.cast(builder, args[7], sig.args[7], sig.args[0].dtype)
            v = builder.fmul(v, _ir_splat(builder, scale))
        word = builder.load(_ir_at(context, builder, sig.args[5], args[5],
                                   builder.lshr(at, at.type(5)), False))
        shift = builder.trunc(builder.and_(at, at.type(31)), _I32)
        bits = builder.and_(_ir_splat(builder, builder.lshr(word, shift)),
                            _ir_ints([1 << k for k in range(_LANES)]))
        return _ir_flip(builder, v, builder.icmp_unsigned("!=", bits, _ir_ints([0] * _LANES)))

    def _make_butterflies(count, in_lanes, signs):
        """An intrinsic running, on ``count`` vectors h apart, the stages h = 1, 2, 4 inside
        each (with ``in_lanes``), then log2(count) stages across them (the vector k pairs
        with k + 1, then k + 2, ...).  ``signs=None``: ``(v, p, h)``, in place on v[p],
        v[p + h], ...  ``"in"``: ``(src, s, dst, d, h, sign_words, t)``, from src[s + kh]
        to dst[d + kh], each vector signed (as _ir_signed, for block element t + kh) before
        the stages; ``"out"``: ``(..., t, scale)``, each vector times ``scale`` and signed
        after them."""
        def codegen(context, builder, sig, args):
            def index(i):
                return context.cast(builder, args[i], sig.args[i], numba.types.intp)

            if signs is None:
                src = dst = (sig.args[0], args[0], index(1))
                h = index(2)
            else:
                src, dst = (sig.args[0], args[0], index(1)), (sig.args[2], args[2], index(3))
                h, t = index(4), index(6)
            align = sig.args[0].dtype.bitwidth // 8
            vs = []
            for k in range(count):
                off = builder.mul(h, h.type(k))
                v = builder.load(_ir_at(context, builder, src[0], src[1],
                                        builder.add(src[2], off)), align=align)
                if signs == "in":
                    v = _ir_signed(context, builder, v, sig, args, builder.add(t, off))
                vs.append(_ir_in_lanes(builder, v) if in_lanes else v)
            for k, v in enumerate(_ir_across(builder, vs)):
                off = builder.mul(h, h.type(k))
                if signs == "out":
                    v = _ir_signed(context, builder, v, sig, args, builder.add(t, off))
                builder.store(v, _ir_at(context, builder, dst[0], dst[1],
                                        builder.add(dst[2], off)), align=align)
            return context.get_dummy_value()

        def in_place(typingctx, v, p, h):
            _check_lanes(v)
            return numba.types.void(v, p, h), codegen

        def check_signed(src, dst, sign_words):
            _check_lanes(src, dst)
            if not (isinstance(sign_words, numba.types.Array)
                    and sign_words.dtype == numba.types.uint32):
                raise numba.core.errors.TypingError(
                    f"sign words are a uint32 array, not {sign_words}")

        def signed_in(typingctx, src, s, dst, d, h, sign_words, t):
            check_signed(src, dst, sign_words)
            return numba.types.void(src, s, dst, d, h, sign_words, t), codegen

        def signed_out(typingctx, src, s, dst, d, h, sign_words, t, scale):
            check_signed(src, dst, sign_words)
            return numba.types.void(src, s, dst, d, h, sign_words, t, scale), codegen

        butterflies = {None: in_place, "in": signed_in, "out": signed_out}[signs]
        butterflies.__name__ = f"_butterflies_{count}{'_lanes' if in_lanes else ''}_{signs}"
        return numba.extending.intrinsic(butterflies)

    # in place: stages 1, 2, 4 of one vector; 1 .. 32 of 64 elements (8 vectors, h = 8);
    # h .. 4h across 8 vectors, h .. 2h across 4, h across 2
    _wht_lanes, _wht_64 = _make_butterflies(1, True, None), _make_butterflies(8, True, None)
    _wht_across2, _wht_across4, _wht_across8 = (
        _make_butterflies(c, False, None) for c in (2, 4, 8))
    # the same, signed on the way in (the forward's first group) or out (the inverse's last)
    _wht_lanes_in, _wht_64_in = (_make_butterflies(1, True, "in"),
                                 _make_butterflies(8, True, "in"))
    _wht_lanes_out, _wht_64_out = (_make_butterflies(1, True, "out"),
                                   _make_butterflies(8, True, "out"))
    _wht_across2_out, _wht_across4_out, _wht_across8_out = (
        _make_butterflies(c, False, "out") for c in (2, 4, 8))

    @numba.njit(inline="always")
    def _magnitude_max(bits, lo, hi, magnitude_mask):
        """The largest of bits[lo:hi] & magnitude_mask (lo, hi unsigned: see _codes_run).
        For non-negative IEEE floats, integer order is float order, and NaN/Inf have the
        largest patterns: an integer max (which vectorizes) gives max|x| and flags
        non-finite.  Each masked word is cast back to its own width: numba widens the & of
        two uint32 to 64 bits, which vectorizes four lanes to an AVX2 vector with a compare
        and a blend, where 32-bit lanes take eight with one vpmaxud."""
        word = bits.dtype.type
        m = word(0)
        for i in range(lo, hi):
            m = max(m, word(bits[i] & magnitude_mask))
        return m

    def _items_absmax_bits(bits_view, item_lo, item_hi, magnitude_mask, out):
        # max |x| of each work item, as _magnitude_max takes it
        for w in numba.prange(item_lo.size):
            out[w] = _magnitude_max(bits_view, numba.uint64(item_lo[w]),
                                    numba.uint64(item_hi[w]), magnitude_mask)

    def _segment_l2(x, seg_start, out):
        for s in numba.prange(seg_start.size - 1):
            acc = np.zeros(8)  # independent partial sums break the add dependency chain
            lo, hi = seg_start[s], seg_start[s + 1]
            for i in range(lo, hi):
                v = numba.float64(x[i])
                acc[i & 7] += v * v
            total = acc.sum()
            out[s] = np.sqrt(total) if np.isfinite(total) else np.inf

    @numba.njit
    def _codes_run(x, lo, hi, mult, top, seed, codes):
        """codes[i] = floor(y) + (u_i < frac(y)) for elements lo..hi of one tensor, where
        y = clamp(x[i] * mult, -top, top) and u_i = noise(key, i) (``seed``: ``_seed`` of
        these elements).  u_i is a multiple of 2**-24 and frac(y) is exact in x's dtype, so
        the comparison is exact, and for float32 it runs in float32 lanes, eight per AVX2
        vector (float64 lanes are half as wide).  A NaN codes as +top (see _codes).

        Not inlined: computed in the same function as this loop, the seed kept it from
        vectorizing.  Indices are unsigned: numba then skips its negative-index wraparound
        select, which otherwise keeps it from vectorizing too."""
        unit = numba.float32(_UNIT)
        for i in range(lo, hi):
            r = numba.float32(numba.int32(_mix32(_U(_U(i) + seed)) >> _U(8)))
            v = x[i] * mult
            y = v if v < top else top  # two selects: a NaN test as well breaks the vector
            y = y if y > -top else -top
            low = np.floor(y)
            codes[i] = numba.int16(low) + numba.int16(r * unit < y - low)

    @numba.njit(inline="always")
    def _codes(x, lo, hi, mult, top, key, codes):
        """codes[i] for elements lo..hi of one tensor, whose multiplier is ``mult``.

        A NaN or Inf sits only in a tensor whose multiplier is 0: its local norm is inf, so
        its global scale is too (``core.multipliers``).  Such a tensor, like an all-zero
        one, gets code 0 everywhere without reading x, as ``core.quantize`` gives it.  (Were
        a NaN passed with a nonzero multiplier, _codes_run's selects would code it +top: in
        range, never an undefined integer conversion.)"""
        lo, hi = numba.uint64(lo), numba.uint64(hi)
        if mult == 0:
            for i in range(lo, hi):
                codes[i] = 0
            return
        high = lo >> numba.uint64(32)  # one seed per 2**32 elements: a cut in one item at most
        cut = min(hi, (high + numba.uint64(1)) << numba.uint64(32))
        _codes_run(x, lo, cut, mult, top, _seed(key, high), codes)
        if cut < hi:
            _codes_run(x, cut, hi, mult, top, _seed(key, high + numba.uint64(1)), codes)

    def _codes_pass(x, item_lo, item_hi, item_mult, top, key, codes):
        # work items never straddle tensors, so each runs with one multiplier
        for w in numba.prange(item_lo.size):
            _codes(x, item_lo[w], item_hi[w], item_mult[w], top, key, codes)

    @numba.njit
    def _pack(codes, bits, offset, words, j0, count):
        # Offset form of the signed-digit word: W = U - H with U = sum (q_k + half) 2^(bits k)
        # and H = sum half 2^(bits k).  Each q_k + half lies in [1, 2^bits - 1], so U is a
        # plain bit-field word (no carries) built with shifts and ORs; W = U - H mod 2^64 is
        # exactly core.pack's word.
        # int64 arithmetic: two-stage lanes are up to 32 bits wide (half = 2**31)
        lanes = numba.uint64(64 // bits)
        half = numba.int64(1) << numba.int64(bits - 1)
        for j in range(numba.uint64(j0), numba.uint64(j0 + count)):  # unsigned: see _codes_run
            u = numba.uint64(0)
            for k in range(lanes):
                u |= numba.uint64(numba.int64(codes[j * lanes + k]) + half) << numba.uint64(
                    bits * k)
            words[j] = numba.int64(u - offset)

    def _pack_pass(codes, bits, offset, words):
        per_block = BLOCK // (64 // bits)
        for b in numba.prange((words.size + per_block - 1) // per_block):
            j0 = b * per_block
            _pack(codes, bits, offset, words, j0, min(per_block, words.size - j0))

    def _unpack_scale(words, bits, start, out, scales, block, offset):
        # U = W + H turns the summed signed-digit word back into plain bit fields (every lane
        # sum S_k has |S_k| < half, so S_k + half is in [1, 2^bits - 1]): lanes decode
        # independently instead of being peeled one after another.  Element t takes
        # scales[t // block]: a word inside one block uses one scale, tracked without a
        # division per word (blk, rem: its first lane is element blk * block + rem).
        lanes = 64 // bits
        half = numba.int64(1) << numba.int64(bits - 1)
        mask = numba.uint64((1 << bits) - 1)
        stop = start + out.size
        j_first, j_last = start // lanes, (stop - 1) // lanes
        per_block = BLOCK // lanes
        for b in numba.prange((j_last - j_first + per_block) // per_block):
            jb0 = j_first + b * per_block
            base0 = jb0 * lanes - start
            blk = max(base0, 0) // block
            rem = base0 - blk * block  # negative only for a word before the tensor's start
            for j in range(jb0, min(j_last + 1, jb0 + per_block)):
                u = numba.uint64(words[j]) + offset
                base = j * lanes - start
                if base >= 0 and base + lanes <= out.size and rem + lanes <= block:
                    scale = scales[blk]  # interior word, inside one scale block
                    ubase = numba.uint64(base)  # unsigned index: see _codes_run
                    for k in range(numba.uint64(lanes)):
                        field = (u >> (numba.uint64(bits) * k)) & mask
                        out[ubase + k] = (numba.int64(field) - half) * scale
                else:  # the tensor, or a scale block, starts or ends inside this word
                    for k in range(lanes):
                        if 0 <= base + k < out.size:
                            field = (u >> numba.uint64(bits * k)) & mask
                            out[base + k] = (numba.int64(field) - half) * scales[
                                (base + k) // block]
                rem += lanes
                while rem >= block:
                    rem -= block
                    blk += 1


    def _from_lanes(words, flip, offset):
        # Byte lanes (see _byte_lanes): the bytes hold each code in two's complement, V.
        # Flipping every lane's top bit adds half to each lane without carries, giving U, and
        # W = U - H is the signed-digit word that core.pack builds.
        for j in numba.prange(words.size):
            words[j] = numba.int64((numba.uint64(words[j]) ^ flip) - offset)

    def _to_lanes(words, flip, offset):
        # The inverse on the summed words: U = W + H holds S_k + half in each lane (no
        # carries, see _unpack_scale), and flipping the top bits leaves S_k in two's complement.
        for j in numba.prange(words.size):
            words[j] = numba.int64((numba.uint64(words[j]) + offset) ^ flip)

    def _narrow(codes, out):
        """Whether ``out`` is float32 and every code converts to float32 exactly: int8 or
        int16 codes, or float32 ones (the decodes keep those below 2**24 in magnitude)."""

    @numba.extending.overload(_narrow)
    def _narrow_typed(codes, out):
        narrow = (out.dtype == numba.types.float32
                  and codes.dtype in (numba.types.int8, numba.types.int16, numba.types.float32))
        return lambda codes, out: narrow

    @numba.njit(inline="always")
    def _scale_run(codes, lane, out, o, count, scale):
        """out[o + t] = codes[lane + t] * scale for t < count (count unsigned: see
        _codes_run), the exact product rounded once into out's dtype: in float64, where a
        code of at most 32 bits times a float32 scale is exact and a float32 out rounds on
        the store.  With _narrow codes and a normal float32 scale the float32 multiply
        rounds the same exact product once, so it gives the same bits, eight lanes to a
        vector instead of four.  A subnormal (or non-finite) scale keeps float64, where
        float32 arithmetic on subnormals (a deep net's vanishing gradients) would run
        orders of magnitude slower."""
        if _narrow(codes, out) and _FLT_MIN <= abs(scale) <= _FLT_MAX:
            narrow = numba.float32(scale)
            for t in range(count):
                out[o + t] = numba.float32(codes[lane + t]) * narrow
        else:
            wide = numba.float64(scale)
            for t in range(count):
                out[o + t] = numba.float64(codes[lane + t]) * wide

    def _scale_lanes(lanes, start, out, scales, block):
        # out[t] = lanes[start + t] * scales[t // block], in work items of BLOCK elements
        # and, inside them, runs that share one scale, each product as _scale_run forms it
        for w in numba.prange((out.size + BLOCK - 1) // BLOCK):
            lo, hi = w * BLOCK, min(out.size, (w + 1) * BLOCK)
            while lo < hi:
                b = lo // block
                end = min(hi, (b + 1) * block)
                _scale_run(lanes, numba.uint64(start) + numba.uint64(lo), out,
                           numba.uint64(lo), numba.uint64(end - lo), scales[b])
                lo = end

    def _unpack_fields(words, bits, offset, out):
        # out[j * lanes + k] = lane k of word j as a signed integer, for every index below
        # out.size: U = W + H turns a signed-digit word (summed or not) into plain bit
        # fields (see _unpack_scale).  Word-major, so the stores are contiguous: lane-major
        # (one lane of a run of words at a time) vectorized the shifts but stored one
        # element every 64/bits, and was the slower of the two at every width timed.  4-bit
        # lanes go through the bytes of U, two lanes per byte in order on a little-endian
        # host, in a loop that vectorizes into float32 and int16 outputs
        # (benchmarks/cpu_cost.py --rotation times the decodes).
        lanes = numba.uint64(64 // bits)
        half = numba.int64(1) << numba.int64(bits - 1)
        mask = numba.uint64((1 << bits) - 1)
        full = min(numba.uint64(words.size), numba.uint64(out.size) // lanes)
        per = numba.uint64(BLOCK) // lanes
        for b in numba.prange((full + per - 1) // per):
            j0 = numba.uint64(b) * per
            j1 = min(full, j0 + per)
            if bits == 4 and _LITTLE_ENDIAN:
                plain = np.empty(j1 - j0, np.uint64)
                for j in range(j0, j1):  # unsigned: see _codes_run
                    plain[j - j0] = numba.uint64(words[j]) + offset
                nibbles = plain.view(np.uint8)
                o = j0 * lanes
                for i in range(numba.uint64(nibbles.size)):
                    v = nibbles[i]
                    # int32, not int64: AVX2 converts int32 to float eight at a time
                    out[o + i + i] = numba.int32(v & numba.uint8(15)) - numba.int32(8)
                    out[o + i + i + numba.uint64(1)] = numba.int32(v >> numba.uint8(4)) - \
                        numba.int32(8)
            else:
                for j in range(j0, j1):
                    u = numba.uint64(words[j]) + offset
                    for k in range(lanes):
                        field = (u >> (numba.uint64(bits) * numba.uint64(k))) & mask
                        out[j * lanes + k] = numba.int64(field) - half
        if full < words.size:  # the last word, cut by out's end
            u = numba.uint64(words[full]) + offset
            for k in range(lanes):
                t = full * lanes + numba.uint64(k)
                if t < out.size:
                    field = (u >> (numba.uint64(bits) * numba.uint64(k))) & mask
                    out[t] = numba.int64(field) - half

    def _scale_items(codes, item_lane, item_out, item_count, item_scale, out):
        # Item i is item_count[i] consecutive codes with one scale, from codes[item_lane[i]]
        # to out[item_out[i]] (a bucket's segments: Summed.unpack_bucket, in place where
        # codes is out; two-stage messages: Messages); each product as _scale_run forms it
        for i in numba.prange(item_lane.size):
            _scale_run(codes, numba.uint64(item_lane[i]), out, numba.uint64(item_out[i]),
                       numba.uint64(item_count[i]), item_scale[i])

    # The rotation (core, "Rotation").  Blocks of 8 elements and more go through the
    # intrinsics above, in groups of vectors that stay in registers: the forward's first
    # group reads the source, signs it and writes the destination, where the later groups
    # run in place while the block sits in L1; the inverse runs in place on its source up
    # to its last group, which scales, signs and writes the destination.  (numba's loop
    # vectorizer cannot prove a stage's two halves apart, and stages h < 8 pair the lanes
    # of one vector.)  Blocks of 2 and 4 take plain loops.

    @numba.njit
    def _sign_words(out, n, g, key):
        """The signs of the full block of n elements at global index g, one bit per element:
        out[w] is the hash of index g + w, and element t of the block takes -1 where bit
        t % 32 of out[t // 32] is set.  Fills ceil(n / 32) words (out: _sign_scratch(n)),
        in a loop per seed that vectorizes.  The seed changes where the index crosses a
        multiple of 2**32: once at most here, as n / 32 is at most 2**11."""
        words = (n + numba.uint64(31)) >> numba.uint64(5)
        high = g >> numba.uint64(32)
        cut = min(words, ((high + numba.uint64(1)) << numba.uint64(32)) - g)
        base = _U(_U(g) + _seed(key, high))  # index g + w hashes as _mix32(u32(w + base))
        for w in range(cut):
            out[w] = _mix32(_U(_U(w) + base))
        if cut < words:
            base = _U(_U(g) + _seed(key, high + numba.uint64(1)))
            for w in range(cut, words):
                out[w] = _mix32(_U(_U(w) + base))

    @numba.njit(inline="always")
    def _sign_scratch(block):
        """The sign words of one block, for _sign_words."""
        return np.empty(max(block >> 5, 1), np.uint32)

    @numba.njit
    def _small_block(src, s0, dst, d0, n, sb, scale):
        # Blocks of 2 and 4.  The forward (scale None): signs then butterflies; the inverse:
        # butterflies in place in src, then scale and signs
        if scale is None:
            for t in range(n):
                w = src[s0 + t]
                dst[d0 + t] = -w if (sb[0] >> t) & 1 else w
            v, lo = dst, d0
        else:
            v, lo = src, s0
        h = numba.uint64(1)
        while h < n:
            for j0 in range(lo, lo + n, h + h):
                for j in range(j0, j0 + h):
                    a, b = v[j], v[j + h]
                    v[j] = a + b
                    v[j + h] = a - b
            h += h
        if scale is not None:
            for t in range(n):
                w = src[s0 + t] * scale
                dst[d0 + t] = -w if (sb[0] >> t) & 1 else w

    @numba.njit(inline="always")
    def _span(h, block):
        # The stages after h that the next group runs: up to three (8 vectors)
        span = h + h
        if span < block:
            span += span
            if span < block:
                span += span
        return span

    @numba.njit(inline="always")
    def _across(v, p, h, span):
        # In place: the stages h .. span / 2 of the 2, 4 or 8 vectors at v[p], v[p + h], ...
        if span == h << numba.uint64(3):
            _wht_across8(v, p, h)
        elif span == h << numba.uint64(2):
            _wht_across4(v, p, h)
        else:
            _wht_across2(v, p, h)

    @numba.njit(inline="always")
    def _across_out(src, s, out, d, h, span, sb, t, scale):
        # _across from src[s], ..., into out[d], ..., scaled and signed (block element t)
        if span == h << numba.uint64(3):
            _wht_across8_out(src, s, out, d, h, sb, t, scale)
        elif span == h << numba.uint64(2):
            _wht_across4_out(src, s, out, d, h, sb, t, scale)
        else:
            _wht_across2_out(src, s, out, d, h, sb, t, scale)

    @numba.njit(inline="always")
    def _forward(x, lo, out, block, g, key, sb):
        """out[lo:lo + block] = H_B (d * x[lo:lo + block]) (out may be x); g: the global
        index of x[lo]; sb: _sign_scratch(block)."""
        _sign_words(sb, block, g, key)
        if block < _LANES:
            _small_block(x, lo, out, lo, block, sb, None)
            return
        # the first group: one vector (stages 1, 2, 4) or 64 elements (stages 1 .. 32)
        first = numba.uint64(8 * _LANES if block >= 8 * _LANES else _LANES)
        for t in range(0, block, first):
            if first == _LANES:
                _wht_lanes_in(x, lo + t, out, lo + t, _LANES, sb, t)
            else:
                _wht_64_in(x, lo + t, out, lo + t, _LANES, sb, t)
        h = first
        while h < block:
            span = _span(h, block)
            for t0 in range(0, block, span):
                for t in range(t0, t0 + h, _LANES):
                    _across(out, lo + t, h, span)
            h = span

    @numba.njit(inline="always")
    def _inverse(src, s0, out, lo, block, g, key, inv, sb):
        """out[lo:lo + block] = d * ((H_B src[s0:s0 + block]) * inv), transforming src in
        place up to the last group (src may be out at the same offset, or scratch)."""
        _sign_words(sb, block, g, key)
        if block < _LANES:
            _small_block(src, s0, out, lo, block, sb, inv)
            return
        first = numba.uint64(8 * _LANES if block >= 8 * _LANES else _LANES)  # as _forward's
        for t in range(0, block, first):
            if first == block and first == _LANES:  # one group, so the last
                _wht_lanes_out(src, s0 + t, out, lo + t, _LANES, sb, t, inv)
            elif first == block:
                _wht_64_out(src, s0 + t, out, lo + t, _LANES, sb, t, inv)
            elif first == _LANES:
                _wht_lanes(src, s0 + t, _LANES)
            else:
                _wht_64(src, s0 + t, _LANES)
        h = first
        while h < block:
            span = _span(h, block)
            for t0 in range(0, block, span):
                for t in range(t0, t0 + h, _LANES):
                    if span < block:
                        _across(src, s0 + t, h, span)
                    else:
                        _across_out(src, s0 + t, out, lo + t, h, span, sb, t, inv)
            h = span

    @numba.njit(inline="always")
    def _rotate_segment(x, out, lo, hi, block, key, start, sb):
        # A full block rotated into out; any other segment copied
        if hi - lo == block:
            _forward(x, lo, out, block, start + lo, key, sb)
        else:
            for i in range(lo, hi):
                out[i] = x[i]

    @numba.njit(inline="always")
    def _groups(segments, block):
        # Segments per parallel work item (about BLOCK elements), and the item count
        per = max(1, BLOCK // block)
        return per, (segments + per - 1) // per

    def _rotate_absmax(x, out, out_bits, bounds, block, key, start, magnitude_mask,
                       partial):
        # Every segment rotated (or copied) into out, then its max |.| (_magnitude_max, as
        # _items_absmax_bits takes it) from the bits of out just written (still in cache)
        per, items = _groups(bounds.size - 1, block)
        n = numba.uint64(block)
        for w in numba.prange(items):
            sb = _sign_scratch(block)
            for s in range(w * per, min((w + 1) * per, bounds.size - 1)):
                lo, hi = numba.uint64(bounds[s]), numba.uint64(bounds[s + 1])
                _rotate_segment(x, out, lo, hi, n, key, numba.uint64(start), sb)
                partial[s] = _magnitude_max(out_bits, lo, hi, magnitude_mask)

    def _rotate_l2(x, out, bounds, block, key, start, norms):
        # As _rotate_absmax, with the L2 norm summed exactly as _segment_l2 sums it
        per, items = _groups(bounds.size - 1, block)
        n = numba.uint64(block)
        for w in numba.prange(items):
            sb = _sign_scratch(block)
            for s in range(w * per, min((w + 1) * per, bounds.size - 1)):
                lo, hi = numba.uint64(bounds[s]), numba.uint64(bounds[s + 1])
                _rotate_segment(x, out, lo, hi, n, key, numba.uint64(start), sb)
                acc = np.zeros(8)
                for i in range(lo, hi):
                    v = numba.float64(out[i])
                    acc[i & numba.uint64(7)] += v * v
                total = acc.sum()
                norms[s] = np.sqrt(total) if np.isfinite(total) else np.inf

    def _scale_unrotate_items(codes, seg_lo, seg_hi, seg_i0, seg_i1, item_lane, item_out,
                              item_count, item_scale, out, block, key, start, inv):
        # out = codes times their scale, as _scale_items forms it (_scale_run), and every
        # full block then rotated back
        # before it is stored.  Segment s is out[seg_lo[s]:seg_hi[s]], filled by the items
        # seg_i0[s] .. seg_i1[s] (Summed: one per segment; Messages: its parts' items); a
        # full block's items go into scratch, then _inverse, any other segment's to out
        per, items = _groups(seg_lo.size, block)
        n = numba.uint64(block)
        for w in numba.prange(items):
            buf, sb = np.empty(block, out.dtype), _sign_scratch(block)
            for s in range(w * per, min((w + 1) * per, seg_lo.size)):
                lo, hi = numba.uint64(seg_lo[s]), numba.uint64(seg_hi[s])
                full = hi - lo == n
                for i in range(seg_i0[s], seg_i1[s]):
                    lane, o = numba.uint64(item_lane[i]), numba.uint64(item_out[i])
                    count = numba.uint64(item_count[i])
                    if full:
                        _scale_run(codes, lane, buf, o - lo, count, item_scale[i])
                    else:
                        _scale_run(codes, lane, out, o, count, item_scale[i])
                if full:
                    _inverse(buf, numba.uint64(0), out, lo, n, numba.uint64(start) + lo, key,
                             inv, sb)

    def _unrotate(v, bounds, block, key, start, inv):
        per, items = _groups(bounds.size - 1, block)
        n = numba.uint64(block)
        for w in numba.prange(items):
            sb = _sign_scratch(block)
            for s in range(w * per, min((w + 1) * per, bounds.size - 1)):
                lo, hi = numba.uint64(bounds[s]), numba.uint64(bounds[s + 1])
                if hi - lo == n:
                    _inverse(v, lo, v, lo, n, numba.uint64(start) + lo, key, inv, sb)

    def _twin(fn):
        """Compile ``fn`` twice: threaded for big inputs, serial for small ones (a threaded
        launch costs more than a small tensor's whole work).  The serial twin
        releases the GIL, so that Python threads (TF's host calls, WireWatch's signals) run
        while it works; the threaded one keeps it, which also keeps two threaded launches
        from overlapping (numba's workqueue layer aborts on that).

        The serial twin compiles a copy of ``fn`` named ``<name>_serial``: numba's disk
        cache keys an entry by the function's name, line, bytecode and signature, not by
        its compile options, so two twins of one function would share entries, and either
        would load whichever twin saved first: a serial twin running threaded code starts
        numba's thread pool beside the framework's threads, keeps the GIL, and
        oversubscribes the cores every rank shares."""
        serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                    fn.__closure__)
        serial.__qualname__ = f"{fn.__qualname__}_serial"
        return (numba.njit(parallel=True, cache=True)(fn),
                numba.njit(cache=True, nogil=True)(serial))

    _items_absmax_bits = _twin(_items_absmax_bits)
    _segment_l2 = _twin(_segment_l2)
    _codes_pass = _twin(_codes_pass)
    _pack_pass = _twin(_pack_pass)
    _unpack_scale = _twin(_unpack_scale)
    _from_lanes = _twin(_from_lanes)
    _to_lanes = _twin(_to_lanes)
    _scale_lanes = _twin(_scale_lanes)
    _unpack_fields = _twin(_unpack_fields)
    _scale_items = _twin(_scale_items)
    _rotate_absmax = _twin(_rotate_absmax)
    _rotate_l2 = _twin(_rotate_l2)
    _unrotate = _twin(_unrotate)
    _scale_unrotate_items = _twin(_scale_unrotate_items)


# ranks that launchers start on one host: Open MPI, horovodrun (Gloo), torchrun, MPICH/Hydra
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE",
                    "MPI_LOCALNRANKS")
_budget: int | None = None  # thread_budget() of this process, read at the first big kernel


def thread_budget(environ: Mapping[str, str] = os.environ, cpus: int | None = None) -> int:
    """Threads one kernel call may use in this process (at least 1), from the first of:

    1. ``NUMBA_NUM_THREADS``, when set (numba's own setting);
    2. ``OMP_NUM_THREADS``, when set: the per-rank thread count that multi-rank jobs already
       set for torch and TF (torchrun sets 1 when it starts several ranks per node; so does
       this project's Makefile);
    3. the CPUs this process may run on (``cpus``, default its affinity mask) divided by the
       ranks its launcher started on this host (``OMPI_COMM_WORLD_LOCAL_SIZE``,
       ``HOROVOD_LOCAL_SIZE``, ``LOCAL_WORLD_SIZE`` or ``MPI_LOCALNRANKS``).

    Why not numba's default of one thread per CPU in every rank: the threaded twins run on
    numba's OpenMP pool, whose idle threads spin before they sleep.  With more ranks than
    CPUs that spinning takes the CPUs from everything else, steps that call no kernel
    included (seen with the local-SGD study's 4 ranks on 2 CPUs).
    """
    if "NUMBA_NUM_THREADS" in environ:
        return _positive_int(environ, "NUMBA_NUM_THREADS")
    if "OMP_NUM_THREADS" in environ:
        return _positive_int(environ, "OMP_NUM_THREADS")
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    local = next((_positive_int(environ, v, "rank count") for v in _LOCAL_SIZE_VARS
                  if v in environ), 1)
    return max(1, cpus // local)


def _positive_int(environ: Mapping[str, str], name: str, what: str = "thread count") -> int:
    first = environ[name].split(",")[0].strip()  # OMP_NUM_THREADS may list nested levels
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"{name}={environ[name]!r} is not a positive {what}; hvd_gqsgd's "
                         f"CPU kernels read it to size their thread pool (see "
                         f"hvd_gqsgd.kernels.thread_budget). Set it to an integer >= 1.")
    return int(first)


def _threads() -> int:
    global _budget
    if _budget is None:
        _budget = min(thread_budget(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    return _budget


def _run(kernel, size: int, *args) -> None:
    """Run the threaded twin of ``kernel`` when ``size`` elements make it worth it and the
    process's :func:`thread_budget` allows more than one thread (and this is not the overlap
    thread, see :class:`WireWatch`); else the serial twin, which starts no thread pool."""
    threads = _threads() if size >= PARALLEL_MIN and not getattr(_SERIAL, "only", False) else 1
    if threads > 1:
        numba.set_num_threads(threads)  # numba keeps this count per calling thread
        kernel[0](*args)
    else:
        kernel[1](*args)


# A chunk quantized while earlier chunks are on the wire runs on a worker thread this much
# nicer than its caller (HVD_GQSGD_OVERLAP_NICE; 0, the default: on the caller)
OVERLAP_NICE_VAR = "HVD_GQSGD_OVERLAP_NICE"
DEFAULT_OVERLAP_NICE = 0
# (pid, nice, pool); no pool when nice is 0
_overlap_worker: tuple[int, int, ThreadPoolExecutor | None] | None = None
_overlap_lock = threading.Lock()
_SERIAL = threading.local()  # .only is True on the overlap thread: serial twins only


def overlap_nice(environ: Mapping[str, str] = os.environ) -> int:
    """How much nicer than its caller :class:`WireWatch` quantizes a chunk while earlier
    chunks are on the wire: ``HVD_GQSGD_OVERLAP_NICE`` (0-19), default 0 (on the calling
    thread, at its priority).

    What it is for: a chunk is quantized much faster than a 1 Gbit/s link sends it, so the
    overlap has slack, but the transfer needs CPU too (Open MPI's progress thread
    busy-polls its sockets, and the kernel runs TCP).  Where every core is busy, quantizing
    at the same priority takes that CPU from the transfer it should hide behind.  Which way
    it goes depends on the links and the cores (docs/BENCHMARKS.md has runs both ways);
    hence off by default."""
    if OVERLAP_NICE_VAR not in environ:
        return DEFAULT_OVERLAP_NICE
    value = environ[OVERLAP_NICE_VAR].strip()
    if not value.isdigit() or int(value) > 19:
        raise ValueError(f"{OVERLAP_NICE_VAR}={environ[OVERLAP_NICE_VAR]!r} is not a niceness "
                         f"increment from 0 to 19; hvd_gqsgd quantizes a chunk that overlaps "
                         f"earlier chunks' transfer that much nicer than its caller (0: at the "
                         f"caller's own priority).")
    return int(value)


def _overlap_pool() -> tuple[int, ThreadPoolExecutor | None]:
    """This process's overlap thread and its niceness increment, started at first use (and
    again in a forked child, which has the record but not the thread).  Increment 0, or a
    platform where a thread's niceness is not its own (Linux sets it per thread; elsewhere
    ``setpriority`` acts on the process): no thread."""
    global _overlap_worker
    with _overlap_lock:
        if _overlap_worker is None or _overlap_worker[0] != os.getpid():
            nice = overlap_nice() if sys.platform.startswith("linux") else 0
            pool = None
            if nice:
                pool = ThreadPoolExecutor(1, thread_name_prefix="hvd_gqsgd-overlap")
                try:
                    pool.submit(_start_overlap_thread, nice).result()  # raises if it fails
                except BaseException:
                    pool.shutdown(wait=False)
                    raise
            _overlap_worker = (os.getpid(), nice, pool)
        _, nice, pool = _overlap_worker
    return nice, pool


def _start_overlap_thread(step: int) -> None:
    """On the overlap thread: serial kernels only (a serial twin releases the GIL, so the
    caller's signals and its own take-over run meanwhile), and ``step`` nicer (capped at 19).
    Raising niceness needs no privilege, so a failure here is unexpected and reported."""
    _SERIAL.only = True
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except OSError as e:
        raise RuntimeError(f"hvd_gqsgd could not lower the priority of its overlap thread "
                           f"({e}); set {OVERLAP_NICE_VAR}=0 to quantize overlapping chunks "
                           f"at the caller's priority") from e


class WireWatch:
    """One bucket's chunks on the wire during a step, so that a chunk quantized while earlier
    ones are in flight uses only CPU that their transfer leaves over.

    A chunk is *sent* once its words exist (its Sum allreduce can start) and *back* once its
    sum has arrived.  :meth:`quantize_pack` codes a later chunk on the overlap thread
    (:func:`overlap_nice` steps nicer), piece by piece, while some sent chunk is not back.
    The caller codes the pieces the overlap thread has not taken yet, at its own priority,
    once the wire is about to run dry: when every sent chunk is back, or earlier, at
    :meth:`_deadline`, from the first chunk's round trip and coding time (on a fast link
    that is at once).  An element's code depends on its index only, so which thread codes
    which piece never changes a bit.

    With :func:`overlap_nice` 0 (the default) it simply quantizes on the calling thread.
    Counters are per step (:meth:`first`); a tf.function run from two threads at once mixes
    them, which costs speed, never correctness."""

    PIECES = 16  # per chunk: after a take-over the caller waits for one piece at most

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._started = 0.0  # when this step's first chunk began
        self._sent: list[float] = []  # when each chunk of this step was sent
        self._back = 0
        # Seconds, from the last step that measured them (None: not yet): the first chunk's
        # quantize at full priority, and its round trip (it goes alone, on an idle wire)
        self._coding_s: float | None = None
        self._round_trip_s: float | None = None

    def first(self) -> None:
        """The bucket's first chunk is about to be quantized: a new step."""
        with self._cond:
            self._sent, self._back = [], 0
            self._started = time.perf_counter()

    def sent(self) -> None:
        with self._cond:
            self._sent.append(time.perf_counter())
            if len(self._sent) == 1:
                self._coding_s = self._sent[0] - self._started

    def back(self) -> None:
        with self._cond:
            self._back += 1
            if self._back == 1 and self._sent:
                self._round_trip_s = time.perf_counter() - self._sent[0]
            self._cond.notify_all()

    def _deadline(self) -> float:
        """When the caller joins in even though chunks are still out: the wire is expected to
        run dry one round trip after the last chunk was sent, and the caller alone needs
        about a first chunk's coding time.  Without both figures (a first step): now."""
        if self._round_trip_s is None or self._coding_s is None or not self._sent:
            return 0.0
        return self._sent[-1] + self._round_trip_s - self._coding_s

    def quantize_pack(self, x: np.ndarray, counts: Sequence[int] | np.ndarray, mult: np.ndarray,
                      level: int, bits: int, key: int, words: np.ndarray) -> None:
        """:func:`quantize_pack` of a later chunk, behind the wire as described above."""
        _, pool = _overlap_pool()
        if pool is None:
            quantize_pack(x, counts, mult, level, bits, key, words)
            return
        job = _QuantizeJob(x, counts, mult, level, bits, key, words, pieces=self.PIECES,
                           shared=True)
        helper = pool.submit(job.work, True)
        helper.add_done_callback(self._wake)
        with self._cond:
            while not helper.done() and job.front < job.back and self._back < len(self._sent):
                left = self._deadline() - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
        job.work(front=False)  # the wire runs dry: code what the overlap thread has not taken
        job.finish()

    def _wake(self, _: Any) -> None:
        with self._cond:
            self._cond.notify_all()


def _offset(bits: int) -> np.uint64:
    """H = sum_k half * 2^(bits k) over the lanes of a word (see _pack)."""
    half = 1 << (bits - 1)
    return np.uint64(sum(half << (bits * k) for k in range(64 // bits)))


def _byte_lanes(bits: int) -> type | None:
    """The integer type of one lane when lanes are whole bytes (8 or 16 bits on a
    little-endian host), so a word's lane k is element k of the words viewed as that type;
    else None.  Codes then go straight into the words (no int16 buffer, no packing pass)."""
    if not _LITTLE_ENDIAN:
        return None
    return {8: np.int8, 16: np.int16}.get(bits)


def _flip(bits: int) -> np.uint64:
    """The top bit of every lane of a word."""
    return np.uint64(sum(1 << (bits * (k + 1) - 1) for k in range(64 // bits)))


def _derived(counts: Sequence[int] | np.ndarray, name: str, make: Any) -> Any:
    """``make(counts as int64)``: an array that a kernel derives from a bucket's segment
    counts.  For a tuple, made once and kept (read-only) while the tuple is one of the last
    ``_DERIVED_MAX`` used: a layout's counts (:func:`hvd_gqsgd.core.segments`) are the same
    tuple at every step, and converting 65536 segments of a 64 MB bucket cost milliseconds
    a call.  Keyed by identity, which the kept tuple keeps unique; a tuple never changes."""
    if not isinstance(counts, tuple):
        return make(np.asarray(counts, dtype=np.int64))
    with _DERIVED_LOCK:
        entry = _DERIVED.pop(id(counts), None)
        if entry is None or entry[0] is not counts:
            entry = (counts, {})
        _DERIVED[id(counts)] = entry  # the most recent last
        while len(_DERIVED) > _DERIVED_MAX:
            del _DERIVED[next(iter(_DERIVED))]
        cache = entry[1]
        value = cache.get(name)
        if value is None:
            array = cache.get("array")
            if array is None:
                array = cache["array"] = np.array(counts, dtype=np.int64)
                array.flags.writeable = False
            value = cache[name] = make(array)
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
            else:
                for v in value:
                    v.flags.writeable = False
        return value


_DERIVED: dict[int, tuple[tuple[int, ...], dict[str, Any]]] = {}
_DERIVED_LOCK = threading.Lock()
_DERIVED_MAX = 16


def _work_items(counts: Sequence[int] | np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a bucket into work items of at most BLOCK elements that never straddle two
    tensors: (tensor index, first element, end element) per item."""
    return _derived(counts, "items", _make_work_items)


def _make_work_items(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pieces = -(-counts // BLOCK)
    seg = np.repeat(np.arange(len(counts)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    lo = starts[seg] + (np.arange(seg.size) - first) * BLOCK
    hi = np.minimum(lo + BLOCK, starts[seg] + counts[seg])
    return seg, lo, hi


def _segment_items(counts: Sequence[int], lo: int, hi: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_work_items` of segments of ``counts`` elements, cut to the bucket elements
    ``lo .. hi``: each item's first element (counted from ``lo``), its element count, and
    its segment.  The whole bucket's are kept with the counts (``_derived``), so that a
    decode does not cut every block's item again (at 64-element blocks a 64 MB bucket has
    262144)."""
    seg, a, b = _work_items(counts)
    if lo == 0 and hi >= (b[-1] if b.size else 0):
        return _derived(counts, "whole_items", _make_whole_items)
    return _cut_items(seg, a, b, lo, hi)


def _cut_items(seg: np.ndarray, a: np.ndarray, b: np.ndarray, lo: int, hi: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b = np.clip(a, lo, hi), np.clip(b, lo, hi)
    keep = b > a
    return a[keep] - lo, (b - a)[keep], seg[keep]


def _make_whole_items(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    seg, a, b = _make_work_items(counts)
    return _cut_items(seg, a, b, 0, int(b[-1]) if b.size else 0)


def segment_norms(x: np.ndarray, counts: Sequence[int] | np.ndarray, norm: str
                  ) -> np.ndarray:
    """Per-tensor max |x| (``norm="max"``) or L2 norm of a flat bucket, float64; ``inf`` for
    a tensor holding any NaN/Inf (so it wins the MAX exchange on every rank)."""
    out = np.empty(len(counts), dtype=np.float64)
    if norm == "l2":
        _run(_segment_l2, x.size, x, _bounds(counts), out)
        return out
    seg, lo, hi = _work_items(counts)
    uint = np.uint32 if x.dtype == np.float32 else np.uint64
    partial = np.empty(seg.size, dtype=uint)
    _run(_items_absmax_bits, x.size, x.view(uint), lo, hi, uint(np.iinfo(uint).max >> 1),
         partial)
    first_item = _derived(counts, "first_item", lambda c: np.concatenate(
        [[0], np.cumsum(-(-c // BLOCK))[:-1]]))
    absmax = np.maximum.reduceat(partial, first_item).view(x.dtype).astype(np.float64)
    return np.where(np.isfinite(absmax), absmax, np.inf)


def rotate_norms(x: np.ndarray, counts: Sequence[int], block: int, key: int, norm: str,
                 out: np.ndarray, start: int = 0) -> np.ndarray:
    """The forward rotation (:mod:`hvd_gqsgd.core`, "Rotation") of the flat bucket ``x``
    (float32/64; segment ``s`` is the next ``counts[s]`` elements, ``x[0]`` is bucket element
    ``start``) into ``out`` (same dtype and size): every full block (``block`` elements)
    rotated with the signs keyed by ``key``, every other segment copied.  Returns the
    per-segment norms of ``out``, float64, exactly as :func:`segment_norms` of ``out`` gives
    them (``inf`` for a segment with a NaN/Inf), computed while each segment is still in
    cache.  Bit for bit what :func:`hvd_gqsgd.core.rotate` computes.

    ``out`` may be ``x`` itself when the caller owns it (a bucket's own flat copy): each
    block is read whole before it is written, and in place saves the reads that the first
    write to each line of a separate buffer costs.  Never in place on a user's tensor."""
    bounds = _bounds(counts)
    if norm == "l2":
        norms = np.empty(bounds.size - 1, dtype=np.float64)
        _run(_rotate_l2, x.size, x, out, bounds, block, np.uint64(key), start, norms)
        return norms
    uint = np.uint32 if x.dtype == np.float32 else np.uint64
    partial = np.empty(bounds.size - 1, dtype=uint)
    _run(_rotate_absmax, x.size, x, out, out.view(uint), bounds, block, np.uint64(key), start,
         uint(np.iinfo(uint).max >> 1), partial)
    absmax = partial.view(x.dtype).astype(np.float64)
    return np.where(np.isfinite(absmax), absmax, np.inf)


def unrotate(x: np.ndarray, counts: Sequence[int], block: int, key: int, start: int = 0
             ) -> None:
    """The inverse rotation of every full block of ``x`` (as :func:`rotate_norms` lays the
    bucket out), in place: bit for bit ``core.rotate(..., inverse=True)``.  After decoding,
    ``Summed.unpack_bucket(..., rotation=(block, key))`` does the same in the decode's own
    pass over the bucket."""
    _run(_unrotate, x.size, x, _bounds(counts), block, np.uint64(key), start,
         x.dtype.type(1.0 / block))


def window_segments(counts: Sequence[int] | np.ndarray, start: int, size: int, block: int
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    """The segments of ``counts`` (each positive) cut to the bucket elements ``start ..
    start + size``: their first and end elements (counted from ``start``), and the index of
    the first of them (they are consecutive).  Refuses a window that cuts a full block
    (``block`` elements), whose inverse rotation needs all of it."""
    bounds = _bounds(counts)
    if size <= 0:
        return bounds[:0], bounds[:0], 0
    stop = start + size
    first = int(np.searchsorted(bounds, start, side="right")) - 1  # the one holding start
    last = int(np.searchsorted(bounds, stop, side="left"))  # past the one holding stop - 1
    lo = np.maximum(bounds[first:last], start) - start
    hi = np.minimum(bounds[first + 1:last + 1], stop) - start
    for s in (first, last - 1):  # only the window's ends can cut a segment
        whole = int(bounds[s + 1] - bounds[s])
        if whole == block and hi[s - first] - lo[s - first] != block:
            raise ValueError(f"elements {start}..{stop} of the bucket cut the full block at "
                             f"element {int(bounds[s])}, which a rotation transforms as a "
                             "whole: decode the bucket whole, or in windows of whole blocks")
    return lo, hi, first


def _bounds(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """Segment boundaries: 0, then the running total of ``counts`` (int64)."""
    return _derived(counts, "bounds", lambda c: np.concatenate([[0], np.cumsum(c)]))


def quantize_pack(x: np.ndarray, counts: Sequence[int] | np.ndarray, mult: np.ndarray,
                  level: int, bits: int, key: int, words: np.ndarray) -> None:
    """Quantize flat ``x`` (float32/64; tensor ``s`` is the next ``counts[s]`` elements,
    multiplier ``mult[s] = L / s``) and pack into ``words`` (int64, ``packed_words`` long).

    Two passes, each a loop simple enough to vectorize: codes (work items of at most BLOCK
    elements inside one tensor, so one multiplier each), then packing, or with byte lanes
    the fix-up of the words that the codes were written into."""
    job = _QuantizeJob(x, counts, mult, level, bits, key, words, pieces=1, shared=False)
    job.work(front=True)
    job.finish()


class _QuantizeJob:
    """:func:`quantize_pack` cut into ``pieces`` runs of whole work items, which any threads
    may claim (from the front or the back) and code in any order: an element's code depends
    on its own index only, so who codes which piece never changes a bit.  :meth:`finish`
    packs once every piece is coded.  ``shared``: the int16 codes (when lanes are not whole
    bytes) go to a buffer of the job's own, not the calling thread's scratch."""

    def __init__(self, x: np.ndarray, counts: Sequence[int] | np.ndarray, mult: np.ndarray,
                 level: int, bits: int, key: int, words: np.ndarray, pieces: int,
                 shared: bool) -> None:
        seg, self.item_lo, self.item_hi = _work_items(counts)
        self.item_mult = np.asarray(mult).astype(x.dtype)[seg]
        self.x, self.bits, self.words = x, bits, words
        self.top, self.key = x.dtype.type(level), np.uint64(key)
        self.lane = _byte_lanes(bits)
        n = words.size * (64 // bits)
        self.codes: np.ndarray
        if self.lane:
            self.codes = words.view(self.lane)
        else:
            self.codes = host_array(n, np.int16) if shared else _scratch(n)
        self.codes[x.size:] = 0  # padding lanes of the last word: code 0, as in core.pack
        self.bounds = np.linspace(0, self.item_lo.size, max(1, pieces) + 1).astype(np.int64)
        self.front, self.back = 0, len(self.bounds) - 1  # unclaimed pieces: front..back-1
        self.coded = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def work(self, front: bool) -> None:
        """Claim and code pieces, from the front or the back, until none is left."""
        while True:
            with self.cond:
                if self.front == self.back:
                    return
                if front:
                    i, self.front = self.front, self.front + 1
                else:
                    self.back -= 1
                    i = self.back
            a, b = self.bounds[i], self.bounds[i + 1]
            try:
                if b > a:
                    size = int(self.item_hi[b - 1] - self.item_lo[a])
                    _run(_codes_pass, size, self.x, self.item_lo[a:b], self.item_hi[a:b],
                         self.item_mult[a:b], self.top, self.key, self.codes)
            except BaseException as e:
                self.error = e  # finish() raises it in the thread that waits for the words
                raise
            finally:
                with self.cond:
                    self.coded += 1
                    self.cond.notify_all()

    def finish(self) -> None:
        """Wait until every piece is coded (by any thread), then pack; a piece's exception,
        whichever thread met it, is raised here."""
        with self.cond:
            while self.coded < len(self.bounds) - 1:
                self.cond.wait()
        if self.error is not None:
            raise self.error
        if self.lane:
            _run(_from_lanes, self.x.size, self.words, _flip(self.bits), _offset(self.bits))
        else:
            _run(_pack_pass, self.x.size, self.codes, self.bits, _offset(self.bits),
                 self.words)


_SCRATCH = threading.local()  # reused int16 code buffer: a fresh one per call page-faults


def _scratch(size: int) -> np.ndarray:
    buf = getattr(_SCRATCH, "codes", None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1 << 16), dtype=np.int16)
        _SCRATCH.codes = buf
    return buf[:size]


ALIGN = 64  # bytes: host_array's alignment (at least EIGEN_MAX_ALIGN_BYTES for TF)
_POOL_MIN = 1 << 20  # bytes: smaller buffers are cheap to allocate afresh
# Per size: bytes of buffers kept beyond the first.  Each bucket's decoded gradient lives
# until the framework drops it, so a step holds one buffer per bucket at once (8 for the
# deep model's 64 MB in 8 MiB buckets); with less, all but one would fault in fresh pages
# every step (studies/deep_timeline.py shows where a step's time goes).
# The pool never holds more than the most buffers of a size that were in use at once.
_POOL_BYTES = 256 << 20
_pool: dict[int, list[np.ndarray]] = {}
_pool_lock = threading.Lock()


def host_array(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array, its data ``ALIGN``-byte aligned, for results the adapters hand
    to their framework (which then owns them for as long as it keeps the tensor).

    Buffers of ``_POOL_MIN`` bytes and more are recycled (:func:`_recycled`): a fresh 64 MB
    buffer costs its page faults again every step.  NumPy memory, not the framework's:
    NumPy asks for transparent huge pages on large buffers, which a framework's allocator
    does not where THP is in "madvise" mode."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) if isinstance(shape, tuple) else int(shape)  # not np.prod: slow
    nbytes = size * dtype.itemsize
    raw = _recycled(nbytes) if nbytes >= _POOL_MIN else np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def _free_refs() -> int:
    """What ``sys.getrefcount`` says of a pooled buffer that nothing else references: the
    pool's list, the loop variable and the call's own argument (measured, not assumed)."""
    pool = [np.empty(1, np.uint8)]
    for raw in pool:
        return sys.getrefcount(raw)
    raise AssertionError("unreachable")


_FREE_REFS = _free_refs()


def _recycled(nbytes: int) -> np.ndarray:
    """A byte buffer of ``nbytes + ALIGN``: a pooled one that nothing references any more,
    else a new one, kept in the pool while it holds fewer than
    ``max(1, _POOL_BYTES // nbytes)`` of this size.

    Whatever uses a buffer references it: a view of it (any NumPy view keeps its base), the
    torch tensor ``from_numpy`` made of it, or the TF tensor that ``numpy_function`` aliased
    to it (TF drops that reference only when the tensor's memory is freed).  A reference
    count at the floor therefore means that nothing uses it."""
    with _pool_lock:
        pool = _pool.setdefault(nbytes, [])
        for raw in pool:
            if sys.getrefcount(raw) == _FREE_REFS:
                return raw
        raw = np.empty(nbytes + ALIGN, np.uint8)
        if len(pool) < max(1, _POOL_BYTES // nbytes):
            pool.append(raw)
        return raw


class Summed:
    """A bucket's summed words, decoded one tensor at a time.

    Takes ownership of ``words``: with byte lanes (8 or 16 bits) they are rewritten in place,
    once, so that each lane holds its sum as a plain int8/int16 and decoding a tensor is one
    multiply per element; other widths decode lane fields from the words directly."""

    def __init__(self, words: np.ndarray, bits: int) -> None:
        self.bits = bits
        self.words = words
        self.lanes: np.ndarray | None = None
        lane = _byte_lanes(bits)
        if lane:
            _run(_to_lanes, words.size * (64 // bits), words, _flip(bits), _offset(bits))
            self.lanes = words.view(lane)

    def unpack_bucket(self, out: np.ndarray, counts: Sequence[int], scales: np.ndarray,
                      start: int = 0, rotation: tuple[int, int] | None = None) -> None:
        """Every scale segment of the bucket into the flat ``out``, in one kernel call:
        segment ``i`` holds the next ``counts[i]`` elements (:func:`hvd_gqsgd.core.segments`)
        and takes ``scales[i]`` (in ``out``'s dtype).

        ``start > 0``: these words are a chunk (:func:`hvd_gqsgd.core.chunk_plan`, cut at a
        word boundary) whose first lane is bucket element ``start``, and ``out`` receives
        bucket elements ``start .. start + out.size``.

        ``rotation=(block, key)``: then the inverse rotation of every full block, fused:
        each block is scaled, transformed and written once, where :func:`unrotate` after
        decoding reads and writes ``out`` once more; bit for bit ``unrotate(out, counts,
        block, key, start)`` after the plain decode.  A full block must lie wholly inside
        ``out`` (a chunk that cuts one is refused)."""
        if not out.size:
            return
        if self.lanes is not None:
            codes = self.lanes
        else:
            if start % (64 // self.bits):
                raise ValueError(f"a chunk starts at a word boundary, not at element {start}")
            # Other widths: the lane sums first (exact in out's dtype: below 2**24 up to 25
            # bits), then every segment times its scale, in place
            exact = out.dtype == np.float64 or self.bits <= 25
            codes = out if exact else host_array(out.size, np.float64)
            _run(_unpack_fields, out.size, self.words, self.bits, _offset(self.bits), codes)
        if rotation is not None:
            block, key = rotation
            lo, hi, first = window_segments(counts, start, out.size, block)
            scale = np.asarray(scales, dtype=out.dtype)[first:first + lo.size]
            one = np.arange(lo.size, dtype=np.int64)  # one item per segment
            _run(_scale_unrotate_items, out.size, codes, lo, hi, one, one + 1, lo, lo, hi - lo,
                 scale, out, block, np.uint64(key), start, out.dtype.type(1.0 / block))
            return
        lane, count, segment = _segment_items(counts, start, start + out.size)
        item_scale = np.asarray(scales, dtype=out.dtype)[segment]
        _run(_scale_items, out.size, codes, lane, lane, count, item_scale, out)

    def unpack_scale(self, start: int, out: np.ndarray, scales: np.ndarray | float,
                     block: int = 0) -> None:
        """``out[t] = lane_sum(start + t) * scales[t // block]`` for one tensor of the
        bucket; ``block == 0``: ``scales`` is the tensor's one scale."""
        if not out.size:
            return
        scales = np.asarray(scales, dtype=out.dtype).reshape(-1)  # no copy when it is one
        block = block if block else out.size
        if self.lanes is not None:
            _run(_scale_lanes, out.size, self.lanes, start, out, scales, block)
        else:
            _run(_unpack_scale, out.size, self.words, self.bits, start, out, scales, block,
                 _offset(self.bits))


def lane_sums(words: np.ndarray, bits: int, out: np.ndarray) -> None:
    """The exact lane sums of summed ``bits``-lane words (up to 32 bits) into ``out``: every
    lane of the words in order, as many as ``out`` holds (float64 holds each one exactly:
    they are below 2**31).  The words are only read."""
    if out.size:
        _run(_unpack_fields, out.size, words, bits, _offset(bits), out)


class Messages:
    """A two-stage bucket's gathered messages, decoded a tensor at a time: the twin of
    :class:`Summed` for :mod:`hvd_gqsgd.two_stage`, laid out by a
    :class:`hvd_gqsgd.core.MessageLayout`.  Every lane of the words (the part slots' too,
    never read) is unpacked once into int16 codes, so that each part's codes are one
    contiguous run; the words are only read."""

    def __init__(self, words: np.ndarray, layout: Any) -> None:
        self.words, self.layout = words, layout
        items = layout.derived.get("kernel_items")
        if items is None:
            items = layout.derived["kernel_items"] = _message_items(layout)
        self.items = items
        bits = layout.bits
        self.codes = host_array(words.size * (64 // bits), np.int16)  # |code| <= 2**15 - 1
        _run(_unpack_fields, self.codes.size, words, bits, _offset(bits), self.codes)

    def part_max(self) -> np.ndarray:
        """Every part's max |sum|, from its slot, as float64 (exact: below 2**31)."""
        return self.words[self.items[5]].astype(np.float64)

    def unpack_parts(self, p0: int, p1: int, out: np.ndarray, scales: np.ndarray,
                     start: int, rotation: tuple[int, int] | None = None) -> None:
        """Parts ``p0 .. p1`` (consecutive elements of the bucket, the first being bucket
        element ``start``) into ``out``: each code times its part's entry of ``scales``
        (``p1 - p0`` values, taken in ``out``'s dtype).

        ``rotation=(block, key)``: then the inverse rotation of every full block (a scale
        segment of ``block`` elements), fused: each block is scaled into scratch,
        transformed and written once; bit for bit :func:`unrotate` of the plain decode.
        A full block must lie wholly inside the window (one that cuts it is refused)."""
        part, lane, pos, count, first, _ = self.items
        a, b = first[p0], first[p1]
        if a == b:
            return
        item_scale = np.asarray(scales).astype(out.dtype)[part[a:b] - p0]
        if rotation is None:
            _run(_scale_items, out.size, self.codes, lane[a:b], pos[a:b] - start, count[a:b],
                 item_scale, out)
            return
        block, key = rotation
        layout = self.layout
        lo, hi, s = window_segments(segment_counts(layout), start, out.size, block)
        # each segment's items: those of its parts, cut to the window's
        part_of = _layout_array(layout, "first", layout.first)[s:s + lo.size + 1]
        i0 = np.clip(first[part_of[:-1]], a, b) - a
        i1 = np.clip(first[part_of[1:]], a, b) - a
        _run(_scale_unrotate_items, out.size, self.codes, lo, hi, i0, i1, lane[a:b],
             pos[a:b] - start, count[a:b], item_scale, out, block, np.uint64(key), start,
             out.dtype.type(1.0 / block))


def segment_counts(layout: Any) -> np.ndarray:
    """The elements of each scale segment of a two-stage bucket (int64): the sum of its
    parts' counts, since the parts of a :class:`hvd_gqsgd.core.MessageLayout` tile the
    bucket in order (made once per layout)."""
    counts = layout.derived.get("segment_counts")
    if counts is None:
        edges = _bounds(layout.counts)
        first = _layout_array(layout, "first", layout.first)
        counts = layout.derived["segment_counts"] = edges[first[1:]] - edges[first[:-1]]
    return counts


def _layout_array(layout: Any, name: str, values: Sequence[int]) -> np.ndarray:
    """``values`` (a field of ``layout``, which never changes) as int64, made once per
    layout: converting a list of one entry per segment costs milliseconds each step."""
    key = ("kernels", name)
    array = layout.derived.get(key)
    if array is None:
        array = layout.derived[key] = np.asarray(values, dtype=np.int64)
    return array


def _message_items(layout: Any) -> tuple[np.ndarray, ...]:
    """Work items of at most BLOCK codes inside one part: (part, first lane, first bucket
    element, count) per item, each part's first item (plus a final entry), and the parts'
    slot words."""
    counts = np.asarray(layout.counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    pieces = -(-counts // BLOCK)
    part = np.repeat(np.arange(counts.size, dtype=np.int64), pieces)
    first = np.concatenate([[0], np.cumsum(pieces)]).astype(np.int64)
    offset = (np.arange(part.size, dtype=np.int64) - first[part]) * BLOCK
    lane = np.asarray(layout.lanes, dtype=np.int64)[part] + offset
    count = np.minimum(BLOCK, counts[part] - offset)
    slots = np.asarray(layout.slots, dtype=np.int64)
    return part, lane, starts[part] + offset, count, first, slots
