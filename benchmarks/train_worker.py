"""One rank of the end-to-end benchmark (benchmarks/netbench.py launches it on emulated hosts).

A communication-bound training step: an MLP whose gradient (about 64 MB fp32) is large next to
its compute on a small batch, trained with ``hvd.DistributedOptimizer`` and each compressor in
turn.  Rank 0 prints one JSON line per compressor: the median step time of the slowest rank,
and the loss on a fixed held-out batch before and after the steps (all compressors start from
the same weights and see the same data).  The learning rate is large enough that the steps
lower that loss by about 5%, so a compressor that broke training would show.
"""

from __future__ import annotations

import json
import statistics
import time

import horovod.torch as hvd
import torch

from gqsgd_lab.bench_common import compressor, train_args


def model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                               torch.nn.Linear(2 * width, width))


def run(name: str, width: int, batch: int, steps: int) -> dict:
    net = model(width)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5),
                                   named_parameters=net.named_parameters(),
                                   compression=compressor(name, hvd))
    gen = torch.Generator().manual_seed(hvd.rank())
    target = torch.nn.Linear(width, width)
    held_out = torch.randn(64, width, generator=torch.Generator().manual_seed(12345))
    with torch.no_grad():
        held_target = torch.tanh(target(held_out))

    def held_out_loss() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(net(held_out), held_target))

    loss_start, times = held_out_loss(), []
    for i in range(steps + 1):
        x = torch.randn(batch, width, generator=gen)
        with torch.no_grad():
            y = torch.tanh(target(x))
        hvd.allreduce(torch.zeros(1), name="barrier")
        start = time.perf_counter()
        opt.zero_grad()
        out = torch.nn.functional.mse_loss(net(x), y)
        out.backward()
        opt.step()
        if i:  # the first step warms up (numba compilation, buffers, response cache)
            times.append(time.perf_counter() - start)
    slowest = hvd.allreduce(torch.tensor(statistics.median(times)), op=hvd.Max,
                            name=f"t.{name}")
    grad_mb = sum(p.numel() * 4 for p in net.parameters()) / 2**20
    return {"what": f"train_{name}", "median_s": float(slowest),
            "loss_start": loss_start, "loss_end": held_out_loss(),
            "grad_mb": grad_mb, "ranks": hvd.size()}


def main() -> None:
    args = train_args()
    hvd.init()
    torch.set_num_threads(1)
    for name in args.compressors.split(","):
        row = run(name, args.width, args.batch, args.steps)
        if hvd.rank() == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
