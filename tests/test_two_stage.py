"""Single-process: two-stage Global-QSGD's core functions (lane width, levels, plan, message
layout) against their definitions, and every backend's local steps, with the collectives
simulated by NumPy sums and concatenations, against gqsgd_lab/two_stage_oracle.py bit for bit.
Real collectives: tests/test_two_stage_multiproc.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gqsgd_lab.inputs import TWO_STAGE_NUMELS, TWO_STAGE_SEED, two_stage_input
from gqsgd_lab.two_stage_oracle import lane_width, predicted_variance, simulate, stage_levels
from hvd_gqsgd import core, kernels, two_stage

NUMELS, SEED = TWO_STAGE_NUMELS, TWO_STAGE_SEED
BLOCK = 1024  # the scale block the backends' steps are called with here, at every bits


@pytest.mark.parametrize("bits", range(core.MIN_BITS, core.MAX_BITS + 1))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 9, 16, 31, 64, 100, 256, 1024, 4096])
def test_lane_width_is_minimal_then_widest(bits, n):
    w = core.two_stage_bits(bits, n)
    need = core.levels(bits, 1)
    narrowest = next(v for v in range(bits, 33) if core.flat_levels(v, n) >= need)
    assert core.lanes_per_word(w) == core.lanes_per_word(narrowest)  # same bytes
    assert w == 32 or core.lanes_per_word(w + 1) < core.lanes_per_word(w)  # widest such
    assert narrowest <= bits + math.ceil(math.log2(n)) if n > 1 else narrowest == bits
    assert w == lane_width(bits, n)


@pytest.mark.parametrize("bits", range(core.MIN_BITS, core.MAX_BITS + 1))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 64, 1000, 4096])
def test_stage_one_levels_fit_the_lane_and_beat_one_rank(bits, n):
    w, l1 = core.two_stage_bits(bits, n), core.two_stage_levels(bits, n)
    assert n * l1 <= 2 ** (w - 1) - 1  # no partial sum of n codes leaves its lane
    assert core.levels(bits, 1) <= l1 <= core.MAX_CODE  # int16 codes in the kernels
    assert (l1, core.levels(bits, 1)) == stage_levels(bits, n)


def test_lane_width_refuses_what_no_word_holds():
    with pytest.raises(ValueError, match="hierarchical=True"):
        core.two_stage_bits(16, 70_000)


@pytest.mark.parametrize("bits, n, expected", [(8, 8, True), (8, 9, True), (8, 16, True),
                                                (8, 2, False), (4, 2, True), (4, 1, False),
                                                (16, 2000, False), (16, 2200, True)])
def test_auto_choice_keeps_at_least_15_levels(bits, n, expected):
    # 8 bits at 8 ranks: flat has exactly 15 levels, so flat stays; 9 ranks: 14, two-stage
    expected = expected and not (bits == 8 and n == 8)
    assert core.use_two_stage(None, bits, n) is expected
    assert core.use_two_stage(True, bits, n) and not core.use_two_stage(False, bits, n)


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
       block=st.sampled_from([0, 7, 64, 1024]), n=st.integers(1, 40),
       bits=st.sampled_from([2, 4, 8, 12, 16]))
def test_plan_shards_cover_the_bucket_in_equal_whole_words(numels, block, n, bits):
    counts, _ = core.segments(numels, block)
    plan = core.two_stage_plan(counts, n, bits)
    total, k1, k2 = sum(counts), core.lanes_per_word(plan.lane_bits), core.lanes_per_word(bits)
    assert len(plan.shards) == n and plan.total == total
    assert plan.scatter_words == n * plan.shard_words >= core.packed_words(total, plan.lane_bits)
    lo = 0
    for r, shard in enumerate(plan.shards):
        assert shard.lo == lo == min(total, r * plan.shard_words * k1)
        assert sum(shard.counts) == shard.hi - shard.lo <= plan.shard_words * k1
        assert len(shard.counts) <= plan.part_slots
        # part p of the shard lies in segment first + p
        ends = np.cumsum([0, *counts])
        start = shard.lo
        for p, c in enumerate(shard.counts):
            g = shard.first + p
            assert ends[g] <= start and start + c <= ends[g + 1]
            start += c
        lo = shard.hi
    assert lo == total
    assert plan.code_words * k2 >= plan.shard_words * k1  # a full shard's codes fit


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_message_layout_places_parts_without_overlap(n):
    counts, first = core.segments(NUMELS, BLOCK)
    plan = core.two_stage_plan(counts, n, 4)
    layout = core.message_layout([(plan, 0, 0)], plan.gather_words, len(counts))
    k2 = core.lanes_per_word(4)
    assert sum(layout.counts) == sum(counts)
    used = np.zeros(plan.gather_words * k2, dtype=int)
    for c, lane in zip(layout.counts, layout.lanes):
        used[lane:lane + c] += 1
    assert used.max() == 1  # no code lane twice
    slot_lanes = np.concatenate([np.arange(s * k2, (s + 1) * k2) for s in layout.slots])
    assert used[slot_lanes].sum() == 0  # slots hold no codes
    assert len(set(layout.slots)) == len(layout.slots)
    # segment g owns parts first[g]:first[g+1], whose counts add up to the segment
    for g, c in enumerate(counts):
        parts = range(layout.first[g], layout.first[g + 1])
        assert [layout.segments[p] for p in parts] == [g] * len(parts)
        assert sum(layout.counts[p] for p in parts) == c


def _inputs(n: int, numels=NUMELS, kind: str = "random"):
    return [two_stage_input(r, n, kind, numels) for r in range(n)]


class _Torch:
    """Torch backend's local steps (fused, or the torch-ops path, which draws the kernels'
    counter-based noise, so both round identically)."""

    def __init__(self, rank: int, fused: bool):
        import torch

        from hvd_gqsgd.torch_ops import TorchLocal

        self.torch = torch
        self.b = TorchLocal(SEED)
        if not fused:
            self.b._fused = lambda t: False

    def tensor(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a))

    def array(self, t):
        return t.numpy()

    def decode(self, state, layout, counts, first, numels, factor, n):
        probe = self.torch.tensor([factor * n, factor * n * (n + 1) / 2],
                                  dtype=self.torch.float64)
        likes = [self.torch.empty(k) for k in numels]
        rescaled = self.b.rescale_bucket(state, None, counts, likes, probe, n)
        out, offset = [], 0
        for like in likes:  # each tensor's slice, as the engine takes it
            out.append(self.b.take(rescaled, offset, like, probe, n).numpy())
            offset += like.numel()
        return np.concatenate(out)


class _TF:
    def __init__(self, rank: int, graph: bool, fused: bool = True):
        import tensorflow as tf

        import hvd_gqsgd.tensorflow as adapter

        self.tf, self.graph = tf, graph
        self.b = adapter.TensorFlowBackend(SEED)
        self.fused = fused

    def tensor(self, a):
        return self.tf.constant(a)

    def array(self, t):
        return t.numpy()

    def decode(self, state, layout, counts, first, numels, factor, n):
        probe = self.tf.constant([factor * n, factor * n * (n + 1) / 2], self.tf.float64)
        likes = [self.tf.zeros([k]) for k in numels]
        return self.b.rescale_bucket(state, None, counts, likes, probe, n).numpy()


def _simulate_backend(make, xs, numels, bits, factor):
    """Every rank's local steps through ``make(rank)``'s backend, with the reduce-scatter a
    NumPy sum of the words and the allgather a concatenation of the messages."""
    n = len(xs)
    ranks = [make(r) for r in range(n)]
    counts, first = core.segments(numels, BLOCK)
    plan, layout = two_stage.plan_of(("test", tuple(numels), BLOCK), counts, n, bits)
    scales = np.max([ranks[r].array(ranks[r].b.local_norms([], ranks[r].tensor(x), counts,
                                                            "max", []))
                     for r, x in enumerate(xs)], axis=0)
    words = []
    for r, (rk, x) in enumerate(zip(ranks, xs)):
        mult = core.multipliers(rk.b, rk.tensor(scales), plan.levels1)
        words.append(rk.array(rk.b.encode(rk.tensor(x), mult, counts, plan.levels1,
                                          plan.lane_bits, r, pad_to=plan.scatter_words)))
    summed, q = np.sum(words, axis=0), plan.shard_words
    messages = [ranks[r].array(two_stage.requantize(ranks[r].b, ranks[r].tensor(
        summed[r * q:(r + 1) * q].copy()), plan, r, r)) for r in range(n)]
    gathered = np.concatenate(messages)
    outs = []
    for rk in ranks:
        steps1 = core.step_sizes(rk.b, rk.tensor(scales), plan.levels1)
        state = rk.b.messages(rk.tensor(gathered.copy()), layout, steps1)
        outs.append(rk.decode(state, layout, counts, first, numels, factor, n))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # bit-identical on every rank
    return outs[0], summed


BACKENDS = {
    "torch-fused": lambda r: _Torch(r, fused=True),
    "torch-generic": lambda r: _Torch(r, fused=False),
    "tf-fused": lambda r: _TF(r, graph=False),
}


# the generic path up to 8 ranks only: it unpacks every gathered word, slow at 33
LOCAL_CASES = [(backend, bits, n, kind) for backend in BACKENDS for bits in (2, 4, 8, 12, 16)
               for n in (1, 2, 3, 5, 8, 33) for kind in ("random", "extremes", "tiny")
               if not (backend == "torch-generic" and n > 8)]
TINY = [3, 1, 2]  # fewer words than ranks from 2 ranks on: the last shards are empty


@pytest.mark.parametrize("backend, bits, n, kind", LOCAL_CASES,
                         ids=lambda v: str(v))
def test_local_steps_match_the_oracle_bit_for_bit(backend, bits, n, kind):
    numels = TINY if kind == "tiny" else NUMELS
    xs = _inputs(n, numels, "random" if kind == "tiny" else kind)
    factor = 1.0 / n
    got, _ = _simulate_backend(BACKENDS[backend], xs, numels, bits, factor)
    want = simulate(xs, numels, bits, SEED, factor, block=BLOCK)
    np.testing.assert_array_equal(got, want.out)


def test_extremes_decode_to_the_exact_sum():
    """Every rank at +-s (or 0) at the same places: every lane sum is +-n L1 or 0, every
    part's max |S| is n L1, so every code is +-L2: the sum comes back within float32's
    rounding of the step."""
    for n in (2, 3, 8):
        xs = _inputs(n, kind="extremes")
        want = simulate(xs, NUMELS, 8, SEED, 1.0)
        exact = np.sum(xs, axis=0, dtype=np.float64)
        same = np.all([np.sign(x) == np.sign(xs[0]) for x in xs], axis=0)
        np.testing.assert_allclose(want.out[same], exact[same], rtol=2**-23, atol=0)
        assert np.all(want.out[exact == 0] == 0)


def test_tf_graph_and_generic_paths_agree_with_eager():
    """Inside tf.function (fused host ops) the result is the eager one bit for bit; the TF-ops
    path (GPU) rounds with its own noise, so it must stay within the per-element bound."""
    import tensorflow as tf

    import hvd_gqsgd.tensorflow as adapter

    n, bits = 3, 8
    xs = _inputs(n)
    eager, _ = _simulate_backend(lambda r: _TF(r, graph=False), xs, NUMELS, bits, 1.0)

    @tf.function(autograph=False)  # the library's Python must run as written
    def traced():
        out, _ = _simulate_graph(xs, bits)
        return out

    np.testing.assert_array_equal(traced().numpy(), eager)
    original = adapter._fused
    adapter._fused = lambda t: False
    try:
        generic, summed = _simulate_backend(lambda r: _TF(r, graph=False), xs, NUMELS, bits,
                                            1.0)
    finally:
        adapter._fused = original
    bound = _bound(xs, bits)
    assert np.all(np.abs(generic - np.sum(xs, axis=0, dtype=np.float64)) <= bound)


def _bound(xs, bits):
    """Per element, the most the sum can be off: n stage-1 steps plus one stage-2 step."""
    n = len(xs)
    sim = simulate(xs, NUMELS, bits, SEED, 1.0, block=BLOCK)
    l1, _ = stage_levels(bits, n)
    counts, _ = core.segments(NUMELS, BLOCK)
    seg = np.repeat(np.arange(len(counts)), counts)
    scale = np.zeros(len(counts))
    for x in xs:
        np.maximum.at(scale, seg, np.abs(x.astype(np.float64)))
    return (n * scale[seg] / l1 + sim.steps) * (1 + 1e-6)


def _simulate_graph(xs, bits):
    """The TF backend's steps as one graph (inside the caller's tf.function)."""
    import tensorflow as tf

    from hvd_gqsgd.tensorflow import TensorFlowBackend

    n = len(xs)
    counts, _ = core.segments(NUMELS, BLOCK)
    plan, layout = two_stage.plan_of(("test", tuple(NUMELS), BLOCK), counts, n, bits)
    bs = [TensorFlowBackend(SEED) for _ in range(n)]
    flats = [tf.constant(x) for x in xs]
    scales = tf.reduce_max(tf.stack([b.local_norms([], f, counts, "max", [])
                                     for b, f in zip(bs, flats)]), 0)
    words = [b.encode(f, core.multipliers(b, scales, plan.levels1), counts, plan.levels1,
                      plan.lane_bits, r, pad_to=plan.scatter_words)
             for r, (b, f) in enumerate(zip(bs, flats))]
    summed, q = tf.add_n(words), plan.shard_words
    messages = [two_stage.requantize(bs[r], summed[r * q:(r + 1) * q], plan, r, r)
                for r in range(n)]
    gathered = tf.concat(messages, 0)
    steps1 = core.step_sizes(bs[0], scales, plan.levels1)
    state = bs[0].messages(gathered, layout, steps1)
    probe = tf.constant([float(n), n * (n + 1) / 2], tf.float64)
    likes = [tf.zeros([k]) for k in NUMELS]
    return bs[0].rescale_bucket(state, None, counts, likes, probe, n), summed


def test_unbiased_over_many_rounds():
    """The mean of many rounds' results converges to the exact sum: the average error per
    element shrinks like 1/sqrt(rounds), with no floor (a bias would be the floor)."""
    n, bits, rounds = 4, 4, 400
    xs = _inputs(n, numels=[2000])
    exact = np.sum(xs, axis=0, dtype=np.float64)
    outs = np.array([simulate(xs, [2000], bits, seed, 1.0).out for seed in range(rounds)])
    err = outs - exact
    sd = err.std(axis=0)
    z = err.mean(axis=0) / (sd / math.sqrt(rounds))  # per element, ~N(0, 1) if unbiased
    assert abs(z.mean()) < 5 / math.sqrt(z.size)  # mean of 2000 z-scores: sd 1/sqrt(2000)
    assert 0.8 < z.std() < 1.2
    # a biased second stage (round to nearest) shows when every rank holds the same input
    same = [xs[0]] * n
    outs = np.array([simulate(same, [2000], bits, seed, 1.0).out for seed in range(rounds)])
    z = (outs.mean(axis=0) - n * xs[0].astype(np.float64)) / (
        outs.std(axis=0) / math.sqrt(rounds) + 1e-30)
    assert abs(z[outs.std(axis=0) > 0].mean()) < 5 / math.sqrt(z.size)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_error_below_flat_by_the_predicted_factor(n):
    """Two-stage's squared error of the sum over flat's, measured over seeds, matches the
    ratio the rounding variances predict (within 25%), and is below 1."""
    bits = 8
    xs = _inputs(n)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    flat_var, two_var = predicted_variance(xs, NUMELS, bits)
    two = np.mean([np.sum((simulate(xs, NUMELS, bits, s, 1.0).out - exact) ** 2)
                   for s in range(8)])
    flat = np.mean([np.sum((_flat(xs, bits, s) - exact) ** 2) for s in range(8)])
    assert two < flat
    assert two / flat == pytest.approx(two_var / flat_var, rel=0.25)
    assert flat == pytest.approx(flat_var, rel=0.1)


def _flat(xs, bits, seed):
    """Flat Global-QSGD's sum with the kernels' rounding (the flat path is tested elsewhere
    against its own oracle; here it is the baseline)."""
    from gqsgd_lab.numpy_ops import NumpyOps

    ops, n = NumpyOps(), len(xs)
    counts, _ = core.segments(NUMELS, BLOCK)
    level = core.levels(bits, n)
    seg = np.repeat(np.arange(len(counts)), counts)
    scale = np.zeros(len(counts))
    for x in xs:
        np.maximum.at(scale, seg, np.abs(x.astype(np.float64)))
    mult = core.multipliers(ops, scale, level)
    total = 0
    for r, x in enumerate(xs):
        words = np.empty(core.packed_words(x.size, bits), np.int64)
        kernels.quantize_pack(x, np.asarray(counts), mult, level, bits,
                              core.noise_key(core.rank_seed(seed, r), 1), words)
        total = total + words
    sums = core.unpack(ops, total, bits, xs[0].size)
    return sums * (scale / level)[seg]


def test_plans_are_cached_per_layout():
    counts, _ = core.segments(NUMELS, BLOCK)
    a = two_stage.plan_of(("cache", tuple(NUMELS)), counts, 4, 8)
    assert two_stage.plan_of(("cache", tuple(NUMELS)), counts, 4, 8) is a
    assert two_stage.plan_of(("cache", tuple(NUMELS)), counts, 5, 8) is not a


def test_settings_refuse_two_stage_with_chunks_and_bad_values():
    with pytest.raises(ValueError, match="not in chunks"):
        core.Settings(two_stage=True, chunk_bytes=1 << 20)
    with pytest.raises(ValueError, match="True, False or None"):
        core.Settings(two_stage=1)
    core.Settings(two_stage=True, chunk_bytes=0)
    s = core.Settings(chunk_bytes=1 << 20)  # auto: refused only where two-stage is needed
    assert two_stage.chosen(s, 4) is False
    with pytest.raises(ValueError, match="two_stage=False to keep flat"):
        two_stage.chosen(s, 16)


def test_flat_with_few_levels_warns_once_and_names_two_stage():
    s = core.Settings(bits=8, two_stage=False)
    two_stage._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="two_stage=True") as caught:
        assert two_stage.chosen(s, 16) is False
        assert two_stage.chosen(s, 16) is False
    assert len(caught) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert two_stage.chosen(s, 8) is False  # 15 levels: no warning
        assert two_stage.chosen(core.Settings(bits=8), 16) is True  # the default: none
