"""Single-process: the TensorFlow adapter's fused CPU path (numba kernels behind
``tf.numpy_function``) gives bit for bit what the NumPy oracle gives, eagerly and inside
``tf.function``, for every float dtype; and it adds no stateful op to a graph (a stateful op
inside Horovod's per-gradient ``tf.cond`` serialises all gradients, see tensorflow.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from gqsgd_lab.numpy_ops import NumpyOps
from hvd_gqsgd import core, kernels

NP = NumpyOps()
DTYPES = ["float16", "bfloat16", "float32", "float64"]
SEED, RANK = 11, 1


def _backend():
    from hvd_gqsgd.tensorflow import TensorFlowBackend

    return TensorFlowBackend(seed=SEED)


AVERAGE = [1.0, 1.5]  # the probe an Average over 2 ranks returns: factor 1/2


def _round_trip(ops, x, other_words, bits, block, level):
    """The adapter's side of one bucket: norms, codes, then (after adding another rank's
    words, as the Sum allreduce would) the decoded sum times each block's step, averaged."""
    numel = x.shape.num_elements()
    counts, _ = core.segments([numel], block)
    flat = ops.flat_concat([x])
    norms = ops.local_norms([x], flat, counts, "max", [5.0, -5.0])
    scales = ops.check_layout(norms)
    words = ops.encode(flat, core.multipliers(ops, scales, level), counts, level, bits, RANK)
    steps = core.step_sizes(ops, scales, level)
    state = ops.decoder(words + other_words, bits, numel)
    probe = tf.constant(AVERAGE, tf.float64)
    rescaled = ops.rescale_bucket(state, steps, counts, [x], probe, 2)
    return norms, words, ops.take(rescaled, 0, x, probe, 2)


def _oracle(x64, keys, other_words, bits, block, level, flat_dtype, graph):
    """The same bucket in NumPy: core's formulas, the kernels' noise stream.  In a graph,
    TF's optimizer rewrites core.step_sizes' ``s / L`` (a division by a constant) into
    ``s * (1 / L)`` (grappler's ReduceDivToReciprocalMul), one float64 ulp away at most and
    the same on every rank; the oracle does what the graph does."""
    flat = x64.reshape(-1).astype(flat_dtype)
    counts, _ = core.segments([flat.size], block)
    bounds = np.cumsum([0, *counts])
    scales = np.array([np.abs(flat[a:b]).max() for a, b in zip(bounds[:-1], bounds[1:])],
                      np.float64)
    mult = np.repeat(core.multipliers(NP, scales, level).astype(flat_dtype), counts)
    words = core.encode(NP, flat, mult, kernels.noise(keys.next(RANK), 0, flat.size), level,
                        bits)
    sums = core.unpack(NP, words + other_words, bits, flat.size)
    steps = scales * (1.0 / level) if graph else core.step_sizes(NP, scales, level)
    steps = np.repeat(steps * 0.5, counts)  # times the Average's factor
    return scales, words, sums * steps.astype(flat_dtype)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,block", [(8, 0), (8, 100), (4, 7), (16, 1024)])
def test_fused_round_trip_matches_numpy(mode, dtype, bits, block):
    ops, keys = _backend(), core.NoiseKeys(SEED)
    level = core.levels(bits, 2)
    rng = np.random.default_rng([bits, block])
    x = tf.cast(tf.constant(rng.normal(size=(37, 29))), dtype)
    x64 = tf.cast(x, tf.float64).numpy()  # the values the adapter really sees
    flat_dtype = np.float64 if dtype == "float64" else np.float32
    other = core.pack(NP, np.full(x64.size, -(level // 2)), bits)  # another rank's codes
    other[::3] = 0
    fn = _round_trip if mode == "eager" else tf.function(_round_trip, autograph=False)
    for _ in range(2):  # a graph draws a fresh noise key every time it runs
        norms, words, out = fn(ops, x, tf.constant(other), bits, block, level)
        scales, want_words, want = _oracle(x64, keys, other, bits, block, level, flat_dtype,
                                         graph=mode == "function")
        np.testing.assert_array_equal(norms.numpy(), [*scales, 5.0, -5.0])
        np.testing.assert_array_equal(words.numpy(), want_words)
        assert out.dtype == x.dtype and out.shape == x.shape
        np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(),
                                      want.astype(dtype_np(dtype)).astype(np.float64)
                                      .reshape(x.shape))


def dtype_np(name: str):
    return tf.as_dtype(name).as_numpy_dtype


@pytest.mark.parametrize("path", ["fused", "generic"])
@pytest.mark.parametrize("block", [0, 25])
def test_rescale_a_bucket_of_several_tensors(path, block, monkeypatch):
    """One bucket of three tensors (float32, float64, bfloat16; the second starts mid-word):
    each is taken in its dtype and shape, with its own segments' steps times the factor."""
    if path == "generic":
        monkeypatch.setenv("HVD_GQSGD_KERNELS", "0")
    ops, bits = _backend(), 8
    likes = [tf.zeros([3, 5]), tf.zeros([10, 9], tf.float64), tf.zeros([7], tf.bfloat16)]
    numels = [15, 90, 7]
    counts, _ = core.segments(numels, block)
    codes = np.random.default_rng(block).integers(-63, 64, sum(numels))
    steps = np.linspace(0.5, 2.0, len(counts))
    probe = [0.25, 0.375]  # Sum with a predivide of 4, over 2 ranks: factor 1/8

    @tf.function(autograph=False)
    def rescale():
        state = ops.decoder(tf.constant(core.pack(NP, codes, bits)), bits, sum(numels))
        reduced = tf.constant(probe, tf.float64)
        out = ops.rescale_bucket(state, tf.constant(steps), counts, likes, reduced, 2)
        return [ops.take(out, int(np.sum(numels[:i])), like, reduced, 2)
                for i, like in enumerate(likes)]

    got = rescale()
    per_element = np.repeat(steps * 0.125, counts)  # float64, a bucket with float64 in it
    want = codes * per_element
    for i, (g, like) in enumerate(zip(got, likes)):
        lo = int(np.sum(numels[:i]))
        assert g.dtype == like.dtype and g.shape == like.shape
        expected = want[lo:lo + numels[i]].astype(like.dtype.as_numpy_dtype)
        np.testing.assert_array_equal(g.numpy().reshape(-1), expected)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("bits,block,chunk_bytes", [(8, 0, 40), (8, 25, 48), (4, 7, 16)])
def test_rescale_a_bucket_sent_in_chunks(mode, bits, block, chunk_bytes):
    """The words of a bucket as several chunks (core.chunk_plan cuts tensors and scale blocks):
    in a graph each chunk is unpacked into its slice of one buffer by its own op, eagerly they
    are joined first; both give bit for bit what the whole bucket gives."""
    ops = _backend()
    likes = [tf.zeros([3, 5]), tf.zeros([10, 9]), tf.zeros([70])]
    numels = [15, 90, 70]
    counts, _ = core.segments(numels, block)
    top = (1 << (bits - 1)) - 1
    codes = np.random.default_rng(bits).integers(-top, top + 1, sum(numels))
    words = core.pack(NP, codes, bits)
    plan = core.chunk_plan(counts, bits, chunk_bytes)
    assert len(plan) >= 3
    lanes = core.lanes_per_word(bits)
    chunks = [words[c.lo // lanes:-(-c.hi // lanes)] for c in plan]
    assert sum(c.size for c in chunks) == words.size
    steps = np.linspace(0.5, 2.0, len(counts))
    probe = tf.constant([0.25, 0.375], tf.float64)  # factor 1/8

    def rescale(parts):
        state = ops.decoder([tf.convert_to_tensor(p) for p in parts], bits, sum(numels))
        out = ops.rescale_bucket(state, tf.constant(steps), counts, likes, probe, 2)
        return [ops.take(out, int(np.sum(numels[:i])), like, probe, 2)
                for i, like in enumerate(likes)]

    run = rescale if mode == "eager" else tf.function(rescale, autograph=False)
    got = run(chunks)
    if mode == "function":  # one unpack op per chunk, not one after joining them
        graph = run.get_concrete_function(chunks).graph
        host_ops = [op for op in graph.get_operations() if op.type == "PyFuncStateless"]
        assert len(host_ops) == len(chunks) + 3  # scales, buffer, one per chunk, hand-over
    want = codes * np.repeat(steps * 0.125, counts).astype(np.float32)
    for i, (g, like) in enumerate(zip(got, likes)):
        lo = int(np.sum(numels[:i]))
        assert g.dtype == like.dtype and g.shape == like.shape
        np.testing.assert_array_equal(g.numpy().reshape(-1),
                                      want[lo:lo + numels[i]].astype(np.float32))


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("chunk_bytes", [0, 16])
def test_rescale_rotates_back_whole_and_in_chunks(mode, chunk_bytes):
    """With a rotation the decoded bucket is rotated back: fused into the decode of a whole
    bucket, after the last chunk's unpack for chunks (which cut blocks); both the oracle's
    inverse of the plain decode, bit for bit."""
    from gqsgd_lab import rotation_oracle as oracle

    ops, bits, block = _backend(), 4, 8
    numels = [15, 90, 70]
    counts, _ = core.segments(numels, block)
    codes = np.random.default_rng(3).integers(-7, 8, sum(numels))
    words = core.pack(NP, codes, bits)
    lanes = core.lanes_per_word(bits)
    plan = core.chunk_plan(counts, bits, chunk_bytes) if chunk_bytes else []
    chunks = [words[c.lo // lanes:-(-c.hi // lanes)] for c in plan] or [words]
    assert (len(chunks) >= 3) == bool(chunk_bytes)
    assert any(c.hi % block for c in plan) == bool(chunk_bytes)  # chunks that cut a block
    steps = np.linspace(0.5, 2.0, len(counts))
    probe = tf.constant([0.25, 0.375], tf.float64)  # factor 1/8
    key = core.rotation_key(3, 0, 1)
    likes = [tf.zeros([k]) for k in numels]

    def rescale(parts):
        state = ops.decoder([tf.convert_to_tensor(p) for p in parts], bits, sum(numels))
        return ops.rescale_bucket(state, tf.constant(steps), counts, likes, probe, 2,
                                  (block, key))

    run = rescale if mode == "eager" else tf.function(rescale, autograph=False)
    plain = (codes * np.repeat((steps * 0.125).astype(np.float32), counts)).astype(np.float32)
    want = oracle.inverse(plain, counts, block, key)
    np.testing.assert_array_equal(run(chunks).numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("nice", ["0", "7"])
def test_later_chunks_in_a_graph_quantize_behind_the_wire(monkeypatch, nice):
    """Inside tf.function a bucket's chunks after the first go through its WireWatch (the
    first one finds the wire idle), on the overlap thread when HVD_GQSGD_OVERLAP_NICE asks
    for one; the words are bit for bit the eager ones, quantized on TF's own thread."""
    monkeypatch.setenv("HVD_GQSGD_OVERLAP_NICE", nice)
    monkeypatch.setattr(kernels, "_overlap_worker", None)
    behind = []
    quantize_pack = kernels.WireWatch.quantize_pack

    def spy(self, *args):
        behind.append(args[-1].size)  # the chunk's words
        return quantize_pack(self, *args)

    monkeypatch.setattr(kernels.WireWatch, "quantize_pack", spy)
    bits, level, n = 8, core.levels(8, 2), 64
    x = tf.constant(np.random.default_rng(3).normal(size=3 * n), tf.float32)
    mult = tf.constant([level / 4.0, level / 3.0, level / 2.0], tf.float64)

    def chain(ops, x):
        words, sent = None, []
        for i in range(3):
            words = ops.encode(x[i * n:(i + 1) * n], mult[i:i + 1], [n], level, bits, RANK,
                               after=words)
            sent.append(words)
        return sent

    graph = tf.function(lambda x: chain(_backend(), x), autograph=False)(x)
    assert behind == [n // 8, n // 8]  # chunks 1 and 2, 8 codes per word
    eager = chain(_backend(), x)
    assert len(behind) == 2
    for g, e in zip(graph, eager):
        np.testing.assert_array_equal(g.numpy(), e.numpy())


@pytest.mark.parametrize("path", ["fused", "generic"])
def test_graph_holds_no_stateful_op(path, monkeypatch):
    if path == "generic":  # the TF-ops path GPU tensors take
        monkeypatch.setenv("HVD_GQSGD_KERNELS", "0")
    assert kernels.available() == (path == "fused")
    ops, level, bits = _backend(), 63, 8
    x = tf.random.normal([3000])

    @tf.function(autograph=False)
    def chain(probe):
        _, _, out = _round_trip(ops, x, tf.zeros([375], tf.int64), bits, 1024, level)
        return out * tf.cast(ops.probe_factor(probe, 2), out.dtype)

    graph = chain.get_concrete_function(tf.constant([1.0, 1.5], tf.float64)).graph
    stateful = [op.type for op in graph.get_operations() if op._is_stateful]
    assert not stateful, stateful
    types = {op.type for op in graph.get_operations()}
    assert "PyFuncStateless" in types  # the fused kernels, or the generic path's noise key
    assert ("StatelessRandomUniformV2" in types) == (path == "generic")


def test_layout_mismatch_and_bad_probe_raise_in_a_graph():
    ops = _backend()

    @tf.function(autograph=False)
    def check(vec, probe):
        return ops.check_layout(vec), ops.probe_factor(probe, 2)

    check(tf.constant([1.0, 3.0, -3.0], tf.float64), tf.constant([1.0, 1.5], tf.float64))
    with pytest.raises(tf.errors.OpError, match="different tensors"):
        check(tf.constant([1.0, 3.0, -2.0], tf.float64), tf.constant([1.0, 1.5], tf.float64))
    with pytest.raises(tf.errors.OpError, match="op=Sum or op=Average"):
        check(tf.constant([1.0, 3.0, -3.0], tf.float64), tf.constant([1.0, 1.0], tf.float64))


def test_nan_poisons_only_its_block_in_a_graph():
    ops, level, bits = _backend(), 63, 8
    x = np.random.default_rng(0).normal(size=300).astype(np.float32)
    x[150] = np.nan
    _, _, out = tf.function(_round_trip, autograph=False)(
        ops, tf.constant(x), tf.zeros([38], tf.int64), bits, 100, level)
    out = out.numpy()
    assert np.isnan(out[100:200]).all() and np.isfinite(np.delete(out, range(100, 200))).all()


_GROUPING = """
import warnings
warnings.simplefilter("error", RuntimeWarning)
{first}
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
{second}
try:
    comp.compress(tf.ones([3]))
except RuntimeWarning as w:
    print("warned:", w)
print("grouped:", getattr(hvd._make_allreduce_grads_fn, "_hvd_gqsgd_groups", False))
"""


@pytest.mark.parametrize("late", [False, True])
def test_gradients_are_grouped_and_a_late_compressor_warns(late):
    """Constructed after ``import horovod.tensorflow``, a GlobalQSGD makes Horovod's tape
    group its gradients silently; constructed before, the first TF tensor installs the
    grouping and warns that tapes made until then reduce gradient by gradient."""
    import subprocess
    import sys

    make = "from hvd_gqsgd import GlobalQSGD\ncomp = GlobalQSGD(bits=8)"
    code = _GROUPING.format(first=make if late else "", second="" if late else make)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ,
                                            "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grouped: True" in proc.stdout
    assert ("warned: GlobalQSGD was constructed before horovod.tensorflow" in proc.stdout) == late


def test_recycled_host_buffers_never_overwrite_a_live_tensor():
    """Big host outputs come from a pool (kernels.host_array: a fresh 64 MB buffer
    page-faults every step); a buffer is reused only once no tensor or view holds it, so
    results the caller keeps are never overwritten, and a dropped result's buffer is
    reused."""
    from hvd_gqsgd import tensorflow as htf

    n = (2 << 20) // 4  # 2 MiB of float32: pooled, up to 8 buffers of this size

    def fill(v):
        out = kernels.host_array(n, np.float32)
        assert out.ctypes.data % kernels.ALIGN == 0
        out[:] = v
        return out

    make = tf.function(lambda v: htf._host(fill, [v], tf.float32, [n]), autograph=False)
    kernels._pool.pop(n * 4, None)
    kept = [make(tf.constant(float(i))) for i in range(3)]  # all alive at once
    for i, t in enumerate(kept):
        assert np.all(t.numpy() == i)
    pooled = kernels._pool[n * 4]
    assert len(pooled) == 3  # each result got its own buffer
    del kept, t
    again = make(tf.constant(7.0))
    assert np.all(again.numpy() == 7.0)
    assert len(pooled) == 3  # a dropped result's buffer was reused
    view = kernels.host_array(n, np.float32)[10:20]  # a view keeps its buffer taken
    assert kernels.host_array(n, np.float32).base is not view.base


def test_buckets_walk_back_from_the_last_gradient():
    """hvd_gqsgd.tensorflow.buckets: the engine's seal rule (close a bucket once it holds
    ``limit`` bytes) applied from the last gradient back; None gradients are skipped; a
    sparse gradient or one of unknown size puts everything in one group (None)."""
    from hvd_gqsgd.tensorflow import buckets

    grads = [tf.zeros([128]), tf.zeros([16]), None, tf.zeros([16], tf.float16), tf.zeros([1])]
    # bytes: 512, 64, -, 32, 4; from the back: 4+32+64 = 100 >= 60, then 512
    assert buckets(grads, 60) == [[4, 3, 1], [0]]
    assert buckets(grads, 1) == [[4], [3], [1], [0]]
    assert buckets(grads, 10**9) == [[4, 3, 1, 0]]
    # in list order, the engine's rule fills each bucket exactly: a bucket whose first
    # tensor reached ``limit`` alone would be split in two
    assert buckets([tf.zeros([128]), tf.zeros([1])], 60) == [[1, 0]]
    assert buckets([None, None], 60) == []
    sparse = tf.IndexedSlices(tf.zeros([2, 4]), tf.constant([0, 3]), tf.constant([8, 4]))
    assert buckets([tf.zeros([4]), sparse], 60) is None

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def unknown(x):
        assert buckets([tf.zeros([4]), x], 60) is None
        return x

    unknown(tf.zeros([3]))



_SEALS = """
import json
import horovod.tensorflow as hvd
import tensorflow as tf
from hvd_gqsgd import GlobalQSGD
from hvd_gqsgd.engine import Engine
from hvd_gqsgd.tensorflow import buckets, tape_sources
hvd.init()
sealed = []
seal = Engine._seal
def spy(self):
    sealed.append([e.numel for e in self._round.queued])
    seal(self)
Engine._seal = spy
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="tanh"),
                             tf.keras.layers.Dense(1)])
model(tf.zeros([1, 8]))
variables = tape_sources(model.trainable_variables)  # 512, 64, 64 and 4 bytes
comp = GlobalQSGD(bits=8, bucket_bytes=60)
@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, variables)
step(tf.ones([4, 8]))
planned = buckets(variables, 60)
print(json.dumps({"planned": planned, "sealed": sealed,
                  "numel": [int(tf.size(v)) for v in variables]}))
"""


def test_each_traced_bucket_is_sealed_whole():
    """Inside ``tf.function`` with an explicit ``bucket_bytes``, the tape makes one grouped
    call per :func:`buckets` group and the engine seals exactly those groups: a group whose
    first-compressed tensor reached the limit alone would be sealed in two pieces (two scale
    exchanges and two code allreduces where one was planned)."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SEALS], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["planned"] == [[3, 2], [1], [0]]
    assert out["sealed"] == [[out["numel"][i] for i in group] for group in out["planned"]]
