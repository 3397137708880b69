r"""Global-QSGD as FSDP2's gradient reduce-scatter.  Needs torch only, no Horovod::

    from torch.distributed.fsdp import fully_shard
    import hvd_gqsgd.fsdp

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hvd_gqsgd.fsdp.register(model, bits=8)   # every FSDPModule in model
    ...
    print(state.stats.as_dict())                     # bytes and seconds, one round per call

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters each module's gradients once
per backward: every rank hands it one flat buffer of ``n * S`` elements (``reduce_dtype``:
fp32, bf16, ...; each parameter's gradient padded along dim 0 to a multiple of ``n`` and cut
into ``n`` rows), and rank ``r`` keeps the average of row ``r``, its shard.  That is exactly
stage 1 of two-stage Global-QSGD (:mod:`hvd_gqsgd.two_stage`); there is no second stage,
since FSDP keeps the shard.  For one call, on the ``n`` ranks of FSDP's reduce-scatter group:

1. **Global scale** (COLLECTIVE, float64 MAX ``all_reduce``): each row is cut into scale
   blocks of ``scale_block`` elements; each block's local max ``|x|`` (or L2 norm),
   ``inf`` where it holds NaN/Inf, maxed over ranks: ``s`` per block, the same everywhere.
2. **Quantize** (local): ``L1 = core.two_stage_levels(bits, n) >= 2**(bits-1) - 1`` levels
   per sign, unbiased stochastic rounding of ``x L1 / s`` with the rank's own noise
   (``E[q] = x L1 / s``), packed ``64 // w`` to an int64 word in lanes of
   ``w = core.two_stage_bits(bits, n) <= bits + ceil(log2 n)`` bits; each row into its own
   ``q = ceil(S / (64 // w))`` words.
3. **Sum reduce-scatter** (COLLECTIVE, int64 SUM): rank ``r`` receives row ``r``'s words
   summed over ranks: ``|sum| <= n L1 <= 2**(w-1) - 1``, so no lane carries into the next
   (:mod:`hvd_gqsgd.core`'s bound with ``w``-bit lanes).  NCCL: ``reduce_scatter_tensor``;
   Gloo: ``all_to_all`` plus a local int64 sum (Gloo's reduce-scatter runs a whole
   all_reduce: twice the bytes).
4. **Decode** (local): ``sum(q) * s / L1 / d`` into FSDP's output shard in
   ``reduce_dtype``, with ``d`` FSDP's gradient divide factor (default ``n``: the average,
   what FSDP computes without the hook).  Every rank that holds a shard decodes the same
   summed integers, so the shard is what a single rank would compute: deterministic given
   the ranks' codes.

The error is one rank's rounding at ``L1`` levels per block, at most ``s / L1`` per element
of the average, whatever ``n`` is.  Bytes per rank per element of the input:
``8 / (64 // w)`` (at ``bits=8``: 9.1 bits at 2 ranks, 10.7 at 3-4, 12.8 from 5 on; so
3.5x to 2.5x fewer than an fp32 reduce-scatter, 1.75x to 1.25x fewer than bf16), plus 8
bytes per block in step 1.

:func:`register` also sets each module's ``set_force_sum_reduction_for_comms(True)`` and
``set_gradient_divide_factor(1.0)``, so FSDP hands the hook a plain SUM and divides nothing
itself; the hook applies the divide factor the module had (``d`` above).

Hazards:
    * HSDP and ``replicate`` meshes are refused: their cross-replica all_reduce is a plain
      ``dist.all_reduce`` that no reduce-scatter hook replaces.
    * A module with several parameter groups (``shard_placement_fn`` with several meshes) is
      refused, as FSDP's setter refuses it.
    * Do not change a registered module's force-sum or divide factor afterwards: the hook
      checks them at every call and raises ``RuntimeError``.
    * Collective order: one MAX ``all_reduce`` and one reduce-scatter per call, in FSDP's
      order, on FSDP's reduce-scatter stream (CUDA) or the calling thread (CPU).
    * NaN/Inf in a block on any rank makes that block NaN in every shard, so AMP's gradient
      scaler skips the step everywhere.

Importing this module imports torch and ``torch.distributed``, never Horovod or TensorFlow.
"""

# No ``from __future__ import annotations``: consistent with the sibling hook modules, whose
# annotations torch reads at run time.
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from . import core, torch_dist
from .torch_dist import Transport

__all__ = ["FSDPState", "GlobalQSGDReduceScatter", "register"]

_FULL = (torch.float32, torch.float64)  # reduce dtypes decoded in place; others via fp32


class FSDPState(Transport):
    """State of the FSDP2 hook (:func:`register` returns it): a
    :class:`~hvd_gqsgd.torch_dist.Transport` (settings, the rank's noise stream and
    :class:`hvd_gqsgd.engine.Stats`, one round per reduce-scatter call: FSDP issues one per
    FSDPModule per backward).  Pickles like :class:`hvd_gqsgd.ddp.GlobalQSGDState`: a
    checkpointed state continues its noise stream.

    Args:
        bits: code width, 2..16: ``2**(bits-1) - 1`` levels per rank and sign; lanes on the
            wire are ``core.two_stage_bits(bits, n)`` wide.
        norm: ``"max"`` or ``"l2"``: the local norm whose MAX over ranks is a block's scale.
        seed: ``None`` seeds each rank's rounding noise from the OS; an int makes it
            reproducible.  Either way ranks draw independent noise and torch's global RNG
            is neither read nor advanced.
        scale_block: elements of a row per global scale (0: one scale per row; ``None``, the
            default: 1024, and 64 at 4 bits and fewer, as :class:`hvd_gqsgd.GlobalQSGD`'s).
        rotation: ``"hadamard"``, ``None`` or ``"auto"`` (default: on at 4 bits and fewer),
            as :class:`hvd_gqsgd.GlobalQSGD`'s: every full block of the input is rotated
            before its norms (in place: the input is FSDP's scratch buffer) and each rank
            rotates its decoded shard back; signs from ``seed`` and the call count.
    """

    def __init__(self, bits: int = 8, norm: str = "max", seed: int | None = None,
                 scale_block: int | None = None,
                 rotation: str | None = "auto") -> None:
        super().__init__(core.Settings(bits=bits, norm=norm, seed=seed,
                                       scale_block=scale_block,  # type: ignore[arg-type]
                                       two_stage=True, rotation=rotation))


class GlobalQSGDReduceScatter:
    """FSDP2's ``ReduceScatter`` comm (``allocate`` and ``__call__``) for one FSDPModule's
    parameter group, running Global-QSGD on ``state``'s transport (see the module
    docstring).  Made by :func:`register`; holds the group weakly, to check at every call
    that FSDP still hands it a plain SUM."""

    def __init__(self, state: FSDPState, param_group: Any, divide_factor: float | None,
                 tensors: int) -> None:
        self.state = state
        self.divide_factor = divide_factor  # None: FSDP's default, the group size (Average)
        self.tensors = tensors  # parameters reduced per call (for the stats)
        # FSDP's parameter group (weakly); None for a comm called outside FSDP
        self._param_group = None if param_group is None else weakref.ref(param_group)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> None:
        """COLLECTIVE: ``output_tensor`` (``S`` elements) becomes the divided sum over the
        group of row ``rank`` of every rank's ``input_tensor`` (``n * S`` elements)."""
        self._check_call(op, async_op)
        start = time.perf_counter()
        state, bits = self.state, self.state.settings.bits
        n, rank = state.group_size(group), dist.get_rank(group)
        shard = output_tensor.numel()
        if input_tensor.numel() != n * shard:
            raise ValueError(f"GlobalQSGD's FSDP reduce-scatter got an input of "
                             f"{input_tensor.numel()} elements for {n} shards of {shard}")
        # fp16/bf16 are quantized in fp32 (a copy); fp32/fp64 are read in place
        flat = input_tensor.reshape(-1)
        flat = flat if flat.dtype in _FULL else flat.float()
        row, _ = state.segments([shard])
        rotation = state.rotation()
        flat, scales, waited = torch_dist.exchange_scales(state, flat, row * n, group,
                                                          rotation)  # COLLECTIVE
        lane_bits, levels1 = core.two_stage_bits(bits, n), core.two_stage_levels(bits, n)
        row_words, m = core.packed_words(shard, lane_bits), len(row)
        rows = [core.Chunk(r * shard, (r + 1) * shard, r * m, (r + 1) * m, tuple(row))
                for r in range(n)]
        words = torch_dist.scatter_rows(state, flat, scales, rows, row_words, levels1,
                                        lane_bits)
        launched = time.perf_counter()
        summed = torch_dist.reduce_scatter(words, row_words, group,
                                           wait=True).wait()  # COLLECTIVE
        arrived = time.perf_counter()
        divisor = float(n if self.divide_factor is None else self.divide_factor)
        steps = core.step_sizes(torch_dist.OPS, scales[rank * m:(rank + 1) * m], levels1)
        out = output_tensor.reshape(-1)
        decoded = out if out.dtype in _FULL else torch.empty_like(out, dtype=torch.float32)
        state._local.unpack_scaled(summed, lane_bits, decoded, row,
                                   (steps / divisor).to(decoded.dtype))
        if rotation is not None:  # this row's blocks start at input element rank * shard
            decoded = state._local.unrotate(decoded, row, *rotation, start=rank * shard)
        if decoded is not out:
            out.copy_(decoded)
        state.stats.add_round({
            "uncompressed": input_tensor.numel() * input_tensor.element_size(),
            "payload": words.numel() * 8, "overhead": 8 * len(row) * n,
            "quantize_s": (launched - start - waited) + (time.perf_counter() - arrived),
            "scale_wait_s": waited, "codes_wait_s": arrived - launched}, self.tensors)

    def _check_call(self, op: Any, async_op: bool) -> None:
        group = None if self._param_group is None else self._param_group()
        if group is not None and (not group.force_sum_reduction_for_comms
                                  or group.gradient_divide_factor != 1.0):
            raise RuntimeError(
                "GlobalQSGD's FSDP reduce-scatter needs the module's force-sum reduction on and "
                "its gradient divide factor at 1.0, as hvd_gqsgd.fsdp.register() set them (got "
                f"force_sum={group.force_sum_reduction_for_comms}, divide factor "
                f"{group.gradient_divide_factor}); pass a divide factor to register() instead "
                "of changing them afterwards.")
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"GlobalQSGD's FSDP reduce-scatter sums integer codes; FSDP "
                               f"asked for {op}. Let hvd_gqsgd.fsdp.register() set the module's "
                               "reduction options.")
        if async_op:
            raise ValueError("GlobalQSGD's FSDP reduce-scatter runs synchronously on the "
                             "reduce-scatter stream; async_op=True is not supported")


def register(model: torch.nn.Module, bits: int = 8, *, norm: str = "max",
             seed: int | None = None, scale_block: int | None = None,
             gradient_divide_factor: float | None = None,
             rotation: str | None = "auto") -> FSDPState:
    """Make every ``FSDPModule`` in ``model`` (``model`` itself included) reduce-scatter its
    gradients with Global-QSGD; returns the shared :class:`FSDPState`.  Call it after
    ``fully_shard`` and before the first backward.

    Args:
        model: a module to which ``fully_shard`` was applied (itself or its submodules).
        bits, norm, seed, scale_block, rotation: see :class:`FSDPState`.
        gradient_divide_factor: what the summed gradient is divided by; ``None`` keeps each
            module's own (``set_gradient_divide_factor``; by default the group size: the
            average, as FSDP reduces without the hook).

    Raises:
        ValueError: no FSDPModule in ``model``; an HSDP or ``replicate`` mesh; a module with
            several parameter groups; ``bits`` outside 2..16; a group so large that the
            lanes would exceed 32 bits; ``register`` called twice on one module.

    Example::

        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32))
        state = hvd_gqsgd.fsdp.register(model, bits=8)
    """
    from torch.distributed.fsdp import FSDPModule

    state = FSDPState(bits=bits, norm=norm, seed=seed, scale_block=scale_block,
                      rotation=rotation)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"hvd_gqsgd.fsdp.register() found no FSDPModule in "
                         f"{type(model).__name__}: call fully_shard() on the model (and its "
                         "blocks) first")
    comms = [(m, _comm(state, m, gradient_divide_factor)) for m in modules]
    for module, comm in comms:  # every module checked before any is changed
        if comm is not None:
            # FSDP's ReduceScatter base class is private (torch 2.13); FSDP only calls
            # allocate and __call__, which this class has
            module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return state


def _comm(state: FSDPState, module: Any, divide_factor: float | None
          ) -> GlobalQSGDReduceScatter | None:
    """The comm for ``module``'s parameter group (None: it has none), after checking that the
    hook can serve it."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    name = type(module).__name__
    if len(groups) > 1:
        raise ValueError(f"{name} has {len(groups)} FSDP parameter groups (several meshes from "
                         "shard_placement_fn); FSDP takes one custom reduce-scatter per module, "
                         "so give each mesh's parameters a module of their own")
    if not groups:
        return None
    group = groups[0]
    if getattr(group.mesh_info, "replicate_process_group", None) is not None:
        raise ValueError(f"{name} is sharded on a mesh with a replicate dimension (HSDP or "
                         "replicate): FSDP sums across replicas with a plain all_reduce that no "
                         "reduce-scatter hook replaces. Use a 1-D mesh (fully_shard over every "
                         "rank), or the DDP hook (hvd_gqsgd.ddp) for pure replication")
    if isinstance(group._reduce_scatter_comm, GlobalQSGDReduceScatter):
        raise ValueError(f"{name} already reduce-scatters with GlobalQSGD: call "
                         "hvd_gqsgd.fsdp.register() once per model")
    _check_lanes(state.settings.bits, group._reduce_scatter_process_group.size())
    factor = group.gradient_divide_factor if divide_factor is None else divide_factor
    return GlobalQSGDReduceScatter(state, group, factor, len(group.fsdp_params))


def _check_lanes(bits: int, world_size: int) -> None:
    """``ValueError`` naming the bits that fit, when the stage-1 lanes that keep
    ``core.levels(bits, 1)`` levels for each of ``world_size`` ranks exceed 32 bits."""
    room = core.flat_levels(core.MAX_LANE_BITS, world_size)  # levels per rank in 32 bits
    if room >= core.levels(bits, 1):
        return
    fits = [b for b in range(core.MIN_BITS, bits) if core.levels(b, 1) <= room]
    raise ValueError(
        f"GlobalQSGD's FSDP reduce-scatter at bits={bits} over {world_size} ranks needs lanes "
        f"wider than {core.MAX_LANE_BITS} bits. "
        + (f"Use bits <= {fits[-1]}." if fits else "Shard over fewer ranks."))
