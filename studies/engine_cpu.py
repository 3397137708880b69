"""GlobalQSGD's own CPU a round, under DistributedOptimizer's call pattern (every gradient's
``compress``, then every ``decompress``), with Horovod left out: one rank, the PyTorch
backend's local half (:class:`hvd_gqsgd.torch_ops.TorchLocal`, the numba kernels) and
collectives that hand back their input at once (gqsgd_lab/one_rank.py).  So the figures are
the engine's and the backend's work alone, which no wire hides on the 300-tensor shape
(benchmarks/small_tensors.py), without the noise of Horovod's waits.

    python studies/engine_cpu.py
    PYTHONPATH=/path/to/other/checkout python studies/engine_cpu.py   # another version

Two models: 150 ``Linear(32, 32)`` (300 tensors, 1.2 MB, one bucket) and 16
``Linear(1024, 1024)`` (32 tensors, 64 MB, 8 MiB buckets).  Prints the median milliseconds
a round of each, and per tensor, over interleaved repeats, then one JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # one thread, as with 2 ranks on 2 cores

import torch  # noqa: E402

import hvd_gqsgd  # noqa: E402
from gqsgd_lab.one_rank import Local, gradients, split_round  # noqa: E402
from hvd_gqsgd import core  # noqa: E402
from hvd_gqsgd.engine import Engine  # noqa: E402

MODELS = {"300 tensors": (32, 150), "deep 16x1024": (1024, 16)}


def one_round(engine: Engine, grads: list[torch.Tensor]) -> float:
    return sum(split_round(engine, grads))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {}
    for name, (width, depth) in MODELS.items():
        engine = Engine(Local(seed=0), core.Settings(bits=8), None, uid=0)
        grads = gradients(width, depth)
        for _ in range(5):  # compile the kernels, fill the caches
            one_round(engine, grads)
        cases[name] = (engine, grads, 200 if depth > 100 else 10)
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # models take turns: a slow spell hits both
        for name, (engine, grads, rounds) in cases.items():
            medians[name].append(statistics.median(one_round(engine, grads)
                                                   for _ in range(rounds)))
    print(f"hvd_gqsgd from {os.path.dirname(hvd_gqsgd.__file__)}")
    for name, values in medians.items():
        tensors = len(cases[name][1])
        s = statistics.median(values)
        print(f"{name}: {1e3 * s:.3f} ms a round, {1e6 * s / tensors:.1f} us a tensor")
        print(json.dumps({"what": "engine_cpu", "model": name, "round_s": s,
                          "tensors": tensors}), flush=True)


if __name__ == "__main__":
    main()
