"""Runs on every rank under ``horovodrun --gloo -H localhost:2,127.0.0.1:2`` (2 nodes of 2
ranks on one machine; mode ``nodes-lite``: 3 nodes of 2, fewer scenarios) or an unequal
layout; records what hierarchical GlobalQSGD returned through real Horovod collectives.
tests/test_hierarchical.py loads every rank's ``rank{r}.pkl`` and compares it with a NumPy
simulation.  No checking happens here.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import warnings

import horovod.torch as hvd
import numpy as np
import torch
from hier_inputs import (
    BLOCK,
    GRID_BITS,
    GROUP_NUMELS,
    TWO_STAGE_NUMELS,
    random_input,
    rank_grid,
)

from hvd_gqsgd import GlobalQSGD as _GlobalQSGD

# These scenarios test flat Global-QSGD, whose levels the test's simulation assumes at every
# bits, without a rotation; the defaults would pick two-stage below 15 levels
# (tests/workers/two_stage_checks.py covers that) and rotate at 4 bits
# (the rotation scenario of tests/workers/two_stage_checks.py covers that).
GlobalQSGD = functools.partial(_GlobalQSGD, two_stage=False, rotation=None)


OPS = {"sum": hvd.Sum, "average": hvd.Average}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def _where() -> tuple[int, int, int, int]:
    return hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()


def grid_exact(c: int, j: int, s: int, nodes: int) -> dict:
    """One tensor per (bits, dtype, op), then a bucket of several tensors with 16-element
    scale blocks: node sums on the grid, so the result must be exact."""
    out = {}
    for bits in GRID_BITS:
        for dtype in ("float32", "float64"):
            for op in ("sum", "average"):
                x = torch.tensor(rank_grid(c, j, s, nodes, bits, 200, 0),
                                 dtype=getattr(torch, dtype))
                comp = GlobalQSGD(bits=bits, hierarchical=True, scale_block=0)
                y = hvd.allreduce(x, op=OPS[op], compression=comp)
                out[(bits, dtype, op)] = (str(y.dtype), _np(y))
        xs = [torch.tensor(rank_grid(c, j, s, nodes, bits, n, BLOCK), dtype=torch.float32)
              for n in GROUP_NUMELS]
        comp = GlobalQSGD(bits=bits, hierarchical=True, scale_block=BLOCK)
        ys = hvd.grouped_allreduce(xs, op=hvd.Sum, compression=comp)
        out[(bits, "grouped")] = [_np(y) for y in ys]
    # 3 elements: one word, so one rank of each node holds an empty shard
    x = torch.tensor(rank_grid(c, j, s, nodes, 8, 3, 0), dtype=torch.float32)
    out["tiny"] = _np(hvd.allreduce(x, op=hvd.Sum,
                                    compression=GlobalQSGD(bits=8, hierarchical=True)))
    return out


def flat_refuses(c: int, j: int, s: int, nodes: int) -> str:
    try:
        hvd.allreduce(torch.ones(8), op=hvd.Sum, compression=GlobalQSGD(bits=3))
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def random_bounds(rank: int) -> dict:
    out = {}
    for norm in ("max", "l2"):
        comp = GlobalQSGD(bits=8, norm=norm, hierarchical=True)  # 1024-element blocks
        x = torch.tensor(random_input(rank, 3000), dtype=torch.float32)
        out[norm] = (_np(hvd.allreduce(x, op=hvd.Average, compression=comp)),
                     comp.stats.as_dict())
    comp = GlobalQSGD(bits=8, hierarchical=True, scale_block=0)
    x = torch.tensor(random_input(rank, 1024), dtype=torch.float32)
    hvd.allreduce(x, op=hvd.Sum, compression=comp)
    out["stats_1024"] = comp.stats.as_dict()
    return out


def moments(rank: int, trials: int = 40, numel: int = 2000) -> dict:
    """Sum and sum of squares over trials of hierarchical and flat results, bits=4.  Seeded
    (each rank's noise still its own), so the statistical test sees the same sample every
    run: with the OS's noise its bound (5 standard errors at each of 2000 elements) failed
    once in a clean-clone run, by chance."""
    x = torch.tensor(random_input(rank, numel, seed=1), dtype=torch.float32)
    out = {"trials": trials}
    for name, hier in (("hier", True), ("flat", False)):
        comp = GlobalQSGD(bits=4, hierarchical=hier, scale_block=0, seed=11)
        s1 = torch.zeros(numel, dtype=torch.float64)
        s2 = torch.zeros(numel, dtype=torch.float64)
        for _ in range(trials):
            y = hvd.allreduce(x, op=hvd.Sum, compression=comp).double()
            s1 += y
            s2 += y * y
        out[name] = (s1.numpy(), s2.numpy())
    return out


def optimizer_grads(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    rng = np.random.default_rng([3, rank])
    x = torch.tensor(rng.normal(size=(64, 8)), dtype=torch.float32)
    y = torch.tensor(rng.normal(size=(64, 1)), dtype=torch.float32)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=GlobalQSGD(bits=8, hierarchical=True))
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = [_np(p.grad.clone()) for p in model.parameters()]
    opt.synchronize()
    return {"local": local, "reduced": [_np(p.grad) for p in model.parameters()]}


def two_stage(rank: int) -> dict:
    """Hierarchical two-stage: node sums summed across nodes in wide lanes, requantized, and
    gathered; 16-element scale blocks straddle the node shards and the cross pieces."""
    out = {}
    xs = np.split(random_input(rank, sum(TWO_STAGE_NUMELS)).astype(np.float32),
                  np.cumsum(TWO_STAGE_NUMELS)[:-1])
    for bits in (4, 8):
        for op in ("sum", "average"):
            comp = GlobalQSGD(bits=bits, hierarchical=True, two_stage=True, seed=7,
                              chunk_bytes=0, scale_block=BLOCK)
            got = hvd.grouped_allreduce([torch.from_numpy(x) for x in xs], op=OPS[op],
                                        compression=comp)
            out[(bits, op)] = np.concatenate([_np(g) for g in got])
    return out


def unequal(rank: int, n: int) -> dict:
    """Unequal nodes, one node, or one rank per node: flat Global-QSGD with one warning;
    flat's grid inputs sum exactly."""
    level = (2 ** 7 - 1) // n
    k = np.random.default_rng([5, rank]).integers(-level, level + 1, 100)
    k[0] = level
    x = torch.tensor(k * 2.0**-3, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comp = GlobalQSGD(bits=8, hierarchical=True, scale_block=0)
        y = hvd.allreduce(x, op=hvd.Sum, compression=comp)
        y2 = hvd.allreduce(x, op=hvd.Sum, compression=comp)  # no second warning
    return {"codes": k, "sum": _np(y), "sum2": _np(y2),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    results = {"size": n, "where": _where()}
    if mode in ("nodes", "nodes-lite"):
        j, s, c, nodes = _where()
        results["grid_exact"] = grid_exact(c, j, s, nodes)
        results["flat_refuses"] = flat_refuses(c, j, s, nodes)
        results["random_bounds"] = random_bounds(rank)
        if mode == "nodes":  # the long ones: 2 x 40 rounds, an optimizer
            results["moments"] = moments(rank)
            results["optimizer_grads"] = optimizer_grads(rank)
            results["two_stage"] = two_stage(rank)
    else:
        results["unequal"] = unequal(rank, n)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
