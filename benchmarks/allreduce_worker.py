"""One rank of the bandwidth benchmark (benchmarks/netbench.py launches it on emulated hosts).

Times ``hvd.allreduce`` of one fp32 gradient, default op (Average), per compressor, and two
inputs of the performance model: ``latency`` (a 1-element allreduce) and ``local`` (the same
GlobalQSGD allreduce on a process set of this rank alone: quantization and Horovod overhead,
no network).  With ``--compute-width W`` also ``compute``: train_worker.py's step at width W
(forward, backward, SGD update) with no allreduce.  Rank 0 prints one JSON line per
measurement: the median over repeats of the slowest rank.
"""

from __future__ import annotations

import json
import statistics
import time

import horovod.torch as hvd
import torch
import train_worker

from gqsgd_lab.bench_common import allreduce_args, compressor, hvd_size_from_env


def timed(fn, repeats: int, name: str) -> float:
    times = []
    for i in range(repeats + 1):
        hvd.allreduce(torch.zeros(1), name="barrier")
        start = time.perf_counter()
        fn()
        if i:  # the first run warms up (numba compilation, buffers, response cache)
            times.append(time.perf_counter() - start)
    slowest = hvd.allreduce(torch.tensor(statistics.median(times)), op=hvd.Max, name=f"t.{name}")
    return float(slowest)


def compute_step(width: int, batch: int = 32):
    """train_worker.py's step (same model and batch) without Horovod: what a step costs
    when the allreduce is free."""
    net = train_worker.model(width)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x, y = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return step


def main() -> None:
    args = allreduce_args()
    alone = [hvd.ProcessSet([r]) for r in range(hvd_size_from_env())]
    hvd.init(process_sets=alone)
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    x = torch.randn(int(args.mb * 2**20) // 4)
    rows = {"latency": timed(lambda: hvd.allreduce(torch.zeros(1), name="lat"),
                             args.repeats, "latency")}
    for name in args.compressors.split(","):
        comp = compressor(name, hvd)
        rows[name] = timed(lambda c=comp, n=name: hvd.allreduce(x, compression=c, name=f"b.{n}"),
                           args.repeats, name)
        if name.startswith("gqsgd"):
            mine = alone[hvd.rank()]
            local = compressor(name, hvd, process_set=mine)
            rows[f"local_{name}"] = timed(
                lambda c=local, ps=mine: hvd.allreduce(x, compression=c, process_set=ps),
                args.repeats, f"local_{name}")
    if args.compute_width:
        rows["compute"] = timed(compute_step(args.compute_width), args.repeats, "compute")
    if hvd.rank() == 0:
        for name, seconds in rows.items():
            print(json.dumps({"what": name, "mb": args.mb, "ranks": hvd.size(),
                              "median_s": seconds}), flush=True)


if __name__ == "__main__":
    main()
