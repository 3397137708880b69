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
import signal
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
TITLE = """# Memory

What one round adds to a rank's resident memory over the same entry point's uncompressed
round, from `python benchmarks/memory.py` (see its docstring for how it is measured).  The
torch-ops path is what CUDA tensors run: it works chunk by chunk
(`hvd_gqsgd/torch_generic.py`), so what it adds is the packed words plus one chunk's
temporaries, and issue 42's goal (at most 0.5x the gradient) is read on its rows.  On the
fused CPU path the decoded gradients come from `kernels.host_array`'s pool, which keeps up to
256 MiB of buffers per size between rounds: a round there adds little, less than the
uncompressed round whose output is new memory, because the pool already holds it."""


def launch(entry: str, sizes: list[int], kernels: bool, ranks: int = 2,
           timeout: float = 3600) -> list[dict]:
    """One 2-rank job measuring both variants at every size; its rank-0 JSON lines.  A job
    still running after ``timeout`` seconds is killed (its whole process group), and the
    error carries what it printed until then."""
    bin_dir = Path(sys.executable).parent
    script = [sys.executable, str(WORKER), "--entry", entry, "--mb",
              ",".join(str(m) for m in sizes)]
    if entry.startswith("hvd"):
        cmd = [str(bin_dir / "horovodrun"), "--gloo", "-np", str(ranks), "-H",
               f"localhost:{ranks}", *script]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(ranks), "--master_port",
               "29517", *script[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HVD_GQSGD_KERNELS": "1" if kernels else "0"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"{entry} ran past {timeout:.0f} s and was killed; its output:\n"
                           f"{out[-3000:]}\n{err[-3000:]}") from None
    rows = [json.loads(ln[ln.index("{"):]) for ln in out.splitlines() if "added_bytes" in ln]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{entry} failed:\n{out[-3000:]}\n{err[-3000:]}")
    return rows


def measure(sizes: list[int], entries: list[str], paths: list[bool],
            timeout: float = 3600) -> list[dict]:
    """Per (entry, path, size): the added bytes of both variants and their difference in
    gradient fp32 bytes; with two sizes, also the slope: what each further MB of gradient
    adds (what grows with the model, the per-chunk part cancelling out)."""
    out = []
    for entry in entries:
        for kernels in paths:
            got = {(r["variant"], r["mb"]): r["added_bytes"] for r in
                   launch(entry, sizes, kernels, timeout=timeout)}
            for mb in sizes:
                extra = got[("gqsgd8", mb)] - got[("none", mb)]
                row = {"entry": entry, "kernels": kernels, "mb": mb,
                       "none": got[("none", mb)], "gqsgd8": got[("gqsgd8", mb)],
                       "ratio": extra / (mb * 2**20)}
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def slope(rows: list[dict], entry: str, kernels: bool) -> float:
    """Extra bytes per gradient byte between the smallest and the largest size."""
    mine = sorted((r for r in rows if r["entry"] == entry and r["kernels"] == kernels),
                  key=lambda r: r["mb"])
    lo, hi = mine[0], mine[-1]
    extra = (hi["gqsgd8"] - hi["none"]) - (lo["gqsgd8"] - lo["none"])
    return extra / ((hi["mb"] - lo["mb"]) * 2**20)


def table(rows: list[dict]) -> list[str]:
    lines = ["| entry | path | gradient MB | uncompressed round adds (MB) | "
             "GlobalQSGD(8) round adds (MB) | difference, in gradient bytes | goal |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        path = "fused kernels (CPU)" if r["kernels"] else "torch ops (what CUDA runs)"
        goal = "-" if r["kernels"] else ("met" if r["ratio"] <= GOAL else "not met")
        lines.append(f"| {LABELS[r['entry']]} | {path} | {r['mb']} | {r['none'] / 2**20:.0f} | "
                     f"{r['gqsgd8'] / 2**20:.0f} | {r['ratio']:+.2f}x | {goal} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="256", help="gradient sizes in MB, e.g. 64,256")
    parser.add_argument("--entries", default=",".join(ENTRIES))
    parser.add_argument("--paths", default="torch,fused")
    parser.add_argument("--out", default=str(ROOT / "docs" / "MEMORY.md"))
    args = parser.parse_args()
    paths = [p == "fused" for p in args.paths.split(",")]
    sizes = [int(m) for m in args.mb.split(",")]
    rows = measure(sizes, args.entries.split(","), paths)
    lines = [f"`python benchmarks/memory.py --mb {args.mb}`, {time.strftime('%Y-%m-%d')}, "
             f"{platform.machine()}: fp32 gradients of {args.mb} MB (one `Linear` weight), "
             f"2 ranks on one machine, Gloo; goal: at most {GOAL}x on the torch-ops path.",
             "", *table(rows)]
    write_section(Path(args.out), "memory", lines, TITLE)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
