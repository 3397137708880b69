"""Two-stage GlobalQSGD through real Horovod collectives, on every rank of a horovodrun or
mpirun job: ``two_stage_checks.py OUT_DIR torch|tf``.  Each scenario records what the ranks
got under a key of ``rank{r}.pkl``; tests/test_two_stage_multiproc.py compares it with
gqsgd_lab/two_stage_oracle.py.  Inputs come from gqsgd_lab/inputs.py.  No checking happens here.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
from contextlib import contextmanager

import numpy as np

from gqsgd_lab.inputs import TWO_STAGE_NUMELS, TWO_STAGE_SEED, two_stage_input
from hvd_gqsgd import GlobalQSGD as _GlobalQSGD
from hvd_gqsgd import core

# Two-stage as the oracle simulates it: no rotation (the default rotates at 4 bits;
# the rotation scenario below covers two-stage with it)
GlobalQSGD = functools.partial(_GlobalQSGD, rotation=None)

FRAMEWORK = sys.argv[2]
if FRAMEWORK == "torch":
    import horovod.torch as hvd
    import torch
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

ORACLE_CASES = [(bits, op, kind) for bits in (4, 8) for op in ("sum", "average")
                for kind in ("random", "extremes")]
OPS = {"sum": hvd.Sum, "average": hvd.Average}
UNBIASED_ROUNDS = 24


def _split(flat: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(TWO_STAGE_NUMELS)[:-1])


def _reduce(compression, xs, op, graph=False, process_set=None):
    """One grouped allreduce of the tensors ``xs`` (NumPy); the results as one float64 array."""
    pset = process_set or hvd.global_process_set
    if FRAMEWORK == "torch":
        out = hvd.grouped_allreduce([torch.from_numpy(x) for x in xs], op=op,
                                    compression=compression, process_set=pset)
        return np.concatenate([o.double().numpy() for o in out])

    def run(ts):
        return hvd.grouped_allreduce(ts, op=op, compression=compression, process_set=pset)

    if graph:
        run = tf.function(run)
    out = run([tf.constant(x) for x in xs])
    return np.concatenate([o.numpy().astype(np.float64) for o in out])


def lane_extremes(rank: int, n: int) -> dict:
    """Stage-1 words at every bits' lane width, codes all +L1 / all -L1 / random, summed by
    Horovod's reduce-scatter: the shards' lane sums, unpacked."""
    from gqsgd_lab.numpy_ops import NumpyOps

    ops, out = NumpyOps(), {}
    for bits in range(core.MIN_BITS, core.MAX_BITS + 1):
        w, level = core.two_stage_bits(bits, n), core.two_stage_levels(bits, n)
        numel = n * 3 * core.lanes_per_word(w)  # 3 words per shard
        for pattern in ("all_max", "all_min", "random"):
            codes = {"all_max": np.full(numel, level), "all_min": np.full(numel, -level),
                     "random": np.random.default_rng([bits, rank]).integers(-level, level + 1,
                                                                            numel)}[pattern]
            words = core.pack(ops, codes.astype(np.int64), w)
            name = f"ts.lanes.{bits}.{pattern}"
            if FRAMEWORK == "torch":
                shard = hvd.reducescatter(torch.from_numpy(words), op=hvd.Sum, name=name).numpy()
            else:
                shard = hvd.reducescatter(tf.constant(words), op=hvd.Sum, name=name).numpy()
            out[(bits, pattern)] = core.unpack(ops, shard, w, 3 * core.lanes_per_word(w))
    return out


def oracle(rank: int, n: int) -> dict:
    """The compressor's result for the oracle's inputs, with a fresh compressor per case, so
    its noise keys are serial 1 (stage 1) and 2 (stage 2) of each rank's stream."""
    out = {}
    for bits, op, kind in ORACLE_CASES:
        for graph in ((False, True) if FRAMEWORK == "tf" else (False,)):
            c = GlobalQSGD(bits=bits, two_stage=True, seed=TWO_STAGE_SEED)
            xs = _split(two_stage_input(rank, n, kind))
            got = _reduce(c, xs, OPS[op], graph=graph)
            stats = c.stats.as_dict() if not graph else None
            out[(bits, op, kind, graph)] = (got, stats)
    return out


@contextmanager
def _generic():
    """The framework-ops path (what CUDA tensors take), with the kernels switched off."""
    os.environ["HVD_GQSGD_KERNELS"] = "0"
    try:
        yield
    finally:
        del os.environ["HVD_GQSGD_KERNELS"]


def generic(rank: int, n: int) -> dict:
    """The random oracle inputs through the generic path: its own noise, so the test checks
    bounds and bit-identical results instead of equality with the oracle."""
    out = {}
    with _generic():
        for bits in (4, 8):
            for graph in ((False, True) if FRAMEWORK == "tf" else (False,)):
                c = GlobalQSGD(bits=bits, two_stage=True)
                out[(bits, graph)] = _reduce(c, _split(two_stage_input(rank, n)), hvd.Sum,
                                             graph=graph)
    return out


def unbiased(rank: int, n: int) -> list[np.ndarray]:
    """The same input reduced many times by one compressor (fresh noise every round)."""
    c = GlobalQSGD(bits=4, two_stage=True, seed=5)
    x = [two_stage_input(rank, n, numels=[1024])]
    return [_reduce(c, x, hvd.Sum) for _ in range(UNBIASED_ROUNDS)]


def flat_and_two(rank: int, n: int) -> dict:
    """The same input through flat (where 8 bits allow it) and two-stage Global-QSGD."""
    x = _split(two_stage_input(rank, n))
    out = {"two": [_reduce(GlobalQSGD(bits=8, two_stage=True, seed=s), x, hvd.Sum)
                   for s in range(4)]}
    if core.flat_levels(8, n):
        out["flat"] = [_reduce(GlobalQSGD(bits=8, two_stage=False, seed=s), x, hvd.Sum)
                       for s in range(4)]
    return out


def default_choice(rank: int, n: int) -> dict:
    """GlobalQSGD's default (two_stage=None) at 4 and 8 bits: the bytes it counted."""
    out = {}
    for bits in (4, 8):
        c = GlobalQSGD(bits=bits, seed=1)
        _reduce(c, _split(two_stage_input(rank, n)), hvd.Average)
        out[bits] = c.stats.as_dict()
    return out


def process_set(rank: int, n: int) -> dict | None:
    """Two-stage over a proper subset (ranks 0, 2, ...): its members' results."""
    pset = PROCESS_SETS[0]
    # built on every rank: compressors are numbered in construction order, and their
    # collectives' names with them
    c = GlobalQSGD(bits=8, two_stage=True, seed=TWO_STAGE_SEED, process_set=pset)
    if not pset.included():
        return None
    size = pset.size()
    return {"set_rank": pset.rank(), "set_size": size,
            "got": _reduce(c, _split(two_stage_input(pset.rank(), size)), hvd.Sum,
                           process_set=pset)}


def optimizer(rank: int, n: int) -> dict:
    """Horovod's optimizer/tape with a two-stage compressor: the gradients each rank fed in
    and the reduced ones (torch: DistributedOptimizer with backward_passes_per_step=2 and
    op=Sum; TF: DistributedGradientTape in tf.function)."""
    rng = np.random.default_rng([3, rank])
    data = [rng.normal(size=(16, 20)).astype(np.float32) for _ in range(2)]
    if FRAMEWORK == "torch":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(),
                                    torch.nn.Linear(300, 5))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            named_parameters=model.named_parameters(), op=hvd.Sum,
            # 4 KiB buckets: the larger tensors are sealed and moved on from compress
            compression=GlobalQSGD(bits=8, two_stage=True, bucket_bytes=4096),
            backward_passes_per_step=2)
        local = [torch.zeros_like(p) for p in model.parameters()]
        for x in data:
            loss = model(torch.from_numpy(x)).pow(2).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            for acc, g in zip(local, grads):
                acc += g
            loss.backward()
        opt.step()
        return {"local": [g.double().numpy() for g in local],
                "reduced": [p.grad.double().numpy() for p in model.parameters()]}
    tf.random.set_seed(0)
    w1 = tf.Variable(tf.random.normal([20, 300], seed=1))
    w2 = tf.Variable(tf.random.normal([300, 5], seed=2))
    c = GlobalQSGD(bits=8, two_stage=True)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.tanh(x @ w1) @ w2))
        local = tape.gradient(loss, [w1, w2])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.tanh(x @ w1) @ w2))
        tape = hvd.DistributedGradientTape(tape, compression=c)
        return local, tape.gradient(loss, [w1, w2])

    local, reduced = step(tf.constant(data[0]))
    return {"local": [g.numpy().astype(np.float64) for g in local],
            "reduced": [g.numpy().astype(np.float64) for g in reduced]}


def keras_fit(rank: int, n: int) -> dict | None:
    """Keras 3 model.fit through hvd_gqsgd.keras.DistributedOptimizer with a two-stage
    compressor, and the same fit with no compression: the weights after two steps."""
    if FRAMEWORK != "tf":
        return None
    import keras

    from hvd_gqsgd.keras import DistributedOptimizer

    rng = np.random.default_rng([4, rank])
    x, y = rng.normal(size=(32, 10)).astype(np.float32), rng.normal(size=(32, 1))
    out = {}
    for name, compression in (("two", GlobalQSGD(bits=8, two_stage=True)),
                              ("none", hvd.Compression.none)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     compression=compression), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        out[name] = [w.astype(np.float64) for w in model.get_weights()]
    return out


def qprsgd(rank: int, n: int) -> dict | None:
    """QPRSGD's allreduce sync through a two-stage compressor: the synchronised model, the
    ranks' local models just before it, and the model all ranks started from."""
    if FRAMEWORK != "torch":
        return None
    from hvd_gqsgd.torch import QPRSGD

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(),
                                torch.nn.Linear(300, 5))
    start = [p.detach().double().numpy().copy() for p in model.parameters()]
    opt = QPRSGD(torch.optim.SGD(model.parameters(), lr=0.05), model.parameters(), period=100,
                 compression=GlobalQSGD(bits=8, two_stage=True))
    x = torch.from_numpy(np.random.default_rng([6, rank]).normal(size=(16, 20)).astype(
        np.float32))
    for _ in range(3):  # local steps only (period 100)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    local = [p.detach().double().numpy().copy() for p in model.parameters()]
    opt.synchronize()
    return {"start": start, "local": local,
            "synced": [p.detach().double().numpy().copy() for p in model.parameters()]}


def rotation(rank: int, n: int) -> dict:
    """rotation="hadamard", flat (where ``bits`` leaves flat levels) and two-stage, 4 and 8
    bits, one compressor per case for two rounds (the round counter enters the key), eagerly
    and in tf.function: the results, for the oracle to replay."""
    out = {}
    x = _split(two_stage_input(rank, n))
    for bits in (4, 8):
        for two in (False, True):
            if not two and not core.flat_levels(bits, n):
                continue
            for graph in ((False, True) if FRAMEWORK == "tf" else (False,)):
                c = _GlobalQSGD(bits=bits, two_stage=two, seed=TWO_STAGE_SEED,
                                rotation="hadamard")
                out[(bits, two, graph)] = [_reduce(c, x, hvd.Sum, graph=graph)
                                           for _ in range(2)]
    return out


def heavy(rank: int, n: int) -> dict:
    """A heavy-tailed gradient (Student's t, 2 degrees of freedom) reduced many times at 4
    bits, flat (where 4 bits leave flat levels) and two-stage, with and without the
    rotation: a fresh unseeded compressor per round, so fresh rounding noise and, rotated,
    the signs of round 0: the error and the bias."""
    x = [np.random.default_rng([rank, 23]).standard_t(2, 8192).astype(np.float32)]
    return {(two, rot): [_reduce(_GlobalQSGD(bits=4, two_stage=two, rotation=rot), x, hvd.Sum)
                         for _ in range(HEAVY_ROUNDS)]
            for two in ((False, True) if core.flat_levels(4, n) else (True,))
            for rot in (None, "hadamard")}


HEAVY_ROUNDS = 40
# process_set runs an unnamed collective on its members only, which shifts Horovod's
# per-process names of later unnamed ones on them: the scenarios after it name theirs
SCENARIOS = [lane_extremes, oracle, generic, unbiased, flat_and_two, default_choice, rotation,
             heavy, process_set, optimizer, keras_fit, qprsgd]
PROCESS_SETS: list = []


def main() -> None:
    out_dir = sys.argv[1]
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("HOROVOD_SIZE") or 1)
    PROCESS_SETS.append(hvd.ProcessSet(list(range(0, world, 2))))
    hvd.init(process_sets=PROCESS_SETS)
    rank, n = hvd.rank(), hvd.size()
    only = sys.argv[3] if len(sys.argv) > 3 else None  # comma-separated subset (big jobs)
    results = {"size": n, "framework": FRAMEWORK}
    for scenario in SCENARIOS:
        if only is None or scenario.__name__ in only.split(","):
            results[scenario.__name__] = scenario(rank, n)
    # non-members must not shut down while the process set still reduces (TF has no barrier)
    hvd.allreduce((torch if FRAMEWORK == "torch" else tf).zeros(1), name="ts.barrier")
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
