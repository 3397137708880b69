"""``GlobalQSGD``: the Horovod compressor users construct.  Picks the framework adapter by the
type of the first tensor it sees and imports that framework only then."""

from __future__ import annotations

import functools
import importlib
import itertools
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from . import core
from .engine import Engine, Stats

__all__ = ["GlobalQSGD", "instance_hook", "refuse_class"]

# tensor type's top-level module -> adapter module, backend class name
_ADAPTERS = {
    "torch": ("hvd_gqsgd.torch", "TorchBackend"),
    "tensorflow": ("hvd_gqsgd.tensorflow", "TensorFlowBackend"),
}


def _class_message(cls: type, where: str) -> str:
    name = cls.__name__
    return (f"compression={name} passes the class, not a compressor ({where}): write "
            f"compression={name}(bits=8), with parentheses. Horovod's own compressors are "
            f"classes (hvd.Compression.fp16), but a {name} holds per-run state (its settings, "
            "rounding generator and collective names), so each optimizer needs an instance.")


def refuse_class(compression: Any, where: str) -> None:
    """``TypeError`` (naming the fix) when ``compression`` is the ``GlobalQSGD`` class or a
    subclass instead of an instance; for the entry points that take a compressor, so they
    refuse it at construction.  ``where`` names the entry point in the message."""
    if isinstance(compression, type) and issubclass(compression, GlobalQSGD):
        raise TypeError(_class_message(compression, where))


class instance_hook:  # noqa: N801 -- used as a decorator, like classmethod
    """A compressor hook (``compress``/``decompress``) that refuses the class as receiver.

    ``hvd.DistributedOptimizer(opt, compression=GlobalQSGD)`` (no parentheses, as Horovod's
    ``hvd.Compression.fp16`` is written) makes Horovod call ``GlobalQSGD.compress(tensor)``.
    A plain method would bind the tensor to ``self`` and fail with "missing 1 required
    positional argument"; looked up on the class, this one returns a function that raises
    a ``TypeError`` naming the fix instead.  Looked up on an instance it is the plain method.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Callable[..., Any]:
        if obj is not None:
            return types.MethodType(self.fn, obj)
        cls = owner if owner is not None else GlobalQSGD

        @functools.wraps(self.fn)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(_class_message(
                cls, f"{cls.__name__}.{self.fn.__name__}() was called on the class"))
        return refuse


class GlobalQSGD:
    r"""Global-QSGD gradient compression for Horovod (PyTorch and TensorFlow 2).

    Algorithm, for the ``n`` ranks of the process set and ``bits``-bit lanes:

    1. **Global scale** (COLLECTIVE). Each rank computes a local norm per block of
       ``scale_block`` elements of each tensor,
       :math:`\|x_i\|_\infty` (``norm="max"``) or :math:`\|x_i\|_2` (``norm="l2"``); one MAX
       allreduce per batch of tensors gives every rank the same scale :math:`s`.
    2. **Quantize.** :math:`L = \lfloor (2^{bits-1} - 1) / n \rfloor` levels per sign, so the
       sum of ``n`` codes in :math:`[-L, L]` always fits a ``bits``-bit lane.  Each rank draws
       :math:`q = \lfloor xL/s \rfloor + [u < \mathrm{frac}(xL/s)]`, ``u`` uniform from its own
       generator: unbiased, :math:`E[q] = xL/s`.
    3. **Sum** (COLLECTIVE). Codes are packed ``64 // bits`` to an int64 word and summed by
       Horovod's ordinary allreduce; lanes cannot carry into each other (see
       :mod:`hvd_gqsgd.core`).
    4. **Rescale.** :math:`\sum_i q_i \cdot s / L`, times 1/n for Average.  Bit-identical on
       every rank.

    Bytes on the wire per element: ``8 / (64 // bits)`` (1 at ``bits=8``, 4x fewer than fp32),
    plus 8 bytes per block for the scale and 16 per tensor for the probe described below.

    **Two-stage** (``two_stage``, :mod:`hvd_gqsgd.two_stage`): steps 3-4 become a Sum
    reduce-scatter of codes in lanes wide enough that every rank keeps
    :math:`2^{bits-1} - 1` levels (``core.two_stage_bits``: at most ``bits + ceil(log2 n)``),
    one unbiased requantization of each shard's exact sum to ``bits`` with scales of its own,
    and an allgather.  The error then stays near one rank's at ``bits`` whatever ``n`` is,
    where flat's grows with ``n`` (docs/TWO_STAGE.md has the measurements), for about
    ``(64 / (64 // w) + bits) / 2`` bits per element in allreduce terms: 8.6 at 2 ranks and
    8 bits, 9.3 at 4, 10.4 at 8-16, 12 at 32-256 (arithmetic from the lane widths).

    Example::

        import horovod.torch as hvd
        from hvd_gqsgd import GlobalQSGD

        hvd.init()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=GlobalQSGD(bits=8))

    Args:
        bits: lane width, 2..16.  Flat ``L`` shrinks like ``1/n``: 8 bits gives 63 levels at
            n=2, 15 at n=8, 0 (an error naming the smallest bits that works) at n=128;
            two-stage keeps ``2**(bits-1) - 1`` at any n.
        norm: ``"max"`` or ``"l2"`` (see step 1).
        seed: ``None`` (default) seeds each rank's rounding noise from the OS; an int makes
            runs reproducible.  Either way the noise differs between ranks and the framework's
            global RNG is never read or advanced.
        process_set: Horovod process set for the compressor's own collectives; must be the
            same set the optimizer or ``hvd.allreduce`` reduces over (default: global).
        bucket_bytes: input bytes per bucket.  A bucket is sealed in ``compress`` once this
            many bytes are queued: its scale exchange starts at once, and later ``compress``
            calls quantize and send it as soon as that exchange has finished, without
            waiting.  Under ``hvd.DistributedOptimizer``, which calls ``compress`` from each
            gradient's backward hook, a deep model's codes then go on the wire while
            backward still runs.  ``None`` (default) lets the adapter choose: PyTorch 8 MiB
            (``core.AUTO_BUCKET_BYTES``; with ``hierarchical``, whose collectives block, the
            first ``decompress`` seals the round in buckets of that size);
            TensorFlow 8 MiB inside ``tf.function``, where each bucket becomes its own grouped
            Horovod call (:func:`hvd_gqsgd.tensorflow.buckets`) that TF starts once its
            gradients exist, and one group eagerly, where tapes hand over every gradient at
            once.  0: one bucket per round, sealed by the first ``decompress``: one scale
            exchange and one codes allreduce per step, fewest collectives, which can win where
            backward is short next to the wire (docs/BENCHMARKS.md).
        chunk_bytes: packed bytes per Sum allreduce: a larger bucket is quantized and sent
            chunk by chunk, so Horovod's background thread puts chunk k on the wire while
            chunk k+1 is being quantized.  ``None`` (default) lets the adapter choose:
            TensorFlow inside ``tf.function`` on CPU sends 2 MiB chunks
            (``core.AUTO_CHUNK_BYTES``, 8 MiB of fp32 gradient at ``bits=8``) and unpacks
            each one as soon as it arrives; eager TensorFlow (where every Horovod op blocks
            until done, so chunks could not overlap) and PyTorch (which joins the chunks
            before decoding, and where chunks were no faster: docs/BENCHMARKS.md) send one
            allreduce per bucket.  0 forces one allreduce per bucket; an int > 0 sets the
            chunk size.  ``HVD_GQSGD_OVERLAP_NICE`` lowers the priority of TF's overlapping
            quantize (:class:`hvd_gqsgd.kernels.WireWatch`; off by default).
        scale_block: elements per global scale: each block of a tensor gets its own scale,
            at 8 bytes per block in the MAX exchange (0.8% more bytes at ``bits=8`` with
            1024).  Finer scales waste fewer levels where gradients are small: 1024 follows
            the gradient's magnitude more closely than one scale per tensor, with a lower
            quantization error and training loss (docs/LOW_BITS.md, docs/CONVERGENCE.md).
            ``None`` (default): 1024, and 64 at 4 bits and fewer, where the coarse grid
            needs the finer scales (``core.default_scale_block``).  0: one scale per tensor.
            A NaN/Inf poisons only its own block.
        hierarchical: sum in full precision inside each node (Horovod's ``local_rank`` /
            ``cross_rank``), then run Global-QSGD across nodes only, so ``L`` is set by the
            node count: 8 nodes of 8 ranks keep ``L = 15`` at ``bits=8`` where flat
            Global-QSGD has 1.  Each rank quantizes and sends its own shard across the
            network; the result is bit-identical on all ranks.  Works after a plain
            ``hvd.init()`` on the global process set (6 collectives per bucket: 4
            alltoalls and 2 small MAX allreduces; :mod:`hvd_gqsgd.hierarchical`).  Falls
            back to flat Global-QSGD, with a one-time ``RuntimeWarning`` that says why, on
            one node, with one rank per node, or when nodes have unequal rank counts.
            PyTorch only; not with ``chunk_bytes`` or a ``process_set``.  With two-stage
            (below), the reduce-scatter and allgather across nodes are the two stages, so its
            wide lanes count nodes.
        two_stage: ``True``: two-stage Global-QSGD (see above); ``False``: flat, which
            warns once when it leaves fewer than 15 levels per rank; ``None`` (default):
            two-stage where flat would leave fewer than 15 levels
            (``core.AUTO_MIN_LEVELS``: 8 bits from 9 ranks, or nodes with
            ``hierarchical``, on; 4 bits at any size from 2), flat elsewhere.  Two-stage
            sends one reduce-scatter and one allgather per bucket, no chunks: with it an
            explicit ``chunk_bytes > 0`` is refused (``ValueError``).
        rotation: ``"hadamard"``: every full scale block is multiplied by a randomized
            Walsh-Hadamard matrix before quantizing and by its inverse after the sum
            (:mod:`hvd_gqsgd.core`, "Rotation"); the signs come from ``seed`` and a round
            counter that every rank derives alike, so codes still add in the allreduce and
            every rank ends bit-identical.  It spreads a block's few large entries over the
            block, so the max scale wastes fewer levels on heavy-tailed gradients.  Costs
            about one pass over the gradient each way on CPU.  ``None``: off.
            ``"auto"`` (default): on at 4 bits and fewer, off above
            (``core.AUTO_ROTATION_MAX_BITS``; see docs/LOW_BITS.md).  Needs ``scale_block``
            a power of two (as the defaults are).

    .. warning::
        * **Op.** Any ``op`` that sums works: ``Average`` (the default), ``Sum``, and
          ``gradient_predivide_factor``.  ``compress`` is not told the op, so the codes travel
          in a separate Sum allreduce and Horovod's own allreduce carries a 2-element probe
          that reveals the op's scaling.  ``Adasum``, ``Min``, ``Max`` and ``Product`` raise
          ``ValueError`` in ``decompress``: integer sums cannot implement them.
        * **Order.** Every rank must call ``compress`` on the same tensors in the same order
          (true for the same model and script).  A layout mismatch in size or dtype raises.
        * **World size.** ``L`` (and the flat/two-stage choice) is recomputed at every
          batch from the current process-set size; if flat ``bits`` is too small for it,
          ``ValueError`` says which ``bits`` works.
        * **TensorFlow.** Constructed with ``horovod.tensorflow`` already imported, it makes
          Horovod's ``DistributedGradientTape`` and legacy Keras ``DistributedOptimizer``
          reduce gradients in grouped calls when they are given a ``GlobalQSGD``
          (:func:`hvd_gqsgd.tensorflow.group_gradients`: one round per bucket inside
          ``tf.function``, one per step eagerly, instead of one per gradient; results are the
          same).  Constructed earlier, it warns once.
        * **Failures.** A step that fails in a collective leaves no state behind: the round is
          dropped at once if the error surfaces in GlobalQSGD's own waits, else at the next
          ``compress`` once no ctx of it is held any more (a ``RuntimeWarning`` says so), as
          after a Horovod elastic reset; names then restart, as on a newly added rank.
          ``decompress`` refuses (``RuntimeError``) a ctx of a dropped round, or one
          decompressed already.
        * Non-float and empty tensors pass through unchanged (Horovod reduces them as usual).
          NaN/Inf on any rank gives NaN on every rank for its whole scale block (the whole
          tensor with ``scale_block=0`` or below ``scale_block`` elements), so AMP's loss
          scaler still sees it and skips the step everywhere.
    """

    _instances = itertools.count()

    def __init__(self, bits: int = 8, norm: str = "max", seed: int | None = None,
                 process_set: Any = None, bucket_bytes: int | None = None,
                 chunk_bytes: int | None = core.DEFAULT_CHUNK_BYTES,
                 scale_block: int | None = None, hierarchical: bool = False,
                 two_stage: bool | None = None, rotation: str | None = "auto") -> None:
        self.settings = core.Settings(bits=bits, norm=norm, seed=seed, bucket_bytes=bucket_bytes,
                                      chunk_bytes=chunk_bytes,
                                      scale_block=scale_block,  # type: ignore[arg-type]
                                      hierarchical=hierarchical, two_stage=two_stage,
                                      rotation=rotation)
        self.process_set = process_set
        self._uid = next(GlobalQSGD._instances)
        self._engines: dict[str, Engine] = {}  # framework name -> its engine
        self._by_type: dict[type, Engine] = {}  # tensor type -> its framework's engine
        self._lock = threading.Lock()
        if "horovod.tensorflow" in sys.modules:  # TF is loaded already: importing is free
            importlib.import_module("hvd_gqsgd.tensorflow").group_gradients()

    def __repr__(self) -> str:
        s = self.settings
        return (f"GlobalQSGD(bits={s.bits}, norm={s.norm!r}, seed={s.seed!r}, "
                f"scale_block={s.scale_block}"
                + (", hierarchical=True" if s.hierarchical else "")
                + (f", two_stage={s.two_stage}" if s.two_stage is not None else "")
                + (f", rotation={s.rotation!r})" if s.rotation != "auto" else ")"))

    @instance_hook
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Horovod compressor hook.  Queues ``tensor`` and returns ``(probe, ctx)``."""
        return self._engine_for(tensor).compress(tensor)

    @instance_hook
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Horovod compressor hook.  Returns the reduced gradient for ``ctx`` (COLLECTIVE on
        the first call after a batch of ``compress`` calls)."""
        if ctx is None:
            return tensor
        return self._engine_for(tensor).decompress(tensor, ctx)

    def levels(self, world_size: int) -> int:
        """Quantization levels per sign at ``world_size`` ranks (``ValueError`` if 0)."""
        return core.levels(self.settings.bits, world_size)

    @property
    def stats(self) -> Stats:
        """Byte counters of the last and all rounds, summed over frameworks used."""
        if len(self._engines) == 1:
            return next(iter(self._engines.values())).stats
        total = Stats()
        for engine in self._engines.values():
            for name, value in engine.stats.as_dict().items():
                if name != "last_ratio":
                    setattr(total, name, getattr(total, name) + value)
        return total

    def _engine_for(self, tensor: Any) -> Engine:
        engine = self._by_type.get(type(tensor))  # twice per tensor per step: keep it short
        if engine is not None:
            return engine
        framework = type(tensor).__module__.split(".")[0]
        engine = self._engines.get(framework)
        if engine is not None:
            self._by_type[type(tensor)] = engine
            return engine
        if framework not in _ADAPTERS:
            raise TypeError(
                f"GlobalQSGD got a {type(tensor).__module__}.{type(tensor).__name__}; it "
                f"supports tensors of {sorted(_ADAPTERS)}"
            )
        module, cls = _ADAPTERS[framework]
        adapter = importlib.import_module(module)
        if hasattr(adapter, "group_gradients"):  # TF: too late to group tapes made until now
            adapter.group_gradients(late=True)
        backend = getattr(adapter, cls)(self.settings.seed)
        with self._lock:
            engine = self._engines.setdefault(
                framework, Engine(backend, self.settings, self.process_set, self._uid))
        self._by_type[type(tensor)] = engine
        return engine


# TensorFlow's AutoGraph would otherwise try to rewrite these (and the lazy adapter import
# inside) when Horovod calls them in a tf.function; they have no tensor-dependent Python
# control flow, so they must run as written.  This is the attribute that
# tf.autograph.experimental.do_not_convert sets, written here without importing TensorFlow.
for _hook in ("compress", "decompress"):
    setattr(GlobalQSGD.__dict__[_hook].fn, "autograph_info__", frozenset())  # noqa: B010
