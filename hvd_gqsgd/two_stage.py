r"""Two-stage Global-QSGD: integer codes summed exactly by a reduce-scatter, each shard
requantized once, then allgathered.

Flat Global-QSGD sums ``n`` codes in one ``bits``-wide lane, so every rank gets
``L = floor((2^(bits-1) - 1) / n)`` levels and the error of the average grows with ``n`` (8
bits: 63 levels at 2 ranks, 7 at 16, none from 128).  A ring allreduce is a reduce-scatter
followed by an allgather, and only the reduce-scatter adds: an allgather copies, so its codes
need neither a shared scale nor room for a sum.  Two-stage Global-QSGD gives the adding half
wide lanes and the copying half ``bits``-wide codes.

Algorithm, for one bucket (the engine's flat buffer and scale segments, as in flat
Global-QSGD) over the ``n`` ranks of the process set; :class:`hvd_gqsgd.core.TwoStagePlan`
holds every size below:

1. **Global scale** (COLLECTIVE, MAX allreduce; the flat path's own exchange): ``s`` per
   scale segment, the same on every rank.
2. **Stage-1 quantize.** Lanes of ``w = core.two_stage_bits(bits, n)`` bits, at most
   ``bits + ceil(log2 n)``, with ``L1 = core.two_stage_levels(bits, n) >= 2^(bits-1) - 1``
   levels per sign: each rank has at least the levels it would have alone at ``bits``.
   Unbiased rounding of ``x L1 / s``, ``64 // w`` codes per int64 word, zero-padded to
   ``n * q`` words.
3. **Sum reduce-scatter** (COLLECTIVE, int64 Sum): rank ``r`` receives words
   ``[r q, (r + 1) q)`` summed over ranks: the exact lane sums ``S`` of its shard
   (``|S| <= n L1 <= 2^(w-1) - 1``, the bound of :mod:`hvd_gqsgd.core` with ``w``-bit lanes).
4. **Requantize** (local, once).  The shard's scale segments, cut at its edges, are its
   *parts*; each gets a scale of its own, ``m = max |S|`` over the part, and
   ``c = round(S L2 / m)`` with ``L2 = 2^(bits-1) - 1`` and unbiased stochastic rounding
   (fresh noise from the rank's stream): ``E[c m / L2] = S``.  The message is the codes
   packed ``64 // bits`` to a word, then each part's ``m`` as an int64.
5. **Allgather** (COLLECTIVE) of the messages; every rank decodes the same bytes, so
   results are bit-identical on all ranks:
   ``x_sum = c * (m / L2) * (s / L1)`` (:func:`hvd_gqsgd.core.stage_two_steps`), times the
   op's factor (Average: ``1/n``) from Horovod's probe.

Error: stage 1 adds ``n`` roundings of step ``s / L1``, stage 2 one rounding of step
``m (s / L1) / L2`` with ``m <= n L1``; the sum's error is about that of one rank at ``bits``
whatever ``n`` is (docs/MULTINODE.md's table, from ``studies/two_stage_sim.py``).

Traffic per rank for ``T`` elements, in an allreduce's terms (``Stats.payload``,
:meth:`~hvd_gqsgd.core.TwoStagePlan.wire_bytes`): ``(n q + n (q2 + P)) / 2`` int64 words,
with ``q = ceil(T w' / 64 / n)`` (``w' = 64 / (64 // w)``), ``q2`` the shard's stage-2 code
words and ``P`` its part slots: about ``(w' + bits) / 2`` bits per element, against ``bits``
for flat: 8.6 at 2 ranks and 8 bits, 9.3 at 4, 10.4 at 8-16, 12 at 32-256.

Hazards:

* Collective order: ranks may launch different buckets' reduce-scatters and allgathers in
  different orders (the engine moves each bucket on as soon as its last collective is back,
  :meth:`hvd_gqsgd.engine.Engine._advance`); Horovod matches them by the engine's names,
  which are the same on every rank.
* Empty shards: a bucket of fewer words than ranks leaves the last ranks nothing to sum;
  they still send (all-zero) messages, so a tiny bucket costs ``n`` words at least.
* Chunks (``chunk_bytes > 0``) are a flat-path feature; ``two_stage=True`` refuses them.

Example::

    import horovod.torch as hvd
    from hvd_gqsgd import GlobalQSGD

    hvd.init()   # e.g. 64 ranks: flat 8 bits leaves 1 level, two-stage keeps 127
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=GlobalQSGD(bits=8, two_stage=True))
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from . import core

__all__ = ["BACKEND_METHODS", "chosen", "gather", "layout_of", "plan_of", "requantize",
           "scatter"]

# Backend methods two-stage needs on top of engine.Backend
BACKEND_METHODS = ("reducescatter_sum_async", "allgather_async", "lane_sums", "part_max",
                   "message", "messages")

_WARNED: set[str] = set()  # warnings already given in this process
_CACHE_SIZE = 64
_plans: OrderedDict[Any, tuple[core.TwoStagePlan, core.MessageLayout]] = OrderedDict()


def chosen(settings: core.Settings, world_size: int, what: str = "ranks") -> bool:
    """Whether a bucket summed over ``world_size`` ranks (nodes with ``hierarchical``, then
    ``what`` is ``"nodes"``) runs two-stage.  ``two_stage=False`` that leaves fewer than
    ``core.AUTO_MIN_LEVELS`` levels warns once; ``two_stage=None`` with an explicit
    ``chunk_bytes`` where two-stage is needed raises (chunks are flat-only)."""
    bits = settings.bits
    two = core.use_two_stage(settings.two_stage, bits, world_size)
    flat = core.flat_levels(bits, world_size)
    if settings.two_stage is None and two and settings.chunk_bytes:
        raise ValueError(
            f"GlobalQSGD(bits={bits}) leaves {flat} levels per sign at {world_size} {what}, so "
            f"two_stage=None picks two-stage Global-QSGD, which sends no chunks; got "
            f"chunk_bytes={settings.chunk_bytes}. Pass chunk_bytes=None, or two_stage=False "
            f"to keep flat Global-QSGD with chunks.")
    if not two and settings.two_stage is False and 0 < flat < core.AUTO_MIN_LEVELS:
        _warn_once(
            f"GlobalQSGD(bits={bits}, two_stage=False) leaves {flat} levels per sign at "
            f"{world_size} {what}: the average's error grows with the {what}' count. "
            f"two_stage=True (or None, the default) keeps {core.levels(bits, 1)} levels per "
            f"{what[:-1]} for about {_two_stage_bits_per_element(bits, world_size):.1f} bits "
            f"per element instead of {64 / core.lanes_per_word(bits):.1f}.")
    return two


def _two_stage_bits_per_element(bits: int, world_size: int) -> float:
    wide = 64 / core.lanes_per_word(core.two_stage_bits(bits, world_size))
    return (wide + 64 / core.lanes_per_word(bits)) / 2


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=5)


def plan_of(key: Any, counts: Sequence[int], world_size: int, bits: int
            ) -> tuple[core.TwoStagePlan, core.MessageLayout]:
    """The plan of a flat two-stage bucket and the layout of its gathered messages, cached by
    ``key`` (the bucket's layout: the same every step, so this runs once per layout)."""
    full = (key, world_size, bits)
    cached = _plans.get(full)
    if cached is None:
        plan = core.two_stage_plan(counts, world_size, bits)
        layout = core.message_layout([(plan, 0, 0)], plan.gather_words, len(counts))
        cached = _plans[full] = (plan, layout)
        if len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    return cached


def layout_of(key: Any, make: Any) -> Any:
    """A cached value for ``key`` made by ``make()`` (hierarchical's nested plans)."""
    cached = _plans.get(key)
    if cached is None:
        cached = _plans[key] = make()
        if len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    return cached


def check_backend(backend: Any) -> None:
    missing = [m for m in BACKEND_METHODS if not hasattr(backend, m)]
    if missing:
        raise TypeError(
            f"two-stage GlobalQSGD needs the backend methods {list(BACKEND_METHODS)}; "
            f"{type(backend).__name__} lacks {missing}. Use two_stage=False with it.")


def scatter(backend: Any, bucket: Any, flat: Any, scales: Any, plan: core.TwoStagePlan,
            name: str, pset: Any, round_: Any) -> None:
    """Steps 2-3, COLLECTIVE: quantize the bucket at ``plan.lane_bits`` and launch its Sum
    reduce-scatter; the handle goes to ``bucket.handles`` and the stage-1 steps ``s / L1``
    to ``bucket.steps``.  ``round_`` is the engine's round (figures and timers)."""
    b = backend
    check_backend(b)
    with round_.timing("quantize_s"):
        bucket.steps = core.step_sizes(b, scales, plan.levels1)
        mult = core.multipliers(b, scales, plan.levels1)
        words = b.encode(flat, mult, bucket.counts, plan.levels1, plan.lane_bits, bucket.rank,
                         pad_to=plan.scatter_words)
    bucket.handles = [b.reducescatter_sum_async(words, f"{name}.rs", pset)]
    round_.figures["payload"] += plan.wire_bytes()


def requantize(backend: Any, words: Any, plan: core.TwoStagePlan, index: int,
               rank: int) -> Any:
    """Step 4 on shard ``index`` (``words``: its summed stage-1 words, which the backend may
    rewrite): the rank's message, ``plan.message_words`` int64 words."""
    b, shard = backend, plan.shards[index]
    sums = b.lane_sums(words, plan.lane_bits, shard.hi - shard.lo)
    if shard.hi == shard.lo:  # past the bucket's last word: an all-zero message
        return b.message(None, sums, plan.code_words, plan.part_slots)
    part_max = b.part_max(sums, shard.counts)
    mult = core.stage_two_multipliers(b, part_max, plan.bits)
    codes = b.encode(sums, mult, shard.counts, plan.levels2, plan.bits, rank,
                     pad_to=plan.code_words)
    return b.message(codes, part_max, plan.code_words, plan.part_slots)


def gather(backend: Any, bucket: Any, plan: core.TwoStagePlan, name: str, pset: Any,
           round_: Any) -> Any:
    """Step 4 and the start of step 5, COLLECTIVE: wait for the reduce-scatter, requantize
    this rank's shard and launch the allgather of every rank's message; returns its handle.
    The engine waits for it and decodes with ``Backend.messages`` and the bucket's
    :class:`~hvd_gqsgd.core.MessageLayout`."""
    b = backend
    with round_.timing("codes_wait_s"):
        words = b.wait(bucket.handles[0])
    bucket.handles = []
    with round_.timing("quantize_s"):
        message = requantize(b, words, plan, bucket.rank, bucket.rank)
    return b.allgather_async(message, f"{name}.ag", pset)
