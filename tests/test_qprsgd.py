"""QPRSGD (local SGD with quantized syncs) through real Horovod, Gloo and MPI, 2 and 3 ranks.

Each configuration launches tests/workers/qprsgd_worker.py once; the tests compare what the
ranks recorded with each other (bit for bit where the algorithm promises it), with the
float64 NumPy replay in tests/workers/qprsgd_data.py (exact communication), and with bounds
computed here from the recorded inputs (quantized communication).  Gossip needs a ring of 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gqsgd_lab.launch import launch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import qprsgd_data as data  # noqa: E402

from hvd_gqsgd import core  # noqa: E402

LR0 = 0.3  # as in the worker
CONFIGS = [("gloo", 3), ("mpi", 4), ("gloo", 2)]
RINGS = [c for c in CONFIGS if c[1] >= 3]
_JOBS: dict = {}


def _job(config, tmp_path_factory):
    if config not in _JOBS:
        controller, n = config
        out = tmp_path_factory.mktemp(f"qprsgd-{controller}-{n}")
        _JOBS[config] = launch("qprsgd_worker.py", controller, n, out)
    return _JOBS[config]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{c}-np{n}" for c, n in CONFIGS])
def ranks(request, tmp_path_factory):
    return _job(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=RINGS, ids=[f"{c}-np{n}" for c, n in RINGS])
def ring(request, tmp_path_factory):
    return _job(request.param, tmp_path_factory)


def _flat(tensors) -> np.ndarray:
    return np.concatenate([np.asarray(t, dtype=np.float64).reshape(-1) for t in tensors])


def _same_bits(models) -> None:
    """Every model (a list of arrays) equal to the first, bit for bit."""
    for m in models[1:]:
        np.testing.assert_array_equal(_flat(m), _flat(models[0]))


def _spread(models) -> float:
    """Consensus distance: sum over ranks of ||x_i - mean x||^2."""
    flat = np.stack([_flat(m) for m in models])
    return float(((flat - flat.mean(axis=0)) ** 2).sum())


def _blocks(numels=(data.OUTPUTS * data.FEATURES, data.OUTPUTS)):
    """Index arrays of GlobalQSGD's scale blocks over the flat (W, b) vector."""
    counts, _ = core.segments(list(numels), data.SCALE_BLOCK)
    bounds = np.cumsum([0, *counts])
    return [np.arange(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


# ------------------------------------------------------------------ bad input


def test_bad_input_raises_clear_errors(ranks):
    n = len(ranks)
    for r in ranks:
        e = r["errors"]
        assert e["period0"].startswith("ValueError: QPRSGD period must be an int >= 1")
        assert e["topology"].startswith("ValueError: QPRSGD topology must be one of")
        assert e["distributed"].startswith("TypeError: QPRSGD got a hvd.DistributedOptimizer")
        assert e["differ"].startswith("ValueError: QPRSGD: the ranks start from different")
        if n < 3:
            assert e["gossip_small"].startswith(
                "ValueError: QPRSGD(topology='gossip') needs a ring of at least 3 ranks")


# ------------------------------------------------------------------ exact communication


def test_period1_none_matches_distributed_optimizer(ranks):
    n = len(ranks)
    oracle = data.simulate(n, 20, 1, LR0, "allreduce")
    for rank, r in enumerate(ranks):
        rec = r["equivalence"]
        for t, (q, d) in enumerate(zip(rec["qprsgd"], rec["distributed"])):
            np.testing.assert_allclose(_flat(q), _flat(d), rtol=1e-5, atol=1e-6, err_msg=f"t={t}")
            np.testing.assert_allclose(_flat(q), _flat(oracle[t][rank]), rtol=1e-4, atol=1e-5)
    _same_bits([r["equivalence"]["qprsgd"][-1] for r in ranks])


@pytest.mark.parametrize("topology, period", [("allreduce", 4), ("gossip", 2)])
def test_compression_none_matches_numpy_replay(ranks, topology, period):
    n = len(ranks)
    if topology == "gossip" and n < 3:
        assert "exact_gossip" not in ranks[0]  # covered by the gossip_small error instead
        return
    oracle = data.simulate(n, 24, period, LR0, topology)
    for rank, r in enumerate(ranks):
        rec = r[f"exact_{topology}"]
        assert rec["syncs"] == 24 // period
        for t, got in enumerate(rec["history"]):
            np.testing.assert_allclose(_flat(got), _flat(oracle[t][rank]), rtol=1e-4, atol=1e-5,
                                       err_msg=f"rank {rank} step {t + 1}")
    # the replay itself must show local drift, or this test could not tell syncs from none
    assert _spread(oracle[period - 2]) > 1e-3


# ------------------------------------------------------------------ allreduce, GlobalQSGD(8)


def test_allreduce_sync_is_bit_identical_and_within_one_step(ranks):
    n = len(ranks)
    recs = [r["gq8_allreduce"] for r in ranks]
    level, blocks = core.levels(8, n), _blocks()
    anchor = _flat(data.initial())
    quantized_somewhere = False
    for t in range(30):
        sync = (t + 1) % 3 == 0
        assert recs[0]["syncs"][t] == (t + 1) // 3
        after = [rec["after"][t] for rec in recs]
        if not sync:
            for rec in recs:  # no communication: the step is the local step
                _same_bits([rec["after"][t], rec["local"][t]])
            continue
        _same_bits(after + [rec["shared"][t] for rec in recs])
        diffs = [_flat(rec["local"][t]) - anchor for rec in recs]
        moved = _flat(recs[0]["shared"][t]) - anchor
        err = np.abs(moved - np.mean(diffs, axis=0))
        for idx in blocks:  # Average of n codes each off by < 1 step s/L: off by < s/L
            s = max(np.abs(d[idx]).max() for d in diffs)
            assert err[idx].max() <= s / level * (1 + 1e-4) + 1e-6, (t, idx[0])
        quantized_somewhere |= bool(err.max() > 1e-6)
        anchor = _flat(recs[0]["shared"][t])
    assert quantized_somewhere
    assert _spread([rec["local"][28] for rec in recs]) > 1e-6  # the ranks did drift apart
    n_seg = len(blocks)
    assert recs[0]["bytes"] == (core.wire_bytes(anchor.size, 8) + core.scale_exchange_bytes(n_seg)
                                + 2 * core.PROBE_BYTES)


def test_restart_after_world_change_is_exact_average(ranks):
    mean = np.mean([_flat(r["restart"]["before"]) for r in ranks], axis=0)
    _same_bits([r["restart"]["after"] for r in ranks] + [r["restart"]["anchor"] for r in ranks])
    np.testing.assert_allclose(_flat(ranks[0]["restart"]["after"]), mean, rtol=1e-6, atol=1e-7)
    assert _spread([r["restart"]["before"] for r in ranks]) > 1e-6


# ------------------------------------------------------------------ gossip, GlobalQSGD(8)


def test_gossip_public_copies_agree_bit_for_bit(ring):
    n = len(ring)
    for t in range(32):
        for r in range(n):
            mine = ring[r]["gq8_gossip"]["shared"][t]
            np.testing.assert_array_equal(mine["left"],
                                          ring[(r - 1) % n]["gq8_gossip"]["shared"][t]["self"])
            np.testing.assert_array_equal(mine["right"],
                                          ring[(r + 1) % n]["gq8_gossip"]["shared"][t]["self"])


def test_gossip_sync_keeps_mean_shrinks_spread_and_quantizes_within_one_step(ring):
    recs = [r["gq8_gossip"] for r in ring]
    level, blocks = core.levels(8, 1), _blocks()
    hat = [_flat(data.initial()) for _ in recs]
    for t in range(3, 32, 4):  # sync steps 4, 8, ...
        local = [rec["local"][t] for rec in recs]
        after = [rec["after"][t] for rec in recs]
        np.testing.assert_allclose(np.mean([_flat(a) for a in after], axis=0),
                                   np.mean([_flat(x) for x in local], axis=0), atol=2e-6)
        assert _spread(after) < 0.5 * _spread(local), t
        for i, rec in enumerate(recs):
            new_hat = rec["shared"][t]["self"]
            diff = _flat(local[i]) - hat[i]
            for idx in blocks:  # a rank's own scale per block: one step is max|diff| / 127
                bound = np.abs(diff[idx]).max() / level
                assert np.abs(new_hat[idx] - _flat(local[i])[idx]).max() <= bound * (
                    1 + 1e-4) + 1e-6
            hat[i] = new_hat.astype(np.float64)


def test_gossip_quantization_error_does_not_accumulate(ring):
    rounds = [[r["consensus"]["rounds"][k] for r in ring] for k in range(26)]
    start = _spread(rounds[0])
    means = [np.mean([_flat(m) for m in models], axis=0) for models in rounds]
    for m in means[1:]:
        np.testing.assert_allclose(m, means[0], atol=2e-6)
    # One round's quantization error alone is ~ start / 127**2; public copies re-send it, so
    # the spread keeps shrinking far below that instead of settling at it.
    assert start > 1e-3
    assert _spread(rounds[-1]) < 1e-3 * start / 127**2


def test_gossip_with_rotation_keeps_the_mean_and_reaches_consensus(ring):
    """GlobalQSGD(4, rotation="hadamard"): every rank rotates its message and rotates the
    decoded ones back with the same signs (the seed and the sync count), so the mean stays
    and the spread keeps shrinking far below one 4-bit round's error (~ start / 7**2)."""
    rounds = [[r["consensus_rotated"]["rounds"][k] for r in ring] for k in range(26)]
    start = _spread(rounds[0])
    means = [np.mean([_flat(m) for m in models], axis=0) for models in rounds]
    for m in means[1:]:
        np.testing.assert_allclose(m, means[0], atol=2e-6)
    assert start > 1e-3
    assert _spread(rounds[-1]) < 1e-3 * start / 7**2


# ------------------------------------------------------------------ convergence, checkpoints


@pytest.mark.parametrize("topology", ["allreduce", "gossip"])
def test_least_squares_converges_near_optimum(ranks, topology):
    n = len(ranks)
    if topology == "gossip" and n < 3:
        assert "converge_gossip" not in ranks[0]
        return
    w_opt, b_opt = data.optimum(n)
    opt, start = _flat((w_opt, b_opt)), _flat(data.initial())
    finals = [_flat(r[f"converge_{topology}"]["final"]) for r in ranks]
    exact = np.mean([_flat(m) for m in data.simulate(n, 200, 4, LR0, topology)[-1]], axis=0)
    rel = np.linalg.norm(np.mean(finals, axis=0) - opt) / np.linalg.norm(start - opt)
    rel_exact = np.linalg.norm(exact - opt) / np.linalg.norm(start - opt)
    assert rel < 0.02, (rel, rel_exact)
    assert rel < rel_exact + 0.005  # 8-bit syncs cost almost nothing against exact ones


@pytest.mark.parametrize("topology", ["allreduce", "gossip"])
def test_state_dict_round_trip_continues_identically(ranks, topology):
    if topology == "gossip" and len(ranks) < 3:
        assert "round_trip_gossip" not in ranks[0]
        return
    for r in ranks:
        rec = r[f"round_trip_{topology}"]
        assert rec["steps_in_state"] == 6
        assert len(rec["original"]) == 6
        for original, restored in zip(rec["original"], rec["restored"]):
            _same_bits([original, restored])
        assert not np.array_equal(_flat(rec["original"][0]), _flat(rec["original"][-1]))


# ------------------------------------------------------------------ single process


def _local_opt():
    import torch

    p = torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([p], lr=0.1), [p]


@pytest.mark.parametrize("kwargs, message", [
    ({"period": 0}, "period must be an int >= 1"),
    ({"period": 2.5}, "period must be an int >= 1"),
    ({"period": True}, "period must be an int >= 1"),
    ({"topology": "ring"}, "topology must be one of ('allreduce', 'gossip')"),
    ({"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
    ({"gamma": 0.0}, "gamma (gossip consensus step) must be in (0, 1]"),
    ({"gamma": 1.5}, "gamma (gossip consensus step) must be in (0, 1]"),
])
def test_settings_are_validated_at_construction(kwargs, message):
    from hvd_gqsgd.qprsgd import QPRSGD

    opt, ps = _local_opt()
    with pytest.raises(ValueError) as info:
        QPRSGD(opt, ps, **kwargs)
    assert message in str(info.value)


def test_params_and_compression_are_checked():
    import torch

    from hvd_gqsgd.qprsgd import QPRSGD

    opt, ps = _local_opt()
    with pytest.raises(ValueError, match="no params"):
        QPRSGD(opt, [])
    with pytest.raises(ValueError, match="repeat a tensor"):
        QPRSGD(opt, ps + ps)
    with pytest.raises(TypeError, match="floating-point tensors"):
        QPRSGD(opt, [torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="Horovod compressor"):
        QPRSGD(opt, ps, compression="gq8")
    with pytest.raises(TypeError, match="QPRSGD cannot add parameter groups"):
        QPRSGD(opt, ps).add_param_group({"params": []})


def test_sync_schedule_with_warmup():
    from hvd_gqsgd.qprsgd import QPRSGD, ring_neighbours

    opt, ps = _local_opt()
    q = QPRSGD(opt, ps, period=4, warmup_steps=3)
    assert [t for t in range(1, 20) if q.is_sync_step(t)] == [1, 2, 3, 7, 11, 15, 19]
    q1 = QPRSGD(opt, ps, period=1)
    assert all(q1.is_sync_step(t) for t in range(1, 10))
    assert q.param_groups is opt.param_groups and q.state is opt.state
    assert [ring_neighbours(r, 4) for r in range(4)] == [(3, 1), (0, 2), (1, 3), (2, 0)]


def test_plain_optimizer_checkpoint_restarts_with_a_warning():
    from hvd_gqsgd.qprsgd import QPRSGD

    opt, ps = _local_opt()
    q = QPRSGD(opt, ps, period=4)
    with pytest.warns(UserWarning, match="no 'qprsgd' entry"):
        q.load_state_dict(opt.state_dict())
    assert q.synced_params() is None and q.public_copies() is None


# ------------------------------------------------------------------ examples


def test_example_specs_parse_local_sgd_variants():
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from _common import build_compressor, is_local_sgd, parse_variants

    plain, ring_k8, custom = parse_variants("qprsgd8,qprsgd8:k=8:gossip,qprsgd4:l2:k=2:warmup=5")
    assert plain.local == {"period": 4, "topology": "allreduce", "warmup_steps": 0}
    assert ring_k8.local["period"] == 8 and ring_k8.local["topology"] == "gossip"
    assert custom.kwargs == {"bits": 4, "norm": "l2"} and custom.local["warmup_steps"] == 5
    assert custom.label == "QPRSGD(4, K=2, allreduce, l2, warmup 5)"
    assert all(is_local_sgd(v) for v in (plain, ring_k8, custom))
    with pytest.raises(ValueError, match="k= needs a whole number"):
        parse_variants("qprsgd8:k=x")
    with pytest.raises(ValueError, match="'qprsgd1'"):
        parse_variants("qprsgd1")
    with pytest.raises(ValueError, match="local SGD"):  # a TF script must not get GlobalQSGD
        build_compressor(plain, None, 0)


def test_digits_example_runs_a_qprsgd_variant():
    import os
    import re
    import subprocess

    from gqsgd_lab.launch import BIN, TIMEOUT_S

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
           str(Path(__file__).parent.parent / "examples" / "torch_digits.py"), "--epochs", "3",
           "--variants", "none,qprsgd8:k=4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m.group(1): (float(m.group(2)), float(m.group(3).replace(",", "")))
            for m in re.finditer(r"(fp32 \(none\)|QPRSGD\(8, K=4, allreduce\))\s+([\d.]+)\s+"
                                 r"[\d.]+\s+([\d,]+)", proc.stdout)}
    assert set(rows) == {"fp32 (none)", "QPRSGD(8, K=4, allreduce)"}, proc.stdout
    (acc_none, bytes_none), (acc_q, bytes_q) = rows["fp32 (none)"], rows[
        "QPRSGD(8, K=4, allreduce)"]
    assert acc_none > 0.85 and acc_q > 0.85
    # 4x from 8 bits, 4x from K=4, less the extra sync at each epoch end
    assert 10 < bytes_none / bytes_q <= 16


def test_benchmark_time_to_target_interpolates_and_bounds():
    sys.path.insert(0, str(Path(__file__).parent.parent / "studies"))
    import local_sgd

    curve = [{"time_s": 0.0, "val_loss": 4.0}, {"time_s": 10.0, "val_loss": 3.0},
             {"time_s": 30.0, "val_loss": 2.0}]
    assert local_sgd.time_to(curve, 2.5) == pytest.approx(20.0)
    assert local_sgd.time_to(curve, 3.0) == pytest.approx(10.0)
    assert local_sgd.time_to(curve, 1.9) is None
    same = {"runs": {"sync:gq8": {"time_to_target": None, "train_s": 50.0, "val_loss": 2.1}}}
    text, met = local_sgd._vs_gq8(same, 10.0)  # never reached: its whole run is a lower bound
    assert text.startswith("> 5.00x") and met == "yes"


def _bench():
    sys.path.insert(0, str(Path(__file__).parent.parent / "studies"))
    import local_sgd

    return local_sgd


def test_benchmark_run_specs_carry_warmup():
    local_sgd = _bench()
    assert local_sgd.parse_spec("allreduce:4:w32") == ("allreduce", "4", 32)
    assert local_sgd.parse_spec("gossip:8") == ("gossip", "8", None)  # the job's --warmup-steps
    assert local_sgd.label("allreduce:4:w32") == "QPRSGD allreduce K=4, warmup 32"
    assert local_sgd.label("avg:1") == "fp32 averaging K=1"
    for bad in ("allreduce:4:32", "allreduce:4:w", "avg:4:w8:w2"):
        with pytest.raises(ValueError, match="kind:K"):
            local_sgd.parse_spec(bad)


def _run(spec: str, loss: float, steps: int) -> dict:
    return {"spec": spec, "label": _bench().label(spec), "val_loss": loss,
            "loss_vs_fp32_pct": 0.0, "time_to_target": None,
            "curve": [{"step": 0, "val_loss": 4.6}, {"step": steps, "val_loss": loss}]}


def test_benchmark_reports_the_equal_samples_goal_at_every_length():
    local_sgd = _bench()
    same = {"runs": {"sync:none": _run("sync:none", 2.0, 160),
                     "allreduce:4": {**_run("allreduce:4", 2.12, 160),
                                     "loss_vs_fp32_pct": 6.0}},
            "target": 2.0}
    horizon = {"160": {"runs": [_run("sync:none", 2.0, 160), _run("allreduce:4", 2.12, 160),
                                _run("allreduce:4:w32", 2.14, 160)]},
               "480": {"runs": [_run("sync:none", 1.7, 480), _run("allreduce:4", 1.717, 480)]},
               "320": {"runs": [_run("sync:none", 1.8, 320), _run("allreduce:4", 1.872, 320)]}}
    rows = [r for r in local_sgd.goals(same, None, horizon) if "within 3%" in r]
    # the 160-step number stays; longer lengths follow, shortest first; no duplicate at 160
    assert rows[0].endswith("(160 steps, same-samples job) | within 3% | +6.00% | no |")
    assert rows[1] == "| same, 320 steps for every run (loss-only job) | within 3% | +4.00% | no |"
    assert rows[2] == "| same, 480 steps for every run (loss-only job) | within 3% | +1.00% | yes |"
    assert len(rows) == 3
    notes = "\n".join(local_sgd.horizon_notes(horizon, same))
    assert "+6.00% at 160 steps, +4.00% at 320 steps, +1.00% at 480 steps" in notes
    assert "QPRSGD allreduce K=4, warmup 32 +7.00%, against +6.00% without" in notes
    assert "exactly the same-samples job's losses" in notes
    table = local_sgd.horizon_table(horizon)
    assert table[2:5] == ["| 160 | sync fp32 | 2.0000 | +0.00% |",
                          "| 160 | QPRSGD allreduce K=4 | 2.1200 | +6.00% |",
                          "| 160 | QPRSGD allreduce K=4, warmup 32 | 2.1400 | +7.00% |"]


def test_benchmark_diagnostic_runs_only_at_their_length():
    import argparse

    local_sgd = _bench()
    args = argparse.Namespace(steps=480, diagnostic_steps=160,
                              horizon_runs="sync:none,allreduce:4",
                              diagnostic_runs="avg:1,allreduce:4:w32")
    assert local_sgd.horizon_runs(args, 160) == "sync:none,allreduce:4,avg:1,allreduce:4:w32"
    assert local_sgd.horizon_runs(args, 480) == "sync:none,allreduce:4"


def test_benchmark_notes_name_the_length_the_diagnostics_ran_at():
    """A same-samples job at 480 steps with diagnostics from the 160-step loss-only run: the
    warmup and K=1 notes use the 160-step runs and say so."""
    local_sgd = _bench()
    same = {"runs": {"sync:none": _run("sync:none", 1.7, 480),
                     "allreduce:4": _run("allreduce:4", 1.717, 480)}, "target": 1.7}
    horizon = {"160": {"runs": [_run("sync:none", 2.0, 160), _run("allreduce:4", 2.12, 160),
                                _run("avg:1", 2.1, 160), _run("allreduce:4:w32", 2.14, 160)]},
               "480": {"runs": [_run("sync:none", 1.7, 480), _run("allreduce:4", 1.717, 480)]}}
    notes = "\n".join(local_sgd.horizon_notes(horizon, same))
    assert "Warmup at 160 steps" in notes
    assert "warmup 32 +7.00%, against +6.00% without" in notes
    assert "ends +5.00% from sync fp32 at 160 steps" in notes
    assert "At 480 steps the loopback runs" in notes


def test_benchmark_link_note_reads_the_sync_steps_of_fp32_averaging():
    local_sgd = _bench()
    runs = {"sync:none": {"spec": "sync:none", "median_step_s": 0.6},
            "avg:4": {"spec": "avg:4", "step_times": [0.05, 0.05, 0.05, 0.5] * 3},
            "avg:1": {"spec": "avg:1", "step_times": [0.7]}}
    note = local_sgd.link_notes({"runs": runs}, "1mb")
    assert len(note) == 1 and "took 0.500 s at K=4, against 0.600 s" in note[0]
    assert "K=1" not in note[0]
    assert local_sgd.link_notes({"runs": {"sync:none": runs["sync:none"]}}, "1mb") == []


def test_benchmark_time_goals_take_the_best_k_of_each_topology():
    local_sgd = _bench()

    def timed(spec, t):
        return {**_run(spec, 1.5, 480), "time_to_target": t, "train_s": 2 * t}

    runs = {"sync:none": timed("sync:none", 300.0), "avg:4": timed("avg:4", 60.0),
            "avg:8": timed("avg:8", 36.0), "allreduce:4": timed("allreduce:4", 26.0),
            "allreduce:8": timed("allreduce:8", 31.0), "gossip:4": timed("gossip:4", 27.0),
            "gossip:8": timed("gossip:8", 25.0)}
    same = {"runs": {"sync:none": runs["sync:none"], "sync:gq8": timed("sync:gq8", 75.0)}}
    rows = local_sgd.goals(same, {"runs": runs, "factor": 3})
    assert "best allreduce K (QPRSGD allreduce K=4, 26.0 s)" in rows[2]
    assert rows[2].endswith("| >= 4x | 11.54x | yes |")
    assert rows[4].endswith("at K=4 (time-budget job, local runs 3x the steps) | >= 1.5x | "
                            "2.31x | yes |")
    assert "(QPRSGD gossip K=8, 25.0 s, the fastest QPRSGD run)" in rows[5]
    assert rows[6].endswith("| >= 1.5x | 3.00x | yes |")  # sync GQ8: 75 s
    assert rows[7].endswith("at K=8 (time-budget job, local runs 3x the steps) | >= 1.5x | "
                            "1.44x | no |")
