"""CPU that Horovod's PyTorch wait (``hvd.synchronize``) takes while it waits, on 2 ranks.

    horovodrun --gloo -np 2 -H localhost:2 python studies/wait_cpu.py

1. One allreduce that rank 1 joins 50 ms late: rank 0's wall time in ``synchronize`` against
   the CPU its thread used meanwhile (equal when the wait is a busy loop).
2. The 300-tensor step of benchmarks/small_tensors.py with ``none``, ``floor`` and
   ``gqsgd8``: the model thread's CPU a step in all, and inside Horovod's wait
   (``mpi_lib.horovod_torch_wait_and_clear``, which both Horovod's optimizer and
   GlobalQSGD's waits end in), mean of two interleaved runs each.

With 2 ranks on 2 cores, CPU that a waiting rank burns is CPU its peer and Horovod's
background threads do not get.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import small_tensors  # noqa: E402  (its 300-tensor model, step and compressors)

WAITED = {"cpu": 0.0}


def _counting(wait):
    def counted(handle):
        start = time.thread_time()
        try:
            return wait(handle)
        finally:
            WAITED["cpu"] += time.thread_time() - start
    return counted


def late_peer(repeats: int = 5) -> list[tuple[float, float]]:
    out = []
    for _ in range(repeats):
        hvd.allreduce(torch.zeros(1), name="wait_cpu.sync")
        if hvd.rank() == 1:
            time.sleep(0.05)
        cpu, wall = time.thread_time(), time.perf_counter()
        hvd.synchronize(hvd.allreduce_async(torch.zeros(4), name="wait_cpu.late"))
        out.append((time.perf_counter() - wall, time.thread_time() - cpu))
    return out


def step_cpu(name: str, steps: int = 50, warmup: int = 10) -> tuple[float, float]:
    step = small_tensors.training_step(small_tensors.make_compressor(name))
    total = waited = 0.0
    for i in range(warmup + steps):
        hvd.allreduce(torch.zeros(1), name="wait_cpu.step")
        WAITED["cpu"], start = 0.0, time.thread_time()
        step()
        if i >= warmup:
            total += time.thread_time() - start
            waited += WAITED["cpu"]
    return total / steps, waited / steps


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    late = late_peer()
    mpi_ops.mpi_lib.horovod_torch_wait_and_clear = _counting(
        mpi_ops.mpi_lib.horovod_torch_wait_and_clear)
    names = ["none", "floor", "gqsgd8"]
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _ in range(2):
        for name in names:
            runs[name].append(step_cpu(name))
    if hvd.rank() == 0:
        wall, cpu = (statistics.median(v) for v in zip(*late))
        print(f"one wait, peer 50 ms late: {1e3 * wall:.1f} ms wall, {1e3 * cpu:.1f} ms of "
              "the waiting thread's CPU")
        for name, values in runs.items():
            total, waited = (statistics.mean(v) for v in zip(*values))
            print(f"300 tensors, {name}: model thread {1e3 * total:.2f} ms of CPU a step, "
                  f"{1e3 * waited:.2f} ms of it inside Horovod's wait")
            print(json.dumps({"what": "wait_cpu", "compressor": name, "thread_cpu_s": total,
                              "in_wait_cpu_s": waited}))
        print(json.dumps({"what": "wait_cpu_late_peer", "wall_s": wall, "cpu_s": cpu}))


if __name__ == "__main__":
    main()
