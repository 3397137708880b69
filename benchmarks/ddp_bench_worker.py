"""One rank of benchmarks/ddp_bench.py: a communication-bound training step under PyTorch DDP
with each communication hook in turn (``--mode ddp``), or under Horovod's
``DistributedOptimizer`` (``--mode horovod``) for comparison.

The model and task are train_worker.py's: an MLP with about 64 MB of fp32 gradient (several
25 MB DDP buckets) on a small batch, regression onto ``tanh`` of a fixed random linear map,
SGD at lr 0.5 so that the steps lower the held-out loss visibly.  Every variant starts from the
same weights and sees the same batches.  Rank 0 prints one JSON line per variant: the median
step time of the slowest rank over the timed steps (after ``--warmup`` untimed steps, which
also cover PowerSGD's plain-allreduce warm-up), and the held-out loss before and after.

Ranks and rendezvous come from mpirun (OMPI_COMM_WORLD_*) or torchrun (RANK, WORLD_SIZE), with
MASTER_ADDR/MASTER_PORT set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

VARIANTS = ("default", "fp16", "bf16", "powersgd1", "powersgd4", "gqsgd8", "gqsgd4")
HOROVOD_VARIANTS = ("hvd-none", "hvd-gqsgd8")


def model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                               torch.nn.Linear(2 * width, width))


def register(net: DDP, name: str) -> Any:
    """Install variant ``name``'s communication hook (``default``: DDP's own allreduce); the
    hook's state when it keeps stats (GlobalQSGD)."""
    if name in ("fp16", "bf16"):
        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[name]
        net.register_comm_hook(None, hook)
    elif name.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=int(name[8:]),
                                            start_powerSGD_iter=2)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name.startswith("gqsgd"):
        import hvd_gqsgd.ddp as hook_module
        import hvd_gqsgd.torch_dist as transport

        m = re.fullmatch(r"gqsgd(\d+)(ts|flat)?(-rs)?", name)
        if m is None:
            raise ValueError(f"unknown variant {name!r}: gqsgd<bits>[ts|flat][-rs]")
        # -rs: the two-stage reduce-scatter as Gloo's reduce_scatter instead of all_to_all
        transport.GLOO_REDUCE_SCATTER = "reduce_scatter" if m.group(3) else "all_to_all"
        state = hook_module.GlobalQSGDState(
            bits=int(m.group(1)), two_stage={"ts": True, "flat": False, None: None}[m.group(2)])
        net.register_comm_hook(state, hook_module.global_qsgd_hook)
        return state
    elif name != "default":
        raise ValueError(f"unknown variant {name!r}: expected one of {VARIANTS}")
    return None


class Task:
    """Batches (different per rank, the same for every variant) and the held-out loss."""

    def __init__(self, width: int, batch: int, rank: int) -> None:
        torch.manual_seed(1)
        self.target = torch.nn.Linear(width, width)
        self.width, self.batch, self.rank = width, batch, rank
        held = torch.randn(64, width, generator=torch.Generator().manual_seed(12345))
        with torch.no_grad():
            self.held = (held, torch.tanh(self.target(held)))

    def batches(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.rank)

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(self.batch, self.width, generator=gen)
            with torch.no_grad():
                return x, torch.tanh(self.target(x))

        return next_batch

    def held_out_loss(self, net: torch.nn.Module) -> float:
        """Mean squared error in float64: in float32 the distances between variants after a
        few steps fall below one ulp of the loss (fp16's read as exactly 0)."""
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(net(self.held[0]).double(),
                                                      self.held[1].double()))


def timed_steps(net: torch.nn.Module, opt: torch.optim.Optimizer, task: Task, args,
                barrier: Callable[[], None]) -> list[float]:
    """Train ``warmup + steps`` steps; the seconds of the last ``steps``."""
    next_batch, times = task.batches(), []
    for i in range(args.warmup + args.steps):
        x, y = next_batch()
        barrier()
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def run_ddp(name: str, task: Task, args) -> dict:
    # powerSGD_hook issues collectives from Future.then callbacks, which on Gloo run on a
    # worker thread and race with the next bucket's hook: with several buckets the ranks
    # mismatch collectives ("Received data size doesn't match expected size", seen here).
    # One bucket leaves nothing to race with.
    one_bucket = {"bucket_cap_mb": 2 * args.width * args.width * 2 * 4 / 2**20 + 1}
    net = DDP(model(args.width), **(one_bucket if name.startswith("powersgd") else {}))
    state = register(net, name)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    loss_start = task.held_out_loss(net)
    times = timed_steps(net, opt, task, args, dist.barrier)
    slowest = torch.tensor(statistics.median(times))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    row = {"variant": name, "median_s": float(slowest), "loss_start": loss_start,
           "loss_end": task.held_out_loss(net)}
    if state is not None:  # where rank 0's last step went (see engine.Stats)
        row["stats"] = {k: v for k, v in state.stats.as_dict().items()
                        if k.startswith("last_") and k.endswith("_s")}
    return row


def run_horovod(name: str, task: Task, args) -> dict:
    import horovod.torch as hvd

    from gqsgd_lab.bench_common import compressor

    net = model(args.width)
    compression = compressor(name.removeprefix("hvd-"), hvd)  # hvd-none, hvd-gqsgd8ts, ...
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=args.lr),
                                   named_parameters=net.named_parameters(),
                                   compression=compression)
    loss_start = task.held_out_loss(net)
    times = timed_steps(net, opt, task, args,
                        lambda: hvd.allreduce(torch.zeros(1), name="barrier"))
    slowest = hvd.allreduce(torch.tensor(statistics.median(times)), op=hvd.Max, name=name)
    return {"variant": name, "median_s": float(slowest), "loss_start": loss_start,
            "loss_end": task.held_out_loss(net)}


def task_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The task's and the timing's options (this worker's and fsdp_bench_worker.py's),
    parsed."""
    parser.add_argument("--width", type=int, default=2048)  # 2 x 2048 x 4096 ~ 64 MB fp32
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    return parser.parse_args()


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the world size, under mpirun or torchrun."""
    env = os.environ
    return (int(env.get("OMPI_COMM_WORLD_RANK", env.get("RANK", "0"))),
            int(env.get("OMPI_COMM_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "horovod"), default="ddp")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = task_args(parser)
    rank, size = rank_and_size()
    torch.set_num_threads(1)
    task = Task(args.width, args.batch, rank)
    if args.mode == "horovod":
        import horovod.torch as hvd

        hvd.init()
        run = run_horovod
    else:
        dist.init_process_group("gloo", rank=rank, world_size=size)
        run = run_ddp
    for name in args.variants.split(","):
        row = {**run(name, task, args), "ranks": size, "mode": args.mode}
        if rank == 0:
            print(json.dumps(row), flush=True)
    if args.mode == "ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
