"""Worker of tests/test_cuda.py: GlobalQSGD through real Horovod (one rank, ``hvd.init()``
without horovodrun) on CUDA tensors, or CPU tensors when GQSGD_TEST_DEVICE=cpu.

    python cuda_horovod.py OUT.pkl

Writes a dict to OUT.pkl: ``skip`` (why nothing ran: no horovod.torch, or a Horovod built
without CUDA) or, per dtype, the results of ``hvd.allreduce`` (a round per tensor) and of
``hvd.grouped_allreduce`` (one round of all the tensors) with GlobalQSGD(8) and op=Average.
(``hvd.DistributedOptimizer`` reduces nothing at one rank.)  No expected value is computed
here.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
from cuda_inputs import DTYPES, device_kind, host, inputs, tensor

from hvd_gqsgd import GlobalQSGD, core


def run() -> dict:
    try:
        import horovod.torch as hvd
    except ImportError as e:
        return {"skip": f"horovod.torch is not importable ({e})"}
    cuda = device_kind() == "cuda"
    if cuda and not hvd.cuda_built():
        return {"skip": "this Horovod was built without CUDA (HOROVOD_GPU_OPERATIONS=NCCL, "
                        "as docker/Dockerfile.gpu builds it)"}
    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    out: dict = {"size": hvd.size()}
    levels = core.levels(8, hvd.size())
    for dtype in DTYPES:
        xs = [tensor(x, dtype, device) for x in inputs(hvd.rank(), levels, 0)]
        compression = GlobalQSGD(bits=8, seed=1)
        reduced = [hvd.allreduce(x, compression=compression, op=hvd.Average,
                                 name=f"cuda.{dtype}.{i}") for i, x in enumerate(xs)]
        grouped = hvd.grouped_allreduce(xs, compression=compression, op=hvd.Average,
                                        name=f"cuda.{dtype}.grouped")
        out[dtype] = {"allreduce": [host(y) for y in reduced],
                      "grouped": [host(y) for y in grouped],
                      "on_device": all(y.device == device and y.dtype == x.dtype
                                       and y.shape == x.shape
                                       for y, x in zip(reduced + grouped, xs + xs)),
                      "rounds": compression.stats.rounds}
    hvd.shutdown()
    return out


if __name__ == "__main__":
    Path(sys.argv[1]).write_bytes(pickle.dumps(run()))
