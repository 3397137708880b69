"""examples/demo.py (`make demo`): its step-time columns from made-up costs, then the
predicted path end to end (what a user without root sees) through horovodrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gqsgd_lab.launch import TIMEOUT_S

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import demo  # noqa: E402

COSTS = {"latency": 0.002, "compute": 0.07, "local_gqsgd8": 0.05}


def test_worker_names_of_the_specs_it_can_time():
    assert [demo.worker_name(s) for s in ("none", "fp16", "gq8", "gq4:l2", "qprsgd8:k=4")] == [
        "none", "fp16", "gqsgd8", None, None]


def test_predicted_step_is_compute_plus_the_models_allreduce():
    steps = demo.predict_steps(COSTS, ["none", "gqsgd8"])
    wire = demo.grad_mb() * 2**20 * 8  # bits of fp32 gradient; a 2-host ring sends it once
    assert steps["1gbit"]["none"] == pytest.approx(0.07 + 0.002 + wire / 1e9)
    assert steps["10gbit"]["none"] == pytest.approx(0.07 + 0.002 + wire / 1e10)
    # 3 latencies (scale, probe, codes), a quarter of the bits (one element per 8-bit lane,
    # to the word), the local cost
    assert steps["1gbit"]["gqsgd8"] == pytest.approx(0.07 + 3 * 0.002 + wire / 4 / 1e9 + 0.05,
                                                     rel=1e-3)


def test_columns_and_footer_say_predicted_and_compare_with_fp32():
    runs = [{"spec": "none", "label": "fp32 (none)"},
            {"spec": "gq8", "label": "GlobalQSGD(8)"}, {"spec": "gq4:l2", "label": "GQ(4, l2)"}]
    steps = {"1gbit": {"none": 0.6, "gqsgd8": 0.3}, "10gbit": {"none": 0.1, "gqsgd8": 0.125}}
    columns = demo.link_columns(runs, steps, predicted=True)
    assert [c[0] for c in columns] == ["1G step*", "10G step*"]
    assert [r["step_1gbit"] for r in runs[:2]] == [0.6, 0.3] and runs[2]["step_1gbit"] != 0.6
    text = "\n".join(demo.footer(runs, steps, predicted=True))
    assert "PREDICTED, not measured" in text
    assert "GlobalQSGD(8) step at 1 Gbit/s: 2.00x faster than fp32 (predicted)." in text
    assert "GlobalQSGD(8) step at 10 Gbit/s: 1.25x slower than fp32 (predicted)." in text
    assert "GQ(4, l2)" not in text  # a spec the benchmark workers cannot time
    measured = "\n".join(demo.footer(runs, {"1gbit": steps["1gbit"]}, predicted=False))
    assert "measured on 2 emulated hosts" in measured and "predicted" not in measured.lower()


def test_auto_without_root_says_why_and_predicts(monkeypatch, capsys):
    """As a user without root: the real EmulatedHosts refuses, the demo says so and
    predicts (the costs job is replaced by COSTS here; the end-to-end test runs it)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(demo, "measure_costs", lambda names, np_: COSTS)
    steps, predicted = demo.link_steps("auto", ["none", "gqsgd8"], 2, 3)
    assert predicted and set(steps) == {"1gbit", "10gbit"}
    assert steps == demo.predict_steps(COSTS, ["none", "gqsgd8"])
    assert "No emulated hosts here (emulated hosts need root" in capsys.readouterr().out
    with pytest.raises(PermissionError, match="need root"):
        demo.link_steps("emulated", ["none"], 2, 3)  # asked for a measurement: no prediction


@pytest.mark.multiproc
def test_demo_without_emulated_hosts_prints_predicted_step_times():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--link",
                           "predicted", "--epochs", "2"], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.replace("[0]<stdout>:", "")
    assert re.search(r"^run .* wall s\s+1G step\*\s+10G step\*$", out, re.M), out
    rows = {m.group(1): [float(v) for v in m.group(2, 3, 4)] for m in re.finditer(
        r"^(fp32 \(none\)|GlobalQSGD\(8\))\s.*\s([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    assert set(rows) == {"fp32 (none)", "GlobalQSGD(8)"}, out
    wire_s = demo.grad_mb() * 2**20 * 8 / 1e9  # the fp32 gradient through a 1 Gbit/s ring
    (_, none_1g, none_10g), (_, gq_1g, gq_10g) = rows["fp32 (none)"], rows["GlobalQSGD(8)"]
    assert none_1g > wire_s and gq_1g > wire_s / 4  # no step beats its own wire time
    assert none_10g < none_1g and gq_10g < gq_1g
    assert "PREDICTED, not measured" in out and "step at 1 Gbit/s" in out
