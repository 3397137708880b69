"""PyTorch adapter: translates :mod:`hvd_gqsgd.core` primitives into torch ops and Horovod's
torch collectives.  No formula lives here.

Importing this module imports ``torch`` and ``horovod.torch``.  Do not import it in a
TensorFlow program (importing ``horovod.torch`` after ``horovod.tensorflow`` is initialised
breaks TensorFlow's global process set); ``hvd_gqsgd.GlobalQSGD`` loads it only when a torch
tensor arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import horovod.torch as hvd
import torch

from . import core
from .compressor import GlobalQSGD
from .qprsgd import QPRSGD
from .torch_ops import TorchLocal

__all__ = ["GlobalQSGD", "QPRSGD", "TorchBackend"]


class TorchBackend(TorchLocal):
    """:class:`hvd_gqsgd.engine.Backend` for PyTorch tensors (CPU or CUDA): the local steps of
    :class:`hvd_gqsgd.torch_ops.TorchLocal` plus Horovod's torch collectives."""

    # --- Horovod
    def global_process_set(self) -> Any:
        return hvd.global_process_set

    def allreduce_max(self, vec: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce(vec, op=hvd.Max, name=name, process_set=process_set)

    def allreduce_max_async(self, vec: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce_async(vec, op=hvd.Max, name=name, process_set=process_set)

    def poll(self, handle: Any) -> bool:
        return bool(hvd.poll(handle))

    def auto_bucket_bytes(self) -> int:
        # Sealed from compress, which DistributedOptimizer calls from each gradient's backward
        # hook: a deep model's codes go on the wire while backward still runs
        return core.AUTO_BUCKET_BYTES

    def allreduce_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        # in place: the words are ours, and a second buffer would cost another allocation
        return hvd.allreduce_async_(words, op=hvd.Sum, name=name, process_set=process_set)

    def allgather_async(self, tensor: Any, name: str, process_set: Any) -> Any:
        return hvd.allgather_async(tensor, name=name, process_set=process_set)

    def wait(self, handle: Any) -> Any:
        return hvd.synchronize(handle)

    def reducescatter_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        # equal shards: the words are world_size * shard_words long (core.TwoStagePlan)
        return hvd.reducescatter_async(words, name=name, op=hvd.Sum, process_set=process_set)

    # --- hierarchical (hvd_gqsgd.hierarchical)
    def topology(self) -> tuple[int, int, int, int]:
        return hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()

    def alltoall(self, t: Any, splits: Sequence[int], name: str, process_set: Any) -> Any:
        handle = hvd.alltoall_async(t, torch.tensor(list(splits), dtype=torch.int32), name=name,
                                    process_set=process_set)
        return hvd.synchronize(handle)[0]  # (output, received splits)
