"""One rank of the bandwidth benchmark (benchmarks/netbench.py launches it on emulated hosts).

Times ``hvd.allreduce`` of one fp32 gradient, default op (Average), per compressor, and two
inputs of the performance model: ``latency`` (a 1-element allreduce) and ``local`` (the same
GlobalQSGD allreduce on a process set of this rank alone: quantization and Horovod overhead,
no network).  Rank 0 prints one JSON line per measurement: the median over repeats of the
slowest rank.
"""

from __future__ import annotations

import json
import statistics
import time

import horovod.torch as hvd
import torch
from bench_common import allreduce_args, compressor, hvd_size_from_env


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
    if hvd.rank() == 0:
        for name, seconds in rows.items():
            print(json.dumps({"what": name, "mb": args.mb, "ranks": hvd.size(),
                              "median_s": seconds}), flush=True)


if __name__ == "__main__":
    main()
