"""Issue 24: error of the averaged gradient against the rank count, flat vs hierarchical vs
two-stage Global-QSGD, on real gradients, 2 to 1024 ranks, 4 and 8 bits.

    .venv/bin/python studies/two_stage_sim.py     # docs/TWO_STAGE.md (its section),
                                                   # docs/two_stage_error.png and .json

A single-process simulation:

* **gradients**: gqsgd_lab/simulate.py's (as hierarchical_sim.py's), the digits MLP (85,002
  weights) mid-training, one gradient per rank on its own batch of 32 images;
* **flat**: ``L = levels(bits, n)`` codes against the per-block MAX scale, summed
  (gqsgd_lab.simulate.quantized_sum, the core's rounding);
* **hierarchical**: 8 ranks per node summed in float64, the node sums quantized with
  ``L = levels(bits, n / 8)`` (from 16 ranks on; below, one node: flat);
* **two-stage**: the library's own path (gqsgd_lab.simulate.two_stage_sum:
  ``hvd_gqsgd.two_stage`` with the torch backend's fused kernels), with the reduce-scatter a
  NumPy sum of every rank's words and the allgather a concatenation of the shards' messages;
* **fp16**: every rank's gradient rounded to float16, summed exactly.

The relative error is ``||g_hat - g|| / ||g||`` for the exact mean ``g``, averaged over
``--draws`` rounding draws.  "Bits per element" are what one rank moves per gradient element,
in allreduce terms (``TwoStagePlan.wire_bytes``: both phases; flat's packed codes; for
hierarchical the codes each rank carries across nodes, its ``1/8`` shard, besides the
full-precision exchange inside the node).  The ``.json`` feeds docs/MULTINODE.md's levels
table (scripts/levels_table.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from hierarchical_sim import PER_NODE, fp16_error

from gqsgd_lab.bench_common import write_section
from gqsgd_lab.simulate import block_max, gradients, quantized_sum, two_stage_sum
from hvd_gqsgd import core

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "TWO_STAGE.md"
PLOT = ROOT / "docs" / "two_stage_error.png"
DATA = ROOT / "docs" / "two_stage_error.json"
RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BITS = (4, 8)
SECTION = "two_stage_sim"


def bits_per_element(mode: str, bits: int, n: int, numels: list[int]) -> float:
    total = sum(numels)
    if mode == "two-stage":
        counts, _ = core.segments(numels, core.DEFAULT_SCALE_BLOCK)
        return 8 * core.two_stage_plan(counts, n, bits).wire_bytes() / total
    flat = 8 * core.wire_bytes(total, bits) / total
    return flat / PER_NODE if mode == "hierarchical" else flat


def errors(grads: np.ndarray, numels: list[int], n: int, bits: int, draws: int,
           seed: int) -> dict:
    rows = grads[:n]
    counts, _ = core.segments(numels, core.DEFAULT_SCALE_BLOCK)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    exact = rows.astype(np.float64).sum(axis=0)
    norm = np.linalg.norm(exact)
    out: dict = {"ranks": n, "bits": bits, "fp16": fp16_error(grads, n)}
    terms = {"flat": (rows, n)}
    if n >= 2 * PER_NODE:
        terms["hierarchical"] = (rows.astype(np.float64).reshape(
            n // PER_NODE, PER_NODE, -1).sum(axis=1), n // PER_NODE)
    for mode, (summed, count) in terms.items():
        if core.flat_levels(bits, count) == 0:
            out[mode] = None  # GlobalQSGD refuses: no level left
            continue
        rng = np.random.default_rng([seed, n, bits, count])
        scales = block_max(summed, starts)
        out[mode] = float(np.mean([np.linalg.norm(
            quantized_sum(summed, scales, counts, core.levels(bits, count), rng) - exact) / norm
            for _ in range(draws)]))
    out["two-stage"] = float(np.mean([
        np.linalg.norm(two_stage_sum(rows, numels, bits, seed * 1000 + d) - exact) / norm
        for d in range(draws)]))
    out["levels"] = {"flat": core.flat_levels(bits, n),
                     "two-stage": [core.two_stage_levels(bits, n), core.levels(bits, 1)]}
    out["bits_per_element"] = {m: bits_per_element(m, bits, n, numels)
                               for m in ("flat", "hierarchical", "two-stage")}
    return out


def _cell(x: float | None) -> str:
    return "refused (L = 0)" if x is None else f"{x:.3g}"


def table(results: list[dict]) -> list[str]:
    lines = ["| bits | ranks | flat L | flat | hierarchical (8/node) | two-stage L1 / L2 | "
             "two-stage | two-stage / flat | bits/elem flat, two-stage | fp16 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        flat, two = r["flat"], r["two-stage"]
        ratio = f"{two / flat:.2f}" if flat else "-"
        hier = _cell(r["hierarchical"]) if "hierarchical" in r else "= flat (one node)"
        b = r["bits_per_element"]
        lines.append(f"| {r['bits']} | {r['ranks']} | {r['levels']['flat']} | {_cell(flat)} | "
                     f"{hier} | {r['levels']['two-stage'][0]} / {r['levels']['two-stage'][1]} "
                     f"| {two:.3g} | {ratio} | {b['flat']:.2g}, {b['two-stage']:.3g} | "
                     f"{r['fp16']:.2g} |")
    return lines


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for bits, style in zip(BITS, ("--", "-")):
        rows = [r for r in results if r["bits"] == bits]
        for mode, color in (("flat", "C0"), ("hierarchical", "C1"), ("two-stage", "C2")):
            pts = [(r["ranks"], r[mode]) for r in rows if r.get(mode) is not None]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{mode}, {bits} bits")
        bx.plot([r["ranks"] for r in rows], [r["bits_per_element"]["two-stage"] for r in rows],
                style, marker="o", color="C2", label=f"two-stage, {bits} bits")
        bx.axhline(rows[0]["bits_per_element"]["flat"], ls=style, color="C0",
                   label=f"flat, {bits} bits")
    rows = [r for r in results if r["bits"] == BITS[0]]
    ax.plot([r["ranks"] for r in rows], [r["fp16"] for r in rows], ":", color="gray",
            label="fp16")
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("ranks")
        a.legend(fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("relative error of the averaged gradient")
    bx.set_ylabel("bits per element on the wire (allreduce terms)")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    ranks = [int(n) for n in args.ranks.split(",")]
    grads, numels = gradients(max(ranks), args.seed)
    results = []
    for bits in BITS:
        for n in ranks:
            t = time.perf_counter()
            results.append(errors(grads, numels, n, bits, args.draws, args.seed))
            r = results[-1]
            print(f"bits {bits} ranks {n:5d}: flat {_cell(r['flat'])} two-stage "
                  f"{r['two-stage']:.3g} ({time.perf_counter() - t:.1f} s)", flush=True)
    DATA.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)
    seconds = time.perf_counter() - started
    write_section(DOC, SECTION, [
        "## Error against rank count",
        "",
        f"`python studies/two_stage_sim.py` ({seconds:.0f} s; {args.draws} draws, seed "
        f"{args.seed}): the relative error of the averaged gradient on real gradients (the "
        "digits MLP, 85,002 weights, one batch of 32 per rank), by a single-process "
        "simulation: flat and hierarchical with the core's rounding, two-stage through the "
        "library's own reduce-scatter and requantize path.  L is the levels per sign; "
        "\"bits/elem\" is what one rank moves per element in allreduce terms (two-stage: "
        "both phases).  Hierarchical groups 8 ranks per node.", "",
        *table(results), "",
        "![error against rank count](two_stage_error.png)", ""])
    print(f"wrote {DOC}, {PLOT} and {DATA}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
