"""One rank of the bandwidth benchmark (benchmarks/netbench.py launches it on emulated hosts).

Times ``hvd.allreduce`` of one fp32 gradient, default op (Average), per compressor, and two
inputs of the performance model: ``latency`` (a 1-element allreduce) and ``local`` (the same
GlobalQSGD allreduce on a process set of this rank alone: quantization and Horovod overhead,
no network).  Rank 0 prints one JSON line per measurement: the median over repeats of the
slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import horovod.torch as hvd
import torch

from hvd_gqsgd import GlobalQSGD, QSGDAllgather


def compressor(name: str, process_set=None):
    """``none``, ``fp16``, ``qsgd<bits>`` or ``gqsgd<bits>[@<chunk KiB>k]``."""
    m = re.fullmatch(r"gqsgd(\d+)(?:@(\d+)k)?", name)
    if m:
        chunk = {} if m.group(2) is None else {"chunk_bytes": int(m.group(2)) * 1024}
        return GlobalQSGD(bits=int(m.group(1)), process_set=process_set, **chunk)
    if name.startswith("qsgd"):  # the per-rank-scale baseline over an allgather
        return QSGDAllgather(bits=int(name[4:]))
    return {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[name]


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
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compressors", default="none,fp16,gqsgd8")
    args = parser.parse_args()
    alone = [hvd.ProcessSet([r]) for r in range(hvd_size_from_env())]
    hvd.init(process_sets=alone)
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    x = torch.randn(int(args.mb * 2**20) // 4)
    rows = {"latency": timed(lambda: hvd.allreduce(torch.zeros(1), name="lat"),
                             args.repeats, "latency")}
    for name in args.compressors.split(","):
        comp = compressor(name)
        rows[name] = timed(lambda c=comp, n=name: hvd.allreduce(x, compression=c, name=f"b.{n}"),
                           args.repeats, name)
        if name.startswith("gqsgd"):
            mine = alone[hvd.rank()]
            local = compressor(name, process_set=mine)
            rows[f"local_{name}"] = timed(
                lambda c=local, ps=mine: hvd.allreduce(x, compression=c, process_set=ps),
                args.repeats, f"local_{name}")
    if hvd.rank() == 0:
        for name, seconds in rows.items():
            print(json.dumps({"what": name, "mb": args.mb, "ranks": hvd.size(),
                              "median_s": seconds}), flush=True)


def hvd_size_from_env() -> int:
    """World size before hvd.init (process sets must be declared at init): mpirun's or
    horovodrun's variable."""
    for var in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE"):
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError("run under mpirun or horovodrun: no world size in the environment")


if __name__ == "__main__":
    main()
