"""Trains with GlobalQSGD and logs every step, so tests/test_faults.py can kill a rank mid-run.

Usage: ``fault_worker.py OUT_DIR VICTIM KILL_STEP``.  Each rank appends one JSON line per
finished step to ``OUT_DIR/rank{r}.jsonl``: the step and a hash of the parameters after it.
Rank ``VICTIM`` SIGKILLs itself at step ``KILL_STEP`` after its backward pass, i.e. with its
compressed gradients already handed to Horovod.  A survivor that gets an exception logs its
type, message and the parameter hash at that moment, and exits 3.  No checking happens here.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

from hvd_gqsgd import GlobalQSGD

SURVIVOR_ERROR_EXIT = 3


def params_hash(net: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    out, victim, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                   named_parameters=net.named_parameters(),
                                   compression=GlobalQSGD(bits=8, seed=rank))
    gen = torch.Generator().manual_seed(rank)
    start = time.monotonic()
    with open(os.path.join(out, f"rank{rank}.jsonl"), "w") as log:
        def record(**fields) -> None:
            log.write(json.dumps({"t": time.monotonic() - start, **fields}) + "\n")
            log.flush()

        record(step=-1, hash=params_hash(net))
        for step in range(10_000):
            x = torch.randn(64, 64, generator=gen)
            opt.zero_grad()
            net(x).pow(2).mean().backward()  # hooks hand each gradient to Horovod here
            if rank == victim and step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                opt.step()
            except Exception as e:  # noqa: BLE001 -- logged for the test, then a failing exit
                record(step=step, error=type(e).__name__, message=str(e)[:2000],
                       hash=params_hash(net))
                log.close()
                os._exit(SURVIVOR_ERROR_EXIT)  # Horovod is shut down; skip its atexit hooks
            record(step=step, hash=params_hash(net))
    hvd.shutdown()


if __name__ == "__main__":
    main()
