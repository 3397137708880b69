"""TensorFlow twin of benchmarks/deep_worker.py (benchmarks/deep_bench.py launches both).

The same deep MLP (``--depth`` x ``Linear(width, width)`` + Tanh, as plain variables: Keras 3
variables break Horovod's tape, see the README), trained with ``hvd.DistributedGradientTape``
in ``tf.function`` with Horovod's default arguments.  ``compute`` is the same step with a
plain ``tf.GradientTape``.  Rank 0 prints one JSON line per variant, named ``tf_deep_<name>``.
``process_cpu_s`` is the CPU a step of all the rank's threads together (TF's executor runs
the step on a pool, so there is no one model thread to single out as the PyTorch worker
does), averaged over the ranks: on one core per rank, a value near the step time says the
core, not the link, sets the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from gqsgd_lab.bench_common import compressor, deep_args


def layers(width: int, depth: int) -> list[tf.Variable]:
    out = []
    for i in range(depth):
        out += [tf.Variable(tf.random.stateless_uniform([width, width], seed=[0, i],
                                                        minval=-1, maxval=1) / width**0.5),
                tf.Variable(tf.zeros([width]))]
    return out


def forward(params: list[tf.Variable], x: tf.Tensor) -> tf.Tensor:
    for w, b in zip(params[::2], params[1::2]):
        x = tf.tanh(x @ w + b)
    return x


def run(name: str, args: argparse.Namespace) -> dict:
    params = layers(args.width, args.depth)
    comp = None if name == "compute" else compressor(name, hvd)
    held_out = tf.random.stateless_normal([64, args.width], seed=[12345, 0])

    def target(x: tf.Tensor) -> tf.Tensor:
        return tf.sin(tf.roll(x, 1, axis=1))

    def held_out_loss() -> float:
        return float(tf.reduce_mean(tf.square(forward(params, held_out) - target(held_out))))

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(forward(params, x) - target(x)))
        if comp is not None:
            tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, params)
        for p, g in zip(params, grads):
            p.assign_sub(args.lr * g)
        return loss

    loss_start, times, cpu = held_out_loss(), [], 0.0
    barrier = tf.zeros([1])
    for i in range(args.steps + 1):
        x = tf.random.stateless_normal([args.batch, args.width], seed=[hvd.rank(), i])
        hvd.allreduce(barrier, name="barrier")
        start, cpu_start = time.perf_counter(), time.process_time()
        step(x)
        if i:  # the first step traces and warms up
            times.append(time.perf_counter() - start)
            cpu += (time.process_time() - cpu_start) / args.steps
    slowest = hvd.allreduce(tf.constant(statistics.median(times)), op=hvd.Max,
                            name=f"t.{name}")
    cpu = hvd.allreduce(tf.constant(cpu, tf.float64), name=f"c.{name}")  # mean over ranks
    return {"what": f"tf_deep_{name}", "median_s": float(slowest), "loss_start": loss_start,
            "process_cpu_s": float(cpu), "loss_end": held_out_loss(), "ranks": hvd.size(),
            "grad_mb": sum(int(tf.size(p)) * 4 for p in params) / 2**20,
            "tensors": len(params)}


def main() -> None:
    args = deep_args("compute,none,fp16,gqsgd8,gqsgd8b0k")
    hvd.init()
    for name in args.compressors.split(","):
        row = run(name, args)
        if hvd.rank() == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
