"""TensorFlow twin of torch_checks.py: runs on every rank, records what real Horovod TF
collectives returned under the same keys, so tests/test_multiproc.py checks both frameworks
with one simulation.  Default Keras here is Keras 3 (TF 2.21's tf.keras)."""

from __future__ import annotations

import functools
import os
import pickle
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from gqsgd_lab.inputs import (
    GRID_CASES,
    block_grid_input,
    grid_input,
    random_input,
    training_data,
)
from hvd_gqsgd import GlobalQSGD as _GlobalQSGD
from hvd_gqsgd import QSGDAllgather, core
from hvd_gqsgd.tensorflow import TensorFlowBackend, tape_sources

# These scenarios test flat Global-QSGD, whose levels the test's simulation assumes at every
# bits, without a rotation; the defaults would pick two-stage below 15 levels
# (tests/workers/two_stage_checks.py covers that) and rotate at 4 bits
# (the rotation scenario of tests/workers/two_stage_checks.py covers that).
GlobalQSGD = functools.partial(_GlobalQSGD, two_stage=False, rotation=None)

OPS = {"sum": hvd.Sum, "average": hvd.Average}


def _np(t) -> np.ndarray:
    a = np.asarray(t.numpy())
    return a.astype(np.float64) if t.dtype.is_floating else a


def _dtype(name: str):
    return getattr(tf, name)


def packed_extremes(rank: int, n: int) -> dict:
    backend, out = TensorFlowBackend(seed=0), {}
    for bits in range(core.MIN_BITS, core.MAX_BITS + 1):
        if core.min_bits(n) > bits:
            continue
        level = core.levels(bits, n)
        for pattern in ("all_max", "all_min", "random"):
            codes = {"all_max": np.full(37, level), "all_min": np.full(37, -level),
                     "random": np.random.default_rng([bits, rank]).integers(-level, level + 1, 37)
                     }[pattern]
            words = core.pack(backend, tf.constant(codes, tf.int64), bits)
            summed = hvd.allreduce(words, op=hvd.Sum, name=f"pk.{bits}.{pattern}")
            out[(bits, pattern)] = core.unpack(backend, summed, bits, codes.size).numpy()
    return out


def grid_exact(rank: int, n: int) -> dict:
    out = {}
    for bits, dtype_name, op in GRID_CASES:
        x = tf.constant(grid_input(rank, n, bits), dtype=_dtype(dtype_name))
        y = hvd.allreduce(x, op=OPS[op], compression=GlobalQSGD(bits=bits))
        out[(bits, dtype_name, op)] = (y.dtype.name, _np(y))
    return out


def random_bounds(rank: int, n: int) -> dict:
    out = {}
    for norm in ("max", "l2"):
        for op in ("sum", "average"):
            comp = GlobalQSGD(bits=8, norm=norm)
            x = tf.constant(random_input(rank, 1000), tf.float32)
            y = hvd.allreduce(x, op=OPS[op], compression=comp)
            out[(norm, op)] = (_np(y), comp.stats.as_dict())
    return out


def unbiased(rank: int, n: int, trials: int = 300) -> dict:
    comp = GlobalQSGD(bits=4)
    x = tf.constant(random_input(rank, 256), tf.float32)

    @tf.function
    def step(x):  # traced once; the noise generator advances on every call
        return tf.cast(hvd.allreduce(x, op=hvd.Sum, compression=comp), tf.float64)

    acc = np.zeros(256)
    for _ in range(trials):
        acc += step(x).numpy()
    return {"mean": acc / trials, "trials": trials}


def independent_noise(rank: int, n: int) -> dict:
    tf.random.set_seed(1234)
    expected_draw = tf.random.uniform([4]).numpy()
    tf.random.set_seed(1234)
    level = core.levels(8, n)
    x = np.full(8192, 0.5 / level, dtype=np.float32)
    x[0] = 1.0
    # one scale for the whole tensor (x[0]): every other element then sits halfway between
    # two levels; with 1024-element blocks, blocks without x[0] would be exact
    y = hvd.allreduce(tf.constant(x), op=hvd.Sum, compression=GlobalQSGD(bits=8, scale_block=0))
    untouched = bool(np.array_equal(expected_draw, tf.random.uniform([4]).numpy()))
    return {"sum": _np(y), "global_rng_untouched": untouched}


def qsgd_baseline(rank: int, n: int) -> dict:
    x = tf.constant(random_input(rank, 1000), tf.float32)
    return {op: _np(hvd.allreduce(x, op=OPS[op], compression=QSGDAllgather(bits=8)))
            for op in ("sum", "average")}


def seeded(rank: int, n: int) -> dict:
    x = tf.constant(random_input(rank, 500), tf.float32)
    a = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=4, seed=99))
    b = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=4, seed=99))
    c = hvd.allreduce(x, op=hvd.Sum, compression=GlobalQSGD(bits=4, seed=100))
    return {"a": _np(a), "b": _np(b), "c": _np(c)}


def bad_inputs(rank: int, n: int) -> dict:
    comp, out = GlobalQSGD(bits=8), {}
    ints = tf.range(10, dtype=tf.int32) * (rank + 1)
    out["int32"] = _np(hvd.allreduce(ints, op=hvd.Sum, compression=comp))
    for dtype in ("float16", "bfloat16", "float64"):
        x = tf.constant(random_input(rank, 64), dtype=_dtype(dtype))
        y = hvd.allreduce(x, op=hvd.Sum, compression=comp)
        out[dtype] = (y.dtype.name, _np(y))
    out["zeros"] = _np(hvd.allreduce(tf.zeros([33]), op=hvd.Average, compression=comp))
    out["empty"] = tuple(hvd.allreduce(tf.zeros([0, 3]), op=hvd.Sum, compression=comp).shape)
    zero_d = hvd.allreduce(tf.constant(float(rank + 1)), op=hvd.Sum, compression=comp)
    out["zero_d"] = (tuple(zero_d.shape), float(zero_d))
    base = tf.reshape(tf.constant(random_input(rank, 60), tf.float32), [6, 10])
    out["noncontig"] = (_np(base), _np(hvd.allreduce(tf.transpose(base), op=hvd.Sum,
                                                     compression=comp)))
    for bad in ("nan", "inf"):
        x = np.ones(20, dtype=np.float32)
        if rank == n - 1:
            x[3] = float(bad)
        out[bad] = _np(hvd.allreduce(tf.constant(x), op=hvd.Average, compression=comp))
    # a NaN in one tensor of a batch must not leak into the others packed beside it
    x = np.ones(21, dtype=np.float32)
    if rank == n - 1:
        x[16] = np.nan  # lane 0 of the word shared with the next tensor
    clean = random_input(rank, 30).astype(np.float32)
    pair = hvd.grouped_allreduce([tf.constant(x), tf.constant(clean)], op=hvd.Sum,
                                 compression=GlobalQSGD(bits=8))
    out["nan_neighbour"] = (_np(pair[0]), _np(pair[1]))
    return out


def errors(rank: int, n: int) -> dict:
    out = {}
    # Horovod's MPI Adasum aborts the whole job (MPI_Group_incl) at non-power-of-2 sizes
    # before its Python side can refuse, so only try it where Horovod can run it.
    adasum = ["Adasum"] if n & (n - 1) == 0 else []
    for op_name in ["Min", "Max", *adasum]:
        try:
            hvd.allreduce(tf.ones([8]) * (rank + 1), op=getattr(hvd, op_name),
                          compression=GlobalQSGD(bits=8))
            out[op_name] = "no error"
        except ValueError as e:
            out[op_name] = f"ValueError: {e}"
        except Exception as e:  # recorded; the test accepts only what it expects
            out[op_name] = f"{type(e).__name__}: {e}"
    try:
        hvd.allreduce(tf.ones([8]), op=hvd.Sum, compression=GlobalQSGD(bits=2))
        out["bits2"] = "no error"
    except ValueError as e:
        out["bits2"] = f"ValueError: {e}"

    comp = GlobalQSGD(bits=8)  # built outside, first used inside the trace

    @tf.function
    def traced_min(x):
        return hvd.allreduce(x, op=hvd.Min, compression=comp)

    try:
        traced_min(tf.ones([8]))
        out["traced_min"] = "no error"
    except Exception as e:  # a graph op fails with a TF error carrying our message
        out["traced_min"] = f"{type(e).__name__}: {e}"
    return out


def _model():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    model(tf.zeros([1, 8]))
    return model


def _sources(model):
    return tape_sources(model.trainable_variables)


def optimizer_grads(rank: int, n: int) -> dict:
    """DistributedGradientTape, eagerly and in tf.function: local grads in, reduced out."""
    x, y = (tf.constant(a) for a in training_data(rank, 64))
    configs = {"average": {}, "sum": {"op": hvd.Sum}, "predivide": {
        "gradient_predivide_factor": 2.0}, "groups": {"num_groups": 1},
        "bucketed": {}, "sum-bucketed": {"op": hvd.Sum}}
    out = {}
    for mode in ("eager", "function"):
        for name, kwargs in configs.items():
            model = _model()
            # 4 gradients of 512, 64, 64 and 4 bytes: in tf.function, 60-byte buckets make
            # 3 grouped calls (hvd_gqsgd.tensorflow.buckets), eagerly still one
            comp = GlobalQSGD(bits=8, bucket_bytes=60 if "bucketed" in name else None)

            def grads(model=model, comp=comp, kwargs=kwargs):
                with tf.GradientTape(persistent=True) as tape:
                    loss = tf.reduce_mean((model(x) - y) ** 2)
                local = tape.gradient(loss, _sources(model))
                dtape = hvd.DistributedGradientTape(tape, compression=comp, **kwargs)
                return local, dtape.gradient(loss, _sources(model))

            local, reduced = grads() if mode == "eager" else tf.function(grads)()
            out[f"{name}-{mode}"] = {"local": [_np(g) for g in local],
                                     "reduced": [_np(g) for g in reduced],
                                     "rounds": comp.stats.rounds, "tensors": comp.stats.tensors}
    return out


def training(rank: int, n: int, steps: int = 150) -> dict:
    """The tape in a tf.function, the tape eagerly, and horovod.tensorflow's
    DistributedOptimizer around a tf.compat.v1 optimizer; uncompressed as the reference."""
    x, y = (tf.constant(a) for a in training_data(rank, 256))
    runs = [("none", "function", hvd.Compression.none), ("gqsgd8", "function", GlobalQSGD(8)),
            ("gqsgd8_eager", "eager", GlobalQSGD(8)), ("gqsgd8_v1opt", "v1", GlobalQSGD(8))]
    out = {}
    for name, mode, comp in runs:
        model = _model()
        step = _v1_step(model, x, y, comp) if mode == "v1" else _tape_step(model, x, y, comp)
        if mode == "function":
            step = tf.function(step)
        losses = [float(step()) for _ in range(steps)]
        params = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])
        out[name] = {"losses": losses, "params": params.astype(np.float64)}
    return out


def _tape_step(model, x, y, comp):
    opt = tf.keras.optimizers.SGD(0.05)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, _sources(model))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return hvd.allreduce(loss, name="loss")

    return step


def _v1_step(model, x, y, comp):
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                                   compression=comp)

    @tf.function
    def step():
        loss = lambda: tf.reduce_mean((model(x) - y) ** 2)  # noqa: E731
        opt.minimize(loss, var_list=_sources(model))
        return hvd.allreduce(loss(), name="loss")

    return step


def keras3_fit(rank: int, n: int) -> dict:
    """Canary for the docs: Horovod 0.28.1's Keras optimizer under Keras 3."""
    import horovod.tensorflow.keras as hvd_keras

    x, y = training_data(rank, 64)
    model, comp = _model(), GlobalQSGD(bits=8)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05),
                                                           compression=comp), loss="mse")
    model.fit(x, y, epochs=2, verbose=0)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    return {"keras": tf.keras.__name__, "rounds": comp.stats.rounds, "weights": weights}


def process_set(rank: int, n: int, members: list[int]) -> dict:
    if rank not in members:
        return {"member": False}
    ps = PROCESS_SETS[0]
    x = tf.constant(grid_input(rank, len(members), 8), tf.float32)
    y = hvd.allreduce(x, op=hvd.Sum, process_set=ps,
                      compression=GlobalQSGD(bits=8, process_set=ps))
    return {"member": True, "sum": _np(y)}


def chunked(rank: int, n: int) -> dict:
    """Tensors sent in chunks smaller than themselves (chunk_bytes of 2-3 words); the
    Average case runs inside tf.function."""
    grids = [tf.constant(grid_input(rank, n, 8, numel), tf.float32) for numel in CHUNKED_NUMELS]
    comp = GlobalQSGD(bits=8, chunk_bytes=16)
    exact = [_np(t) for t in hvd.grouped_allreduce(grids, op=hvd.Sum, compression=comp)]
    rand = [tf.constant(random_input(rank, numel), tf.float32) for numel in CHUNKED_NUMELS]
    comp4 = GlobalQSGD(bits=4, chunk_bytes=24)

    @tf.function
    def mean_of(xs):
        return hvd.grouped_allreduce(xs, op=hvd.Average, compression=comp4)

    mean = [_np(t) for t in mean_of(rand)]
    return {"exact": exact, "mean": mean, "stats": comp.stats.as_dict()}


def blocked(rank: int, n: int) -> dict:
    """One global scale per 16 elements (scale_block), in chunks that cut blocks."""
    xs = [tf.constant(block_grid_input(rank, n, 8, numel, 16), tf.float32)
          for numel in (70, 45)]
    comp = GlobalQSGD(bits=8, scale_block=16, chunk_bytes=16)
    exact = [_np(t) for t in hvd.grouped_allreduce(xs, op=hvd.Sum, compression=comp)]
    piped = GlobalQSGD(bits=8, scale_block=16, chunk_bytes=16)

    @tf.function
    def summed(ts):  # in a graph each chunk is unpacked on its own (tensorflow._Words)
        return hvd.grouped_allreduce(ts, op=hvd.Sum, compression=piped)

    graph = [_np(t) for t in summed(xs)]
    return {"exact": exact, "graph": graph, "stats": comp.stats.as_dict()}


CHUNKED_NUMELS = (70, 200, 45)
SCENARIOS = [packed_extremes, grid_exact, random_bounds, unbiased, independent_noise, seeded,
             bad_inputs, errors, optimizer_grads, training, qsgd_baseline, keras3_fit, chunked,
             blocked]
PROCESS_SETS: list = []


def main() -> None:
    out_dir = sys.argv[1]
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("HOROVOD_SIZE") or 1)
    members = list(range(0, world, 2))
    PROCESS_SETS.append(hvd.ProcessSet(members))
    hvd.init(process_sets=PROCESS_SETS)
    rank, n = hvd.rank(), hvd.size()
    results = {"size": n, "framework": "tensorflow"}
    for scenario in SCENARIOS:
        results[scenario.__name__] = scenario(rank, n)
    results["process_set"] = process_set(rank, n, members)
    hvd.allreduce(tf.constant(0.0), name="barrier")  # non-members wait for the set to finish
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
