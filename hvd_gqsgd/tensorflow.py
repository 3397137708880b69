"""TensorFlow 2 adapter: translates :mod:`hvd_gqsgd.core` primitives into TF ops and
Horovod's TensorFlow collectives.  No formula lives here.

Works eagerly and inside ``tf.function`` (Horovod traces its allreduce into a cached
function, so every primitive here is traceable).  The rounding-noise generator is created once,
lifted out of any trace with ``tf.init_scope``.

Importing this module imports ``tensorflow`` and ``horovod.tensorflow`` only; it never imports
``horovod.torch`` (doing that after ``horovod.tensorflow`` is initialised breaks TF's global
process set).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from . import core
from .compressor import GlobalQSGD

__all__ = ["GlobalQSGD", "TensorFlowBackend", "tape_sources"]


def tape_sources(variables: Sequence[Any]) -> list[Any]:
    """The ``tf.Variable`` behind each Keras variable, for ``DistributedGradientTape``.

    Horovod 0.28.1's tape calls ``.ref()`` on every source, which Keras 3 variables lack
    (``'Variable' object has no attribute 'ref'``).  Their ``.value`` is the underlying
    ``tf.Variable``; ``tf.Variable`` (plain TF, legacy Keras) is returned as is::

        grads = tape.gradient(loss, tape_sources(model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
    """
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


class TensorFlowBackend:
    """:class:`hvd_gqsgd.engine.Backend` for TensorFlow tensors and variables."""

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._generator: tf.random.Generator | None = None  # created eagerly on first use

    # --- core.TensorOps
    def floor(self, x: Any) -> Any:
        return tf.floor(x)

    def clamp(self, x: Any, low: float, high: float) -> Any:
        return tf.clip_by_value(x, tf.cast(low, x.dtype), tf.cast(high, x.dtype))

    def less(self, a: Any, b: Any) -> Any:
        return a < b

    def to_int64(self, x: Any) -> Any:
        return tf.cast(x, tf.int64)

    def pad_reshape(self, x: Any, rows: int, cols: int) -> Any:
        return tf.reshape(tf.pad(x, [[0, rows * cols - _static_numel(x)]]), [rows, cols])

    def column(self, x: Any, k: int) -> Any:
        return x[:, k]

    def stack_columns(self, cols: Sequence[Any], numel: int) -> Any:
        return tf.reshape(tf.stack(list(cols), axis=1), [-1])[:numel]

    def bitand(self, x: Any, mask: int) -> Any:
        return tf.bitwise.bitwise_and(x, tf.constant(mask, x.dtype))

    def rshift(self, x: Any, shift: int) -> Any:
        return tf.bitwise.right_shift(x, tf.constant(shift, x.dtype))  # arithmetic for int64

    def isfinite(self, x: Any) -> Any:
        return tf.math.is_finite(x)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return tf.where(cond, a, tf.constant(b, a.dtype))

    # --- tensors
    def is_compressible(self, t: Any) -> bool:
        if not t.dtype.is_floating:
            return False
        if not t.shape.is_fully_defined():
            raise ValueError(
                f"GlobalQSGD needs a static shape to lay out the packed allreduce; got a "
                f"{t.dtype.name} tensor of shape {t.shape}. Give the model fixed shapes, or "
                "reduce this tensor without compression."
            )
        return t.shape.num_elements() > 0

    def dtype_name(self, t: Any) -> str:
        return str(t.dtype.name)

    def numel(self, t: Any) -> int:
        return _static_numel(t)

    def nbytes(self, t: Any) -> int:
        return _static_numel(t) * t.dtype.size

    def probe(self, values: Sequence[float], like: Any) -> Any:
        return tf.constant(values, dtype=tf.float64)

    def probe_factor(self, reduced: Any, world_size: int) -> Any:
        return _on_host(lambda r: core.check_probe(r, world_size), reduced)

    def local_norms(self, tensors: Sequence[Any], flat: Any, counts: Sequence[int], norm: str,
                    extra: Sequence[float]) -> Any:
        # +inf for NaN/Inf, which wins the MAX on every rank (MAX may drop a NaN)
        if len(counts) == len(tensors):  # one segment per tensor: reduce each tensor
            def one(t: Any) -> Any:
                x = tf.cast(t, tf.float64)
                value = tf.reduce_max(tf.abs(x)) if norm == "max" else tf.norm(x)
                return tf.where(tf.reduce_all(tf.math.is_finite(x)), value, np.inf)

            norms = tf.stack([one(t) for t in tensors])
        else:  # scale_block: segment reductions over the flat bucket
            x = tf.cast(flat, tf.float64)
            m = len(counts)  # the unsorted_* forms give the result a static shape [m]
            ids = tf.repeat(tf.range(m), list(counts))
            if norm == "max":
                value = tf.math.unsorted_segment_max(tf.abs(x), ids, m)
            else:
                value = tf.sqrt(tf.math.unsorted_segment_sum(tf.square(x), ids, m))
            ok = tf.math.unsorted_segment_min(tf.cast(tf.math.is_finite(x), tf.int32), ids, m)
            norms = tf.where(ok > 0, value, np.inf)
        return tf.concat([norms, tf.constant(extra, tf.float64)], 0)

    def check_layout(self, reduced: Any) -> Any:
        def check(pair: Any) -> float:
            if pair[0] != -pair[1]:
                raise RuntimeError(
                    "GlobalQSGD: ranks compressed different tensors (sizes or dtypes differ at "
                    "the same position). Every rank must call compress() on the same tensors in "
                    "the same order."
                )
            return 0.0

        ok = _on_host(check, reduced[-2:])
        with tf.control_dependencies([ok] if not tf.executing_eagerly() else []):
            return tf.identity(reduced[:-2])

    def flat_concat(self, tensors: Sequence[Any]) -> Any:
        dtype = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32
        return tf.concat([tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors], 0)

    def encode(self, flat: Any, mult: Any, counts: Sequence[int], n_levels: int, bits: int,
               rank: int) -> Any:
        per_element = tf.repeat(tf.cast(mult, flat.dtype), list(counts))
        return core.encode(self, flat, per_element, self._uniform(flat, rank), n_levels, bits)

    def _uniform(self, like: Any, rank: int) -> Any:
        if self._generator is None:
            with tf.init_scope():  # a variable must not be created inside a trace
                self._generator = tf.random.Generator.from_seed(core.rank_seed(self._seed, rank))
        return self._generator.uniform(tf.shape(like), dtype=like.dtype)

    def decoder(self, words: Any, bits: int, total: int) -> Any:
        return core.unpack(self, words, bits, total)

    def decode(self, state: Any, offset: int, like: Any, scale: Any, block: int) -> Any:
        compute = tf.float64 if like.dtype == tf.float64 else tf.float32
        numel = _static_numel(like)
        part = tf.cast(state[offset:offset + numel], compute)
        scale = tf.cast(scale, compute)
        if block:  # element i times scale[i // block]
            scale = tf.repeat(scale, block)[:numel]
        return tf.reshape(tf.cast(part * scale, like.dtype), like.shape)

    def stable_names(self) -> bool:
        return tf.executing_eagerly()

    # --- Horovod
    def global_process_set(self) -> Any:
        return hvd.global_process_set

    def allreduce_max(self, vec: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce(vec, op=hvd.Max, name=name, process_set=process_set,
                             ignore_name_scope=True)

    def allreduce_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce(words, op=hvd.Sum, name=name, process_set=process_set,
                             ignore_name_scope=True)

    def allgather_async(self, tensor: Any, name: str, process_set: Any) -> Any:
        return hvd.allgather(tensor, name=name, process_set=process_set, ignore_name_scope=True)

    def wait(self, handle: Any) -> Any:
        return handle  # TF runs the op asynchronously; its output is the handle

    def concat_words(self, words: Sequence[Any]) -> Any:
        return tf.concat(list(words), 0)


def _static_numel(t: Any) -> int:
    return int(t.shape.num_elements())


def _on_host(fn: Callable[[Any], float], tensor: Any) -> Any:
    """Run a core check on host values: directly when eager (a Python exception), else as a
    graph op (the exception surfaces as a TF error carrying the same message)."""
    if tf.executing_eagerly():
        return tf.constant(fn(tensor.numpy()), tf.float64)
    return tf.numpy_function(lambda a: np.float64(fn(a)), [tensor], tf.float64, stateful=True)
