"""Time to accuracy of local SGD with quantized syncs (QPRSGD) on emulated slow links.

One command, as root (network namespaces), regenerates docs/LOCAL_SGD.md and its plot::

    .venv/bin/python studies/local_sgd.py                 # about an hour on 2 idle cores

It takes /tmp/gqsgd-bench.lock (other benchmarks on the machine wait, and it waits for them),
starts 4 emulated hosts (gqsgd_lab/emulated_hosts.py) joined by links of ``--rate``, and runs
one mpirun job in which every run trains examples/char_lm.py's LSTM from the same weights, on
the same windows, for the same number of steps (so the same samples):

* ``sync:none`` / ``sync:gq8``: synchronous ``hvd.DistributedOptimizer``, fp32 or
  GlobalQSGD(8) gradients, every step;
* ``avg:K``: PostLocalSGD-style fp32 model averaging every K steps (QPRSGD allreduce with
  ``Compression.none``: ``x_bar + mean(x_i - x_bar)`` is the plain mean of the models);
* ``allreduce:K`` / ``gossip:K``: QPRSGD with GlobalQSGD(8) differences, every K steps;
  ``allreduce:K:wN`` (any local run) first averages after each of N warmup steps.

A second mpirun job (``budget``) gives the local-SGD runs 3x the steps, for time to accuracy.
A third job (``horizon``) is loss only: the same-samples comparison at several training
lengths (``--horizon-steps``), plus warmup and K=1 runs at ``--steps``.  Losses do not depend
on the link, so it runs on localhost with ``horovodrun --gloo`` (no emulated hosts, no lock).

Local steps use Adam (state local to each rank).  The clock counts training only: at each
log point (every ``--eval-every`` steps, a multiple of every K, so after a sync) it stops while
the validation loss of the ranks' *average* model is measured (for gossip the ranks still
differ; an fp32 average outside the clock), then runs on.  ``--worker`` is the per-rank entry
that the driver launches; ``--from-json`` redraws the report from saved results.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))  # char_lm.py, the model and data it times

RUNS = ("sync:none", "sync:gq8", "avg:4", "avg:8", "allreduce:4", "allreduce:8", "gossip:4",
        "gossip:8")
LABELS = {"sync:none": "sync fp32", "sync:gq8": "sync GlobalQSGD(8)"}
LOCK = "/tmp/gqsgd-bench.lock"


def parse_spec(spec: str) -> tuple[str, str, int | None]:
    """``"allreduce:4:w32"`` -> ("allreduce", "4", 32); no ``:wN`` -> warmup None (the
    job's ``--warmup-steps``)."""
    kind, arg, *rest = spec.split(":")
    if rest and not (len(rest) == 1 and rest[0][:1] == "w" and rest[0][1:].isdigit()):
        raise ValueError(f"run spec {spec!r}: expected kind:K[:wN], e.g. 'allreduce:4:w32'")
    return kind, arg, int(rest[0][1:]) if rest else None


def label(spec: str) -> str:
    if spec in LABELS:
        return LABELS[spec]
    kind, k, warmup = parse_spec(spec)
    return {"avg": f"fp32 averaging K={k}", "allreduce": f"QPRSGD allreduce K={k}",
            "gossip": f"QPRSGD gossip K={k}"}[kind] + (
        f", warmup {warmup}" if warmup is not None else "")


# ----------------------------------------------------------------------------- worker


def build(spec: str, net, args, hvd, seed: int):
    """The optimizer of one run (an object with zero_grad/step/param_groups)."""
    import torch

    from hvd_gqsgd import GlobalQSGD
    from hvd_gqsgd.qprsgd import QPRSGD

    adam = torch.optim.Adam(net.parameters(), lr=args.lr)
    kind, arg, warmup = parse_spec(spec)
    if kind == "sync":
        comp = hvd.Compression.none if arg == "none" else GlobalQSGD(bits=8, seed=seed)
        return hvd.DistributedOptimizer(adam, named_parameters=net.named_parameters(),
                                        compression=comp)
    comp = hvd.Compression.none if kind == "avg" else GlobalQSGD(bits=8, seed=seed)
    return QPRSGD(adam, net.parameters(), period=int(arg), compression=comp,
                  topology="gossip" if kind == "gossip" else "allreduce",
                  warmup_steps=args.warmup_steps if warmup is None else warmup)


def local_step(opt, net, batch, args, sync: bool, lm) -> float:
    """One training step; the synchronous runs clip the reduced gradient, the local ones
    their own."""
    import torch

    opt.zero_grad()
    loss = lm.lm_loss(net, batch)
    loss.backward()
    if sync:
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
        with opt.skip_synchronize():
            opt.step()
    else:
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
        opt.step()
    return float(loss.detach())


def averaged_val_loss(net, windows, hvd, lm, args) -> float:
    """COLLECTIVE: validation loss of the mean of the ranks' models (fp32, off the clock)."""
    import torch

    params = [p.detach() for p in net.parameters()]
    mean = hvd.grouped_allreduce(params, op=hvd.Average, name="lsgd.eval")
    probe = lm.make_model(0, net.head.out_features, args)
    with torch.no_grad():
        for p, m in zip(probe.parameters(), mean):
            p.copy_(m)
    return lm.val_loss(probe, windows)


def train_run(spec: str, corpus, windows, args, hvd, lm) -> dict:
    import numpy as np
    import torch

    seed = args.seed
    net = lm.make_model(seed, len(corpus.chars), args)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = build(spec, net, args, hvd, seed)
    steps = args.steps * (1 if spec.startswith("sync") else args.local_factor)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=args.lr / 10)
    rng = np.random.default_rng(lm.rank_seed(seed, hvd.rank()))
    batch = args.global_batch // hvd.size()
    clock, step_times = 0.0, []
    curve = [{"step": 0, "time_s": 0.0, "val_loss": averaged_val_loss(net, windows, hvd, lm,
                                                                       args)}]
    for step in range(1, steps + 1):
        data = corpus.train_batch(rng, batch, args.seq)
        start = time.perf_counter()
        local_step(opt, net, data, args, spec.startswith("sync"), lm)
        sched.step()
        step_times.append(time.perf_counter() - start)
        clock += step_times[-1]
        if step % args.eval_every == 0 or step == steps:
            curve.append({"step": step, "time_s": clock,
                          "val_loss": averaged_val_loss(net, windows, hvd, lm, args)})
    return {"spec": spec, "label": label(spec), "curve": curve, "train_s": clock,
            "val_loss": curve[-1]["val_loss"], "step_times": step_times,
            "sync_bytes": getattr(getattr(opt, "stats", None), "last_bytes", None),
            "load_avg_1min": os.getloadavg()[0]}


def warm_up(net, hvd) -> None:
    """COLLECTIVE, off the clock: compile the numba kernels (first use) for this model's
    size, so the first GlobalQSGD run does not pay for it."""
    import torch

    from hvd_gqsgd import GlobalQSGD

    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    hvd.allreduce(torch.randn_like(flat), op=hvd.Average, compression=GlobalQSGD(bits=8),
                  name="lsgd.warmup")


def worker(args) -> None:
    import char_lm as lm
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    corpus = lm.Corpus()
    windows = corpus.val_windows(args.seq, args.val_chars)
    warm_up(lm.make_model(0, len(corpus.chars), args), hvd)
    results = []
    for spec in args.runs.split(","):
        results.append(train_run(spec, corpus, windows, args, hvd, lm))
        if hvd.rank() == 0:
            r = results[-1]
            print(f"{r['label']}: val {r['val_loss']:.4f} after {r['train_s']:.1f} s",
                  flush=True)
            n_params = sum(p.numel() for p in lm.make_model(0, len(corpus.chars),
                                                            args).parameters())
            args.json.write_text(json.dumps({"settings": _settings(args), "n_params": n_params,
                                             "world_size": hvd.size(), "runs": results},
                                            indent=1))
    hvd.shutdown()


def _settings(args) -> dict:
    return {k: v if isinstance(v, bool | int | float | str) or v is None else str(v)
            for k, v in vars(args).items()}


# ----------------------------------------------------------------------------- driver


def worker_command(args, runs: str, factor: int, out: Path, steps: int | None = None,
                   eval_every: int | None = None, rate: str | None = None) -> list[str]:
    """The per-rank command line of one job (the settings of ``args`` unless overridden)."""
    forward = ["--steps", str(steps or args.steps),
               "--eval-every", str(eval_every or args.eval_every),
               "--global-batch", str(args.global_batch), "--seq", str(args.seq),
               "--lr", str(args.lr), "--hidden", str(args.hidden), "--embed", str(args.embed),
               "--layers", str(args.layers), "--val-chars", str(args.val_chars),
               "--seed", str(args.seed), "--runs", runs, "--rate", rate or args.rate,
               "--burst", args.burst,
               "--local-factor", str(factor),
               "--warmup-steps", str(args.warmup_steps), "--clip", str(args.clip),
               "--json", str(out)]
    return [sys.executable, str(Path(__file__).resolve()), "--worker", *forward]


def launch(args, runs: str, factor: int, out: Path) -> None:
    """Root: 4 emulated hosts at --rate, one mpirun job of ``runs``, under the bench lock."""
    from gqsgd_lab.emulated_hosts import EmulatedHosts, require_root

    require_root()
    cmd = worker_command(args, runs, factor, out)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'examples'}"}
    with open(LOCK, "w") as lock:
        print(f"waiting for {LOCK} ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.perf_counter()
        # Own session directory: the hosts share one /tmp and hostname, and an orted of
        # another job's mpirun once took the same job-family directory here.
        with tempfile.TemporaryDirectory(prefix="gq-lsgd-") as tmp, EmulatedHosts(
                args.hosts, rate=args.rate, burst=args.burst) as hosts:
            proc = hosts.mpirun(cmd, env=env, timeout=args.timeout,
                                mca={"orte_tmpdir_base": tmp})
        print(proc.stdout[-3000:], flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark job failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-4000:]}")
        print(f"job took {time.perf_counter() - start:.0f} s", flush=True)


def horizon_runs(args, steps: int) -> str:
    """The runs of the loss-only job at ``steps``: the diagnostics only at
    ``--diagnostic-steps``."""
    return args.horizon_runs + ("," + args.diagnostic_runs
                                if steps == args.diagnostic_steps and args.diagnostic_runs
                                else "")


def launch_horizon(args, out: Path) -> None:
    """Loss only, on localhost: one ``horovodrun --gloo`` job per ``--horizon-steps`` length
    (cosine schedule over that length; validation only at the end), into one JSON."""
    results = {}
    for steps in (int(s) for s in args.horizon_steps.split(",")):
        part = out.with_name(f"{out.stem}_{steps}.json")
        cmd = [str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np",
               str(args.hosts), "-H", f"localhost:{args.hosts}",
               *worker_command(args, horizon_runs(args, steps), 1, part, steps=steps,
                               eval_every=steps, rate="loopback")]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{ROOT}:{ROOT / 'examples'}"}
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"loss-only job at {steps} steps failed (exit "
                             f"{proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        print(f"loss-only job, {steps} steps: {time.perf_counter() - start:.0f} s", flush=True)
        results[str(steps)] = json.loads(part.read_text())
        part.unlink()
    out.write_text(json.dumps(results, indent=1))


def merge(into: Path, extra: Path) -> None:
    """Add the runs of a later job (``--append``) to a job's results, marked as such."""
    payload, more = json.loads(into.read_text()), json.loads(extra.read_text())
    for run in more["runs"]:
        run["appended"] = True
    known = {r["spec"] for r in more["runs"]}
    payload["runs"] = [r for r in payload["runs"] if r["spec"] not in known] + more["runs"]
    into.write_text(json.dumps(payload, indent=1))
    extra.unlink()


def time_to(curve: list[dict], target: float, key: str = "time_s") -> float | None:
    """Training seconds (or, with ``key="step"``, steps) at which the val loss first reaches
    ``target`` (linear between log points); None if it never does."""
    for a, b in zip(curve, curve[1:]):
        if b["val_loss"] <= target:
            if a["val_loss"] <= target:
                return a[key]
            frac = (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            return a[key] + frac * (b[key] - a[key])
    return None


def analyse(payload: dict) -> dict:
    """Targets, times to target, ratios and the communication share of sync fp32's step."""
    runs = {r["spec"]: r for r in payload["runs"]}
    target = runs["sync:none"]["val_loss"]
    for r in runs.values():
        r["time_to_target"] = time_to(r["curve"], target)
        r["time_to_1pct"] = time_to(r["curve"], target * 1.01)
        r["steps_to_target"] = time_to(r["curve"], target, "step")
        r["median_step_s"] = statistics.median(r["step_times"])
        r["loss_vs_fp32_pct"] = 100 * (r["val_loss"] / target - 1)
        kind, k, _ = parse_spec(r["spec"])
        if kind != "sync" and int(k) > 1:
            r["between_syncs_s"] = period_median_s(r, sync=False)  # compute only
    compute = [r["between_syncs_s"] for r in runs.values() if "between_syncs_s" in r]
    compute_s = min(compute) if compute else float("nan")
    return {"target": target, "runs": runs, "compute_step_s": compute_s,
            "factor": payload["settings"].get("local_factor", 1),
            "comm_share": 1 - compute_s / runs["sync:none"]["median_step_s"]}


def speedup(runs: dict, spec: str, base: str) -> float | None:
    a, b = runs[spec]["time_to_target"], runs.get(base, {}).get("time_to_target")
    return None if a is None or b is None else b / a


def _x(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def table(res: dict) -> list[str]:
    runs = res["runs"]
    rows = ["| run | steps | final val loss | vs sync fp32 | train s | median step s | "
            "s to fp32's final loss | steps to it | speed-up vs sync fp32 | vs sync GQ8 | "
            "vs fp32 avg same K | s to within 1% of it | load avg |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for spec, r in runs.items():
        k = spec.split(":")[1]
        avg = speedup(runs, spec, f"avg:{k}") if spec.split(":")[0] in ("allreduce",
                                                                      "gossip") else None
        rows.append(f"| {r['label']} | {r['curve'][-1]['step']} | {r['val_loss']:.4f} | "
                    f"{r['loss_vs_fp32_pct']:+.2f}% | "
                    f"{r['train_s']:.1f} | {r['median_step_s']:.3f} | "
                    f"{_s(r['time_to_target'])} | {_s(r['steps_to_target'])} | "
                    f"{_x(speedup(runs, spec, 'sync:none'))} | "
                    f"{_x(speedup(runs, spec, 'sync:gq8'))} | {_x(avg) if avg else '-'} | "
                    f"{_s(r['time_to_1pct'])} | {_load(r)} |")
    return rows


def _load(run: dict) -> str:
    load = run.get("load_avg_1min")
    text = "not recorded" if load is None else f"{load:.1f}"
    return text + (" (later job)" if run.get("appended") else "")


def plot(same: dict, budget: dict | None, png: Path) -> None:
    """Left: val loss against training time (the budget job if there is one); right: the
    same-samples job against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, res, x in ((left, budget or same, "time_s"), (right, same, "step")):
        for spec, r in res["runs"].items():
            style = {"linestyle": "--" if spec.startswith("sync") else
                     (":" if spec.startswith("avg") else "-"), "marker": ".",
                     "color": f"C{RUNS.index(spec)}" if spec in RUNS else None}
            ax.plot([p[x] for p in r["curve"]], [p["val_loss"] for p in r["curve"]],
                    label=r["label"], **style)
        ax.axhline(res["target"], color="0.6", linewidth=0.8)
        ax.set_ylabel("validation loss (nats/char)")
        ax.grid(alpha=0.3)
    left.set_xlabel("training wall time (s, rank 0, eval excluded)"
                    + (f"; local runs {budget['factor']}x the steps" if budget else ""))
    left.set_xscale("log")
    right.set_xlabel("step (same samples for every run)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def best_qprsgd(runs: dict, topologies: tuple[str, ...] = ("allreduce", "gossip")
                ) -> str | None:
    """The QPRSGD run (of ``topologies``, any K) that reaches the target first."""
    cands = [s for s in runs if s.split(":")[0] in topologies
             and runs[s]["time_to_target"] is not None]
    return min(cands, key=lambda s: runs[s]["time_to_target"]) if cands else None


def _vs_gq8(same: dict, best_time: float | None) -> tuple[str, str]:
    """Speed-up against sync GlobalQSGD(8) of the same-samples job; a lower bound (its whole
    run) when it never reached the target."""
    gq8 = same["runs"].get("sync:gq8")
    if gq8 is None or best_time is None:
        return "not measured" if gq8 is None else "not reached", "no"
    if gq8["time_to_target"] is not None:
        ratio = gq8["time_to_target"] / best_time
        return f"{ratio:.2f}x", _met(ratio, 1.5)
    ratio = gq8["train_s"] / best_time
    return (f"> {ratio:.2f}x (sync GQ8 never reached it: it ended at {gq8['val_loss']:.4f} "
            f"after {gq8['train_s']:.0f} s)", _met(ratio, 1.5))


def goals(same: dict, budget: dict | None, horizon: dict | None = None) -> list[str]:
    timed = budget or same
    where = (f"time-budget job, local runs {budget['factor']}x the steps" if budget else
             "same-samples job")
    rows = ["| goal | target | measured | met |", "|---|---|---|---|"]
    fastest = best_qprsgd(timed["runs"])
    for topology in ("allreduce", "gossip"):  # "best K" of each topology
        rows += _time_goals(same, timed, where, topology, fastest)
    ar4 = same["runs"].get("allreduce:4")
    if ar4:
        pct = ar4["loss_vs_fp32_pct"]
        rows.append(f"| final val loss, QPRSGD allreduce K=4 vs sync fp32, same samples "
                    f"({ar4['curve'][-1]['step']} steps, same-samples job) | "
                    f"within 3% | {pct:+.2f}% | {'yes' if abs(pct) <= 3 else 'no'} |")
    for steps, runs in horizon_runs_by_length(horizon or {}).items():
        if "allreduce:4" in runs and "sync:none" in runs and steps != same_steps(same):
            pct = _pct(runs["allreduce:4"], runs["sync:none"])
            rows.append(f"| same, {steps} steps for every run (loss-only job) | within 3% | "
                        f"{pct:+.2f}% | {'yes' if abs(pct) <= 3 else 'no'} |")
    return rows


def _time_goals(same: dict, timed: dict, where: str, topology: str,
                fastest: str | None) -> list[str]:
    """The three time-to-target rows for ``topology``'s fastest QPRSGD run (its best K)."""
    runs, best = timed["runs"], best_qprsgd(timed["runs"], (topology,))
    if best is None:
        return [f"| best {topology} K to sync fp32's final loss ({where}) | >= 4x | "
                "not reached | no |"] if any(s.startswith(topology) for s in runs) else []
    k = best.split(":")[1]
    vs_fp32, vs_avg = (speedup(runs, best, b) for b in ("sync:none", f"avg:{k}"))
    gq8, gq8_met = _vs_gq8(same, runs[best]["time_to_target"])
    who = (f"best {topology} K ({runs[best]['label']}, "
           f"{runs[best]['time_to_target']:.1f} s"
           + (", the fastest QPRSGD run)" if best == fastest else ")"))
    return [f"| {who} to sync fp32's final loss, vs sync fp32 ({where}) | >= 4x | "
            f"{_x(vs_fp32)} | {_met(vs_fp32, 4)} |",
            f"| same vs sync GlobalQSGD(8) (its time from the same-samples job) | >= 1.5x | "
            f"{gq8} | {gq8_met} |",
            f"| same vs fp32 averaging at K={k} ({where}) | >= 1.5x | {_x(vs_avg)} | "
            f"{_met(vs_avg, 1.5)} |"]


def same_steps(res: dict) -> int:
    return res["runs"]["sync:none"]["curve"][-1]["step"]


def _pct(run: dict, base: dict) -> float:
    return 100 * (run["val_loss"] / base["val_loss"] - 1)


def horizon_runs_by_length(horizon: dict) -> dict[int, dict[str, dict]]:
    """Loss-only job: steps -> spec -> run, shortest first."""
    return {int(k): {r["spec"]: r for r in v["runs"]}
            for k, v in sorted(horizon.items(), key=lambda kv: int(kv[0]))}


def _lag(same: dict) -> str:
    """Why a short run shows a larger gap, from the same-samples job's curves."""
    sync, ar4 = same["runs"]["sync:none"]["curve"], same["runs"].get("allreduce:4")
    caught = None if ar4 is None else time_to(sync, ar4["val_loss"], "step")
    if caught is None:
        return ""
    steps = same_steps(same)
    half = min(sync, key=lambda p: abs(p["step"] - steps / 2))
    drop = half["val_loss"] - sync[-1]["val_loss"]
    return ("  The gap shrinks as every run gets longer: in the same-samples job sync fp32 "
            f"had reached QPRSGD allreduce K=4's final loss by step {caught:.0f} of {steps}, "
            f"and its own loss still fell {drop:.2f} nats over its last "
            f"{steps - half['step']} steps, so local SGD's lag of about "
            f"{steps - caught:.0f} steps costs more at the end of a short run than at the end "
            "of a longer one, where the loss has flattened.")


def horizon_table(horizon: dict) -> list[str]:
    rows = ["| steps (every run) | run | final val loss | vs sync fp32, same steps |",
            "|---|---|---|---|"]
    for steps, runs in horizon_runs_by_length(horizon).items():
        base = runs["sync:none"]
        rows += [f"| {steps} | {r['label']} | {r['val_loss']:.4f} | "
                 f"{_pct(r, base):+.2f}% |" for r in runs.values()]
    return rows


def horizon_notes(horizon: dict, same: dict) -> list[str]:
    """Sentences computed from the loss-only job: agreement with the emulated-host job, the
    trend with length, warmup and K=1."""
    by_len = horizon_runs_by_length(horizon)
    out = []
    here = by_len.get(same_steps(same), {})
    shared = [s for s in here if s in same["runs"]]
    if shared:
        gap = max(abs(here[s]["val_loss"] - same["runs"][s]["val_loss"]) for s in shared)
        out.append(f"- At {same_steps(same)} steps the loopback runs of "
                   + ", ".join(here[s]["label"] for s in shared) + " end "
                   + ("at exactly the same-samples job's losses (4 emulated hosts, mpirun): "
                      "the link changes times, not losses." if gap == 0 else
                      f"within {gap:.2g} nats of the same-samples job's losses."))
    trend = [(steps, _pct(runs["allreduce:4"], runs["sync:none"]))
             for steps, runs in by_len.items() if {"allreduce:4", "sync:none"} <= set(runs)]
    if trend:
        out.append("- QPRSGD allreduce K=4 against sync fp32 at the same samples: "
                   + ", ".join(f"{pct:+.2f}% at {steps} steps" for steps, pct in trend)
                   + "." + (_lag(same) if all(a[1] > b[1] for a, b in zip(trend, trend[1:]))
                            else ""))
    diag = [n for n, runs in by_len.items()
            if any(s == "avg:1" or s.startswith("allreduce:4:w") for s in runs)]
    short = by_len[diag[0]] if diag else {}
    base, ar4 = short.get("sync:none"), short.get("allreduce:4")
    warm = [s for s in short if s.startswith("allreduce:4:w")]
    if base and ar4 and warm:
        out.append(f"- Warmup at {diag[0]} steps (`warmup_steps`, averaging after "
                   "each of the first N steps, as PostLocalSGD does): "
                   + ", ".join(f"{short[s]['label']} {_pct(short[s], base):+.2f}%"
                               for s in warm)
                   + f", against {_pct(ar4, base):+.2f}% without.")
    if base and "avg:1" in short:
        out.append(f"- fp32 model averaging after *every* step (K=1, no local drift at all) "
                   f"ends {_pct(short['avg:1'], base):+.2f}% from sync fp32 at {diag[0]} "
                   "steps: with Adam, "
                   "averaging models is not averaging gradients, because each rank's Adam "
                   "normalises its own quarter-batch gradient by moments of that gradient.  "
                   "Warmup steps are such K=1 averaging steps (through the 8-bit allreduce), "
                   "so they cannot do better than this.")
    return out


def _met(value: float | None, goal: float) -> str:
    return "no" if value is None or value < goal else "yes"


def observations(res: dict) -> list[str]:
    """Sentences computed from the numbers (so they stay true when the doc is regenerated)."""
    runs = res["runs"]
    local = [s for s in runs if not s.startswith("sync")]
    worse = [f"{runs[s]['label']} {runs[s]['loss_vs_fp32_pct']:+.1f}%" for s in local]
    loads = [r["load_avg_1min"] for r in runs.values() if "load_avg_1min" in r]
    out = [f"- The machine's 1-minute load average at the end of the runs: "
           f"{min(loads):.1f} to {max(loads):.1f} (2 cores; 4 of those processes are "
           "this benchmark's ranks)."] if loads else []
    out += [f"- Synchronous fp32 spends {100 * res['comm_share']:.0f}% of its step "
           f"communicating (median step {runs['sync:none']['median_step_s']:.3f} s against "
           f"{res['compute_step_s']:.3f} s for a step with no communication, the median "
           "local step of the local-SGD runs).  On this oversubscribed machine part of that "
           "is Horovod's background threads waiting for a core, not the link.",
           "- Final validation loss at the same number of samples, against sync fp32: "
           + ", ".join(worse) + "."]
    between = [f"{runs[s]['label']} {runs[s]['between_syncs_s']:.3f} s" for s in local
               if "between_syncs_s" in runs[s]]
    if between:
        out.append("- Median step between syncs (compute only, the same work in every "
                   "local-SGD run): " + ", ".join(between) + ".  The ranks' CPU kernels use "
                   "one thread each here; with numba's default of one per CPU in every "
                   "rank, the pool's spinning idle threads made these steps several times "
                   "slower (measured in `hvd_gqsgd.kernels.thread_budget`'s docstring).")
    for k in sorted({s.split(":")[1] for s in local}, key=int):
        avg, ar, gos = (runs.get(f"{t}:{k}") for t in ("avg", "allreduce", "gossip"))
        if avg and ar:
            out.append(f"- K={k}, quantization: QPRSGD allreduce (8-bit differences) ends at "
                       f"{ar['val_loss']:.4f}, fp32 averaging at {avg['val_loss']:.4f} "
                       f"({100 * (ar['val_loss'] / avg['val_loss'] - 1):+.2f}%).")
        if ar and gos:
            out.append(f"- K={k}, topology: gossip ends at {gos['val_loss']:.4f}, allreduce "
                       f"at {ar['val_loss']:.4f} "
                       f"({100 * (gos['val_loss'] / ar['val_loss'] - 1):+.2f}%).")
    return out


def budget_notes(budget: dict) -> list[str]:
    """The load-independent part of the time-budget job (steps), and the caveat on times."""
    runs, sync = budget["runs"], same_steps(budget)
    steps = [f"{r['label']} {r['steps_to_target']:.0f}" for s, r in runs.items()
             if not s.startswith("sync") and r["steps_to_target"] is not None]
    loads = [r["load_avg_1min"] for r in runs.values() if "load_avg_1min" in r]
    out = [f"- Steps to sync fp32's final loss (it needed its {sync}; the other runs had "
           "their own, longer cosine schedule): " + ", ".join(steps) + f".  Fewer than {sync} "
           "does not mean local SGD learns more per sample (the same-samples table shows the "
           f"opposite): a cosine schedule over {budget['factor']}x the steps still has nearly "
           "its full learning rate there.  Steps do not depend on the machine's load; seconds "
           "do."]
    if loads:
        out.append(f"- The 1-minute load average ranged from {min(loads):.1f} to "
                   f"{max(loads):.1f} over this job's runs (2 cores, 4 ranks of ours), so "
                   "ratios between runs that ran at different loads mix the network's "
                   "effect with the machine's: compare runs of similar load, or the steps "
                   "column times each run's median step time.")
    return out


def period_median_s(run: dict, sync: bool) -> float:
    """Median seconds of a local-SGD run's sync steps (every K-th) or of its other steps."""
    k = int(run["spec"].split(":")[1])
    return statistics.median(t for i, t in enumerate(run["step_times"], 1)
                             if (i % k == 0) == sync)


def link_notes(res: dict, burst: str) -> list[str]:
    """How the emulated link treats bursty traffic, from the fp32-averaging runs' sync steps
    (each sends what a sync fp32 step sends, after K - 1 steps with an idle link)."""
    runs = res["runs"]
    avg = sorted((s for s in runs if s.startswith("avg:") and s != "avg:1"),
                 key=lambda s: int(s.split(":")[1]))
    if not avg or "sync:none" not in runs:
        return []
    steps = ", ".join(f"{period_median_s(runs[s], sync=True):.3f} s at K={s.split(':')[1]}"
                      for s in avg)
    return [f"- **The link model favours infrequent fp32 syncs.**  Each link is a tc token "
            f"bucket of {burst} that refills while the ranks compute, so a sync after idle "
            "steps sends part of its bytes at once.  fp32 averaging's sync step, which sends "
            f"the same bytes as a sync fp32 step, took {steps}, against "
            f"{runs['sync:none']['median_step_s']:.3f} s for sync fp32's steps back to back.  "
            "A real link of this rate gives no such credit: there the fp32-averaging rows "
            "would be slower and the \"vs fp32 avg same K\" column higher.  Smaller buckets "
            "were tried and slowed continuous ring traffic well below the link's rate (why "
            "is not known: giving small packets such as acknowledgements their own priority "
            f"class did not help), so the page keeps {burst}."]


STATIC = """\
## Where local SGD loses accuracy

- **Per sample, local SGD is worse than synchronous SGD.**  Between syncs each rank follows
  the gradient of its own small batch (here a quarter of the global batch) from its own
  model; those K steps are not the K steps that the averaged gradient would have taken.  The
  table's "vs sync fp32" column shows the cost at equal samples.
- **Adam's state stays local**: each rank's moments see only its own gradients, and model
  averaging does not average them.  `warmup_steps` (average after every step at first) is
  the usual remedy for the early phase; the loss-only job measures it, and K=1 averaging.
- **Gossip averages only with neighbours**, so a sync leaves the ranks apart: on a ring of
  4 with weights 1/3, one round with exact messages keeps a third of the disagreement, and
  the ring's spectral gap shrinks like 1/n², so larger rings need ~n² rounds to mix.  The
  evaluated model here is the ranks' average, which hides part of that; each rank's own
  model is worse.  Gossip has no global collective, which pays off on many ranks or uneven
  links rather than on 4 equal ones.
- **Quantization adds its own error on top**: in allreduce mode at 4 ranks GlobalQSGD(8)
  has 31 levels per sign per 1024-element block for the difference of K steps (4 codes are
  summed in each 8-bit lane); gossip codes are never summed and get 127 levels with the
  rank's own scale, for twice the bytes (one message per neighbour).  The "quantization"
  lines above compare allreduce mode with fp32 averaging at the same K.
"""


def _setup(payload: dict) -> str:
    s = payload["settings"]
    return (f"{payload['world_size']} emulated hosts (network namespaces, one rank each) at "
            f"{s['rate']} per link (tc tbf, burst {s.get('burst', '1mb')}), all on one 2-core "
            "machine (the hosts share its cores), so compute "
            "is slow and timings are noisy.  Model: examples/char_lm.py's "
            f"{s['layers']}-layer LSTM ({payload['n_params']:,} parameters, "
            f"{4 * payload['n_params'] / 1e6:.2f} MB fp32) on the pydoc topics text; "
            f"{s['steps']} steps of {s['global_batch']} windows x {s['seq']} characters over "
            f"all ranks, Adam lr {s['lr']} cosine-decayed to a tenth over each run's steps, "
            f"seed {s['seed']}.  Every run starts from the same weights and sees the same "
            "windows.  Validation loss of the ranks' average model on "
            f"{s['val_chars']:,} held-out characters every {s['eval_every']} steps; the "
            "clock stops while it is measured.")


def write_doc(same: dict, budget: dict | None, payload: dict, md: Path, png: Path,
              horizon: dict | None = None) -> None:
    lines = [
        "# Local SGD with quantized syncs (QPRSGD): time to accuracy",
        "",
        "Regenerate (root; waits for `/tmp/gqsgd-bench.lock`; two mpirun jobs of about 15 "
        "and 25 minutes on this project's 2-core machine when it is otherwise idle, far "
        "longer under load, then a loss-only job on localhost):",
        "",
        "    .venv/bin/python studies/local_sgd.py",
        "",
        "(`--from-json` redraws this page from docs/local_sgd*.json.)  " + _setup(payload),
        "",
        "## Same samples: every run takes the same steps",
        "",
        f"Target: the final validation loss of synchronous fp32, {same['target']:.4f} "
        "nats/char.",
        "",
        *table(same),
        "",
    ]
    if budget:
        lines += [
            f"## Time budget: local-SGD runs take {budget['factor']}x the steps",
            "",
            "A second job (its own sync fp32 run, so the same load) in which the local-SGD "
            f"runs train {budget['factor']}x as many steps, cosine schedule over their own "
            f"length, so that they can reach sync fp32's final loss "
            f"({budget['target']:.4f} in this job) at all.  Last column: the machine's "
            "1-minute load average when the run ended."
            + ("  Rows marked \"(later job)\" were added by a later job (`--jobs budget "
               "--append --budget-runs ...`): their times were taken under another load."
               if any(r.get("appended") for r in budget["runs"].values()) else ""),
            "",
            *table(budget),
            "",
            *budget_notes(budget),
            "",
        ]
    if horizon:
        lines += [
            "## Same samples, longer training (loss only)",
            "",
            "A third job (`--jobs horizon`) asks whether the same-samples gap is the price of "
            "local SGD or of a short run: every run takes the same steps again, at "
            f"{', '.join(map(str, horizon_runs_by_length(horizon)))} steps, with the cosine "
            "schedule over that length and all other settings as above.  Only the final "
            "validation loss counts, and losses do not depend on the link, so this job runs "
            "on localhost (`horovodrun --gloo`, 4 ranks, no emulated links) and takes no "
            "times.  The local-SGD runs repeat bit for bit (integer sums, or one grouped "
            "allreduce per sync); sync fp32 does not quite, probably because Horovod fuses its "
            "per-tensor fp32 allreduces by timing, which changes the order of the sums (the "
            "first note below the table compares the two jobs).",
            "",
            *horizon_table(horizon),
            "",
            *horizon_notes(horizon, same),
            "",
        ]
    lines += ["## Against the goals of issue 13", "", *goals(same, budget, horizon), "",
              f"![validation loss against time and steps]({png.name})", "",
              "## What the numbers say", "", *observations(same),
              *link_notes(same, payload["settings"].get("burst", "1mb")), "", STATIC]
    md.write_text("\n".join(lines))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="per-rank entry (used by the driver)")
    p.add_argument("--from-json", action="store_true",
                   help="only redraw the doc and plot from --json")
    p.add_argument("--runs", default=",".join(RUNS), help="runs of the same-samples job")
    p.add_argument("--jobs", default="same,budget,horizon",
                   help="which jobs to run: same (every run the same steps), budget (local "
                        "runs --budget-factor times the steps), horizon (loss only, on "
                        "localhost: same steps for every run at each --horizon-steps)")
    p.add_argument("--horizon-steps", default="160,320,480",
                   help="training lengths of the loss-only job")
    p.add_argument("--horizon-runs", default="sync:none,avg:4,allreduce:4",
                   help="runs of the loss-only job at every length")
    p.add_argument("--diagnostic-runs", default="avg:1,allreduce:4:w32,allreduce:4:w80",
                   help="more runs of the loss-only job, at --diagnostic-steps only")
    p.add_argument("--diagnostic-steps", type=int, default=160,
                   help="the loss-only job's length (one of --horizon-steps) that also runs "
                        "--diagnostic-runs")
    p.add_argument("--budget-runs", default=",".join(r for r in RUNS if r != "sync:gq8"))
    p.add_argument("--budget-factor", type=int, default=3)
    p.add_argument("--append", action="store_true",
                   help="budget job: add --budget-runs to the saved budget results instead of "
                        "replacing them (e.g. after a job ran past --timeout)")
    p.add_argument("--local-factor", type=int, default=1,
                   help="(worker) local-SGD runs train this many times --steps")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="20mbit", help="tc rate of every host's link")
    p.add_argument("--burst", default="1mb",
                   help="tc tbf burst of every link (see the page's note on the link model: a "
                        "1 MB bucket lets a sync after idle steps send up to 1 MB at once; "
                        "small buckets halved Horovod's ring throughput here)")
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--eval-every", type=int, default=16, help="a multiple of every K")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="local-SGD runs average every step for this many first steps")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--embed", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--val-chars", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per mpirun job")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "local_sgd.json")
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "LOCAL_SGD.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "local_sgd.png")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    budget_json = args.json.with_name(args.json.stem + "_budget.json")
    horizon_json = args.json.with_name(args.json.stem + "_horizon.json")
    if not args.from_json:
        if "same" in args.jobs:
            launch(args, args.runs, 1, args.json)
        if "budget" in args.jobs and args.append:
            extra = budget_json.with_name(budget_json.stem + "_extra.json")
            launch(args, args.budget_runs, args.budget_factor, extra)
            merge(budget_json, extra)
        elif "budget" in args.jobs:
            launch(args, args.budget_runs, args.budget_factor, budget_json)
        if "horizon" in args.jobs:
            launch_horizon(args, horizon_json)
    payload = json.loads(args.json.read_text())
    same = analyse(payload)
    budget = analyse(json.loads(budget_json.read_text())) if budget_json.exists() else None
    horizon = json.loads(horizon_json.read_text()) if horizon_json.exists() else None
    plot(same, budget, args.png)
    write_doc(same, budget, payload, args.md, args.png, horizon)
    print("\n".join(table(same) + [""] + (table(budget) + [""] if budget else [])
                    + (horizon_table(horizon) + [""] if horizon else [])
                    + goals(same, budget, horizon)))
    print(f"wrote {args.md} and {args.png}")


if __name__ == "__main__":
    main()
