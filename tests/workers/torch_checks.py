"""Runs on every rank under horovodrun/mpirun; records what real Horovod collectives returned.

Each scenario stores its results under a key in ``rank{r}.pkl``; tests/test_multiproc.py
loads all ranks' files and compares them with a single-process simulation.  Inputs come from
``gqsgd_lab/inputs.py`` so the test can regenerate them.  No checking happens here.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

from gqsgd_lab.inputs import (
    GRID_CASES,
    block_grid_input,
    grid_input,
    random_input,
    training_data,
)
from hvd_gqsgd import GlobalQSGD as _GlobalQSGD
from hvd_gqsgd import QSGDAllgather, core
from hvd_gqsgd.torch import TorchBackend

# These scenarios test flat Global-QSGD, whose levels the test's simulation assumes at every
# bits, without a rotation; the defaults would pick two-stage below 15 levels
# (tests/workers/two_stage_checks.py covers that) and rotate at 4 bits
# (the rotation scenario of tests/workers/two_stage_checks.py covers that).
GlobalQSGD = functools.partial(_GlobalQSGD, two_stage=False, rotation=None)

OPS = {"sum": hvd.Sum, "average": hvd.Average}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def packed_extremes(rank: int, n: int) -> dict:
    """Pack codes with the torch adapter, sum words with Horovod, unpack."""
    backend, out = TorchBackend(seed=0), {}
    for bits in range(core.MIN_BITS, core.MAX_BITS + 1):
        if core.min_bits(n) > bits:
            continue
        level = core.levels(bits, n)
        for pattern in ("all_max", "all_min", "random"):
            codes = {"all_max": np.full(37, level), "all_min": np.full(37, -level),
                     "random": np.random.default_rng([bits, rank]).integers(-level, level + 1, 37)
                     }[pattern]
            words = core.pack(backend, torch.tensor(codes, dtype=torch.int64), bits)
            summed = hvd.allreduce(words, op=hvd.Sum, name=f"pk.{bits}.{pattern}")
            out[(bits, pattern)] = core.unpack(backend, summed, bits, codes.size).numpy()
    return out


def grid_exact(rank: int, n: int) -> dict:
    out = {}
    for bits, dtype_name, op in GRID_CASES:
        x = torch.tensor(grid_input(rank, n, bits), dtype=getattr(torch, dtype_name))
        y = hvd.allreduce(x, op=OPS[op], compression=GlobalQSGD(bits=bits), name=None)
        out[(bits, dtype_name, op)] = (_dtype_name(y), _np(y))
    return out


def random_bounds(rank: int, n: int) -> dict:
    out = {}
    for norm in ("max", "l2"):
        for op in ("sum", "average"):
            comp = GlobalQSGD(bits=8, norm=norm)
            x = torch.tensor(random_input(rank, 1000), dtype=torch.float32)
            y = hvd.allreduce(x, op=OPS[op], compression=comp)
            out[(norm, op)] = (_np(y), comp.stats.as_dict())
    return out


def unbiased(rank: int, n: int, trials: int = 300) -> dict:
    comp = GlobalQSGD(bits=4)  # few levels: rounding noise dominates
    x = torch.tensor(random_input(rank, 256), dtype=torch.float32)
    acc = torch.zeros(256, dtype=torch.float64)
    for _ in range(trials):
        acc += hvd.allreduce(x, op=hvd.Sum, compression=comp).double()
    return {"mean": (acc / trials).numpy(), "trials": trials}


def independent_noise(rank: int, n: int) -> dict:
    """Every rank seeds torch identically and holds the same x, halfway between two levels."""
    torch.manual_seed(1234)
    level = core.levels(8, n)
    x = torch.full((8192,), 0.5 / level, dtype=torch.float32)
    x[0] = 1.0  # the global scale s = 1
    state = torch.get_rng_state()
    # one scale for the whole tensor (x[0]): every other element then sits halfway between
    # two levels; with 1024-element blocks, blocks without x[0] would be exact
    y = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=8, scale_block=0))
    untouched = torch.equal(state, torch.get_rng_state())
    return {"sum": _np(y), "global_rng_untouched": untouched}


def qsgd_baseline(rank: int, n: int) -> dict:
    x = torch.tensor(random_input(rank, 1000), dtype=torch.float32)
    return {op: _np(hvd.allreduce(x, op=OPS[op], compression=QSGDAllgather(bits=8)))
            for op in ("sum", "average")}


def seeded(rank: int, n: int) -> dict:
    x = torch.tensor(random_input(rank, 500), dtype=torch.float32)
    a = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=4, seed=99))
    b = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=4, seed=99))
    c = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=4, seed=100))
    return {"a": _np(a), "b": _np(b), "c": _np(c)}


def bad_inputs(rank: int, n: int) -> dict:
    comp, out = GlobalQSGD(bits=8), {}
    ints = torch.arange(10, dtype=torch.int32) * (rank + 1)
    out["int32"] = _np(hvd.allreduce(ints, op=hvd.Sum, compression=comp))
    for dtype in ("float16", "bfloat16", "float64"):
        x = torch.tensor(random_input(rank, 64), dtype=getattr(torch, dtype))
        y = hvd.allreduce(x, op=hvd.Sum, compression=comp)
        out[dtype] = (_dtype_name(y), _np(y))
    out["zeros"] = _np(hvd.allreduce(torch.zeros(33), op=hvd.Average, compression=comp))
    out["empty"] = tuple(hvd.allreduce(torch.zeros(0, 3), op=hvd.Sum, compression=comp).shape)
    zero_d = hvd.allreduce(torch.tensor(float(rank + 1)), op=hvd.Sum, compression=comp)
    out["zero_d"] = (tuple(zero_d.shape), float(zero_d))
    base = torch.tensor(random_input(rank, 60), dtype=torch.float32).view(6, 10)
    out["noncontig"] = (_np(base), _np(hvd.allreduce(base.t(), op=hvd.Sum, compression=comp)))
    for bad in ("nan", "inf"):
        x = torch.ones(20)
        if rank == n - 1:
            x[3] = float(bad)
        out[bad] = _np(hvd.allreduce(x, op=hvd.Average, compression=comp))
    # a NaN in one tensor of a batch must not leak into the others packed beside it
    x = np.ones(21, dtype=np.float32)
    if rank == n - 1:
        x[16] = np.nan  # lane 0 of the word shared with the next tensor
    clean = random_input(rank, 30).astype(np.float32)
    pair = hvd.grouped_allreduce([torch.tensor(x), torch.tensor(clean)], op=hvd.Sum,
                                 compression=GlobalQSGD(bits=8))
    out["nan_neighbour"] = (_np(pair[0]), _np(pair[1]))
    return out


def errors(rank: int, n: int) -> dict:
    out = {}
    for op_name in ("Min", "Max", "Adasum"):
        try:
            hvd.allreduce(torch.ones(8) * (rank + 1), op=getattr(hvd, op_name),
                          compression=GlobalQSGD(bits=8))
            out[op_name] = "no error"
        except ValueError as e:
            out[op_name] = f"ValueError: {e}"
        except Exception as e:  # recorded, and the test fails on anything but ValueError
            out[op_name] = f"{type(e).__name__}: {e}"
    try:
        hvd.allreduce(torch.ones(8), op=hvd.Sum, compression=GlobalQSGD(bits=2))
        out["bits2"] = "no error"
    except ValueError as e:
        out["bits2"] = f"ValueError: {e}"
    return out


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def optimizer_grads(rank: int, n: int) -> dict:
    """One synchronize() per configuration: local grads in, reduced grads out."""
    x, y = (torch.tensor(a, dtype=torch.float32) for a in training_data(rank, 64))
    configs = {
        "average": {},
        "sum": {"op": hvd.Sum},
        "predivide": {"gradient_predivide_factor": 2.0},
        "groups": {"groups": 2},
        "bpps2": {"backward_passes_per_step": 2},
        "bucketed": {},  # several buckets per round: sealed from the autograd hooks
        "sum-bucketed": {"op": hvd.Sum},
        "groups-bucketed": {"groups": 2},
        "bpps2-bucketed": {"backward_passes_per_step": 2},
    }
    out = {}
    for name, kwargs in configs.items():
        model = _model()
        comp = GlobalQSGD(bits=8, bucket_bytes=60 if name.endswith("bucketed") else 0)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            compression=comp, **kwargs)
        passes = kwargs.get("backward_passes_per_step", 1)
        local = None
        for p in range(passes):
            loss = torch.nn.functional.mse_loss(model(x[p::passes]), y[p::passes])
            loss.backward()
        local = [_np(p.grad.clone()) for p in model.parameters()]
        opt.synchronize()
        out[name] = {"local": local, "reduced": [_np(p.grad) for p in model.parameters()],
                     "scale_bytes": comp.stats.last_overhead}
        opt.zero_grad()
    return out


def training(rank: int, n: int, steps: int = 150) -> dict:
    x, y = (torch.tensor(a, dtype=torch.float32) for a in training_data(rank, 256))
    out = {}
    for name, comp in (("none", hvd.Compression.none), ("gqsgd8", GlobalQSGD(bits=8))):
        model = _model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression=comp)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[name] = {"losses": losses, "params": _np(params)}
    return out


def process_set(rank: int, n: int, members: list[int]) -> dict:
    if rank not in members:
        return {"member": False}
    ps = PROCESS_SETS[0]
    x = torch.tensor(grid_input(rank, len(members), 8), dtype=torch.float32)
    y = hvd.allreduce(x, op=hvd.Sum, process_set=ps, compression=GlobalQSGD(bits=8, process_set=ps))
    return {"member": True, "sum": _np(y)}


def chunked(rank: int, n: int) -> dict:
    """Tensors sent in chunks smaller than themselves (chunk_bytes of 2-3 words)."""
    grids = [torch.tensor(grid_input(rank, n, 8, numel), dtype=torch.float32)
             for numel in CHUNKED_NUMELS]
    comp = GlobalQSGD(bits=8, chunk_bytes=16)
    exact = [_np(t) for t in hvd.grouped_allreduce(grids, op=hvd.Sum, compression=comp)]
    rand = [torch.tensor(random_input(rank, numel), dtype=torch.float32)
            for numel in CHUNKED_NUMELS]
    comp4 = GlobalQSGD(bits=4, chunk_bytes=24)
    mean = [_np(t) for t in hvd.grouped_allreduce(rand, op=hvd.Average, compression=comp4)]
    return {"exact": exact, "mean": mean, "stats": comp.stats.as_dict()}


def blocked(rank: int, n: int) -> dict:
    """One global scale per 16 elements (scale_block), in chunks that cut blocks."""
    xs = [torch.tensor(block_grid_input(rank, n, 8, numel, 16), dtype=torch.float32)
          for numel in (70, 45)]
    comp = GlobalQSGD(bits=8, scale_block=16, chunk_bytes=16)
    exact = [_np(t) for t in hvd.grouped_allreduce(xs, op=hvd.Sum, compression=comp)]
    return {"exact": exact, "stats": comp.stats.as_dict()}


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: gives the MAX allreduce of the layers after it time to
    finish while backward still runs, as a deep model's compute does."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(0.2)
        return grad


def overlap(rank: int, n: int) -> dict:
    """Buckets sealed and sent from compress under DistributedOptimizer (issue 26): records
    the order of the compressor's collectives and its first decompress, two steps."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(x):
        for layer in layers:
            x = _SlowBackward.apply(torch.tanh(layer(x)))
        return x

    per_layer = (64 * 64 + 64) * 4
    comp = GlobalQSGD(bits=8, bucket_bytes=2 * per_layer)  # layers 3+2, then layer 1
    events: list[str] = []
    spies = {}
    for method in ("allreduce_max_async", "allreduce_sum_async"):
        original = getattr(TorchBackend, method)
        spies[method] = original

        def spy(self, vec, name, pset, _original=original, _what=method):
            events.append(_what)
            return _original(self, vec, name, pset)
        setattr(TorchBackend, method, spy)
    decompress = comp.decompress

    def logged(tensor, ctx):
        events.append("decompress")
        return decompress(tensor, ctx)
    comp.decompress = logged  # Horovod calls the instance's attribute
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1),
                                   named_parameters=layers.named_parameters(), compression=comp)
    x = torch.tensor(np.random.default_rng([2, rank]).normal(size=(8, 64)), dtype=torch.float32)
    y = torch.sin(x.roll(1, dims=1))
    steps = []
    try:
        for _ in range(2):
            events.clear()
            opt.zero_grad()
            torch.nn.functional.mse_loss(forward(x), y).backward()
            local = [_np(p.grad.clone()) for p in layers.parameters()]
            opt.synchronize()
            steps.append({"events": list(events), "local": local,
                          "reduced": [_np(p.grad) for p in layers.parameters()]})
            with opt.skip_synchronize():
                opt.step()
    finally:
        for method, original in spies.items():
            setattr(TorchBackend, method, original)
    return {"steps": steps}


CHUNKED_NUMELS = (70, 200, 45)
SCENARIOS = [packed_extremes, grid_exact, random_bounds, unbiased, independent_noise, seeded,
             bad_inputs, errors, optimizer_grads, training, qsgd_baseline, chunked, blocked,
             overlap]
PROCESS_SETS: list = []


def main() -> None:
    out_dir = sys.argv[1]
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("HOROVOD_SIZE") or 1)
    members = list(range(0, world, 2))  # a proper subset: [0] at 2 ranks, [0, 2] at 3
    PROCESS_SETS.append(hvd.ProcessSet(members))
    hvd.init(process_sets=PROCESS_SETS)
    rank, n = hvd.rank(), hvd.size()
    results = {"size": n, "framework": "torch"}
    for scenario in SCENARIOS:
        results[scenario.__name__] = scenario(rank, n)
    results["process_set"] = process_set(rank, n, members)
    hvd.barrier()  # non-members must not shut down while the set is still reducing
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
