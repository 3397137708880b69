"""Goal 3 of the performance issue: single-rank, single-thread CPU cost of
compress + allreduce + decompress of a 64 MB fp32 gradient, in units of one torch.add pass
over the same tensor, measured in the same process.

    python benchmarks/cpu_cost.py                        # fused numba kernels
    HVD_GQSGD_KERNELS=0 python benchmarks/cpu_cost.py    # generic torch-op path

Goal: <= 4 passes (the naive fp32 torch version costs about 14).
"""

from __future__ import annotations

import argparse
import statistics
import time

import horovod.torch as hvd
import torch

from hvd_gqsgd import GlobalQSGD, kernels


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (and numba compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bits", type=int, default=8)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if kernels.available():
        kernels.numba.set_num_threads(1)
    n = args.mb * 2**20 // 4
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    comp = GlobalQSGD(bits=args.bits)
    chunked = GlobalQSGD(bits=args.bits, chunk_bytes=1 << 20)
    t_add = median_time(lambda: torch.add(x, y, out=out), args.repeats)
    t_none = median_time(lambda: hvd.allreduce(x, name="none"), args.repeats)
    t_gq = median_time(lambda: hvd.allreduce(x, compression=comp, name="gq"), args.repeats)
    t_chunk = median_time(lambda: hvd.allreduce(x, compression=chunked, name="gqc"),
                          args.repeats)
    path = "fused numba kernels" if kernels.available() else "generic torch ops"
    print(f"{args.mb} MB fp32, 1 rank, 1 thread, {path}: torch.add {1e3 * t_add:.1f} ms, "
          f"allreduce(none) {1e3 * t_none:.1f} ms ({t_none / t_add:.2f} passes), "
          f"GlobalQSGD({args.bits}) {1e3 * t_gq:.1f} ms ({t_gq / t_add:.2f} passes; goal <= 4), "
          f"with chunk_bytes=1 MiB {1e3 * t_chunk:.1f} ms ({t_chunk / t_add:.2f} passes)")


if __name__ == "__main__":
    main()
