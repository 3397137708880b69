"""Rank worker for tests/test_fsdp.py: FSDP2 (``fully_shard``) with hvd_gqsgd's reduce-scatter
over real Gloo collectives, launched by torchrun (RANK/WORLD_SIZE, MASTER_ADDR/PORT).

Writes ``rank{r}.pkl`` into argv[1]: what each reduce-scatter call got and returned, the
gradients and losses FSDP produced, and the errors raised.  No expected value is computed
here; tests/test_fsdp.py replays everything with gqsgd_lab/two_stage_oracle.py.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
from fsdp_inputs import (
    GRID_CASES,
    SHAPES,
    grid_rows,
    params_input,
    random_rows,
    train_data,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import hvd_gqsgd.fsdp as gq
import hvd_gqsgd.torch_dist as torch_dist
from gqsgd_lab.launch import finish_dist_worker

# The scenarios below check the hook without a rotation (the default rotates at 4 bits);
# `rotation` checks it with one
FSDPState = functools.partial(gq.FSDPState, rotation=None)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Params(torch.nn.Module):
    """forward(xs) = sum_i <p_i, x_i>, so p_i's gradient is exactly x_i."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.ps, xs))


def _comm(state, divisor=None):
    """The hook for a call outside FSDP: no parameter group to check."""
    return gq.GlobalQSGDReduceScatter(state, None, divisor, 1)


def _call(comm, rows, dtype):
    group = dist.group.WORLD
    n = dist.get_world_size()
    inp = torch.from_numpy(rows.reshape(-1)).to(dtype)
    out = torch.empty(inp.numel() // n, dtype=dtype)
    comm(out, inp, group, dist.ReduceOp.SUM)
    return out.float().numpy().astype(np.float64)


def grid(rank, n):
    """Grid rows (deterministic rounding) per (bits, dtype, shard size): one direct call."""
    out = {}
    for bits, dtype, shard in GRID_CASES:
        state = FSDPState(bits=bits, seed=1)
        out[(bits, dtype, shard)] = (_call(_comm(state), grid_rows(rank, n, bits, shard),
                                           DTYPES[dtype]), state.stats.as_dict())
    return out


def recorded(rank, n):
    """Random rows through direct calls (seed 5): serial before each call, the output.  The
    Gloo reduce-scatter goes in pieces of 5 words per rank (the default is 4 MiB), so the
    piecewise sums are checked too."""
    torch_dist.PIECE_BYTES = 8 * n * 5
    state = FSDPState(bits=8, seed=5)
    comm = _comm(state)
    calls = []
    for step, shard in enumerate((3000, 1, 4097)):
        serial = state._key_serial
        calls.append((serial, shard, _call(comm, random_rows(rank, n, step, shard),
                                           torch.float32)))
    l2 = FSDPState(bits=8, seed=5, norm="l2")
    calls.append((0, 2500, _call(_comm(l2), random_rows(rank, n, 7, 2500), torch.float32)))
    half = FSDPState(bits=4, seed=5)
    calls.append((0, 2500, _call(_comm(half, divisor=2.5), random_rows(rank, n, 8, 2500),
                                 torch.float32)))
    torch_dist.PIECE_BYTES = 4 << 20
    return calls


def rotation(rank, n):
    """Rows of 2 full blocks and a partial one (shard 2500), 4 and 8 bits with the rotation
    (seed 5): serials before each call, and the output."""
    calls = []
    for step, bits in enumerate((4, 8, 4)):
        state = gq.FSDPState(bits=bits, seed=5, rotation="hadamard")
        comm = _comm(state)
        for _ in range(step % 2 + 1):  # the second state runs twice: its counter moves
            calls.append((bits, state._key_serial, state._rotation_serial,
                          _call(comm, random_rows(rank, n, 20 + step, 2500), torch.float32)))
    return calls


def unbiased(rank, n, trials=300):
    """One fixed row set, fresh noise each call (4 bits): the mean over calls."""
    comm = _comm(FSDPState(bits=4))
    rows = random_rows(rank, n, 0, 1500)
    return {"mean": sum(_call(comm, rows, torch.float32) for _ in range(trials)) / trials,
            "trials": trials}


def error(rank, n, trials=20):
    """Heavy-tailed rows (8 bits), fresh noise: each call's output, to measure the error."""
    comm = _comm(FSDPState(bits=8))
    rows = random_rows(rank, n, 1, 8192, heavy=True)
    return [_call(comm, rows, torch.float32) for _ in range(trials)]


def non_finite(rank, n):
    """The last rank puts NaN at row 0 element 5 and +inf at row 0 element 2000."""
    rows = grid_rows(rank, n, 8, 3000)
    if rank == n - 1:
        rows = rows.copy()
        rows[0, 5], rows[0, 2000] = np.nan, np.inf
    return _call(_comm(FSDPState(bits=8, seed=1)), rows, torch.float32)


def _shard_model(model, mesh, reduce_dtype=torch.float32, param_dtype=torch.float32,
                 blocks=()):
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def _record(model):
    """Wrap every registered comm: (serial before, input, output) per call, in call order."""
    calls = []

    class Recorder:
        def __init__(self, inner):
            self.inner = inner

        def allocate(self, size, *, dtype, device):
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            serial = self.inner.state._key_serial
            self.inner(output_tensor, input_tensor, group, op, async_op)
            calls.append((serial, input_tensor.float().numpy().copy(),
                          output_tensor.float().numpy().copy()))

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                group._reduce_scatter_comm = Recorder(group._reduce_scatter_comm)
    return calls


def through_fsdp(rank, n, mesh):
    """Params model (shapes whose dim 0 does not divide by n: FSDP pads), fp32 and bf16
    reduce dtype, 2 steps: every call recorded, and each parameter's full gradient."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = _shard_model(Params(SHAPES), mesh, reduce_dtype=DTYPES[dtype])
        state = gq.register(model, bits=8, seed=9)
        calls = _record(model)
        grads = []
        for step in range(2):
            for p in model.parameters():
                p.grad = None
            model([torch.from_numpy(x) for x in params_input(rank, step)]).backward()
            grads.append([p.grad.full_tensor().float().numpy().astype(np.float64)
                          for p in model.ps])
        out[dtype] = {"calls": calls, "grads": grads, "stats": state.stats.as_dict()}
    return out


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _train(rank, n, mesh, seed, hook, reduce_dtype, steps=150, stop=None, resume=None):
    """Digits MLP under fully_shard (a module per layer), SGD with momentum; the held-out
    losses at the end and the parameters.  ``stop``: return a checkpoint after that many
    steps; ``resume``: start from one."""
    (xtr, ytr), (xte, yte) = train_data()
    xtr, ytr = torch.from_numpy(xtr[rank::n]), torch.from_numpy(ytr[rank::n])
    torch.manual_seed(seed)
    model = _mlp()
    _shard_model(model, mesh, reduce_dtype=reduce_dtype,
                 blocks=[m for m in model if isinstance(m, torch.nn.Linear)])
    state = gq.register(model, bits=8, seed=seed) if hook else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        state.load_state_dict(resume["hook"])
        start = resume["step"]
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    order = [torch.randperm(len(xtr), generator=gen) for _ in range(steps)]
    for step in range(start, steps):
        if step == stop:
            return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "opt": pickle.loads(pickle.dumps(opt.state_dict())),
                    "hook": pickle.loads(pickle.dumps(state.state_dict())), "step": step}
        idx = order[step][:32]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    params = [p.full_tensor().detach().numpy().copy() for p in model.parameters()]
    with torch.no_grad():
        logits = model(torch.from_numpy(xte)).float()
        loss = float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(yte)))
    return {"loss": loss, "params": params}


def training(rank, n, mesh, seeds=(0, 1)):
    """Held-out loss with and without the hook, fp32 and bf16 reduce dtype, same seeds."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        for hook in (False, True):
            out[(dtype, hook)] = [_train(rank, n, mesh, s, hook, DTYPES[dtype])["loss"]
                                  for s in seeds]
    return out


def checkpoint(rank, n, mesh):
    """40 steps straight, against 20 steps, a state_dict checkpoint (model, optimizer and
    hook), and 20 more steps in a freshly built model: the same parameters bit for bit."""
    straight = _train(rank, n, mesh, 3, True, torch.float32, steps=40)
    saved = _train(rank, n, mesh, 3, True, torch.float32, steps=40, stop=20)
    resumed = _train(rank, n, mesh, 3, True, torch.float32, steps=40, resume=saved)
    return {"straight": straight["params"], "resumed": resumed["params"]}


def refusals(rank, n, mesh):
    """What register() refuses on a real mesh, with its message."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    attempt("no_fsdp", lambda: gq.register(_mlp()))
    attempt("bits", lambda: gq.register(_shard_model(_mlp(), mesh), bits=17))
    twice = _shard_model(_mlp(), mesh)
    gq.register(twice)
    attempt("twice", lambda: gq.register(twice))
    if n % 2 == 0 and n >= 4:  # HSDP: 2 replicas of n/2 shards
        hsdp = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
        attempt("hsdp", lambda: gq.register(_shard_model(_mlp(), hsdp)))
    changed = _shard_model(Params([(8 * n,)]), mesh)
    gq.register(changed)
    changed.set_force_sum_reduction_for_comms(False)
    attempt("changed", lambda: changed([torch.ones(8 * n)]).backward())
    return out


CHECKS = {"grid": grid, "recorded": recorded, "rotation": rotation, "unbiased": unbiased,
          "error": error, "non_finite": non_finite}
MESH_CHECKS = {"through_fsdp": through_fsdp, "training": training, "checkpoint": checkpoint,
               "refusals": refusals}


def main():
    env = os.environ
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (size,))
    only = env.get("FSDP_CHECKS", "").split(",")
    result = {"size": size, "rank": rank}
    for name, check in {**CHECKS, **MESH_CHECKS}.items():
        if name in only:
            result[name] = check(rank, size, mesh) if name in MESH_CHECKS else check(rank, size)
    finish_dist_worker(sys.argv[1], rank, result)


if __name__ == "__main__":
    main()
