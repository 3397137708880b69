"""Bandwidth benchmark on emulated hosts: `make bench` (root needed).

Runs benchmarks/allreduce_worker.py with mpirun on 2..4 network namespaces whose links are
rate-limited with tc, sweeping link rate and host count, then benchmarks/train_worker.py (a
communication-bound training step) on 2 hosts at 1 Gbit/s, and writes

* docs/BENCHMARKS.md: measured allreduce times, speed-ups over Compression.none and fp16,
  and what a small performance model predicts;
* docs/bench_speedup.png: speed-up vs link rate.

The model: one allreduce of B bytes per rank over n hosts at rate R costs
``t(B) = a + 2 (n-1)/n * B * 8 / R`` (ring), with the latency ``a`` measured in the same job;
GlobalQSGD adds two more round trips (scale exchange, probe) and its local cost ``c``
(quantization, measured in the same job on a one-rank process set), so
``t_gq = 3a + 2 (n-1)/n * B/(32/bits) * 8 / R + c`` when it sends one allreduce (the
default); with ``chunk_bytes`` (the ``@<KiB>k`` rows) quantization can overlap the wire, and
the model gives the full-overlap bound ``3a + max(wire, c)``.  The QSGD baseline allgathers:
``t_qsgd = 2a + (n-1) * B/(32/bits) * 8 / R + c`` (c taken from GlobalQSGD at the same bits;
its n decodes make the real local cost higher).

Traffic stays inside the namespaces made here; they are removed on exit; each job has a
timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from gqsgd_lab.bench_common import GQSGD_NAME, TWO_STAGE, machine_stamp
from gqsgd_lab.emulated_hosts import EmulatedHosts, require_root
from hvd_gqsgd import core

ROOT = Path(__file__).resolve().parent.parent
RATES = {"1gbit": 1e9, "10gbit": 1e10}
WORKERS = {"torch": ("allreduce_worker.py", "train_worker.py"),
           "tf": ("allreduce_worker_tf.py", "train_worker_tf.py")}


def plugin_env() -> dict[str, str]:
    """This process's ``HVD_GQSGD_*`` settings (e.g. ``HVD_GQSGD_OVERLAP_NICE``), which every
    rank gets: mpirun passes a rank only the variables it is told to."""
    return {k: v for k, v in os.environ.items() if k.startswith("HVD_GQSGD_")}


def run_job(hosts: int, rate: str, worker: str, *args: str) -> list[dict]:
    with EmulatedHosts(hosts, rate=rate) as net:
        proc = net.mpirun([sys.executable, str(ROOT / "benchmarks" / worker), *args],
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **plugin_env()},
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({hosts} hosts, {rate}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def gq_bits(name: str) -> int:
    """bits of a ``gqsgd<bits>[ts|flat][@<KiB>k]`` name (see bench_common.compressor)."""
    return int(GQSGD_NAME.fullmatch(name).group(1))  # type: ignore[union-attr]


def gq_two_stage(name: str, hosts: int) -> bool:
    """Whether a ``gqsgd`` name runs two-stage on ``hosts`` ranks (as the compressor decides)."""
    m = GQSGD_NAME.fullmatch(name)
    assert m is not None
    return core.use_two_stage(TWO_STAGE[m.group(2)], int(m.group(1)), hosts)


def predict(times: dict, hosts: int, rate: float, mb: float, name: str) -> float:
    """Model time of one allreduce (see the module docstring)."""
    ring = 2 * (hosts - 1) / hosts
    nbytes = mb * 2**20
    if name == "none":
        return times["latency"] + ring * nbytes * 8 / rate
    if name == "fp16":  # the casts are cheap next to the wire; not modelled
        return times["latency"] + ring * nbytes / 2 * 8 / rate
    if name.startswith("qsgd"):  # allgather: every rank receives (n-1) payloads; local cost
        wire = core.wire_bytes(int(nbytes // 4), int(name[4:]))  # taken from GlobalQSGD's
        return (2 * times["latency"] + (hosts - 1) * wire * 8 / rate
                + times.get(f"local_g{name}", float("nan")))
    local = times[f"local_{name}"]
    if gq_two_stage(name, hosts):  # scale, probe, reduce-scatter, allgather; both phases
        counts, _ = core.segments([int(nbytes // 4)], core.DEFAULT_SCALE_BLOCK)
        plan = core.two_stage_plan(counts, hosts, gq_bits(name))
        return 4 * times["latency"] + ring * plan.wire_bytes() * 8 / rate + local
    wire = ring * core.wire_bytes(int(nbytes // 4), gq_bits(name)) * 8 / rate
    if "@" not in name or name.endswith("@0k"):  # one allreduce: quantize, then send
        return 3 * times["latency"] + wire + local
    return 3 * times["latency"] + max(wire, local)  # chunked: full overlap (a lower bound)


def framework_times(times: dict, framework: str) -> dict:
    """One framework's rows of a job (the TF worker prefixes its names with ``tf_``)."""
    if framework == "torch":
        return {k: v for k, v in times.items() if not k.startswith("tf_")}
    return {k[3:]: v for k, v in times.items() if k.startswith("tf_")}


def table(results: list[dict], mb: float) -> list[str]:
    lines = ["| hosts | link | framework | compressor | time (s) | vs none | vs fp16 | vs qsgd8 "
             "| model (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for framework in res["frameworks"]:
            t = framework_times(res["times"], framework)
            for name in [n for n in res["compressors"] if n in t]:
                model = predict(t, res["hosts"], RATES[res["rate"]], mb, name)
                vs = " | ".join(f"{t[base] / t[name]:.2f}x" if base in t else "-"
                                for base in ("none", "fp16", "qsgd8"))
                lines.append(f"| {res['hosts']} | {res['rate']} | {framework} | {name} | "
                             f"{t[name]:.3f} | {vs} | {model:.3f} |")
    return lines


def train_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    medians = {r["what"]: r["median_s"] for r in rows}
    lines = ["## End to end: a communication-bound training step", "",
             f"2 hosts at 1 Gbit/s, `benchmarks/train_worker.py`: an MLP with a "
             f"{rows[0]['grad_mb']:.0f} MB fp32 gradient, batch 32 per rank, "
             "`hvd.DistributedOptimizer` (torch) or `hvd.DistributedGradientTape` in "
             "`tf.function` (TF, `benchmarks/train_worker_tf.py`), default arguments, median step "
             "time of the slowest rank (forward, backward, allreduce, update).  The loss on a "
             "fixed held-out batch, before and after the steps (same start and data for every "
             "compressor of a framework, SGD with lr 0.5), shows whether each run trains like "
             "fp32.", "",
             "| framework | compressor | step (s) | vs none | held-out loss: start → end |",
             "|---|---|---|---|---|"]
    for r in rows:
        framework, name = r["what"].split("train_")
        framework = framework.rstrip("_") or "torch"
        base = medians[f"{'tf_' if framework == 'tf' else ''}train_none"]
        lines.append(f"| {framework} | {name} | {r['median_s']:.3f} | "
                     f"{base / r['median_s']:.2f}x | "
                     f"{r['loss_start']:.7f} → {r['loss_end']:.7f} |")
    return [*lines, ""]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lines = [(f, name) for f in ("torch", "tf") for name in ("fp16", "qsgd8", "gqsgd4", "gqsgd8",
                                                            "gqsgd16")
             if f == "torch" or name == "gqsgd8"]
    for hosts in sorted({r["hosts"] for r in results}):
        for framework, name in lines:
            pts = [(RATES[r["rate"]] / 1e9, t["none"] / t[name]) for r in results
                   if r["hosts"] == hosts
                   for t in [framework_times(r["times"], framework)]
                   if name in t and "none" in t]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", ls="--" if framework == "tf" else "-",
                        label=f"{framework} {name}, {hosts} hosts")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Gbit/s)")
    ax.set_ylabel("speed-up over Compression.none")
    ax.axhline(1, color="gray", lw=0.5)
    ax.legend(fontsize=7)
    ax.set_title("64 MB fp32 allreduce on emulated hosts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--compressors",
                        default="none,fp16,qsgd8,gqsgd4,gqsgd8,gqsgd8@2048k,gqsgd16")
    parser.add_argument("--train", default="none,fp16,gqsgd8,gqsgd8@0k,gqsgd8@2048k",
                        help="compressors of the end-to-end training job (2 hosts, 1 Gbit/s); "
                        "empty to skip it")
    parser.add_argument("--frameworks", default="torch,tf",
                        help="torch (allreduce_worker.py), tf (allreduce_worker_tf.py) or both")
    parser.add_argument("--tf-compressors", default="none,fp16,qsgd8,gqsgd8,gqsgd8@0k",
                        help="compressors of the TF job")
    parser.add_argument("--busy", type=int, default=0,
                        help="run this many CPU-bound loops (other processes) during the jobs: "
                        "shows how much of this machine's CPU the emulated links need")
    parser.add_argument("--busy-nice", type=int, default=0,
                        help="niceness of the --busy loops (0: the jobs' own priority)")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    if args.busy < 0 or not 0 <= args.busy_nice <= 19:
        parser.error(f"--busy must be >= 0 and --busy-nice in 0..19, got {args.busy} and "
                     f"{args.busy_nice}")
    require_root()
    with busy_loops(args.busy, args.busy_nice):
        run(args)


@contextlib.contextmanager
def busy_loops(count: int, nice: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes that only spin, ``nice`` nicer than this one, for the duration."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        for proc in procs:  # raising a child's niceness needs no privilege
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, own + nice))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> None:
    results = []
    started, load_start = time.time(), os.getloadavg()[0]
    for hosts in (int(h) for h in args.hosts.split(",")):
        for rate in args.rates.split(","):
            names, frameworks = args.compressors.split(","), args.frameworks.split(",")
            rows = []
            for framework in frameworks:
                worker = WORKERS[framework]
                wanted = names if framework == "torch" else args.tf_compressors.split(",")
                rows += run_job(hosts, rate, worker[0], "--mb", str(args.mb),
                                "--repeats", str(args.repeats), "--compressors", ",".join(wanted))
            times = {r["what"]: r["median_s"] for r in rows}
            results.append({"hosts": hosts, "rate": rate, "frameworks": frameworks,
                            "compressors": list(dict.fromkeys(
                                names + args.tf_compressors.split(","))), "times": times})
            print(f"{hosts} hosts, {rate}: " + ", ".join(
                f"{k}={v:.3f}s" for k, v in times.items()), flush=True)
    train = []
    if args.train:
        for framework in args.frameworks.split(","):
            train += run_job(2, "1gbit", WORKERS[framework][1], "--compressors", args.train)
        print("training, 2 hosts, 1gbit: " + ", ".join(
            f"{r['what']}={r['median_s']:.3f}s" for r in train), flush=True)
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    plot(results, out / "bench_speedup.png")
    doc = [
        "# Bandwidth benchmark",
        "",
        machine_stamp(load_start, time.time() - started),
        "",
        "Regenerate with `make bench` (root: network namespaces and tc). "
        f"{args.mb:g} MB fp32 gradient, `hvd.allreduce` with the default op (TF: inside "
        "`tf.function`, as Horovod's tape calls it), Open MPI over TCP "
        "between network namespaces whose links tc limits to the given rate, 1 rank per host, "
        f"median of {args.repeats} runs of the slowest rank. All hosts share this machine's "
        "2 cores, so compute-heavy rows are pessimistic. Model: see benchmarks/netbench.py."
        + (f" {args.busy} other process(es) spun at niceness {args.busy_nice} throughout "
           "(`--busy`)." if args.busy else "")
        + "".join(f" Every rank ran with `{k}={v}`." for k, v in sorted(plugin_env().items())),
        "",
        *table(results, args.mb),
        "",
        "`gqsgd8` is GlobalQSGD(8) with its defaults.  Their `chunk_bytes=None` lets the "
        "adapter choose: TF inside `tf.function` sends the codes in 2 MiB chunks, each put on "
        "the wire while the next is quantized and unpacked as soon as it arrives; PyTorch "
        "sends one allreduce per bucket.  `@<n>k` rows force `chunk_bytes=<n> KiB`: "
        "`gqsgd8@0k` one allreduce per bucket, `gqsgd8@2048k` 2 MiB chunks (in PyTorch the "
        "chunks are joined before decoding, so only quantizing overlaps the wire).  All "
        "hosts share 2 cores with Open MPI's busy-polling progress loop, which the overlap "
        "competes with.",
        "",
        "![speed-up vs link rate](bench_speedup.png)",
        "",
        *train_table(train),
        "",
    ]
    (out / "BENCHMARKS.md").write_text("\n".join(doc))
    print(f"wrote {out / 'BENCHMARKS.md'} and {out / 'bench_speedup.png'}")


if __name__ == "__main__":
    main()
