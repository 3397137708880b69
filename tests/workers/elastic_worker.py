"""Horovod elastic training with GlobalQSGD while the world changes under it.

Usage: ``elastic_worker.py OUT_DIR HOSTS_FILE SCENARIO AT STEPS``, where SCENARIO is

* ``grow``: rank 0 rewrites the host-discovery file to ``localhost:3`` at step ``AT``;
  Horovod then resets between two steps and a third rank joins.  The same compressor object
  is used before and after, so its levels must follow the new size.  The job ends after
  ``STEPS`` steps at 3 ranks.
* ``replace``: the job starts on ``localhost:2`` plus ``127.0.0.1:1``.  Rank 0 offers a third
  slot on localhost at step ``AT - 1`` (``--max-np 3`` keeps it unused), and at step ``AT``
  the rank on 127.0.0.1 dies in its first gradient hook, while the others compress that
  step and seal buckets (small ``bucket_bytes``) whose exchanges can never finish.
  Horovod elastic blacklists 127.0.0.1, the survivors restore their state and reset, and a
  new process takes the free localhost slot: in the repeated step it starts with a fresh
  compressor, next to survivors whose compressor holds the dead step (or, if the driver
  starts it later, at a later step, after the survivors went on at 2 ranks).
  The job ends after ``STEPS`` steps in all.

Every step, each rank appends one JSON line to ``OUT_DIR/rank{r}.{pid}.jsonl``: the world
size, the parameters' hash, the compressor's finished rounds, and two
``hvd.allreduce(op=Sum)`` results through the compressor whose exact values
tests/test_faults.py knows.  No checking happens here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import horovod.torch as hvd
import torch

from gqsgd_lab.inputs import grid_input
from hvd_gqsgd import GlobalQSGD

VICTIM_HOST = "127.0.0.1"
DEADLINE_S = 120  # stop (and let the test fail on what is missing) if no change comes


def main() -> None:
    out, hosts_file, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    at, steps = int(sys.argv[4]), int(sys.argv[5])
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    # replace: 1 KiB buckets, sealed (and their scale exchanges started) during backward
    comp = GlobalQSGD(bits=8, bucket_bytes=1024 if scenario == "replace" else None)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                   named_parameters=net.named_parameters(), compression=comp)
    state = hvd.elastic.TorchState(model=net, optimizer=opt, step=0, full_steps=0)
    log_path = os.path.join(out, f"rank{hvd.rank()}.{os.getpid()}.jsonl")
    victim = scenario == "replace" and os.environ.get("HOROVOD_HOSTNAME") == VICTIM_HOST
    if victim:  # the last layer's bias: its gradient is the first that backward produces
        net[2].bias.register_hook(lambda g: os._exit(1) if state.step == at else g)
    start = time.monotonic()

    def done() -> bool:
        if time.monotonic() - start > DEADLINE_S:
            return True
        return (state.full_steps if scenario == "grow" else state.step) >= steps

    @hvd.elastic.run
    def train(state) -> None:
        while not done():
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
                                      "pid": os.getpid(), "rounds": comp.stats.rounds,
                                      "levels": comp.levels(size), "hash": digest,
                                      "ext": ext.tolist(), "grid": grid.tolist()}) + "\n")
            if rank == 0 and scenario == "grow" and state.step == at:
                with open(hosts_file, "w") as f:
                    f.write("localhost:3\n")
            offer = scenario == "replace" and state.step == at - 1
            if rank == 0 and offer:
                with open(hosts_file, "w") as f:
                    f.write(f"localhost:3\n{VICTIM_HOST}:1\n")
            state.step += 1
            if size == 3:
                state.full_steps += 1
            # give the driver's discovery poll (every second) time to see the new host; before
            # the kill, long enough that the new slot is known when the rank dies
            time.sleep(2.5 if offer else 0.2)
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
