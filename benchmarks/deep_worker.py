"""One rank of the deep-model benchmark (benchmarks/deep_bench.py launches it on emulated
hosts; issue 26).

A deep MLP, ``--depth`` layers of ``Linear(width, width)`` + Tanh (16 x 1024: 32 tensors, 64 MB
of fp32 gradient), trained with ``hvd.DistributedOptimizer`` and each compressor in turn.  Its
backward produces gradients layer by layer, so a compressor that starts sending from
``compress`` (GlobalQSGD's default ``bucket_bytes``) can overlap the codes with the rest of
backward, as Horovod's own fp16 does.  ``compute`` is the same step with the plain optimizer
and no Horovod at all: the floor no compressor can beat.  Rank 0 prints one JSON line per
variant: the median step time of the slowest rank, the held-out loss before and after,
GlobalQSGD's own timers, and the CPU each step took, split between the thread that runs the
model (with GlobalQSGD's kernels) and the process's other threads (Horovod's background
thread, which busy-polls in MPI while bytes are in flight), averaged over the ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import horovod.torch as hvd
import torch

from gqsgd_lab.bench_common import compressor, cpu_split, deep_args, thread_cpu_s


def model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def run(name: str, args: argparse.Namespace) -> dict:
    net = model(args.width, args.depth)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    base = torch.optim.SGD(net.parameters(), lr=args.lr)
    comp = None if name == "compute" else compressor(name, hvd)
    opt = base if comp is None else hvd.DistributedOptimizer(
        base, named_parameters=net.named_parameters(), compression=comp)
    gen = torch.Generator().manual_seed(hvd.rank())
    held_out = torch.randn(64, args.width, generator=torch.Generator().manual_seed(12345))

    def target(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x.roll(1, dims=1))

    def held_out_loss() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(net(held_out), target(held_out)))

    loss_start, times, after_warmup = held_out_loss(), [], {}
    cpu: dict[str, float] = {"main_cpu_s": 0.0, "other_cpu_s": 0.0, "mean_s": 0.0}
    for i in range(args.steps + 1):
        x = torch.randn(args.batch, args.width, generator=gen)
        hvd.allreduce(torch.zeros(1), name="barrier")
        before = thread_cpu_s()
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), target(x)).backward()
        opt.step()
        if i:  # the first step warms up (numba compilation, buffers, response cache)
            times.append(time.perf_counter() - start)
            split = cpu_split(before, thread_cpu_s(), threading.get_native_id(), args.steps)
            split["mean_s"] = times[-1] / args.steps
            cpu = {k: cpu[k] + v for k, v in split.items()}
        elif comp is not None and hasattr(comp, "stats"):
            after_warmup = comp.stats.as_dict()
    slowest = hvd.allreduce(torch.tensor(statistics.median(times)), op=hvd.Max,
                            name=f"t.{name}")
    # CPU per step of the thread that runs the model and of all others (Horovod's background
    # thread), and the mean step they add up to, averaged over the ranks
    cpu = {k: float(hvd.allreduce(torch.tensor(v), name=f"c.{name}.{k}"))
           for k, v in cpu.items()}
    row = {"what": f"deep_{name}", "median_s": float(slowest), **cpu, "loss_start": loss_start,
           "loss_end": held_out_loss(), "ranks": hvd.size(),
           "grad_mb": sum(p.numel() * 4 for p in net.parameters()) / 2**20,
           "tensors": len(list(net.parameters()))}
    if after_warmup:  # GlobalQSGD's timers per step, warm-up excluded
        now = comp.stats.as_dict()
        rounds = now["rounds"] - after_warmup["rounds"]
        row.update({k: (now[f"total_{k}"] - after_warmup[f"total_{k}"]) / rounds
                    for k in ("payload", "quantize_s", "scale_wait_s", "codes_wait_s")})
    return row


def main() -> None:
    args = deep_args("compute,none,fp16,gqsgd8,gqsgd8b0k")
    hvd.init()
    torch.set_num_threads(1)
    for name in args.compressors.split(","):
        row = run(name, args)
        if hvd.rank() == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
