"""benchmarks/deep_bench.py's report and bench_common's CPU split, from made-up job results
and a thread of this process (the jobs themselves need root and run under `make bench`)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import deep_bench  # noqa: E402

from gqsgd_lab import bench_common  # noqa: E402


def _row(name: str, median_s: float, main: float | None = None, other: float = 0.0,
         **extra: float) -> dict:
    row = {"what": f"deep_{name}", "median_s": median_s, "mean_s": median_s, "grad_mb": 64.0,
           "loss_start": 0.5, "loss_end": 0.4, **extra}
    if main is not None:
        row |= {"main_cpu_s": main, "other_cpu_s": other}
    return row


def test_cpu_split_gives_the_busy_thread_its_own_cpu() -> None:
    stop, spun, done = time.perf_counter() + 0.3, threading.Event(), threading.Event()

    def spin() -> None:
        while time.perf_counter() < stop:
            pass
        spun.set()
        done.wait()  # alive at the second reading, as Horovod's background thread is

    before = bench_common.thread_cpu_s()
    worker = threading.Thread(target=spin)
    worker.start()
    spun.wait()  # this thread sleeps meanwhile
    after = bench_common.thread_cpu_s()
    done.set()
    worker.join()
    split = bench_common.cpu_split(before, after, threading.get_native_id(), steps=2)
    # 0.3 s of spinning over 2 steps, at the clock tick's resolution (10 ms); a loaded
    # machine can only take CPU from the spinner, never give it more
    assert 0.02 <= split["other_cpu_s"] <= 0.16
    assert split["main_cpu_s"] <= 0.02


def _ratio(g: dict, what: str) -> dict:
    return next(r for r in g["ratios"] if r["what"] == what)


def test_goals_budget_the_compressors_own_cpu() -> None:
    torch_rows = [_row("compute", 0.095, main=0.060, other=0.030),
                  _row("none", 0.640, main=0.100, other=0.560),
                  _row("fp16", 0.400, main=0.070, other=0.330),
                  _row("gqsgd8", 0.250, main=0.120, other=0.135, payload=16 * 2**20)]
    tf_rows = [_row(n, t) for n, t in
               (("compute", 0.1), ("none", 0.6), ("fp16", 0.36), ("gqsgd8", 0.3))]
    deep = (deep_bench.annotate([dict(r, what="deep_" + r["what"][5:]) for r in torch_rows],
                                "PyTorch", 2, "1gbit")
            + deep_bench.annotate([dict(r, what="tf_deep_" + r["what"][5:]) for r in tf_rows],
                                  "TF", 2, "1gbit"))
    g = deep_bench.goals(deep)
    none = _ratio(g, "none/GQ8")
    assert none["torch"] == pytest.approx(0.640 / 0.250) and not none["met"]
    assert none["tf"] == pytest.approx(2.0) and not none["tf_close"]  # 22% below PyTorch's
    cpu = g["cpu"]
    assert (cpu["main"], cpu["compute"], cpu["other"]) == (0.120, 0.060, 0.135)
    assert cpu["own"] == pytest.approx(0.060)
    # 3.2x: a step of 0.640 / 3.2 = 0.200 s, less the model's 0.060 and Horovod's 0.135
    assert cpu["budgets"]["none/GQ8"]["step"] == pytest.approx(0.200)
    assert cpu["budgets"]["none/GQ8"]["own_allowed"] == pytest.approx(0.005)
    # 1.7x: 0.400 / 1.7 = 0.235 s, less the same 0.195 s
    assert cpu["budgets"]["fp16/GQ8"]["own_allowed"] == pytest.approx(0.400 / 1.7 - 0.195)
    assert "tf_cpu" not in g and "gloo" not in g
    table = deep_bench.deep_table(deep)
    assert "| 0.120 + 0.135 |" in table[4] and "| - |" in table[-1]
    assert len(deep_bench.goal_lines(deep)) == 1 + 2 + 1 + 2  # header, ratios, CPU, budgets


def test_tf_rows_report_their_process_cpu_against_the_goal() -> None:
    torch_rows = [_row("compute", 0.095), _row("none", 0.640), _row("fp16", 0.400),
                  _row("gqsgd8", 0.250, payload=16 * 2**20)]
    tf_rows = [_row(n, t, process_cpu_s=c) for n, t, c in
               (("compute", 0.1, 0.1), ("none", 0.6, 0.3), ("fp16", 0.36, 0.3),
                ("gqsgd8", 0.3, 0.28))]
    deep = (deep_bench.annotate(torch_rows, "PyTorch", 2, "1gbit")
            + deep_bench.annotate([dict(r, what="tf_" + r["what"]) for r in tf_rows], "TF",
                                  2, "1gbit"))
    tf = deep_bench.goals(deep)["tf_cpu"]
    # within 15% of PyTorch's 2.56x: a step of 0.6 / (0.85 * 2.56) = 0.276 s, less the
    # model's 0.1 s of CPU; measured beyond the model: 0.28 - 0.1
    assert tf["need_step"] == pytest.approx(0.6 / (0.85 * 0.640 / 0.250))
    assert tf["left"] == pytest.approx(tf["need_step"] - 0.1)
    assert tf["measured"] == pytest.approx(0.180) and tf["busy"] == pytest.approx(0.28 / 0.3)
    assert "| 0.280 (all threads) |" in deep_bench.deep_table(deep)[-1]


def test_goals_are_met_when_the_ratios_reach_them() -> None:
    torch_rows = [_row("compute", 0.06), _row("none", 0.64), _row("fp16", 0.40),
                  _row("gqsgd8", 0.19, payload=16 * 2**20)]
    deep = deep_bench.annotate(torch_rows, "PyTorch", 2, "1gbit") + deep_bench.annotate(
        [dict(r, what="tf_" + r["what"]) for r in torch_rows], "TF", 2, "1gbit")
    g = deep_bench.goals(deep)
    assert all(r["met"] and r["tf_close"] for r in g["ratios"])
    assert _ratio(g, "fp16/GQ8")["torch"] == pytest.approx(0.40 / 0.19)
    assert "cpu" not in g and "tf_cpu" not in g  # no CPU split measured: no budgets
    assert pytest.approx(deep[0]["wire"]) == 2 * 0.5 * 64 * 2**20 * 8 / 1e9


def test_gloo_rows_get_their_own_entry_and_stay_out_of_the_goals() -> None:
    mpi = [_row("compute", 0.06), _row("none", 0.64), _row("fp16", 0.40),
           _row("gqsgd8", 0.25, payload=16 * 2**20)]
    gloo = [_row("compute", 0.06, main=0.06, other=0.0), _row("none", 0.64, main=0.5),
            _row("fp16", 0.44, main=0.2), _row("gqsgd8", 0.22, main=0.18, other=0.04,
                                                payload=16 * 2**20)]
    deep = (deep_bench.annotate(mpi, "PyTorch", 2, "1gbit")
            + deep_bench.annotate([dict(r, what="tf_" + r["what"]) for r in mpi], "TF", 2,
                                  "1gbit")
            + deep_bench.annotate(gloo, deep_bench.GLOO, 2, "1gbit"))
    g = deep_bench.goals(deep)
    assert _ratio(g, "none/GQ8")["torch"] == pytest.approx(0.64 / 0.25)  # mpirun's, not Gloo's
    assert g["gloo"]["vs_none"] == pytest.approx(0.64 / 0.22)
    assert g["gloo"]["vs_fp16"] == pytest.approx(0.44 / 0.22)
    assert (g["gloo"]["other_cpu_s"], g["gloo"]["main_cpu_s"]) == (0.04, 0.18)


def test_goals_need_both_frameworks_rows() -> None:
    deep = deep_bench.annotate([_row("compute", 0.06), _row("none", 0.64), _row("fp16", 0.40),
                                _row("gqsgd8", 0.25)], "PyTorch", 2, "1gbit")
    assert deep_bench.goals(deep) == {}
    assert len(deep_bench.goal_lines(deep)) == 1


WORKER = """
import socket, horovod.torch as hvd, torch
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
print("RESULT", hvd.rank(), socket.gethostbyname(socket.gethostname()), float(total), flush=True)
"""


def test_horovodrun_runs_gloo_across_the_emulated_hosts(tmp_path) -> None:
    from gqsgd_lab.emulated_hosts import EmulatedHosts
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with EmulatedHosts(2, rate="1gbit") as net:
        proc = net.horovodrun([sys.executable, str(script)], env={"OMP_NUM_THREADS": "1"},
                              timeout=300)
        etc = [Path("/etc/netns") / ns for ns in net.hosts]
        assert all((e / "hosts").exists() for e in etc)
        addresses = net.addresses
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = sorted(line.split("RESULT ")[1].split() for line in proc.stdout.splitlines()
                     if "RESULT " in line)
    # each rank on its own host, whose hostname resolves to that host's address (Gloo binds
    # there), and the sum went through Gloo between them
    assert results == [["0", addresses[0], "3.0"], ["1", addresses[1], "3.0"]]
    assert not any(e.exists() for e in etc)
