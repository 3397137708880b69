"""`make demo`: the digits comparison of examples/torch_digits.py, plus what the byte saving
buys on a real link, in the same table.

    python examples/demo.py [--link auto|emulated|predicted] [--np 2]

1. ``horovodrun --gloo`` runs examples/torch_digits.py (fp32 against GlobalQSGD(8), 2 ranks
   on this machine, loopback).  Its wall times show the quantizer's CPU cost, since
   loopback bandwidth is free.
2. A step time on a link that is not free, for one training step of
   benchmarks/train_worker.py (an MLP with a 64 MB fp32 gradient, batch 32 per rank):

   * ``emulated`` (root, network namespaces and tc: gqsgd_lab/emulated_hosts.py): measured
     on 2 emulated hosts whose links are limited to 1 Gbit/s, as ``make bench`` does;
   * ``predicted`` (anyone): predicted for 2 hosts at 1 and 10 Gbit/s by the performance
     model of benchmarks/netbench.py, from costs measured here on loopback
     (benchmarks/allreduce_worker.py: latency, the quantizer's local cost, the step's
     compute): ``step = compute + t_allreduce``, with no overlap of the two;
   * ``auto`` (default): emulated where namespaces can be made, else predicted, saying why.

Only the fp32 and GlobalQSGD rows of ``--variants`` get step times; the others show ``-``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # netbench.py's performance model
from gqsgd_lab.emulated_hosts import EmulatedHosts  # noqa: E402

BIN = Path(sys.executable).parent
WIDTH = 2048  # train_worker.py's default: 2 x 2048 x 4096 weights, 64 MB of fp32 gradient
RATES = {"1gbit": 1e9, "10gbit": 1e10}
GBIT = {"1gbit": "1", "10gbit": "10"}  # tc's rate names -> Gbit/s, for the table
TIMEOUT_S = 600


def grad_mb(width: int = WIDTH) -> float:
    """MiB of fp32 gradient of train_worker.model(width)."""
    return (2 * width * 2 * width + 3 * width) * 4 / 2**20


def worker_name(spec: str) -> str | None:
    """The benchmarks' name of a torch_digits compressor spec: ``none``, ``fp16``,
    ``gq<bits>`` -> ``gqsgd<bits>``; None for specs with options or local SGD."""
    if spec in ("none", "fp16"):
        return spec
    if spec.startswith("gq") and spec[2:].isdigit():
        return f"gqsgd{spec[2:]}"
    return None


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": str(ROOT)}


def train_digits(np_: int, out: Path, extra: list[str]) -> dict:
    """Step 1: torch_digits.py under horovodrun; its progress lines stream through, its
    results come back through --json."""
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
           sys.executable, str(ROOT / "examples" / "torch_digits.py"), "--no-report",
           "--json", str(out), *extra]
    subprocess.run(cmd, env=env(), check=True, timeout=TIMEOUT_S)
    return json.loads(out.read_text())


def json_rows(stdout: str) -> dict[str, float]:
    return {r["what"]: r["median_s"] for r in
            (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}


def measure_emulated(names: list[str], steps: int) -> dict[str, float]:
    """Step 2, emulated: median step time of the slowest rank per worker name, 2 hosts at
    1 Gbit/s (raises PermissionError / CalledProcessError where namespaces cannot be made)."""
    with EmulatedHosts(2, rate="1gbit") as hosts:
        proc = hosts.mpirun([sys.executable, str(ROOT / "benchmarks" / "train_worker.py"),
                             "--compressors", ",".join(names), "--steps", str(steps)],
                            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"train_worker.py on emulated hosts failed:\n{proc.stdout[-3000:]}"
                           f"\n{proc.stderr[-3000:]}")
    rows = json_rows(proc.stdout)
    return {name: rows[f"train_{name}"] for name in names}


def measure_costs(names: list[str], np_: int) -> dict[str, float]:
    """Step 2, predicted: the model's inputs, measured on loopback with np_ ranks."""
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
           sys.executable, str(ROOT / "benchmarks" / "allreduce_worker.py"),
           "--mb", f"{grad_mb():.4f}", "--repeats", "3", "--compressors", ",".join(names),
           "--compute-width", str(WIDTH)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"allreduce_worker.py failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return json_rows(proc.stdout.replace("[0]<stdout>:", ""))


def predict_steps(costs: dict[str, float], names: list[str]) -> dict[str, dict[str, float]]:
    """rate -> worker name -> predicted step time on 2 hosts (netbench.predict, plus the
    step's compute)."""
    import netbench

    return {rate: {name: costs["compute"] + netbench.predict(costs, 2, bps, grad_mb(), name)
                   for name in names} for rate, bps in RATES.items()}


def link_columns(runs: list[dict], steps: dict[str, dict[str, float]], predicted: bool
                 ) -> tuple:
    """Adds each rate's step time to the runs it applies to; returns print_table columns."""
    columns = []
    for rate, by_name in steps.items():
        key = f"step_{rate}"
        for run in runs:
            run[key] = by_name.get(worker_name(run["spec"]) or "", float("nan"))
        header = f"{GBIT[rate]}G step{'*' if predicted else ''}"
        columns.append((header, key, ".3f", 12, ""))
    return tuple(columns)


def footer(runs: list[dict], steps: dict[str, dict[str, float]], predicted: bool) -> list[str]:
    base = next((r for r in runs if r["spec"] == "none"), None)
    lines = ["", "Wall s is loopback on one machine: bandwidth is free there, so it shows only "
             "the quantizer's CPU cost."]
    what = (f"one training step of an MLP with a {grad_mb():.0f} MB fp32 gradient "
            "(benchmarks/train_worker.py, batch 32 per rank)")
    if predicted:
        lines.append(f"* PREDICTED, not measured: {what} on 2 hosts at 1 and 10 Gbit/s, by the "
                     "model of benchmarks/netbench.py from costs measured here; as root, "
                     "make demo measures it on emulated hosts.")
    else:
        lines.append(f"1G step: {what}, measured on 2 emulated hosts with 1 Gbit/s links "
                     "(network namespaces + tc, gqsgd_lab/emulated_hosts.py).")
    for run in runs:
        if base is None or run is base or worker_name(run["spec"]) is None:
            continue
        for rate in steps:
            ratio = base[f"step_{rate}"] / run[f"step_{rate}"]
            faster = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
            lines.append(f"{run['label']} step at {GBIT[rate]} Gbit/s: {faster} than fp32"
                         + (" (predicted)." if predicted else "."))
    return lines


def link_steps(link: str, names: list[str], np_: int, steps: int
               ) -> tuple[dict[str, dict[str, float]], bool]:
    """Step 2: (rate -> worker name -> step time, whether predicted).  ``auto`` measures on
    emulated hosts where they can be made and says why it predicts where not."""
    if link in ("auto", "emulated"):
        try:
            return {"1gbit": measure_emulated(names, steps)}, False
        except (PermissionError, subprocess.CalledProcessError) as exc:
            if link == "emulated":
                raise
            why = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else exc
            print(f"\nNo emulated hosts here ({why}); predicting step times instead.",
                  flush=True)
    return predict_steps(measure_costs(names, np_), names), True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", choices=("auto", "emulated", "predicted"), default="auto")
    parser.add_argument("--np", type=int, default=2, help="ranks of the digits run")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps on emulated hosts (after one warm-up step)")
    args, extra = parser.parse_known_args()
    sys.path.insert(0, str(ROOT / "examples"))
    import torch_digits  # imports horovod.torch; initialised only in the horovodrun job

    started, load = time.perf_counter(), os.getloadavg()[0]  # before any rank of ours runs
    with tempfile.TemporaryDirectory(prefix="gq-demo-") as tmp:
        result = train_digits(args.np, Path(tmp) / "digits.json", extra)
    digits_s = time.perf_counter() - started
    runs = result["runs"]
    names = list(dict.fromkeys(n for n in (worker_name(r["spec"]) for r in runs) if n))
    steps, predicted = link_steps(args.link, names, args.np, args.steps)
    settings = argparse.Namespace(**result["settings"])
    torch_digits.report(runs, settings, result["world_size"],
                        link_columns(runs, steps, predicted), footer(runs, steps, predicted))
    total_s = time.perf_counter() - started
    if load > (os.cpu_count() or 1) / 2:
        print(f"Other work was running (load average {load:.1f} on {os.cpu_count()} CPUs "
              "when the demo started): step times are slower than on an idle machine, the "
              "CPU-heavy GlobalQSGD rows most.")
    print(f"Took {total_s:.0f} s: the digits job {digits_s:.0f} s, the "
          f"{'cost measurements' if predicted else 'emulated hosts'} {total_s - digits_s:.0f} s.")


if __name__ == "__main__":
    main()
