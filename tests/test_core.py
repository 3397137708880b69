"""Single-process tests of the core math against independent oracles (Python ints, NumPy)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gqsgd_lab.numpy_ops import NumpyOps
from hvd_gqsgd import core

OPS = NumpyOps()
BITS = list(range(core.MIN_BITS, core.MAX_BITS + 1))


def oracle_levels(bits: int, n: int) -> int:
    """Largest L with n * L <= 2**(bits-1) - 1, by search rather than by formula."""
    lane_max = 2 ** (bits - 1) - 1
    level = 0
    while n * (level + 1) <= lane_max:
        level += 1
    return level


def oracle_word(codes: list[int], bits: int) -> int:
    return sum(int(q) << (bits * k) if q >= 0 else -((-int(q)) << (bits * k))
               for k, q in enumerate(codes))


# ----------------------------------------------------------------------------- levels


@settings(max_examples=400, deadline=None)
@given(bits=st.integers(core.MIN_BITS, core.MAX_BITS), n=st.integers(1, 1024))
def test_levels_is_the_largest_overflow_free_count(bits, n):
    expected = oracle_levels(bits, n)
    if expected == 0:
        with pytest.raises(ValueError, match=f"bits >= {core.min_bits(n)}"):
            core.levels(bits, n)
        return
    level = core.levels(bits, n)
    assert level == expected
    assert n * level <= 2 ** (bits - 1) - 1 < n * (level + 1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 64, 127, 128, 1000, 1024])
def test_min_bits_is_minimal(n):
    b = core.min_bits(n)
    assert oracle_levels(b, n) >= 1
    assert b == core.MIN_BITS or oracle_levels(b - 1, n) == 0


def test_levels_table_from_notes():
    assert [core.levels(8, n) for n in (2, 4, 8)] == [63, 31, 15]
    with pytest.raises(ValueError, match="bits >= 9"):
        core.levels(8, 128)


# ----------------------------------------------------------------------------- packing


def _sum_through_packing(rank_codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack each rank's codes, add the words in int64 in every prefix order, unpack."""
    words = [core.pack(OPS, c, bits) for c in rank_codes]
    for w, c in zip(words[:4], rank_codes):
        k = core.lanes_per_word(bits)
        padded = np.pad(c, (0, len(w) * k - len(c)))
        assert [int(x) for x in w] == [oracle_word(list(padded[j * k:(j + 1) * k]), bits)
                                      for j in range(len(w))]
    total = words[0].copy()
    for w in words[1:]:
        exact = [int(a) + int(b) for a, b in zip(total, w)]
        assert all(-(2 ** 63) <= v < 2 ** 63 for v in exact), "partial sum left int64"
        total = total + w
    return core.unpack(OPS, total, bits, rank_codes.shape[1])


FEASIBLE = [(b, n) for b in BITS for n in (1, 2, 3, 4, 5, 8, 16, 1024)
            if oracle_levels(b, n) >= 1]


@pytest.mark.parametrize("bits, n", FEASIBLE)
@pytest.mark.parametrize("pattern", ["all_max", "all_min", "alternating", "random"])
def test_packed_sum_is_exact_at_the_extremes(bits, n, pattern):
    level = core.levels(bits, n)
    numel = 3 * core.lanes_per_word(bits) + 1  # a ragged tail too
    rng = np.random.default_rng(bits * 1000 + n)
    if pattern == "all_max":
        codes = np.full((n, numel), level, dtype=np.int64)
    elif pattern == "all_min":
        codes = np.full((n, numel), -level, dtype=np.int64)
    elif pattern == "alternating":
        sign = np.where(np.arange(numel) % 2 == 0, 1, -1)
        codes = np.tile(sign * level, (n, 1)).astype(np.int64)
    else:
        codes = rng.integers(-level, level + 1, size=(n, numel), dtype=np.int64)
    got = _sum_through_packing(codes, bits)
    np.testing.assert_array_equal(got, codes.sum(axis=0))


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(core.MIN_BITS, core.MAX_BITS), n=st.integers(1, 40),
       numel=st.integers(1, 50), seed=st.integers(0, 2 ** 31))
def test_packed_sum_property(bits, n, numel, seed):
    if oracle_levels(bits, n) == 0:
        return
    level = core.levels(bits, n)
    codes = np.random.default_rng(seed).integers(-level, level + 1, size=(n, numel))
    np.testing.assert_array_equal(_sum_through_packing(codes, bits), codes.sum(axis=0))


@settings(max_examples=300, deadline=None)
@given(bits=st.integers(core.MIN_BITS, core.MAX_BITS),
       counts=st.lists(st.integers(1, 90), min_size=1, max_size=30),
       chunk_bytes=st.integers(0, 100), seed=st.integers(0, 2 ** 31))
def test_chunked_encoding_concatenates_to_the_whole_bucket(bits, counts, chunk_bytes, seed):
    """Chunks cover the bucket in order, cut at word boundaries, and packing them one by one
    gives exactly the words of packing the bucket at once (same noise)."""
    ops, level = NumpyOps(), core.levels(bits, 1)
    rng = np.random.default_rng(seed)
    flat = rng.normal(size=sum(counts))
    mult = rng.uniform(0.5, 2.0, size=len(counts)) * level / (np.abs(flat).max() + 1e-9)
    noise = rng.uniform(size=flat.size)
    whole = core.encode(ops, flat, np.repeat(mult, counts), noise, level, bits)
    plan = core.chunk_plan(counts, bits, chunk_bytes)
    assert plan[0].lo == 0 and plan[-1].hi == flat.size
    lanes = core.lanes_per_word(bits)
    for a, b in zip(plan, plan[1:]):
        assert a.hi == b.lo and a.hi % lanes == 0
    if chunk_bytes:
        assert all(c.hi - c.lo <= max(1, chunk_bytes // 8) * lanes for c in plan)
    else:
        assert len(plan) == 1
    owner = np.repeat(np.arange(len(counts)), counts)  # segment of each element
    parts = []
    for c in plan:
        held = np.bincount(owner[c.lo:c.hi], minlength=len(counts))
        touched = np.flatnonzero(held)
        assert (c.first, c.stop) == (touched[0], touched[-1] + 1)
        assert c.counts == tuple(held[c.first:c.stop])
        parts.append(core.encode(ops, flat[c.lo:c.hi], np.repeat(mult[c.first:c.stop], c.counts),
                                 noise[c.lo:c.hi], level, bits))
    np.testing.assert_array_equal(np.concatenate(parts), whole)


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 100), min_size=1, max_size=5),
       block=st.integers(0, 40))
def test_segments_cut_each_tensor_into_blocks(numels, block):
    counts, first = core.segments(numels, block)
    assert first[0] == 0 and first[-1] == len(counts) and len(first) == len(numels) + 1
    for i, n in enumerate(numels):
        mine = counts[first[i]:first[i + 1]]
        assert sum(mine) == n
        if block:
            assert all(c == block for c in mine[:-1]) and 0 < mine[-1] <= block
        else:
            assert mine == (n,)
    assert isinstance(counts, tuple)  # immutable, so the kernels keep what they derive


def test_chunk_plan_splits_tensors_across_chunks():
    # bits=8: 8 lanes per word; 16 bytes = 2 words = 16 elements per chunk
    plan = core.chunk_plan([10, 30, 4], 8, 16)
    assert [(c.lo, c.hi, c.first, c.stop, c.counts) for c in plan] == [
        (0, 16, 0, 2, (10, 6)), (16, 32, 1, 2, (16,)), (32, 44, 1, 3, (8, 4))]


@pytest.mark.parametrize("bits", BITS)
def test_wire_bytes(bits):
    k = 64 // bits
    assert core.lanes_per_word(bits) == k
    assert core.wire_bytes(1000, bits) == 8 * math.ceil(1000 / k)
    if 64 % bits == 0:
        assert core.wire_bytes(64 * 1000, bits) == 64 * 1000 * bits // 8


# ----------------------------------------------------------------------------- rounding


def test_quantize_is_exact_on_the_grid_even_for_u_near_one():
    level = 63
    x = np.arange(-level, level + 1, dtype=np.float32)
    u = np.full_like(x, np.nextafter(np.float32(1), np.float32(0)))
    q = core.quantize(OPS, x, np.float32(1.0), u, level)
    np.testing.assert_array_equal(q, x.astype(np.int64))


def test_quantize_never_leaves_the_lane_when_x_is_the_scale():
    level, s = 63, np.float32(0.3)
    mult = np.float32(level) / s
    x = np.array([s, -s] * 500, dtype=np.float32)
    u = np.random.default_rng(0).random(x.size, dtype=np.float32)
    u[:10] = np.nextafter(np.float32(1), np.float32(0))
    q = core.quantize(OPS, x, mult, u, level)
    assert q.min() >= -level and q.max() <= level


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantize_unbiased_and_variance_bound(dtype):
    level, trials = 7, 4000
    rng = np.random.default_rng(1)
    y = rng.uniform(-level, level, size=64).astype(dtype)
    draws = np.stack([core.quantize(OPS, y, dtype(1.0), rng.random(y.size).astype(dtype), level)
                      for _ in range(trials)])
    assert np.all(np.abs(draws - y) < 1)
    frac = y - np.floor(y)
    var = frac * (1 - frac)  # Bernoulli variance of one rounding, <= 1/4
    assert np.all(draws.var(axis=0) <= var + 5 * np.sqrt(var / trials) + 1e-12)
    # mean within 5 standard errors of the exact value, per element
    se = np.sqrt(np.maximum(var, 1e-12) / trials)
    assert np.all(np.abs(draws.mean(axis=0) - y) <= 5 * se + 1e-12)


def test_multipliers_and_steps_handle_zero_and_nonfinite():
    scales = np.array([2.0, 0.0, np.inf, 0.5])
    np.testing.assert_array_equal(core.multipliers(OPS, scales, 10), [5.0, 0.0, 0.0, 20.0])
    tiny = np.array([core.MIN_SCALE, core.MIN_SCALE / 2, 1e-40])
    mult = core.multipliers(OPS, tiny, core.levels(core.MAX_BITS, 1))
    assert mult[0] == core.levels(core.MAX_BITS, 1) * 2.0**100 and list(mult[1:]) == [0, 0]
    assert np.isfinite(mult.astype(np.float32)).all()  # the largest multiplier fits float32
    steps = core.step_sizes(OPS, scales, 10)
    assert steps[0] == 0.2 and steps[1] == 0.0 and np.isnan(steps[2]) and steps[3] == 0.05


# ----------------------------------------------------------------------------- probe


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_probe_factor_for_sum_and_average(n):
    probes = np.array([core.probe_values(r) for r in range(n)])
    total = probes.sum(axis=0)
    assert core.check_probe(total, n) == pytest.approx(1.0)
    assert core.check_probe(total / n, n) == pytest.approx(1.0 / n)
    f = 4.0  # gradient_predivide_factor: prescale 1/f, postscale f/n
    assert core.check_probe((probes / f).sum(axis=0) * f / n, n) == pytest.approx(1.0 / n)


def _adasum(a, b):
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", ["min", "max", "product", "adasum", "wrong_set"])
def test_probe_rejects_non_sum_reductions(n, op):
    probes = np.array([core.probe_values(r) for r in range(n)])
    reduced = {
        "min": lambda: probes.min(axis=0),
        "max": lambda: probes.max(axis=0),
        "product": lambda: probes.prod(axis=0),
        "adasum": lambda: _adasum(probes[0], probes[1]),
        "wrong_set": lambda: probes[:n - 1].sum(axis=0),
    }[op]()
    with pytest.raises(ValueError, match="op=Sum or op=Average"):
        core.check_probe(reduced, n)


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("kwargs, message", [
    ({"bits": 1}, "bits must be in"),
    ({"bits": 17}, "bits must be in"),
    ({"bits": 8.0}, "bits must be an int"),
    ({"bits": True}, "bits must be an int"),
    ({"norm": "l1"}, "norm must be one of"),
    ({"seed": -1}, "seed must be None or an int"),
    ({"bucket_bytes": -5}, "bucket_bytes must be"),
    ({"chunk_bytes": -1}, "chunk_bytes must be"),
    ({"chunk_bytes": 1.5}, "chunk_bytes must be"),
    ({"scale_block": -2}, "scale_block must be"),
    ({"scale_block": True}, "scale_block must be"),
])
def test_settings_reject_bad_values(kwargs, message):
    from hvd_gqsgd import GlobalQSGD

    with pytest.raises(ValueError, match=message):
        GlobalQSGD(**kwargs)


def test_rank_seed_differs_per_rank_and_is_reproducible():
    seeds = {core.rank_seed(7, r) for r in range(64)}
    assert len(seeds) == 64
    assert core.rank_seed(7, 3) == core.rank_seed(7, 3) < 2 ** 63
    assert core.rank_seed(None, 0) != core.rank_seed(None, 0)


def test_layout_fingerprint_is_float64_exact():
    fp = core.layout_fingerprint([10, 20], ["float32", "float16"])
    assert fp == float(int(fp)) and fp < 2 ** 52
    assert fp != core.layout_fingerprint([20, 10], ["float32", "float16"])


def test_import_loads_no_framework():
    code = ("import sys, hvd_gqsgd; hvd_gqsgd.GlobalQSGD(bits=8); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow') "
            "or m.startswith('horovod.')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
