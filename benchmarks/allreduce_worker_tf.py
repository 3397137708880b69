"""TensorFlow twin of benchmarks/allreduce_worker.py (netbench.py launches both).

Times ``hvd.allreduce`` of one fp32 gradient inside ``tf.function`` (the way Horovod's
``DistributedGradientTape`` and Keras optimizers call it), default op (Average), per
compressor, plus ``latency`` (a 1-element allreduce) and ``local`` (the same GlobalQSGD
allreduce on a process set of this rank alone).  Rank 0 prints one JSON line per
measurement, named ``tf_<what>``: the median over repeats of the slowest rank.
"""

from __future__ import annotations

import json
import statistics
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from gqsgd_lab.bench_common import allreduce_args, compressor, hvd_size_from_env


def reducer(x: tf.Tensor, comp, name: str, process_set=None):
    """A tf.function that allreduces ``x`` (as Horovod's tape does, in a graph).  ``name``
    becomes a TF name scope, which allows no ``@`` (as in ``gqsgd8@1024k``)."""
    name = name.replace("@", "_at_")
    pset = process_set if process_set is not None else hvd.global_process_set

    @tf.function
    def run() -> tf.Tensor:
        return hvd.allreduce(x, compression=comp, name=name, process_set=pset)

    return run


def timed(fn, repeats: int, name: str) -> float:
    times = []
    barrier = tf.zeros([1])
    for i in range(repeats + 1):
        hvd.allreduce(barrier, name="barrier")
        start = time.perf_counter()
        fn()
        if i:  # the first run traces and warms up (numba compilation, response cache)
            times.append(time.perf_counter() - start)
    slowest = hvd.allreduce(tf.constant(statistics.median(times)), op=hvd.Max,
                            name=f"t.{name}".replace("@", "_at_"))
    return float(slowest)


def main() -> None:
    args = allreduce_args()
    alone = [hvd.ProcessSet([r]) for r in range(hvd_size_from_env())]
    hvd.init(process_sets=alone)
    tf.random.set_seed(hvd.rank())
    x = tf.random.normal([int(args.mb * 2**20) // 4])
    rows = {"latency": timed(reducer(tf.zeros([1]), hvd.Compression.none, "lat"),
                             args.repeats, "latency")}
    for name in args.compressors.split(","):
        rows[name] = timed(reducer(x, compressor(name, hvd), f"b.{name}"), args.repeats, name)
        if name.startswith("gqsgd"):
            mine = alone[hvd.rank()]
            rows[f"local_{name}"] = timed(
                reducer(x, compressor(name, hvd, process_set=mine), f"l.{name}", mine),
                args.repeats, f"local_{name}")
    if hvd.rank() == 0:
        for name, seconds in rows.items():
            print(json.dumps({"what": f"tf_{name}", "mb": args.mb, "ranks": hvd.size(),
                              "median_s": seconds}), flush=True)


if __name__ == "__main__":
    main()
