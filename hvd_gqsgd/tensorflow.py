"""TensorFlow 2 adapter: translates :mod:`hvd_gqsgd.core` primitives into TF ops and
Horovod's TensorFlow collectives.  No formula lives here.

Works eagerly and inside ``tf.function`` (Horovod traces its allreduce into a cached
function, so every primitive here is traceable).

CPU tensors go through the same fused kernels as the torch path (:mod:`hvd_gqsgd.kernels`),
called through ``tf.numpy_function``; GPU tensors (and ``HVD_GQSGD_KERNELS=0``) use TF ops on
:mod:`hvd_gqsgd.core`.  Every op this adapter adds to a graph is *stateless*: Horovod wraps
each gradient's allreduce in its own ``tf.cond``, and a branch holding one stateful op (a
``tf.random.Generator`` draw, a stateful ``numpy_function``) becomes a stateful ``If`` that
``tf.function``'s automatic control dependencies chain behind the previous gradient's, so
300 gradients ran one after the other, each waiting for its own two collectives.  Stateless,
the chains run concurrently and Horovod fuses their collectives.  The rounding noise is the
one piece of state: its per-bucket key is drawn in Python when the op *runs*
(:class:`hvd_gqsgd.core.NoiseKeys`), which is safe to declare stateless because keys are
independent and the order in which concurrent chains draw them does not matter.

Importing this module imports ``tensorflow`` and ``horovod.tensorflow`` only; it never imports
``horovod.torch`` (doing that after ``horovod.tensorflow`` is initialised breaks TF's global
process set).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from . import core, kernels
from .compressor import GlobalQSGD

__all__ = ["GlobalQSGD", "TensorFlowBackend", "buckets", "group_gradients", "tape_sources"]


def group_gradients(late: bool = False) -> None:
    """Make Horovod reduce gradients in grouped calls of about ``bucket_bytes`` each when the
    compressor is a :class:`GlobalQSGD`, instead of one call per gradient.

    With Horovod's default ``num_groups=0``, ``DistributedGradientTape`` and the (legacy)
    Keras ``DistributedOptimizer`` reduce each gradient in its own ``tf.cond``: a compressor
    sees one tensor at a time and pays a scale exchange, a code allreduce and a host call per
    gradient (a 300-tensor model stepped many times slower than uncompressed).  Grouped,
    each group is one bucket.  Results are the same either way: one gradient's reduction
    does not depend on the others'.  Other compressors, and an explicit ``num_groups`` or
    ``groups``, are left as they are.

    How the gradients are grouped depends on where the reduction is built:

    * inside ``tf.function`` (a tape made in the traced step): one grouped call per bucket
      (:func:`buckets`: ``bucket_bytes`` of gradient, 8 MiB by default, taken from the last
      variable back, the order backward produces them).  Each call is its own ``tf.cond``,
      which TF runs as soon as that bucket's gradients exist, so a deep model's last layers
      are exchanged, quantized and sent while backward still computes the first ones;
    * eagerly, or with ``bucket_bytes=0``: one grouped call for all gradients, as if the user
      had passed ``num_groups=1`` (eagerly, the gradients are all computed before Horovod
      sees them, so there is nothing to overlap).

    Installed by wrapping ``horovod.tensorflow._make_allreduce_grads_fn``, which both build
    their reduction with, when a ``GlobalQSGD`` is constructed after ``horovod.tensorflow``
    was imported (the usual order) or, ``late``, when the first TF tensor reaches one; tapes
    and optimizers made before that keep reducing per gradient, and a warning says so.
    """
    make = hvd._make_allreduce_grads_fn
    if getattr(make, "_hvd_gqsgd_groups", False):
        return
    signature = inspect.signature(make)

    @functools.wraps(make)
    def make_grouped(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        compression = bound.arguments.get("compression")
        if not isinstance(compression, GlobalQSGD) or bound.arguments.get("groups"):
            return make(*bound.args, **bound.kwargs)
        bound.arguments["groups"] = 1
        reduce_all = make(*bound.args, **bound.kwargs)
        limit = compression.settings.bucket_bytes
        if tf.executing_eagerly() or limit == 0:
            return reduce_all
        return _per_bucket(reduce_all, core.AUTO_BUCKET_BYTES if limit is None else limit)

    make_grouped._hvd_gqsgd_groups = True  # type: ignore[attr-defined]
    hvd._make_allreduce_grads_fn = make_grouped
    if late:
        warnings.warn(
            "GlobalQSGD was constructed before horovod.tensorflow was imported, so "
            "DistributedGradientTape/DistributedOptimizer objects created until now reduce "
            "gradients one by one (a scale exchange and a code allreduce per gradient: slow "
            "for many small tensors). Construct GlobalQSGD after `import horovod.tensorflow`, "
            "or pass num_groups=1 to them.", RuntimeWarning, stacklevel=3)


def buckets(grads: Sequence[Any], limit: int) -> list[list[int]] | None:
    """Indices of ``grads`` grouped into buckets of at least ``limit`` bytes (the last may be
    smaller), walking from the last gradient back, as backward produces them: the rule by
    which the engine seals a bucket from ``compress``.  Each bucket lists its indices in that
    order too, last first, so that compressing a bucket's tensors in list order seals it
    exactly at its end, never partway.  ``None`` gradients are left out.  ``None`` when a
    gradient's size is not known at trace time or it is sparse (``tf.IndexedSlices``): then
    all go in one group."""
    out: list[list[int]] = []
    current: list[int] = []
    queued = 0
    for i in reversed(range(len(grads))):
        g = grads[i]
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) or not g.shape.is_fully_defined():
            return None
        current.append(i)
        queued += g.shape.num_elements() * g.dtype.size
        if queued >= limit:
            out.append(current)
            current, queued = [], 0
    if current:
        out.append(current)
    return out


def _per_bucket(reduce_all: Callable[..., Any], limit: int) -> Callable[..., Any]:
    """``reduce_all`` (Horovod's reduction of a list of gradients in one grouped call), called
    once per :func:`buckets` group instead of once for all: one ``tf.cond`` per bucket, each
    waiting only for its own gradients.  With ``use_generic_names`` Horovod would name every
    call's group ``grad_0``, so then all gradients go in one call."""

    @functools.wraps(reduce_all)
    def reduce_per_bucket(grads: Sequence[Any], vars: Sequence[Any] | None = None,
                          use_generic_names: bool = False) -> list[Any]:
        groups = None if use_generic_names else buckets(grads, limit)
        if groups is None or len(groups) < 2:
            return reduce_all(grads, vars, use_generic_names)
        out = list(grads)
        for group in groups:
            reduced = reduce_all([grads[i] for i in group],
                                 None if vars is None else [vars[i] for i in group],
                                 use_generic_names)
            for i, r in zip(group, reduced):
                out[i] = r
        return out

    return reduce_per_bucket


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
        self._keys = core.NoiseKeys(seed)  # one key per bucket, drawn when the op runs
        # In a graph: the chunks of the bucket being traced, and of each traced chunk's Sum
        # allreduce until its bucket's decoder takes it (kernels.WireWatch)
        self._watch: kernels.WireWatch | None = None
        self._watch_of: dict[Any, kernels.WireWatch] = {}

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

    def rshift(self, x: Any, shift: Any) -> Any:
        return tf.bitwise.right_shift(x, tf.cast(shift, x.dtype))  # arithmetic for int64

    def isfinite(self, x: Any) -> Any:
        return tf.math.is_finite(x)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return tf.where(cond, a, tf.constant(b, a.dtype))

    def copy(self, x: Any) -> Any:
        return tf.identity(x)

    def row_index(self, starts: Sequence[int], width: int, like: Any) -> Any:
        first = tf.constant(list(starts), dtype=tf.int64)
        return first[:, None] + tf.range(width, dtype=tf.int64)[None, :]

    def gather_rows(self, x: Any, index: Any) -> Any:
        return tf.gather(x, index)

    def scatter_rows(self, out: Any, index: Any, rows: Any) -> Any:
        return tf.tensor_scatter_nd_update(out, tf.reshape(index, [-1, 1]), tf.reshape(rows, [-1]))

    def butterfly(self, rows: Any, h: int) -> Any:
        k, width = rows.shape  # static: rotate's chunks have known sizes
        pairs = tf.reshape(rows, [k, width // (2 * h), 2, h])
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        return tf.reshape(tf.stack([a + b, a - b], axis=2), [k, width])

    def bitxor(self, x: Any, y: Any) -> Any:
        return tf.bitwise.bitwise_xor(x, y if tf.is_tensor(y) else tf.constant(y, x.dtype))

    def cast_like(self, x: Any, like: Any) -> Any:
        return tf.cast(x, like.dtype)

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

    def round_probe(self, values: Sequence[float], like: Any) -> Any:
        # Horovod's TF ops write their results to new tensors: a constant can serve always
        return self.probe(values, like)

    def end_round(self, clean: bool) -> None:
        pass

    def probe_factor(self, reduced: Any, world_size: int) -> Any:
        return _host(lambda r: np.float64(core.check_probe(r, world_size)), [reduced],
                     tf.float64, [])

    def local_norms(self, tensors: Sequence[Any] | None, flat: Any, counts: Sequence[int],
                    norm: str, extra: Sequence[float]) -> Any:
        tail = np.asarray(extra, np.float64)
        if _fused(flat):
            sizes = tuple(counts)  # kernels._derived keeps what it makes of a tuple

            def run(x: np.ndarray) -> np.ndarray:
                return np.concatenate([kernels.segment_norms(x, sizes, norm), tail])

            return _host(run, [flat], tf.float64, [len(counts) + len(extra)])
        # +inf for NaN/Inf, which wins the MAX on every rank (MAX may drop a NaN)
        if tensors is not None and len(counts) == len(tensors):  # a segment per tensor
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
        return tf.concat([norms, tf.constant(tail)], 0)

    def check_layout(self, reduced: Any) -> Any:
        def check(vec: np.ndarray) -> np.ndarray:
            if vec[-2] != -vec[-1]:
                raise RuntimeError(
                    "GlobalQSGD: ranks compressed different tensors (sizes or dtypes differ at "
                    "the same position), or, with rotation, are at different rounds. Every "
                    "rank must call compress() on the same tensors in the same order."
                )
            return vec[:-2]

        # The scales pass through the check as data: a stateless op that only a control
        # dependency waits for is pruned from the graph, and the check would never run.
        return _host(check, [reduced], tf.float64, [reduced.shape[0] - 2])

    def flat_concat(self, tensors: Sequence[Any]) -> Any:
        dtype = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32
        return tf.concat([tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors], 0)

    def round_flat(self, tensors: Sequence[Any]) -> Any:
        return self.flat_concat(tensors)  # a new tensor: TF owns its memory

    def encode(self, flat: Any, mult: Any, counts: Sequence[int], n_levels: int, bits: int,
               rank: int, after: Any = None, pad_to: int | None = None) -> Any:
        if pad_to is not None:  # two-stage: one piece, zero words up to pad_to, no chunks
            return self._encode(flat, mult, counts, n_levels, bits, rank, None, True, pad_to)
        if after is not None and not tf.executing_eagerly():
            # Chunks: without this order TF's executor runs every chunk's encode before any
            # chunk's allreduce (all are ready at once), and Horovod fuses them all into one
            # message sent after the last chunk is packed: no overlap at all.
            with tf.control_dependencies([after]):
                return self._encode(flat, mult, counts, n_levels, bits, rank, self._watch,
                                    first=False)
        # A bucket's first (or only) chunk; in a graph its later chunks quantize behind it
        graph = not tf.executing_eagerly() and _fused(flat)
        self._watch = kernels.WireWatch() if graph else None
        return self._encode(flat, mult, counts, n_levels, bits, rank, self._watch, first=True)

    def _encode(self, flat: Any, mult: Any, counts: Sequence[int], n_levels: int, bits: int,
                rank: int, watch: kernels.WireWatch | None, first: bool,
                pad_to: int | None = None) -> Any:
        numel = _static_numel(flat)
        size = core.packed_words(numel, bits)
        if _fused(flat):  # a longer buffer gets zero codes, hence zero words, at its end
            sizes, size = tuple(counts), pad_to or size

            def run(x: np.ndarray, m: np.ndarray) -> np.ndarray:
                words = kernels.host_array(size, np.int64)
                args = (x, sizes, m, n_levels, bits, self._keys.next(rank), words)
                if watch is None:
                    kernels.quantize_pack(*args)
                    return words
                if first:
                    watch.first()
                    kernels.quantize_pack(*args)
                else:
                    watch.quantize_pack(*args)
                watch.sent()
                return words

            return _host(run, [flat, mult], tf.int64, [size])
        per_element = tf.repeat(tf.cast(mult, flat.dtype), list(counts))
        words = core.encode(self, flat, per_element, self._uniform(flat, rank), n_levels, bits)
        if pad_to and pad_to > size:
            words = tf.pad(words, [[0, pad_to - size]])
        return words

    def _uniform(self, like: Any, rank: int) -> Any:
        """Noise for the TF-ops path: a stateless draw keyed by a fresh 64-bit key per call."""
        def key() -> np.ndarray:
            return np.array(divmod(self._keys.next(rank), 1 << 32), np.int64)

        seed = _host(lambda _: key(), [tf.shape(like)], tf.int64, [2])
        return tf.random.stateless_uniform(tf.shape(like), seed=seed, dtype=like.dtype)

    def auto_chunk_bytes(self, flat: Any) -> int:
        # In a graph, fused chunks pipeline: chunk k's allreduce is launched before chunk k+1
        # is quantized (encode's ``after``) and each chunk is unpacked as it arrives
        # (_Words.rescale).  Eagerly every Horovod op blocks until done, so chunks would only
        # add round trips; the TF-ops (GPU) path decodes after joining the chunks.
        if tf.executing_eagerly() or not _fused(flat):
            return 0
        return core.AUTO_CHUNK_BYTES

    def decoder(self, words: Any, bits: int, total: int) -> Any:
        chunks = list(words) if isinstance(words, (list, tuple)) else [words]
        watch = None
        for chunk in chunks:
            watch = self._watch_of.pop(chunk.ref(), watch)
        if _fused(chunks[0]):
            # decoded by rescale_bucket (or decode: QSGDAllgather); in a graph chunk by chunk
            return _Words(chunks, bits, watch)
        return core.unpack(self, self.concat_words(chunks), bits, total)

    def decode(self, state: Any, offset: int, like: Any, scale: Any, block: int) -> Any:
        compute = tf.float64 if like.dtype == tf.float64 else tf.float32
        numel = _static_numel(like)
        if isinstance(state, _Words):
            out = state.decode(offset, numel, scale, block, compute)
            return tf.reshape(tf.cast(out, like.dtype), like.shape)
        part = tf.cast(state[offset:offset + numel], compute)
        scale = tf.cast(scale, compute)
        if block:  # element i times scale[i // block]
            scale = tf.repeat(scale, block)[:numel]
        return tf.reshape(tf.cast(part * scale, like.dtype), like.shape)

    def rescale_bucket(self, state: Any, steps: Any, counts: Sequence[int],
                       likes: Sequence[Any], reduced_probe: Any, world_size: int,
                       rotation: tuple[int, int] | None = None) -> Any:
        compute = tf.float64 if any(t.dtype == tf.float64 for t in likes) else tf.float32
        if isinstance(state, _TwoStage):  # rotated back there
            return state.rescale(compute, reduced_probe, world_size, rotation)
        if isinstance(state, _Words):  # rotated back there too
            return state.rescale(steps, counts, compute, reduced_probe, world_size, rotation)
        # the TF-ops path (GPU): the summed codes themselves
        factor = self.probe_factor(reduced_probe, world_size)
        out = tf.cast(state, compute) * tf.repeat(tf.cast(steps * factor, compute), counts)
        if rotation is None:
            return out
        return core.rotate(self, out, counts, *rotation, inverse=True)

    def rotate_norms(self, flat: Any, counts: Sequence[int], block: int, key: int, norm: str,
                     extra: Sequence[float]) -> tuple[Any, Any]:
        """``flat`` rotated (:func:`hvd_gqsgd.core.rotate`; the kernels on CPU) and the local
        norms of the result."""
        if _fused(flat):
            sizes = tuple(counts)

            def run(x: np.ndarray) -> np.ndarray:
                out = kernels.host_array(x.size, x.dtype)
                kernels.rotate_norms(x, sizes, block, key, norm, out)
                return out

            rotated = _host(run, [flat], flat.dtype, [_static_numel(flat)])
        else:
            rotated = core.rotate(self, flat, counts, block, key)
        return rotated, self.local_norms(None, rotated, counts, norm, extra)

    def take(self, rescaled: Any, offset: int, like: Any, reduced_probe: Any,
             world_size: int) -> Any:
        # The bucket was rescaled in one host call (one per tensor costs more than a
        # small gradient's whole reduction) with its first probe's factor: in TF a bucket of
        # several tensors is always one grouped_allreduce call, so one op and factor.
        part = rescaled[offset:offset + _static_numel(like)]
        return tf.reshape(tf.cast(part, like.dtype), like.shape)

    def stable_names(self) -> bool:
        return tf.executing_eagerly()

    # --- Horovod
    def global_process_set(self) -> Any:
        return hvd.global_process_set

    def allreduce_max(self, vec: Any, name: str, process_set: Any) -> Any:
        return hvd.allreduce(vec, op=hvd.Max, name=name, process_set=process_set,
                             ignore_name_scope=True)

    def allreduce_max_async(self, vec: Any, name: str, process_set: Any) -> Any:
        return self.allreduce_max(vec, name, process_set)  # its output is the handle

    def poll(self, handle: Any) -> bool:
        return True  # wait() is the identity: nothing to wait for on the Python side

    def auto_bucket_bytes(self) -> int:
        # Each grouped Horovod call hands over its gradients at once, so a round is one
        # bucket; inside tf.function, group_gradients makes one call per bucket (buckets)
        return 0

    def allreduce_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        summed = hvd.allreduce(words, op=hvd.Sum, name=name, process_set=process_set,
                               ignore_name_scope=True)
        if self._watch is not None:  # a chunk of the bucket being traced
            self._watch_of[summed.ref()] = self._watch
        return summed

    def allgather_async(self, tensor: Any, name: str, process_set: Any) -> Any:
        out = hvd.allgather(tensor, name=name, process_set=process_set, ignore_name_scope=True)
        # equal inputs on every rank here, so the output's length is static (a graph leaves
        # it unknown, and the TF-ops decode needs it)
        out.set_shape([tensor.shape[0] * process_set.size(), *tensor.shape[1:]])
        return out

    def reducescatter_sum_async(self, words: Any, name: str, process_set: Any) -> Any:
        # equal shards: the words are world_size * shard_words long (core.TwoStagePlan)
        out = hvd.reducescatter(words, op=hvd.Sum, name=name, process_set=process_set,
                                ignore_name_scope=True)
        out.set_shape([words.shape[0] // process_set.size()])
        return out

    # --- two-stage (hvd_gqsgd.two_stage)
    def lane_sums(self, words: Any, bits: int, numel: int) -> Any:
        if _fused(words):
            def run(w: np.ndarray) -> np.ndarray:
                out = kernels.host_array(numel, np.float64)
                kernels.lane_sums(w if w.flags.writeable else np.array(w), bits, out)
                return out

            return _host(run, [words], tf.float64, [numel])
        return tf.cast(core.unpack(self, words, bits, numel), tf.float64)

    def part_max(self, sums: Any, counts: Sequence[int]) -> Any:
        if _fused(sums):
            sizes = tuple(counts)  # kernels._derived keeps what it makes of a tuple
            return _host(lambda x: kernels.segment_norms(x, sizes, "max"), [sums], tf.float64,
                         [len(counts)])
        ids = tf.repeat(tf.range(len(counts)), list(counts))
        return tf.math.unsorted_segment_max(tf.abs(sums), ids, len(counts))

    def message(self, codes: Any, part_max: Any, code_words: int, slots: int) -> Any:
        parts = [tf.zeros([code_words], tf.int64) if codes is None else codes,
                 tf.cast(part_max, tf.int64)]  # exact: integers below 2**31
        rest = slots - int(part_max.shape[0])
        return tf.concat(parts + ([tf.zeros([rest], tf.int64)] if rest else []), 0)

    def messages(self, gathered: Any, layout: core.MessageLayout, steps1: Any) -> Any:
        return _TwoStage(self, gathered, layout, steps1)

    def wait(self, handle: Any) -> Any:
        return handle  # TF runs the op asynchronously; its output is the handle

    def concat_words(self, words: Sequence[Any]) -> Any:
        return words[0] if len(words) == 1 else tf.concat(list(words), 0)


def _static_numel(t: Any) -> int:
    return int(t.shape.num_elements())


def _fused(t: Any) -> bool:
    """CPU tensors take the numba kernels; a tensor placed on a GPU, or any tensor while a GPU
    is visible and the placement is not yet known (inside a trace), keeps the TF-ops path."""
    if not kernels.available():
        return False
    device = t.device or ""
    if "GPU" in device.upper():
        return False
    return "CPU" in device.upper() or not tf.config.list_logical_devices("GPU")


def _host(fn: Callable[..., Any], inputs: list[Any], dtype: Any, shape: list[int]) -> Any:
    """``fn`` on the inputs' NumPy values as a *stateless* graph op (see the module docstring
    for why); eagerly it is simply called.  Big results come from :func:`kernels.host_array`:
    ``numpy_function`` hands TF a 64-byte aligned array's buffer as is but copies an
    unaligned one (NumPy aligns big arrays to 16 bytes only).  A Python
    exception in ``fn`` surfaces as a TF error carrying the same message."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(fn(*[t.numpy() for t in inputs]), dtype)
    out = tf.numpy_function(fn, inputs, dtype, stateful=False)
    out.set_shape(shape)
    return out


class _Words:
    """A bucket's summed words (one tensor per chunk it was sent in) for the fused decode:
    :meth:`rescale` decodes the whole bucket (the engine's path); :meth:`decode` one tensor
    from a copy of just its own words (``QSGDAllgather``, which decodes each rank's slice on
    its own)."""

    def __init__(self, chunks: Sequence[Any], bits: int,
                 watch: kernels.WireWatch | None = None) -> None:
        self.chunks, self.bits, self.watch = list(chunks), bits, watch

    def decode(self, offset: int, numel: int, scale: Any, block: int, compute: Any) -> Any:
        lanes = core.lanes_per_word(self.bits)
        first, stop = offset // lanes, -(-(offset + numel) // lanes)
        start = offset - first * lanes  # the tensor's first lane inside its first word
        out_dtype = compute.as_numpy_dtype
        words = self.chunks[0] if len(self.chunks) == 1 else tf.concat(self.chunks, 0)

        def run(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
            out = kernels.host_array(numel, out_dtype)
            kernels.Summed(np.array(words), self.bits).unpack_scale(start, out, scales, block)
            return out

        return _host(run, [words[first:stop], scale], compute, [numel])

    def rescale(self, steps: Any, counts: Sequence[int], compute: Any, reduced_probe: Any,
                world_size: int, rotation: tuple[int, int] | None = None) -> Any:
        """The whole bucket, flat: the probe's check and factor, then each tensor's lane sums
        times its segments' steps times the factor; ``rotation=(block, key)``: rotated back.

        One chunk (or eagerly): one host call, the inverse rotation fused into the decode.
        Several chunks in a graph: one host call per chunk, each runs as soon as its chunk's
        allreduce is done and writes its slice of one output buffer, so unpacking overlaps
        the later chunks' time on the wire; the inverse rotation then follows in one more
        host call (a chunk ends at a word boundary, which may cut a block)."""
        out_dtype, total, bits = compute.as_numpy_dtype, sum(counts), self.bits

        def scales_of(step: np.ndarray, probe: np.ndarray) -> np.ndarray:
            return step * core.check_probe(probe.tolist(), world_size)

        def unpack(out: np.ndarray, words: np.ndarray, scales: np.ndarray, start: int,
                   rotation: tuple[int, int] | None = None) -> None:
            # The summed words are this op's alone (the Sum allreduce's output, read by
            # nothing else), so the kernels may rewrite them in place, saving a copy of a
            # quarter of the gradient; an eager tensor's view is read-only and is copied.
            summed = kernels.Summed(words if words.flags.writeable else np.array(words), bits)
            summed.unpack_bucket(out, counts, scales, start=start, rotation=rotation)

        if len(self.chunks) == 1 or tf.executing_eagerly():
            words = self.chunks[0] if len(self.chunks) == 1 else tf.concat(self.chunks, 0)

            def whole(words: np.ndarray, step: np.ndarray, probe: np.ndarray) -> np.ndarray:
                out = kernels.host_array(total, out_dtype)
                unpack(out, words, scales_of(step, probe), 0, rotation)
                return out

            return _host(whole, [words, steps, reduced_probe], compute, [total])

        scales = _host(scales_of, [steps, reduced_probe], tf.float64, [steps.shape[0]])
        # The buffer is allocated once the scales exist: a data input of its own, so two
        # buckets' buffers can never be merged as equal expressions.
        buffer = _host(lambda _: kernels.host_array(total, out_dtype), [scales], compute,
                       [total])
        lanes, start, done, watch = core.lanes_per_word(bits), 0, [], self.watch
        for words in self.chunks:
            stop = min(total, start + _static_numel(words) * lanes)

            def one_chunk(out: np.ndarray, words: np.ndarray, scales: np.ndarray,
                          lo: int = start, hi: int = stop) -> np.ndarray:
                if watch is not None:  # this chunk is back: the next may be waiting for it
                    watch.back()
                if not out.flags.writeable:  # TF hands graph-mode inputs over writeable
                    raise RuntimeError("GlobalQSGD: TensorFlow passed the decode buffer "
                                       "read-only; set chunk_bytes=0 and report this")
                unpack(out[lo:hi], words, scales, lo)
                return np.asarray(hi, np.int64)

            done.append(_host(one_chunk, [buffer, words, scales], tf.int64, []))
            start = stop
        # Every chunk's op feeds this one as data (ops that only a control dependency waits
        # for are pruned); it hands the filled buffer on without copying it, rotated back in
        # place with ``rotation``.
        sizes = tuple(counts)

        def filled(out: np.ndarray, *_: Any) -> np.ndarray:
            if rotation is not None:
                out = out if out.flags.writeable else np.array(out)
                kernels.unrotate(out, sizes, *rotation)
            return out

        return _host(filled, [buffer, *done], compute, [total])


class _TwoStage:
    """A two-stage bucket's gathered messages (``Backend.messages``), decoded by
    :meth:`rescale` in one host call (fused) or with TF ops over the core (GPU path)."""

    def __init__(self, ops: TensorFlowBackend, gathered: Any, layout: core.MessageLayout,
                 steps1: Any) -> None:
        self.ops, self.gathered, self.layout, self.steps1 = ops, gathered, layout, steps1

    def rescale(self, compute: Any, reduced_probe: Any, world_size: int,
                rotation: tuple[int, int] | None = None) -> Any:
        """The whole bucket, flat: every code times its part's step times the op's factor
        (the probe, checked here as in flat Global-QSGD); ``rotation=(block, key)``: rotated
        back too, in the same host call when fused."""
        layout, out_dtype = self.layout, compute.as_numpy_dtype
        total = int(sum(layout.counts))
        segments = np.asarray(layout.segments, np.int64)
        if _fused(self.gathered):
            def run(words: np.ndarray, steps1: np.ndarray, probe: np.ndarray) -> np.ndarray:
                messages = kernels.Messages(words, layout)
                factor = core.check_probe(probe.tolist(), world_size)
                steps = core.stage_two_steps(messages.part_max(), steps1[segments],
                                             layout.bits) * factor
                out = kernels.host_array(total, out_dtype)
                messages.unpack_parts(0, len(layout.counts), out, steps, 0, rotation)
                return out

            return _host(run, [self.gathered, self.steps1, reduced_probe], compute, [total])
        factor = _host(lambda r: np.float64(core.check_probe(r, world_size)), [reduced_probe],
                       tf.float64, [])
        part_max = tf.cast(tf.gather(self.gathered, list(layout.slots)), tf.float64)
        steps = core.stage_two_steps(part_max, tf.gather(self.steps1, segments),
                                     layout.bits) * factor
        counts = np.asarray(layout.counts, np.int64)
        starts = np.cumsum(counts) - counts
        position = tf.range(total, dtype=tf.int64) + tf.repeat(
            tf.constant(np.asarray(layout.lanes, np.int64) - starts), counts)
        every = core.unpack(self.ops, self.gathered, layout.bits,
                            _static_numel(self.gathered) * core.lanes_per_word(layout.bits))
        codes = tf.cast(tf.gather(every, position), compute)
        out = codes * tf.repeat(tf.cast(steps, compute), counts)
        if rotation is None:
            return out
        block, key = rotation
        return core.rotate(self.ops, out, list(kernels.segment_counts(layout)), block, key,
                           inverse=True)
