"""Runs on every rank under horovodrun: passes the compressor *class* where an instance
belongs (``compression=GlobalQSGD``, as Horovod's own ``hvd.Compression.fp16`` is written)
and records where it failed and with what message, then trains one step with an instance.

``argv``: ``out_dir framework`` (``torch`` or ``tf``; one framework per process, see the
import-order trap in the README).  tests/test_class_slip.py checks what is recorded; no
checking happens here.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

from hvd_gqsgd import GlobalQSGD, QSGDAllgather


def attempt(steps: Iterator[str]) -> dict:
    """Run a scenario, a generator that yields the name of each stage before entering it:
    ``{"at": stage, "type": ..., "message": ...}`` of the TypeError it raised (stage
    "construction" before its first yield), or ``{"at": None}`` when it ran through."""
    at = "construction"
    try:
        for stage in steps:
            at = stage
    except TypeError as exc:
        return {"at": at, "type": type(exc).__name__, "message": str(exc)}
    return {"at": None}


def torch_cases() -> tuple[dict, Any]:
    import horovod.torch as hvd
    import torch

    from hvd_gqsgd.qprsgd import QPRSGD

    hvd.init()
    torch.manual_seed(0)

    def optimizer(cls: Any) -> Iterator[str]:
        net = torch.nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters(),
                                       compression=cls)
        yield "backward"
        net(torch.ones(3, 4)).sum().backward()
        yield "step"
        opt.step()

    def allreduce(cls: Any) -> Iterator[str]:
        yield "allreduce"
        hvd.allreduce(torch.ones(8), compression=cls, name=f"slip.{cls.__name__}")

    def qprsgd(cls: Any) -> Iterator[str]:
        net = torch.nn.Linear(4, 2)
        QPRSGD(torch.optim.SGD(net.parameters(), lr=0.1), net.parameters(), compression=cls)
        yield "after construction"

    out = {f"{case.__name__}/{cls.__name__}": attempt(case(cls))
           for case in (optimizer, allreduce) for cls in (GlobalQSGD, QSGDAllgather)}
    out["qprsgd/GlobalQSGD"] = attempt(qprsgd(GlobalQSGD))
    # an instance, after all that, trains: every rank applies the same averaged gradient
    net = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    out["instance_start"] = net.weight.detach().numpy().copy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(),
                                   compression=GlobalQSGD(bits=8))
    net(torch.full((3, 4), float(hvd.rank() + 1))).sum().backward()
    opt.step()
    out["instance_weights"] = net.weight.detach().numpy().copy()
    return {"rank": hvd.rank(), "size": hvd.size(), **out}, hvd


def tf_cases() -> tuple[dict, Any]:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from hvd_gqsgd.keras import DistributedOptimizer

    hvd.init()
    var = tf.Variable(tf.ones(4))

    def tape(cls: Any) -> Iterator[str]:
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(var * var)
        t = hvd.DistributedGradientTape(t, compression=cls)
        yield "gradient"
        t.gradient(loss, [var])

    def keras_optimizer(cls: Any) -> Iterator[str]:
        DistributedOptimizer(keras.optimizers.SGD(0.1), compression=cls)
        yield "after construction"

    out = {f"tape/{cls.__name__}": attempt(tape(cls)) for cls in (GlobalQSGD, QSGDAllgather)}
    out["keras/GlobalQSGD"] = attempt(keras_optimizer(GlobalQSGD))
    return {"rank": hvd.rank(), "size": hvd.size(), **out}, hvd


def main() -> None:
    out_dir, framework = sys.argv[1], sys.argv[2]
    results, hvd = torch_cases() if framework == "torch" else tf_cases()
    with open(os.path.join(out_dir, f"rank{results['rank']}.pkl"), "wb") as f:
        pickle.dump(results, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
