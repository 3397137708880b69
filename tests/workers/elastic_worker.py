"""Horovod elastic training with GlobalQSGD while the world grows from 2 to 3 ranks.

Usage: ``elastic_worker.py OUT_DIR HOSTS_FILE``.  Rank 0 rewrites the host-discovery file to
``localhost:3`` at step ``GROW_AT``; Horovod then resets and a third rank joins.  The same
compressor object is used before and after, so its levels must follow the new size.  Every
step, each rank appends one JSON line to ``OUT_DIR/rank{r}.{pid}.jsonl``: the world size, the
parameters' hash, and two ``hvd.allreduce(op=Sum)`` results through the compressor whose
exact values tests/test_faults.py knows.  No checking happens here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from inputs import grid_input  # noqa: E402

from hvd_gqsgd import GlobalQSGD  # noqa: E402

GROW_AT = 3
STEPS_AT_FULL_SIZE = 4
DEADLINE_S = 120  # stop (and let the test fail on the missing size) if no resize comes


def main() -> None:
    out, hosts_file = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    comp = GlobalQSGD(bits=8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                   named_parameters=net.named_parameters(), compression=comp)
    state = hvd.elastic.TorchState(model=net, optimizer=opt, step=0, full_steps=0)
    log_path = os.path.join(out, f"rank{hvd.rank()}.{os.getpid()}.jsonl")
    start = time.monotonic()

    @hvd.elastic.run
    def train(state) -> None:
        while state.full_steps < STEPS_AT_FULL_SIZE and time.monotonic() - start < DEADLINE_S:
            rank, size = hvd.rank(), hvd.size()
            gen = torch.Generator().manual_seed(1000 * state.step + rank)
            opt.zero_grad()
            net(torch.randn(16, 32, generator=gen)).pow(2).mean().backward()
            opt.step()
            # Every element at +-max: each rank's codes are exactly +-L, so the lane sums are
            # +-size*L, which overflow a lane unless L was chosen for the current size.
            extremes = torch.ones(64)
            extremes[1::2] = -1.0
            ext = hvd.allreduce(extremes, op=hvd.Sum, compression=comp, name="elastic.ext")
            grid = hvd.allreduce(torch.tensor(grid_input(rank, size, 8)), op=hvd.Sum,
                                 compression=comp, name="elastic.grid")
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                             for p in net.parameters())).hexdigest()[:16]
            with open(log_path, "a") as log:
                log.write(json.dumps({"step": state.step, "rank": rank, "size": size,
                                      "levels": comp.levels(size), "hash": digest,
                                      "ext": ext.tolist(), "grid": grid.tolist()}) + "\n")
            if state.step == GROW_AT and rank == 0:
                with open(hosts_file, "w") as f:
                    f.write("localhost:3\n")
            state.step += 1
            if size == 3:
                state.full_steps += 1
            time.sleep(0.2)  # give the driver's discovery poll time to see the new host
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
