"""Several fake Horovod ranks in one process, one thread each, for the engine's multi-rank
paths on one device (tests/test_cuda.py: flat and two-stage at several ranks, hierarchical
on 2 nodes of 2 ranks, with every rank's tensors on the same GPU).

Each rank's backend is the torch backend's local half (:class:`TorchLocal`, the very class
``hvd_gqsgd.torch.TorchBackend`` extends) plus collectives that meet by name: a rank's k-th
call of a name joins every other rank's k-th call of it, and the collective completes when
the last rank arrives (as Horovod matches collectives by name).  Results are computed here
with plain torch ops: a sum, a max, a concatenation.  Horovod's node layout comes from
``local_size``: rank ``r`` is local rank ``r % local_size`` of node ``r // local_size``.

A rank that raises marks the world broken, so the others stop waiting and fail too; every
wait is bounded by ``timeout`` seconds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hvd_gqsgd import core
from hvd_gqsgd.torch_ops import TorchLocal

__all__ = ["RankBackend", "World"]


class _Set:
    """A rank's view of Horovod's global process set."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def included(self) -> bool:
        return True

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@dataclass
class _Meeting:
    """One collective: every rank's input until all arrived, then every rank's result."""

    combine: Callable[[list[Any]], list[Any]]
    parts: dict[int, Any] = field(default_factory=dict)
    results: list[Any] | None = None
    taken: int = 0


class World:
    """The collectives of ``size`` ranks (threads), ``local_size`` ranks per node."""

    def __init__(self, size: int, local_size: int | None = None, timeout: float = 120.0) -> None:
        self.size = size
        self.local_size = size if local_size is None else local_size
        assert size % self.local_size == 0
        self.timeout = timeout
        self._cond = threading.Condition()
        self._meetings: dict[tuple[str, int], _Meeting] = {}
        self._calls: list[dict[str, int]] = [{} for _ in range(size)]
        self._broken: BaseException | None = None
        self.names: set[str] = set()  # every collective started, by name

    def start(self, rank: int, name: str, value: Any,
              combine: Callable[[list[Any]], list[Any]]) -> tuple[str, int, int]:
        """Join the collective ``name`` with ``value``; a handle for :meth:`ready`/:meth:`take`."""
        with self._cond:
            self.names.add(name)
            k = self._calls[rank][name] = self._calls[rank].get(name, -1) + 1
            meeting = self._meetings.setdefault((name, k), _Meeting(combine))
            meeting.parts[rank] = value
            if len(meeting.parts) == self.size:
                meeting.results = combine([meeting.parts[r] for r in range(self.size)])
                meeting.parts = {}
                self._cond.notify_all()
        return name, k, rank

    def ready(self, handle: tuple[str, int, int]) -> bool:
        with self._cond:
            return self._meetings[handle[:2]].results is not None

    def take(self, handle: tuple[str, int, int]) -> Any:
        """Wait for the collective; this rank's result."""
        key, rank = handle[:2], handle[2]
        with self._cond:
            meeting = self._meetings[key]
            if not self._cond.wait_for(lambda: meeting.results is not None or self._broken,
                                       self.timeout):
                raise TimeoutError(f"rank {rank} waited {self.timeout} s for {key}")
            if meeting.results is None:
                raise RuntimeError(f"rank {rank}: another rank failed") from self._broken
            out = meeting.results[rank]
            meeting.taken += 1
            if meeting.taken == self.size:
                del self._meetings[key]
            return out

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        """``work(rank)`` on every rank, each in its own thread; their results in rank order.
        The first error is raised here, after every thread has stopped."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller below
                with self._cond:
                    errors.append(e)
                    self._broken = e
                    self._cond.notify_all()

        threads = [threading.Thread(target=one, args=(r,), daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout + 10)
        if errors:
            raise errors[0]
        assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
        return results


def _copies(t: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [t.clone() for _ in range(size)]


def _sum(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return _copies(torch.stack(parts).sum(0), len(parts))


def _max(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return _copies(torch.stack(parts).amax(0), len(parts))


def _scatter(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    total = torch.stack(parts).sum(0)
    return [piece.clone() for piece in total.chunk(len(parts))]  # equal shards (the engine's)


def _gather(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return _copies(torch.cat(parts), len(parts))


def _alltoall(parts: list[tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
    """Rank d receives, in sender order, what each sender's splits put at position d."""
    pieces = [t.split(splits) for t, splits in parts]
    return [torch.cat([p[d] for p in pieces]) for d in range(len(parts))]


class RankBackend(TorchLocal):
    """One rank's :class:`hvd_gqsgd.engine.Backend`: TorchLocal plus the world's collectives
    (Horovod's allreduce, reduce-scatter, allgather and alltoall as the engine, two-stage
    and hierarchical call them)."""

    def __init__(self, world: World, rank: int, seed: int) -> None:
        super().__init__(seed=seed)
        self.world, self.rank = world, rank
        self._set = _Set(rank, world.size)

    def global_process_set(self) -> _Set:
        return self._set

    def allreduce_max(self, vec: Any, name: str, pset: Any) -> Any:
        return self.wait(self.allreduce_max_async(vec, name, pset))

    def allreduce_max_async(self, vec: Any, name: str, pset: Any) -> Any:
        return self.world.start(self.rank, name, vec.clone(), _max)

    def allreduce_sum_async(self, words: Any, name: str, pset: Any) -> Any:
        return self.world.start(self.rank, name, words.clone(), _sum)

    def reducescatter_sum_async(self, words: Any, name: str, pset: Any) -> Any:
        return self.world.start(self.rank, name, words.clone(), _scatter)

    def allgather_async(self, tensor: Any, name: str, pset: Any) -> Any:
        return self.world.start(self.rank, name, tensor.clone(), _gather)

    def poll(self, handle: Any) -> bool:
        return self.world.ready(handle)

    def wait(self, handle: Any) -> Any:
        return self.world.take(handle)

    def auto_bucket_bytes(self) -> int:
        return core.AUTO_BUCKET_BYTES

    def topology(self) -> tuple[int, int, int, int]:
        local = self.world.local_size
        return self.rank % local, local, self.rank // local, self.world.size // local

    def alltoall(self, t: Any, splits: Sequence[int], name: str, pset: Any) -> Any:
        return self.wait(self.world.start(self.rank, name, (t.clone(), list(splits)),
                                          _alltoall))

    def average(self, probe: Any, name: str) -> None:
        """Horovod's own allreduce of a probe, op=Average, in place (as it reduces the
        tensor that compress returned)."""
        probe.copy_(self.wait(self.world.start(self.rank, name, probe.clone(), _sum))
                    / self.world.size)
