r"""Global-QSGD as a PyTorch DDP communication hook.  Needs torch only, no Horovod::

    from hvd_gqsgd.ddp import GlobalQSGDState, global_qsgd_hook
    ddp_model.register_comm_hook(GlobalQSGDState(bits=8), global_qsgd_hook)

It mirrors ``PowerSGDState`` + ``powerSGD_hook``: a small state object (settings, the rank's
noise stream, :class:`hvd_gqsgd.engine.Stats`) and a hook that DDP calls once per gradient
bucket during backward.  The algorithm and every formula are the Horovod path's
(:mod:`hvd_gqsgd.core`, and :mod:`hvd_gqsgd.kernels` for CPU tensors); the state and the
collective steps are :mod:`hvd_gqsgd.torch_dist`'s, shared with the FSDP2 hook
(:mod:`hvd_gqsgd.fsdp`).  This module only translates a ``GradBucket`` into them and keeps
DDP's order of collectives.

Importing this module imports torch and ``torch.distributed``, never Horovod or TensorFlow.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import core, torch_dist
from . import two_stage as _two_stage
from .torch_dist import Transport

__all__ = ["GlobalQSGDState", "global_qsgd_hook"]


class GlobalQSGDState(Transport):
    """State of :func:`global_qsgd_hook` for one DDP model: a
    :class:`~hvd_gqsgd.torch_dist.Transport` (settings, the rank's noise stream,
    :class:`hvd_gqsgd.engine.Stats`) plus the two-stage buckets in flight.

    Example::

        from hvd_gqsgd.ddp import GlobalQSGDState, global_qsgd_hook

        model = DDP(model)                                   # after init_process_group
        state = GlobalQSGDState(bits=8)
        model.register_comm_hook(state, global_qsgd_hook)
        ...
        print(state.stats.as_dict())                         # bytes and seconds per step

    Args:
        process_group: the group DDP reduces over; pass DDP's ``process_group`` when it is
            not the default group (the hook cannot see which group DDP was given).
        bits: lane width, 2..16.  ``L = floor((2**(bits-1) - 1) / n)`` levels per sign at
            group size ``n``; too few bits for ``n`` raises ``ValueError`` naming the bits
            that work (here if the group is known already, else at the first bucket).
        norm: ``"max"`` or ``"l2"``: the local norm whose MAX over ranks is the scale.
        seed: ``None`` seeds each rank's rounding noise from the OS; an int makes it
            reproducible.  Either way ranks draw independent noise and torch's global RNG is
            neither read nor advanced.
        scale_block: elements per global scale inside each gradient tensor (0: one scale per
            tensor; ``None``, the default: 1024, and 64 at 4 bits and fewer, as
            :class:`hvd_gqsgd.GlobalQSGD`'s).  Each block costs 8 bytes of MAX all_reduce.
        chunk_bytes: packed bytes per SUM all_reduce.  A bucket's codes go in chunks of about
            this size, each launched as soon as it is packed and unpacked as soon as it
            arrives, so packing and unpacking overlap the wire.  ``None`` (default): 2 MiB
            chunks (``core.AUTO_CHUNK_BYTES``, 8 MB of fp32 gradient at ``bits=8``) on CPU,
            one all_reduce per bucket on CUDA; 0: one all_reduce per bucket.  Flat only.
        two_stage: ``True``: two-stage Global-QSGD (:mod:`hvd_gqsgd.two_stage`): codes in
            wide lanes summed by a reduce-scatter, each shard requantized to ``bits`` and
            all-gathered, so every rank keeps ``2**(bits-1) - 1`` levels at any group size;
            ``False``: flat; ``None`` (default): two-stage where flat would leave fewer than
            15 levels (8 bits: from 9 ranks on).  See :func:`global_qsgd_hook`.
        rotation: ``"hadamard"``, ``None`` or ``"auto"`` (default: on at 4 bits and fewer),
            as :class:`hvd_gqsgd.GlobalQSGD`'s: the bucket is rotated before its norms and
            back after decoding, with signs from ``seed`` and the hook's call count.

    Checkpointing: the state pickles (``torch.save``) without its process group, like
    ``PowerSGDState``; a loaded state uses the default group (set ``process_group`` after
    loading for a subgroup) and re-derives its noise key from its new rank, so a rank-0
    checkpoint loaded on every rank still gives independent noise.
    """

    _TRANSIENT = (*Transport._TRANSIENT, "_pending")

    def __init__(self, process_group: Any = None, bits: int = 8, norm: str = "max",
                 seed: int | None = None,
                 scale_block: int | None = None,
                 chunk_bytes: int | None = core.DEFAULT_CHUNK_BYTES,
                 two_stage: bool | None = None, rotation: str | None = "auto") -> None:
        super().__init__(core.Settings(bits=bits, norm=norm, seed=seed,
                                       scale_block=scale_block,  # type: ignore[arg-type]
                                       chunk_bytes=chunk_bytes, two_stage=two_stage,
                                       rotation=rotation),
                         process_group)
        if process_group is not None or dist.is_initialized():  # fail here, not in backward
            size = self.group_size(process_group)
            if not _two_stage.chosen(self.settings, size):
                core.levels(bits, size)

    def _reset_transient(self) -> None:
        super()._reset_transient()
        # two-stage: the buckets whose reduce-scatter is in flight, finished by the next hook
        self._pending: list[_TwoStageBucket] = []


def global_qsgd_hook(state: GlobalQSGDState,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""DDP communication hook: the bucket's average over the group, by Global-QSGD.

    For the ``n`` ranks of ``state.process_group`` and the bucket's flat buffer ``x_i``
    (DDP's concatenated gradients, fp32/fp16/bf16/fp64, CPU or CUDA):

    1. **Local norms.** Each gradient tensor of the bucket is cut into blocks of
       ``scale_block`` elements; each block's :math:`\|x_i\|_\infty` (or :math:`\|x_i\|_2`),
       ``inf`` for a block holding NaN/Inf.
    2. **Global scale** (COLLECTIVE, float64 MAX ``all_reduce``): :math:`s` per block, the
       same on every rank.
    3. **Quantize and pack** (local): :math:`L = \lfloor (2^{bits-1} - 1)/n \rfloor`,
       :math:`q = \lfloor xL/s \rfloor + [u < \mathrm{frac}(xL/s)]` with ``u`` from the rank's
       own counter-based stream (unbiased, :math:`E[q] = xL/s`); ``64 // bits`` codes per
       int64 word as signed digits.
    4. **Sum** (COLLECTIVE, async int64 SUM ``all_reduce``, one per chunk of
       ``chunk_bytes``, each launched as soon as it is packed): lane sums stay in
       :math:`[-nL, nL]`, inside a ``bits``-bit lane, so words add without carries.
    5. **Rescale** (``Future.then``, per chunk as it arrives):
       :math:`\frac{1}{n}\sum_i q_i \cdot s/L`, written into the bucket's buffer in its
       dtype.  Bit-identical on every rank.

    Bytes on the wire per element: ``8 / (64 // bits)`` (1 at 8 bits, 4x fewer than fp32)
    plus 8 per block for step 2.

    **Two-stage** (``state.settings.two_stage``, by default where flat would leave fewer than
    15 levels: :mod:`hvd_gqsgd.two_stage`): steps 3-5 become (3') codes in lanes wide enough
    for ``2**(bits-1) - 1`` levels per rank, (4') an async int64 SUM reduce-scatter (NCCL:
    ``reduce_scatter``; Gloo: ``all_to_all`` of the shards plus a local sum, since Gloo's
    ``reduce_scatter`` runs a whole ``all_reduce``), (5') each rank requantizes its shard's
    exact sum to ``bits`` and an async ``all_gather`` shares every shard; its callback decodes
    the average into the bucket.  The allgather of bucket ``k`` is launched by the hook of
    bucket ``k + 1`` (collectives stay on the autograd thread, in bucket order, see below), so
    bucket ``k``'s reduce-scatter runs during the next bucket's backward; the last bucket's
    hook finishes its own.  About ``(64 / (64 // w) + bits) / 2`` bits per element (8.6 at 2
    ranks and 8 bits, 10.4 at 8-16).

    Hazards:
        * Collective order.  All all_reduces are issued here, on the autograd thread, in
          bucket order.  Ranks must issue collectives in one order (Gloo tags them by issue
          order), and a ``Future.then`` callback of a Gloo all_reduce runs on a Gloo worker
          thread whenever it completes: launching the Sum from the MAX's callback races with
          the next bucket's hook and with DDP's own all_reduce of unused-parameter flags.
          Seen here: such a hook on 2 Gloo ranks failed with "Received data size doesn't
          match expected size", and so did ``powerSGD_hook`` (which chains its collectives
          that way) with DDP's default 25 MB buckets.  The MAX is small (8 bytes per block)
          and its wait is one round trip; the Sum, the bulk of the bytes, overlaps the rest
          of backward.
        * NaN/Inf in a block on any rank: that block is NaN on every rank, so AMP's
          ``GradScaler`` skips the step everywhere.
        * The group: ``state.process_group`` must be the group DDP was given.
        * Memory, torch-ops path (CUDA): while a bucket is quantized, a multiplier, a
          uniform and a code per element exist at once; nothing per element outlives it.

    Tuning: ``bits=8`` sends 4x fewer bytes than fp32 and keeps 63 levels at 2 ranks, 15 at
    8; ``bits=4`` halves the bytes again with far coarser steps (3 levels at 2 ranks).  A
    smaller ``scale_block`` follows the gradient's magnitude more closely for 8 more bytes of
    MAX all_reduce per block.  Each bucket costs one MAX round trip on the autograd thread,
    so very small ``bucket_cap_mb`` values pay for it many times per step.

    Example::

        ddp_model.register_comm_hook(GlobalQSGDState(bits=8), global_qsgd_hook)
    """
    start = time.perf_counter()
    bits, group = state.settings.bits, state.process_group
    size = state.group_size(group)
    two = _two_stage.chosen(state.settings, size)
    n_levels = 0 if two else core.levels(bits, size)  # ValueError naming the bits that work
    buffer = bucket.buffer()
    numels = [g.numel() for g in bucket.gradients()]
    counts, _ = state.segments(numels)
    if sum(numels) != buffer.numel():
        raise RuntimeError(f"GlobalQSGD: the bucket's gradients hold {sum(numels)} elements "
                           f"but its buffer {buffer.numel()}; DDP's bucket layout changed")
    # fp16/bf16 are quantized in fp32 (a copy); fp32/fp64 buffers are read in place
    flat = buffer if buffer.dtype in (torch.float32, torch.float64) else buffer.float()
    rotation = state.rotation()
    flat, norms, waited = torch_dist.exchange_scales(state, flat, counts, group,
                                                     rotation)  # COLLECTIVE
    exchanged = time.perf_counter()
    local_s = exchanged - start - waited
    if two:
        return _two_stage_hook(state, bucket, buffer, flat, numels, counts, norms, size,
                               (local_s, waited), rotation)
    decoded, launched = torch_dist.sum_chunks(state, flat, norms, counts, n_levels, size,
                                              group)  # COLLECTIVE
    state.begin(len(numels), bucket.is_last(), {
        "uncompressed": buffer.numel() * buffer.element_size(),
        "payload": core.wire_bytes(buffer.numel(), bits), "overhead": 8 * len(counts),
        "quantize_s": local_s + (launched - exchanged), "scale_wait_s": waited})
    return torch.futures.collect_all(decoded).then(
        _finisher(state, buffer, flat, counts, rotation, launched))


def _into_buffer(state: GlobalQSGDState, buffer: torch.Tensor, flat: torch.Tensor,
                 counts: Sequence[int], rotation: tuple[int, int] | None) -> None:
    """The decoded bucket, rotated back with ``rotation``, into DDP's buffer (from ``flat``,
    its fp32 copy for fp16/bf16 or a rotated copy on the torch-ops path)."""
    if rotation is not None:
        flat = state._local.unrotate(flat, counts, *rotation)
    if flat is not buffer:
        buffer.copy_(flat)


def _finisher(state: GlobalQSGDState, buffer: torch.Tensor, flat: torch.Tensor,
              counts: Sequence[int], rotation: tuple[int, int] | None,
              launched: float) -> Callable[[torch.futures.Future], torch.Tensor]:
    """Once every chunk is decoded: the buffer (rotated back, copied from ``flat`` where it
    is not the buffer), and the step's figures.  An error in a chunk's decode surfaces here,
    from its future."""

    def finish(chunks: torch.futures.Future) -> torch.Tensor:
        start = time.perf_counter()
        timings = [chunk.wait() for chunk in chunks.value()]  # raises what a decode raised
        _into_buffer(state, buffer, flat, counts, rotation)
        state.end({"codes_wait_s": max(t for t, _ in timings) - launched,
                   "quantize_s": sum(d for _, d in timings) + time.perf_counter() - start})
        return buffer

    return finish


# --------------------------------------------------------------------------- two-stage

@dataclass(eq=False)
class _TwoStageBucket:
    """A two-stage bucket between its hook and its allgather."""

    future: torch.futures.Future  # what the hook returned to DDP: set once decoded
    buffer: torch.Tensor
    flat: torch.Tensor  # the buffer, or its fp32 copy (fp16/bf16)
    plan: core.TwoStagePlan
    layout: core.MessageLayout
    steps: torch.Tensor  # s / L1 per segment
    shard: torch.futures.Future  # the reduce-scatter: this rank's summed words
    launched: float  # when the reduce-scatter was launched
    counts: Sequence[int]  # the bucket's scale segments
    rotation: tuple[int, int] | None  # Settings.rotation's (block, key), undone at the end


def _two_stage_hook(state: GlobalQSGDState, bucket: dist.GradBucket, buffer: torch.Tensor,
                    flat: torch.Tensor, numels: list[int], counts: Sequence[int],
                    norms: torch.Tensor, size: int, local_s: tuple[float, float],
                    rotation: tuple[int, int] | None) -> torch.futures.Future[torch.Tensor]:
    """Two-stage Global-QSGD for one bucket (:mod:`hvd_gqsgd.two_stage`): quantize in wide
    lanes and launch the reduce-scatter now (the transport's stage 1, the bucket as one row
    of ``plan.scatter_words`` words); the allgather is launched by the *next* hook, on the
    autograd thread (collectives must be issued there, in bucket order: see the hazards
    above), by when the reduce-scatter has had the next bucket's backward to run.  The last
    bucket of a step finishes its own."""
    begun = time.perf_counter()
    settings, group = state.settings, state.process_group
    plan, message_layout = _two_stage.plan_of(("ddp", tuple(numels), settings.scale_block),
                                              counts, size, settings.bits)
    whole = core.Chunk(0, plan.total, 0, len(counts), tuple(counts))
    words = torch_dist.scatter_rows(state, flat, norms, [whole], plan.scatter_words,
                                    plan.levels1, plan.lane_bits)
    shard = torch_dist.reduce_scatter(words, plan.shard_words, group)  # COLLECTIVE
    launched = time.perf_counter()
    mine = _TwoStageBucket(torch.futures.Future(), buffer, flat, plan, message_layout,
                           core.step_sizes(torch_dist.OPS, norms, plan.levels1), shard,
                           launched, counts, rotation)
    state.begin(len(numels), bucket.is_last(), {
        "uncompressed": buffer.numel() * buffer.element_size(), "payload": plan.wire_bytes(),
        "overhead": 8 * len(counts),
        "quantize_s": local_s[0] + (launched - begun), "scale_wait_s": local_s[1]})
    earlier, state._pending = state._pending, [] if bucket.is_last() else [mine]
    rank = dist.get_rank(group)
    try:
        for pending in earlier + ([mine] if bucket.is_last() else []):
            _all_gather(state, pending, rank)
    except BaseException:
        state._pending = []  # every rank fails here together; the next step starts clean
        raise
    return mine.future


def _all_gather(state: GlobalQSGDState, pending: _TwoStageBucket, rank: int) -> None:
    """Wait for ``pending``'s reduce-scatter, requantize this rank's shard and launch the
    allgather (COLLECTIVE, async); its callback decodes the bucket and completes the future
    DDP holds."""
    start = time.perf_counter()
    summed = pending.shard.wait()  # raises what the reduce-scatter raised
    message = _two_stage.requantize(state._local, summed, pending.plan, rank, rank)
    gathered = torch.empty(pending.plan.gather_words, dtype=torch.int64, device=message.device)
    work = torch_dist.all_gather_single(gathered, message, group=state.process_group, async_op=True)
    requantized = time.perf_counter() - start
    work.get_future().then(_two_stage_finisher(state, pending, gathered, requantized))


def _two_stage_finisher(state: GlobalQSGDState, pending: _TwoStageBucket,
                        gathered: torch.Tensor, requantized: float
                        ) -> Callable[[torch.futures.Future], None]:
    """The allgather's callback: decode every message into the bucket's buffer (the average:
    factor ``1/n``), then complete DDP's future, with the error if any step failed."""

    def finish(work: torch.futures.Future) -> None:
        arrived = time.perf_counter()
        try:
            work.wait()
            local = state._local
            decoded = local.messages(gathered, pending.layout, pending.steps)
            flat = local.decode_into(decoded, pending.flat, 1.0 / pending.plan.world_size,
                                     rotation=pending.rotation)  # rotated back here
            _into_buffer(state, pending.buffer, flat, pending.counts, None)
            state.end({"codes_wait_s": arrived - pending.launched,
                        "quantize_s": requantized + time.perf_counter() - arrived})
        except BaseException as e:  # handed to DDP, which raises it where it waits
            pending.future.set_exception(e)
            return
        pending.future.set_result(pending.buffer)

    return finish
