"""Rank worker of tests/test_cuda.py: the torch.distributed hooks on CUDA tensors over NCCL
(one GPU per rank, ``cuda:<RANK>``), or on CPU tensors over Gloo when GQSGD_TEST_DEVICE=cpu.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python cuda_checks.py OUT CHECKS

CHECKS is a comma-separated list of ``ddp``, ``fsdp_comm``, ``fsdp_model``, ``ddp_bench``.
Writes ``rank{r}.pkl`` into OUT: what each check produced (gradients and outputs as float64
arrays, the hooks' stats, timings), or ``{"error": traceback}`` for a check that raised, so
that one failing check does not hide the others' results.  No expected value is computed
here.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from cuda_inputs import (
    BENCH_BYTES,
    DTYPES,
    FSDP_ROW,
    FSDP_SHAPES,
    REHEARSAL_BENCH_BYTES,
    SHAPES,
    device_kind,
    fsdp_inputs,
    fsdp_rows,
    host,
    inputs,
    tensor,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_gqsgd import core
from hvd_gqsgd.ddp import GlobalQSGDState, global_qsgd_hook
from hvd_gqsgd.fsdp import FSDPState, GlobalQSGDReduceScatter, register

BENCH_RUNS = 5  # timed backward passes per variant, after one warm-up


class Params(torch.nn.Module):
    """forward(xs) = sum_i <p_i, x_i>: p_i's gradient is exactly x_i."""

    def __init__(self, shapes, dtype: str, device: torch.device) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(s, dtype=DTYPES[dtype], device=device))
             for s in shapes])

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.ps, xs))


def _ddp(model: torch.nn.Module, device: torch.device) -> DDP:
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def check_ddp(rank: int, size: int, device: torch.device) -> dict:
    """Two steps of the Global-QSGD DDP hook per dtype, flat and two-stage, on grid
    gradients for flat's levels at this world size."""
    out = {}
    levels = core.levels(8, size)
    for dtype in DTYPES:
        for two in (False, True):
            model = Params(SHAPES, dtype, device)
            ddp = _ddp(model, device)
            state = GlobalQSGDState(bits=8, seed=7, two_stage=two)
            ddp.register_comm_hook(state, global_qsgd_hook)
            steps = []
            for step in range(2):
                ddp([tensor(x, dtype, device) for x in inputs(rank, levels, step)]).backward()
                steps.append([(host(p.grad), p.grad.dtype == DTYPES[dtype],
                               p.grad.device == device) for p in model.ps])
                model.zero_grad()
            out[dtype, two] = {"steps": steps, "rounds": state.stats.rounds,
                               "payload": state.stats.total_payload}
    return out


def check_fsdp_comm(rank: int, size: int, device: torch.device) -> dict:
    """hvd_gqsgd.fsdp's reduce-scatter called directly (no FSDP around it), per case:
    (input dtype, divide factor)."""
    state = FSDPState(bits=8, seed=3)
    levels = core.two_stage_levels(8, size)
    out: dict = {}
    for case, (dtype, divide) in enumerate([("float32", None), ("bfloat16", None),
                                            ("float32", 2.0)]):
        comm = GlobalQSGDReduceScatter(state, None, divide, 1)
        inp = tensor(fsdp_rows(rank, size, levels, case), dtype, device)
        result = torch.empty(FSDP_ROW, dtype=DTYPES[dtype], device=device)
        comm(result, inp, dist.group.WORLD, dist.ReduceOp.SUM)
        out[case] = {"out": host(result), "dtype": result.dtype == inp.dtype,
                     "device": result.device == device}
    out["rounds"] = state.stats.rounds
    return out


def check_fsdp_model(rank: int, size: int, device: torch.device) -> dict:
    """fully_shard + hvd_gqsgd.fsdp.register on the probe model, one backward per
    (param dtype, reduce dtype); the full gradients as FSDP left them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (size,))
    levels = core.two_stage_levels(8, size)
    out = {}
    for param, reduce in (("float32", "float32"), ("bfloat16", "float32")):
        model = Params(FSDP_SHAPES, "float32", device)
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce]))
        state = register(model, bits=8, seed=4, scale_block=0)  # one scale per row
        model([tensor(x, param, device) for x in fsdp_inputs(rank, levels)]).backward()
        out[param, reduce] = {"grads": [host(p.grad.full_tensor()) for p in model.ps],
                              "rounds": state.stats.rounds}
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_variant(hook, state, x: torch.Tensor, device: torch.device) -> dict:
    """Median time of a DDP backward of one ``x``-sized parameter whose gradient is ``x``,
    the peak CUDA memory above what was allocated before it, and the largest error of the
    last gradient in units of Global-QSGD's one-rank step (block max / 127)."""
    model = Params([tuple(x.shape)], "float32", device)
    ddp = _ddp(model, device)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    times, peaks = [], []
    for i in range(BENCH_RUNS + 1):
        model.zero_grad()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        ddp([x]).backward()
        _sync(device)
        if i:  # the first pass warms up (buckets, NCCL, kernels)
            times.append(time.perf_counter() - start)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(device) - base)
    error = _error_steps(model.ps[0].grad, x)
    del ddp, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms": 1e3 * statistics.median(times), "peak": max(peaks) if peaks else None,
            "error_steps": error}


def _error_steps(y: torch.Tensor, x: torch.Tensor) -> float:
    """max |y - x| / (s / L) over x's scale blocks (s: the block's max |x|, L = 127 levels of
    one rank at 8 bits); x's size is a multiple of the block."""
    block = core.DEFAULT_SCALE_BLOCK
    step = x.view(-1, block).abs().amax(1, keepdim=True) / core.levels(8, 1)
    return float(((y.float() - x).view(-1, block).abs() / step).max())


def check_ddp_bench(rank: int, size: int, device: torch.device) -> dict:
    """The benchmark's gradient through DDP at this world size: default all_reduce, torch's
    fp16_compress_hook, and Global-QSGD(8)'s hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    nbytes = BENCH_BYTES if device.type == "cuda" else REHEARSAL_BENCH_BYTES
    gen = torch.Generator(device=device).manual_seed(11)
    x = torch.randn(nbytes // 4, device=device, generator=gen)
    out: dict = {"bytes": nbytes}
    for name, hook, state in (("allreduce", None, None), ("fp16", fp16_compress_hook, None),
                              ("gq8", global_qsgd_hook, GlobalQSGDState(bits=8, seed=5))):
        out[name] = _bench_variant(hook, state, x, device)
    return out


CHECKS = {"ddp": check_ddp, "fsdp_comm": check_fsdp_comm, "fsdp_model": check_fsdp_model,
          "ddp_bench": check_ddp_bench}


def main() -> None:
    out_dir, checks = Path(sys.argv[1]), sys.argv[2].split(",")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = device_kind() == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    results: dict = {"size": size, "device": str(device)}
    for name in checks:
        try:
            results[name] = CHECKS[name](rank, size, device)
        except Exception:  # noqa: BLE001 -- reported by the test that reads this check
            results[name] = {"error": traceback.format_exc()}
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
