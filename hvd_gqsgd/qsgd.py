"""``QSGDAllgather``: the QSGD baseline Global-QSGD is measured against.

QSGD quantizes each rank's tensor against that rank's *own* scale.  Codes with different
scales cannot be summed as integers, so every rank must receive every other rank's codes
(an allgather: bytes grow with the rank count) and decode them one by one.  It is here so
users can compare both on their own clusters (``benchmarks/netbench.py`` does); the math is
the core's, with ``L = 2**(bits-1) - 1`` levels since codes are never summed in the lanes.

Example::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=QSGDAllgather(bits=8))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from . import core
from .compressor import GlobalQSGD, instance_hook

__all__ = ["QSGDAllgather"]

# GlobalQSGD's arguments that have no meaning for one whole-tensor scale per rank
_GLOBAL_ONLY = ("norm", "bucket_bytes", "chunk_bytes", "scale_block", "hierarchical",
                "two_stage", "rotation")


@dataclass(eq=False)
class _Pending:
    """ctx of one tensor: its input and the two allgathers in flight."""

    tensor: Any
    words: Any  # handle: every rank's packed codes, concatenated
    scales: Any  # handle: every rank's local scale


class QSGDAllgather(GlobalQSGD):
    """Per-rank-scale QSGD over an allgather (COLLECTIVE in ``compress``: two allgathers per
    tensor, started there and waited for in ``decompress``).

    Each tensor is quantized whole against its own max |x| on this rank, so only ``bits``,
    ``seed`` and ``process_set`` mean anything here; GlobalQSGD's other arguments (buckets,
    chunks, scale blocks, the norm, hierarchical, two-stage, the rotation) are refused with a
    ``TypeError`` rather than silently ignored.  Op handling (the probe), the class-passed-as-
    compressor refusal and bad-input behaviour are :class:`GlobalQSGD`'s.

    Args:
        bits: code width, 2..16; ``L = 2**(bits-1) - 1`` levels per sign at any rank count.
        seed: ``None`` (default) seeds each rank's rounding noise from the OS; an int makes
            runs reproducible.
        process_set: Horovod process set of the two allgathers; must be the set the
            optimizer or ``hvd.allreduce`` reduces over (default: global).
    """

    _serial = itertools.count()

    def __init__(self, bits: int = 8, *, seed: int | None = None, process_set: Any = None,
                 **refused: Any) -> None:
        for name in refused:
            if name in _GLOBAL_ONLY:
                raise TypeError(
                    f"QSGDAllgather(..., {name}=...): QSGDAllgather ignores {name}, as it "
                    "quantizes each tensor whole against its own max |x|; drop the argument, "
                    f"or use GlobalQSGD({name}=...) for it")
            raise TypeError(f"QSGDAllgather() got an unexpected keyword argument {name!r}")
        super().__init__(bits=bits, seed=seed, process_set=process_set)

    def __repr__(self) -> str:
        return f"QSGDAllgather(bits={self.settings.bits}, seed={self.settings.seed!r})"

    @instance_hook
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        engine = self._engine_for(tensor)
        b = engine.backend
        if not b.is_compressible(tensor):
            return tensor, None
        rank, _, pset = engine._world()
        level = (1 << (self.settings.bits - 1)) - 1
        flat = b.flat_concat([tensor])
        norms = b.local_norms([tensor], flat, [b.numel(tensor)], "max", [])
        words = b.encode(flat, core.multipliers(b, norms, level), [b.numel(tensor)], level,
                         self.settings.bits, rank)
        name = f"qsgd.{self._uid}.{next(QSGDAllgather._serial)}"
        ctx = _Pending(tensor, b.allgather_async(words, f"{name}.codes", pset),
                       b.allgather_async(norms, f"{name}.scales", pset))
        return b.probe(core.probe_values(rank), tensor), ctx

    @instance_hook
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        engine = self._engine_for(tensor)
        b, bits = engine.backend, self.settings.bits
        _, size, _ = engine._world()
        factor = b.probe_factor(tensor, size)
        level = (1 << (bits - 1)) - 1
        words, scales = b.wait(ctx.words), b.wait(ctx.scales)
        steps = core.step_sizes(b, scales, level)
        per_rank = core.packed_words(b.numel(ctx.tensor), bits)  # static, also in a graph
        total = None
        for r in range(size):  # decode each rank's codes with its own scale: O(n) work
            state = b.decoder(words[r * per_rank:(r + 1) * per_rank], bits, b.numel(ctx.tensor))
            part = b.decode(state, 0, ctx.tensor, steps[r] * factor, 0)
            total = part if total is None else total + part
        return total
