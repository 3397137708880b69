"""Issue 10's small-tensor goal in TensorFlow: step time of a 300-tensor model (150 dense
32x32 layers plus biases) with ``hvd.DistributedGradientTape`` in ``tf.function`` and
Horovod's **default arguments**, GlobalQSGD(bits=8) vs uncompressed, unthrottled loopback.

    horovodrun --gloo -np 2 -H localhost:2 python studies/small_tensors_tf.py

Prints the median step time of each and their ratio (goal: <= 1.5x); ``--num-groups 1`` adds
Horovod's grouped path for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_gqsgd import GlobalQSGD


def step_times(compression, steps: int, warmup: int, num_groups: int) -> list[float]:
    tf.random.set_seed(0)
    layers = [(tf.Variable(tf.random.normal([32, 32], stddev=0.2)), tf.Variable(tf.zeros([32])))
              for _ in range(150)]
    variables = [v for pair in layers for v in pair]
    x = tf.random.normal([16, 32])

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            h = x
            for w, b in layers:
                h = tf.tanh(h @ w + b)
            loss = tf.reduce_mean(tf.square(h))
        tape = hvd.DistributedGradientTape(tape, compression=compression,
                                           num_groups=num_groups)
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(1e-3 * g)
        return loss

    barrier = tf.zeros([1])
    times = []
    for i in range(warmup + steps):
        hvd.allreduce(barrier, name="sync")  # start every step together
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-groups", type=int, default=0,
                        help="also time GlobalQSGD with this num_groups (0: only defaults)")
    args = parser.parse_args()
    hvd.init()
    runs = [("none", hvd.Compression.none, 0), ("gqsgd8", GlobalQSGD(bits=8), 0)]
    if args.num_groups:
        runs.append((f"gqsgd8 num_groups={args.num_groups}", GlobalQSGD(bits=8),
                     args.num_groups))
    results: dict[str, list[float]] = {}
    for _ in range(2):  # interleave to even out machine noise
        for name, comp, groups in runs:
            results.setdefault(name, []).extend(step_times(comp, args.steps, args.warmup, groups))
    if hvd.rank() == 0:
        med = {k: statistics.median(v) for k, v in results.items()}
        rest = ", ".join(f"{k} {1e3 * v:.2f} ms/step ({v / med['none']:.2f}x)"
                         for k, v in med.items() if k != "none")
        print(f"TF, 300 tensors, {hvd.size()} ranks, DistributedGradientTape in tf.function: "
              f"none {1e3 * med['none']:.2f} ms/step, {rest} (goal for gqsgd8 <= 1.5x)")


if __name__ == "__main__":
    main()
