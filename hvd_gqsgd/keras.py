"""Keras 3 ``model.fit`` through Horovod, with any Horovod compressor (``GlobalQSGD`` included).

Horovod 0.28.1's ``horovod.tensorflow.keras.DistributedOptimizer`` hooks Keras 2 methods that
Keras 3 no longer calls, so under Keras 3 ``model.fit`` never reduces and every rank trains
alone, with no error.  This module is the Keras 3 replacement::

    import horovod.tensorflow as hvd
    import keras
    from hvd_gqsgd import GlobalQSGD
    from hvd_gqsgd.keras import (BroadcastGlobalVariablesCallback, DistributedOptimizer,
                                 MetricAverageCallback)

    hvd.init()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), compression=GlobalQSGD(bits=8))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[BroadcastGlobalVariablesCallback(0), MetricAverageCallback()])

Keras 3 hands every gradient to ``optimizer.apply(grads, variables)``, compiled or with
``run_eagerly=True``; the wrapped optimizer reduces there, in ONE ``hvd.grouped_allreduce``
for all gradients of a step, so a ``GlobalQSGD`` compressor runs one scale exchange per step.

Importing this module imports ``keras``, ``tensorflow`` and ``horovod.tensorflow`` (never
``horovod.torch``); ``import hvd_gqsgd`` does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from .compressor import refuse_class

__all__ = ["BroadcastGlobalVariablesCallback", "DistributedOptimizer", "MetricAverageCallback",
           "broadcast_variables"]

# Horovod matches collectives across ranks by op name.  Keras names optimizers and layers
# from per-process counters ("sgd_3/..."), which differ between ranks as soon as one rank
# builds an extra model or optimizer (an evaluation copy, a checkpoint restore); so every
# collective here gets a fixed name and ignore_name_scope=True, never a Keras-derived one.
_GRADS_NAME = "hvd_gqsgd.keras.grads"  # also stable across steps: the response cache hits


@dataclass(frozen=True)
class _Reduction:
    """How gradients are reduced: Horovod's ``compression``, ``op`` and ``process_set``."""

    compression: Any
    op: Any
    process_set: Any

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        """COLLECTIVE: every rank of the process set reduces the same gradients in the same
        step.  ``None`` entries stay ``None``; ``tf.IndexedSlices`` (embedding gradients) are
        made dense first, so the compressor sees them (Horovod would allgather them raw)."""
        _refuse_xla()
        where = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in where]
        reduced = hvd.grouped_allreduce(dense, op=self.op, compression=self.compression,
                                        process_set=self.process_set, name=_GRADS_NAME,
                                        ignore_name_scope=True)
        out = list(grads)
        for i, r in zip(where, reduced):
            out[i] = r
        return out


def _refuse_xla() -> None:
    # Horovod's ops and the compressor's host callbacks have no XLA kernels; without this the
    # failure is an XLA compile error deep inside model.fit.  Keras's jit_compile="auto" turns
    # XLA on when a GPU is visible.
    from tensorflow.python.ops import control_flow_util  # no public form of this check

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "hvd_gqsgd.keras.DistributedOptimizer cannot reduce inside an XLA-compiled train "
            "step (Horovod ops have no XLA kernels); got jit_compile=True. Compile with "
            "model.compile(..., jit_compile=False).")


class _ReduceBeforeClipping:
    """Mixin for plain Keras 3 optimizers: reduce the gradient Keras is about to clip.

    Keras calls ``_clip_gradients`` once per optimizer update, on the gradient it will apply:
    the step's gradient, or with ``gradient_accumulation_steps`` the accumulated mean, on the
    update step only.  Reducing there makes clipping see the reduced gradient and sends one
    round per update, not per micro-step.
    """

    _hvd_reduction: _Reduction

    def _clip_gradients(self, grads: Any) -> Any:
        return super()._clip_gradients(self._hvd_reduction(grads))  # type: ignore[misc]


class _ReduceBeforeLossScale:
    """Mixin for ``LossScaleOptimizer``: reduce the scaled gradients before its finiteness
    check, so every rank sees the same (reduced) gradients, takes the same skip-or-apply
    branch and keeps the same loss scale.  The inner optimizer is not wrapped."""

    _hvd_reduction: _Reduction

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        return super().apply(self._hvd_reduction(list(grads)),  # type: ignore[misc]
                             trainable_variables)


_CLASSES: dict[type, Any] = {}  # wrapped optimizer class -> its distributed subclass


def _distributed_class(base: type) -> Any:
    if base not in _CLASSES:
        is_lso = issubclass(base, keras.optimizers.LossScaleOptimizer)
        mixin = _ReduceBeforeLossScale if is_lso else _ReduceBeforeClipping
        if not is_lso:
            _check_hook(base)
        _CLASSES[base] = type(f"Distributed{base.__name__}", (mixin, base),
                              {"__module__": __name__, "__doc__": DistributedOptimizer.__doc__})
    return _CLASSES[base]


def _check_hook(base: type) -> None:
    """Refuse a class whose ``apply`` would bypass ``_clip_gradients``: the wrapper would then
    never reduce, silently (Horovod's Keras 2 optimizer under Keras 3)."""
    if not callable(getattr(base, "_clip_gradients", None)):
        raise TypeError(
            f"{base.__name__} has no _clip_gradients, the Keras 3 optimizer method "
            f"hvd_gqsgd.keras reduces in; Keras {keras.__version__} is not supported "
            "(tested with Keras 3.15).")
    if base.apply is not keras.optimizers.Optimizer.apply:  # type: ignore[attr-defined]
        raise TypeError(
            f"{base.__name__} overrides apply (e.g. MultiOptimizer delegates to inner "
            "optimizers), so hvd_gqsgd.keras cannot tell where its gradients are applied. "
            "Wrap a plain Keras optimizer or a LossScaleOptimizer.")


def DistributedOptimizer(optimizer: Any, compression: Any = None, op: Any = None,  # noqa: N802
                         backward_passes_per_step: int = 1, process_set: Any = None) -> Any:
    r"""A copy of the Keras 3 ``optimizer`` that averages (``op``) its gradients over Horovod
    ranks before applying them; pass it to ``model.compile``.

    With ``g_r`` the gradient rank ``r`` computed on its own batch, every rank applies
    :math:`\bar g = \frac1n \sum_{r=1}^{n} g_r` (``hvd.Average``; ``hvd.Sum`` drops the
    1/n), up to the compressor's error: with equal batch sizes, the gradient of the mean
    loss over all ranks' batches.  Every rank gets the same bits.

    Where the reduction happens, per step, inside Keras 3's ``apply``:

    1. Keras drops ``None`` gradients and unscales a static ``loss_scale_factor``.
    2. **Plain optimizers:** at the start of the update, on the gradient about to be clipped
       (COLLECTIVE: one ``hvd.grouped_allreduce`` of all gradients, so ``GlobalQSGD`` runs one
       scale exchange per update).  Hence:

       * ``clipnorm``, ``clipvalue``, ``global_clipnorm`` clip the *reduced* gradient, the
         same bits on every rank;
       * ``gradient_accumulation_steps=k`` (or ``backward_passes_per_step=k``, which sets it):
         each rank accumulates its own k micro-batch gradients locally; the mean is reduced
         once, on the k-th step, then clipped and applied (one round per k steps);
       * weight decay, the update, and ``use_ema`` (the moving average, and its
         ``ema_overwrite_frequency`` overwrite) follow on identical values on every rank.

    3. **``keras.mixed_precision.LossScaleOptimizer``** (wrap it, not its inner optimizer):
       the *scaled* gradients are reduced first, before its finiteness check.  A NaN/Inf on
       any rank reaches every rank (``none``/``fp16`` sum it; ``GlobalQSGD`` poisons its scale
       block), so all ranks skip the step together and halve the loss scale together.  The
       inner optimizer then unscales, clips and accumulates the reduced gradient as in 2, but
       with accumulation the reduction runs on every micro-step.

    Example::

        opt = DistributedOptimizer(keras.optimizers.Adam(1e-3, global_clipnorm=1.0),
                                   compression=GlobalQSGD(bits=8))
        model.compile(optimizer=opt, loss="mse")          # jit_compile stays False on CPU
        model.fit(x, y, callbacks=[BroadcastGlobalVariablesCallback(0)])

    Args:
        optimizer: a Keras 3 optimizer (or its name), not yet built.  The result is a fresh
            instance of a subclass of its class, made from its ``get_config()``.
        compression: a Horovod compressor: ``hvd.Compression.none`` (default),
            ``hvd.Compression.fp16`` or ``GlobalQSGD(...)``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        backward_passes_per_step: k > 1 sets Keras's ``gradient_accumulation_steps=k``.
        process_set: Horovod process set to reduce over (default: global).  A compressor with
            its own ``process_set`` must name the same set.

    .. warning::
        * Under ``mixed_float16`` wrap the ``LossScaleOptimizer`` yourself:
          ``model.compile`` would otherwise wrap *this* optimizer in one whose finiteness
          check runs on each rank's own gradients, before the reduction; ranks could then
          disagree and hang.  A global ``mixed_float16`` policy makes this function refuse a
          plain optimizer; :class:`BroadcastGlobalVariablesCallback` refuses the composition.
        * ``jit_compile=True`` is refused (Horovod ops have no XLA kernels); Keras's "auto"
          picks XLA when a GPU is visible, so pass ``jit_compile=False`` there.
        * Every rank must run the same number of steps (same number of batches per epoch).
        * ``keras.optimizers.MultiOptimizer`` (its ``apply`` delegates to inner optimizers)
          is refused: the reduction would never run.
        * Legacy Keras (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``) optimizers are refused: use
          ``horovod.tensorflow.keras.DistributedOptimizer`` there, which works.
        * ``model.save`` records the generated class (``DistributedSGD``, ...), which
          ``keras.models.load_model`` cannot locate: load with ``compile=False`` and compile
          again with a new ``DistributedOptimizer``.
        * ``tf.IndexedSlices`` gradients (``Embedding``) are made dense before the reduction,
          so the compressor sees them; this costs a dense tensor per embedding table.
    """
    optimizer = _keras3_optimizer(optimizer)
    reduction = _reduction(compression, op, process_set)
    config = optimizer.get_config()
    if backward_passes_per_step != 1:
        config = _with_accumulation(optimizer, config, backward_passes_per_step)
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    wrapped._hvd_reduction = reduction
    return wrapped


def _keras3_optimizer(optimizer: Any) -> Any:
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        legacy = kind.startswith("tf_keras") or ".legacy." in kind
        raise TypeError(
            f"hvd_gqsgd.keras.DistributedOptimizer wraps Keras 3 optimizers; got {kind}. " + (
                "This is legacy Keras (tf_keras, TF_USE_LEGACY_KERAS=1): use "
                "horovod.tensorflow.keras.DistributedOptimizer(opt, compression=...) there."
                if legacy else "Pass a keras.optimizers.Optimizer, e.g. keras.optimizers.SGD."))
    if optimizer.built:
        raise ValueError(
            f"{type(optimizer).__name__} is already built (it has variables); its state would "
            "be lost in the distributed copy. Wrap the optimizer before compile/fit.")
    if (not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and keras.config.dtype_policy().name == "mixed_float16"):
        raise ValueError(
            "Under the mixed_float16 policy model.compile wraps the optimizer in a "
            "LossScaleOptimizer whose non-finite check would run before the reduction, "
            "differently on each rank. Wrap it yourself: DistributedOptimizer("
            "keras.optimizers.LossScaleOptimizer(opt), ...).")
    return optimizer


def _reduction(compression: Any, op: Any, process_set: Any) -> _Reduction:
    refuse_class(compression, "given to hvd_gqsgd.keras.DistributedOptimizer")
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum; got {op!r}. Gradients are "
                         "averaged or summed; other ops do not make an optimizer step.")
    process_set = _or_global(process_set)
    own = getattr(compression, "process_set", None)
    if own is not None and own != process_set:
        raise ValueError(f"the compressor reduces over {own!r} but the optimizer over "
                         f"{process_set!r}; give both the same process_set.")
    return _Reduction(hvd.Compression.none if compression is None else compression, op,
                      process_set)


def _with_accumulation(optimizer: Any, config: dict, steps: int) -> dict:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError("backward_passes_per_step with a LossScaleOptimizer: set "
                         "gradient_accumulation_steps on its inner optimizer instead.")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1; got {steps!r}.")
    own = config.get("gradient_accumulation_steps")
    if own not in (None, steps):
        raise ValueError(f"backward_passes_per_step={steps} contradicts the optimizer's "
                         f"gradient_accumulation_steps={own}; set only one of them.")
    return {**config, "gradient_accumulation_steps": steps}


def _or_global(process_set: Any) -> Any:
    return hvd.global_process_set if process_set is None else process_set


def _tf_variables(variables: Sequence[Any]) -> list[Any]:
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


def broadcast_variables(model: Any, root_rank: int = 0, process_set: Any = None) -> None:
    """COLLECTIVE: copy rank ``root_rank``'s model variables (trainable and not) and, if the
    model is compiled, its optimizer's variables (iterations, moments, loss scale) to every
    rank.  An optimizer not built yet is built here first (as its first ``apply`` would), so
    every rank broadcasts the same list even when only rank 0 restored optimizer state."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    process_set = _or_global(process_set)
    # one blocking broadcast per variable, once per training run; named by position
    for i, v in enumerate(_tf_variables(variables)):
        v.assign(hvd.broadcast(v, root_rank, name=f"hvd_gqsgd.keras.broadcast.{i}",
                               ignore_name_scope=True, process_set=process_set))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Keras 3 callback: :func:`broadcast_variables` from ``root_rank`` when the first
    ``fit`` begins, so all ranks start from rank ``root_rank``'s weights and optimizer state.

    Also refuses a ``LossScaleOptimizer`` wrapped around :func:`DistributedOptimizer` (what
    ``model.compile`` does under a per-model ``mixed_float16`` policy), which could hang.

    Example::

        model.fit(x, y, callbacks=[BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0, process_set: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self._done = False

    def on_train_begin(self, logs: Any = None) -> None:
        optimizer = self.model.optimizer
        inner = getattr(optimizer, "inner_optimizer", None)
        if isinstance(inner, _ReduceBeforeClipping):
            raise ValueError(
                "model.optimizer is a LossScaleOptimizer around hvd_gqsgd's "
                "DistributedOptimizer (model.compile does this for mixed_float16 models): its "
                "non-finite check runs before the reduction, so ranks could disagree. Pass "
                "DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt)) to compile.")
        if not self._done:
            broadcast_variables(self.model, self.root_rank, self.process_set)
            self._done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Keras 3 callback: at each epoch end, replace every number in ``logs`` (loss, metrics,
    ``val_*``) by its average over ranks (COLLECTIVE: one allreduce of all of them, in
    sorted-name order, so every rank must log the same names).  Put it before callbacks that
    read ``logs`` (checkpoints, early stopping); the History that ``fit`` returns sees the
    averages.

    Example::

        model.fit(x, y, callbacks=[MetricAverageCallback()])
    """

    def __init__(self, process_set: Any = None) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)))
        values = tf.constant([float(logs[k]) for k in names], tf.float64)
        mean = hvd.allreduce(values, op=hvd.Average, name="hvd_gqsgd.keras.metrics",
                             ignore_name_scope=True,
                             process_set=_or_global(self.process_set)).numpy()
        logs.update(zip(names, (float(m) for m in mean)))
