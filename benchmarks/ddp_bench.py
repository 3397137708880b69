"""DDP communication hooks on emulated hosts: GlobalQSGD against DDP's own allreduce, its fp16
and bf16 compression hooks and PowerSGD, plus the same model under Horovod + GlobalQSGD(8).

    flock /tmp/gqsgd-bench.lock python benchmarks/ddp_bench.py     # root; ~10 minutes

For each host count (one network namespace per host, links limited with tc, see
gqsgd_lab/emulated_hosts.py), one mpirun job runs benchmarks/ddp_bench_worker.py --mode ddp over
Gloo with every hook in turn, and one runs --mode horovod in the same namespaces, so the ratios
come from one run on one machine.  Writes the table to docs/DDP.md (between the markers, the
rest of the file is kept) and prints it.  On a shared or small machine the figures move from
run to run: compare ratios within one table, not across tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gqsgd_lab.bench_common import gloo_job, write_section
from gqsgd_lab.emulated_hosts import EmulatedHosts, require_root

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "ddp_bench_worker.py"
LABELS = {"default": "DDP default allreduce (fp32)", "fp16": "`fp16_compress_hook`",
          "bf16": "`bf16_compress_hook`", "powersgd1": "`powerSGD_hook`, rank 1 (one bucket)",
          "powersgd4": "`powerSGD_hook`, rank 4 (one bucket)", "gqsgd8": "**GlobalQSGD(8)** hook",
          "gqsgd4": "**GlobalQSGD(4)** hook", "hvd-none": "Horovod, no compression",
          "hvd-gqsgd8": "Horovod + GlobalQSGD(8)",
          "gqsgd8flat": "GlobalQSGD(8, two_stage=False) hook",
          "gqsgd8ts": "GlobalQSGD(8, two_stage=True) hook (Gloo: all_to_all + sum)",
          "gqsgd8ts-rs": "GlobalQSGD(8, two_stage=True) hook, Gloo reduce_scatter",
          "gqsgd4ts": "GlobalQSGD(4, two_stage=True) hook"}


def run_job(net: EmulatedHosts, mode: str, variants: str, args) -> list[dict]:
    command = [sys.executable, str(WORKER), "--mode", mode, "--variants", variants,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return gloo_job(net, command, mode, timeout=1800)


def table(rows: list[dict], rate: str) -> list[str]:
    lines = ["| hosts | variant | median step (s) | default / this | fp16 hook / this | "
             "held-out loss start -> end | end - default's end |", "|---|---|---|---|---|---|---|"]
    for hosts in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == hosts]
        base = {r["variant"]: r for r in mine}
        for r in mine:
            lines.append(
                f"| {hosts} | {LABELS.get(r['variant'], r['variant'])} | {r['median_s']:.3f} | "
                f"{base['default']['median_s'] / r['median_s']:.2f}x | "
                f"{base['fp16']['median_s'] / r['median_s']:.2f}x | "
                f"{r['loss_start']:.4f} -> {r['loss_end']:.6f} | "
                f"{r['loss_end'] - base['default']['loss_end']:+.1e} |")
    return [f"Links at {rate}, Gloo, batch 32, lr 0.5; one run (`python benchmarks/ddp_bench.py`"
            f", {time.strftime('%Y-%m-%d')}).", "", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--rate", default="1gbit",
                        help="tc rate of every link; 'none' leaves the links unthrottled (the "
                             "step's compute floor)")
    parser.add_argument("--variants", default="default,fp16,powersgd1,powersgd4,gqsgd8,"
                        "gqsgd4")
    parser.add_argument("--horovod", default="hvd-none,hvd-gqsgd8",
                        help="Horovod variants run in the same namespaces; empty to skip")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "docs" / "DDP.md"))
    args = parser.parse_args()
    require_root()
    rows = []
    for hosts in (int(h) for h in args.hosts.split(",")):
        with EmulatedHosts(hosts, rate=None if args.rate == "none" else args.rate) as net:
            got = run_job(net, "ddp", args.variants, args)
            if args.horovod:
                got += run_job(net, "horovod", args.horovod, args)
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
    lines = table(rows, args.rate)
    write_section(Path(args.out), "ddp_bench", lines, "# PyTorch DDP")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
