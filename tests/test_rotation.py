"""Single-process tests of the shared-seed Hadamard rotation: the definition (core's module
docstring, "Rotation") through gqsgd_lab/rotation_oracle.py, against the fused kernels and the
generic path on NumPy, torch and TensorFlow, bit for bit; and the settings around it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gqsgd_lab import rotation_oracle as oracle
from gqsgd_lab.numpy_ops import NumpyOps
from hvd_gqsgd import core, kernels

NP = NumpyOps()
KEY = core.rotation_key(5, 0, 1)
BLOCKS = [2, 4, 8, 16, 32, 64, 128, 256, 1024]
DTYPES = [np.float32, np.float64]


def _bucket(numels, block, dtype, seed=0):
    counts, _ = core.segments(numels, block)
    x = np.random.default_rng(seed).normal(size=sum(numels)).astype(dtype)
    return x, counts


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ----------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("block", BLOCKS)
def test_butterfly_oracle_is_the_sylvester_matrix(block):
    rng = np.random.default_rng(block)
    ints = rng.integers(-50, 50, size=(3, block)).astype(np.float64)
    h = oracle.sylvester(block)
    assert np.array_equal(h @ h, block * np.eye(block))  # H is a Hadamard matrix
    np.testing.assert_array_equal(oracle.butterflies(ints), ints @ h.T)  # exact: integers
    floats = rng.normal(size=(2, block))
    np.testing.assert_allclose(oracle.butterflies(floats), floats @ h.T, rtol=0, atol=1e-12)


def test_sign_hash_matches_python_integers():
    # kernels.signs (NumPy, shared by the oracle) against the hash in Python ints, for
    # blocks whose hash indices cross the 2**32 boundary where the seed changes
    for start, block in ((0, 80), (1000, 2), (1000, 256), (2**32 - 3, 256), (2**40 + 3, 64)):
        expected = [oracle.sign_of(KEY, start, t) for t in range(block)]
        np.testing.assert_array_equal(kernels.signs(KEY, start, block), expected)


def test_signs_are_balanced_and_keyed():
    d = kernels.signs(KEY, 0, 1 << 16)
    assert set(np.unique(d)) == {-1.0, 1.0}
    assert abs(np.mean(d)) < 4 / np.sqrt(d.size)  # about half are -1 (4 sigma)
    for lag in (1, 8, 31, 32):  # inside one hash, and across hashes
        assert abs(np.mean(d[lag:] * d[:-lag])) < 4 / np.sqrt(d.size)  # uncorrelated
    other = kernels.signs(core.rotation_key(5, 0, 2), 0, d.size)
    assert 0.45 < np.mean(d != other) < 0.55  # another round: fresh signs
    moved = kernels.signs(KEY, 32 * 1024, 1024)  # another block: other hashes
    assert 0.4 < np.mean(d[:1024] != moved) < 0.6


# ----------------------------------------------------------------------------- fused kernels


@pytest.mark.parametrize("norm", core.NORMS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_oracle(dtype, block, norm):
    numels = [3 * block + 5, block, 1, 2 * block - 1, block // 2]
    x, counts = _bucket(numels, block, dtype, seed=block)
    before = x.copy()
    # the block at `start` crosses element 2**32 in the third, and its hash indices (one
    # per 32 elements: the seed changes at 2**32) cross it in the fourth from 64 up
    for start in (0, 7, 2**32 - block // 2 - 1, 2**32 - block // 64):
        expected = oracle.forward(x, counts, block, KEY, start)
        out = np.empty_like(x)
        norms = kernels.rotate_norms(x, counts, block, KEY, norm, out, start)
        _same_bits(out, expected)
        _same_bits(norms, kernels.segment_norms(expected, np.asarray(counts), norm))
        np.testing.assert_allclose(norms, oracle.norms(expected, counts, norm), rtol=1e-12)
        kernels.unrotate(out, counts, block, KEY, start)
        _same_bits(out, oracle.inverse(expected, counts, block, KEY, start))
    _same_bits(x, before)  # rotate_norms only reads x


@pytest.mark.parametrize("block", [2048, 1 << 15, core.MAX_ROTATION_BLOCK])
def test_kernels_match_oracle_on_large_blocks(block):
    # an odd log2(B) (a radix-2 pass), and the largest block
    x, counts = _bucket([2 * block + 17, block], block, np.float32, seed=block)
    expected = oracle.forward(x, counts, block, KEY, 5)
    out = np.empty_like(x)
    kernels.rotate_norms(x, counts, block, KEY, "max", out, 5)
    _same_bits(out, expected)
    kernels.unrotate(out, counts, block, KEY, 5)
    _same_bits(out, oracle.inverse(expected, counts, block, KEY, 5))


@settings(max_examples=40, deadline=None)
@given(log_block=st.integers(1, 10), start=st.integers(0, 2**40),
       numels=st.lists(st.integers(1, 3000), min_size=1, max_size=5),
       dtype=st.sampled_from(DTYPES))
def test_kernels_match_oracle_on_any_layout(log_block, start, numels, dtype):
    block = 1 << log_block
    x, counts = _bucket(numels, block, dtype, seed=len(numels))
    expected = oracle.forward(x, counts, block, KEY, start)
    out = np.empty_like(x)
    kernels.rotate_norms(x, counts, block, KEY, "max", out, start)
    _same_bits(out, expected)
    kernels.unrotate(out, counts, block, KEY, start)
    _same_bits(out, oracle.inverse(expected, counts, block, KEY, start))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_norms_in_place(dtype):
    block = 32
    x, counts = _bucket([9 * block + 5], block, dtype)
    expected = oracle.forward(x, counts, block, KEY, 4)
    norms = kernels.rotate_norms(x, counts, block, KEY, "max", x, 4)
    _same_bits(x, expected)
    _same_bits(norms, kernels.segment_norms(expected, np.asarray(counts), "max"))


def test_threaded_kernels_match_oracle(monkeypatch):
    monkeypatch.setattr(kernels, "_budget", numba.config.NUMBA_NUM_THREADS)
    assert kernels._threads() > 1, "needs a machine with 2+ CPUs to run the threaded twins"
    block = 256
    numels = [kernels.PARALLEL_MIN + 3 * block + 17, 1000]  # the threaded twins run
    x, counts = _bucket(numels, block, np.float32)
    expected = oracle.forward(x, counts, block, KEY, 3)
    for norm in core.NORMS:
        out = np.empty_like(x)
        norms = kernels.rotate_norms(x, counts, block, KEY, norm, out, 3)
        _same_bits(out, expected)
        _same_bits(norms, kernels.segment_norms(expected, np.asarray(counts), norm))
    kernels.unrotate(out, counts, block, KEY, 3)
    inverse = oracle.inverse(expected, counts, block, KEY, 3)
    _same_bits(out, inverse)
    words = core.pack(NP, np.arange(x.size) % 201 - 100, 8)
    scales = np.linspace(1.0, 2.0, len(counts)).astype(np.float32)
    plain = np.empty_like(x)
    kernels.Summed(words.copy(), 8).unpack_bucket(plain, counts, scales)
    fused = np.empty_like(x)
    kernels.Summed(words.copy(), 8).unpack_bucket(fused, counts, scales, rotation=(block, KEY))
    _same_bits(fused, oracle.inverse(plain, counts, block, KEY))
    counts, layout, words, scales, plain = _gathered(3, 4, block, np.float32, numels=numels)
    fused = np.empty_like(plain)
    kernels.Messages(words, layout).unpack_parts(0, len(layout.counts), fused, scales, 0,
                                                 (block, KEY))
    _same_bits(fused, oracle.inverse(plain, counts, block, KEY))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [2, 64, 1024])
def test_round_trip_is_exact_for_small_integers(dtype, block):
    # every butterfly sum of integers below 8 * block**2 <= 2**23 is exact in both dtypes
    numels = [4 * block + 3, block]
    counts, _ = core.segments(numels, block)
    x = np.random.default_rng(1).integers(-8, 9, size=sum(numels)).astype(dtype)
    out = np.empty_like(x)
    kernels.rotate_norms(x, counts, block, KEY, "max", out)
    assert not np.array_equal(out, x)
    kernels.unrotate(out, counts, block, KEY)
    np.testing.assert_array_equal(out, x)  # equal values (a zero may come back as -0.0)
    back = core.rotate(NP, core.rotate(NP, x, counts, block, KEY), counts, block, KEY,
                       inverse=True)
    np.testing.assert_array_equal(back, x)


def test_rotation_spreads_a_spike_and_keeps_the_l2_norm():
    block = 1024
    x = np.zeros(block, np.float64)
    x[17] = 3.0
    out = np.empty_like(x)
    norms = kernels.rotate_norms(x, [block], block, KEY, "l2", out)
    np.testing.assert_array_equal(np.abs(out), 3.0)  # a column of H: all +-1, times 3
    assert norms[0] == pytest.approx(3.0 * np.sqrt(block))  # unnormalized: sqrt(B) times


@pytest.mark.parametrize("norm", core.NORMS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_has_infinite_norm(norm, bad):
    block = 64
    x, counts = _bucket([3 * block + 10], block, np.float32)
    x[block + 5] = bad  # the second block
    x[3 * block + 2] = bad  # the partial segment
    out = np.empty_like(x)
    norms = kernels.rotate_norms(x, counts, block, KEY, norm, out)
    assert norms[1] == np.inf and norms[3] == np.inf
    assert np.isfinite(norms[[0, 2]]).all()
    assert np.isfinite(out[:block]).all() and np.isfinite(out[2 * block:3 * block]).all()


@pytest.mark.parametrize("bits", [3, 4, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [2, 64, 1024])
def test_decode_fused_with_the_inverse_matches_oracle(bits, dtype, block):
    # Summed.unpack_bucket(rotation=) against the oracle's inverse of the plain decode
    numels = [5 * block + 3, block, 7]
    counts, _ = core.segments(numels, block)
    rng = np.random.default_rng(bits + block)
    level = core.levels(bits, 2)
    codes = rng.integers(-level, level + 1, size=sum(numels))
    words = core.pack(NP, codes, bits) * 2  # a sum over two ranks
    scales = rng.random(len(counts)).astype(dtype)
    plain = np.empty(codes.size, dtype)
    kernels.Summed(words.copy(), bits).unpack_bucket(plain, counts, scales)
    np.testing.assert_array_equal(plain, (2 * codes * np.repeat(scales, counts)).astype(dtype))
    fused = np.empty_like(plain)
    kernels.Summed(words.copy(), bits).unpack_bucket(fused, counts, scales,
                                                     rotation=(block, KEY))
    _same_bits(fused, oracle.inverse(plain, counts, block, KEY))


def test_decode_fused_with_the_inverse_by_windows():
    # a chunk of whole blocks decodes on its own, its blocks keyed by their bucket index; a
    # window that cuts a full block is refused
    block, bits = 64, 8
    counts, _ = core.segments([10 * block], block)
    codes = np.random.default_rng(2).integers(-50, 51, size=10 * block)
    words = core.pack(NP, codes, bits)
    scales = np.linspace(0.5, 1.5, len(counts)).astype(np.float32)
    whole = np.empty(codes.size, np.float32)
    kernels.Summed(words.copy(), bits).unpack_bucket(whole, counts, scales,
                                                     rotation=(block, KEY))
    start, stop = 3 * block, 7 * block  # words 24 .. 56: whole blocks, at word boundaries
    window = np.empty(stop - start, np.float32)
    lanes = 64 // bits
    kernels.Summed(words[start // lanes:stop // lanes].copy(), bits).unpack_bucket(
        window, counts, scales, start=start, rotation=(block, KEY))
    _same_bits(window, whole[start:stop])
    with pytest.raises(ValueError, match="elements 160..408 of the bucket cut the full block "
                                         "at element 128"):
        kernels.Summed(words[24:55].copy(), bits).unpack_bucket(
            np.empty(31 * lanes, np.float32), counts, scales, start=start - block // 2,
            rotation=(block, KEY))


@given(counts=st.lists(st.integers(1, 40), min_size=1, max_size=12), data=st.data())
@settings(max_examples=200, deadline=None)
def test_window_segments_against_every_segment(counts, data):
    # the window's segments and their cut bounds, against a walk over every segment
    total = sum(counts)
    start = data.draw(st.integers(0, total - 1))
    size = data.draw(st.integers(1, total - start))
    block = data.draw(st.sampled_from(sorted(set(counts))))
    edges = np.concatenate([[0], np.cumsum(counts)])
    inside = [s for s in range(len(counts)) if edges[s] < start + size and edges[s + 1] > start]
    lo = [max(edges[s], start) - start for s in inside]
    hi = [min(edges[s + 1], start + size) - start for s in inside]
    cut = [s for s, a, b in zip(inside, lo, hi) if counts[s] == block and b - a != block]
    if cut:
        with pytest.raises(ValueError, match=f"cut the full block at element {edges[cut[0]]},"):
            kernels.window_segments(counts, start, size, block)
        return
    got_lo, got_hi, first = kernels.window_segments(counts, start, size, block)
    assert (got_lo.tolist(), got_hi.tolist(), first) == (lo, hi, inside[0])


def _gathered(n, bits, block, dtype, seed=0, numels=None):
    """A two-stage bucket's layout at ``n`` ranks and gathered words of random stage-2 codes,
    each part's slot a positive max; the plain decode of every part, and its scales."""
    numels = numels or [5 * block + 3, block, 7, 3 * block]
    counts, _ = core.segments(numels, block)
    plan = core.two_stage_plan(counts, n, bits)
    layout = core.message_layout([(plan, 0, 0)], plan.gather_words, len(counts))
    rng = np.random.default_rng(seed + bits + block)
    lanes = plan.gather_words * core.lanes_per_word(bits)
    words = core.pack(NP, rng.integers(-plan.levels2, plan.levels2 + 1, size=lanes), bits)
    words[list(layout.slots)] = rng.integers(1, 100, size=len(layout.slots))
    scales = rng.random(len(layout.counts)).astype(dtype)
    plain = np.empty(sum(counts), dtype)
    kernels.Messages(words, layout).unpack_parts(0, len(layout.counts), plain, scales, 0)
    return counts, layout, words, scales, plain


@pytest.mark.parametrize("n, bits", [(2, 4), (5, 4), (3, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [2, 64, 1024])
def test_two_stage_decode_fused_with_the_inverse_matches_oracle(n, bits, dtype, block):
    # Messages.unpack_parts(rotation=) against the oracle's inverse of the plain decode
    counts, layout, words, scales, plain = _gathered(n, bits, block, dtype)
    if block >= 64:  # shard edges (at word boundaries) cut segments into several parts
        assert len(layout.counts) > len(counts)
    np.testing.assert_array_equal(kernels.segment_counts(layout), counts)
    fused = np.empty_like(plain)
    kernels.Messages(words, layout).unpack_parts(0, len(layout.counts), fused, scales, 0,
                                                 (block, KEY))
    _same_bits(fused, oracle.inverse(plain, counts, block, KEY))


def test_two_stage_decode_fused_with_the_inverse_by_windows():
    # parts that are whole segments decode on their own, keyed by their bucket index; a
    # window whose first part starts inside a full block is refused
    block = 64
    counts, layout, words, scales, plain = _gathered(4, 4, block, np.float32)
    whole = oracle.inverse(plain, counts, block, KEY)
    messages = kernels.Messages(words, layout)
    g0, g1 = 2, 7
    p0, p1 = layout.first[g0], layout.first[g1]
    start, stop = sum(counts[:g0]), sum(counts[:g1])
    window = np.empty(stop - start, np.float32)
    messages.unpack_parts(p0, p1, window, scales[p0:p1], start, (block, KEY))
    _same_bits(window, whole[start:stop])
    cut = next(p for p in range(1, len(layout.counts))
               if layout.segments[p] == layout.segments[p - 1]
               and counts[layout.segments[p]] == block)
    at = sum(layout.counts[:cut])
    with pytest.raises(ValueError, match=f"cut the full block at element "
                                         f"{block * layout.segments[cut]}"):
        messages.unpack_parts(cut, len(layout.counts), np.empty(plain.size - at, np.float32),
                              scales[cut:], at, (block, KEY))


@pytest.mark.parametrize("fused", [True, False])
def test_torch_two_stage_decode_rotates_back(fused):
    # TorchLocal.decode_into(rotation=): the kernels on CPU, decode then core.rotate on the
    # torch-ops path; both the oracle's inverse of the plain decode, whole and by windows
    import torch

    from hvd_gqsgd.torch_ops import TorchLocal, TwoStageSums

    block = 64
    counts, layout, words, scales, plain = _gathered(3, 4, block, np.float64)
    local = TorchLocal(0)
    if not fused:
        local._fused = lambda t: False  # the torch-ops path, as on CUDA
    steps = torch.from_numpy(scales)
    state = (TwoStageSums(layout, steps, fused=kernels.Messages(words, layout)) if fused
             else TwoStageSums(layout, steps, gathered=torch.from_numpy(words)))
    out = torch.empty(plain.size, dtype=torch.float64)
    got = local.decode_into(state, out, 1.0, rotation=(block, KEY))
    assert (got is out) == fused
    whole = oracle.inverse(plain, counts, block, KEY)
    _same_bits(got.numpy(), whole)
    p0, p1 = layout.first[1], layout.first[6]
    start = sum(counts[:1])
    window = local.decode_into(state, torch.empty(sum(counts[1:6]), dtype=torch.float64), 1.0,
                               p0, p1, rotation=(block, KEY))
    _same_bits(window.numpy(), whole[start:start + window.numel()])


def test_tensorflow_two_stage_rescale_rotates_back(monkeypatch):
    # _TwoStage.rescale(rotation=): fused in its host call, eagerly and traced, and on the
    # TF-ops path; all the oracle's inverse of the plain decode
    import tensorflow as tf

    import hvd_gqsgd.tensorflow as adapter

    block, n = 64, 3
    counts, layout, words, _, _ = _gathered(n, 4, block, np.float32)
    ops = adapter.TensorFlowBackend(seed=0)
    steps1 = np.random.default_rng(1).random(len(counts))
    probe = tf.constant([1.0 * n, n * (n + 1) / 2], tf.float64)
    likes = [tf.zeros([c]) for c in counts]

    def decode(rotation):
        state = adapter._TwoStage(ops, tf.constant(words), layout, tf.constant(steps1))
        return ops.rescale_bucket(state, None, counts, likes, probe, n, rotation)

    plain = decode(None).numpy()
    want = oracle.inverse(plain, counts, block, KEY)
    _same_bits(decode((block, KEY)).numpy(), want)
    _same_bits(tf.function(lambda: decode((block, KEY)))().numpy(), want)
    monkeypatch.setattr(adapter, "_fused", lambda t: False)
    _same_bits(decode(None).numpy(), plain)
    _same_bits(decode((block, KEY)).numpy(), want)


# ----------------------------------------------------------------------------- generic path


@pytest.mark.parametrize("dtype", DTYPES)
def test_generic_numpy_rotate_matches_oracle_chunk_by_chunk(dtype, monkeypatch):
    block = 16
    x, counts = _bucket([11 * block + 3, block, 5], block, dtype)
    before = x.copy()
    seen = []
    gather_rows = NP.gather_rows

    def spy(x, index):
        seen.append(len(index))
        return gather_rows(x, index)

    monkeypatch.setattr(core, "ROTATE_CHUNK_ROWS", 5)
    monkeypatch.setattr(NP, "gather_rows", spy)
    y = core.rotate(NP, x, counts, block, KEY, start=9)
    assert seen == [5, 5, 2]  # 12 full blocks, at most 5 at a time
    _same_bits(y, oracle.forward(before, counts, block, KEY, 9))
    _same_bits(x, before)
    back = core.rotate(NP, y, counts, block, KEY, start=9, inverse=True)
    _same_bits(back, oracle.inverse(y, counts, block, KEY, 9))


def test_generic_chunks_are_bounded_in_elements(monkeypatch):
    seen = []
    gather_rows = NP.gather_rows
    monkeypatch.setattr(NP, "gather_rows", lambda x, index: seen.append(index.size)
                        or gather_rows(x, index))
    monkeypatch.setattr(core, "ROTATE_CHUNK_ELEMENTS", 64)
    x, counts = _bucket([10 * 16], 16, np.float32)
    y = core.rotate(NP, x, counts, 16, KEY)
    assert seen == [64, 64, 32]  # 4 blocks of 16 at a time, though 1024 rows are allowed
    _same_bits(y, oracle.forward(x, counts, 16, KEY))
    seen.clear()
    x, counts = _bucket([3 * 128], 128, np.float32)
    core.rotate(NP, x, counts, 128, KEY)
    assert seen == [128] * 3  # a block bigger than the bound: one at a time


def test_rotate_rejects_a_block_that_is_no_power_of_two():
    for block in (0, 1, 3, 1000, 2 * core.MAX_ROTATION_BLOCK):
        with pytest.raises(ValueError, match="power of two"):
            core.rotate(NP, np.zeros(4), [4], block, KEY)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_generic_rotate_matches_oracle(dtype, monkeypatch):
    import torch

    from hvd_gqsgd.torch_ops import TorchOps

    monkeypatch.setattr(core, "ROTATE_CHUNK_ROWS", 3)  # several chunks
    ops = TorchOps()
    for block, start in ((2, 0), (128, 2**32 - 100), (1024, 5)):
        x, counts = _bucket([7 * block + 1, 3, block], block, dtype, seed=block)
        t = torch.from_numpy(x.copy())
        y = core.rotate(ops, t, counts, block, KEY, start)
        expected = oracle.forward(x, counts, block, KEY, start)
        _same_bits(y.numpy(), expected)
        _same_bits(t.numpy(), x)  # the input is left alone
        back = core.rotate(ops, y, counts, block, KEY, start, inverse=True)
        _same_bits(back.numpy(), oracle.inverse(expected, counts, block, KEY, start))


def test_tensorflow_generic_rotate_matches_oracle_eagerly_and_traced(monkeypatch):
    import tensorflow as tf

    from hvd_gqsgd.tensorflow import TensorFlowBackend

    monkeypatch.setattr(core, "ROTATE_CHUNK_ROWS", 3)
    ops = TensorFlowBackend(seed=0)
    for dtype in DTYPES:
        for block, start in ((4, 0), (128, 2**32 - 100), (1024, 5)):
            x, counts = _bucket([7 * block + 1, 3, block], block, dtype, seed=block)
            expected = oracle.forward(x, counts, block, KEY, start)
            inverse = oracle.inverse(expected, counts, block, KEY, start)

            def both(v, counts=counts, block=block, start=start):
                y = core.rotate(ops, v, counts, block, KEY, start)
                return y, core.rotate(ops, y, counts, block, KEY, start, inverse=True)

            for fn in (both, tf.function(both)):
                y, back = fn(tf.constant(x))
                _same_bits(y.numpy(), expected)
                _same_bits(back.numpy(), inverse)


# ----------------------------------------------------------------------------- settings


def test_full_blocks_are_the_segments_of_block_elements():
    assert core.full_blocks([4, 4, 3, 4, 1], 4) == [0, 4, 11]
    assert core.full_blocks([3, 2], 4) == []
    assert core.full_blocks([], 4) == []
    counts, _ = core.segments([2500, 1024, 7], 1024)
    assert core.full_blocks(counts, 1024) == [0, 1024, 2500]


def test_rotation_key_is_shared_and_fresh_per_stream_round_and_seed():
    expected = int.from_bytes(hashlib.blake2b(b"gqsgd-rotation:5:0:1", digest_size=8)
                              .digest(), "little")
    assert KEY == expected
    assert core.rotation_key(None, 0, 1) == int.from_bytes(
        hashlib.blake2b(b"gqsgd-rotation:none:0:1", digest_size=8).digest(), "little")
    keys = {core.rotation_key(seed, stream, count)
            for seed in (None, 0, 5) for stream in range(3) for count in range(3)}
    assert len(keys) == 27 and all(0 <= k < 2**64 for k in keys)


def test_rotation_key_does_not_depend_on_the_process_or_its_rank():
    code = "from hvd_gqsgd import core; print(core.rotation_key(None, 3, 4))"
    got = set()
    for rank in ("0", "1"):
        env = dict(os.environ, PYTHONHASHSEED=rank, OMPI_COMM_WORLD_RANK=rank,
                   HOROVOD_RANK=rank, RANK=rank)
        got.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                               capture_output=True, text=True).stdout.strip())
    assert got == {str(core.rotation_key(None, 3, 4))}


@pytest.mark.parametrize("rotation", ["Hadamard", "walsh", 1, True, ("hadamard",)])
def test_settings_reject_an_unknown_rotation(rotation):
    with pytest.raises(ValueError, match=r"rotation must be None \(off\) or one of "
                                         r"\('auto', 'hadamard'\)"):
        core.Settings(rotation=rotation)


@pytest.mark.parametrize("scale_block", [0, 1, 1000, 2 * core.MAX_ROTATION_BLOCK])
@pytest.mark.parametrize("bits, default", [(8, 1024), (4, 64)])
def test_settings_need_a_power_of_two_block_for_hadamard(scale_block, bits, default):
    with pytest.raises(ValueError, match=rf"scale_block={scale_block}: use scale_block=None "
                                         rf"\(the default, {default} at bits={bits}\) with "
                                         r"rotation='hadamard'"):
        core.Settings(bits=bits, rotation="hadamard", scale_block=scale_block)


@pytest.mark.parametrize("bits, block", [(2, 64), (3, 64), (4, 64), (5, 1024), (8, 1024),
                                         (16, 1024)])
def test_scale_block_defaults_by_bits(bits, block):
    """None (every entry point's default) is resolved once, in Settings; an explicit block,
    0 included, is kept at any bits."""
    from hvd_gqsgd import GlobalQSGD
    from hvd_gqsgd.ddp import GlobalQSGDState
    from hvd_gqsgd.fsdp import FSDPState

    assert core.default_scale_block(bits) == block
    assert core.Settings(bits=bits).scale_block == block
    assert core.Settings(bits=bits, scale_block=None).scale_block == block
    assert core.Settings(bits=bits, scale_block=1024).scale_block == 1024
    assert core.Settings(bits=bits, scale_block=0).scale_block == 0
    assert GlobalQSGD(bits=bits).settings.scale_block == block
    assert GlobalQSGDState(bits=bits).settings.scale_block == block
    assert FSDPState(bits=bits).settings.scale_block == block
    assert f"scale_block={block}" in repr(GlobalQSGD(bits=bits))


def test_rotation_block_auto_rule():
    assert core.Settings().rotation == "auto"
    assert [f.name for f in core.Settings.__dataclass_fields__.values()][-1] == "rotation"
    top = core.AUTO_ROTATION_MAX_BITS
    assert core.rotation_block(core.Settings(bits=top)) == 64  # the block by bits
    assert core.rotation_block(core.Settings(bits=top, scale_block=1024)) == 1024
    assert core.rotation_block(core.Settings(bits=2, scale_block=4)) == 4
    assert core.rotation_block(core.Settings(bits=top + 1)) == 0
    assert core.rotation_block(core.Settings(bits=8)) == 0
    assert core.rotation_block(core.Settings(bits=top, scale_block=0)) == 0
    assert core.rotation_block(core.Settings(bits=top, scale_block=1000)) == 0  # not 2**k
    assert core.rotation_block(core.Settings(bits=top, scale_block=1 << 17)) == 0
    assert core.rotation_block(core.Settings(bits=top, rotation=None)) == 0
    assert core.rotation_block(core.Settings(bits=16, rotation="hadamard",
                                             scale_block=2)) == 2
    assert core.rotation_block(core.Settings(bits=8, rotation="hadamard")) == 1024
