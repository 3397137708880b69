"""Two-stage GlobalQSGD through real Horovod collectives (reduce-scatter and allgather),
PyTorch and TensorFlow, 2, 3, 4 and 8 ranks, Gloo and MPI, against gqsgd_lab/two_stage_oracle.py.

Each configuration runs tests/workers/two_stage_checks.py once.  The fused (CPU) path draws
its rounding noise from a counter-based stream that the oracle replays, so its results must
equal the oracle's bit for bit; the generic path (what CUDA tensors take) has noise of its
own and must stay within the rounding bound and be bit-identical on every rank.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gqsgd_lab.inputs import TWO_STAGE_NUMELS, TWO_STAGE_SEED, two_stage_input
from gqsgd_lab.launch import launch
from gqsgd_lab.rotation_oracle import forward, inverse
from gqsgd_lab.two_stage_oracle import predicted_variance, segment_ids, simulate, stage_levels
from hvd_gqsgd import core, kernels

pytestmark = pytest.mark.multiproc

# (framework, controller, ranks, scenarios or None for all); 8 ranks oversubscribe 2 cores
CONFIGS = [("torch", "gloo", 2, None), ("torch", "mpi", 3, None), ("torch", "gloo", 4, None),
           ("torch", "mpi", 8, "lane_extremes,oracle,flat_and_two,default_choice,rotation"),
           ("tf", "gloo", 2, None), ("tf", "mpi", 3, None)]
_JOBS: dict = {}


def _job(config, tmp_path_factory):
    if config not in _JOBS:
        framework, controller, n, only = config
        out = tmp_path_factory.mktemp(f"two-stage-{framework}-{controller}-{n}")
        _JOBS[config] = launch("two_stage_checks.py", controller, n, out, framework,
                               *([only] if only else []))
    return _JOBS[config]


def configs(scenario: str, framework: str | None = None) -> list:
    """The configurations whose job runs ``scenario`` (as pytest params)."""
    return [pytest.param(c, id=f"{c[0]}-{c[1]}-np{c[2]}") for c in CONFIGS
            if (c[3] is None or scenario in c[3].split(",")) and framework in (None, c[0])]


def _all_equal(values):
    for v in values[1:]:
        np.testing.assert_array_equal(v, values[0])  # bit-identical on every rank
    return values[0]


@pytest.mark.parametrize("config", configs("lane_extremes"))
def test_stage_one_lanes_sum_exactly_at_the_extremes(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    got = [r["lane_extremes"] for r in ranks]
    assert len(got[0]) == 3 * (core.MAX_BITS - core.MIN_BITS + 1)
    for bits, pattern in got[0]:
        w, level = core.two_stage_bits(bits, n), core.two_stage_levels(bits, n)
        numel = n * 3 * core.lanes_per_word(w)
        codes = [{"all_max": np.full(numel, level), "all_min": np.full(numel, -level),
                  "random": np.random.default_rng([bits, r]).integers(-level, level + 1, numel)
                  }[pattern] for r in range(n)]
        total = np.sum(codes, axis=0)
        shard = numel // n
        for r in range(n):
            np.testing.assert_array_equal(got[r][(bits, pattern)],
                                          total[r * shard:(r + 1) * shard],
                                          err_msg=f"bits={bits} {pattern} rank {r}")


@pytest.mark.parametrize("config", configs("oracle"))
def test_results_equal_the_oracle_bit_for_bit(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    cases = ranks[0]["oracle"].keys()
    assert len(cases) >= 8
    for bits, op, kind, graph in cases:
        got = _all_equal([r["oracle"][(bits, op, kind, graph)][0] for r in ranks])
        xs = [two_stage_input(r, n, kind) for r in range(n)]
        want = simulate(xs, TWO_STAGE_NUMELS, bits, TWO_STAGE_SEED,
                        1.0 / n if op == "average" else 1.0)
        np.testing.assert_array_equal(got, want.out, err_msg=f"{bits} {op} {kind} {graph}")


@pytest.mark.parametrize("config", configs("oracle"))
def test_stats_count_both_phases(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    for (bits, _op, _kind, graph), (_, stats) in ranks[0]["oracle"].items():
        if graph:
            continue
        counts, _ = core.segments(TWO_STAGE_NUMELS, core.default_scale_block(bits))
        plan = core.two_stage_plan(counts, n, bits)
        # the reduce-scatter's input and the allgather's output, in allreduce terms
        assert stats["last_payload"] == 4 * (n * plan.shard_words + n * plan.message_words)
        assert stats["last_uncompressed"] == 4 * sum(TWO_STAGE_NUMELS)
        assert stats["last_overhead"] == (core.scale_exchange_bytes(len(counts))
                                          + core.PROBE_BYTES * len(TWO_STAGE_NUMELS))


def _bound(xs, bits):
    """Per element, the most the sum can be off: n stage-1 steps plus one stage-2 step,
    whose part max |sum| is at most n L1 (so the step at most n s / L2)."""
    n = len(xs)
    l1, l2 = stage_levels(bits, n)
    seg = segment_ids(TWO_STAGE_NUMELS, core.default_scale_block(bits))
    scale = np.zeros(seg.max() + 1)
    for x in xs:
        np.maximum.at(scale, seg, np.abs(x.astype(np.float64)))
    return n * scale[seg] * (1 / l1 + 1 / l2) * (1 + 1e-6)


@pytest.mark.parametrize("config", configs("generic"))
def test_generic_path_within_the_bound_and_identical(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    xs = [two_stage_input(r, n) for r in range(n)]
    exact = np.sum(xs, axis=0, dtype=np.float64)
    generic = [r["generic"] for r in ranks]
    for key in generic[0]:
        got = _all_equal([g[key] for g in generic])
        err = np.abs(got - exact)
        assert np.all(err <= _bound(xs, key[0])), key
        assert err.max() > 0  # it really was quantized


@pytest.mark.parametrize("config", configs("unbiased"))
def test_unbiased_and_each_round_replays_the_oracle(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    rounds = np.array(_all_equal([np.array(u) for u in [r["unbiased"] for r in ranks]]))
    xs = [two_stage_input(r, n, numels=[1024]) for r in range(n)]
    for k in (0, len(rounds) - 1):  # round k rounds with key serials 2k+1 and 2k+2
        want = simulate(xs, [1024], 4, 5, 1.0, serial=2 * k + 1)
        np.testing.assert_array_equal(rounds[k], want.out)
    err = rounds - np.sum(xs, axis=0, dtype=np.float64)
    sd = err.std(0, ddof=1)
    # an element rounds the same way in every round when its rounding is (nearly) exact
    z = err.mean(0)[sd > 0] / (sd[sd > 0] / math.sqrt(len(rounds)))
    assert z.size > 900 and abs(z.mean()) < 5 / math.sqrt(z.size)  # the mean of t-scores
    assert 0.8 < z.std() < 1.3


@pytest.mark.parametrize("config", configs("flat_and_two"))
def test_error_below_flat_by_the_predicted_factor(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    xs = [two_stage_input(r, n) for r in range(n)]
    exact = np.sum(xs, axis=0, dtype=np.float64)
    runs = _all_equal([r["flat_and_two"]["two"] for r in ranks])
    for s, got in enumerate(runs):  # seeded: each replays the oracle
        np.testing.assert_array_equal(got, simulate(xs, TWO_STAGE_NUMELS, 8, s, 1.0).out)
    two = np.mean([np.sum((g - exact) ** 2) for g in runs])
    flat = np.mean([np.sum((g - exact) ** 2) for g in ranks[0]["flat_and_two"]["flat"]])
    flat_var, two_var = predicted_variance(xs, TWO_STAGE_NUMELS, 8)
    assert two < flat
    assert two / flat == pytest.approx(two_var / flat_var, rel=0.3)


@pytest.mark.parametrize("config", configs("default_choice"))
def test_default_goes_two_stage_below_15_levels(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    for bits, stats in ranks[0]["default_choice"].items():
        counts, _ = core.segments(TWO_STAGE_NUMELS, core.default_scale_block(bits))
        two = core.flat_levels(bits, n) < 15
        expected = (core.two_stage_plan(counts, n, bits).wire_bytes() if two
                    else core.wire_bytes(sum(TWO_STAGE_NUMELS), bits))
        assert stats["last_payload"] == expected, (bits, n)


@pytest.mark.parametrize("config", configs("process_set"))
def test_process_set_members_match_the_oracle(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    got = [g for g in [r["process_set"] for r in ranks] if g is not None]
    size = got[0]["set_size"]
    assert len(got) == size == (len(ranks) + 1) // 2
    xs = [two_stage_input(r, size) for r in range(size)]
    want = simulate(xs, TWO_STAGE_NUMELS, 8, TWO_STAGE_SEED, 1.0)
    np.testing.assert_array_equal(_all_equal([g["got"] for g in got]), want.out)


@pytest.mark.parametrize("config", configs("optimizer"))
def test_optimizer_gradients_within_the_bound(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    opt = [r["optimizer"] for r in ranks]
    reduced = [np.concatenate([g.ravel() for g in o["reduced"]]) for o in opt]
    got = _all_equal(reduced)
    locals_ = [np.concatenate([g.ravel() for g in o["local"]]) for o in opt]
    exact = np.sum(locals_, axis=0)
    if ranks[0]["framework"] == "tf":
        exact = exact / n  # the tape's default op is Average
    l1, l2 = stage_levels(8, n)
    offset, worst = 0, 0.0
    for g in opt[0]["local"]:  # scale blocks lie inside tensors: bound by the tensor's max
        k = g.size
        top = max(float(np.abs(loc[offset:offset + k]).max()) for loc in locals_)
        bound = n * top * (1 / l1 + 1 / l2) * (1 + 1e-6)
        if ranks[0]["framework"] == "tf":
            bound /= n
        err = np.abs(got[offset:offset + k] - exact[offset:offset + k])
        assert np.all(err <= bound)
        worst = max(worst, float(err.max()))
        offset += k
    assert worst > 0


@pytest.mark.parametrize("config", configs("keras_fit", "tf"))
def test_keras3_fit_trains_identically_on_every_rank(config, tmp_path_factory):
    ranks = _job(config, tmp_path_factory)
    fits = [r["keras_fit"] for r in ranks]
    two = [np.concatenate([w.ravel() for w in f["two"]]) for f in fits]
    none = np.concatenate([w.ravel() for w in fits[0]["none"]])
    got = _all_equal(two)
    assert not np.array_equal(got, none)  # the gradients were quantized ...
    np.testing.assert_allclose(got, none, atol=2e-3)  # ... and still averaged


@pytest.mark.parametrize("config", configs("qprsgd", "torch"))
def test_qprsgd_sync_averages_within_the_bound(config, tmp_path_factory):
    """QPRSGD's allreduce sync through a two-stage GlobalQSGD: every rank ends with the same
    model, within the rounding bound of the exact average of the ranks' local models."""
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    runs = [r["qprsgd"] for r in ranks]
    l1, l2 = stage_levels(8, n)
    for i, start in enumerate(runs[0]["start"]):
        synced = _all_equal([r["synced"][i] for r in runs])
        diffs = [r["local"][i] - start for r in runs]
        assert max(float(np.abs(d).max()) for d in diffs) > 0  # the ranks moved apart
        exact = start + np.mean(diffs, axis=0)
        top = max(float(np.abs(d).max()) for d in diffs)  # a bound on each block's scale
        bound = top * (1 / l1 + 1 / l2) * (1 + 1e-6) + 2.0**-22 * np.abs(exact)  # + fp32
        assert np.all(np.abs(synced - exact) <= bound)


# --------------------------------------------------------------------------- rotation


def rotate_bucket(x: np.ndarray, numels: list[int], key: int, block: int) -> np.ndarray:
    return forward(x, core.segments(numels, block)[0], block, key)


def rotate_back(y: np.ndarray, numels: list[int], key: int, block: int) -> np.ndarray:
    return inverse(y, core.segments(numels, block)[0], block, key)


def _flat_sum(ys: list[np.ndarray], numels: list[int], bits: int, serial: int) -> np.ndarray:
    """Flat Global-QSGD's sum (op=Sum) of the bucket ``ys`` as the kernels round it (key
    serial ``serial`` of each rank), written from the algorithm: levels (2**(bits-1)-1)//n,
    a scale per block of the bits' default size (max over ranks), float32 multipliers, lane
    sums times float32(s / L)."""
    n = len(ys)
    seg = segment_ids(numels, core.default_scale_block(bits))
    scale = np.zeros(seg.max() + 1)
    for y in ys:
        np.maximum.at(scale, seg, np.abs(y.astype(np.float64)))
    level = (2 ** (bits - 1) - 1) // n
    mult = np.where(scale > 0, level / np.where(scale > 0, scale, 1.0), 0.0).astype(np.float32)
    sums = np.zeros(ys[0].size, dtype=np.int64)
    for r, y in enumerate(ys):
        v = np.clip(y * mult[seg], -level, level)
        low = np.floor(v)
        u = kernels.noise(core.noise_key(core.rank_seed(TWO_STAGE_SEED, r), serial), 0, y.size)
        sums += low.astype(np.int64) + (u < (v - low).astype(np.float64))
    step = (scale / level).astype(np.float32).astype(np.float64)[seg]
    return (sums * step).astype(np.float32)


@pytest.mark.parametrize("config", configs("rotation"))
def test_rotation_replays_the_oracle_bit_for_bit(config, tmp_path_factory):
    """rotation="hadamard", flat and two-stage, 4 and 8 bits, two rounds (eager and in
    tf.function): every rank rotates its bucket by the same signs (key from the seed, the
    bucket's serial and the round), the codes of the rotated blocks sum in the collectives,
    and every rank rotates the decoded sum back: the oracle's result bit for bit, on every
    rank."""
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    xs = [two_stage_input(r, n) for r in range(n)]
    for case in ranks[0]["rotation"]:
        bits, two, graph = case
        for k in range(2):
            got = _all_equal([r["rotation"][case][k] for r in ranks])
            # the stream is the bucket's serial: in a round eagerly (names restart), across
            # traces in a graph (names stay unique in the process)
            key = core.rotation_key(TWO_STAGE_SEED, k if graph else 0, k)
            block = core.default_scale_block(bits)
            ys = [rotate_bucket(x, TWO_STAGE_NUMELS, key, block) for x in xs]
            if two:
                rotated = simulate(ys, TWO_STAGE_NUMELS, bits, TWO_STAGE_SEED, 1.0,
                                   serial=2 * k + 1).out.astype(np.float32)
            else:
                rotated = _flat_sum(ys, TWO_STAGE_NUMELS, bits, serial=k + 1)
            want = rotate_back(rotated, TWO_STAGE_NUMELS, key, block)
            np.testing.assert_array_equal(got, want, err_msg=f"{case} round {k}")


def _flat_variance(xs: list[np.ndarray], level: int, block: int) -> float:
    """Expected squared error of flat Global-QSGD's sum of one 8192-element tensor with a
    scale per ``block``: each rank's unbiased rounding of y = x L / s adds
    frac(y) (1 - frac(y)) (s / L)**2."""
    blocks = np.arange(xs[0].size) // block
    scale = np.max([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    scale = np.maximum.reduceat(scale, np.arange(0, xs[0].size, block))[blocks]
    total = 0.0
    for x in xs:
        y = np.abs(x.astype(np.float64)) * level / scale
        f = y - np.floor(y)
        total += float(np.sum(f * (1 - f) * (scale / level) ** 2))
    return total


@pytest.mark.parametrize("config", configs("heavy"))
def test_rotation_cuts_heavy_tailed_error_by_the_predicted_factor_unbiased(config,
                                                                           tmp_path_factory):
    """4 bits, a Student's t gradient (2 degrees of freedom), 40 rounds each way.  Flat: the
    squared error of the sum without and with the rotation each match the rounding variance
    predicted from the data (the rotated one in the rotated basis, divided by the block: the
    inverse H/B shrinks a squared error by B), so their ratio is the predicted factor, well
    below 1.  Two-stage: the rotation's error is lower too.  Rotated results are unbiased."""
    ranks = _job(config, tmp_path_factory)
    n = len(ranks)
    xs = [np.random.default_rng([r, 23]).standard_t(2, 8192).astype(np.float32)
          for r in range(n)]
    block = core.default_scale_block(4)
    ys = [rotate_bucket(x, [8192], core.rotation_key(None, 0, 0), block) for x in xs]
    exact = np.sum(xs, axis=0, dtype=np.float64)
    measured = {}
    for case in ranks[0]["heavy"]:
        runs = np.array(_all_equal([np.array(r["heavy"][case]) for r in ranks]))
        measured[case] = float(np.mean(np.sum((runs - exact) ** 2, axis=1)))
        if case[1] is not None:  # unbiased: the t-scores of the mean error
            err = runs - exact
            z = err.mean(0) / (err.std(0, ddof=1) / math.sqrt(len(runs)))
            assert abs(z.mean()) < 5 / math.sqrt(z.size) and 0.8 < z.std() < 1.3, case
    if (False, None) in measured:
        level = (2**3 - 1) // n
        plain = _flat_variance(xs, level, block)
        rotated = _flat_variance(ys, level, block) / block
        assert measured[(False, None)] == pytest.approx(plain, rel=0.15)
        assert measured[(False, "hadamard")] == pytest.approx(rotated, rel=0.15)
        assert rotated < 0.8 * plain
    assert measured[(True, "hadamard")] < 0.8 * measured[(True, None)], measured
