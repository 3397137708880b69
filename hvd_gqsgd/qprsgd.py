r"""QPRSGD: local SGD whose periodic synchronisation sends quantized model differences.

QPRSGD (Quantized Parallel Restarted SGD, arXiv 2004.09125) lets every rank take ``K`` local
optimizer steps and then synchronises the models, sending quantized *model differences*
instead of every step's gradient.  Against synchronous fp32 SGD a rank sends
``bits / 32 / K`` of the bytes (1/32 at ``bits=8``, ``K=8``).  Two ways to synchronise:

* ``topology="allreduce"``: one Horovod ``grouped_allreduce`` of the differences to the
  last synchronised model, through any Horovod compressor.  With :class:`GlobalQSGD` the
  integer codes are summed on the wire and every rank ends the sync with the same model,
  bit for bit.
* ``topology="gossip"``: a ring; each rank sends its quantized difference to its two
  neighbours only (CHOCO-gossip style public copies, so quantization error never piles up)
  and mixes with weight 1/3.  No collective over all ranks: each link carries two messages.

Importing this module imports ``torch`` and ``horovod.torch``.  The quantizer is the one of
:mod:`hvd_gqsgd.core` / :mod:`hvd_gqsgd.kernels`, reached through
:class:`hvd_gqsgd.torch.TorchBackend`; nothing here re-derives a formula.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

from . import core
from .compressor import GlobalQSGD, refuse_class

__all__ = ["QPRSGD", "SyncStats", "TOPOLOGIES", "RING_WEIGHT", "ring_neighbours"]

TOPOLOGIES = ("allreduce", "gossip")
RING_WEIGHT = 1.0 / 3.0  # w_ij for j in {i-1, i, i+1} on a ring: symmetric, doubly stochastic
GOSSIP_MIN_RANKS = 3  # a ring whose two neighbours are distinct ranks


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(left, right) neighbours of ``rank`` on a ring of ``size >= 3`` ranks."""
    return (rank - 1) % size, (rank + 1) % size


@dataclass(frozen=True)
class _Settings:
    """QPRSGD's validated arguments (all checking lives here)."""

    period: int
    topology: str
    warmup_steps: int
    gamma: float

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"QPRSGD period must be an int >= 1 (local steps between syncs), "
                             f"got {self.period!r}; period=1 synchronises after every step")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"QPRSGD topology must be one of {TOPOLOGIES}, got "
                             f"{self.topology!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or (
                self.warmup_steps < 0):
            raise ValueError(f"QPRSGD warmup_steps must be an int >= 0, got "
                             f"{self.warmup_steps!r}")
        if not (isinstance(self.gamma, int | float) and 0.0 < self.gamma <= 1.0):
            raise ValueError(f"QPRSGD gamma (gossip consensus step) must be in (0, 1], got "
                             f"{self.gamma!r}; 1.0 suits 8 bits, try 0.5 at 4 bits or fewer")


@dataclass
class SyncStats:
    """What the synchronisations cost one rank: count, seconds, and bytes this rank put on
    the wire (packed payload plus scales; Horovod's own framing not counted).  In allreduce
    mode the bytes are one rank's input to the allreduce (a ring sends about twice that)."""

    syncs: int = 0
    last_sync_s: float = 0.0
    total_sync_s: float = 0.0
    last_bytes: int = 0
    total_bytes: int = 0

    def add(self, seconds: float, nbytes: int) -> None:
        self.syncs += 1
        self.last_sync_s, self.last_bytes = seconds, nbytes
        self.total_sync_s += seconds
        self.total_bytes += nbytes


class QPRSGD(torch.optim.Optimizer):
    r"""Local SGD with quantized periodic synchronisation, as a torch optimizer wrapper.

    Let :math:`x_i` be rank ``i``'s parameters (``params``), :math:`n` the ranks of the
    process set, :math:`K` = ``period``, :math:`Q` the compressor.  Step ``t`` (the ``t``-th
    call of :meth:`step`, counted from 1) does:

    1. **Local step.** ``optimizer.step()``: :math:`x_i \leftarrow x_i - \eta\, u_i`, where
       :math:`u_i` is whatever the local optimizer computes from the local gradient.  Its
       state (momentum, Adam moments) stays local and is never communicated or averaged.
    2. **Sync?** when :math:`t \le` ``warmup_steps`` (warmup: every step), or
       :math:`(t - \text{warmup\_steps}) \bmod K = 0`.
    3. **allreduce** (COLLECTIVE): every rank holds the same synchronised model
       :math:`\bar x`.  It sends :math:`d_i = x_i - \bar x` through one
       ``hvd.grouped_allreduce(op=Average, compression=Q)`` and sets

       .. math:: \bar x \leftarrow \bar x + \tfrac1n \textstyle\sum_i Q(d_i), \qquad
                 x_i \leftarrow \bar x .

       With :class:`GlobalQSGD` the sum is of integer codes: one scale exchange and one
       packed Sum per sync, and :math:`\bar x` is bit-identical on every rank.  With
       ``Compression.none`` and ``K=1`` plain SGD this is synchronous SGD (up to float
       rounding): :math:`\bar x - \eta \cdot \mathrm{mean}_i\, g_i`.
    4. **gossip** (COLLECTIVE, ring of :math:`n \ge 3`): rank ``i`` keeps public copies
       :math:`\hat x_i, \hat x_{i-1}, \hat x_{i+1}`, changed only by what was sent.  It sends
       :math:`q_i = Q_{loc}(x_i - \hat x_i)` to both neighbours, receives theirs, and sets

       .. math:: \hat x_j \leftarrow \hat x_j + q_j \ (j \in \{i-1, i, i+1\}), \qquad
                 x_i \leftarrow x_i + \gamma \textstyle\sum_j w_{ij} (\hat x_j - \hat x_i)

       with :math:`w_{ij} = 1/3` for the three ring members.  :math:`Q_{loc}` is the
       quantizer of :mod:`hvd_gqsgd.core` with a *local* scale per block (codes are never
       summed, so :math:`L = 2^{bits-1}-1`, ``core.levels(bits, 1)``: 127 at 8 bits).
       Every holder of :math:`\hat x_j` applies the same decoded :math:`q_j`, so the copies
       agree bit for bit and the quantization error of a round is what :math:`x_j - \hat
       x_j` carries into the next round's message: it is re-sent, never accumulated.  W is
       symmetric, so mixing keeps :math:`\mathrm{mean}_i\, x_i` unchanged.

    Bytes per sync and rank, ``N`` parameters at 8 bits: allreduce :math:`N` (plus 8 per
    1024-element scale block) into a ring allreduce; gossip :math:`2N` (one message to each
    neighbour).  Synchronous fp32 sends :math:`4N` every step, so the ratio per step is
    :math:`4K` (allreduce) and :math:`2K` (gossip).

    Example::

        import horovod.torch as hvd
        from hvd_gqsgd import GlobalQSGD
        from hvd_gqsgd.qprsgd import QPRSGD

        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)   # same start everywhere
        opt = QPRSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                     model.parameters(), period=8, compression=GlobalQSGD(bits=8))
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()        # local step; every 8th call also synchronises

    Args:
        optimizer: the local torch optimizer (not a ``hvd.DistributedOptimizer``: QPRSGD
            does its own communication).
        params: the tensors to synchronise, normally ``model.parameters()`` (or
            ``named_parameters()``); same shapes, dtypes and order on every rank.
        period: ``K``, local steps between syncs (>= 1).
        compression: allreduce mode: any Horovod compressor (default ``GlobalQSGD(bits=8)``).
            Gossip mode: ``GlobalQSGD`` (its ``bits``, ``norm``, ``seed``, ``scale_block``
            are used, with local scales) or an element-wise Horovod compressor such as
            ``hvd.Compression.none``.
        topology: ``"allreduce"`` or ``"gossip"``.
        warmup_steps: the first ``warmup_steps`` steps synchronise after every step (model
            averaging at period 1 through the same topology and compressor), then every
            ``K``-th.  With plain SGD that is synchronous SGD; with momentum it differs
            (the momentum buffers stay local).
        gamma: gossip consensus step size in (0, 1].  1 is plain gossip averaging of the
            public copies; lower it when few bits make :math:`Q_{loc}` coarse.
        process_set: Horovod process set to synchronise over (default: global); a
            ``GlobalQSGD`` compressor must use the same one.

    .. warning::
        * **Start.** All ranks must start from the same parameters (broadcast them).  The
          first :meth:`step` checks this with one small MAX allreduce of a hash of the
          parameters and raises ``ValueError`` if they differ.
        * **Order.** :meth:`step` is COLLECTIVE on sync steps: every rank must call it the
          same number of times.  Between syncs the ranks' models differ (that is local SGD);
          evaluate or checkpoint right after a sync step for a model that all ranks share.
        * **World size.** Read again at every sync (elastic, process sets).  When the rank
          or size changed since the last sync, the sync is replaced by a restart: one fp32
          Average allreduce of the parameters, which becomes everyone's model and public
          copy.  ``GlobalQSGD`` recomputes its levels from the new size by itself.
        * **Gossip with fewer than 3 ranks** raises ``ValueError`` at the sync: a ring of 2
          has one neighbour, and there ``topology="allreduce"`` does the same job cheaper.
        * **Memory.** allreduce: one copy of the parameters (:math:`\bar x`).  gossip: three
          (the public copies), flat, in float32 (float64 if a parameter is float64).
    """

    _instances = itertools.count()

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[Any], period: int = 4,
                 compression: Any = None, topology: str = "allreduce", warmup_steps: int = 0,
                 gamma: float = 1.0, process_set: Any = None) -> None:
        # torch.optim.Optimizer.__init__ is not called on purpose: the wrapped optimizer
        # owns param_groups and state, and QPRSGD only delegates to it.
        self.settings = _Settings(period=period, topology=topology, warmup_steps=warmup_steps,
                                  gamma=float(gamma))
        if hasattr(optimizer, "_allreduce_grad_async"):
            raise TypeError("QPRSGD got a hvd.DistributedOptimizer; pass the plain local torch "
                            "optimizer instead (QPRSGD synchronises models, not gradients)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"QPRSGD needs a torch.optim.Optimizer, got {type(optimizer)}")
        self.optim = optimizer
        self._params = _check_params(params)
        self.compression = GlobalQSGD(bits=8) if compression is None else compression
        self.process_set = process_set
        _check_compression(self.compression, self.settings.topology, process_set)
        self._prefix = f"qprsgd.{next(QPRSGD._instances)}"  # same on every rank: built in order
        self.stats = SyncStats()
        self._steps = 0  # calls of step() so far
        self._world: tuple[int, int] | None = None  # (rank, size) at the last sync or start
        self._anchor: list[torch.Tensor] | None = None  # allreduce: x_bar, one per param
        self._public: dict[str, torch.Tensor] | None = None  # gossip: flat x_hat of self/left/right
        self._gossip: _GossipCodec | None = None

    # ----------------------------------------------------------------- optimizer protocol

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def __repr__(self) -> str:
        s = self.settings
        return (f"QPRSGD({self.optim!r}, period={s.period}, topology={s.topology!r}, "
                f"compression={self.compression!r}, warmup_steps={s.warmup_steps})")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("QPRSGD cannot add parameter groups after construction: the set of "
                        "synchronised tensors is fixed; build a new QPRSGD instead")

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Local step, then (COLLECTIVE) a sync every ``period``-th call, every call during
        warmup.  The first call also checks that all ranks start from the same parameters."""
        if self._world is None:
            self._start()
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        self._steps += 1
        if self.is_sync_step(self._steps):
            self.synchronize()
        return loss

    def is_sync_step(self, t: int) -> bool:
        """Whether call ``t`` (from 1) of :meth:`step` ends with a sync."""
        s = self.settings
        return t <= s.warmup_steps or (t - s.warmup_steps) % s.period == 0

    @torch.no_grad()
    def synchronize(self) -> None:
        """COLLECTIVE: synchronise now, whatever the step count (see the class docstring)."""
        if self._world is None:
            self._start()
        pset = self._pset()
        world = (pset.rank(), pset.size())
        start = time.perf_counter()
        if world != self._world:
            nbytes = self._restart(pset, world)
        elif self.settings.topology == "allreduce":
            nbytes = self._sync_allreduce(pset)
        else:
            nbytes = self._sync_gossip(pset, *world)
        self.stats.add(time.perf_counter() - start, nbytes)

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict plus a ``"qprsgd"`` entry: step count, world,
        and the synchronised model (allreduce) or the public copies (gossip)."""
        out = self.optim.state_dict()
        out["qprsgd"] = {
            "steps": self._steps, "world": self._world,
            "topology": self.settings.topology,
            "anchor": None if self._anchor is None else [a.clone() for a in self._anchor],
            "public": None if self._public is None else {
                k: v.clone() for k, v in self._public.items()},
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.  A plain optimizer state dict (no
        ``"qprsgd"`` entry) restarts QPRSGD: the next step re-checks and re-anchors."""
        state_dict = dict(state_dict)
        mine = state_dict.pop("qprsgd", None)
        self.optim.load_state_dict(state_dict)
        if mine is None:
            warnings.warn("QPRSGD.load_state_dict: no 'qprsgd' entry (a plain optimizer "
                          "checkpoint); the step count restarts at 0 and the next step "
                          "re-anchors on the current parameters", stacklevel=2)
            self._steps, self._world, self._anchor, self._public = 0, None, None, None
            return
        if mine["topology"] != self.settings.topology:
            raise ValueError(f"QPRSGD.load_state_dict: checkpoint is for topology "
                             f"{mine['topology']!r}, this optimizer uses "
                             f"{self.settings.topology!r}")
        self._steps = int(mine["steps"])
        self._world = None if mine["world"] is None else (int(mine["world"][0]),
                                                          int(mine["world"][1]))
        self._anchor = None if mine["anchor"] is None else [
            a.to(device=p.device, dtype=p.dtype).clone()
            for a, p in zip(mine["anchor"], self._params)]
        device = self._params[0].device
        self._public = None if mine["public"] is None else {
            k: v.to(device).clone() for k, v in mine["public"].items()}

    # ----------------------------------------------------------------- read-only views

    def synced_params(self) -> list[torch.Tensor] | None:
        """allreduce mode: the synchronised model :math:`\\bar x` (None before the start)."""
        return self._anchor

    def public_copies(self) -> dict[str, torch.Tensor] | None:
        """gossip mode: flat public copies ``{"self", "left", "right"}`` (None before)."""
        return self._public

    # ----------------------------------------------------------------- internals

    def _pset(self) -> Any:
        pset = hvd.global_process_set if self.process_set is None else self.process_set
        if not pset.included():
            raise ValueError(f"this rank is not in QPRSGD's process set {pset}")
        return pset

    @torch.no_grad()
    def _start(self) -> None:
        """COLLECTIVE: check that every rank starts from the same parameters; anchor on them."""
        pset = self._pset()
        digest = _fingerprint(self._params)
        both = torch.tensor([digest, -digest], dtype=torch.float64)
        high, neg_low = hvd.allreduce(both, op=hvd.Max, name=f"{self._prefix}.check",
                                      process_set=pset).tolist()
        if high != -neg_low:
            raise ValueError(
                "QPRSGD: the ranks start from different parameters (or shapes/dtypes/order "
                "differ). Broadcast them first, e.g. hvd.broadcast_parameters("
                "model.state_dict(), root_rank=0), and pass the same params on every rank.")
        self._anchor_on_current((pset.rank(), pset.size()))

    def _anchor_on_current(self, world: tuple[int, int]) -> None:
        """Make the current parameters the synchronised model and every public copy."""
        self._world = world
        if self.settings.topology == "allreduce":
            self._anchor = [p.detach().clone() for p in self._params]
            return
        flat = _flat(self._params)
        self._public = {"self": flat.clone(), "left": flat.clone(), "right": flat}

    def _restart(self, pset: Any, world: tuple[int, int]) -> int:
        """COLLECTIVE: the world changed; exact fp32 average of the parameters for everyone."""
        avg = hvd.grouped_allreduce([p.detach() for p in self._params], op=hvd.Average,
                                    name=f"{self._prefix}.restart", process_set=pset)
        for p, a in zip(self._params, avg):
            p.copy_(a)
        self._anchor_on_current(world)
        return sum(p.numel() * p.element_size() for p in self._params)

    def _sync_allreduce(self, pset: Any) -> int:
        """COLLECTIVE: x_bar += Average_i Q(x_i - x_bar); x_i = x_bar (bit-identical)."""
        assert self._anchor is not None
        params = [p.detach() for p in self._params]
        diffs = torch._foreach_sub(params, self._anchor)
        mean = hvd.grouped_allreduce(diffs, op=hvd.Average, compression=self.compression,
                                     name=f"{self._prefix}.sync", process_set=pset)
        torch._foreach_add_(self._anchor, mean)
        for p, a in zip(params, self._anchor):
            p.copy_(a)
        return _allreduce_bytes(self.compression, params, pset.size())

    def _sync_gossip(self, pset: Any, rank: int, size: int) -> int:
        """COLLECTIVE (ring neighbours): CHOCO-style exchange of Q(x_i - x_hat_i), then mix."""
        if size < GOSSIP_MIN_RANKS:
            raise ValueError(
                f"QPRSGD(topology='gossip') needs a ring of at least {GOSSIP_MIN_RANKS} ranks "
                f"(two distinct neighbours), the process set has {size}; use "
                "topology='allreduce', which with 2 ranks exchanges the same information")
        assert self._public is not None
        if self._gossip is None:
            self._gossip = _GossipCodec(self.compression, self._params)
        codec, hat = self._gossip, self._public
        x = _flat(self._params)
        left, right = ring_neighbours(rank, size)
        message = codec.encode(x - hat["self"], rank)
        from_left, from_right = _exchange(message, rank, size, left, right,
                                          f"{self._prefix}.gossip", pset)
        hat["self"] += codec.decode(message)
        hat["left"] += codec.decode(from_left)
        hat["right"] += codec.decode(from_right)
        # x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i), w = 1/3 on i-1, i, i+1
        mix = (hat["left"] + hat["right"] - 2.0 * hat["self"]) * (
            self.settings.gamma * RING_WEIGHT)
        _add_flat(self._params, mix)
        return 2 * message.numel() * message.element_size()


class _GossipCodec:
    """Gossip messages: encode a flat difference, decode a received one.

    ``GlobalQSGD``: codes with one *local* scale per block (``L = core.levels(bits, 1)``), via
    :class:`hvd_gqsgd.torch.TorchBackend` (fused kernels on CPU, ``core.encode`` otherwise);
    the message is the int64 words followed by the float64 scales' bits.  With the
    compressor's rotation the difference is rotated before its norms and every decoded
    message rotated back, with signs keyed by the seed and the sync count, alike on every
    rank.  Another Horovod
    compressor: its own ``compress``/``decompress`` (element-wise: none, fp16)."""

    def __init__(self, compression: Any, params: list[torch.Tensor]) -> None:
        self.compression = compression
        self.numels = [p.numel() for p in params]
        self.dtype = _flat_dtype(params)
        self.quantized = isinstance(compression, GlobalQSGD)
        if self.quantized:
            from .torch import TorchBackend  # lazily: hvd_gqsgd.torch re-exports QPRSGD

            s = compression.settings
            self.backend = TorchBackend(s.seed)
            self.bits, self.block, self.norm = s.bits, s.scale_block, s.norm
            self.level = core.levels(s.bits, 1)  # codes are decoded alone, never summed
            self.counts, self.first = core.segments(self.numels, s.scale_block)
            self.n_words = core.packed_words(sum(self.numels), s.bits)
            self.rotation_block, self.seed = core.rotation_block(s), s.seed
        self._ctx: Any = None
        self._syncs = 0  # encodes so far: every rank encodes once per gossip sync
        self._key = 0  # this sync's rotation key

    def encode(self, diff: torch.Tensor, rank: int) -> torch.Tensor:
        """One rank's message for ``diff`` (flat)."""
        if not self.quantized:
            message, self._ctx = self.compression.compress(diff)
            return message
        b = self.backend
        if self.rotation_block:
            self._key = core.rotation_key(self.seed, 1, self._syncs)
            diff, scales = b.rotate_norms(diff, self.counts, self.rotation_block, self._key,
                                          self.norm, [])
        else:
            scales = b.local_norms([], diff, self.counts, self.norm, [])
        self._syncs += 1
        mult = core.multipliers(b, scales, self.level)
        words = b.encode(diff, mult, self.counts, self.level, self.bits, rank)
        return torch.cat([words, scales.view(torch.int64)])  # float64 bits, exact

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """The flat difference a message stands for, in this codec's dtype (any rank's
        message decodes the same on every rank: the public copies stay identical)."""
        if not self.quantized:
            return self.compression.decompress(message, self._ctx).to(self.dtype)
        b = self.backend
        words = message[:self.n_words].clone()  # the decoder rewrites its words in place
        steps = core.step_sizes(b, message[self.n_words:].view(torch.float64), self.level)
        state = b.decoder(words, self.bits, sum(self.numels))
        parts, offset = [], 0
        for i, n in enumerate(self.numels):  # per tensor: scale blocks restart at each one
            lo, hi = self.first[i], self.first[i + 1]
            like = torch.empty(n, dtype=self.dtype, device=message.device)  # shape/dtype only
            scale = steps[lo:hi] if self.block else steps[lo]
            parts.append(b.decode(state, offset, like, scale, self.block))
            offset += n
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.rotation_block:
            flat = b.unrotate(flat, self.counts,
                              self.rotation_block, self._key)
        return flat


def _exchange(message: torch.Tensor, rank: int, size: int, left: int, right: int, name: str,
              pset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """COLLECTIVE (every rank of ``pset``): send ``message`` to both ring neighbours through
    one ``hvd.alltoall`` whose splits are 0 for every other rank; return what the left and
    the right neighbour sent (alltoall orders both sides by rank)."""
    rows = message.numel()
    splits = torch.zeros(size, dtype=torch.int32)
    splits[left] = splits[right] = rows
    received, _ = hvd.alltoall(torch.cat([message, message]), splits=splits, name=name,
                               process_set=pset)
    first, second = received[:rows], received[rows:]
    return (first, second) if left < right else (second, first)


def _check_params(params: Iterable[Any]) -> list[torch.Tensor]:
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if not tensors:
        raise ValueError("QPRSGD got no params; pass model.parameters()")
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"QPRSGD params must be floating-point tensors, got {type(t)}"
                            f"{'' if not isinstance(t, torch.Tensor) else ' ' + str(t.dtype)}")
    if len({id(t) for t in tensors}) != len(tensors):
        raise ValueError("QPRSGD params repeat a tensor; pass each parameter once")
    return tensors


def _check_compression(compression: Any, topology: str, process_set: Any) -> None:
    refuse_class(compression, "given to QPRSGD")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"QPRSGD compression must be a Horovod compressor (compress/decompress),"
                        f" e.g. GlobalQSGD(bits=8) or hvd.Compression.none; got {compression!r}")
    if isinstance(compression, GlobalQSGD) and _resolve(compression.process_set) is not (
            _resolve(process_set)):
        raise ValueError("QPRSGD and its GlobalQSGD must use the same process set: pass "
                         "process_set=... to both (or to neither)")


def _resolve(process_set: Any) -> Any:
    return hvd.global_process_set if process_set is None else process_set


def _fingerprint(params: list[torch.Tensor]) -> float:
    """A float64-exact (< 2**52) hash of every parameter's bytes, shapes and dtypes."""
    h = hashlib.blake2b(digest_size=8)
    for p in params:
        h.update(f"{tuple(p.shape)}:{p.dtype};".encode())
        h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return float(int.from_bytes(h.digest(), "little") >> 12)


def _flat_dtype(params: list[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    dtype = _flat_dtype(params)
    return torch.cat([p.detach().reshape(-1).to(dtype) for p in params])


def _add_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.add_(flat[offset:offset + n].view(p.shape).to(p.dtype))
        offset += n


def _allreduce_bytes(compression: Any, params: list[torch.Tensor], size: int) -> int:
    """Bytes one rank hands the allreduce per sync (packed codes and scales for GlobalQSGD;
    two-stage: both phases in allreduce terms, ``core.TwoStagePlan.wire_bytes``)."""
    if isinstance(compression, GlobalQSGD):
        s = compression.settings
        numel = sum(p.numel() for p in params)
        counts = core.segments([p.numel() for p in params], s.scale_block)[0]
        payload = (core.two_stage_plan(counts, size, s.bits).wire_bytes()
                   if core.use_two_stage(s.two_stage, s.bits, size)
                   else core.wire_bytes(numel, s.bits))
        return payload + core.scale_exchange_bytes(len(counts)) + core.PROBE_BYTES * len(params)
    width = 2 if compression is hvd.Compression.fp16 else None
    return sum(p.numel() * (width or p.element_size()) for p in params)
