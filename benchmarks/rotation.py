"""The randomized Hadamard rotation (``rotation="hadamard"``), measured: error against the rank
count on real gradients, training at 2, 4 and 16 ranks, and the 64 MB allreduce's speed on
emulated hosts.  Writes its sections of docs/LOW_BITS.md.

    python benchmarks/rotation.py                 # all three; over an hour
    python benchmarks/rotation.py --parts error   # error, train and/or speed

* **error**: a single-process simulation with the library's own steps (gqsgd_lab/simulate.py,
  as the flat, hierarchical and two-stage studies use): the digits MLP's gradients
  mid-training, one per rank; flat (the core's rounding, simulate.quantized_sum) and
  two-stage (simulate.two_stage_sum, the torch backend's kernels), each on the gradients as
  they are and rotated by kernels.rotate_norms with a shared key, the sum rotated back with
  kernels.unrotate; the relative error ``||g_hat - g|| / ||g||`` averaged over draws.
* **train**: examples/char_lm.py (the 2-layer character LSTM on Python's help topics) under
  horovodrun on this machine, each bits' default scale blocks: 16 ranks with two-stage 4 and
  8 bits, rotation off and on, 4 seeds, against fp32 (goals: 4 bits with rotation within 2%,
  8 bits with rotation within 1%); 2 and 4 ranks with flat and two-stage 4 bits, rotation
  off and on (two-stage with it is the 4-bit default), and flat 8 bits with the rotation, 3
  seeds (goal: 4 bits within 2%).
  ``--train-ranks 16`` runs one rank count; the section is rewritten after each.
* **blocks** (not in the default parts; about 30 minutes): two-stage 4 bits with the
  rotation at 2, 4 and 16 ranks with scale blocks of 1024, 256 and 64 elements, against
  fp32, with the bytes per step char_lm counts.
* **speed**: one ``hvd.allreduce`` of 64 MB on 2 emulated hosts at 1 Gbit/s (root; see
  gqsgd_lab/emulated_hosts.py), 4 bits with the rotation against 8 bits without, in the same
  job, and again on unthrottled links (the floor the 2 shared cores set).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gqsgd_lab.bench_common import write_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "LOW_BITS.md"
RANKS = (2, 4, 8, 16, 64)
TRAIN_GOALS = {4: 2.0, 8: 1.0}  # % above fp32's validation loss, with the rotation


def rotated_sum(rows: np.ndarray, sum_fn, key: int, numels: list[int], block: int
                ) -> np.ndarray:
    """``sum_fn`` of the rows rotated by ``key`` in blocks of ``block``, rotated back
    (float64)."""
    from hvd_gqsgd import core, kernels

    counts, _ = core.segments(numels, block)
    rotated = np.empty_like(rows)
    for r in range(rows.shape[0]):
        kernels.rotate_norms(rows[r], counts, block, key, "max", rotated[r])
    total = np.ascontiguousarray(sum_fn(rotated), dtype=np.float64)
    kernels.unrotate(total, counts, block, key)
    return total


def _flat_sum(x: np.ndarray, counts: list[int], starts: np.ndarray, level: int,
              rng: np.random.Generator) -> np.ndarray:
    """Flat Global-QSGD's sum of the rows ``x`` against their own block scales."""
    from gqsgd_lab.simulate import block_max, quantized_sum

    return quantized_sum(x, block_max(x, starts), counts, level, rng)


def error_part(draws: int) -> list[str]:
    from gqsgd_lab.simulate import gradients, two_stage_sum
    from hvd_gqsgd import core

    grads, numels = gradients(max(RANKS))
    lines = ["| bits | ranks | flat | flat, rotated | two-stage | two-stage, rotated |",
             "|---|---|---|---|---|---|"]
    for bits in (4, 8):
        block = core.default_scale_block(bits)
        counts, _ = core.segments(numels, block)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        for n in RANKS:
            rows = grads[:n]
            exact = rows.astype(np.float64).sum(axis=0)
            norm = np.linalg.norm(exact)
            cells = []
            for two in (False, True):
                for rot in (False, True):
                    if not two and core.flat_levels(bits, n) == 0:
                        cells.append("refused (L = 0)")
                        continue
                    errs = []
                    for d in range(draws):
                        rng = np.random.default_rng([d, n, bits])
                        if two:
                            summed = functools.partial(two_stage_sum, numels=numels, bits=bits,
                                                       seed=1000 * n + d, block=block)
                        else:
                            summed = functools.partial(_flat_sum, counts=counts,
                                                       starts=starts,
                                                       level=core.levels(bits, n), rng=rng)
                        key = core.rotation_key(d, 0, 0)
                        got = (rotated_sum(rows, summed, key, numels, block) if rot
                               else summed(rows))
                        errs.append(np.linalg.norm(got - exact) / norm)
                    cells.append(f"{np.mean(errs):.3g}")
            lines.append(f"| {bits} | {n} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return [f"`python benchmarks/rotation.py --parts error` ({time.strftime('%Y-%m-%d')}): "
            f"relative error of the averaged gradient, digits MLP gradients mid-training (one "
            f"per rank), {draws} rounding draws, each bits' default scale blocks "
            f"({core.default_scale_block(4)} elements at 4 bits, "
            f"{core.default_scale_block(8)} at 8).", "", *lines]


def train_job(ranks: int, variants: str, seeds: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        command = [str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np",
                   str(ranks), "-H", f"localhost:{ranks}", sys.executable,
                   str(ROOT / "examples" / "char_lm.py"), "--variants", variants, "--steps",
                   str(steps), "--seeds", seeds, "--json", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "TF_CPP_MIN_LOG_LEVEL": "3"}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=6 * 3600)
        if proc.returncode != 0:
            raise RuntimeError(f"char_lm at {ranks} ranks failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["runs"]


def by_spec(runs: list[dict]) -> list[tuple[str, list[dict], list[float]]]:
    """char_lm's runs grouped by variant spec, each with its seeds' val loss in % above
    fp32's (the ``none`` run) of the same seed."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["spec"], []).append(r)
    base = {r["seed"]: r["val_loss"] for r in by["none"]}
    return [(spec, group, [100 * (r["val_loss"] / base[r["seed"]] - 1) for r in group])
            for spec, group in by.items()]


def goal_cell(rel: list[float], limit: float) -> str:
    return f"within {limit:g}%: {'met' if np.mean(rel) <= limit else 'not met'}"


def train_rows(ranks: int, runs: list[dict]) -> list[str]:
    lines = []
    for spec, group, rel in by_spec(runs):
        goal = ""
        if "rotation=hadamard" in spec:
            limit = TRAIN_GOALS.get(int(spec[2:spec.index(":")]))
            if limit is not None:
                goal = goal_cell(rel, limit)
        vals = [r["val_loss"] for r in group]
        lines.append(f"| {ranks} | {group[0]['label']} | {np.mean(vals):.4f} | "
                     f"{np.mean(rel):+.2f}% | {len(group)} | {goal or '-'} |")
    return lines


def train_part(steps: int, ranks: list[int], write) -> None:
    """Runs the training jobs at each rank count in ``ranks``, calling ``write`` with the
    section's lines after each, so a long run keeps what it finished."""
    from hvd_gqsgd import core

    head = [f"`python benchmarks/rotation.py --parts train` ({time.strftime('%Y-%m-%d')}): "
            f"examples/char_lm.py, {steps} steps, global batch 32, under horovodrun on this "
            "machine (2 cores); the same data and initial weights for every variant.  Goals "
            "(issue 41): flat 4 bits with the rotation within 2% of fp32 at 2 and 4 ranks, "
            "two-stage 4 bits with the rotation within 2% at 16 ranks, 8 bits with the "
            "rotation within 1%.  Scale (and rotation) blocks are each bits' default: "
            f"{core.default_scale_block(4)} elements at 4 bits, {core.default_scale_block(8)} at "
            "8.", "",
            "| ranks | variant | final val loss | vs fp32 (mean of seeds) | seeds | goal |",
            "|---|---|---|---|---|---|"]
    small = ("none,gq4:two_stage=false:rotation=none,gq4:two_stage=false:rotation=hadamard,"
             "gq4:two_stage=true:rotation=none,gq4:two_stage=true:rotation=hadamard,"
             "gq8:two_stage=false:rotation=hadamard")
    big = ("none,gq4:two_stage=true:rotation=none,gq4:two_stage=true:rotation=hadamard,"
           "gq8:two_stage=true:rotation=none,gq8:two_stage=true:rotation=hadamard")
    rows: dict[int, list[str]] = {}
    for n in ranks:
        # 4 seeds at 16 ranks: seeds 0 and 1 alone put two-stage 4 bits 0.6 points nearer
        # fp32 than seeds 0 to 3 did, across the 2% goal
        variants, seeds = (big, "0,1,2,3") if n >= 16 else (small, "0,1,2")
        rows[n] = train_rows(n, train_job(n, variants, seeds, steps))
        write([*head, *(line for k in sorted(rows) for line in rows[k])])
        print("\n".join(rows[n]), flush=True)


BLOCKS = (1024, 256, 64)
BLOCK_RANKS = {2: "0,1,2", 4: "0,1,2", 16: "0,1"}  # rank count -> seeds


def blocks_part(steps: int) -> list[str]:
    """Two-stage 4 bits with the rotation at each rank count of BLOCK_RANKS, with scale (and
    rotation) blocks of each size in BLOCKS, against fp32; bytes per step as char_lm counts
    them (payload and overhead, the scale exchange included)."""
    variants = ",".join(["none", *(f"gq4:two_stage=true:rotation=hadamard:scale_block={b}"
                                   for b in BLOCKS)])
    lines = ["| ranks | scale_block | final val loss | vs fp32 (mean of seeds) | per seed | "
             "fewer bytes per step than fp32 | goal |", "|---|---|---|---|---|---|---|"]
    for ranks, seeds in BLOCK_RANKS.items():
        for spec, group, rel in by_spec(train_job(ranks, variants, seeds, steps)):
            block = spec.rsplit("=", 1)[1] if spec != "none" else "fp32"
            goal = "-" if spec == "none" else goal_cell(rel, TRAIN_GOALS[4])
            lines.append(f"| {ranks} | {block} | {np.mean([r['val_loss'] for r in group]):.4f} "
                         f"| {np.mean(rel):+.2f}% | {', '.join(f'{v:+.2f}%' for v in rel)} | "
                         f"{group[0]['bytes_vs_fp32']:.2f}x | {goal} |")
        print("\n".join(lines), flush=True)
    return [f"`python benchmarks/rotation.py --parts blocks` ({time.strftime('%Y-%m-%d')}): "
            f"examples/char_lm.py under horovodrun on this machine, {steps} steps, seeds "
            f"{', '.join(f'{s} at {n} ranks' for n, s in BLOCK_RANKS.items())}; "
            "GlobalQSGD(4, two_stage=True, rotation='hadamard') with each scale_block (the "
            "rotation's block is the scale block).  Bytes per step are char_lm's count: "
            "payload plus overhead (the scales' MAX exchange and the stage-2 slots).", "",
            *lines]


def speed_part(repeats: int) -> list[str]:
    from netbench import run_job

    from gqsgd_lab.emulated_hosts import require_root

    require_root()
    names = "none,fp16,gqsgd8norot,gqsgd4rot,gqsgd4norot"
    lines = ["| links | variant | median s | vs GlobalQSGD(8) |", "|---|---|---|---|"]
    for rate in ("1gbit", None):
        got = run_job(2, rate, "allreduce_worker.py", "--mb", "64", "--repeats", str(repeats),
                      "--compressors", names)
        t = {r["what"]: r["median_s"] for r in got if r["what"] in names.split(",")}
        for name, s in t.items():
            lines.append(f"| {rate or 'unthrottled'} | {name} | {s:.3f} | "
                         f"{t['gqsgd8norot'] / s:.2f}x |")
        print("\n".join(lines), flush=True)
    return [f"`python benchmarks/rotation.py --parts speed` ({time.strftime('%Y-%m-%d')}): one "
            "`hvd.allreduce` of 64 MB fp32 on 2 emulated hosts (PyTorch, mpirun), median of "
            f"{repeats}; `gqsgd4rot` is GlobalQSGD(4) with the rotation (two-stage, the 4-bit "
            "default), `gqsgd4norot` the same without it, `gqsgd8norot` GlobalQSGD(8) without "
            "it (flat); each at its bits' default scale blocks.", "", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="error,train,speed")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--train-ranks", default="16,2,4",
                        help="rank counts of the train part, in the order run")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "error" in parts:
        write_section(DOC, "rotation_error", ["### Rotation: error against the rank count",
                                              "", *error_part(args.draws)])
    if "train" in parts:
        train_part(args.steps, [int(n) for n in args.train_ranks.split(",")],
                   lambda lines: write_section(DOC, "rotation_train",
                                               ["### Rotation: training", "", *lines]))
    if "blocks" in parts:
        write_section(DOC, "rotation_blocks", ["### Rotation: smaller blocks", "",
                                               *blocks_part(args.steps)])
    if "speed" in parts:
        write_section(DOC, "rotation_speed", ["### Rotation: 64 MB allreduce speed", "",
                                              *speed_part(args.repeats)])


if __name__ == "__main__":
    main()
