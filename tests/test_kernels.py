"""The fused numba kernels compute bit for bit what the generic core path computes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numba
import numpy as np
import pytest

from gqsgd_lab.numpy_ops import NumpyOps
from hvd_gqsgd import core, kernels

OPS = NumpyOps()


def _bucket(dtype, sizes=(5, 130, 1, 4097), seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(0, 1 + i, size).astype(dtype) for i, size in enumerate(sizes)]
    return xs, np.concatenate(xs)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 7, 8, 9, 12, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantize_pack_matches_generic_path(bits, dtype):
    n_ranks = 1 if bits == 2 else 2
    level = core.levels(bits, n_ranks)
    xs, flat = _bucket(dtype)
    counts = np.array([x.size for x in xs])
    scales = np.array([np.abs(x).max() for x in xs])
    scales[2] = 0.0  # an all-zero tensor's scale
    mult = core.multipliers(OPS, scales, level)
    key = core.noise_key(123, 4)
    words = np.empty(core.packed_words(flat.size, bits), dtype=np.int64)
    kernels.quantize_pack(flat, counts, mult, level, bits, key, words)
    per_element = np.repeat(mult.astype(dtype), counts)
    # the kernels' noise is float64 (32 random bits); the comparison promotes, exactly
    expected = core.encode(OPS, flat, per_element, kernels.noise(key, 0, flat.size), level, bits)
    np.testing.assert_array_equal(words, expected)


@pytest.mark.parametrize("bits", [3, 8, 16])
def test_unpack_scale_matches_generic_path(bits):
    n_ranks = 3
    level = core.levels(bits, n_ranks)
    rng = np.random.default_rng(bits)
    codes = rng.integers(-level, level + 1, size=(n_ranks, 1000))
    codes[:, :10] = level
    codes[:, 10:20] = -level
    words = sum(core.pack(OPS, c, bits) for c in codes)
    sums = core.unpack(OPS, words, bits, 1000)
    summed = kernels.Summed(words.copy(), bits)  # decodes many tensors from one bucket
    for start, stop in [(0, 1000), (0, 1), (7, 8), (13, 500), (999, 1000), (8, 16)]:
        out = np.empty(stop - start, dtype=np.float32)
        summed.unpack_scale(start, out, 0.25)
        np.testing.assert_array_equal(out, sums[start:stop].astype(np.float32) * np.float32(0.25))
        # per-block scales; blocks of 5 and 12 straddle words, 64 lanes never do
        for block in (5, 12, 64):
            scales = np.linspace(0.5, 3.0, -(-(stop - start) // block))
            summed.unpack_scale(start, out, scales, block)
            want = sums[start:stop].astype(np.float32) * np.repeat(
                scales.astype(np.float32), block)[:stop - start]
            np.testing.assert_array_equal(out, want, err_msg=f"block {block}")


@pytest.mark.parametrize("bits", [4, 8, 13, 16])
@pytest.mark.parametrize("block", [7, 1000, 1024, 50_000])
def test_unpack_scale_blocks_across_kernel_work_items(bits, block):
    """Tensors longer than the kernel's work items (BLOCK elements), starting mid-word, with
    scale blocks that do and do not line up with words: every element gets its block's scale."""
    level = core.levels(bits, 2)
    rng = np.random.default_rng([bits, block])
    total = 3 * kernels.BLOCK + 77
    codes = rng.integers(-level, level + 1, size=(2, total))
    words = sum(core.pack(OPS, c, bits) for c in codes)
    sums = core.unpack(OPS, words, bits, total)
    summed = kernels.Summed(words.copy(), bits)
    middle = 3 * kernels.BLOCK // 2 + 1
    for start, dtype in [(0, np.float32), (5, np.float64), (middle, np.float32)]:
        size = total - start
        scales = rng.uniform(0.5, 2.0, -(-size // block))
        out = np.empty(size, dtype=dtype)
        summed.unpack_scale(start, out, scales, block)
        want = sums[start:].astype(dtype) * np.repeat(scales.astype(dtype), block)[:size]
        np.testing.assert_array_equal(out, want, err_msg=f"start {start}")


@pytest.mark.parametrize("bits", [8, 9])
def test_tiny_and_subnormal_tensors(bits):
    """Vanishing gradients: a tensor whose scale is below core.MIN_SCALE is sent as zeros
    (its float32 multiplier would overflow), one just above it is quantized normally, and
    decoding with a subnormal float32 scale matches a float32 multiply."""
    level = core.levels(bits, 2)
    rng = np.random.default_rng(bits)
    small = (rng.uniform(-1, 1, 300) * 1e-38).astype(np.float32)  # mostly subnormal
    fine = (rng.uniform(-1, 1, 300) * 2.0**-99).astype(np.float32)
    flat = np.concatenate([small, fine])
    counts = np.array([300, 300])
    scales = np.array([np.abs(small).max(), np.abs(fine).max()], dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in casting multipliers to float32
        mult = core.multipliers(OPS, scales, level)
        words = np.empty(core.packed_words(flat.size, bits), dtype=np.int64)
        kernels.quantize_pack(flat, counts, mult, level, bits, 7, words)
    expected = core.encode(OPS, flat, np.repeat(mult.astype(np.float32), counts),
                           kernels.noise(7, 0, flat.size), level, bits)
    np.testing.assert_array_equal(words, expected)
    codes = core.unpack(OPS, words, bits, flat.size)
    assert not codes[:300].any() and np.abs(codes[300:]).max() == level
    out = np.empty(300, dtype=np.float32)
    step = np.float32(1e-40)  # subnormal
    kernels.Summed(words.copy(), bits).unpack_scale(300, out, step)
    np.testing.assert_array_equal(out, codes[300:].astype(np.float32) * step)


@pytest.mark.parametrize("bits", [8, 16, 4])
def test_decode_products_are_the_float64_product_rounded_once(bits):
    # kernels._scale_run multiplies in float32 where the code and a normal scale make that
    # the same single rounding as the float64 product; at the edges of the float32 range,
    # at 0, subnormal, inf and NaN scales, the bits must match the float64 formula.  8 and
    # 16 bits decode int8/int16 lanes (_scale_lanes), 4 bits float32 lane sums
    # (_scale_items, in place)
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    rng = np.random.default_rng(bits)
    scales = np.concatenate([
        2.0 ** rng.uniform(-126, 127, 40) * rng.choice([-1, 1], 40),
        [tiny, -tiny, tiny * 1.5, big, big / 100, 0.0, -0.0, tiny / 4, np.inf, np.nan]])
    scales = scales.astype(np.float32)
    block = 64
    level = core.levels(bits, 1)
    codes = rng.integers(-level, level + 1, size=block * scales.size)
    codes[:4] = [level, -level, 0, 1]
    words = core.pack(OPS, codes, bits)
    counts = [block] * scales.size
    out = np.empty(codes.size, np.float32)
    kernels.Summed(words.copy(), bits).unpack_bucket(out, counts, scales)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (codes.astype(np.float64) * np.repeat(scales.astype(np.float64), block)
                ).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_nan_input_gives_code_zero_and_spares_neighbours():
    level, bits = 63, 8
    flat = np.ones(16, dtype=np.float32)
    flat[8] = np.nan  # lane 0 of the second word
    mult = np.array([0.0, 63.0])  # tensor 0 (elements 0..11) has a non-finite scale
    words = np.empty(2, dtype=np.int64)
    kernels.quantize_pack(flat, np.array([12, 4]), mult, level, bits, 1, words)
    sums = core.unpack(OPS, words, bits, 16)
    np.testing.assert_array_equal(sums[:12], 0)
    np.testing.assert_array_equal(sums[12:], 63)


@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segment_norms(norm, dtype):
    xs, flat = _bucket(dtype, sizes=(5, 130, 1, 4097, 70_000))
    xs[1][3] = np.nan
    xs[3][-1] = -np.inf
    xs[4][12_345] = -1e30  # the largest magnitude, negative: its sign bit set
    flat = np.concatenate(xs)
    got = kernels.segment_norms(flat, np.array([x.size for x in xs]), norm)
    for g, x in zip(got, xs):
        if not np.all(np.isfinite(x)):
            assert g == np.inf
        elif norm == "max":
            assert g == np.abs(x).max()
        else:
            assert g == pytest.approx(np.linalg.norm(x.astype(np.float64)), rel=1e-12)


def test_noise_is_uniform_and_keyed():
    u = kernels.noise(5, 0, 200_000)
    assert u.dtype == np.float64 and u.min() >= 0 and u.max() < 1
    assert np.all(u * 2**24 == np.floor(u * 2**24))  # 24-bit uniforms
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert not np.array_equal(u[:100], kernels.noise(6, 0, 100))
    np.testing.assert_array_equal(u[50:60], kernels.noise(5, 50, 10))


def _window(buf: np.ndarray, first: int, size: int) -> np.ndarray:
    """A 1-D array of ``size`` elements whose elements ``first .. first + buf.size`` are
    ``buf``: a bucket far longer than memory, of which a kernel touches only that window."""
    interface = {"data": (buf.ctypes.data - first * buf.itemsize, False),
                 "shape": (size,), "typestr": buf.dtype.str, "version": 3}
    holder = type("Window", (), {"__array_interface__": interface, "buf": buf})()
    return np.asarray(holder)


def test_codes_cross_the_two_to_the_32_boundary():
    # elements 2**32 - 32 .. 2**32 + 32: the noise seed changes at 2**32, in the kernel as in
    # kernels.noise (a bucket that long is 16 GiB of float32, so only a window is real)
    first, count, level, key = 2**32 - 32, 64, 31, core.noise_key(3, 1)
    x = np.linspace(-0.9, 0.8, count).astype(np.float32) * np.float32(0.37)
    codes = np.zeros(count, np.int16)
    mult = np.float32(level / 0.9)
    kernels._codes_pass[1](_window(x, first, first + count), np.array([first]),
                           np.array([first + count]), np.array([mult]), np.float32(level),
                           np.uint64(key), _window(codes, first, first + count))
    u = kernels.noise(key, first, count)
    y = np.clip(x * mult, -level, level)
    expected = np.floor(y) + (u < y - np.floor(y))
    np.testing.assert_array_equal(codes, expected)
    assert not np.array_equal(u[32:], kernels.noise(key, 0, 32))  # a fresh seed past 2**32


def test_threaded_kernels_match_generic_path(monkeypatch):
    monkeypatch.setattr(kernels, "_budget", numba.config.NUMBA_NUM_THREADS)
    assert kernels._threads() > 1, "needs a machine with 2+ CPUs to run the threaded twins"
    level, bits = 31, 8
    size = kernels.PARALLEL_MIN + 5 * kernels.BLOCK + 11  # the threaded twins run
    flat = np.random.default_rng(3).normal(size=size).astype(np.float32)
    counts = np.array([flat.size])
    mult = np.array([level / np.abs(flat).max()])
    words = np.empty(core.packed_words(flat.size, bits), dtype=np.int64)
    kernels.quantize_pack(flat, counts, mult, level, bits, 9, words)
    expected = core.encode(OPS, flat, np.repeat(mult.astype(np.float32), counts),
                           kernels.noise(9, 0, flat.size), level, bits)
    np.testing.assert_array_equal(words, expected)
    out = np.empty(flat.size, dtype=np.float32)
    kernels.Summed(words.copy(), bits).unpack_scale(0, out, 1.0)
    np.testing.assert_array_equal(out, core.unpack(OPS, words, bits, flat.size))


@pytest.mark.parametrize("bits", [3, 4, 8, 16, 30])
@pytest.mark.parametrize("block", [0, 5, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unpack_bucket_gives_each_tensor_its_own_segments(bits, block, dtype):
    """A bucket of tensors (sizes that start and end mid-word, one longer than a work item)
    decoded into one flat output in one call: tensor i's elements take the scales of its own
    segments (core.segments), each product rounded once, as lane * float(scale)."""
    numels = [13, 1, 200, 7, kernels.BLOCK + 3000]
    counts, _ = core.segments(numels, block)
    top = (1 << (bits - 1)) - 1
    codes = np.random.default_rng(block + bits).integers(-top, top + 1, sum(numels))
    words = core.pack(OPS, codes, bits)
    scales = np.random.default_rng(1).uniform(0.5, 2.0, len(counts))
    out = np.full(sum(numels), np.nan, dtype)
    kernels.Summed(words.copy(), bits).unpack_bucket(out, counts, scales)
    want = codes * np.repeat(scales.astype(dtype), counts).astype(np.float64)
    np.testing.assert_array_equal(out, want.astype(dtype))


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("block", [0, 5, 64])
@pytest.mark.parametrize("chunk_bytes", [8, 24, 40])
def test_unpack_bucket_chunk_by_chunk_matches_whole_bucket(bits, block, chunk_bytes):
    """Chunks (core.chunk_plan: cut at word boundaries, so mid-tensor and mid scale block)
    decoded one at a time into their slices of the output give the whole bucket's decode."""
    numels = [13, 1, 200, 7, 70]
    counts, _ = core.segments(numels, block)
    top = (1 << (bits - 1)) - 1
    codes = np.random.default_rng(bits + block).integers(-top, top + 1, sum(numels))
    words = core.pack(OPS, codes, bits)
    scales = np.random.default_rng(2).uniform(0.5, 2.0, len(counts))
    want = np.empty(sum(numels), np.float32)
    kernels.Summed(words.copy(), bits).unpack_bucket(want, counts, scales)
    plan = core.chunk_plan(counts, bits, chunk_bytes)
    assert len(plan) > 2
    lanes = core.lanes_per_word(bits)
    out = np.full(sum(numels), np.nan, np.float32)
    for c in plan:
        part = words[c.lo // lanes:-(-c.hi // lanes)].copy()
        kernels.Summed(part, bits).unpack_bucket(out[c.lo:c.hi], counts, scales, start=c.lo)
    np.testing.assert_array_equal(out, want)


def test_host_arrays_are_aligned_and_recycled_only_when_unused():
    """kernels.host_array: aligned; a big buffer goes back to use only once nothing (no
    NumPy view, no torch tensor made with from_numpy) holds it; small ones are not pooled."""
    import torch

    from hvd_gqsgd.torch_ops import host_empty

    n = (4 << 20) // 8  # 4 MiB of int64: pooled
    kernels._pool.pop(n * 8, None)
    a = host_empty(n, np.int64)
    a.fill_(1)
    b = kernels.host_array((n // 2, 2), np.int64)  # a is alive: another buffer
    assert b.shape == (n // 2, 2) and b.ctypes.data % kernels.ALIGN == 0
    assert a.data_ptr() % kernels.ALIGN == 0 and a.data_ptr() != b.ctypes.data
    b[:] = 2
    assert torch.all(a == 1)
    pooled = kernels._pool[n * 8]
    assert len(pooled) == 2
    del a
    c = host_empty(n, np.int64)  # a's buffer is free again
    assert len(pooled) == 2 and np.all(b == 2)
    assert c.data_ptr() not in range(b.ctypes.data, b.ctypes.data + n * 8)
    assert kernels.host_array(10, np.float32).base is not kernels.host_array(10, np.float32).base
    assert 40 not in kernels._pool  # small buffers: not pooled


@pytest.mark.parametrize("environ, cpus, expected", [
    ({}, 8, 8),                                            # one rank: every CPU
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 8, 2),           # mpirun, 4 ranks on the host
    ({"HOROVOD_LOCAL_SIZE": "3"}, 8, 2),                   # horovodrun
    ({"LOCAL_WORLD_SIZE": "4"}, 2, 1),                     # torchrun, more ranks than CPUs
    ({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}, 8, 1),
    ({"OMP_NUM_THREADS": "3,2"}, 8, 3),                    # nested levels: the outer one
    ({"NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}, 8, 2),
])
def test_thread_budget_shares_the_cpus_between_ranks(environ, cpus, expected):
    assert kernels.thread_budget(environ, cpus) == expected


@pytest.mark.parametrize("value", ["0", "", "two", "-1"])
def test_thread_budget_rejects_a_bad_thread_count(value):
    with pytest.raises(ValueError, match="OMP_NUM_THREADS.*positive thread count"):
        kernels.thread_budget({"OMP_NUM_THREADS": value}, 8)


def test_thread_budget_rejects_a_bad_local_rank_count():
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_LOCAL_SIZE='0' is not a positive "
                                         "rank count"):
        kernels.thread_budget({"OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, 8)


@pytest.mark.parametrize("budget, size, twin", [
    (1, kernels.PARALLEL_MIN, "serial"),        # a budget of 1 never starts the pool
    (2, kernels.PARALLEL_MIN - 1, "serial"),    # too small to pay for a threaded launch
    (2, kernels.PARALLEL_MIN, "threaded"),
])
def test_run_picks_the_twin_from_size_and_budget(monkeypatch, budget, size, twin):
    monkeypatch.setattr(kernels, "_budget", budget)
    ran = []
    kernels._run((lambda: ran.append("threaded"), lambda: ran.append("serial")), size)
    assert ran == [twin]


_TWIN_PROBE = """
import sys
import numpy as np
import numba.np.ufunc.parallel as pool
from hvd_gqsgd import kernels
twin = dict(zip(("threaded", "serial"), kernels._segment_l2))[sys.argv[1]]
twin(np.ones(64, np.float32), np.array([0, 64]), np.zeros(1))
print(sum(twin.stats.cache_hits.values()), pool._is_initialized)
"""


def test_twins_keep_separate_disk_caches(tmp_path):
    """numba's disk cache does not key entries by compile options: twins sharing entries
    let a serial call load the threaded code saved by an earlier process and start numba's
    thread pool.  Each process here shares one fresh cache directory; the first column is
    the twin's cache hits, the second whether numba's thread pool started."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": root}

    def probe(which):
        out = subprocess.run([sys.executable, "-c", _TWIN_PROBE, which], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout.split()
        return int(out[0]), out[1] == "True"

    assert probe("threaded") == (0, True)   # compiled and saved
    assert probe("serial") == (0, False)    # its own entry: compiled, no pool
    assert probe("serial") == (1, False)    # and cached
    assert probe("threaded") == (1, True)


@pytest.mark.parametrize("environ, expected", [
    ({}, 0),
    ({"HVD_GQSGD_OVERLAP_NICE": "0"}, 0),
    ({"HVD_GQSGD_OVERLAP_NICE": " 19 "}, 19),
])
def test_overlap_nice_reads_its_variable(environ, expected):
    assert kernels.overlap_nice(environ) == expected


@pytest.mark.parametrize("value", ["-1", "20", "ten", ""])
def test_overlap_nice_rejects_a_bad_increment(value):
    with pytest.raises(ValueError, match="HVD_GQSGD_OVERLAP_NICE=.* is not a niceness "
                                         "increment from 0 to 19"):
        kernels.overlap_nice({"HVD_GQSGD_OVERLAP_NICE": value})


def _where() -> tuple[int, int]:
    """(thread id, niceness) of the calling thread."""
    tid = threading.get_native_id()
    return tid, os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def overlap(monkeypatch):
    """A fresh overlap thread for the test (the module keeps one per process), shut down
    after it."""
    monkeypatch.setattr(kernels, "_overlap_worker", None)
    yield monkeypatch
    if kernels._overlap_worker is not None and kernels._overlap_worker[2] is not None:
        kernels._overlap_worker[2].shutdown()


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="per-thread niceness is Linux's")


def _in_flight(watch: kernels.WireWatch, sent: int, back: int, round_trip: float = 60.0):
    """A step with ``sent`` chunks out and ``back`` of them back, after a step whose first
    chunk took ``round_trip`` seconds to come back and no time to code."""
    watch.first()
    for _ in range(sent):
        watch.sent()
    for _ in range(back):
        watch.back()
    watch._round_trip_s, watch._coding_s = round_trip, 0.0


def _chunk(bits):
    """A chunk of three tensors (one odd-sized), its arguments for quantize_pack, and the
    words quantize_pack gives on the calling thread."""
    sizes = (5, 3 * kernels.BLOCK + 7, 2 * kernels.BLOCK)  # 7 work items
    x, counts = _bucket(np.float32, sizes=sizes)[1], np.array(sizes)
    level = core.levels(bits, 2)
    mult = level / np.array([4.0, 6.0, 9.0])
    args = (x, counts, mult, level, bits, 77)
    want = np.empty(core.packed_words(x.size, bits), np.int64)
    kernels.quantize_pack(*args, want)
    return args, want


@pytest.fixture
def coders(monkeypatch):
    """Record (thread id, niceness) of every piece the codes pass runs on."""
    seen = []
    twins = kernels._codes_pass

    def recorded(twin):
        def run(*args):
            seen.append(_where())
            return twin(*args)
        return run

    monkeypatch.setattr(kernels, "_codes_pass", tuple(recorded(t) for t in twins))
    return seen


@LINUX
@pytest.mark.parametrize("bits", [8, 4])
def test_a_chunk_behind_a_busy_wire_is_coded_on_a_nicer_thread(overlap, coders, bits):
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")
    args, want = _chunk(bits)
    watch, (tid, nice) = kernels.WireWatch(), _where()
    _in_flight(watch, sent=2, back=1)  # one chunk still on the wire
    words = np.zeros_like(want)
    coders.clear()
    watch.quantize_pack(*args, words)
    np.testing.assert_array_equal(words, want)
    assert len(coders) == 7  # one piece per work item here (7 items, fewer than PIECES)
    assert set(coders) == {(coders[0][0], min(19, nice + 7))} and coders[0][0] != tid
    assert _where() == (tid, nice)  # the caller's own priority is untouched


@LINUX
@pytest.mark.parametrize("bits", [8, 4])
def test_the_caller_codes_the_rest_when_the_wire_runs_dry(overlap, coders, bits):
    """The overlap thread is held up (a job ahead of it blocks); once every sent chunk is
    back the caller codes the pieces left, at its own priority: the same words."""
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")
    args, want = _chunk(bits)
    watch, gate = kernels.WireWatch(), threading.Event()
    _, pool = kernels._overlap_pool()
    pool.submit(gate.wait)
    _in_flight(watch, sent=1, back=0)
    threading.Timer(0.05, watch.back).start()  # the chunk on the wire arrives
    words = np.zeros_like(want)
    coders.clear()
    watch.quantize_pack(*args, words)
    gate.set()
    np.testing.assert_array_equal(words, want)
    assert coders == [_where()] * 7


@LINUX
@pytest.mark.parametrize("round_trip", [None, 0.05])
def test_the_caller_joins_in_at_the_deadline(overlap, coders, round_trip):
    """No chunk comes back and the overlap thread is held up: the caller codes the chunk
    itself once the wire should have run dry (at once on a first step, which has no
    figures yet)."""
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")
    args, want = _chunk(8)
    watch, gate = kernels.WireWatch(), threading.Event()
    _, pool = kernels._overlap_pool()
    pool.submit(gate.wait)
    _in_flight(watch, sent=1, back=0, round_trip=round_trip)
    if round_trip is None:
        watch._coding_s = None
    words = np.zeros_like(want)
    coders.clear()
    start = time.perf_counter()
    watch.quantize_pack(*args, words)
    waited = time.perf_counter() - start
    gate.set()
    np.testing.assert_array_equal(words, want)
    assert coders == [_where()] * 7
    assert waited < 0.04 if round_trip is None else waited >= 0.04


@LINUX
def test_the_overlap_threads_exception_is_the_callers(overlap, monkeypatch):
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")

    def fail(*args):
        raise ZeroDivisionError("in a piece")

    args, want = _chunk(8)
    monkeypatch.setattr(kernels, "_codes_pass", (fail, fail))
    watch = kernels.WireWatch()
    _in_flight(watch, sent=1, back=0)
    with pytest.raises(ZeroDivisionError, match="in a piece"):
        watch.quantize_pack(*args, np.zeros_like(want))


def test_increment_0_codes_on_the_caller(overlap, coders):
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "0")
    args, want = _chunk(8)
    watch, words = kernels.WireWatch(), np.zeros_like(want)
    _in_flight(watch, sent=1, back=0)
    coders.clear()
    watch.quantize_pack(*args, words)
    np.testing.assert_array_equal(words, want)
    assert coders == [_where()]  # quantize_pack itself: one piece


@LINUX
def test_a_forked_child_starts_its_own_overlap_thread(overlap):
    """A forked child has the parent's record of the thread but not the thread."""
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")
    gone = kernels.ThreadPoolExecutor(1)
    gone.shutdown()
    overlap.setattr(kernels, "_overlap_worker", (os.getpid() + 1, 7, gone))
    nice, pool = kernels._overlap_pool()
    assert nice == 7 and pool is not gone and kernels._overlap_worker[0] == os.getpid()


@LINUX
def test_a_failed_renice_is_reported(overlap):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")
    overlap.setattr(kernels.os, "setpriority", refuse)
    overlap.setattr(kernels, "_SERIAL", threading.local())
    with pytest.raises(RuntimeError, match="could not lower the priority.*"
                                           "HVD_GQSGD_OVERLAP_NICE=0"):
        kernels._overlap_pool()
    assert kernels._overlap_worker is None  # nothing half made is kept


@LINUX
def test_the_overlap_thread_runs_serial_twins_only(overlap, monkeypatch):
    """There a twin that releases the GIL (the serial one), so the caller's signals and its
    take-over are not held up behind it."""
    overlap.setenv("HVD_GQSGD_OVERLAP_NICE", "7")
    monkeypatch.setattr(kernels, "_budget", 2)
    ran = []
    twins = (lambda: ran.append("threaded"), lambda: ran.append("serial"))
    _, pool = kernels._overlap_pool()
    pool.submit(kernels._run, twins, kernels.PARALLEL_MIN).result()
    kernels._run(twins, kernels.PARALLEL_MIN)
    assert ran == ["serial", "threaded"]


@pytest.mark.parametrize("start", [0, 17, 2**32 - 5])
@pytest.mark.parametrize("key", [1, 2**63 + 12345, 987654321987])
def test_torch_ops_noise_is_the_kernels_noise(key, start):
    """The torch-ops path (CUDA) draws core.uniforms: kernels.noise bit for bit, in float64
    and float32 (multiples of 2**-24), across a 2**32 boundary of the element index."""
    import torch

    from hvd_gqsgd.torch_generic import noise
    from hvd_gqsgd.torch_ops import TorchOps

    want = kernels.noise(key, start, 1000)
    for dtype in (torch.float64, torch.float32):
        got = noise(TorchOps(), key, start, 1000, torch.empty(0, dtype=dtype))
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.double().numpy(), want)


def test_segment_arrays_are_kept_per_tuple_and_read_only():
    # kernels._derived: what is derived from a tuple of counts is made once and shared,
    # read-only; a list (which may change) is converted at every call
    counts = tuple([5, 3, 7] * 4)
    bounds = kernels._bounds(counts)
    np.testing.assert_array_equal(bounds, np.concatenate([[0], np.cumsum(counts)]))
    assert kernels._bounds(counts) is bounds and not bounds.flags.writeable
    with pytest.raises(ValueError):
        bounds[1] = 0
    assert kernels._bounds(tuple(list(counts))) is not bounds  # another tuple: its own
    as_list = list(counts)
    assert kernels._bounds(as_list) is not kernels._bounds(as_list)
    seg, lo, hi = kernels._work_items(counts)
    assert kernels._work_items(counts)[1] is lo and not hi.flags.writeable
    # only the last _DERIVED_MAX tuples are kept
    for i in range(kernels._DERIVED_MAX):
        kernels._bounds((i + 1,))
    assert kernels._bounds(counts) is not bounds
