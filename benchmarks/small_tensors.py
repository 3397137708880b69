"""Goal 2 of the performance issue: step time of a 300-tensor model (150 Linear(32, 32)
layers) with DistributedOptimizer, GlobalQSGD(bits=8) vs uncompressed, on unthrottled loopback.

    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/small_tensors.py

Prints the median step time of each and their ratio (goal: <= 1.5x), then one JSON line
per compressor (``--compressors``: names as in benchmarks/bench_common.py, e.g.
``gqsgd8b0k`` for ``bucket_bytes=0``; benchmarks/deep_bench.py reads them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.torch as hvd
import torch
from bench_common import compressor


def step_times(compression, steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(150)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    x = torch.randn(16, 32)
    times = []
    for i in range(warmup + steps):
        hvd.allreduce(torch.zeros(1), name="sync")  # start every step together
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compressors", default="none,gqsgd8")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    names = args.compressors.split(",")
    results: dict[str, list[float]] = {}
    for _ in range(2):  # interleave to even out machine noise
        for name in names:
            results.setdefault(name, []).extend(
                step_times(compressor(name, hvd), args.steps, args.warmup))
    if hvd.rank() == 0:
        med = {k: statistics.median(v) for k, v in results.items()}
        for name in names[1:]:
            print(f"300 tensors, {hvd.size()} ranks: none {1e3 * med['none']:.2f} ms/step, "
                  f"{name} {1e3 * med[name]:.2f} ms/step, "
                  f"ratio {med[name] / med['none']:.2f}x (goal <= 1.5x)")
        for name in names:
            print(json.dumps({"what": f"small_{name}", "median_s": med[name],
                              "ranks": hvd.size()}), flush=True)


if __name__ == "__main__":
    main()
