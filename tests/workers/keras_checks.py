"""Keras under Horovod with GlobalQSGD.  Run with TF_USE_LEGACY_KERAS=1 (tf_keras, Keras 2):
model.fit with horovod.tensorflow.keras.DistributedOptimizer, and a custom tape loop on a Keras
model.  Records losses and weights; tests/test_keras.py checks them."""

from __future__ import annotations

import os
import pickle
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

from gqsgd_lab.inputs import training_data
from hvd_gqsgd import GlobalQSGD
from hvd_gqsgd.tensorflow import tape_sources


def _model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.layers.Dense(16, activation="tanh", input_shape=(8,)),
                                tf.keras.layers.Dense(1)])


def fit(x, y) -> dict:
    out = {}
    for name, comp in (("none", hvd.Compression.none), ("gqsgd8", GlobalQSGD(bits=8))):
        model = _model()
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=comp)
        model.compile(optimizer=opt, loss="mse")
        hist = model.fit(x, y, batch_size=32, epochs=8, verbose=0, shuffle=False,
                         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
        out[name] = {"losses": hist.history["loss"], "weights": weights,
                     "rounds": getattr(comp, "stats", None) and comp.stats.rounds,
                     "tensors": getattr(comp, "stats", None) and comp.stats.tensors,
                     "variables": len(model.trainable_variables)}
    return out


def tape_loop(x, y) -> dict:
    model, comp = _model(), GlobalQSGD(bits=8)
    model(x[:1])
    opt = tf.keras.optimizers.SGD(0.05)
    hvd_tf = sys.modules["horovod.tensorflow"]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd_tf.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, tape_sources(model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return hvd_tf.allreduce(loss, name="loss")

    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    losses = [float(step()) for _ in range(100)]
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    return {"losses": losses, "weights": weights}


def main() -> None:
    hvd.init()
    x, y = training_data(hvd.rank(), 256)
    results = {"size": hvd.size(), "keras": tf.keras.__name__ if hasattr(tf.keras, "__name__")
               else str(tf.keras), "fit": fit(x, y), "tape_loop": tape_loop(x, y)}
    with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
