"""Goal 3 of the performance issue: single-rank, single-thread CPU cost of
compress + allreduce + decompress of a 64 MB fp32 gradient, in units of one torch.add pass
over the same tensor, measured in the same process.

    python benchmarks/cpu_cost.py                        # fused numba kernels
    HVD_GQSGD_KERNELS=0 python benchmarks/cpu_cost.py    # generic torch-op path

Goal: <= 4 passes (the naive fp32 torch version costs about 14).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

from hvd_gqsgd import GlobalQSGD, kernels


def median_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function.  The functions take turns within every repeat, so
    a slow spell of this shared machine hits the baseline and the candidates alike instead
    of skewing their ratio."""
    for fn in fns.values():
        fn()  # warm-up (and numba compilation)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--bits", type=int, default=8)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if kernels.available():
        kernels.numba.set_num_threads(1)
    n = args.mb * 2**20 // 4
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    variants = {  # label -> compressor; the first is the default configuration
        f"GlobalQSGD({args.bits})": GlobalQSGD(bits=args.bits),
        "with scale_block=0": GlobalQSGD(bits=args.bits, scale_block=0),
        "with chunk_bytes=1 MiB": GlobalQSGD(bits=args.bits, chunk_bytes=1 << 20),
    }
    fns = {"torch.add": lambda: torch.add(x, y, out=out),
           "allreduce(none)": lambda: hvd.allreduce(x, name="none")}
    for i, (label, comp) in enumerate(variants.items()):
        fns[label] = functools.partial(hvd.allreduce, x, compression=comp, name=f"gq{i}")
    t = median_times(fns, args.repeats)
    t_add = t.pop("torch.add")
    path = "fused numba kernels" if kernels.available() else "generic torch ops"
    default = next(iter(variants))
    figures = [f"{label} {1e3 * s:.1f} ms ({s / t_add:.2f} passes"
               f"{'; goal <= 4' if label == default else ''})" for label, s in t.items()]
    print(f"{args.mb} MB fp32, 1 rank, 1 thread, {path}: torch.add {1e3 * t_add:.1f} ms, "
          + ", ".join(figures))

if __name__ == "__main__":
    main()
