"""The Global-QSGD round: queue tensors, exchange one scale vector, sum packed codes, rescale.

Framework-free.  An adapter supplies a :class:`Backend` (tensor primitives plus Horovod's
collectives for its framework); this module decides *when* each collective runs and in which
order, and :mod:`hvd_gqsgd.core` supplies every formula.

Life of a round (all ranks must make the same calls in the same order)::

    compress(t1) .. compress(tk)        queue; return a 2-element probe per tensor
      [bucket full -> seal]             Settings.bucket_bytes reached (PyTorch: 8 MiB by
                                        default):
                                          1. COLLECTIVE  async MAX allreduce of local norms
                                             (one per scale block) + layout
      [every compress: advance]         for each sealed bucket whose exchange is back
                                        (Backend.poll), without waiting:
                                          2. quantize + pack it (or, with
                                             Settings.chunk_bytes, chunk by chunk)
                                          3. COLLECTIVE  async Sum allreduce of the words
                                             (two-stage: reduce-scatter; once that is back,
                                             requantize and allgather)
    decompress(probe1, ctx1)            seal what is still queued; for the buckets up to
                                        ctx1's, in sealing order, wait for each collective
                                        and run 2-3; wait for ctx1's codes, unpack once per
                                        bucket, rescale tensor 1
    decompress(probe_k, ctx_k)          rescale from the already-unpacked bucket
    (all results taken -> the round ends; in eager mode collective names restart, so
     Horovod's response cache sees the same names every step)

Horovod's ``DistributedOptimizer`` calls ``compress`` from each gradient's backward hook, so
a deep model's buckets are exchanged, quantized and sent while backward still produces the
gradients of earlier layers.  Horovod matches collectives by name, so launching them from
hooks is safe as long as every rank seals the same tensors into the same buckets; a rank
waits only for collectives that every rank issues before it waits for a later bucket's.

With ``Settings.hierarchical`` the first decompress seals the round's tensors in buckets of
``bucket_bytes`` (8 MiB by default); each bucket's seal reads the node layout (one small MAX
allreduce) and, when there are several nodes of equal size, hands steps 1-3 and the unpack to
:func:`hvd_gqsgd.hierarchical.reduce`, blocking, at the seal: full-precision sums inside each
node, codes summed across nodes only, so ``L`` is set by the node count.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import core, hierarchical, two_stage

__all__ = ["Backend", "Ctx", "Engine", "Entry", "Stats"]


class Backend(core.TensorOps, Protocol):
    """Framework primitives on top of :class:`core.TensorOps`.  Methods that talk to other
    ranks are marked COLLECTIVE: every rank of the process set must call them in the same order.
    """

    def is_compressible(self, t: Any) -> bool: ...
    def dtype_name(self, t: Any) -> str: ...
    def numel(self, t: Any) -> int: ...
    def nbytes(self, t: Any) -> int: ...
    def global_process_set(self) -> Any: ...
    def probe(self, values: Sequence[float], like: Any) -> Any: ...
    # Horovod's probe for one compressed tensor: a float64 tensor of ``values`` that no
    # other tensor of the round shares (Horovod may reduce it in place), valid until
    # end_round; the backend may hand it out again in a later round.  end_round(True): the
    # round's results are all taken, so none of its probes is in a collective any more;
    # end_round(False): the round failed and some may still be (never reuse those).
    def round_probe(self, values: Sequence[float], like: Any) -> Any: ...
    def end_round(self, clean: bool) -> None: ...
    def probe_factor(self, reduced: Any, world_size: int) -> Any: ...
    # local norm of each segment of flat (counts: elements per segment; the segments are the
    # tensors unless Settings.scale_block cuts them), +inf if non-finite, then ``extra``
    def local_norms(self, tensors: Sequence[Any], flat: Any, counts: Sequence[int], norm: str,
                    extra: Sequence[float]) -> Any: ...
    def allreduce_max(self, vec: Any, name: str, process_set: Any) -> Any: ...  # COLLECTIVE
    # COLLECTIVE: the same MAX allreduce, started; wait() gives its result, poll() says
    # whether wait() would return at once (a graph backend may run it synchronously)
    def allreduce_max_async(self, vec: Any, name: str, process_set: Any) -> Any: ...
    def poll(self, handle: Any) -> bool: ...
    # Settings.bucket_bytes None: input bytes per bucket sealed from compress (0: one bucket,
    # sealed by the first decompress)
    def auto_bucket_bytes(self) -> int: ...
    def check_layout(self, reduced: Any) -> Any: ...
    def flat_concat(self, tensors: Sequence[Any]) -> Any: ...
    # a bucket's flat_concat, valid until end_round (the backend may fill the same memory
    # again in a later round, as with round_probe)
    def round_flat(self, tensors: Sequence[Any]) -> Any: ...
    # quantize + pack a bucket (mult: L/s per segment); core.encode or a fused kernel
    # after: the previous chunk's words, which a graph backend must run this encode after, so
    # that that chunk's allreduce is launched before the next chunk is quantized
    def encode(self, flat: Any, mult: Any, counts: Sequence[int], n_levels: int, bits: int,
               rank: int, after: Any = None) -> Any: ...
    # Settings.chunk_bytes None: packed bytes per Sum allreduce for this flat bucket (0: one)
    def auto_chunk_bytes(self, flat: Any) -> int: ...
    def allreduce_sum_async(self, words: Any, name: str, process_set: Any) -> Any: ...  # COLL.
    def allgather_async(self, tensor: Any, name: str, process_set: Any) -> Any: ...  # COLL.
    def wait(self, handle: Any) -> Any: ...
    def concat_words(self, words: Sequence[Any]) -> Any: ...  # int64 chunks, in order
    # once per bucket; a list of the chunks' words when the bucket was sent in several, so
    # that a backend can decode each chunk as it arrives
    def decoder(self, words: Any, bits: int, total: int) -> Any: ...
    # one tensor: lane sums at [offset, offset + numel) times scale, in like's dtype and shape;
    # block > 0: scale is a vector, element i of the tensor takes scale[i // block]
    # (QSGDAllgather and QPRSGD; the engine decodes whole buckets)
    def decode(self, state: Any, offset: int, like: Any, scale: Any, block: int) -> Any: ...
    # once per bucket, at its first decompress (with that tensor's probe): the whole bucket
    # decoded (flat, or two-stage's messages), every segment (counts: elements per scale
    # segment) times its step times the op's factor; then take per tensor, with its own probe
    # rotation: (block, key) of Settings.rotation, whose inverse the decoded bucket gets
    def rescale_bucket(self, state: Any, steps: Any, counts: Sequence[int],
                       likes: Sequence[Any], reduced_probe: Any, world_size: int,
                       rotation: tuple[int, int] | None = None) -> Any: ...
    # Settings.rotation: flat rotated into a new buffer (core.rotate) and the local norms of
    # the result with ``extra`` appended, as local_norms gives them
    def rotate_norms(self, flat: Any, counts: Sequence[int], block: int, key: int, norm: str,
                     extra: Sequence[float]) -> tuple[Any, Any]: ...
    def take(self, rescaled: Any, offset: int, like: Any, reduced_probe: Any,
             world_size: int) -> Any: ...
    def stable_names(self) -> bool: ...  # True when names may repeat every round (eager)
    # two-stage: decoder state of the allgathered messages (steps1: stage-1 steps s / L1)
    def messages(self, gathered: Any, layout: core.MessageLayout, steps1: Any) -> Any: ...


FIGURES = ("uncompressed", "payload", "overhead", "quantize_s", "scale_wait_s", "codes_wait_s")


@dataclass
class Stats:
    """What compression cost and bought, per round (``last_*``) and cumulative (``total_*``).

    Bytes: ``payload`` is the packed codes one rank sends into the allreduce; ``overhead`` the
    scale/layout vector and the probes; ``uncompressed`` what the same tensors would have cost
    in their own dtype.  Seconds: ``quantize_s`` is local work (norms, quantize, pack, unpack,
    rescale), ``scale_wait_s`` the blocking scale exchange, ``codes_wait_s`` waiting for the
    summed codes.  Inside ``tf.function`` these describe tracing, not executed steps.  The
    seconds are host time: on CUDA they count the launches of asynchronous work and the
    waits for collectives, not the device's time on each step.

    Example::

        opt.step()
        print(compression.stats.as_dict())   # or log it: a flat dict of numbers
    """

    rounds: int = 0
    tensors: int = 0
    last_uncompressed: int = 0
    last_payload: int = 0
    last_overhead: int = 0
    last_quantize_s: float = 0.0
    last_scale_wait_s: float = 0.0
    last_codes_wait_s: float = 0.0
    total_uncompressed: int = 0
    total_payload: int = 0
    total_overhead: int = 0
    total_quantize_s: float = 0.0
    total_scale_wait_s: float = 0.0
    total_codes_wait_s: float = 0.0

    @property
    def last_ratio(self) -> float:
        """Uncompressed bytes over bytes actually sent, for the last finished round."""
        sent = self.last_payload + self.last_overhead
        return self.last_uncompressed / sent if sent else float("nan")

    def as_dict(self) -> dict[str, float]:
        names = [f for f in self.__dataclass_fields__]
        return {**{f: getattr(self, f) for f in names}, "last_ratio": self.last_ratio}

    def add_round(self, figures: dict[str, float], tensors: int) -> None:
        self.rounds += 1
        self.tensors += tensors
        for f in FIGURES:
            setattr(self, f"last_{f}", figures[f])
            setattr(self, f"total_{f}", getattr(self, f"total_{f}") + figures[f])


@dataclass(eq=False, slots=True)  # slots: made once per tensor per step
class Entry:
    """One compressed tensor, as the engine keeps it until its ``decompress``."""

    tensor: Any  # the input: read when its bucket is flushed, its shape/dtype when rescaled
    numel: int
    nbytes: int
    bucket: Bucket | None = None
    index: int = -1  # its first scale segment inside the bucket
    stop: int = -1  # one past its last scale segment
    offset: int = 0  # element offset inside the bucket's flat buffer


class _Ticket:
    """Held by every :class:`Ctx` of one round and only weakly by the engine: when it is
    gone, no caller holds any ctx of the round, so none of its tensors can be decompressed."""

    __slots__ = ("__weakref__",)


class Ctx:
    """The ``ctx`` that ``compress`` returns to Horovod: its tensor's :class:`Entry` and the
    round's ticket.  The engine never holds one, so whether any is still held tells it
    whether the round can still finish (see :meth:`Engine.compress`)."""

    __slots__ = ("entry", "ticket")

    def __init__(self, entry: Entry, ticket: _Ticket) -> None:
        self.entry, self.ticket = entry, ticket


@dataclass(eq=False)
class Bucket:
    """Tensors quantized together: one scale exchange and one packed Sum allreduce."""

    entries: list[Entry]
    rank: int
    world_size: int
    n_levels: int
    counts: Sequence[int] = ()  # elements per scale segment
    steps: Any = None  # value of one summed code per segment (s / L), float64 on the device
    handles: list[Any] = field(default_factory=list)  # pending Sum allreduces, one per chunk
    decoded: Any = None  # Backend.decoder() state, once the Sum allreduce is waited for
    rescaled: Any = None  # Backend.rescale_bucket() output, once the first tensor is taken
    remaining: int = 0
    total: int = 0
    name: str = ""  # prefix of the bucket's collectives' names
    fingerprint: float = 0.0  # core.layout_fingerprint of its tensors' sizes and dtypes
    # Settings.rotation: (block, key) of the rotation its flat buffer went through, the
    # inverse of which rescale_bucket applies; None without
    rotation: tuple[int, int] | None = None
    norms: Any = None  # local norms already taken with the rotation (Backend.rotate_norms)
    # two-stage (hvd_gqsgd.two_stage): the plan while the reduce-scatter is in flight, and the
    # gathered messages' layout, whose parts (not segments) carry the decode's steps
    plan: core.TwoStagePlan | None = None
    layout: core.MessageLayout | None = None
    # progress (Engine._step): _SCALING while the MAX allreduce is in flight (flat and pset
    # kept for the codes), _SCATTERING while two-stage's reduce-scatter is, then _SENT: the
    # last collective is launched (or, hierarchical, done) and handles hold what to wait for
    stage: int = 0
    two: bool = False
    flat: Any = None
    pset: Any = None
    scale_handle: Any = None


_SCALING, _SCATTERING, _SENT = range(3)
_LAYOUTS = 64  # bucket layouts an engine remembers (Engine._layout)


@dataclass(frozen=True, eq=False)
class _Layout:
    """What a bucket's tensor sizes and dtypes alone decide (Engine._layout)."""

    counts: tuple[int, ...]  # elements per scale segment (core.segments)
    first: list[int]  # tensor i owns segments first[i]:first[i + 1]
    offsets: list[int]  # tensor i starts at element offsets[i]; the last entry: the total
    fingerprint: float  # core.layout_fingerprint, exchanged with the scales


@dataclass
class _Round:
    """Mutable state of the round in progress (guarded by Engine._lock)."""

    rank: int | None = None  # this rank in the process set, read at the round's first compress
    # the round's _Ticket, held by its ctxs only; None until the round's first compress
    ticket: weakref.ref[_Ticket] | None = None
    limit: int = 0  # input bytes that seal a bucket from compress (0: none), read with rank
    queued: list[Entry] = field(default_factory=list)
    queued_bytes: int = 0
    pending: list[Bucket] = field(default_factory=list)  # sealed, not yet _SENT, in order
    outstanding: int = 0  # entries compressed but not yet decompressed
    tensors: int = 0
    figures: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FIGURES, 0))

    @contextmanager
    def timing(self, figure: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.figures[figure] += time.perf_counter() - start


class Engine:
    """One compressor's state for one framework.  Thread-safe: Horovod may call ``compress``
    from autograd threads and ``decompress`` from the optimizer's thread."""

    def __init__(self, backend: Backend, settings: core.Settings, process_set: Any,
                 uid: int) -> None:
        self.backend = backend
        self.settings = settings
        self.process_set = process_set
        self.stats = Stats()
        self._prefix = f"gqsgd.{uid}"  # same on every rank: compressors are built in order
        self._round = _Round()
        self._serial = 0  # names the next bucket's collectives
        # Settings.rotation: rounds finished since the names last restarted after a failure,
        # the round counter of the rotation's keys (core.rotation_key)
        self._rotation_round = 0
        self._lock = threading.RLock()
        self._layouts: dict[tuple[tuple[int, ...], tuple[str, ...]], _Layout] = {}

    # ----------------------------------------------------------------- compress / decompress

    def compress(self, tensor: Any) -> tuple[Any, Ctx | None]:
        """Queue ``tensor``; return Horovod's probe and the ctx.  Non-float and empty tensors
        are returned untouched with ``ctx=None`` so Horovod reduces them as usual.  A full
        bucket is sealed here (its scale exchange starts), and buckets sealed earlier move on
        as far as their collectives allow, without waiting.

        A round that no caller can finish any more is dropped first: one whose ctxs are all
        gone while some of its tensors were never decompressed.  That is what a Horovod
        elastic reset leaves when a rank fails mid-step outside GlobalQSGD's own waits
        (``optimizer.load_state_dict`` drops the optimizer's ctxs); carrying such a round on
        would mix its tensors into the next step's buckets, never end it, and name the next
        buckets differently from a rank that has just joined."""
        b = self.backend
        if not b.is_compressible(tensor):
            return tensor, None
        numel = b.numel(tensor)
        entry = Entry(tensor=tensor, numel=numel, nbytes=b.nbytes(tensor))
        with self._lock:
            r = self._round
            ticket = r.ticket() if r.ticket is not None else None
            if ticket is None:  # the round's first compress, or every ctx of it is gone
                if r.outstanding:
                    self._drop_dead_round()
                    r = self._round
                ticket = _Ticket()
                r.ticket = weakref.ref(ticket)
            if r.rank is None:  # once per round: Horovod's process-set queries are not free
                r.rank, r.limit = self._world()[0], self._limit()
            rank = r.rank
            r.queued.append(entry)
            r.queued_bytes += entry.nbytes
            r.outstanding += 1
            try:
                if r.limit and r.queued_bytes >= r.limit:
                    self._seal()
                if r.pending:
                    self._advance()
            except BaseException:
                self._abandon()  # as in decompress: all ranks fail here together
                raise
        return b.round_probe(core.probe_values(rank), tensor), Ctx(entry, ticket)

    def decompress(self, reduced_probe: Any, ctx: Ctx | None) -> Any:
        """Return the reduced gradient for ``ctx``; seals what is still queued and waits for
        ``ctx``'s bucket (and the buckets sealed before it).  A ctx is decompressed once, in
        the round that made it (``RuntimeError`` otherwise)."""
        if ctx is None:
            return reduced_probe
        entry = ctx.entry
        with self._lock:
            r = self._round
            if r.ticket is None or r.ticket() is not ctx.ticket or entry.tensor is None:
                raise RuntimeError(
                    "GlobalQSGD.decompress got a ctx it cannot finish: "
                    + ("it was decompressed already" if entry.tensor is None else
                       "its round was abandoned (an error in a collective, or a Horovod "
                       "elastic reset, ended it)")
                    + ". Each ctx that compress() returns goes to decompress() exactly once, "
                    "in the same step; after a failed step, compress the tensors again.")
            try:
                if entry.bucket is None:
                    self._seal()
                bucket = entry.bucket
                assert bucket is not None
                if bucket.stage != _SENT:
                    self._advance(until=bucket)
                if self._round.pending:  # later buckets whose scales are back: on the wire
                    self._advance()  # now, not once every earlier bucket is decoded
                if bucket.decoded is None:
                    self._decode(bucket)
                # the bucket is rescaled whole at its first tensor (one backend call, where a
                # call per tensor cost a deep model's many small tensors more than their
                # allreduce), then each tensor is a slice of it
                b, start = self.backend, time.perf_counter()  # not timing(): once per tensor
                if bucket.rescaled is None:
                    bucket.rescaled = b.rescale_bucket(
                        bucket.decoded, bucket.steps, bucket.counts,
                        [e.tensor for e in bucket.entries], reduced_probe, bucket.world_size,
                        bucket.rotation)
                out = b.take(bucket.rescaled, entry.offset, entry.tensor, reduced_probe,
                             bucket.world_size)
                self._round.figures["quantize_s"] += time.perf_counter() - start
            except BaseException:
                # Every rank fails at the same point (same sizes, same probe), so start the
                # next round clean on all of them rather than carry a broken queue.
                self._abandon()
                raise
            self._release(bucket, entry)
        return out

    # ----------------------------------------------------------------- internals

    def _limit(self) -> int:
        """Queued input bytes that make a bucket to seal from compress (0: never; the first
        decompress seals).  From the settings alone, so that buckets follow from this round's
        tensors alone, which every rank has in common (a rank that elastic adds mid-run has
        no history: a limit learned from earlier rounds would bucket differently)."""
        limit = self.settings.bucket_bytes
        if limit is None:
            limit = 0 if self.settings.hierarchical else self.backend.auto_bucket_bytes()
        return limit

    def _decode(self, bucket: Bucket) -> None:
        """Wait for a _SENT bucket's last collective and decode it, once per bucket."""
        b, r = self.backend, self._round
        if bucket.layout is not None:  # two-stage: the allgathered messages
            with r.timing("codes_wait_s"):
                gathered = b.wait(bucket.handles[0])
            with r.timing("quantize_s"):
                bucket.decoded = b.messages(gathered, bucket.layout, bucket.steps)
        else:
            with r.timing("codes_wait_s"):
                chunks = [b.wait(h) for h in bucket.handles]
            with r.timing("quantize_s"):
                words = chunks[0] if len(chunks) == 1 else chunks  # see Backend.decoder
                bucket.decoded = b.decoder(words, self.settings.bits, bucket.total)
        bucket.handles = []

    def _seal(self) -> None:
        """COLLECTIVE: make a bucket of all queued tensors and start its scale exchange.
        Hierarchical: cut them into buckets of ``Settings.bucket_bytes`` (None: 8 MiB, 0:
        one bucket) and reduce each whole, in order, so that the node sums and codes exist
        for one bucket at a time, not for the model.  Every rank seals the same tensors in
        the same order (the names below match across ranks; the layout check catches a
        mismatch)."""
        r = self._round
        entries, r.queued, r.queued_bytes = r.queued, [], 0
        if not entries:
            return
        limit = self.settings.bucket_bytes
        if not self.settings.hierarchical or limit == 0:
            self._seal_entries(entries)
            return
        cap = core.AUTO_BUCKET_BYTES if limit is None else limit
        group: list[Entry] = []
        held = 0
        for e in entries:
            if group and held + e.nbytes > cap:
                self._seal_entries(group)
                group, held = [], 0
            group.append(e)
            held += e.nbytes
        self._seal_entries(group)

    def _seal_entries(self, entries: list[Entry]) -> None:
        """:meth:`_seal` of one bucket of ``entries``."""
        r = self._round
        rank, size, pset = self._world()
        name = f"{self._prefix}.b{self._serial}"
        self._serial += 1
        tree = self._tree(rank, size, pset, name, entries[0].tensor)  # None: not hierarchical
        # re-read every bucket: elastic resizes.  Hierarchical: lanes sum one code per node
        summing = tree.cross_size if tree else size
        two = two_stage.chosen(self.settings, summing, "nodes" if tree else "ranks")
        n_levels = 0 if two else core.levels(self.settings.bits, summing)
        r.tensors += len(entries)
        r.figures["uncompressed"] += sum(e.nbytes for e in entries)
        r.figures["overhead"] += core.PROBE_BYTES * len(entries)
        layout = self._layout(entries)
        bucket = Bucket(entries=entries, rank=rank, world_size=size, n_levels=n_levels,
                        remaining=len(entries), name=name, two=two, pset=pset,
                        counts=layout.counts, total=layout.offsets[-1],
                        fingerprint=layout.fingerprint)
        first, offsets = layout.first, layout.offsets
        for i, e in enumerate(entries):
            e.bucket, e.index, e.stop, e.offset = bucket, first[i], first[i + 1], offsets[i]
        with r.timing("quantize_s"):
            flat = self.backend.round_flat([e.tensor for e in entries])
            flat = self._rotate(bucket, flat, self._serial - 1)
        if tree is not None:  # its norms are the node sums' (hierarchical.reduce), not these
            bucket.norms = None
            hierarchical.reduce(self.backend, self.settings, tree, bucket, flat, name, pset, r,
                                two)
            bucket.stage = _SENT
            return
        bucket.flat = flat
        bucket.scale_handle = self._start_scales(bucket, flat, f"{name}.scale", pset)
        bucket.stage = _SCALING
        r.pending.append(bucket)

    def _advance(self, until: Bucket | None = None) -> None:
        """Move sealed buckets on.  Without ``until``: each as far as collectives that have
        finished allow, never waiting.  With it: the buckets sealed up to ``until``, in
        order, waiting for each collective, until ``until`` is _SENT.  (No deadlock: a rank
        waits only for collectives that every rank issues before it waits for any later
        bucket's.)"""
        pending = self._round.pending
        if until is not None:
            while until.stage != _SENT:
                self._step(pending[0], block=True)
                if pending[0].stage == _SENT:
                    pending.pop(0)
            return
        for bucket in list(pending):
            while bucket.stage != _SENT and self._step(bucket, block=False):
                pass
        pending[:] = [bk for bk in pending if bk.stage != _SENT]

    def _step(self, bucket: Bucket, block: bool) -> bool:
        """One stage of ``bucket`` (COLLECTIVE: launches its next collective); False when
        that needs a collective still in flight and ``block`` is False."""
        b, r = self.backend, self._round
        if bucket.stage == _SCALING:
            if not block and not b.poll(bucket.scale_handle):
                return False
            with r.timing("scale_wait_s"):
                scales = b.check_layout(b.wait(bucket.scale_handle))
            flat, bucket.flat, bucket.scale_handle = bucket.flat, None, None
            r.figures["overhead"] += core.scale_exchange_bytes(len(bucket.counts))
            if bucket.two:
                bucket.plan, bucket.layout = two_stage.plan_of(
                    (tuple(e.numel for e in bucket.entries), self.settings.scale_block),
                    bucket.counts, bucket.world_size, self.settings.bits)
                two_stage.scatter(b, bucket, flat, scales, bucket.plan, bucket.name,
                                  bucket.pset, r)
                bucket.stage = _SCATTERING
            else:
                with r.timing("quantize_s"):
                    self._send_codes(bucket, flat, scales, f"{bucket.name}.codes", bucket.pset)
                r.figures["payload"] += core.wire_bytes(bucket.total, self.settings.bits)
                bucket.stage = _SENT
            return True
        if bucket.stage == _SCATTERING:
            if not block and not b.poll(bucket.handles[0]):
                return False
            assert bucket.plan is not None
            bucket.handles = [two_stage.gather(b, bucket, bucket.plan, bucket.name,
                                               bucket.pset, r)]
            bucket.plan = None
            bucket.stage = _SENT
            return True
        return True

    def _rotate(self, bucket: Bucket, flat: Any, stream: int) -> Any:
        """With ``Settings.rotation``: ``flat`` rotated (a new buffer; the local norms of the
        rotated data are taken in the same pass and kept for :meth:`_start_scales`), the
        bucket's key noted for the inverse, and the round counter folded into the layout
        pair, so that ranks at different rounds (a rank Horovod elastic added between steps)
        fail the layout check instead of summing codes of different rotations."""
        block = core.rotation_block(self.settings)
        if not block:
            return flat
        key = core.rotation_key(self.settings.seed, stream, self._rotation_round)
        bucket.rotation = (block, key)
        bucket.fingerprint = core.round_fingerprint(bucket.fingerprint, self._rotation_round)
        flat, bucket.norms = self.backend.rotate_norms(
            flat, bucket.counts, block, key, self.settings.norm,
            [bucket.fingerprint, -bucket.fingerprint])
        return flat

    def _start_scales(self, bucket: Bucket, flat: Any, name: str, pset: Any) -> Any:
        """COLLECTIVE: start one MAX allreduce of every segment's local norm plus the layout
        pair ``(h, -h)``; ranks that queued different layouts get ``max(h) != -max(-h)``
        (``Backend.check_layout``, when it is waited for)."""
        b = self.backend
        norms, bucket.norms = bucket.norms, None
        if norms is None:
            tensors = [e.tensor for e in bucket.entries]
            with self._round.timing("quantize_s"):
                norms = b.local_norms(tensors, flat, bucket.counts, self.settings.norm,
                                      [bucket.fingerprint, -bucket.fingerprint])
        return b.allreduce_max_async(norms, name, pset)

    def _send_codes(self, bucket: Bucket, flat: Any, scales: Any, name: str, pset: Any) -> None:
        """Quantize and pack the bucket chunk by chunk; COLLECTIVE: launch each chunk's Sum
        allreduce as soon as it is packed, so the wire works while the next chunk is packed."""
        b, level, bits = self.backend, bucket.n_levels, self.settings.bits
        bucket.steps = core.step_sizes(b, scales, level)
        mult = core.multipliers(b, scales, level)
        chunk_bytes = self.settings.chunk_bytes
        if chunk_bytes is None:
            chunk_bytes = b.auto_chunk_bytes(flat)
        plan = core.chunk_plan(bucket.counts, bits, chunk_bytes)
        words = None
        for i, c in enumerate(plan):
            whole = len(plan) == 1
            words = b.encode(flat if whole else flat[c.lo:c.hi],
                             mult if whole else mult[c.first:c.stop], c.counts, level, bits,
                             bucket.rank, after=words)
            bucket.handles.append(
                b.allreduce_sum_async(words, name if whole else f"{name}{i}", pset))

    def _layout(self, entries: list[Entry]) -> _Layout:
        """The scale segments, offsets and fingerprint of a bucket of these tensors' sizes
        and dtypes, made once per layout (a model's buckets repeat every step, and working
        them out again is a Python loop over every segment)."""
        b = self.backend
        numels = tuple(e.numel for e in entries)
        dtypes = tuple(b.dtype_name(e.tensor) for e in entries)
        key = (numels, dtypes)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _LAYOUTS:  # a program that never repeats a layout
                self._layouts.clear()
            counts, first = core.segments(numels, self.settings.scale_block)
            layout = self._layouts[key] = _Layout(
                counts, first, list(itertools.accumulate(numels, initial=0)),
                core.layout_fingerprint(numels, dtypes))
        return layout

    def _tree(self, rank: int, size: int, pset: Any, name: str, like: Any
              ) -> hierarchical.Tree | None:
        """COLLECTIVE with ``Settings.hierarchical``: the node layout (see
        :mod:`hvd_gqsgd.hierarchical`), or None for flat Global-QSGD."""
        if not self.settings.hierarchical:
            return None
        self._round.figures["overhead"] += 8 * 4 * size  # the table, also when it says flat
        with self._round.timing("scale_wait_s"):
            return hierarchical.topology(self.backend, rank, size, pset, f"{name}.topo", like)

    def _world(self) -> tuple[int, int, Any]:
        """(rank, size, set) of the compressor's process set, read afresh: elastic resizes."""
        pset = self.process_set
        if pset is None:
            pset = self.backend.global_process_set()
        if not pset.included():
            raise ValueError(f"this rank is not in GlobalQSGD's process set {pset}")
        return pset.rank(), pset.size(), pset

    def _abandon(self) -> None:
        """Drop the round in progress after an error (its probes may still be in flight).
        Eager names restart as at a round's end: every rank abandons at the same point, and
        a rank that Horovod elastic adds after the error starts from the first name too."""
        self._round = _Round()
        self.backend.end_round(False)
        if self.backend.stable_names():
            self._serial = 0
        self._rotation_round = 0  # as on a rank that elastic adds

    def _drop_dead_round(self) -> None:
        """Abandon a round whose ctxs are all gone before every tensor was decompressed (see
        :meth:`compress`); every rank of the set meets the same failure, so every rank drops
        its round at the same call."""
        warnings.warn(
            f"GlobalQSGD dropped an unfinished round: {self._round.outstanding} tensor(s) were "
            "compressed but never decompressed, and nothing holds their ctx any more (expected "
            "once after a step that failed, e.g. before a Horovod elastic reset); the tensors "
            "compressed from now on start a new round.", RuntimeWarning, stacklevel=4)
        self._abandon()

    def _release(self, bucket: Bucket, entry: Entry) -> None:
        entry.tensor = None
        bucket.remaining -= 1
        if bucket.remaining == 0:
            bucket.decoded = bucket.rescaled = bucket.layout = None
        r = self._round
        r.outstanding -= 1
        if r.outstanding == 0 and not r.queued:
            self.stats.add_round(r.figures, r.tensors)
            self._round = _Round()
            self._rotation_round += 1
            self.backend.end_round(True)
            if self.backend.stable_names():
                # Eager: restart names so Horovod's response cache sees the same ones each
                # step.  While tracing a graph, names must stay unique within the process.
                self._serial = 0

