"""benchmarks/netbench.py's report: the table of measured times, from made-up job results
(the jobs themselves need root and run under `make bench`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import netbench  # noqa: E402


def _rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """(framework, compressor) -> the row's cells after the compressor."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {(c[2], c[3]): c[4:] for c in cells}


def _result(times: dict[str, float], compressors: list[str]) -> dict:
    return {"hosts": 2, "rate": "1gbit", "frameworks": ["torch"], "compressors": compressors,
            "times": times}


def test_table_gives_ratios_against_every_baseline_it_has() -> None:
    times = {"latency": 0.002, "none": 0.6, "fp16": 0.3, "qsgd8": 0.45, "gqsgd8": 0.15,
             "local_gqsgd8": 0.03}
    rows = _rows(netbench.table([_result(times, ["none", "fp16", "qsgd8", "gqsgd8"])], 64))
    time_s, vs_none, vs_fp16, vs_qsgd, model = rows[("torch", "gqsgd8")]
    assert (time_s, vs_none, vs_fp16, vs_qsgd) == ("0.150", "4.00x", "2.00x", "3.00x")
    # 3 latencies + 16 MiB of codes through a 2-host ring at 1 Gbit/s + the local cost,
    # printed to the millisecond
    assert float(model) == pytest.approx(3 * 0.002 + 16 * 2**20 * 8 / 1e9 + 0.03, abs=5e-4)


def test_table_leaves_a_missing_baseline_blank_instead_of_failing() -> None:
    # a TF-only sweep of chunk sizes, run without fp16 and qsgd8: the report used to raise
    # KeyError: 'fp16' after every job had run
    times = {"tf_latency": 0.002, "tf_none": 0.57, "tf_gqsgd8": 0.19, "tf_local_gqsgd8": 0.04,
             "tf_gqsgd8@8192k": 0.18, "tf_local_gqsgd8@8192k": 0.04}
    result = _result(times, ["none", "gqsgd8", "gqsgd8@8192k"]) | {"frameworks": ["tf"]}
    rows = _rows(netbench.table([result], 64))
    assert rows[("tf", "gqsgd8@8192k")][:4] == ["0.180", "3.17x", "-", "-"]
    assert rows[("tf", "none")][1:4] == ["1.00x", "-", "-"]


def test_busy_loops_spin_at_the_niceness_asked_and_stop_on_exit() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with netbench.busy_loops(2, 5) as procs:
        assert len(procs) == 2
        for proc in procs:
            assert proc.poll() is None
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, own + 5)
    assert all(proc.poll() is not None for proc in procs)


def test_the_plugins_settings_reach_every_rank(monkeypatch) -> None:
    """mpirun hands a rank only the variables it is told to, so netbench forwards this
    process's HVD_GQSGD_* settings (and nothing else of its environment)."""
    for name in [k for k in os.environ if k.startswith("HVD_GQSGD_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HVD_GQSGD_OVERLAP_NICE", "10")
    monkeypatch.setenv("HVD_GQSGD_KERNELS", "0")
    monkeypatch.setenv("NOT_HVD_GQSGD_X", "1")
    assert netbench.plugin_env() == {"HVD_GQSGD_OVERLAP_NICE": "10", "HVD_GQSGD_KERNELS": "0"}
