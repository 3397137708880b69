"""Issue 14: flat vs hierarchical Global-QSGD on real gradients, 8 ranks per node, 2-128 nodes.

    .venv/bin/python studies/hierarchical_sim.py          # writes docs/HIERARCHICAL.md + png

A single-process simulation with hvd_gqsgd.core as the oracle (``levels``, ``segments``,
``multipliers``, ``quantize``, ``step_sizes``, driven by gqsgd_lab/numpy_ops.py; the sums are
gqsgd_lab/simulate.py's), of the relative error ``||g_hat - g|| / ||g||`` of the averaged
gradient ``g`` (the exact mean over ranks):

* **gradients**: the digits MLP of examples/torch_digits.py (64-256-256-10, 85,002 weights)
  after 2 epochs of SGD on one process, then one gradient per rank on its own random batch
  of 32 images, as a data-parallel step would see them;
* **flat**: every rank quantizes its gradient with ``L = levels(bits, ranks)`` against the
  per-block scale (1024-element blocks, the default) that a MAX over all ranks gives; the
  integer codes are summed and rescaled;
* **hierarchical**: the 8 ranks of a node sum in float64, each node sum is quantized with
  ``L = levels(bits, nodes)`` against the MAX over nodes; codes summed and rescaled;
* **fp16**: each rank's gradient rounded to float16, summed exactly (a lower bound for
  Horovod's fp16 compression, which also adds in fp16);
* **predicted ratio**: flat over hierarchical of ``sqrt(E ||error||^2)``, where each rounded
  term contributes ``step^2 f (1 - f)`` (``f`` the fractional part of ``x L / s``): what the
  rounding variance alone predicts, to compare with the measured ratio.

A cell is missing where ``levels`` is 0 (GlobalQSGD raises).  Each figure is the mean of
``--draws`` independent rounding draws (the spread between draws is below 1%).  Packing is
left out: the tests prove it exact, so it cannot change the error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from gqsgd_lab.simulate import BATCH, OPS, ROWS, block_max, gradients, quantized_sum
from hvd_gqsgd import core

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "HIERARCHICAL.md"
PLOT = ROOT / "docs" / "hierarchical_error.png"
PER_NODE = 8
NODES = (2, 4, 8, 16, 32, 64, 128)
BITS = (4, 8, 16)


def predicted_error(rows: np.ndarray, scales: np.ndarray, counts: list[int], n_levels: int,
                    exact: np.ndarray) -> float:
    """sqrt(E ||sum - exact||^2) / ||exact||: each stochastically rounded term adds variance
    step^2 f (1 - f), f the fractional part of x L / s, independently of the others."""
    mult = np.repeat(core.multipliers(OPS, scales, n_levels), counts)
    steps = np.repeat(core.step_sizes(OPS, scales, n_levels), counts)
    var = np.zeros(rows.shape[1])
    for lo in range(0, rows.shape[0], ROWS):
        y = rows[lo:lo + ROWS].astype(np.float64) * mult
        f = y - np.floor(y)
        var += (f * (1 - f)).sum(axis=0)
    return float(np.sqrt((var * steps * steps).sum()) / np.linalg.norm(exact))


def relative_errors(grads: np.ndarray, numels: list[int], nodes: int, bits: int,
                    draws: int, seed: int) -> dict[str, float]:
    """Mean relative error of the averaged gradient, flat and hierarchical ('nan' if refused),
    and its prediction from the rounding variance."""
    ranks = nodes * PER_NODE
    rows = grads[:ranks]
    counts, _ = core.segments(numels, core.DEFAULT_SCALE_BLOCK)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    exact = rows.astype(np.float64).sum(axis=0)
    node_sums = rows.astype(np.float64).reshape(nodes, PER_NODE, -1).sum(axis=1)
    out = {}
    for name, terms, n in (("flat", rows, ranks), ("hierarchical", node_sums, nodes)):
        if core.min_bits(n) > bits:
            out[name] = out[f"{name}_predicted"] = float("nan")
            continue
        scales = block_max(terms, starts)
        rng = np.random.default_rng([seed, nodes, bits, n])
        errs = [np.linalg.norm(quantized_sum(terms, scales, counts, core.levels(bits, n), rng)
                               - exact) / np.linalg.norm(exact) for _ in range(draws)]
        out[name] = float(np.mean(errs))
        out[f"{name}_predicted"] = predicted_error(terms, scales, counts, core.levels(bits, n),
                                                   exact)
    return out


def fp16_error(grads: np.ndarray, ranks: int) -> float:
    rows = grads[:ranks]
    exact = rows.astype(np.float64).sum(axis=0)
    cast = rows.astype(np.float16).astype(np.float64).sum(axis=0)
    return float(np.linalg.norm(cast - exact) / np.linalg.norm(exact))


def run(draws: int, seed: int, nodes_list: tuple[int, ...]) -> list[dict]:
    grads, numels = gradients(max(nodes_list) * PER_NODE, seed)
    results = []
    for nodes in nodes_list:
        for bits in BITS:
            start = time.perf_counter()
            errs = relative_errors(grads, numels, nodes, bits, draws, seed)
            results.append({"nodes": nodes, "ranks": nodes * PER_NODE, "bits": bits, **errs,
                            "fp16": fp16_error(grads, nodes * PER_NODE)})
            print(f"nodes {nodes:4d} bits {bits:2d}: flat {errs['flat']:.4g} hierarchical "
                  f"{errs['hierarchical']:.4g} ({time.perf_counter() - start:.1f} s)", flush=True)
    return results


def _cell(x: float) -> str:
    return "refused (L = 0)" if np.isnan(x) else f"{x:.3g}"


def table(results: list[dict]) -> str:
    lines = ["| nodes x 8 | ranks | bits | L flat | L hier. | flat | hierarchical | flat / hier. "
             "| predicted ratio | fp16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lf = core.levels(r["bits"], r["ranks"]) if core.min_bits(r["ranks"]) <= r["bits"] else 0
        lh = core.levels(r["bits"], r["nodes"]) if core.min_bits(r["nodes"]) <= r["bits"] else 0
        ratio = r["flat"] / r["hierarchical"]
        want = r["flat_predicted"] / r["hierarchical_predicted"]
        lines.append(f"| {r['nodes']} | {r['ranks']} | {r['bits']} | {lf} | {lh} | "
                     f"{_cell(r['flat'])} | {_cell(r['hierarchical'])} | "
                     f"{'-' if np.isnan(ratio) else f'{ratio:.2f}x'} | "
                     f"{'-' if np.isnan(want) else f'{want:.2f}x'} | {r['fp16']:.2g} |")
    return "\n".join(lines)


def plot(results: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colours = {4: "tab:red", 8: "tab:blue", 16: "tab:green"}
    for bits in BITS:
        rows = [r for r in results if r["bits"] == bits]
        nodes = [r["nodes"] for r in rows]
        ax.plot(nodes, [r["flat"] for r in rows], "o--", color=colours[bits],
                label=f"flat, {bits} bits")
        ax.plot(nodes, [r["hierarchical"] for r in rows], "s-", color=colours[bits],
                label=f"hierarchical, {bits} bits")
    rows = [r for r in results if r["bits"] == BITS[0]]
    ax.plot([r["nodes"] for r in rows], [r["fp16"] for r in rows], ":", color="grey",
            label="fp16 cast (exact sum)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"nodes ({PER_NODE} ranks each)")
    ax.set_ylabel("relative error of the averaged gradient")
    ax.set_title("Digits MLP gradients: flat vs hierarchical Global-QSGD")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


KEEP = "<!-- hand-written below: kept when the tables above are regenerated -->"


def write_doc(results: list[dict], args: argparse.Namespace, seconds: float) -> None:
    """Rewrite the generated part of the doc; everything from the KEEP marker on stays."""
    old = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    tail = old[old.index(KEEP):] if KEEP in old else KEEP + "\n"
    DOC.write_text(
        "# Hierarchical Global-QSGD: error of the averaged gradient\n\n"
        f"Generated by `python studies/hierarchical_sim.py` ({seconds:.0f} s here) down to "
        "the hand-written part; do not edit it by hand.\nHow it simulates, and what each "
        "column means: the docstring of `studies/hierarchical_sim.py`.\n"
        "`GlobalQSGD(hierarchical=True)` itself, and how it runs through Horovod: "
        "`hvd_gqsgd/hierarchical.py`; when to turn it on: docs/MULTINODE.md, section 6.\n\n"
        f"{PER_NODE} ranks per node, digits MLP gradients (batch {BATCH} per rank), "
        f"1024-element scale blocks, mean of {args.draws} rounding draws, seed {args.seed}.\n\n"
        + table(results) + "\n\n![flat vs hierarchical](hierarchical_error.png)\n\n" + tail,
        encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 and 4 nodes, print only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(args.draws, args.seed, (2, 4) if args.quick else NODES)
    print(table(results))
    if not args.quick:
        plot(results)
        write_doc(results, args, time.perf_counter() - start)
        print(f"wrote {DOC.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
