"""FSDP2 convergence: examples/fsdp_lm.py (a char-level transformer under ``fully_shard``,
bf16 parameters and fp32 reduce) with FSDP2's own reduce-scatter and with
``hvd_gqsgd.fsdp.register(model, bits=8)``, 4 ranks, 3 seeds, in one torchrun job.

    python benchmarks/fsdp_convergence.py      # ~6 minutes on 2 cores

Writes its section of docs/FSDP.md (between the markers; the rest is kept) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gqsgd_lab.bench_common import write_section

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fsdp_lm.py"
GOAL_PCT = 1.0  # GlobalQSGD(8)'s mean validation loss within this much of FSDP2's


def lines_for(result: dict) -> list[str]:
    runs, s = result["runs"], result["settings"]
    seeds = sorted({r["seed"] for r in runs})
    by = {(r["variant"], r["seed"]): r for r in runs}
    mine = next(v for v, _ in by if v != "FSDP2")
    rows = ["| seed | FSDP2 val loss | " + mine + " val loss | difference |", "|---|---|---|---|"]
    deltas = []
    for seed in seeds:
        a, b = by[("FSDP2", seed)]["val_loss"], by[(mine, seed)]["val_loss"]
        deltas.append(100 * (b / a - 1))
        rows.append(f"| {seed} | {a:.4f} | {b:.4f} | {deltas[-1]:+.2f}% |")
    mean = float(np.mean(deltas))
    return [f"`python benchmarks/fsdp_convergence.py`, {time.strftime('%Y-%m-%d')}, "
            f"{platform.machine()}: {result['world_size']} ranks (torchrun, Gloo), "
            f"{s['layers']}-block transformer of width {s['width']}, {s['steps']} steps of "
            f"{s['global_batch']} windows x {s['seq']} characters, AdamW lr {s['lr']} "
            f"(cosine), `MixedPrecisionPolicy(param_dtype={s['param_dtype']}, "
            f"reduce_dtype={s['reduce_dtype']})` for both.", "", *rows, "",
            f"Mean difference {mean:+.2f}% (goal: within {GOAL_PCT:.0f}%: "
            f"{'met' if abs(mean) <= GOAL_PCT else 'not met'}); bytes of the reduce-scatter "
            f"{runs[-1].get('bytes_ratio', float('nan')):.2f}x fewer than fp32's."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "docs" / "FSDP.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node",
               str(args.ranks), str(EXAMPLE), "--seeds", args.seeds, "--steps",
               str(args.steps), "--json", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
        if proc.returncode != 0:
            raise SystemExit(f"fsdp_lm.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
    lines = lines_for(result)
    write_section(Path(args.out), "fsdp_convergence", lines, "# FSDP2")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
