r"""Hierarchical Global-QSGD: full precision inside a node, codes summed across nodes only.

Flat Global-QSGD sums the codes of all ``n`` ranks in one lane, so its levels shrink like
``1/n``.  Inside a node the ranks can afford full precision (shared memory or NVLink), and
only the node sums need quantizing: the lanes then hold the codes of ``C`` nodes, and
``L = core.levels(bits, C)``.  8 nodes of 8 ranks keep ``L = 15`` at 8 bits instead of 1.

Nodes are Horovod's: rank ``(c, j)`` has ``cross_rank() == c`` and ``local_rank() == j``, with
``local_size() == S`` ranks on each of ``cross_size() == C`` nodes.  The path below uses only
the global process set, so a plain ``hvd.init()`` is enough.  Every collective is an
``alltoall`` whose splits send nothing to the ranks a step does not involve, so "the ranks of
my node" and "the ranks with my local rank" (the *cross group*) need no process sets.

Algorithm, for one bucket of ``T`` elements (the engine's flat buffer, scale segments as in
flat Global-QSGD), at every rank ``(c, j)``:

0. **Topology** (COLLECTIVE, MAX allreduce of ``4 * size`` floats).  Every rank writes its
   ``(local_rank, local_size, cross_rank, cross_size)`` at its own offset; all ranks get the
   same table and take the same decision: hierarchical when every node has the same
   ``S > 1`` ranks and ``C > 1``; otherwise flat Global-QSGD, with a one-time
   ``RuntimeWarning`` that says why (one node, one rank per node, or unequal nodes).
   Read at every flush, so elastic resizes are followed.
1. **Shards.** The bucket is cut into ``S`` shards at multiples of ``64 // bits`` elements
   (:func:`shard_plan`), so shard ``j``'s packed words are words ``[lo_j / K, hi_j / K)`` of
   the whole bucket.  A scale segment may straddle two shards.
2. **Intra-node reduce-scatter** (COLLECTIVE alltoall, full precision, node-local).  Rank
   ``(c, j)`` sends shard ``j'`` to ``(c, j')`` and sums the ``S`` copies of shard ``j`` it
   receives, in float64: :math:`y_{c,j} = \sum_{j'} x_{(c,j'),\,\mathrm{shard}\ j}`.
3. **Global scale** (COLLECTIVE MAX allreduce, same length as flat).  Each rank writes the
   local norms of its node sum's part of every segment its shard touches, zeros elsewhere
   (norms are >= 0, so zeros never win).  ``max`` norm: ``s_b`` is the max over nodes of
   :math:`\max |y|` in block ``b``, as flat Global-QSGD computes it over ranks.  ``l2``: the
   max over nodes *and shard parts* of the part's L2 norm; still ``>= |y|`` elementwise, so
   nothing clamps and the rounding stays unbiased.
4. **Quantize** the node sum with ``L = core.levels(bits, C)``: codes in ``[-L, L]``, packed
   (``Backend.encode``, the same kernels as flat).
5. **Cross-node reduce-scatter** (COLLECTIVE alltoall within the cross group).  Shard ``j``'s
   words are cut into ``C`` pieces; rank ``(k, j)`` receives piece ``k`` from every node and
   adds the ``C`` words as int64.  Every lane then holds a sum of exactly ``C`` codes in
   ``[-L, L]``: ``|sum| <= C * L <= 2**(bits-1) - 1``, the bound of :mod:`hvd_gqsgd.core`
   with ``n = C``.  No partial sum goes further, whatever the order of addition.
6. **Cross-node allgather** (COLLECTIVE alltoall within the cross group): rank ``(k, j)``
   sends its summed piece to every ``(c, j)``; each rank now has shard ``j``'s summed words.
7. **Intra-node allgather** (COLLECTIVE alltoall, node-local): rank ``(c, j)`` sends shard
   ``j``'s summed words to ``(c, j')``; each rank now has the summed words of the bucket.
8. **Decode** as flat Global-QSGD does: ``sum(q) * s / L``; the op's scaling (Average: 1/n
   with ``n`` the *world* size) comes from Horovod's probe.  Every rank decodes the same words
   with the same scales: results are bit-identical on all ranks.

Traffic per rank, for ``T`` elements of ``b``-byte floats and ``w = T * bits / 64`` words:
node-local ``(S-1)/S * T * b`` bytes (step 2) plus ``(S-1)/S * 8 w`` (step 7); across nodes
``2 (C-1)/C * 8 w / S`` (steps 5-6): each rank carries only its shard over the network, as
in the usual hierarchical allreduce.  ``Stats.payload`` counts the packed bytes a rank sends
to other ranks (steps 5-7), ``Stats.overhead`` adds the full-precision bytes of step 2 and
the topology table to the scale vector and probes.

Hazards:

* Only the global process set: Horovod's local and cross ranks describe it alone
  (``ValueError`` otherwise).
* A "node" is a value of ``cross_rank``.  The result is correct for any assignment of ranks
  to nodes; speed depends on nodes being real machines.
* Ranks must flush in the same order (as in flat Global-QSGD): 6 collectives per bucket
  (flat has 2), a latency cost that shows with many small buckets.

Example::

    import horovod.torch as hvd
    from hvd_gqsgd import GlobalQSGD

    hvd.init()   # e.g. 8 nodes x 8 GPUs: L = 15 at bits=8 instead of 1
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=GlobalQSGD(bits=8, hierarchical=True))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import core, two_stage
from .core import shard_plan

__all__ = ["BACKEND_METHODS", "Tree", "reduce", "shard_plan", "split_words", "topology"]

# Backend methods the hierarchical path needs on top of engine.Backend
BACKEND_METHODS = ("topology", "alltoall", "placed", "sum_rows", "host_list")

_WARNED: set[str] = set()  # warnings already given in this process


@dataclass(frozen=True)
class Tree:
    """The nodes of the global set: ``ranks[c][j]`` is the global rank of local rank ``j`` on
    node ``c``.  ``local_rank`` picks this rank's shard, ``cross_rank`` its piece of it."""

    local_rank: int
    cross_rank: int
    ranks: tuple[tuple[int, ...], ...]

    @property
    def local_size(self) -> int:
        return len(self.ranks[0])

    @property
    def cross_size(self) -> int:
        """The node count: the ``n`` of the overflow bound."""
        return len(self.ranks)

    @property
    def node(self) -> tuple[int, ...]:
        """Global ranks of this rank's node, by local rank."""
        return self.ranks[self.cross_rank]

    @property
    def peers(self) -> tuple[int, ...]:
        """Global ranks of this rank's cross group (same local rank), by node."""
        return tuple(row[self.local_rank] for row in self.ranks)


def check_backend(backend: Any) -> None:
    missing = [m for m in BACKEND_METHODS if not hasattr(backend, m)]
    if missing:
        raise TypeError(
            f"GlobalQSGD(hierarchical=True) needs the backend methods {list(BACKEND_METHODS)}; "
            f"{type(backend).__name__} lacks {missing}. Use hierarchical=False with this "
            "framework (PyTorch supports it).")


def topology(backend: Any, rank: int, size: int, pset: Any, name: str, like: Any
             ) -> Tree | None:
    """COLLECTIVE (MAX allreduce of ``4 * size`` floats): the node layout, or ``None`` when
    flat Global-QSGD must run (one node, one rank per node, or unequal nodes: each warned
    once per process with a ``RuntimeWarning``).
    Every rank gets the same table, so every rank returns the same decision."""
    check_backend(backend)
    if pset is not backend.global_process_set():
        raise ValueError(
            "GlobalQSGD(hierarchical=True) works on Horovod's global process set only (local "
            f"and cross ranks describe that set), got process_set={pset!r}; drop "
            "process_set=..., or use hierarchical=False")
    mine = backend.topology()  # (local_rank, local_size, cross_rank, cross_size)
    values = [0.0] * (4 * size)
    values[4 * rank:4 * rank + 4] = [float(v) for v in mine]
    table = backend.host_list(backend.allreduce_max(backend.probe(values, like), name, pset))
    rows = [tuple(int(v) for v in table[4 * r:4 * r + 4]) for r in range(size)]
    layout = _grid(rows)
    why = _flat_reason(rows, layout)
    if why is not None:
        _warn_once(f"GlobalQSGD(hierarchical=True): {why}; using flat Global-QSGD with "
                   f"levels for n={size} ranks. Pass hierarchical=False to silence this.")
        return None
    assert layout is not None
    return Tree(local_rank=mine[0], cross_rank=mine[2], ranks=layout)


def _flat_reason(rows: Sequence[tuple[int, ...]],
                 layout: tuple[tuple[int, ...], ...] | None) -> str | None:
    """Why the hierarchy cannot help on this layout (the start of the one-time warning), or
    None when it can.  One node or one rank per node is flat already: every level count would
    equal flat Global-QSGD's, for 4 more collectives per bucket."""
    if layout is None:
        sizes = sorted({(row[3], row[1]) for row in rows})
        return f"the nodes have unequal rank counts (cross_size, local_size pairs {sizes})"
    if len(layout) == 1:
        return f"one node holds all {len(rows)} rank(s) (cross_size 1)"
    if len(layout[0]) == 1:
        return f"each of the {len(layout)} nodes has one rank (local_size 1)"
    return None


def _grid(rows: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...] | None:
    """``ranks[c][j]`` from every rank's (local_rank, local_size, cross_rank, cross_size), or
    None unless they form ``C`` nodes of ``S`` ranks, each (c, j) exactly once."""
    local_size, cross_size = rows[0][1], rows[0][3]
    if any(r[1] != local_size or r[3] != cross_size for r in rows):
        return None
    if local_size * cross_size != len(rows):
        return None
    grid = [[-1] * local_size for _ in range(cross_size)]
    for rank, (j, _, c, _) in enumerate(rows):
        if not (0 <= j < local_size and 0 <= c < cross_size) or grid[c][j] >= 0:
            return None
        grid[c][j] = rank
    return tuple(tuple(row) for row in grid)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def split_words(words: int, parts: int) -> list[int]:
    """Word counts of ``parts`` near-equal consecutive pieces of ``words`` words."""
    base, extra = divmod(words, parts)
    return [base + (k < extra) for k in range(parts)]


@dataclass
class _Call:
    """What every step needs: the backend, the collectives' set and names, the round's
    figures and timers (engine._Round)."""

    backend: Any
    size: int
    pset: Any
    name: str
    round: Any

    def alltoall(self, dests: Sequence[int], pieces: Sequence[Any], whole: Any,
                 step: str, concat: Callable[[Sequence[Any]], Any]) -> Any:
        """COLLECTIVE: send ``pieces[i]`` to rank ``dests[i]`` and nothing to other ranks;
        return what arrived, in rank order of the senders.  Horovod's alltoall wants the send
        buffer in rank order: ``whole`` (the pieces already concatenated, or None) is sent
        as is when ``dests`` ascend, else the pieces are copied into rank order."""
        b = self.backend
        splits = [0] * self.size
        for r, piece in zip(dests, pieces):
            splits[r] = b.numel(piece)
        ordered = list(dests) == sorted(dests)
        if ordered and whole is not None:
            send = whole
        elif len(pieces) == 1:
            send = pieces[0]
        else:
            send = concat([p for _, p in sorted(zip(dests, pieces), key=lambda rp: rp[0])])
        with self.round.timing("codes_wait_s"):
            return b.alltoall(send, splits, f"{self.name}.{step}", self.pset)


def _in_order(backend: Any, recv: Any, senders: Sequence[int], widths: Sequence[int]) -> Any:
    """``recv`` (pieces in rank order of ``senders``, ``widths[i]`` words from
    ``senders[i]``) rearranged in the order of ``senders``; no copy when they ascend."""
    if list(senders) == sorted(senders):
        return recv
    starts, offset = {}, 0
    for r, w in sorted(zip(senders, widths)):
        starts[r] = offset
        offset += w
    return backend.concat_words([recv[starts[r]:starts[r] + w] for r, w in zip(senders, widths)])


def reduce(backend: Any, settings: core.Settings, tree: Tree, bucket: Any, flat: Any,
           name: str, pset: Any, round_: Any, two: bool = False) -> None:
    """COLLECTIVE (steps 2-8 of the module docstring): leaves the bucket decoded, with its
    step sizes, exactly as flat Global-QSGD's wait + decode would.  ``round_`` is the engine's
    round (figures and timers).  ``two``: steps 4-6 run two-stage across nodes (see
    :func:`_reduce_two_stage`)."""
    b, bits, level = backend, settings.bits, bucket.n_levels
    call = _Call(b, bucket.world_size, pset, name, round_)
    shards = shard_plan(bucket.counts, bits, tree.local_size)
    mine = shards[tree.local_rank]
    node_sum = _reduce_scatter_node(call, tree, flat, shards)
    scales = _exchange_scales(call, bucket, settings.norm, mine, node_sum)
    if two:
        _reduce_two_stage(call, tree, bucket, node_sum, scales, shards, bits)
        return
    with round_.timing("quantize_s"):
        bucket.steps = core.step_sizes(b, scales, level)
        mult = core.multipliers(b, scales, level)
        if mine.hi > mine.lo:
            words = b.encode(node_sum, mult[mine.first:mine.stop], mine.counts, level, bits,
                             bucket.rank)
        else:
            words = b.to_int64(flat[0:0])
    shard_words = _allreduce_cross(call, tree, words)
    summed = _allgather_node(call, tree, shard_words,
                             [core.packed_words(s.hi - s.lo, bits) for s in shards])
    with round_.timing("quantize_s"):
        bucket.decoded = b.decoder(summed, bits, bucket.total)
    bucket.handles = []


def _reduce_scatter_node(call: _Call, tree: Tree, flat: Any, shards: list[core.Chunk]) -> Any:
    """Step 2, COLLECTIVE: full-precision sum over this node of this rank's shard (float64
    for float inputs: the node sum is rounded once, when it is quantized)."""
    b, mine = call.backend, shards[tree.local_rank]
    pieces = [flat[s.lo:s.hi] for s in shards]
    recv = call.alltoall(tree.node, pieces, flat, "node_rs", b.flat_concat)
    width = mine.hi - mine.lo
    sent = b.numel(flat) - width
    call.round.figures["overhead"] += sent * b.nbytes(flat) // max(1, b.numel(flat))
    if width == 0:
        return recv
    with call.round.timing("quantize_s"):
        return b.sum_rows(recv, tree.local_size)


def _exchange_scales(call: _Call, bucket: Any, norm: str, mine: core.Chunk, node_sum: Any
                     ) -> Any:
    """Step 3, COLLECTIVE: per-segment MAX over nodes (and shard parts) of the node sums'
    norms, plus the layout pair; one vector as long as flat Global-QSGD's."""
    b, n_segments = call.backend, len(bucket.counts)
    layout = bucket.fingerprint
    tail = b.probe([layout, -layout], bucket.entries[0].tensor)
    with call.round.timing("quantize_s"):
        if mine.hi > mine.lo:
            part = b.local_norms([], node_sum, mine.counts, norm, [])
            vec = b.flat_concat([b.placed(part, mine.first, n_segments), tail])
        else:
            vec = b.flat_concat([b.placed(tail[0:0], 0, n_segments), tail])
    call.round.figures["overhead"] += core.scale_exchange_bytes(n_segments)
    with call.round.timing("scale_wait_s"):
        return b.check_layout(b.allreduce_max(vec, f"{call.name}.scale", call.pset))


def _allreduce_cross(call: _Call, tree: Tree, words: Any) -> Any:
    """Steps 5-6, COLLECTIVE: sum this shard's words over the nodes (cross group only)."""
    b, nodes = call.backend, tree.cross_size
    sizes = split_words(b.numel(words), nodes)
    starts = [sum(sizes[:k]) for k in range(nodes)]
    pieces = [words[starts[k]:starts[k] + sizes[k]] for k in range(nodes)]
    recv = call.alltoall(tree.peers, pieces, words, "cross_rs", b.concat_words)
    mine = sizes[tree.cross_rank]
    with call.round.timing("quantize_s"):
        # int64 sum of C words: every lane is a sum of C codes in [-L, L], inside the bound
        piece = b.sum_rows(recv, nodes) if mine else recv
    back = call.alltoall(tree.peers, [piece] * nodes, None, "cross_ag", b.concat_words)
    call.round.figures["payload"] += 8 * (b.numel(words) - mine + (nodes - 1) * mine)
    return _in_order(b, back, tree.peers, sizes)


def _allgather_node(call: _Call, tree: Tree, shard_words: Any, widths: list[int]) -> Any:
    """Step 7, COLLECTIVE: every shard's summed words from the ranks of this node, in shard
    order: the summed words of the whole bucket."""
    b = call.backend
    recv = call.alltoall(tree.node, [shard_words] * tree.local_size, None, "node_ag",
                         b.concat_words)
    call.round.figures["payload"] += 8 * (tree.local_size - 1) * b.numel(shard_words)
    return _in_order(b, recv, tree.node, widths)


def _reduce_two_stage(call: _Call, tree: Tree, bucket: Any, node_sum: Any, scales: Any,
                      shards: list[core.Chunk], bits: int) -> None:
    """Steps 4-7 with two-stage Global-QSGD across nodes (:mod:`hvd_gqsgd.two_stage`, its
    ``n`` being the node count ``C``): the node sum of shard ``j`` is quantized in lanes of
    ``core.two_stage_bits(bits, C)``, summed over the cross group by an alltoall
    reduce-scatter, each piece requantized at ``bits``, and the messages allgathered across
    nodes, then inside the node.  Leaves the bucket's decoder state and message layout."""
    b, nodes = call.backend, tree.cross_size
    plans = two_stage.layout_of(
        ("hierarchical", tuple(bucket.counts), tree.local_size, nodes, bits),
        lambda: _plans(shards, nodes, bits, len(bucket.counts)))
    plan_list, layout = plans
    plan, mine = plan_list[tree.local_rank], shards[tree.local_rank]
    level = plan.levels1
    with call.round.timing("quantize_s"):
        steps1 = core.step_sizes(b, scales, level)
        mult = core.multipliers(b, scales, level)
        if plan.scatter_words:
            words = b.encode(node_sum, mult[mine.first:mine.stop], mine.counts, level,
                             plan.lane_bits, bucket.rank, pad_to=plan.scatter_words)
        else:
            words = b.to_int64(node_sum[0:0])
    q = plan.shard_words
    pieces = [words[k * q:(k + 1) * q] for k in range(nodes)]
    recv = call.alltoall(tree.peers, pieces, words, "cross_rs", b.concat_words)
    with call.round.timing("quantize_s"):
        # int64 sum of C words: every lane is a sum of C codes in [-L1, L1], inside the bound
        piece = b.sum_rows(recv, nodes) if q else recv
        message = two_stage.requantize(b, piece, plan, tree.cross_rank, bucket.rank)
    back = call.alltoall(tree.peers, [message] * nodes, None, "cross_ag", b.concat_words)
    messages = _in_order(b, back, tree.peers, [plan.message_words] * nodes)
    widths = [p.gather_words for p in plan_list]
    gathered = _allgather_node(call, tree, messages, widths)
    call.round.figures["payload"] += 8 * (nodes - 1) * (q + plan.message_words)
    with call.round.timing("quantize_s"):
        bucket.decoded = b.messages(gathered, layout, steps1)
    bucket.layout, bucket.handles = layout, []


def _plans(shards: list[core.Chunk], nodes: int, bits: int, n_segments: int
           ) -> tuple[list[core.TwoStagePlan], core.MessageLayout]:
    """Each node shard's two-stage plan across ``nodes``, and the layout of the words every
    rank ends with: shard 0's ``nodes`` messages, then shard 1's, ..."""
    plans = [core.two_stage_plan(s.counts, nodes, bits) for s in shards]
    blocks, offset = [], 0
    for plan, shard in zip(plans, shards):
        blocks.append((plan, offset, shard.first))
        offset += plan.gather_words
    return plans, core.message_layout(blocks, offset, n_segments)
