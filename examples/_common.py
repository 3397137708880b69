"""Plumbing shared by the example scripts and ``benchmarks/convergence.py``: compressor specs,
per-rank seeds, the rank-0 progress bar, and the result files (CSV, PNG, JSON).

It builds compressors but holds none of the quantizer's math, and it imports no framework:
callers pass in their own ``horovod.torch`` or ``horovod.tensorflow`` module, so a TF script
never imports ``horovod.torch`` through here (see README, "Usage (PyTorch)").

A *compressor spec* is a short string, comma-separated when there are several:

=================  =========================================================
``none``           ``hvd.Compression.none`` (fp32 on the wire)
``fp16``           ``hvd.Compression.fp16``
``gq8``            ``GlobalQSGD(bits=8)``
``gq4:l2``         ``GlobalQSGD(bits=4, norm="l2")`` (``max`` works the same way)
``gq4:key=value``  any other ``GlobalQSGD`` argument, e.g. ``gq8:bucket_bytes=65536``
``gq4:flag``       a boolean argument set to True, e.g. a future ``gq4:rotate``
``qprsgd8:k=4``    local SGD: ``QPRSGD`` (PyTorch only), ring-allreduce syncs of
                   ``GlobalQSGD(bits=8)`` model differences every 4 steps
``qprsgd8:k=8:gossip``  the same with gossip syncs between ring neighbours; also
                   ``:allreduce``, ``:warmup=<steps>`` and any ``GlobalQSGD`` option
=================  =========================================================

:func:`build_optimizer` turns a variant into the optimizer a PyTorch example steps:
``hvd.DistributedOptimizer`` with the compressor, or ``QPRSGD`` around the local optimizer.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_gqsgd import GlobalQSGD

__all__ = ["Variant", "add_common_args", "add_cuda_arg", "build_compressor", "build_optimizer",
           "check_cuda", "group_runs", "is_local_sgd", "make_progress", "rank_device",
           "mean_std", "parse_variant", "parse_variants", "plot_curves", "print_table",
           "rank_seed", "say", "seeds_of", "settings_of", "write_outputs"]

# spec prefix -> (class, its name in labels).  Another quantizer is one more line here.
_QUANTIZERS: dict[str, tuple[type, str]] = {"gq": (GlobalQSGD, "GlobalQSGD")}
_LOCAL_SGD = "qprsgd"  # spec prefix of local SGD (QPRSGD), GlobalQSGD codes
_TOPOLOGIES = ("allreduce", "gossip")
_NORMS = ("max", "l2")
_SPEC = re.compile(r"^(?P<kind>[a-z]+?)(?P<bits>\d+)$")


@dataclass(frozen=True)
class Variant:
    """One compressor setting of a sweep, parsed from a spec such as ``"gq4:l2"``."""

    spec: str  # as written by the user; the key in result files
    label: str  # what tables and plots show, e.g. "GlobalQSGD(4, l2)"
    kind: str  # "none", "fp16" or a key of _QUANTIZERS
    kwargs: dict[str, Any] = field(default_factory=dict)  # quantizer arguments, bits included
    local: dict[str, Any] = field(default_factory=dict)  # QPRSGD's period/topology/warmup

    @property
    def bits(self) -> int | None:
        return self.kwargs.get("bits")


def _option_value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_variant(spec: str) -> Variant:
    """``"gq4:l2"`` -> ``Variant``.  Builds the compressor once, so a bad option fails here,
    before any rank starts training, with the spec in the message."""
    spec = spec.strip()
    if spec == "none":
        return Variant(spec, "fp32 (none)", "none")
    if spec == "fp16":
        return Variant(spec, "fp16", "fp16")
    head, *options = spec.split(":")
    match = _SPEC.match(head)
    if match and match["kind"] == _LOCAL_SGD:
        return _parse_local(spec, int(match["bits"]), options)
    if not match or match["kind"] not in _QUANTIZERS:
        raise ValueError(f"compressor spec {spec!r}: expected 'none', 'fp16' or "
                         f"{'|'.join(_QUANTIZERS)}<bits>[:option...], e.g. 'gq8' or 'gq4:l2'")
    kwargs: dict[str, Any] = {"bits": int(match["bits"])}
    for opt in options:
        if opt in _NORMS:
            kwargs["norm"] = opt
        elif "=" in opt:
            key, value = opt.split("=", 1)
            kwargs[key] = _option_value(value)
        else:
            kwargs[opt] = True
    cls, name = _QUANTIZERS[match["kind"]]
    try:
        cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"compressor spec {spec!r}: {name}(**{kwargs}) failed: {exc}") from exc
    label = ", ".join([str(kwargs["bits"]), *options])
    return Variant(spec, f"{name}({label})", match["kind"], kwargs)


def _parse_local(spec: str, bits: int, options: list[str]) -> Variant:
    """``qprsgd8:k=4:gossip`` -> a QPRSGD variant (period 4 if ``k`` is not given)."""
    local: dict[str, Any] = {"period": 4, "topology": "allreduce", "warmup_steps": 0}
    rest = []
    for opt in options:
        key, _, value = opt.partition("=")
        if opt in _TOPOLOGIES:
            local["topology"] = opt
        elif key in ("k", "warmup") and value.isdigit():
            local["period" if key == "k" else "warmup_steps"] = int(value)
        elif key in ("k", "warmup"):
            raise ValueError(f"compressor spec {spec!r}: {key}= needs a whole number, got "
                             f"{value!r}, e.g. 'qprsgd8:k=4'")
        else:
            rest.append(opt)
    try:
        inner = parse_variant(f"gq{bits}" + "".join(f":{o}" for o in rest))
    except ValueError as exc:
        raise ValueError(f"compressor spec {spec!r}: {exc}") from exc
    if local["period"] < 1:
        raise ValueError(f"compressor spec {spec!r}: k must be >= 1 (local steps per sync)")
    label = f"QPRSGD({bits}, K={local['period']}, {local['topology']}" + "".join(
        f", {o}" for o in rest) + (f", warmup {local['warmup_steps']}" if local[
            "warmup_steps"] else "") + ")"
    return Variant(spec, label, _LOCAL_SGD, inner.kwargs, local)


def parse_variants(text: str | Sequence[str]) -> list[Variant]:
    """Comma-separated specs (or a list of them) -> variants, in order, duplicates refused."""
    specs = [s for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    variants = [parse_variant(s) for s in specs]
    seen = [v.spec for v in variants]
    if len(set(seen)) != len(seen):
        raise ValueError(f"compressor specs repeat: {seen}")
    return variants


def build_compressor(variant: Variant, hvd: Any, seed: int) -> Any:
    """A fresh compressor for one run.  ``hvd`` is the caller's horovod.torch or
    horovod.tensorflow.  GlobalQSGD's rounding noise is seeded from ``seed`` unless the spec
    sets ``seed``: reproducible, and still different on every rank."""
    if variant.kind == "none":
        return hvd.Compression.none
    if variant.kind == "fp16":
        return hvd.Compression.fp16
    if variant.kind == _LOCAL_SGD:
        raise ValueError(f"compressor spec {variant.spec!r} is local SGD (QPRSGD, PyTorch "
                         "only): the example must build it with build_optimizer()")
    cls, _ = _QUANTIZERS[variant.kind]
    return cls(**{"seed": seed, **variant.kwargs})


def build_optimizer(variant: Variant, hvd: Any, local: Any, named_parameters: Any,
                    seed: int) -> tuple[Any, Any]:
    """PyTorch: ``(optimizer, compressor)`` for one run.  ``local`` is the plain torch
    optimizer; synchronous variants wrap it in ``hvd.DistributedOptimizer``, ``qprsgd``
    variants in ``hvd_gqsgd.qprsgd.QPRSGD`` (imported here: it imports torch)."""
    if variant.kind != _LOCAL_SGD:
        compression = build_compressor(variant, hvd, seed)
        return hvd.DistributedOptimizer(local, named_parameters=named_parameters,
                                        compression=compression), compression
    from hvd_gqsgd.qprsgd import QPRSGD

    compression = GlobalQSGD(**{"seed": seed, **variant.kwargs})
    params = [p for _, p in named_parameters]
    return QPRSGD(local, params, compression=compression, **variant.local), compression


def is_local_sgd(variant: Variant) -> bool:
    return variant.kind == _LOCAL_SGD


def rank_seed(seed: int, rank: int) -> int:
    """Seed of a rank's data order: differs between ranks, same for every compressor."""
    return 1000 * seed + rank


def add_common_args(parser: argparse.ArgumentParser, default_variants: str | None,
                    variants_help: str = "%(default)s") -> None:
    """The flags every experiment shares."""
    parser.add_argument("--variants", default=default_variants,
                        help="comma-separated compressor specs, run in this order: none, fp16, "
                             f"gq<bits>[:l2|:max|:key=value|:flag] (default: {variants_help})")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds; every compressor runs once per seed with "
                             "the same data order and initial weights (default: %(default)s)")
    parser.add_argument("--csv", type=Path, help="write every run's loss curve to this CSV")
    parser.add_argument("--png", type=Path, help="plot the loss curves into this PNG")
    parser.add_argument("--json", type=Path, help="write all results as JSON (for the sweep)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on rank 0 (default: only when rank 0's stderr or "
                             "stdout is a terminal; horovodrun pipes them, so pass --progress "
                             "there to see it)")


def add_cuda_arg(parser: argparse.ArgumentParser) -> None:
    """``--cuda``, for the PyTorch examples under Horovod."""
    parser.add_argument("--cuda", action="store_true",
                        help="each rank's model and data on cuda:<local rank> (Horovod's "
                             "hvd.local_rank()); gradients then go through Horovod's GPU "
                             "collectives (NCCL in docker/Dockerfile.gpu's image)")


def check_cuda(requested: bool, script: str) -> None:
    """Before ``hvd.init()``: stop with a clear message when ``--cuda`` was given and torch
    sees no CUDA device (imports torch only then)."""
    if not requested:
        return
    import torch

    if not torch.cuda.is_available():
        build = (f"a CPU build of torch {torch.__version__}" if torch.version.cuda is None
                 else f"torch {torch.__version__} (CUDA {torch.version.cuda}), no usable GPU")
        raise SystemExit(f"{script} --cuda: torch sees no CUDA device ({build}). Run without "
                         "--cuda to train on the CPU.")


def rank_device(requested: bool, local_rank: int) -> Any:
    """``cuda:<local_rank>``, made the current device, with ``--cuda``; else the CPU.  Stops
    when the node has fewer GPUs than ranks."""
    import torch

    if not requested:
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise SystemExit(f"--cuda: local rank {local_rank} needs cuda:{local_rank}, but torch "
                         f"sees {torch.cuda.device_count()} CUDA device(s) on this node; start "
                         "at most one rank per GPU")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def seeds_of(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def settings_of(args: argparse.Namespace) -> dict:
    """The command-line settings, JSON-ready (paths as strings)."""
    return {k: v if v is None or isinstance(v, bool | int | float | str) else str(v)
            for k, v in vars(args).items()}


class _NoBar:
    """Stands in for tqdm when the bar is off (or tqdm is not installed)."""

    def update(self, n: int = 1) -> None: ...
    def set_description_str(self, text: str) -> None: ...
    def set_postfix_str(self, text: str, refresh: bool = True) -> None: ...
    def close(self) -> None: ...


def make_progress(total: int, rank: int, wanted: bool | None) -> Any:
    """A tqdm bar over ``total`` steps on rank 0; a no-op object elsewhere, when ``wanted`` is
    False, or when ``wanted`` is None and neither stderr nor stdout is a terminal."""
    streams = [s for s in (sys.stderr, sys.stdout) if s.isatty()]
    if rank != 0 or wanted is False or (wanted is None and not streams):
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; `pip install tqdm` (dev extra) enables it
        return _NoBar()
    return tqdm(total=total, file=(streams or [sys.stderr])[0], unit="step",
                dynamic_ncols=True, leave=False)


def say(bar: Any, text: str) -> None:
    """Print a line without tearing an active progress bar."""
    if isinstance(bar, _NoBar):
        print(text, flush=True)
    else:
        bar.write(text)


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    vals = [float(v) for v in values]
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def group_runs(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """Runs keyed by compressor spec, in first-seen order."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["spec"], []).append(run)
    return groups


def _cell(values: Sequence[float], fmt: str, suffix: str) -> str:
    mean, std = mean_std(values)
    if len(set(values)) == 1:  # one seed, or a setting that no seed changes (bytes)
        return f"{values[0]:{fmt}}{suffix}"
    return f"{mean:{fmt}}±{std:{fmt}}{suffix}"


def print_table(runs: Sequence[dict], columns: Sequence[tuple[str, str, str, int, str]]) -> None:
    """One row per compressor; ``columns`` are (header, result key, format, width, suffix).
    With several seeds a cell reads mean±std (sample standard deviation over seeds)."""
    groups = list(group_runs(runs).values())
    table = [[_cell([r[key] for r in g], fmt, sfx) for _, key, fmt, _, sfx in columns]
             for g in groups]
    widths = [max([w, *(len(row[i]) + 2 for row in table)])
              for i, (_, _, _, w, _) in enumerate(columns)]
    first = max([16, *(len(g[0]["label"]) + 2 for g in groups)])
    print(f"{'run':<{first}}" + "".join(f"{c[0]:>{w}}" for c, w in zip(columns, widths)))
    for group, row in zip(groups, table):
        print(f"{group[0]['label']:<{first}}" + "".join(f"{c:>{w}}" for c, w in zip(row, widths)))


def _curve_rows(runs: Sequence[dict]) -> tuple[list[str], list[dict]]:
    metrics = list(dict.fromkeys(k for run in runs for point in run["curve"] for k in point))
    rows = [{"compressor": run["spec"], "label": run["label"], "seed": run["seed"], **point}
            for run in runs for point in run["curve"]]
    return ["compressor", "label", "seed", *metrics], rows


# the baselines drawn so that the compressed curves stay visible on top of them
_STYLES: dict[str, dict] = {
    "none": {"color": "black", "linestyle": "--", "linewidth": 1.4, "zorder": 4},
    "fp16": {"color": "0.5", "linestyle": ":", "linewidth": 1.6, "zorder": 3}}


def plot_curves(ax: Any, runs: Sequence[dict], metric: str) -> None:
    """One line per compressor: ``metric`` against step, mean over seeds."""
    for group in group_runs(runs).values():
        steps = [p["step"] for p in group[0]["curve"] if p.get(metric) is not None]
        mean = [mean_std(next(p[metric] for p in run["curve"] if p["step"] == step)
                         for run in group)[0] for step in steps]
        spec = group[0]["spec"]
        # local SGD dash-dotted: a sweep has more lines than the colour cycle has colours
        style = _STYLES.get(spec, {"linestyle": "-."} if spec.startswith(_LOCAL_SGD) else {})
        ax.plot(steps, mean, label=group[0]["label"], **style)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def write_outputs(args: argparse.Namespace, payload: dict, ylabel: str) -> None:
    """Rank 0: --json (everything), --csv (one row per run and logged step), --png (train
    loss and ``payload["metric"]`` against step)."""
    runs = payload["runs"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
    if args.csv:
        header, rows = _curve_rows(runs)
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header, restval="")
            writer.writeheader()
            writer.writerows({k: ("" if v is None else v) for k, v in row.items()}
                             for row in rows)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        plot_curves(left, runs, "train_loss")
        left.set_ylabel("training loss (mean over ranks)")
        plot_curves(right, runs, payload["metric"])
        right.set_ylabel(ylabel)
        right.legend(fontsize=8)
        fig.suptitle(payload["title"], fontsize=10)
        fig.tight_layout()
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        plt.close(fig)
