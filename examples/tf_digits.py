"""Train a small Keras MLP on sklearn's handwritten digits with Horovod's TensorFlow binding,
uncompressed and with GlobalQSGD(bits=8), in a tf.function training step, and print the
comparison.

    horovodrun --gloo -np 2 -H localhost:2 python examples/tf_digits.py

Works with Keras 3 (TF 2.21's default) and with legacy Keras (TF_USE_LEGACY_KERAS=1): the tape
is given ``tape_sources(model.trainable_variables)``, the tf.Variables under the Keras
variables, which Horovod's DistributedGradientTape needs under Keras 3.
"""

from __future__ import annotations

import argparse
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

from hvd_gqsgd import GlobalQSGD, core
from hvd_gqsgd.tensorflow import tape_sources


def shard(rank: int, size: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:360], order[360:]
    mine = train[rank::size]
    return x[mine], y[mine], x[test], y[test]


def build_model() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model(tf.zeros([1, 64]))
    return model


def train(compression, data, epochs: int, batch: int) -> dict:
    xtr, ytr, xte, yte = data
    model = build_model()
    tf_vars = tape_sources(model.trainable_variables)  # Keras 3 variables -> tf.Variable
    hvd.broadcast_variables(tf_vars, root_rank=0)
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, tf_vars)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(hvd.rank())
    steps, start = 0, time.perf_counter()
    for _ in range(epochs):
        perm = rng.permutation(len(xtr))
        for i in range(0, len(perm) - batch + 1, batch):
            idx = perm[i:i + batch]
            step(tf.constant(xtr[idx]), tf.constant(ytr[idx]))
            steps += 1
    wall = time.perf_counter() - start
    logits = model(xte)
    loss = float(loss_fn(yte, logits))
    acc = float(np.mean(np.argmax(logits.numpy(), 1) == yte))
    numels = [int(np.prod(v.shape)) for v in tf_vars]
    wire = 4 * sum(numels)
    if isinstance(compression, GlobalQSGD):
        # compression.stats counts traced rounds inside tf.function, not executed steps, so
        # count one step's bytes directly: the tape reduces each tensor in its own round.
        bits = compression.settings.bits
        wire = sum(core.wire_bytes(m, bits) + core.scale_exchange_bytes(1) + core.PROBE_BYTES
                   for m in numels)
    return {"acc": acc, "loss": loss, "wire": wire, "wall": wall, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bits", type=int, default=8)
    args = parser.parse_args()
    hvd.init()
    data = shard(hvd.rank(), hvd.size())
    runs = {
        "fp32 (none)": train(hvd.Compression.none, data, args.epochs, args.batch),
        f"GlobalQSGD({args.bits})": train(GlobalQSGD(bits=args.bits), data, args.epochs,
                                          args.batch),
    }
    if hvd.rank() == 0:
        base = runs["fp32 (none)"]
        print(f"\nhvd_gqsgd TF2 example: digits MLP, {hvd.size()} ranks, {args.epochs} epochs, "
              f"{base['steps']} steps per run, Keras {tf.keras.__name__}")
        print(f"{'run':<16}{'test acc':>10}{'test loss':>11}{'bytes/step':>12}"
              f"{'vs fp32':>9}{'wall s':>8}")
        for name, r in runs.items():
            print(f"{name:<16}{r['acc']:>10.4f}{r['loss']:>11.4f}{r['wire']:>12,.0f}"
                  f"{base['wire'] / r['wire']:>8.2f}x{r['wall']:>8.2f}")


if __name__ == "__main__":
    main()
