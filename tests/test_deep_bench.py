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


def test_goal_lines_budget_the_compressors_own_cpu() -> None:
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
    lines = deep_bench.goal_lines(deep)
    text = "\n".join(lines)
    assert "PyTorch 2.56x (goal 3.2x: not met), TF 2.00x (-22% against PyTorch's; goal " \
           "within 15%: not met)" in text
    assert "model thread 0.120 s (the model alone 0.060 s, so GlobalQSGD and Horovod's " \
           "hooks 0.060 s), Horovod's threads 0.135 s" in text
    # 3.2x: a step of 0.640 / 3.2 = 0.200 s, less the model's 0.060 and Horovod's 0.135
    assert "needs a step <= 0.200 s: with the model and Horovod's threads as measured, " \
           "GlobalQSGD's own work could take 0.005 s a step at most, against 0.060 s" in text
    # 1.7x: 0.400 / 1.7 = 0.235 s, less the same 0.195 s
    assert "needs a step <= 0.235 s" in text and "could take 0.040 s a step" in text
    table = deep_bench.deep_table(deep)
    assert "| 0.120 + 0.135 |" in table[4] and "| - |" in table[-1]


def test_tf_rows_report_their_process_cpu_against_the_goal() -> None:
    torch_rows = [_row("compute", 0.095), _row("none", 0.640), _row("fp16", 0.400),
                  _row("gqsgd8", 0.250, payload=16 * 2**20)]
    tf_rows = [_row(n, t, process_cpu_s=c) for n, t, c in
               (("compute", 0.1, 0.1), ("none", 0.6, 0.3), ("fp16", 0.36, 0.3),
                ("gqsgd8", 0.3, 0.28))]
    deep = (deep_bench.annotate(torch_rows, "PyTorch", 2, "1gbit")
            + deep_bench.annotate([dict(r, what="tf_" + r["what"]) for r in tf_rows], "TF",
                                  2, "1gbit"))
    text = "\n".join(deep_bench.goal_lines(deep))
    # within 15% of PyTorch's 2.56x: a step of 0.6 / (0.85 * 2.56) = 0.276 s, less the
    # model's 0.1 s of CPU; measured beyond the model: 0.28 - 0.1
    assert "TF GQ8, CPU a step: 0.280 s over all threads (mean over ranks) against a step " \
           "of 0.300 s (the model alone 0.100 s of CPU): the rank's one core is busy 93%" in text
    assert "needs a step <= 0.276 s, which leaves 0.176 s of CPU a step for Horovod's " \
           "threads and GlobalQSGD together, against 0.180 s measured" in text
    assert "| 0.280 (all threads) |" in deep_bench.deep_table(deep)[-1]


def test_goal_lines_say_met_when_a_goal_is() -> None:
    torch_rows = [_row("compute", 0.06), _row("none", 0.64), _row("fp16", 0.40),
                  _row("gqsgd8", 0.19, payload=16 * 2**20)]
    deep = deep_bench.annotate(torch_rows, "PyTorch", 2, "1gbit") + deep_bench.annotate(
        [dict(r, what="tf_" + r["what"]) for r in torch_rows], "TF", 2, "1gbit")
    text = "\n".join(deep_bench.goal_lines(deep))
    assert "PyTorch 3.37x (goal 3.2x: met), TF 3.37x (+0% against PyTorch's; goal within " \
           "15%: met)" in text
    assert "fp16/GQ8: PyTorch 2.11x (goal 1.7x: met)" in text
    assert "CPU a step" not in text  # no CPU split measured: no budget lines
    assert pytest.approx(deep[0]["wire"]) == 2 * 0.5 * 64 * 2**20 * 8 / 1e9


def test_gloo_rows_get_their_own_line_and_stay_out_of_the_goals() -> None:
    mpi = [_row("compute", 0.06), _row("none", 0.64), _row("fp16", 0.40),
           _row("gqsgd8", 0.25, payload=16 * 2**20)]
    gloo = [_row("compute", 0.06, main=0.06, other=0.0), _row("none", 0.64, main=0.5),
            _row("fp16", 0.44, main=0.2), _row("gqsgd8", 0.22, main=0.18, other=0.04,
                                                payload=16 * 2**20)]
    deep = (deep_bench.annotate(mpi, "PyTorch", 2, "1gbit")
            + deep_bench.annotate([dict(r, what="tf_" + r["what"]) for r in mpi], "TF", 2,
                                  "1gbit")
            + deep_bench.annotate(gloo, deep_bench.GLOO, 2, "1gbit"))
    text = "\n".join(deep_bench.goal_lines(deep))
    assert "none/GQ8: PyTorch 2.56x (goal 3.2x: not met)" in text  # mpirun's, not Gloo's
    assert "under `horovodrun --gloo`" in text and "none/GQ8 2.91x, fp16/GQ8 2.00x" in text
    assert "(0.040 s of CPU a step), and the model thread's 0.180 s" in text


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
