"""TensorFlow twin of benchmarks/train_worker.py (netbench.py launches both on emulated hosts).

The same communication-bound MLP (about 64 MB of fp32 gradient, small batch), trained with
``hvd.DistributedGradientTape`` in ``tf.function`` with Horovod's default arguments, one
compressor at a time.  Rank 0 prints one JSON line per compressor, named ``tf_train_<name>``:
the median step time of the slowest rank and the loss on a fixed held-out batch before and
after the steps (all compressors start from the same weights and see the same data).
"""

from __future__ import annotations

import json
import statistics
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from gqsgd_lab.bench_common import compressor, train_args


def mlp(width: int) -> list[tf.Variable]:
    init = tf.random.stateless_normal
    return [tf.Variable(init([width, 2 * width], seed=[0, 1]) / width**0.5),
            tf.Variable(tf.zeros([2 * width])),
            tf.Variable(init([2 * width, width], seed=[0, 2]) / (2 * width)**0.5),
            tf.Variable(tf.zeros([width]))]


def forward(params: list[tf.Variable], x: tf.Tensor) -> tf.Tensor:
    w1, b1, w2, b2 = params
    return tf.nn.relu(x @ w1 + b1) @ w2 + b2


def run(name: str, width: int, batch: int, steps: int) -> dict:
    params = mlp(width)
    comp = compressor(name, hvd)
    target = tf.random.stateless_normal([width, width], seed=[0, 3]) / width**0.5
    held_out = tf.random.stateless_normal([64, width], seed=[12345, 0])
    held_target = tf.tanh(held_out @ target)

    def held_out_loss() -> float:
        return float(tf.reduce_mean(tf.square(forward(params, held_out) - held_target)))

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        y = tf.tanh(x @ target)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(params, x) - y))
        grads = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, params)
        for p, g in zip(params, grads):
            p.assign_sub(0.5 * g)
        return loss

    loss_start, times = held_out_loss(), []
    barrier = tf.zeros([1])
    for i in range(steps + 1):
        x = tf.random.stateless_normal([batch, width], seed=[hvd.rank(), i])
        hvd.allreduce(barrier, name="barrier")
        start = time.perf_counter()
        step(x)
        if i:  # the first step traces and warms up (numba compilation, response cache)
            times.append(time.perf_counter() - start)
    slowest = hvd.allreduce(tf.constant(statistics.median(times)), op=hvd.Max,
                            name=f"t.{name}")
    grad_mb = sum(int(tf.size(p)) * 4 for p in params) / 2**20
    return {"what": f"tf_train_{name}", "median_s": float(slowest),
            "loss_start": loss_start, "loss_end": held_out_loss(),
            "grad_mb": grad_mb, "ranks": hvd.size()}


def main() -> None:
    args = train_args()
    hvd.init()
    for name in args.compressors.split(","):
        row = run(name, args.width, args.batch, args.steps)
        if hvd.rank() == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
