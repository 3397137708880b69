"""Framework-free pieces shared by the benchmark workers (torch and TF).

Nothing here imports a framework or a ``horovod.<framework>`` module: a TF worker must never
import ``horovod.torch`` (NOTES: the import-order trap), so each worker passes its own
``hvd`` module in.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from hvd_gqsgd import GlobalQSGD, QSGDAllgather

GQSGD_NAME = re.compile(r"gqsgd(\d+)(ts|flat)?(?:@(\d+)k)?(?:b(\d+)k)?(rot|norot)?")
ROTATION = {"rot": "hadamard", "norot": None}
TWO_STAGE = {"ts": True, "flat": False, None: None}


def compressor(name: str, hvd: Any, process_set: Any = None) -> Any:
    """``none``, ``fp16``, ``qsgd<bits>`` or ``gqsgd<bits>[ts|flat][@<chunk KiB>k][b<bucket
    KiB>k][rot|norot]`` (``ts``: ``two_stage=True``, ``flat``: ``False``, neither: the
    default, chosen by world size; ``b0k``: ``bucket_bytes=0``, one bucket per step; no
    ``b``: the default; ``rot``: ``rotation="hadamard"``, ``norot``: ``None``, neither: the
    default, on at 4 bits and fewer)."""
    m = GQSGD_NAME.fullmatch(name)
    if m:
        extra = {} if m.group(3) is None else {"chunk_bytes": int(m.group(3)) * 1024}
        if m.group(4) is not None:
            extra["bucket_bytes"] = int(m.group(4)) * 1024
        if m.group(5) is not None:
            extra["rotation"] = ROTATION[m.group(5)]
        return GlobalQSGD(bits=int(m.group(1)), process_set=process_set,
                          two_stage=TWO_STAGE[m.group(2)], **extra)
    if name.startswith("qsgd"):  # the per-rank-scale baseline over an allgather
        return QSGDAllgather(bits=int(name[4:]))
    return {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[name]


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) each thread of this process has used, by native thread
    id, from ``/proc/self/task`` (Linux).  On the emulated hosts each rank has one core, so
    this splits a step between the thread that runs the model (and GlobalQSGD's kernels)
    and Horovod's background thread, whose MPI wait busy-polls while bytes are in flight.
    A thread that ends between two readings drops out of the second, with its CPU."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_split(before: dict[int, float], after: dict[int, float], main: int, steps: int
              ) -> dict[str, float]:
    """Per step: CPU seconds of thread ``main`` and of all other threads together, between
    two :func:`thread_cpu_s` readings."""
    used = {t: v - before.get(t, 0.0) for t, v in after.items()}
    return {"main_cpu_s": used.get(main, 0.0) / steps,
            "other_cpu_s": sum(v for t, v in used.items() if t != main) / steps}


def hvd_size_from_env() -> int:
    """World size before hvd.init (process sets must be declared at init): mpirun's or
    horovodrun's variable."""
    for var in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError("run under mpirun or horovodrun: no world size in the environment")


def allreduce_args() -> argparse.Namespace:
    """Command line of the allreduce workers (allreduce_worker[_tf].py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compressors", default="none,fp16,gqsgd8")
    parser.add_argument("--compute-width", type=int, default=0,
                        help="also time train_worker.py's step at this width without any "
                        "allreduce (what examples/demo.py's prediction adds to the model's)")
    return parser.parse_args()


def train_args() -> argparse.Namespace:
    """Command line of the training workers (train_worker[_tf].py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)  # 2 x 2048 x 4096 ~ 64 MB fp32
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compressors", default="none,fp16,gqsgd8")
    return parser.parse_args()


def deep_args(compressors: str) -> argparse.Namespace:
    """Command line of the deep-model workers (deep_worker[_tf].py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--compressors", default=compressors)
    return parser.parse_args()


def machine_stamp(load_start: float, seconds: float, load_end: float | None = None,
                  date: str | None = None) -> str:
    """The line a generated page states once at its top: the date, this machine (processor,
    cores, memory) and the 1-minute load average at the run's start and end, so a reader can
    tell a quiet run from one that shared the cores.  ``load_end`` and
    ``date``: now's, unless given."""
    import platform
    import time

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() \
            if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (f"Measured {date or time.strftime('%Y-%m-%d')} on {cpu}, {os.cpu_count()} cores, "
            f"{mem:.0f} GiB; load average {load_start:.1f} at the start and "
            f"{os.getloadavg()[0] if load_end is None else load_end:.1f} at the end of a "
            f"{seconds / 60:.0f}-minute run.")


def write_section(path: Path, name: str, lines: list[str], title: str = "") -> None:
    """Replace the block between ``<!-- name begin -->`` and ``<!-- name end -->`` in the
    markdown file ``path`` by ``lines`` (appended, after ``title`` for a new file, when the
    markers are missing); the rest of the file is kept, so each benchmark command rewrites
    only its own section."""
    begin, end = f"<!-- {name} begin -->", f"<!-- {name} end -->"
    text = path.read_text() if path.exists() else (f"{title}\n\n" if title else "")
    if begin not in text:
        text = text.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1])


def gloo_job(net: Any, command: list[str], what: str, timeout: float) -> list[dict]:
    """COLLECTIVE across emulated hosts: ``command`` (a torch.distributed worker over Gloo,
    one rank per host, under mpirun) with its rendezvous at host 0; the JSON lines rank 0
    printed.  ``what`` names the job in the error if it fails."""
    import json

    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MASTER_ADDR": net.addresses[0],
           "MASTER_PORT": "29500",
           "GLOO_SOCKET_IFNAME": "eth0"}  # else Gloo binds to the hostname's 127.0.0.1
    proc = net.mpirun(command, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} job failed on {net.n} hosts:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
