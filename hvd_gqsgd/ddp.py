r"""Global-QSGD as a PyTorch DDP communication hook.  Needs torch only, no Horovod::

    from hvd_gqsgd.ddp import GlobalQSGDState, global_qsgd_hook
    ddp_model.register_comm_hook(GlobalQSGDState(bits=8), global_qsgd_hook)

It mirrors ``PowerSGDState`` + ``powerSGD_hook``: a small state object (settings, the rank's
noise stream, :class:`hvd_gqsgd.engine.Stats`) and a hook that DDP calls once per gradient
bucket during backward.  The algorithm and every formula are the Horovod path's
(:mod:`hvd_gqsgd.core`, and :mod:`hvd_gqsgd.kernels` for CPU tensors); this module only
translates a flat ``GradBucket`` into them and issues ``torch.distributed`` collectives.

Importing this module imports torch and ``torch.distributed``, never Horovod or TensorFlow.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import core, kernels
from . import two_stage as _two_stage
from .engine import FIGURES, Stats
from .torch_ops import TorchLocal, TorchOps, host_empty

__all__ = ["GlobalQSGDState", "global_qsgd_hook"]


_OPS = TorchOps()  # the core's primitives as torch ops (shared with hvd_gqsgd.torch)


@dataclass
class _Layout:
    """Scale segments of one bucket layout (cached: DDP keeps a bucket's layout fixed once it
    has rebuilt its buckets after the first iteration)."""

    numels: list[int]  # per gradient tensor, in bucket order
    counts: list[int]  # elements per scale segment (core.segments)
    first: list[int]  # tensor i owns segments first[i]:first[i+1]
    total: int
    segment_ids: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # generic path

    def segment_of(self, device: torch.device) -> torch.Tensor:
        """Segment index of every element (int64, ``total`` long; generic path only)."""
        ids = self.segment_ids.get(device)
        if ids is None:
            counts = torch.tensor(self.counts, device=device)
            ids = torch.repeat_interleave(torch.arange(len(self.counts), device=device), counts,
                                          output_size=self.total)
            self.segment_ids[device] = ids
        return ids


@dataclass
class _Step:
    """Figures of the DDP step in progress; a step ends when the bucket that DDP marks
    ``is_last()`` and every earlier one are decoded."""

    figures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIGURES, 0))
    tensors: int = 0
    pending: int = 0  # buckets whose Sum all_reduce has not been decoded yet
    closing: bool = False  # the step's last bucket has entered the hook


class GlobalQSGDState:
    """State of :func:`global_qsgd_hook` for one DDP model.

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
            tensor).  1024 costs 8 bytes of MAX all_reduce per 1024 elements.
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

    Checkpointing: the state pickles (``torch.save``) without its process group, like
    ``PowerSGDState``; a loaded state uses the default group (set ``process_group`` after
    loading for a subgroup) and re-derives its noise key from its new rank, so a rank-0
    checkpoint loaded on every rank still gives independent noise.
    """

    _TRANSIENT = ("process_group", "_key_base", "_layouts", "_generators", "_lock", "_step",
                  "_local", "_pending")

    def __init__(self, process_group: Any = None, bits: int = 8, norm: str = "max",
                 seed: int | None = None,
                 scale_block: int = core.DEFAULT_SCALE_BLOCK,
                 chunk_bytes: int | None = core.DEFAULT_CHUNK_BYTES,
                 two_stage: bool | None = None) -> None:
        # settings: validated once, immutable
        self.settings = core.Settings(bits=bits, norm=norm, seed=seed, scale_block=scale_block,
                                      chunk_bytes=chunk_bytes, two_stage=two_stage)
        self.process_group = process_group
        # cumulative figures, one round per DDP step (engine.Stats: bytes and seconds)
        self.stats = Stats()
        # noise: bucket k of this rank is keyed core.noise_key(base, serial); base comes from
        # (seed, rank) at the first bucket, the serial survives checkpoints
        self._key_serial = 0
        self._reset_transient()
        if process_group is not None or dist.is_initialized():  # fail here, not in backward
            size = self._group_size()
            if not _two_stage.chosen(self.settings, size):
                core.levels(bits, size)

    def _reset_transient(self) -> None:
        self._key_base: int | None = None
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self._generators: dict[torch.device, torch.Generator] = {}  # generic path only
        self._lock = threading.Lock()  # guards _step: decodes run on the backend's threads
        self._step = _Step()
        # two-stage: the local steps (TorchLocal: kernels or torch ops, this state's noise
        # keys), and the buckets whose reduce-scatter is in flight, finished by the next hook
        self._local = TorchLocal(self.settings.seed, keys=self)
        self._pending: list[_TwoStageBucket] = []

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None  # the default group, read when the hook runs
        self._reset_transient()

    # ----------------------------------------------------------------- used by the hook

    def _group_size(self) -> int:
        size = dist.get_world_size(self.process_group)
        if size < 1:  # torch answers -1 on a rank outside the group
            raise ValueError(f"this rank ({dist.get_rank()}) is not in GlobalQSGDState's "
                             "process_group: build the state (and DDP) "
                             "only on the group's ranks")
        return size

    def next(self, rank: int) -> int:
        """The noise-key stream interface of :class:`hvd_gqsgd.core.NoiseKeys` (for
        :class:`TorchLocal`): this state's next key; ``rank`` is already in its base."""
        return self._next_key()

    def _next_key(self) -> int:
        """This rank's 64-bit noise key for the next bucket (counter-based, see kernels)."""
        if self._key_base is None:
            self._key_base = core.rank_seed(self.settings.seed, dist.get_rank())
        self._key_serial += 1
        return core.noise_key(self._key_base, self._key_serial)

    def _layout(self, numels: list[int]) -> _Layout:
        key = tuple(numels)
        layout = self._layouts.get(key)
        if layout is None:
            counts, first = core.segments(numels, self.settings.scale_block)
            layout = _Layout(numels, counts, first, sum(numels))
            self._layouts[key] = layout
        return layout

    def _uniform(self, like: torch.Tensor, key: int) -> torch.Tensor:
        """Generic path: uniforms in [0, 1) for a bucket, from a generator re-seeded with the
        bucket's key, so the stream is a function of (seed, rank, serial) as on CPU."""
        gen = self._generators.get(like.device)
        if gen is None:
            gen = self._generators[like.device] = torch.Generator(device=like.device)
        gen.manual_seed(key >> 1)  # manual_seed takes 63 bits
        return torch.rand(like.shape, dtype=like.dtype, device=like.device, generator=gen)

    def _begin(self, tensors: int, last: bool, figures: dict[str, float]) -> None:
        with self._lock:
            self._step.pending += 1
            self._step.tensors += tensors
            self._step.closing |= last
            self._add(figures)

    def _end(self, figures: dict[str, float]) -> None:
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
        * Memory, CUDA path: an int64 block index per bucket element is cached per bucket
          layout (8 bytes per gradient element), plus a uniform and a code per element
          while a bucket is quantized.

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
    size = state._group_size()
    two = _two_stage.chosen(state.settings, size)
    n_levels = 0 if two else core.levels(bits, size)  # ValueError naming the bits that work
    buffer = bucket.buffer()
    layout = state._layout([g.numel() for g in bucket.gradients()])
    if layout.total != buffer.numel():
        raise RuntimeError(f"GlobalQSGD: the bucket's gradients hold {layout.total} elements "
                           f"but its buffer {buffer.numel()}; DDP's bucket layout changed")
    # fp16/bf16 are quantized in fp32 (a copy); fp32/fp64 buffers are read in place
    flat = buffer if buffer.dtype in (torch.float32, torch.float64) else buffer.float()
    fused = flat.device.type == "cpu" and kernels.available()
    norms = _local_norms(flat, layout, state.settings.norm, fused)
    scaled = time.perf_counter()
    dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=group)  # COLLECTIVE, blocking
    exchanged = time.perf_counter()
    if two:
        return _two_stage_hook(state, bucket, buffer, flat, layout, norms, size,
                               (scaled - start, exchanged - scaled))
    steps = core.step_sizes(_OPS, norms, n_levels) / size  # value of one summed code
    mult = core.multipliers(_OPS, norms, n_levels).to(flat.dtype)  # L / s per segment
    chunk_bytes = state.settings.chunk_bytes
    if chunk_bytes is None:
        chunk_bytes = core.AUTO_CHUNK_BYTES if fused else 0
    decoded = []
    for c in core.chunk_plan(layout.counts, bits, chunk_bytes):
        words = _encode(state, flat, mult, layout, c, n_levels, fused)
        future = dist.all_reduce(words, op=dist.ReduceOp.SUM, group=group,
                                 async_op=True).get_future()  # COLLECTIVE
        decoded.append(future.then(_decoder(state, flat, steps, layout, c, fused)))
        if len(decoded) == 1:
            launched = time.perf_counter()  # the wire starts working here
    state._begin(len(layout.numels), bucket.is_last(), {
        "uncompressed": buffer.numel() * buffer.element_size(),
        "payload": core.wire_bytes(layout.total, bits), "overhead": 8 * len(layout.counts),
        "quantize_s": (scaled - start) + (launched - exchanged),
        "scale_wait_s": exchanged - scaled})
    return torch.futures.collect_all(decoded).then(_finisher(state, buffer, flat, launched))


def _local_norms(flat: torch.Tensor, layout: _Layout, norm: str, fused: bool) -> torch.Tensor:
    """Step 1: float64 norm per scale segment, ``inf`` where a segment is not finite (MAX
    reductions may drop NaN: ``a > NaN`` is false; ``inf`` always wins)."""
    if fused:
        return torch.from_numpy(kernels.segment_norms(flat.numpy(), np.asarray(layout.counts),
                                                      norm))
    ids = layout.segment_of(flat.device)
    out = torch.zeros(len(layout.counts), dtype=torch.float64, device=flat.device)
    if norm == "max":
        magnitude = torch.where(torch.isfinite(flat), flat.abs(), torch.inf)
        out.scatter_reduce_(0, ids, magnitude.double(), "amax")
        return out
    # squares in fp64: a finite fp32 block must not overflow its own L2 norm
    out.index_add_(0, ids, flat.double().square())
    return torch.nan_to_num(out.sqrt(), nan=torch.inf)


def _encode(state: GlobalQSGDState, flat: torch.Tensor, mult: torch.Tensor, layout: _Layout,
            c: core.Chunk, n_levels: int, fused: bool) -> torch.Tensor:
    """Step 3 for chunk ``c`` of the bucket: int64 words of its codes, with a noise key of
    its own (each chunk's stream starts at its first element)."""
    bits, key = state.settings.bits, state._next_key()
    part = flat[c.lo:c.hi]
    if fused:
        words = host_empty(core.packed_words(c.hi - c.lo, bits), np.int64)
        kernels.quantize_pack(part.numpy(), np.asarray(c.counts), mult[c.first:c.stop].numpy(),
                              n_levels, bits, key, words.numpy())
        return words
    per_element = mult[layout.segment_of(flat.device)[c.lo:c.hi]]
    return core.encode(_OPS, part, per_element, state._uniform(part, key), n_levels, bits)


def _decoder(state: GlobalQSGDState, flat: torch.Tensor, steps: torch.Tensor,
             layout: _Layout, c: core.Chunk,
             fused: bool) -> Callable[[torch.futures.Future], tuple[float, float]]:
    """Step 5 for chunk ``c``, as the callback of its SUM all_reduce's future: its lane sums
    times ``steps`` into its slice of ``flat`` (the bucket's buffer itself for fp32/fp64).
    Chunks write disjoint slices, so their callbacks may run concurrently.  Returns when the
    chunk arrived and how long decoding it took (for the stats)."""
    bits = state.settings.bits

    def decode(future: torch.futures.Future) -> tuple[float, float]:
        arrived = time.perf_counter()
        summed = future.value()[0]
        scale = steps.to(flat.dtype)  # as the kernels do: lane * float(step), rounded once
        out = flat[c.lo:c.hi]
        if fused:
            kernels.Summed(summed.numpy(), bits).unpack_bucket(out.numpy(), layout.counts,
                                                               scale.numpy(), start=c.lo)
        else:
            sums = core.unpack(_OPS, summed, bits, c.hi - c.lo)
            per_element = scale[layout.segment_of(flat.device)[c.lo:c.hi]]
            torch.mul(sums.to(flat.dtype), per_element, out=out)
        return arrived, time.perf_counter() - arrived

    return decode


def _finisher(state: GlobalQSGDState, buffer: torch.Tensor, flat: torch.Tensor,
              launched: float) -> Callable[[torch.futures.Future], torch.Tensor]:
    """Once every chunk is decoded: the buffer (copied from ``flat`` for fp16/bf16), and the
    step's figures.  An error in a chunk's decode surfaces here, from its future."""

    def finish(chunks: torch.futures.Future) -> torch.Tensor:
        start = time.perf_counter()
        timings = [chunk.wait() for chunk in chunks.value()]  # raises what a decode raised
        if flat is not buffer:
            buffer.copy_(flat)
        state._end({"codes_wait_s": max(t for t, _ in timings) - launched,
                    "quantize_s": sum(d for _, d in timings) + time.perf_counter() - start})
        return buffer

    return finish


# --------------------------------------------------------------------------- two-stage

# How a Gloo group reduce-scatters (benchmarks/ddp_bench.py measures both): "all_to_all"
# (default) or "reduce_scatter", torch's reduce_scatter_single, which Gloo runs as a whole
# all_reduce of the input, and blocking: its work has no future
GLOO_REDUCE_SCATTER = "all_to_all"
# torch >= 2.13 names them *_single; earlier releases only have the older names
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _two_stage_hook(state: GlobalQSGDState, bucket: dist.GradBucket, buffer: torch.Tensor,
                    flat: torch.Tensor, layout: _Layout, norms: torch.Tensor, size: int,
                    local_s: tuple[float, float]) -> torch.futures.Future[torch.Tensor]:
    """Two-stage Global-QSGD for one bucket (:mod:`hvd_gqsgd.two_stage`): quantize in wide
    lanes and launch the reduce-scatter now; the allgather is launched by the *next* hook,
    on the autograd thread (collectives must be issued there, in bucket order: see the
    hazards above), by when the reduce-scatter has had the next bucket's backward to run.
    The last bucket of a step finishes its own."""
    begun = time.perf_counter()
    settings, group, local = state.settings, state.process_group, state._local
    plan, message_layout = _two_stage.plan_of(
        ("ddp", tuple(layout.numels), settings.scale_block), layout.counts, size,
        settings.bits)
    rank = dist.get_rank(group)
    steps = core.step_sizes(_OPS, norms, plan.levels1)
    mult = core.multipliers(_OPS, norms, plan.levels1)
    words = local.encode(flat, mult, layout.counts, plan.levels1, plan.lane_bits, rank,
                         pad_to=plan.scatter_words)
    shard = _reduce_scatter(words, plan, group)  # COLLECTIVE
    launched = time.perf_counter()
    mine = _TwoStageBucket(torch.futures.Future(), buffer, flat, plan, message_layout, steps,
                           shard, launched)
    state._begin(len(layout.numels), bucket.is_last(), {
        "uncompressed": buffer.numel() * buffer.element_size(), "payload": plan.wire_bytes(),
        "overhead": 8 * len(layout.counts),
        "quantize_s": local_s[0] + (launched - begun), "scale_wait_s": local_s[1]})
    earlier, state._pending = state._pending, [] if bucket.is_last() else [mine]
    try:
        for pending in earlier + ([mine] if bucket.is_last() else []):
            _all_gather(state, pending, rank)
    except BaseException:
        state._pending = []  # every rank fails here together; the next step starts clean
        raise
    return mine.future


def _reduce_scatter(words: torch.Tensor, plan: core.TwoStagePlan, group: Any
                    ) -> torch.futures.Future:
    """COLLECTIVE, async: the Sum reduce-scatter of ``words`` (``plan.scatter_words``), as a
    future of this rank's ``plan.shard_words`` summed words.  NCCL: ``reduce_scatter``.
    Gloo, whose ``reduce_scatter`` runs a full all_reduce (twice the bytes): an
    ``all_to_all`` of the shards, then the int64 sum of the ``n`` received copies (every
    lane then holds ``n`` codes in ``[-L1, L1]``, inside its bound)."""
    n, q = plan.world_size, plan.shard_words
    gloo = dist.get_backend(group) == dist.Backend.GLOO
    if not gloo or GLOO_REDUCE_SCATTER == "reduce_scatter":
        out = torch.empty(q, dtype=torch.int64, device=words.device)
        work = _reduce_scatter_single(out, words, op=dist.ReduceOp.SUM, group=group,
                                      async_op=not gloo)
        if gloo:  # Gloo's reduce_scatter work has no future (Work::getFuture): it blocks
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(out)
            return done
        return work.get_future().then(lambda _: out)
    received = torch.empty_like(words)
    work = dist.all_to_all_single(received, words, group=group, async_op=True)
    return work.get_future().then(lambda _: received.view(n, q).sum(0))


def _all_gather(state: GlobalQSGDState, pending: _TwoStageBucket, rank: int) -> None:
    """Wait for ``pending``'s reduce-scatter, requantize this rank's shard and launch the
    allgather (COLLECTIVE, async); its callback decodes the bucket and completes the future
    DDP holds."""
    start = time.perf_counter()
    summed = pending.shard.wait()  # raises what the reduce-scatter raised
    message = _two_stage.requantize(state._local, summed, pending.plan, rank, rank)
    gathered = torch.empty(pending.plan.gather_words, dtype=torch.int64, device=message.device)
    work = _all_gather_single(gathered, message, group=state.process_group, async_op=True)
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
            local.decode_into(decoded, pending.flat, 1.0 / pending.plan.world_size)
            if pending.flat is not pending.buffer:
                pending.buffer.copy_(pending.flat)
            state._end({"codes_wait_s": arrived - pending.launched,
                        "quantize_s": requantized + time.perf_counter() - arrived})
        except BaseException as e:  # handed to DDP, which raises it where it waits
            pending.future.set_exception(e)
            return
        pending.future.set_result(pending.buffer)

    return finish
