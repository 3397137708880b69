"""GlobalQSGD's engine on one rank, with collectives that hand back their input at once: the
engine's and the PyTorch backend's local work alone, without Horovod and without the noise
of its waits.  Shared by benchmarks/small_tensors.py (``floorcpu``'s busy work) and
studies/engine_cpu.py (the engine's CPU a round).

    engine = Engine(Local(seed=0), core.Settings(bits=8), None, uid=0)
    compress_s, decompress_s = split_round(engine, gradients(32, 150))

Set ``NUMBA_NUM_THREADS`` before importing this module (it imports the kernels' numba):
one thread is what a rank gets with 2 ranks on 2 cores.
"""

from __future__ import annotations

import time

import torch

from hvd_gqsgd import core
from hvd_gqsgd.engine import Engine
from hvd_gqsgd.torch_ops import TorchLocal

__all__ = ["Local", "gradients", "split_round"]


class _OneRank:
    def included(self) -> bool:
        return True

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


class Local(TorchLocal):
    """One rank's collectives: a MAX or Sum over one rank is its input, there at once."""

    def global_process_set(self) -> _OneRank:
        return _OneRank()

    def allreduce_max_async(self, vec, name, process_set):
        return vec

    def allreduce_sum_async(self, words, name, process_set):
        return words

    def poll(self, handle) -> bool:
        return True

    def wait(self, handle):
        return handle

    def auto_bucket_bytes(self) -> int:
        return core.AUTO_BUCKET_BYTES


def gradients(width: int, depth: int) -> list[torch.Tensor]:
    """The model's gradients in the order backward produces them (last layer first)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    model(torch.randn(16, width)).square().mean().backward()
    return [p.grad for p in model.parameters()][::-1]


def split_round(engine: Engine, grads: list[torch.Tensor]) -> tuple[float, float]:
    """One round under DistributedOptimizer's call pattern: seconds in all its ``compress``
    calls, and in all its ``decompress`` calls."""
    start = time.perf_counter()
    out = [engine.compress(g) for g in grads]
    middle = time.perf_counter()
    for probe, ctx in out:
        engine.decompress(probe, ctx)
    return middle - start, time.perf_counter() - middle
