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
import json
import re
import sys
import time
from pathlib import Path

from emulated_hosts import EmulatedHosts, require_root

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hvd_gqsgd import core  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RATES = {"1gbit": 1e9, "10gbit": 1e10}


def run_job(hosts: int, rate: str, worker: str, *args: str) -> list[dict]:
    with EmulatedHosts(hosts, rate=rate) as net:
        proc = net.mpirun([sys.executable, str(ROOT / "benchmarks" / worker), *args],
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({hosts} hosts, {rate}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def gq_bits(name: str) -> int:
    """bits of a ``gqsgd<bits>[@<KiB>k]`` name (see allreduce_worker.compressor)."""
    return int(re.fullmatch(r"gqsgd(\d+)(?:@\d+k)?", name).group(1))  # type: ignore[union-attr]


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
    wire = ring * core.wire_bytes(int(nbytes // 4), gq_bits(name)) * 8 / rate
    local = times[f"local_{name}"]
    if "@" not in name or name.endswith("@0k"):  # one allreduce: quantize, then send
        return 3 * times["latency"] + wire + local
    return 3 * times["latency"] + max(wire, local)  # chunked: full overlap (a lower bound)


def table(results: list[dict], mb: float) -> list[str]:
    lines = ["| hosts | link | compressor | time (s) | vs none | vs fp16 | vs qsgd8 | model (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        t = res["times"]
        for name in res["compressors"]:
            model = predict(t, res["hosts"], RATES[res["rate"]], mb, name)
            vs_qsgd = f"{t['qsgd8'] / t[name]:.2f}x" if "qsgd8" in t else "-"
            lines.append(f"| {res['hosts']} | {res['rate']} | {name} | {t[name]:.3f} | "
                         f"{t['none'] / t[name]:.2f}x | {t['fp16'] / t[name]:.2f}x | "
                         f"{vs_qsgd} | {model:.3f} |")
    return lines


def train_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    base = {r["what"]: r["median_s"] for r in rows}["train_none"]
    lines = ["## End to end: a communication-bound training step", "",
             f"2 hosts at 1 Gbit/s, `benchmarks/train_worker.py`: an MLP with a "
             f"{rows[0]['grad_mb']:.0f} MB fp32 gradient, batch 32 per rank, "
             "`hvd.DistributedOptimizer` (default op), median step time of the slowest rank "
             "(forward, backward, allreduce, update).  The loss on a fixed held-out batch, before "
             "and after the steps (same start and data for every compressor, SGD with lr 0.5), "
             "shows whether each run trains like fp32.", "",
             "| compressor | step (s) | vs none | held-out loss: start → end |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what'][6:]} | {r['median_s']:.3f} | {base / r['median_s']:.2f}x | "
                     f"{r['loss_start']:.7f} → {r['loss_end']:.7f} |")
    return [*lines, ""]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for hosts in sorted({r["hosts"] for r in results}):
        for name in ("fp16", "qsgd8", "gqsgd4", "gqsgd8", "gqsgd16"):
            pts = [(RATES[r["rate"]] / 1e9, r["times"]["none"] / r["times"][name])
                   for r in results if r["hosts"] == hosts and name in r["times"]]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=f"{name}, {hosts} hosts")
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compressors",
                        default="none,fp16,qsgd8,gqsgd4,gqsgd8,gqsgd8@1024k,gqsgd16")
    parser.add_argument("--train", default="none,fp16,gqsgd8,gqsgd8@1024k",
                        help="compressors of the end-to-end training job (2 hosts, 1 Gbit/s); "
                        "empty to skip it")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    require_root()
    results = []
    started = time.time()
    for hosts in (int(h) for h in args.hosts.split(",")):
        for rate in args.rates.split(","):
            names = args.compressors.split(",")
            rows = run_job(hosts, rate, "allreduce_worker.py", "--mb", str(args.mb),
                           "--repeats", str(args.repeats), "--compressors", ",".join(names))
            times = {r["what"]: r["median_s"] for r in rows}
            results.append({"hosts": hosts, "rate": rate, "compressors": names,
                            "times": times})
            print(f"{hosts} hosts, {rate}: " + ", ".join(
                f"{k}={v:.3f}s" for k, v in times.items()), flush=True)
    train = []
    if args.train:
        train = run_job(2, "1gbit", "train_worker.py", "--compressors", args.train)
        print("training, 2 hosts, 1gbit: " + ", ".join(
            f"{r['what']}={r['median_s']:.3f}s" for r in train), flush=True)
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    plot(results, out / "bench_speedup.png")
    doc = [
        "# Bandwidth benchmark",
        "",
        "Regenerate with `make bench` (root: network namespaces and tc). "
        f"{args.mb:g} MB fp32 gradient, `hvd.allreduce` with the default op, Open MPI over TCP "
        "between network namespaces whose links tc limits to the given rate, 1 rank per host, "
        f"median of {args.repeats} runs of the slowest rank. All hosts share this machine's "
        "2 cores, so compute-heavy rows are pessimistic. Model: see benchmarks/netbench.py.",
        "",
        *table(results, args.mb),
        "",
        "`gqsgd8@1024k` is GlobalQSGD(8) with `chunk_bytes=1 << 20`: its codes go in 1 MiB "
        "chunks, so quantizing chunk k+1 can overlap sending chunk k; `gqsgd8` (the default, "
        "`chunk_bytes=0`) quantizes everything, then sends.  The difference between the two "
        "rows is what the overlap buys here, where all hosts share 2 cores with Open MPI's "
        "busy-polling progress loop.",
        "",
        "![speed-up vs link rate](bench_speedup.png)",
        "",
        *train_table(train),
        f"Took {time.time() - started:.0f} s.",
        "",
    ]
    (out / "BENCHMARKS.md").write_text("\n".join(doc))
    print(f"wrote {out / 'BENCHMARKS.md'} and {out / 'bench_speedup.png'}")


if __name__ == "__main__":
    main()
