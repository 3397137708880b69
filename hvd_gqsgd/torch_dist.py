r"""Global-QSGD over ``torch.distributed``: the state and the collective steps that the DDP
communication hook (:mod:`hvd_gqsgd.ddp`) and the FSDP2 reduce-scatter
(:mod:`hvd_gqsgd.fsdp`) share.  Needs torch only, no Horovod.

The Horovod path runs its rounds through :class:`hvd_gqsgd.engine.Engine`; here the framework
calls us once per gradient buffer (a DDP bucket, an FSDP reduce-scatter input), so each call
is one self-contained piece of the scheme, built from these steps:

1. :func:`exchange_scales` (COLLECTIVE, float64 MAX ``all_reduce``): every scale segment's
   local norm (:meth:`TorchLocal.local_norms <hvd_gqsgd.torch_ops.TorchLocal.local_norms>`),
   maxed over the group: the global scale ``s`` per segment, the same on every rank.
2. Flat sum, :func:`sum_chunks` (COLLECTIVE, async int64 SUM ``all_reduce`` per chunk):
   codes with ``L = core.levels(bits, n)`` levels in ``bits``-wide lanes.
3. Stage 1 of two-stage, :func:`scatter_rows` + :func:`reduce_scatter` (COLLECTIVE, async
   int64 SUM reduce-scatter): codes with ``L1 = core.two_stage_levels(bits, n)`` levels in
   ``w = core.two_stage_bits(bits, n)``-wide lanes, one row of whole words per rank, so rank
   ``r`` receives the exact lane sums of row ``r``.  FSDP2 stops here (it keeps the shard);
   DDP's two-stage hook goes on to requantize and allgather (:mod:`hvd_gqsgd.two_stage`).

Every formula is :mod:`hvd_gqsgd.core`'s; the local work is
:class:`~hvd_gqsgd.torch_ops.TorchLocal`'s (the numba kernels on CPU, torch ops elsewhere).

Hazards:
    * Collective order: every rank must call these in the same order, from one thread (Gloo
      tags collectives by issue order).
    * The group: both hooks reduce over the group their framework hands them; a rank outside
      it gets a ``ValueError``.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with real objects, and ddp.py builds on the classes here.
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import core
from .engine import FIGURES, Stats
from .torch_ops import TorchLocal, TorchOps

__all__ = ["GLOO_REDUCE_SCATTER", "OPS", "Transport", "exchange_scales", "reduce_scatter",
           "scatter_rows", "sum_chunks"]

OPS = TorchOps()  # the core's primitives as torch ops
_SEGMENT_LAYOUTS = 64  # segment layouts a transport remembers

# How a Gloo group reduce-scatters (benchmarks/ddp_bench.py measures both): "all_to_all"
# (default) or "reduce_scatter", torch's reduce_scatter_single, which Gloo runs as a whole
# all_reduce of the input, and blocking: its work has no future
GLOO_REDUCE_SCATTER = "all_to_all"
# torch >= 2.13 names them *_single; earlier releases only have the older names
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class _Step:
    """Figures of the step in progress (one DDP step: several buckets, possibly decoded on
    the backend's threads, so guarded by ``Transport._lock``)."""

    figures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIGURES, 0))
    tensors: int = 0
    pending: int = 0  # pieces begun and not yet ended
    closing: bool = False  # the step's last piece has begun


class Transport:
    """What a torch.distributed entry point keeps between calls: settings, the rank's noise
    stream, the figures.  The DDP hook's :class:`~hvd_gqsgd.ddp.GlobalQSGDState` and the FSDP2
    hook's :class:`~hvd_gqsgd.fsdp.FSDPState` are this, plus their framework's details.

    Checkpointing: pickles (``torch.save``) without its process group and without anything
    derived; the noise serial survives, so a loaded state continues its noise stream, and the
    key base is re-derived from the loading rank, so a rank-0 checkpoint loaded on every rank
    still gives independent noise."""

    _TRANSIENT: tuple[str, ...] = ("process_group", "_key_base", "_segments", "_lock", "_step",
                                   "_local")

    def __init__(self, settings: core.Settings, process_group: Any = None) -> None:
        # settings: validated once (core.Settings), immutable
        self.settings = settings
        self.process_group = process_group  # None: the group the framework hands the call
        # cumulative figures (engine.Stats): one round per DDP step, per FSDP reduce-scatter
        self.stats = Stats()
        # noise: piece k of this rank is keyed core.noise_key(base, serial); base comes from
        # (seed, rank) at the first piece, the serial survives checkpoints
        self._key_serial = 0
        # Settings.rotation: pieces rotated so far, the counter of the shared sign keys
        # (every rank calls in the same order, so every rank counts alike; checkpointed)
        self._rotation_serial = 0
        self._reset_transient()

    def _reset_transient(self) -> None:
        self._key_base: int | None = None
        self._segments: dict[tuple[int, ...], tuple[tuple[int, ...], list[int]]] = {}
        self._lock = threading.Lock()  # guards _step: DDP decodes run on the backend's threads
        self._step = _Step()
        # local steps: kernels or torch ops, drawing their keys from this state (next)
        self._local = TorchLocal(self.settings.seed, keys=self)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None  # the default (or the framework's) group, read at the call
        self._reset_transient()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this state: the settings (checked on load),
        the noise serial and the figures."""
        return {"settings": dataclasses.asdict(self.settings), "key_serial": self._key_serial,
                "rotation_serial": self._rotation_serial,
                "stats": dataclasses.asdict(self.stats)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` of a state with the same settings (else
        ``ValueError``); the noise continues its stream."""
        mine = dataclasses.asdict(self.settings)
        if state_dict["settings"] != mine:
            raise ValueError(f"the checkpoint's settings {state_dict['settings']} differ from "
                             f"this state's {mine}")
        self._key_serial = int(state_dict["key_serial"])
        self._rotation_serial = int(state_dict["rotation_serial"])
        self.stats = Stats(**state_dict["stats"])

    def group_size(self, group: Any) -> int:
        size = dist.get_world_size(group)
        if size < 1:  # torch answers -1 on a rank outside the group
            raise ValueError(f"this rank ({dist.get_rank()}) is not in {type(self).__name__}'s "
                             "process_group: build the state (and the model wrapper) only on the "
                             "group's ranks")
        return size

    def next(self, rank: int) -> int:
        """The noise-key stream interface of :class:`hvd_gqsgd.core.NoiseKeys`: this rank's
        64-bit key for the next piece (``rank`` is already in the base)."""
        if self._key_base is None:
            self._key_base = core.rank_seed(self.settings.seed, dist.get_rank())
        self._key_serial += 1
        return core.noise_key(self._key_base, self._key_serial)

    def rotation(self) -> tuple[int, int] | None:
        """``(block, key)`` of the next piece's rotation (``Settings.rotation``), the same on
        every rank; None when the settings rotate nothing."""
        block = core.rotation_block(self.settings)
        if not block:
            return None
        self._rotation_serial += 1
        return block, core.rotation_key(self.settings.seed, 0, self._rotation_serial)

    def segments(self, numels: Sequence[int]) -> tuple[tuple[int, ...], list[int]]:
        """``core.segments`` of these tensor sizes at the settings' scale block, cached: a
        framework's buffers keep their layout from step to step."""
        key = tuple(numels)
        cached = self._segments.get(key)
        if cached is None:
            if len(self._segments) >= _SEGMENT_LAYOUTS:  # layouts that never repeat
                self._segments.clear()
            cached = self._segments[key] = core.segments(numels, self.settings.scale_block)
        return cached

    # ------------------------------------------------------------------ figures

    def begin(self, tensors: int, last: bool, figures: dict[str, float]) -> None:
        """A piece of the step has launched its last collective (``last``: no piece of this
        step comes after it)."""
        with self._lock:
            self._step.pending += 1
            self._step.tensors += tensors
            self._step.closing |= last
            self._add(figures)

    def end(self, figures: dict[str, float]) -> None:
        """A piece is decoded; the step's round is recorded once its last piece is."""
        with self._lock:
            step = self._step
            self._add(figures)
            step.pending -= 1
            if step.closing and step.pending == 0:
                self.stats.add_round(step.figures, step.tensors)
                self._step = _Step()

    def _add(self, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            self._step.figures[name] += value


def exchange_scales(state: Transport, flat: torch.Tensor, counts: Sequence[int],
                    group: Any, rotation: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Steps 1-2, COLLECTIVE (blocking float64 MAX ``all_reduce``): the global scale of every
    segment of ``flat`` (``counts``: elements per segment), ``inf`` where any rank's segment
    holds NaN/Inf.  With ``rotation`` (``Transport.rotation``), ``flat`` (a buffer the hook
    owns: DDP's bucket, FSDP's input, or their fp32 copy) is rotated first, in place on CPU,
    and the norms are the rotated blocks'.  Returns the buffer to quantize, the scales and
    the seconds spent waiting for the exchange."""
    local, norm = state._local, state.settings.norm
    if rotation is None:
        norms = local.local_norms(None, flat, counts, norm, [])
    else:
        flat, norms = local.rotate_norms(flat, counts, *rotation, norm, [], in_place=True)
    start = time.perf_counter()
    dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=group)
    return flat, norms, time.perf_counter() - start


def sum_chunks(state: Transport, flat: torch.Tensor, scales: torch.Tensor,
               counts: Sequence[int], n_levels: int, divisor: float, group: Any
               ) -> tuple[list[torch.futures.Future], float]:
    """Flat Global-QSGD of ``flat`` in place, COLLECTIVE: quantize and pack chunk by chunk
    (``Settings.chunk_bytes``; ``None``: 2 MiB chunks on CPU, one on CUDA), launch each
    chunk's async SUM ``all_reduce`` as soon as it is packed, and decode it into its slice of
    ``flat`` (divided by ``divisor``: Average) in the future's callback, so chunks overlap
    the wire.  Returns the futures, which resolve to ``(arrival time, seconds decoding)``
    (chunks write disjoint slices, so their callbacks may run concurrently), and when the
    first chunk was launched."""
    local, bits = state._local, state.settings.bits
    steps = core.step_sizes(OPS, scales, n_levels) / divisor  # value of one summed code
    mult = core.multipliers(OPS, scales, n_levels).to(flat.dtype)  # L / s per segment
    chunk_bytes = state.settings.chunk_bytes
    if chunk_bytes is None:
        chunk_bytes = core.AUTO_CHUNK_BYTES if local._fused(flat) else 0
    futures, launched = [], 0.0
    for c in core.chunk_plan(counts, bits, chunk_bytes):
        words = local.encode(flat[c.lo:c.hi], mult[c.first:c.stop], c.counts, n_levels, bits,
                             dist.get_rank())
        work = dist.all_reduce(words, op=dist.ReduceOp.SUM, group=group, async_op=True)
        futures.append(work.get_future().then(
            _chunk_decoder(local, flat[c.lo:c.hi], steps[c.first:c.stop], c.counts, bits)))
        if len(futures) == 1:
            launched = time.perf_counter()  # the wire starts working here
    return futures, launched


def _chunk_decoder(local: TorchLocal, out: torch.Tensor, steps: torch.Tensor,
                   counts: Sequence[int], bits: int
                   ) -> Callable[[torch.futures.Future], tuple[float, float]]:
    def decode(future: torch.futures.Future) -> tuple[float, float]:
        arrived = time.perf_counter()
        # as the kernels do: lane sum * float(step), rounded once
        local.unpack_scaled(future.value()[0], bits, out, counts, steps.to(out.dtype))
        return arrived, time.perf_counter() - arrived

    return decode


def scatter_rows(state: Transport, flat: torch.Tensor, scales: torch.Tensor,
                 rows: Sequence[core.Chunk], row_words: int, n_levels: int, lane_bits: int
                 ) -> torch.Tensor:
    """Stage 1's local half: every row of ``flat`` (``rows``: element ranges with their scale
    segments, ``Chunk.first:stop`` indexing ``scales``) quantized with ``n_levels`` levels and
    packed in ``lane_bits``-wide lanes into its own ``row_words`` int64 words (zero-padded),
    row ``r`` at words ``[r * row_words, (r + 1) * row_words)``: the input of
    :func:`reduce_scatter`.  One noise key per row."""
    local, rank = state._local, dist.get_rank()
    mult = core.multipliers(OPS, scales, n_levels).to(flat.dtype)
    if len(rows) == 1:
        row = rows[0]
        return local.encode(flat[row.lo:row.hi], mult[row.first:row.stop], row.counts,
                            n_levels, lane_bits, rank, pad_to=row_words)
    words = torch.empty(len(rows) * row_words, dtype=torch.int64, device=flat.device)
    for r, row in enumerate(rows):
        local.encode(flat[row.lo:row.hi], mult[row.first:row.stop], row.counts, n_levels,
                     lane_bits, rank, out=words[r * row_words:(r + 1) * row_words])
    return words


PIECE_BYTES = 4 << 20  # Gloo, blocking: bytes of every rank's words per all_to_all


def reduce_scatter(words: torch.Tensor, shard_words: int, group: Any,
                   wait: bool = False) -> torch.futures.Future:
    """COLLECTIVE: the int64 SUM reduce-scatter of ``words`` (``n * shard_words``), as a
    future of this rank's ``shard_words`` summed words.  NCCL: ``reduce_scatter``.  Gloo,
    whose ``reduce_scatter`` runs a full all_reduce (twice the bytes) and blocks
    (``GLOO_REDUCE_SCATTER``): an ``all_to_all`` of the shards, then the int64 sum of the
    ``n`` received copies (every lane then holds ``n`` codes inside its bound).

    ``wait`` (the FSDP2 hook, which needs the shard before it returns): issued blocking, so
    on CUDA the work is only queued on the current stream (no host wait), and on Gloo the
    all_to_all goes in pieces of ``PIECE_BYTES``, so that the receive buffer is a piece, not
    a second copy of the words.  Otherwise (the DDP hook) asynchronous, one piece."""
    n = words.numel() // shard_words
    gloo = dist.get_backend(group) == dist.Backend.GLOO
    if not gloo or GLOO_REDUCE_SCATTER == "reduce_scatter":
        out = torch.empty(shard_words, dtype=torch.int64, device=words.device)
        blocking = gloo or wait
        work = _reduce_scatter_single(out, words, op=dist.ReduceOp.SUM, group=group,
                                      async_op=not blocking)
        if blocking:  # Gloo's reduce_scatter work has no future (Work::getFuture)
            return _done(out)
        return work.get_future().then(lambda _: out)
    if wait:
        out = torch.empty(shard_words, dtype=torch.int64, device=words.device)
        rows = words.view(n, shard_words)
        step = max(1, PIECE_BYTES // (8 * n))
        for lo in range(0, shard_words, step):
            piece = rows[:, lo:lo + step].contiguous()
            received = torch.empty_like(piece)
            dist.all_to_all_single(received, piece, group=group)
            torch.sum(received, 0, out=out[lo:lo + piece.shape[1]])
        return _done(out)
    received = torch.empty_like(words)
    work = dist.all_to_all_single(received, words, group=group, async_op=True)
    return work.get_future().then(lambda _: received.view(n, shard_words).sum(0))


def _done(value: torch.Tensor) -> torch.futures.Future:
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(value)
    return done
