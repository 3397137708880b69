"""Peak memory of a GlobalQSGD round over the same entry point's uncompressed round, on one
machine (2 ranks, loopback), for the torch-ops path (what CUDA tensors run; forced on CPU
with ``HVD_GQSGD_KERNELS=0``) and the fused CPU kernels.

    python benchmarks/memory.py              # 256 MB gradient; about 5 minutes

Each (entry, path, variant) is its own 2-rank job of benchmarks/memory_worker.py, which
measures the resident set a round adds (see its docstring).  The goal: a GlobalQSGD round
adds at most 0.5x the gradient's fp32 bytes over the uncompressed round, on the torch-ops
path.  Writes docs/MEMORY.md's table (between the markers) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from gqsgd_lab.bench_common import write_section

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "memory_worker.py"
ENTRIES = ("hvd", "hvd-two-stage", "ddp", "fsdp")
LABELS = {"hvd": "Horovod `hvd.allreduce`, flat", "hvd-two-stage": "Horovod, `two_stage=True`",
          "ddp": "DDP hook", "fsdp": "FSDP2 hook"}
GOAL = 0.5  # added bytes over the uncompressed round, in gradient fp32 bytes


def launch(entry: str, variant: str, mb: int, kernels: bool, ranks: int = 2) -> dict:
    """One job; its rank-0 JSON line."""
    bin_dir = Path(sys.executable).parent
    script = [sys.executable, str(WORKER), "--entry", entry, "--variant", variant,
              "--mb", str(mb)]
    if entry.startswith("hvd"):
        cmd = [str(bin_dir / "horovodrun"), "--gloo", "-np", str(ranks), "-H",
               f"localhost:{ranks}", *script]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(ranks), "--master_port",
               "29517", *script[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HVD_GQSGD_KERNELS": "1" if kernels else "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln.split(":", 1)[-1] if ln.startswith("[") else ln
             for ln in proc.stdout.splitlines()]
    rows = [json.loads(ln[ln.index("{"):]) for ln in lines if "{" in ln and "added_bytes" in ln]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{entry} {variant} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return rows[0]


def measure(mb: int, entries: list[str], paths: list[bool]) -> list[dict]:
    """Per (entry, path): the added bytes of both variants and their difference in gradient
    fp32 bytes."""
    out = []
    for entry in entries:
        for kernels in paths:
            none = launch(entry, "none", mb, kernels)["added_bytes"]
            mine = launch(entry, "gqsgd8", mb, kernels)["added_bytes"]
            row = {"entry": entry, "kernels": kernels, "mb": mb, "none": none, "gqsgd8": mine,
                   "ratio": (mine - none) / (mb * 2**20)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def table(rows: list[dict]) -> list[str]:
    lines = ["| entry | path | uncompressed round adds (MB) | GlobalQSGD(8) round adds (MB) | "
             "difference, in gradient bytes | goal |", "|---|---|---|---|---|---|"]
    for r in rows:
        path = "fused kernels (CPU)" if r["kernels"] else "torch ops (what CUDA runs)"
        goal = "-" if r["kernels"] else ("met" if r["ratio"] <= GOAL else "not met")
        lines.append(f"| {LABELS[r['entry']]} | {path} | {r['none'] / 2**20:.0f} | "
                     f"{r['gqsgd8'] / 2**20:.0f} | {r['ratio']:+.2f}x | {goal} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--entries", default=",".join(ENTRIES))
    parser.add_argument("--paths", default="torch,fused")
    parser.add_argument("--out", default=str(ROOT / "docs" / "MEMORY.md"))
    args = parser.parse_args()
    paths = [p == "fused" for p in args.paths.split(",")]
    rows = measure(args.mb, args.entries.split(","), paths)
    lines = [f"`python benchmarks/memory.py`, {time.strftime('%Y-%m-%d')}, "
             f"{platform.machine()}: a {args.mb} MB fp32 gradient (one `Linear` weight), "
             f"2 ranks on one machine, Gloo; goal: at most {GOAL}x on the torch-ops path.",
             "", *table(rows)]
    write_section(Path(args.out), "memory", lines, "# Memory")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
