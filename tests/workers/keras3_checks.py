"""Keras 3 model.fit through hvd_gqsgd.keras on every rank; tests/test_keras3.py checks what
the ranks record.  Each rank trains on its own rows (gqsgd_lab.inputs.training_data) and starts
from its own random weights (seed = rank), so only the broadcast and the reduction can make
the ranks agree.  Rank 0 also trains single-process references on the union of all ranks'
batches: the mean loss over one combined batch of n * BATCH rows has the gradient the ranks'
Average reduces to, so a correct wrapper matches it (to float32 rounding)."""

from __future__ import annotations

import os
import pickle
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from gqsgd_lab.inputs import training_data
from hvd_gqsgd import GlobalQSGD
from hvd_gqsgd.keras import (
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
    MetricAverageCallback,
)

ROWS, BATCH, EPOCHS = 128, 32, 3  # 4 steps an epoch, 12 in all
LR = 0.05


def _model(seed: int, sparse: bool = False) -> keras.Model:
    keras.utils.set_random_seed(seed)
    if sparse:  # an Embedding, whose gradient is a tf.IndexedSlices
        return keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(32, 2),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


def _flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([w.reshape(-1) for w in model.get_weights()])


class _EpochWeights(keras.callbacks.Callback):
    """Weights at each epoch end, and the logs as this rank saw them before averaging."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[np.ndarray] = []
        self.raw_logs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(_flat(self.model))
        self.raw_logs.append(dict(logs or {}))


def _data(rank: int, poison: bool = False,
          sparse: bool = False) -> tuple[np.ndarray, np.ndarray]:
    x, y = training_data(rank, ROWS)
    if sparse:  # token ids for the Embedding model
        return (np.abs(x) * 10).astype(np.int32) % 32, y
    if poison and rank == 1:  # one non-finite input on rank 1, in its 3rd batch of epoch 1
        x = x.copy()
        x[2 * BATCH + 5, 0] = np.inf
    return x, y


def distributed_fit(rank: int, make_opt, eager: bool = False, poison: bool = False,
                    average_metrics: bool = False, sparse: bool = False,
                    **compile_kw) -> dict:
    """model.fit on this rank's rows with the optimizer ``make_opt()`` returns."""
    model, record = _model(rank, sparse), _EpochWeights()
    opt = make_opt()
    model.compile(optimizer=opt, loss="mse", run_eagerly=eager, **compile_kw)
    callbacks = [BroadcastGlobalVariablesCallback(0), record]
    x, y = _data(rank, poison, sparse)
    extra = {}
    if average_metrics:  # val_loss too, from this rank's own validation rows
        callbacks.append(MetricAverageCallback())
        extra["validation_data"] = (x[:BATCH], y[:BATCH])
    hist = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                     callbacks=callbacks, **extra)
    comp = getattr(opt, "_hvd_reduction", None)
    stats = getattr(comp.compression if comp else None, "stats", None)
    return {"epochs": record.weights, "weights": _flat(model), "raw_logs": record.raw_logs,
            "history": hist.history, "stats": stats and stats.as_dict(),
            "iterations": int(model.optimizer.iterations.numpy()),
            "n_vars": len(model.trainable_variables), **_loss_scale(model.optimizer)}


def _loss_scale(opt) -> dict:
    if not isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return {}
    return {"scale": float(opt.dynamic_scale.numpy()), "counter": int(opt.step_counter.numpy())}


def reference_fit(n: int, make_opt, poison: bool = False, sparse: bool = False) -> dict:
    """Single process: the same steps on batches that join all n ranks' batches."""
    parts = [_data(r, poison, sparse) for r in range(n)]
    xs, ys = [], []
    for i in range(0, ROWS, BATCH):
        xs += [x[i:i + BATCH] for x, _ in parts]
        ys += [y[i:i + BATCH] for _, y in parts]
    model, opt = _model(0, sparse), make_opt()
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=n * BATCH, epochs=EPOCHS,
              verbose=0, shuffle=False)
    return {"weights": _flat(model), "iterations": int(opt.iterations.numpy()),
            **_loss_scale(opt)}


def _sgd(lr: float = LR, **kw):
    return lambda: keras.optimizers.SGD(lr, **kw)


def _wrapped(base, compression=None, **kw):
    return lambda: DistributedOptimizer(base(), compression=compression, **kw)


# name -> (optimizer for the reference, for the ranks, fit options); references run on rank 0
FEATURES = {
    "clipnorm": (_sgd(clipnorm=0.02), _wrapped(_sgd(clipnorm=0.02)), {}),
    "clipvalue": (_sgd(clipvalue=0.004), _wrapped(_sgd(clipvalue=0.004)), {}),
    "global_clipnorm": (_sgd(global_clipnorm=0.03), _wrapped(_sgd(global_clipnorm=0.03)), {}),
    "accumulate": (_sgd(gradient_accumulation_steps=2),
                   _wrapped(_sgd(), backward_passes_per_step=2), {}),
    "ema": (_sgd(use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=5),
            _wrapped(_sgd(use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=5)), {}),
}


def _embedding_grad_is_sparse() -> bool:
    """Guards the embedding case: Keras 3 gives the Embedding an IndexedSlices gradient,
    which the wrapper makes dense so the compressor sees it."""
    model = _model(0, sparse=True)
    x, y = _data(0, sparse=True)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x[:4]) - y[:4]) ** 2)
    return isinstance(tape.gradient(loss, model.trainable_variables)[0], tf.IndexedSlices)


def features(rank: int, n: int) -> dict:
    """Each Keras feature that sits inside apply, on the ranks and (rank 0) as a reference;
    clipping also without the clip, to show the clip was active."""
    out = {name: {"dist": distributed_fit(rank, dist, **kw)}
           for name, (_, dist, kw) in FEATURES.items()}
    out["embedding"] = {"dist": distributed_fit(rank, _wrapped(_sgd(), GlobalQSGD(bits=8)),
                                                sparse=True, eager=True),
                        "indexed_slices": _embedding_grad_is_sparse()}
    # Sum of n gradients at lr/n is the Average at lr
    out["sum"] = {"dist": distributed_fit(rank, _wrapped(_sgd(LR / n), op=hvd.Sum))}
    out["sum_gq8"] = {"dist": distributed_fit(
        rank, _wrapped(_sgd(LR / n), GlobalQSGD(bits=8), op=hvd.Sum))}
    if rank == 0:
        for name, (ref, _, _) in FEATURES.items():
            out[name]["ref"] = reference_fit(n, ref)
        out["sum"]["ref"] = reference_fit(n, _sgd())
        out["embedding"]["ref"] = reference_fit(n, _sgd(), sparse=True)
        out["unclipped_ref"] = reference_fit(n, _sgd())
        out["plain_ref"] = reference_fit(n, _sgd(momentum=0.9))  # compressors() "none" runs
    return out


def compressors(rank: int) -> dict:
    """none / fp16 / GlobalQSGD(8), compiled and eager, and the optimizer left unwrapped."""
    out = {}
    for name, make in (("none", lambda: hvd.Compression.none),
                       ("fp16", lambda: hvd.Compression.fp16),
                       ("gq8", lambda: GlobalQSGD(bits=8))):
        for eager in (False, True):
            out[(name, eager)] = distributed_fit(
                rank, _wrapped(_sgd(momentum=0.9), make()), eager=eager,
                average_metrics=not eager)
    out[("gq8_accumulate", True)] = distributed_fit(
        rank, _wrapped(_sgd(), GlobalQSGD(bits=8), backward_passes_per_step=2), eager=True)
    out["unwrapped"] = distributed_fit(rank, _sgd(momentum=0.9))
    return out


def restored(rank: int) -> dict:
    """Only rank 0 holds optimizer state (as after restoring a checkpoint there); the
    callback must still broadcast the same variable list on every rank.  Rank 0 also builds
    an extra model and optimizer first, so Keras's automatic names ("sequential_7",
    "sgd_12") differ between ranks: collectives must not be named after them."""
    if rank == 0:
        _model(99)
        keras.optimizers.SGD(LR)
    model, record = _model(rank), _EpochWeights()
    opt = DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    if rank == 0:
        opt.build(model.trainable_variables)
        opt.iterations.assign(5)
        for m in opt.momentums:
            m.assign(tf.fill(m.shape, 0.01))
    x, y = _data(rank)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
              callbacks=[BroadcastGlobalVariablesCallback(0), record])
    return {"weights": _flat(model), "iterations": int(opt.iterations.numpy())}


def _lso():
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR),
                                               dynamic_growth_steps=3)


def loss_scale(rank: int, n: int) -> dict:
    """mixed_float16 with a LossScaleOptimizer; rank 1 alone meets a non-finite gradient."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        out = {name: {"dist": distributed_fit(rank, lambda c=comp: DistributedOptimizer(
                   _lso(), compression=c), poison=True, eager=eager)}
               for name, comp, eager in (("none", hvd.Compression.none, False),
                                         ("gq8", GlobalQSGD(bits=8), False),
                                         ("gq8_eager", GlobalQSGD(bits=8), True))}
        if rank == 0:
            out["none"]["ref"] = reference_fit(n, _lso, poison=True)
            out["clean_ref"] = reference_fit(n, _lso)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _lso_around_wrapper(rank: int) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model(rank)  # a mixed_float16 model under a float32 global policy
    keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    x, y = _data(rank)
    model.fit(x, y, epochs=1, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])


def _mixed_policy_plain() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        DistributedOptimizer(keras.optimizers.SGD(LR))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _built() -> None:
    opt = keras.optimizers.SGD(LR)
    opt.build(_model(0).trainable_variables)
    DistributedOptimizer(opt)


def refusals(rank: int) -> dict:
    """Misuse that must raise with a message naming the fix (same on every rank)."""
    return {
        "jit": _error(lambda: distributed_fit(rank, _wrapped(_sgd()), jit_compile=True)),
        "op": _error(lambda: DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Max)),
        "built": _error(_built),
        "mixed_plain": _error(_mixed_policy_plain),
        "lso_around": _error(lambda: _lso_around_wrapper(rank)),
        "not_keras": _error(lambda: DistributedOptimizer(object())),
        "multi": _error(lambda: DistributedOptimizer(keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(keras.optimizers.SGD(LR))))),
        "bpps_conflict": _error(lambda: DistributedOptimizer(
            keras.optimizers.SGD(LR, gradient_accumulation_steps=3), backward_passes_per_step=2)),
    }


def main() -> None:
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    results = {"size": n, "keras": keras.__version__, "tf_keras": tf.keras.__name__,
               "refusals": refusals(rank), "compressors": compressors(rank),
               "features": features(rank, n), "loss_scale": loss_scale(rank, n),
               "restored": restored(rank)}
    hvd.allreduce(tf.constant(0.0), name="keras3.barrier")
    with open(os.path.join(sys.argv[1], f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
