"""Runs on every rank under horovodrun/mpirun; records what QPRSGD did with real Horovod.

Each scenario trains tests/workers/qprsgd_data.py's least-squares problems and stores its
records under a key in ``rank{r}.pkl``; tests/test_qprsgd.py compares all ranks' records with
each other and with the NumPy oracle.  No checking happens here.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import numpy as np
import qprsgd_data as data
import torch

from hvd_gqsgd import GlobalQSGD
from hvd_gqsgd.qprsgd import QPRSGD

LR0 = 0.3


def params() -> list[torch.Tensor]:
    w0, b0 = data.initial()
    return [torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32)),
            torch.nn.Parameter(torch.tensor(b0, dtype=torch.float32))]


_PROBLEM: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def backward(rank: int, ps: list[torch.Tensor]) -> None:
    """Full-batch gradient of rank's f_r (no noise), into .grad."""
    if rank not in _PROBLEM:
        a, y = data.problem(rank)
        _PROBLEM[rank] = (torch.tensor(a, dtype=torch.float32),
                          torch.tensor(y, dtype=torch.float32))
    a, y = _PROBLEM[rank]
    w, b = ps
    loss = 0.5 * ((a @ w.T + b - y) ** 2).sum() / data.ROWS
    loss.backward()


def snap(ps: list[torch.Tensor]) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in ps]


def train(opt: Any, ps: list[torch.Tensor], rank: int, steps: int,
          first: int = 1) -> list[list[np.ndarray]]:
    """Steps first..first+steps-1 with the decaying learning rate; params after each step."""
    history = []
    for t in range(first, first + steps):
        for group in opt.param_groups:
            group["lr"] = data.lr_at(t, LR0)
        opt.zero_grad()
        backward(rank, ps)
        opt.step()
        history.append(snap(ps))
    return history


def equivalence(rank: int) -> dict:
    """period=1, Compression.none, plain SGD against hvd.DistributedOptimizer."""
    ps = params()
    q = QPRSGD(torch.optim.SGD(ps, lr=LR0), ps, period=1, compression=hvd.Compression.none)
    ps2 = params()
    d = hvd.DistributedOptimizer(torch.optim.SGD(ps2, lr=LR0),
                                 named_parameters=[("w", ps2[0]), ("b", ps2[1])])
    return {"qprsgd": train(q, ps, rank, 20), "distributed": train(d, ps2, rank, 20)}


def exact(rank: int, topology: str, period: int) -> dict:
    """Compression.none, plain SGD: replayable by qprsgd_data.simulate."""
    ps = params()
    opt = QPRSGD(torch.optim.SGD(ps, lr=LR0), ps, period=period, topology=topology,
                 compression=hvd.Compression.none)
    return {"history": train(opt, ps, rank, 24), "syncs": opt.stats.syncs}


def gq8_records(rank: int, topology: str, period: int, steps: int, momentum: float) -> dict:
    """Per step: params after the local step, after the whole step, sync count, and the
    synchronised model (allreduce) or public copies (gossip)."""
    ps = params()
    opt = QPRSGD(torch.optim.SGD(ps, lr=LR0, momentum=momentum), ps, period=period,
                 topology=topology,
                 compression=GlobalQSGD(bits=8, seed=11, scale_block=data.SCALE_BLOCK))
    rec: dict[str, list] = {"local": [], "after": [], "syncs": [], "shared": []}
    opt.optim.register_step_post_hook(lambda *_: rec["local"].append(snap(ps)))
    for t in range(1, steps + 1):
        rec["after"] += train(opt, ps, rank, 1, first=t)
        rec["syncs"].append(opt.stats.syncs)
        shared = opt.synced_params() if topology == "allreduce" else opt.public_copies()
        assert shared is not None
        rec["shared"].append([s.numpy().copy() for s in shared] if topology == "allreduce"
                             else {k: v.numpy().copy() for k, v in shared.items()})
    rec["bytes"] = opt.stats.last_bytes
    return rec


def consensus(rank: int, bits: int = 8, rotation: str | None = None) -> dict:
    """Gossip, GlobalQSGD(bits): drift apart for 8 local steps, then 25 syncs with no
    steps."""
    ps = params()
    opt = QPRSGD(torch.optim.SGD(ps, lr=LR0), ps, period=1000, topology="gossip",
                 compression=GlobalQSGD(bits=bits, seed=5, scale_block=data.SCALE_BLOCK,
                                        rotation=rotation))
    rounds = [snap(ps) for _ in train(opt, ps, rank, 8)][-1:]
    for _ in range(25):
        opt.synchronize()
        rounds.append(snap(ps))
    return {"rounds": rounds}


def converge(rank: int, topology: str) -> dict:
    """GlobalQSGD(8), K=4, plain SGD, 200 steps: the final models."""
    ps = params()
    opt = QPRSGD(torch.optim.SGD(ps, lr=LR0), ps, period=4, topology=topology,
                 compression=GlobalQSGD(bits=8, seed=13))
    return {"final": train(opt, ps, rank, 200)[-1]}


def round_trip(rank: int, topology: str) -> dict:
    """Checkpoint mid-period (momentum, Compression.none); a fresh optimizer loads it and
    must continue exactly as the original does."""
    ps = params()
    opt = QPRSGD(torch.optim.SGD(ps, lr=LR0, momentum=0.9), ps, period=4, topology=topology,
                 compression=hvd.Compression.none)
    train(opt, ps, rank, 6)
    buffer = io.BytesIO()  # through bytes, as a checkpoint file would (no shared tensors)
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    saved = [p.detach().clone() for p in ps]
    ps2 = params()
    with torch.no_grad():
        for p, s in zip(ps2, saved):
            p.copy_(s)
    opt2 = QPRSGD(torch.optim.SGD(ps2, lr=1.0, momentum=0.9), ps2, period=4, topology=topology,
                  compression=hvd.Compression.none)
    opt2.load_state_dict(state)
    return {"original": train(opt, ps, rank, 6, first=7),
            "restored": train(opt2, ps2, rank, 6, first=7),
            "steps_in_state": state["qprsgd"]["steps"]}


def restart(rank: int) -> dict:
    """A changed world at a sync: the sync becomes an exact fp32 average."""
    ps = params()
    opt = QPRSGD(torch.optim.SGD(ps, lr=LR0), ps, period=100, compression=GlobalQSGD(bits=8))
    train(opt, ps, rank, 3)
    before = snap(ps)
    opt._world = (rank, hvd.size() + 1)  # as if the world had changed since the last sync
    opt.synchronize()
    return {"before": before, "after": snap(ps), "anchor": [a.numpy().copy()
                                                             for a in opt.synced_params() or []]}


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def errors(rank: int, n: int) -> dict:
    ps = params()
    sgd = torch.optim.SGD(ps, lr=LR0)
    out = {
        "period0": _error(lambda: QPRSGD(sgd, ps, period=0)),
        "topology": _error(lambda: QPRSGD(sgd, ps, topology="ring")),
        "distributed": _error(lambda: QPRSGD(hvd.DistributedOptimizer(
            torch.optim.SGD(ps, lr=LR0), named_parameters=[("w", ps[0]), ("b", ps[1])]), ps)),
    }
    with torch.no_grad():
        ps[0][0, 0] += 1e-6 * rank  # rank 0 unchanged, the others differ
    diverged = QPRSGD(sgd, ps, period=2, compression=hvd.Compression.none)
    out["differ"] = _error(lambda: (backward(rank, ps), diverged.step()))
    if n < 3:
        ps2 = params()
        ring = QPRSGD(torch.optim.SGD(ps2, lr=LR0), ps2, period=1, topology="gossip")
        out["gossip_small"] = _error(lambda: (backward(rank, ps2), ring.step()))
    return out


def main() -> None:
    out_dir = sys.argv[1]
    hvd.init()
    torch.set_num_threads(1)
    rank, n = hvd.rank(), hvd.size()
    res: dict[str, Any] = {"size": n, "errors": errors(rank, n),
                           "equivalence": equivalence(rank),
                           "exact_allreduce": exact(rank, "allreduce", 4),
                           "gq8_allreduce": gq8_records(rank, "allreduce", 3, 30, 0.9),
                           "converge_allreduce": converge(rank, "allreduce"),
                           "round_trip_allreduce": round_trip(rank, "allreduce"),
                           "restart": restart(rank)}
    if n >= 3:
        res.update({"exact_gossip": exact(rank, "gossip", 2),
                    "gq8_gossip": gq8_records(rank, "gossip", 4, 32, 0.0),
                    "consensus": consensus(rank),
                    "consensus_rotated": consensus(rank, 4, "hadamard"),
                    "converge_gossip": converge(rank, "gossip"),
                    "round_trip_gossip": round_trip(rank, "gossip")})
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(res, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
