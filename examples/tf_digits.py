"""Train a small Keras MLP on sklearn's handwritten digits with Horovod's TensorFlow binding,
uncompressed and with GlobalQSGD(bits=8), in a tf.function training step, and print the
comparison.

    horovodrun --gloo -np 2 -H localhost:2 python examples/tf_digits.py

Works with Keras 3 (TF 2.21's default) and with legacy Keras (TF_USE_LEGACY_KERAS=1): the tape
is given ``tape_sources(model.trainable_variables)``, the tf.Variables under the Keras
variables, which Horovod's DistributedGradientTape needs under Keras 3.  More compressors and
seeds, with loss curves::

    horovodrun --gloo -np 2 -H localhost:2 python examples/tf_digits.py \\
        --variants none,fp16,gq8,gq4 --seeds 0,1,2 --csv digits_tf.csv --png digits_tf.png

``--fit`` trains with Keras 3 ``model.compile`` + ``model.fit`` instead of the tape loop:
the optimizer is ``hvd_gqsgd.keras.DistributedOptimizer`` (Horovod's own Keras optimizer never
reduces under Keras 3), which reduces all gradients of a step in one round::

    horovodrun --gloo -np 2 -H localhost:2 python examples/tf_digits.py --fit

Every compressor trains from the same initial weights and sees the same batches for a given
seed, with identical hyper-parameters.  This script never imports horovod.torch.
"""

from __future__ import annotations

import argparse
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from _common import (
    add_common_args,
    build_compressor,
    make_progress,
    parse_variants,
    print_table,
    rank_seed,
    say,
    seeds_of,
    settings_of,
    write_outputs,
)
from sklearn.datasets import load_digits

from hvd_gqsgd import GlobalQSGD, core
from hvd_gqsgd.tensorflow import tape_sources

N_TEST = 360


def shard(rank: int, size: int):
    """(x_train, y_train) of this rank, (x_test, y_test) shared; equal-length shards, so all
    ranks take the same number of steps."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:N_TEST], order[N_TEST:]
    mine = train[rank::size][:len(train) // size]
    return x[mine], y[mine], x[test], y[test]


def build_model(seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(256, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model(tf.zeros([1, 64]))
    return model


def keras_name() -> str:
    if tf.keras.__name__.startswith("tf_keras"):
        import tf_keras

        return f"legacy Keras {tf_keras.__version__} (TF_USE_LEGACY_KERAS=1)"
    return f"Keras {tf.keras.__version__}"


def log_point(step: int, train_loss: float | None, model, loss_fn, xte, yte) -> dict:
    logits = model(xte)
    return {"step": step, "train_loss": train_loss, "test_loss": float(loss_fn(yte, logits)),
            "test_acc": float(np.mean(np.argmax(logits.numpy(), 1) == yte))}


def mean_over_ranks(total: float, count: int) -> float:
    """COLLECTIVE: the mean training loss of an epoch over all ranks' batches."""
    summed = hvd.allreduce(tf.constant([total, count], tf.float64), op=hvd.Sum,
                           name="digits.train_loss").numpy()
    return float(summed[0] / summed[1])


def wire_bytes(compression, numels: list[int]) -> float:
    """Gradient bytes one rank sends per step.  GlobalQSGD.stats counts traced rounds inside
    tf.function, not executed steps, so count them here: the tape reduces each tensor in its
    own round (codes, scale exchange, probe)."""
    if isinstance(compression, GlobalQSGD):
        bits, block = compression.settings.bits, compression.settings.scale_block
        return sum(core.wire_bytes(m, bits) + core.PROBE_BYTES
                   + core.scale_exchange_bytes(len(core.segments([m], block)[0]))
                   for m in numels)
    return (2 if compression is hvd.Compression.fp16 else 4) * sum(numels)


def fit_wire_bytes(compression, numels: list[int]) -> float:
    """Gradient bytes one rank sends per step in --fit mode: one round for all tensors.
    GlobalQSGD.stats describes the traced round; its byte figures depend on shapes only."""
    if isinstance(compression, GlobalQSGD):
        return float(compression.stats.last_payload + compression.stats.last_overhead)
    return (2 if compression is hvd.Compression.fp16 else 4) * sum(numels)


class _Progress(tf.keras.callbacks.Callback):
    def __init__(self, bar) -> None:
        super().__init__()
        self.bar = bar

    def on_train_batch_end(self, batch, logs=None):
        self.bar.update()


def train_fit(variant, seed: int, data, args, bar) -> dict:
    """Keras 3 model.fit, one fit call per epoch on this rank's permuted rows (the same
    batches as the tape loop)."""
    from hvd_gqsgd.keras import (
        BroadcastGlobalVariablesCallback,
        DistributedOptimizer,
        MetricAverageCallback,
    )

    xtr, ytr, xte, yte = data
    model = build_model(seed)
    compression = build_compressor(variant, hvd, seed)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=DistributedOptimizer(tf.keras.optimizers.SGD(args.lr, momentum=0.9),
                                                 compression=compression), loss=loss_fn)
    callbacks = [BroadcastGlobalVariablesCallback(0), MetricAverageCallback(), _Progress(bar)]
    rng = np.random.default_rng(rank_seed(seed, hvd.rank()))
    curve = [log_point(0, None, model, loss_fn, xte, yte)]
    steps, start = 0, time.perf_counter()
    for _ in range(args.epochs):
        perm = rng.permutation(len(xtr))
        perm = perm[:len(perm) - len(perm) % args.batch]  # whole batches, as the loop takes
        hist = model.fit(xtr[perm], ytr[perm], batch_size=args.batch, epochs=1, verbose=0,
                         shuffle=False, callbacks=callbacks)
        steps += len(perm) // args.batch
        curve.append(log_point(steps, hist.history["loss"][-1], model, loss_fn, xte, yte))
        bar.set_postfix_str(f"test loss {curve[-1]['test_loss']:.3f}")
    wall = time.perf_counter() - start
    numels = [int(np.prod(v.shape)) for v in model.trainable_variables]
    wire = fit_wire_bytes(compression, numels)
    return {"spec": variant.spec, "label": variant.label, "seed": seed, "steps": steps,
            "test_acc": curve[-1]["test_acc"], "test_loss": curve[-1]["test_loss"],
            "bytes_per_step": wire, "bytes_vs_fp32": 4 * sum(numels) / wire, "wall_s": wall,
            "curve": curve}


def train(variant, seed: int, data, args, bar) -> dict:
    xtr, ytr, xte, yte = data
    model = build_model(seed)
    tf_vars = tape_sources(model.trainable_variables)  # Keras 3 variables -> tf.Variable
    hvd.broadcast_variables(tf_vars, root_rank=0)
    compression = build_compressor(variant, hvd, seed)
    opt = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, tf_vars)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(rank_seed(seed, hvd.rank()))
    curve = [log_point(0, None, model, loss_fn, xte, yte)]
    steps, start = 0, time.perf_counter()
    for _ in range(args.epochs):
        perm = rng.permutation(len(xtr))
        total = 0.0
        for i in range(0, len(perm) - args.batch + 1, args.batch):
            idx = perm[i:i + args.batch]
            total += float(step(tf.constant(xtr[idx]), tf.constant(ytr[idx])))
            steps += 1
            bar.update()
        epoch_steps = steps - curve[-1]["step"]
        curve.append(log_point(steps, mean_over_ranks(total, epoch_steps), model, loss_fn,
                               xte, yte))
        bar.set_postfix_str(f"test loss {curve[-1]['test_loss']:.3f}")
    wall = time.perf_counter() - start
    numels = [int(np.prod(v.shape)) for v in tf_vars]
    wire = wire_bytes(compression, numels)
    return {"spec": variant.spec, "label": variant.label, "seed": seed, "steps": steps,
            "test_acc": curve[-1]["test_acc"], "test_loss": curve[-1]["test_loss"],
            "bytes_per_step": wire, "bytes_vs_fp32": 4 * sum(numels) / wire, "wall_s": wall,
            "curve": curve}


COLUMNS = [("test acc", "test_acc", ".4f", 10, ""), ("test loss", "test_loss", ".4f", 11, ""),
           ("bytes/step", "bytes_per_step", ",.0f", 12, ""),
           ("vs fp32", "bytes_vs_fp32", ".2f", 9, "x"), ("wall s", "wall_s", ".2f", 8, "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--bits", type=int, default=8,
                        help="GlobalQSGD bits of the default comparison (--variants none,gq8)")
    parser.add_argument("--fit", action="store_true",
                        help="train with Keras 3 model.fit and hvd_gqsgd.keras."
                             "DistributedOptimizer instead of a DistributedGradientTape loop")
    add_common_args(parser, default_variants=None, variants_help="none,gq<--bits>")
    args = parser.parse_args()
    variants = parse_variants(args.variants or f"none,gq{args.bits}")
    if args.fit and tf.keras.__name__.startswith("tf_keras"):
        parser.error("--fit needs Keras 3 (hvd_gqsgd.keras); under TF_USE_LEGACY_KERAS=1 use "
                     "horovod.tensorflow.keras.DistributedOptimizer, or drop --fit")
    hvd.init()
    data = shard(hvd.rank(), hvd.size())
    jobs = [(seed, v) for seed in seeds_of(args.seeds) for v in variants]
    bar = make_progress(len(jobs) * args.epochs * (len(data[0]) // args.batch), hvd.rank(),
                        args.progress)
    runs = []
    for k, (seed, variant) in enumerate(jobs, 1):
        bar.set_description_str(f"{variant.label} seed {seed}")
        runs.append((train_fit if args.fit else train)(variant, seed, data, args, bar))
        if hvd.rank() == 0:
            r = runs[-1]
            say(bar, f"run {k}/{len(jobs)}: {r['label']}, seed {seed}: test acc "
                     f"{r['test_acc']:.4f}, test loss {r['test_loss']:.4f} ({r['wall_s']:.1f} s)")
    bar.close()
    if hvd.rank() == 0:
        mode = "model.fit" if args.fit else "tape loop"
        print(f"\nhvd_gqsgd TF2 example: digits MLP, {hvd.size()} ranks, {args.epochs} epochs, "
              f"{runs[0]['steps']} steps per run, {keras_name()}, {mode}")
        print_table(runs, COLUMNS)
        if len(seeds_of(args.seeds)) > 1:
            print("(mean±std over seeds; test acc/loss on the 360 held-out digits)")
        write_outputs(args, {"experiment": "digits_tf", "world_size": hvd.size(),
                             "title": f"TensorFlow MLP on sklearn digits, {hvd.size()} ranks, "
                                      f"{keras_name()}",
                             "metric": "test_loss", "settings": settings_of(args),
                             "runs": runs}, ylabel="test loss (360 held-out digits)")


if __name__ == "__main__":
    main()
