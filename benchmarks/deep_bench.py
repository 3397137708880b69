"""Deep models on emulated hosts (issue 26): `make bench` runs it (root needed).

    .venv/bin/python benchmarks/deep_bench.py     # docs/BENCHMARKS.md, its deep_model section

One run, on an otherwise idle machine, of:

* benchmarks/deep_worker.py (PyTorch, ``hvd.DistributedOptimizer``) and deep_worker_tf.py
  (TensorFlow, ``DistributedGradientTape`` in ``tf.function``): 16 x ``Linear(1024, 1024)`` +
  Tanh, batch 16, 64 MB of fp32 gradient in 32 tensors, at 2 and 4 hosts (network
  namespaces, gqsgd_lab/emulated_hosts.py), 1 and 10 Gbit/s; ``none``, ``fp16``,
  ``gqsgd8`` (GlobalQSGD(8) with its defaults: 8 MiB buckets sealed from ``compress`` in
  PyTorch) and ``gqsgd8b0k`` (``bucket_bytes=0``: one bucket per step, sealed by the first
  ``decompress``, the behaviour before issue 26); and deep_worker.py again under
  ``horovodrun --gloo`` (Horovod's Gloo controller: its background thread does not
  busy-poll, but Horovod's wait on the model thread spins; ``--gloo ''`` skips it);
* the same variants on benchmarks/train_worker.py's 2-layer MLP (2 hosts, 1 Gbit/s), and the
  DDP hook against DDP's own allreduce (benchmarks/ddp_bench_worker.py);
* the 300-tensor shape of benchmarks/small_tensors.py (2 ranks, loopback).

Each deep row is set against a floor, ``max(compute, wire)``: ``compute`` is the step with no
Horovod at all, measured in the same job on every emulated host at once (so on this
machine's 2 shared cores), ``wire`` the ring allreduce's bytes at the link rate, ``2 (n-1)/n
B 8 / R``, with ``B`` the bytes one rank sends into it (codes for GlobalQSGD).  Where a row
sits at its compute floor, the emulation's CPU, not the compressor, caps it.  PyTorch's
rows also show the CPU a step took, split between the thread that runs the model (with
GlobalQSGD's kernels) and Horovod's threads, whose MPI wait busy-polls while bytes are in
flight: on one core per rank the two add up to the step, so the transfer adds to the model
thread's work here instead of hiding behind it, and the goal lines say how much CPU
GlobalQSGD's own work could take at most for each goal.

Traffic stays inside the namespaces made here; they are removed on exit; each job has a
timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gqsgd_lab.bench_common import write_section
from gqsgd_lab.emulated_hosts import EmulatedHosts, require_root
from hvd_gqsgd import core

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "BENCHMARKS.md"
RATES = {"1gbit": 1e9, "10gbit": 1e10}
ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "OMP_NUM_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "3"}
GLOO = "PyTorch, Gloo"  # deep_worker.py under horovodrun --gloo: Horovod's Gloo controller
GOALS = "none/GQ8 >= 3.2x and fp16/GQ8 >= 1.7x in PyTorch; TF within 15% of those ratios"


def rows_of(proc: subprocess.CompletedProcess, what: str) -> list[dict]:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return [json.loads(line) for line in rank0_lines(proc.stdout) if line.startswith("{")]


def rank0_lines(stdout: str) -> list[str]:
    """mpirun's output lines, rank 0's without their ``[0]<stdout>:`` tag."""
    return [line.split(":", 1)[1] if line.startswith("[0]<stdout>:") else line
            for line in stdout.splitlines()]


def on_hosts(net: EmulatedHosts, worker: str, *args: str, env: dict | None = None,
             gloo: bool = False) -> list[dict]:
    """Rank 0's rows of ``worker`` on every host: mpirun (Horovod's MPI controller), or with
    ``gloo`` horovodrun --gloo."""
    command = [sys.executable, str(ROOT / "benchmarks" / worker), *args]
    launch = net.horovodrun if gloo else net.mpirun
    return rows_of(launch(command, env={**ENV, **(env or {})}, timeout=1200),
                   f"{worker} on {net.n} hosts{' (Gloo)' if gloo else ''}")


def wire_seconds(row: dict, name: str, hosts: int, rate: float) -> float:
    """The ring allreduce's bytes per rank at ``rate``: the floor the link sets."""
    nbytes = row["grad_mb"] * 2**20
    if name == "fp16":
        nbytes /= 2
    elif name.startswith("gqsgd"):
        nbytes = row.get("payload") or core.wire_bytes(int(nbytes // 4), 8)
    return 2 * (hosts - 1) / hosts * nbytes * 8 / rate


def deep_table(rows: list[dict]) -> list[str]:
    lines = ["| framework | hosts | link | compressor | step (s) | none / this | fp16 / this | "
             "floor max(compute, wire) (s) | this / floor | CPU a step: model thread + "
             "Horovod threads (s) | held-out loss start -> end |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = (f"{r['main_cpu_s']:.3f} + {r['other_cpu_s']:.3f}" if "main_cpu_s" in r
               else f"{r['process_cpu_s']:.3f} (all threads)" if "process_cpu_s" in r else "-")
        lines.append(
            f"| {r['framework']} | {r['hosts']} | {r['rate']} | {r['name']} | "
            f"{r['median_s']:.3f} | {r['vs_none']:.2f}x | {r['vs_fp16']:.2f}x | "
            f"{r['floor']:.3f} | {r['median_s'] / r['floor']:.2f}x | {cpu} | "
            f"{r['loss_start']:.6f} -> {r['loss_end']:.6f} |")
    return lines


def annotate(rows: list[dict], framework: str, hosts: int, rate: str) -> list[dict]:
    prefix = "tf_deep_" if framework == "TF" else "deep_"
    by = {r["what"][len(prefix):]: r for r in rows}
    compute_row = by.pop("compute")
    compute = compute_row["median_s"]
    out = []
    for name, r in by.items():
        wire = wire_seconds(r, name, hosts, RATES[rate])
        # the model's own CPU a step: PyTorch's model thread, or all of TF's threads
        cpu = compute_row.get("main_cpu_s", compute_row.get("process_cpu_s"))
        own = {} if cpu is None else {"compute_cpu_s": cpu}
        out.append({**r, "name": name, "framework": framework, "hosts": hosts, "rate": rate,
                    "vs_none": by["none"]["median_s"] / r["median_s"],
                    "vs_fp16": by["fp16"]["median_s"] / r["median_s"],
                    "compute": compute, "wire": wire, "floor": max(compute, wire), **own})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--torch", default="compute,none,fp16,gqsgd8,gqsgd8b0k")
    parser.add_argument("--tf", default="compute,none,fp16,gqsgd8,gqsgd8b0k")
    parser.add_argument("--gloo", default="compute,none,fp16,gqsgd8",
                        help="PyTorch variants to run again under horovodrun --gloo "
                        "('': none)")
    args = parser.parse_args()
    require_root()
    start = time.perf_counter()
    deep: list[dict] = []
    others: list[str] = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        for rate in args.rates.split(","):
            with EmulatedHosts(hosts, rate=rate) as net:
                deep += annotate(on_hosts(net, "deep_worker.py", "--steps", str(args.steps),
                                          "--compressors", args.torch), "PyTorch", hosts, rate)
                deep += annotate(on_hosts(net, "deep_worker_tf.py", "--steps",
                                          str(args.steps), "--compressors", args.tf),
                                 "TF", hosts, rate)
                if args.gloo:
                    deep += annotate(on_hosts(net, "deep_worker.py", "--steps",
                                              str(args.steps), "--compressors", args.gloo,
                                              gloo=True), GLOO, hosts, rate)
                if hosts == 2 and rate == "1gbit":
                    others += shallow_rows(net, args)
    others += small_rows()
    lines = ["## Deep models: codes on the wire while backward runs", "",
             f"`python benchmarks/deep_bench.py` ({time.strftime('%Y-%m-%d')}, "
             f"{time.perf_counter() - start:.0f} s; see its docstring): 16 x "
             "`Linear(1024, 1024)` + Tanh, batch 16, 64 MB of fp32 gradient in 32 tensors; "
             "emulated hosts (network namespaces) on this machine's 2 cores, one rank each, "
             f"median of {args.steps} steps of the slowest rank.  `gqsgd8` is "
             "`GlobalQSGD(bits=8)` with its defaults, `gqsgd8b0k` the same with "
             "`bucket_bytes=0` (one bucket per step).  The floor is max(compute, wire): "
             "compute measured with no Horovod, on all hosts at once; wire the ring's bytes "
             "at the link rate.  CPU a step (PyTorch, mean over ranks): the thread that runs "
             "the model and GlobalQSGD's kernels, plus Horovod's threads (its background "
             "thread busy-polls in MPI while bytes are in flight); on one core per rank the "
             "two add up to the step.  `PyTorch, Gloo`: the PyTorch job again under "
             "`horovodrun --gloo` instead of mpirun.", "", *deep_table(deep), "",
             *goal_lines(deep), "",
             "Where backward is short, or the model small, the same run (the 300-tensor "
             "`floorcpu` is the floor plus busy work as long as GlobalQSGD's own CPU a round, "
             "measured without Horovod in the same job; `floor` is no compressor: Horovod "
             "gets GlobalQSGD's probes and makes its two "
             "blocking exchanges after backward, but nothing is quantized, so GlobalQSGD "
             "cannot be faster than it; see benchmarks/small_tensors.py):", "", *others, ""]
    print("\n".join(lines))
    write_section(DOC, "deep_model", lines)
    return 0


GOAL_RATIOS = (("none/GQ8", "vs_none", 3.2), ("fp16/GQ8", "vs_fp16", 1.7))
TF_WITHIN = 0.15  # TF's ratio within this fraction of PyTorch's


def goals(deep: list[dict]) -> dict:
    """The goals at 2 hosts and 1 Gbit/s, as numbers and verdicts (goal_lines words them):
    ``ratios`` per goal; ``cpu`` (PyTorch's CPU split: what GlobalQSGD's own work may take
    a step for each goal, against what it took), ``tf_cpu`` and ``gloo`` where measured."""
    def at(framework: str, name: str) -> dict | None:
        return next((r for r in deep if r["framework"] == framework and r["name"] == name
                     and r["hosts"] == 2 and r["rate"] == "1gbit"), None)

    torch_gq, tf_gq = at("PyTorch", "gqsgd8"), at("TF", "gqsgd8")
    if torch_gq is None or tf_gq is None:
        return {}
    out: dict = {"ratios": []}
    for what, key, goal in GOAL_RATIOS:
        t, f = torch_gq[key], tf_gq[key]
        out["ratios"].append({"what": what, "goal": goal, "torch": t, "met": t >= goal,
                              "tf": f, "tf_vs_torch": f / t - 1,
                              "tf_close": abs(f / t - 1) <= TF_WITHIN})
    old = at("PyTorch", "gqsgd8b0k")
    if old is not None:
        out["bucketed"] = {"faster": old["median_s"] / torch_gq["median_s"],
                           "of_floor": torch_gq["median_s"] / torch_gq["floor"],
                           "compute": torch_gq["compute"], "wire": torch_gq["wire"]}
    none, fp16 = at("PyTorch", "none"), at("PyTorch", "fp16")
    if none is not None and fp16 is not None and "compute_cpu_s" in torch_gq:
        main, other = torch_gq["main_cpu_s"], torch_gq["other_cpu_s"]
        compute = torch_gq["compute_cpu_s"]
        budgets = {}
        for what, key, goal in GOAL_RATIOS:
            base = {"vs_none": none, "vs_fp16": fp16}[key]["median_s"]
            budgets[what] = {"goal": goal, "step": base / goal,
                             "own_allowed": base / goal - compute - other}
        out["cpu"] = {"main": main, "other": other, "compute": compute,
                      "own": main - compute,  # GlobalQSGD's kernels and Horovod's hooks
                      "wire": torch_gq["wire"], "mean_s": torch_gq["mean_s"],
                      "budgets": budgets}
    tf_none = at("TF", "none")
    if "process_cpu_s" in tf_gq and tf_none is not None:
        need = tf_none["median_s"] / ((1 - TF_WITHIN) * torch_gq["vs_none"])
        cpu, compute = tf_gq["process_cpu_s"], tf_gq["compute_cpu_s"]
        out["tf_cpu"] = {"cpu": cpu, "step": tf_gq["median_s"], "compute": compute,
                         "busy": cpu / tf_gq["median_s"], "need_step": need,
                         "left": need - compute, "measured": cpu - compute}
    gloo = at(GLOO, "gqsgd8")
    if gloo is not None:
        out["gloo"] = {k: gloo[k] for k in ("vs_none", "vs_fp16", "other_cpu_s", "main_cpu_s")}
    return out


def goal_lines(deep: list[dict]) -> list[str]:
    """goals(deep), in words, for the page."""
    g = goals(deep)
    out = [f"Goals at 2 hosts and 1 Gbit/s: {GOALS}."]
    if not g:
        return out
    for r in g["ratios"]:
        out.append(f"- {r['what']}: PyTorch {r['torch']:.2f}x (goal {r['goal']}x: "
                   f"{'met' if r['met'] else 'not met'}), TF {r['tf']:.2f}x "
                   f"({100 * r['tf_vs_torch']:+.0f}% against PyTorch's; goal within "
                   f"{100 * TF_WITHIN:.0f}%: {'met' if r['tf_close'] else 'not met'})")
    if "bucketed" in g:
        b = g["bucketed"]
        out.append(f"- PyTorch GQ8 default against `bucket_bytes=0`: {b['faster']:.2f}x "
                   f"faster; default at {b['of_floor']:.2f}x of its floor (compute "
                   f"{b['compute']:.3f} s, wire {b['wire']:.3f} s)")
    if "cpu" in g:
        c = g["cpu"]
        out.append(
            f"- PyTorch GQ8, CPU a step: the model thread {c['main']:.3f} s (the model alone "
            f"{c['compute']:.3f} s, so GlobalQSGD and Horovod's hooks {c['own']:.3f} s), "
            f"Horovod's threads {c['other']:.3f} s (its background thread busy-polls in MPI "
            f"while codes are on the wire: {c['wire']:.3f} s at this rate).  On one core per "
            f"rank the two add up to the step ({c['main'] + c['other']:.3f} s against a mean "
            f"step of {c['mean_s']:.3f} s): each second Horovod's thread polls is a second the "
            f"model thread waits, so here the codes' transfer adds to the model thread's work "
            f"instead of hiding behind it.")
        for what, b in c["budgets"].items():
            out.append(f"- {what} >= {b['goal']}x needs a step <= {b['step']:.3f} s: with the "
                       f"model and Horovod's threads as measured, GlobalQSGD's own work could "
                       f"take {b['own_allowed']:.3f} s a step at most, against {c['own']:.3f} s "
                       f"measured")
    if "tf_cpu" in g:
        t = g["tf_cpu"]
        out.append(
            f"- TF GQ8, CPU a step: {t['cpu']:.3f} s over all threads (mean over ranks) against "
            f"a step of {t['step']:.3f} s (the model alone {t['compute']:.3f} s of CPU): the "
            f"rank's one core is busy {100 * t['busy']:.0f}% of the step.  Within "
            f"{100 * TF_WITHIN:.0f}% of PyTorch's none/GQ8 needs a step <= {t['need_step']:.3f} "
            f"s, which leaves {t['left']:.3f} s of CPU a step for Horovod's threads and "
            f"GlobalQSGD together, against {t['measured']:.3f} s measured")
    if "gloo" in g:
        w = g["gloo"]
        out.append(f"- The same PyTorch job under `horovodrun --gloo` (Horovod's Gloo "
                   f"controller; the goals above are measured under mpirun, as in the issue): "
                   f"none/GQ8 {w['vs_none']:.2f}x, fp16/GQ8 {w['vs_fp16']:.2f}x.  "
                   f"There Horovod's background thread waits without polling "
                   f"({w['other_cpu_s']:.3f} s of CPU a step), and the model thread's "
                   f"{w['main_cpu_s']:.3f} s includes Horovod's own wait, which spins "
                   f"(yielding) while the codes are out")
    return out


def shallow_rows(net: EmulatedHosts, args: argparse.Namespace) -> list[str]:
    """The 2-layer MLP (train_worker.py) and the DDP hook, 2 hosts at 1 Gbit/s."""
    rows = on_hosts(net, "train_worker.py", "--steps", str(args.steps), "--compressors",
                    "none,fp16,gqsgd8,gqsgd8b0k")
    base = {r["what"]: r["median_s"] for r in rows}
    out = ["| what | variant | step (s) | none / this |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| 2-layer MLP (64 MB), 2 hosts, 1gbit, DistributedOptimizer | "
                   f"{r['what'][len('train_'):]} | {r['median_s']:.3f} | "
                   f"{base['train_none'] / r['median_s']:.2f}x |")
    ddp = on_hosts(net, "ddp_bench_worker.py", "--mode", "ddp", "--variants",
                   "default,fp16,gqsgd8", "--steps", str(args.steps),
                   env={"MASTER_ADDR": net.addresses[0], "MASTER_PORT": "29500",
                        "GLOO_SOCKET_IFNAME": "eth0"})
    base_ddp = {r["variant"]: r["median_s"] for r in ddp}
    for r in ddp:
        out.append(f"| DDP hook (hvd_gqsgd.ddp), same MLP, 2 hosts, 1gbit | {r['variant']} | "
                   f"{r['median_s']:.3f} | {base_ddp['default'] / r['median_s']:.2f}x |")
    return out


def small_rows() -> list[str]:
    """benchmarks/small_tensors.py's 300 tensors, 2 ranks on loopback (goal: <= 1.5x)."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    proc = subprocess.run(
        [str(horovodrun), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
         str(ROOT / "benchmarks" / "small_tensors.py"), "--compressors",
         ",".join(SMALL)], capture_output=True, text=True, timeout=900,
        env={**os.environ, **ENV})
    records = rows_of(proc, "small_tensors.py")
    rows = {r["what"]: r["median_s"] for r in records if "median_s" in r}
    own = next(r for r in records if r["what"] == "small_own_cpu")
    own_ms = 1e3 * (own["compress_s"] + own["decompress_s"])
    label = {"floorcpu": f"floorcpu (floor + {own_ms:.2f} ms busy)"}
    return [f"| 300 tensors (150 `Linear(32, 32)`), 2 ranks, loopback | "
            f"{label.get(name, name)} | {1e3 * rows[f'small_{name}']:.2f} ms | "
            f"{rows['small_none'] / rows[f'small_{name}']:.2f}x (this/none "
            f"{rows[f'small_{name}'] / rows['small_none']:.2f}x"
            + ("; goal <= 1.5x) |" if name.startswith("gqsgd") else ") |")
            for name in SMALL]


# floor: GlobalQSGD's probes and its two blocking exchanges, no quantization; floorcpu: the
# floor plus busy work as long as GlobalQSGD's own CPU a round (small_tensors.py)
SMALL = ("none", "floor", "floorcpu", "gqsgd8", "gqsgd8b0k", "fp16")


if __name__ == "__main__":
    raise SystemExit(main())
