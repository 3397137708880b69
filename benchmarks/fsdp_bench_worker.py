"""One rank of benchmarks/fsdp_bench.py: a communication-bound training step under FSDP2
(``fully_shard``, one module per layer plus the root) with each gradient reduce-scatter in
turn.

The model is ddp_bench_worker.py's MLP (2 x 2048 x 4096 weights: 64 MB of fp32 gradient) and
its task, with ``MixedPrecisionPolicy(param_dtype=bf16)``: the all-gathers carry bf16.  Each
variant starts from the same weights and sees the same batches.  Rank 0 prints one JSON line
per variant: the median step time of the slowest rank over the timed steps, the bytes one
rank hands its collectives per step, and the held-out loss before and after.

Variants (``[-rs]`` suffix: ``reshard_after_forward=True``, two all-gathers a step):

* ``fp32``: ``reduce_dtype=fp32``, FSDP2's own reduce-scatter (Gloo runs it as an
  all_reduce: twice the bytes of a reduce-scatter);
* ``fp32a2a``: ``reduce_dtype=fp32`` through an uncompressed all_to_all + sum, a true
  reduce-scatter on Gloo (the byte ceiling's baseline);
* ``bf16``, ``bf16a2a``: the same with ``reduce_dtype=bf16``;
* ``gqsgd<bits>``: ``reduce_dtype=fp32`` with ``hvd_gqsgd.fsdp.register(model, bits)``.

Ranks come from mpirun (OMPI_COMM_WORLD_*) or torchrun (RANK, WORLD_SIZE), with
MASTER_ADDR/MASTER_PORT set.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch
import torch.distributed as dist
from ddp_bench_worker import Task, model, rank_and_size, task_args, timed_steps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

VARIANTS = ("fp32", "fp32a2a", "bf16", "bf16a2a", "gqsgd8")
VARIANT = re.compile(r"(fp32|bf16|gqsgd(\d+))(a2a)?(-rs)?")


class AllToAllReduceScatter:
    """An uncompressed reduce-scatter for FSDP2 on Gloo: ``all_to_all`` of the rows, then
    the sum of the ``n`` received copies in the reduce dtype (force-sum: FSDP divides)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(dist.get_world_size(group), -1), 0, out=output_tensor)


def build(name: str, width: int, mesh) -> tuple[torch.nn.Module, object]:
    m = VARIANT.fullmatch(name)
    if m is None:
        raise ValueError(f"unknown variant {name!r}: fp32|bf16|gqsgd<bits> [a2a] [-rs]")
    net = model(width)
    reduce = torch.bfloat16 if m.group(1) == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce,
                              output_dtype=torch.float32)
    reshard = m.group(4) is not None
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(net, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    state = None
    if m.group(2):
        import hvd_gqsgd.fsdp

        state = hvd_gqsgd.fsdp.register(net, bits=int(m.group(2)))
    elif m.group(3):
        for module in net.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(AllToAllReduceScatter())
                module.set_force_sum_reduction_for_comms(True)
    return net, state


def wire_bytes(net: torch.nn.Module, name: str, n: int, state, steps: int) -> float:
    """Bytes one rank sends per step in ring terms: each all-gather ``(n-1)/n`` of the bf16
    parameters (two with reshard_after_forward), the reduce-scatter ``(n-1)/n`` of its input
    (Gloo's own: an all_reduce, twice that; GlobalQSGD: its codes and scales, from its
    stats over the ``steps`` run)."""
    params = sum(p.numel() for p in net.parameters())  # DTensor numel: the full size
    ring = (n - 1) / n
    gathers = (2 if name.endswith("-rs") else 1) * ring * params * 2
    if state is not None:
        return gathers + ring * (state.stats.total_payload + state.stats.total_overhead) / steps
    scatter = ring * params * (2 if name.startswith("bf16") else 4)
    return gathers + scatter * (1 if "a2a" in name else 2)


def run(name: str, task: Task, args, mesh, n: int) -> dict:
    net, state = build(name, args.width, mesh)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    loss_start = task.held_out_loss(net)
    times = timed_steps(net, opt, task, args, dist.barrier)
    slowest = torch.tensor(statistics.median(times))
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    steps = args.warmup + args.steps
    return {"variant": name, "median_s": float(slowest), "loss_start": loss_start,
            "loss_end": task.held_out_loss(net),
            "wire_bytes": wire_bytes(net, name, n, state, steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = task_args(parser)
    rank, size = rank_and_size()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    task = Task(args.width, args.batch, rank)
    for name in args.variants.split(","):
        row = {**run(name, task, args, mesh, size), "ranks": size}
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
