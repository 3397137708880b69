"""Issue 6: which options make Global-QSGD usable at 4 bits?  A single-process study.

    .venv/bin/python studies/low_bits_study.py

Every option keeps the codes summable by a plain integer allreduce.  n ranks are simulated in
one process the way the real allreduce runs them:

1. each rank computes its gradient on its own shard (batch 32 per rank);
2. each rank transforms its gradient as the option says (rotation, error-feedback residual);
3. the ranks' local norms go through a MAX "allreduce" (``np.max`` over ranks): one global scale
   per tensor, or per chunk;
4. each rank rounds with its own noise stream (``core.rank_seed(seed, rank)``), and its codes
   are packed into int64 words with ``core.pack``;
5. the words are summed (Horovod's integer Sum) and ``core.unpack``-ed; the sum must equal the
   sum of the codes exactly;
6. the sum is rescaled with ``core.step_sizes``, divided by n and un-rotated once.

The base quantizer is hvd_gqsgd.core's ``levels``, ``multipliers``, ``quantize``, ``pack``,
``unpack`` and ``step_sizes``, driven by gqsgd_lab/numpy_ops.py.  This file adds only the option
transforms around it:

* ``norm="l2"`` instead of max|x| for the local norm;
* one global scale per chunk of C elements instead of one per tensor;
* an exponential grid {0, 1, 2, 4, ..., 2**K} laid on the integer grid, with 2**K <= L;
* a randomized Hadamard rotation H.D per block of B elements, with signs shared by all ranks;
* error feedback: each rank carries what its rounding dropped into the next step.

It writes the block between the "generated" markers of docs/LOW_BITS.md, plus
docs/low_bits_mse.png and docs/low_bits_training.png.  The hand-written prose outside the
markers is kept.  The run takes about 8 minutes of CPU on one thread (longer in wall time when
the machine is shared).  ``--quick`` is a one-minute smoke test that writes nothing.
"""

from __future__ import annotations

import argparse
import functools
import math
import pickle
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from sklearn.datasets import load_digits

from gqsgd_lab.numpy_ops import NumpyOps  # the NumPy TensorOps the tests use as oracle
from hvd_gqsgd import core

ROOT = Path(__file__).resolve().parent.parent

OPS = NumpyOps()
DOC = ROOT / "docs" / "LOW_BITS.md"
BEGIN, END = "<!-- generated:begin -->", "<!-- generated:end -->"

BATCH, EPOCHS, LR, MOMENTUM = 32, 8, 0.1, 0.9  # as in examples/torch_digits.py
SEEDS = (0, 1, 2)
CONFIGS_A = ((4, 2), (4, 4), (8, 4), (8, 16))  # (bits, n) for the MSE table
CONFIGS_B = ((4, 2), (4, 4))  # (bits, n) for training
EXTRA_SEEDS = tuple(range(3, 11))  # 8 more seeds for the leading options, to test the 3-seed read
EXTENDED = ("fp32", "max (baseline)", "chunk 256", "HD B=1024", "HD B=1024 + chunk 1024",
            "max + EF")
DRAWS_A = 20  # noise draws per checkpoint for the MSE
DRAWS_BIAS = 150  # noise draws for the unbiasedness check
SNAPSHOT_STEPS = (0, 44, 175)  # fp32 steps (n=2, 22 per epoch): start, epoch 2, the end
T = TypeVar("T")
WHOLE = -1  # Hadamard block meaning "the whole tensor, padded to a power of two"


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One way to quantize.  Every option sends integer codes in [-L, L] that a plain Sum adds."""

    name: str
    norm: str = "max"  # local norm behind the global scale: "max" or "l2"
    chunk: int = 0  # elements per global scale; 0 = one scale per tensor
    exp_grid: bool = False  # levels {0, 1, 2, 4, .., 2**K} (2**K <= L) instead of {0, 1, .., L}
    block: int = 0  # Hadamard block size; 0 = no rotation, WHOLE = the whole tensor
    feedback: bool = False  # error feedback: a per-rank residual carried to the next step


OPTIONS = (
    Option("max (baseline)"),
    Option("l2", norm="l2"),
    Option("chunk 4096", chunk=4096),
    Option("chunk 1024", chunk=1024),
    Option("chunk 256", chunk=256),
    Option("exp grid", exp_grid=True),
    Option("HD B=1024", block=1024),
    Option("HD whole", block=WHOLE),
    Option("HD B=1024 + chunk 1024", block=1024, chunk=1024),
    Option("max + EF", feedback=True),
    Option("HD B=1024 + EF", block=1024, feedback=True),
)
STATELESS = tuple(o for o in OPTIONS if not o.feedback)  # EF is only meaningful along training


# --------------------------------------------------------------------------- rotation


def padded_size(numel: int, block: int) -> int:
    """Length of the rotated vector: a multiple of ``block``, or the next power of two when the
    tensor is smaller than one block (or the block is the whole tensor)."""
    if block == 0:
        return numel
    if block == WHOLE or numel <= block:
        return 1 << (numel - 1).bit_length()
    return -(-numel // block) * block


def fwht(rows: np.ndarray) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform of every row (width a power of two).

    log2(width) butterfly stages; H is symmetric and orthonormal, so it is its own inverse."""
    n_rows, width = rows.shape
    out = rows.copy()
    half = 1
    while half < width:
        v = out.reshape(n_rows, width // (2 * half), 2, half)
        top = v[:, :, 0, :].copy()
        v[:, :, 0, :] += v[:, :, 1, :]
        v[:, :, 1, :] = top - v[:, :, 1, :]
        half *= 2
    return out * (1.0 / math.sqrt(width))


@functools.lru_cache(maxsize=256)
def shared_signs(seed: int, tensor: int, size: int) -> np.ndarray:
    """The diagonal of D: +-1 per padded element, the same on every rank.

    The stream is keyed by (shared seed, tensor index) and never by rank, so all ranks rotate
    alike and the integer sum commutes with the rotation.  Fixed across steps: no state."""
    rng = np.random.default_rng([0x5EED, seed, tensor])
    return rng.integers(0, 2, size).astype(np.float64) * 2.0 - 1.0


def rotate(x: np.ndarray, block: int, signs: np.ndarray) -> np.ndarray:
    """H.D applied to ``x`` zero-padded to ``signs.size``, block by block."""
    padded = np.zeros(signs.size)
    padded[: x.size] = x
    width = signs.size if block == WHOLE else min(signs.size, block)
    return fwht((padded * signs).reshape(-1, width)).reshape(-1)


def unrotate(z: np.ndarray, block: int, signs: np.ndarray, numel: int) -> np.ndarray:
    """D.H applied to ``z`` (the inverse of :func:`rotate`), cropped back to ``numel``."""
    width = signs.size if block == WHOLE else min(signs.size, block)
    return (fwht(z.reshape(-1, width)).reshape(-1) * signs)[:numel]


# --------------------------------------------------------------------------- quantizers


def local_norms(v: np.ndarray, chunk: int, norm: str) -> np.ndarray:
    """One local norm per chunk (one per tensor when ``chunk`` is 0); zero padding is neutral."""
    rows = v.reshape(1, -1) if chunk == 0 else np.pad(v, (0, -v.size % chunk)).reshape(-1, chunk)
    if norm == "max":
        return np.abs(rows).max(axis=1)
    return np.sqrt(np.square(rows).sum(axis=1))


def per_element(values: np.ndarray, chunk: int, size: int) -> np.ndarray:
    """Broadcast per-chunk values to elements."""
    return values if chunk == 0 else np.repeat(values, chunk)[:size]


def quantize_exp(v: np.ndarray, mult: np.ndarray, noise: np.ndarray, top: int) -> np.ndarray:
    """Unbiased rounding of ``v * mult`` to the integer grid {0, +-1, +-2, +-4, .., +-top}.

    ``top`` is a power of two.  On [2**j, 2**(j+1)] the value is rounded by core.quantize in
    units of 2**j (on [0, 1] in units of 1), so E[code] = v * mult and every code is an
    integer that the allreduce can add."""
    y = np.clip(v * mult, -top, top)
    _, exponent = np.frexp(y)  # |y| = m * 2**exponent with m in [0.5, 1)
    unit = np.ldexp(1.0, np.maximum(exponent - 1, 0))
    return core.quantize(OPS, y / unit, 1.0, noise, 2) * unit.astype(np.int64)


class HalfNoise:
    """A stand-in noise stream that always draws 0.5: round-to-nearest, i.e. biased.  It is the
    negative control that proves the unbiasedness check can fail."""

    def random(self, size: int) -> np.ndarray:
        return np.full(size, 0.5)


# --------------------------------------------------------------------------- simulated allreduce


class SimAllreduce:
    """``n`` simulated ranks running one option's integer allreduce, tensor by tensor."""

    def __init__(self, option: Option, bits: int, n: int, seed: int) -> None:
        self.option, self.bits, self.n, self.seed = option, bits, n, seed
        # L: codes in [-L, L], so the sum of n codes fits a bits-wide lane (core's bound)
        self.n_levels = core.levels(bits, n)
        # the grid's top in integer units: L, or the largest power of two <= L
        self.top = 1 << (self.n_levels.bit_length() - 1) if option.exp_grid else self.n_levels
        # one independent rounding-noise stream per rank, as the compressor seeds them
        self.rngs: list = [np.random.default_rng(core.rank_seed(seed, r)) for r in range(n)]
        # error feedback only: residual[tensor][rank], what the rounding dropped last step
        self.residual: dict[int, list[np.ndarray]] = {}

    def mean(self, grads: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
        """The decoded mean of ``grads[rank][tensor]`` (flat float64) over ranks."""
        return [self._tensor(t, [g[t] for g in grads]) for t in range(len(grads[0]))]

    def _forward(self, x: np.ndarray, t: int) -> np.ndarray:
        if not self.option.block:
            return x
        return rotate(x, self.option.block, self._signs(t, x.size))

    def _backward(self, v: np.ndarray, t: int, numel: int) -> np.ndarray:
        if not self.option.block:
            return v
        return unrotate(v, self.option.block, self._signs(t, numel), numel)

    def _signs(self, t: int, numel: int) -> np.ndarray:
        return shared_signs(self.seed, t, padded_size(numel, self.option.block))

    def _tensor(self, t: int, xs: list[np.ndarray]) -> np.ndarray:
        opt, numel = self.option, xs[0].size
        if opt.feedback:
            xs = [x + r for x, r in zip(xs, self.residual.get(t, [0.0] * self.n))]
        vs = [self._forward(x, t) for x in xs]
        size = vs[0].size
        # COLLECTIVE in the real thing: one MAX allreduce of the local norms
        scales = np.max([local_norms(v, opt.chunk, opt.norm) for v in vs], axis=0)
        mult = per_element(core.multipliers(OPS, scales, self.top), opt.chunk, size)
        step = per_element(core.step_sizes(OPS, scales, self.top), opt.chunk, size)
        codes = [self._quantize(v, mult, rng.random(size)) for v, rng in zip(vs, self.rngs)]
        # COLLECTIVE in the real thing: the integer Sum allreduce of packed words
        words = sum(core.pack(OPS, c, self.bits) for c in codes)
        total = core.unpack(OPS, words, self.bits, size)
        if not np.array_equal(total, np.sum(codes, axis=0)):
            raise RuntimeError(f"{opt.name}: a lane overflowed at bits={self.bits}, n={self.n}")
        if opt.feedback:
            self.residual[t] = [x - self._backward(c * step, t, numel) for x, c in zip(xs, codes)]
        return self._backward(total * step / self.n, t, numel)

    def _quantize(self, v: np.ndarray, mult: np.ndarray, noise: np.ndarray) -> np.ndarray:
        if self.option.exp_grid:
            return quantize_exp(v, mult, noise, self.top)
        return core.quantize(OPS, v, mult, noise, self.n_levels)


def exact_mean(grads: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    return [np.mean(ts, axis=0) for ts in zip(*grads)]


def sq_err(est: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> float:
    return float(sum(np.square(e - r).sum() for e, r in zip(est, ref)))


def sq_norm(ref: Sequence[np.ndarray]) -> float:
    return float(sum(np.square(r).sum() for r in ref))


def wire_bits(option: Option, numels: Sequence[int], bits: int) -> float:
    """Bits per gradient element on the wire: padded codes plus a float64 scale per chunk."""
    padded = [padded_size(m, option.block) for m in numels]
    scales = sum(1 if option.chunk == 0 else -(-p // option.chunk) for p in padded)
    return (bits * sum(padded) + 64 * scales) / sum(numels)


# --------------------------------------------------------------------------- digits MLP


@functools.lru_cache(maxsize=8)
def shards(n: int) -> tuple:
    """Per-rank training shards and the shared test set, split as examples/torch_digits.py."""
    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    test, train = order[:360], order[360:]
    return [(x[train[r::n]], y[train[r::n]]) for r in range(n)], (x[test], y[test])


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # seed 0 is examples/torch_digits.py's initialisation
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def rank_grads(net: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> list[np.ndarray]:
    """One rank's gradient of the batch loss: flat float64 arrays, one per parameter."""
    loss = torch.nn.functional.cross_entropy(net(xb), yb)
    grads = torch.autograd.grad(loss, list(net.parameters()))
    return [g.numpy().astype(np.float64).ravel() for g in grads]


def evaluate(net: torch.nn.Module, test: tuple) -> tuple[float, float]:
    with torch.no_grad():
        logits = net(test[0])
        loss = float(torch.nn.functional.cross_entropy(logits, test[1]))
        return float((logits.argmax(1) == test[1]).float().mean()), loss


def train(option: Option | None, bits: int, n: int, seed: int, epochs: int = EPOCHS,
          on_step: Callable[[int, torch.nn.Module], None] | None = None) -> list[tuple]:
    """Simulated n-rank data-parallel SGD; ``option=None`` is the exact fp32 mean.
    Returns (test accuracy, test loss) after every epoch."""
    train_shards, test = shards(n)
    net = model(seed)
    sgd = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    sim = SimAllreduce(option, bits, n, seed) if option else None
    # rank r draws its batch order as the example's rank r does (seed 0), independently
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(n)]
    steps = min(len(xr) for xr, _ in train_shards) // BATCH
    history, step = [], 0
    for _ in range(epochs):
        perms = [torch.randperm(len(xr), generator=g) for (xr, _), g in zip(train_shards, gens)]
        for i in range(steps):
            if on_step:
                on_step(step, net)
            idx = slice(i * BATCH, (i + 1) * BATCH)
            grads = [rank_grads(net, xr[p[idx]], yr[p[idx]])
                     for (xr, yr), p in zip(train_shards, perms)]
            mean = sim.mean(grads) if sim else exact_mean(grads)
            for p, g in zip(net.parameters(), mean):
                p.grad = torch.from_numpy(g.reshape(p.shape).astype(np.float32))
            sgd.step()
            step += 1
        history.append(evaluate(net, test))
        if not math.isfinite(history[-1][1]):  # diverged: NaN stays NaN, skip the rest
            return history + history[-1:] * (epochs - len(history))
    return history


# --------------------------------------------------------------------------- metric A


@dataclass(frozen=True)
class Plan:
    """How much to run.  ``--quick`` shrinks it to a smoke test that writes nothing."""

    seeds: tuple[int, ...] = SEEDS
    extra_seeds: tuple[int, ...] = EXTRA_SEEDS
    draws_a: int = DRAWS_A
    draws_bias: int = DRAWS_BIAS
    epochs: int = EPOCHS


def snapshots(plan: Plan) -> list[dict]:
    """Parameters at SNAPSHOT_STEPS of an fp32 run (n=2, seed 0)."""
    states: list[dict] = []

    def keep(step: int, net: torch.nn.Module) -> None:
        if step in SNAPSHOT_STEPS:
            states.append({k: v.clone() for k, v in net.state_dict().items()})

    train(None, 32, 2, 0, plan.epochs, on_step=keep)
    return states


def checkpoint_grads(state: dict, n: int) -> list[list[np.ndarray]]:
    """Each of n ranks' gradient on a batch of 32 from its own shard, at parameters ``state``."""
    net = model(0)
    net.load_state_dict(state)
    grads = []
    for r, (xr, yr) in enumerate(shards(n)[0]):
        batch = torch.randperm(len(xr), generator=torch.Generator().manual_seed(r))[:BATCH]
        grads.append(rank_grads(net, xr[batch], yr[batch]))
    return grads


def spread(states: list[dict]) -> list[tuple]:
    """Per tensor, rank 0's gradient at the middle checkpoint (n=2): its name, size and
    max|x| / rms(x), plain and after each rotation (over the padded, rotated vector)."""
    grads = checkpoint_grads(states[min(1, len(states) - 1)], 2)[0]
    names = [name for name, _ in model(0).named_parameters()]
    rows = []
    for t, (name, x) in enumerate(zip(names, grads)):
        ratios = [peak_to_rms(rotate(x, b, shared_signs(0, t, padded_size(x.size, b))))
                  for b in (1024, WHOLE)]
        rows.append((name, x.size, peak_to_rms(x), *ratios))
    return rows


def peak_to_rms(v: np.ndarray) -> float:
    return float(np.abs(v).max() / np.sqrt(np.mean(np.square(v))))


def metric_a(states: list[dict], plan: Plan) -> dict[tuple, dict[str, list[float]]]:
    """E||g_hat - g||^2 / ||g||^2 for every config and stateless option: one value per
    checkpoint, each the average over ``plan.draws_a`` noise draws."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for bits, n in CONFIGS_A:
        out[(bits, n)] = {o.name: [] for o in STATELESS}
        for c, state in enumerate(states):
            grads = checkpoint_grads(state, n)
            g = exact_mean(grads)
            for o in STATELESS:
                sim = SimAllreduce(o, bits, n, seed=c)
                err = statistics.fmean(sq_err(sim.mean(grads), g) for _ in range(plan.draws_a))
                out[(bits, n)][o.name].append(err / sq_norm(g))
    return out


def unbiasedness(state: dict, bits: int, n: int, plan: Plan) -> dict[str, tuple[float, float]]:
    """Per option, ``ratio = D ||mean of D estimates - g||^2 / mean ||estimate - g||^2``.

    If the estimator is unbiased, E||mean - g||^2 = MSE / D exactly, so the ratio is about 1
    (many coordinates average out); a bias b adds D ||b||^2 / MSE.  Round-to-nearest is run
    as a negative control and must fail.  Also returns ||mean - g||^2 / ||g||^2."""
    grads = checkpoint_grads(state, n)
    g, draws = exact_mean(grads), plan.draws_bias
    cases = [(o.name, o, False) for o in STATELESS]
    cases.append(("control: round to nearest", OPTIONS[0], True))
    out = {}
    for name, option, nearest in cases:
        sim = SimAllreduce(option, bits, n, seed=7)
        if nearest:
            sim.rngs = [HalfNoise()] * n
        total, mse = [np.zeros_like(t) for t in g], 0.0
        for _ in range(draws):
            est = sim.mean(grads)
            total = [a + e for a, e in zip(total, est)]
            mse += sq_err(est, g) / draws
        bias = sq_err([a / draws for a in total], g)
        out[name] = (draws * bias / mse, bias / sq_norm(g))
        if (out[name][0] < 1.5) == nearest:
            raise RuntimeError(f"unbiasedness check: {name} gave ratio {out[name][0]:.2f}")
    return out


# --------------------------------------------------------------------------- metric B


def metric_b(plan: Plan) -> dict[tuple, dict[str, list[list[tuple]]]]:
    """Training histories: runs[(bits, n)][option name][seed] = [(acc, loss) per epoch].

    Every option runs ``plan.seeds``; the EXTENDED ones then run ``plan.extra_seeds`` too."""
    runs: dict[tuple, dict[str, list[list[tuple]]]] = {}
    variants: list[tuple[str, Option | None]] = [("fp32", None)]
    variants += [(o.name, o) for o in OPTIONS]
    for bits, n in CONFIGS_B:
        runs[(bits, n)] = {}
        for name, option in variants:
            seeds = plan.seeds + (plan.extra_seeds if name in EXTENDED else ())
            runs[(bits, n)][name] = [train(option, bits, n, s, plan.epochs) for s in seeds]
        print(f"  trained bits={bits} n={n}", flush=True)
    return runs


# --------------------------------------------------------------------------- rotation cost


def fwht_torch(rows: torch.Tensor) -> torch.Tensor:
    """The same transform as :func:`fwht` in torch ops."""
    n_rows, width = rows.shape
    half = 1
    while half < width:
        v = rows.reshape(n_rows, width // (2 * half), 2, half)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        rows = torch.stack((a + b, a - b), dim=2).reshape(n_rows, width)
        half *= 2
    return rows * (1.0 / math.sqrt(width))


def fwht_numba() -> Callable[[np.ndarray, np.ndarray, int], np.ndarray]:
    """A block-at-a-time transform, in place on a flat array: each block is copied (times its
    signs) into a scratch buffer that stays in L1 for all stages.  Every stage has the same
    "constant geometry" (pairs (2k, 2k+1) go to k and k + width/2), which gives H in natural
    order after log2(width) stages and, unlike in-place butterflies, lets the compiler
    vectorize because source and destination never alias."""
    import numba

    @numba.njit(nogil=True, fastmath=True)
    def kernel(v: np.ndarray, signs: np.ndarray, width: int) -> np.ndarray:
        scale = np.float32(1.0 / np.sqrt(width))
        src, dst, half = np.empty(width, v.dtype), np.empty(width, v.dtype), width // 2
        for base in range(0, v.size, width):
            for j in range(width):
                src[j] = v[base + j] * signs[base + j]
            span = width
            while span > 1:
                for k in range(half):
                    dst[k] = src[2 * k] + src[2 * k + 1]
                    dst[k + half] = src[2 * k] - src[2 * k + 1]
                src, dst = dst, src
                span //= 2
            for j in range(width):
                v[base + j] = src[j] * scale
        return v

    return kernel


def median_time(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()  # warm-up (and numba compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rotation_cost(numel: int = 1 << 24, block: int = 1024) -> dict[str, tuple[float, float]]:
    """Seconds for one H.D rotation of ``numel`` fp32 values (64 MB), and the same in units of
    one ``torch.add(x, y, out=out)`` pass, the unit of benchmarks/cpu_cost.py."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(numel).astype(np.float32)
    signs = np.where(rng.random(numel) < 0.5, -1.0, 1.0).astype(np.float32)
    xt, st = torch.from_numpy(x), torch.from_numpy(signs)
    yt, out = torch.randn(numel), torch.empty(numel)
    kernel, buf = fwht_numba(), x.copy()
    head = x[: 4 * block]
    expected = fwht((head * signs[: 4 * block]).reshape(-1, block)).reshape(-1)
    for name, got in (("numba", kernel(head.copy(), signs, block)),
                      ("torch", fwht_torch((xt[: 4 * block] * st[: 4 * block]).view(-1, block)))):
        if not np.allclose(np.asarray(got).reshape(-1), expected, atol=1e-4):
            raise RuntimeError(f"the {name} Hadamard transform disagrees with fwht()")
    cost = {
        "one torch.add pass": median_time(lambda: torch.add(xt, yt, out=out)),
        "numpy (vectorized stages)": median_time(lambda: fwht((x * signs).reshape(-1, block))),
        "torch (vectorized stages)": median_time(
            lambda: fwht_torch((xt * st).view(-1, block))),
        "numba (blocked, in cache)": median_time(lambda: kernel(buf, signs, block)),
    }
    unit = cost["one torch.add pass"]
    return {k: (v, v / unit) for k, v in cost.items()}


# --------------------------------------------------------------------------- report


def mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> str:
    """``mean ± std`` (sample std) over the finite values, noting how many runs diverged."""
    ok = [v for v in values if math.isfinite(v)]
    if not ok:
        return "diverged"
    sd = statistics.stdev(ok) if len(ok) > 1 else 0.0
    text = f"{scale * statistics.fmean(ok):.{digits}f} ± {scale * sd:.{digits}f}"
    return text if len(ok) == len(values) else f"{text} ({len(values) - len(ok)} diverged)"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def final(runs: dict, config: tuple, name: str, k: int, n_seeds: int | None = None) -> list:
    """Per-seed final-epoch accuracy (k=0) or test loss (k=1), the first ``n_seeds`` seeds."""
    return [history[-1][k] for history in runs[config][name][:n_seeds]]


def mse_section(mse: dict, numels: Sequence[int]) -> str:
    header = ["option", "wire bits/elem at 4 bits"] + [f"bits={b}, n={n}" for b, n in CONFIGS_A]
    rows = []
    for o in STATELESS:
        cells = []
        for cfg in CONFIGS_A:
            value = statistics.fmean(mse[cfg][o.name])
            base = statistics.fmean(mse[cfg][OPTIONS[0].name])
            cells.append(f"{value:.3g} ({base / value:.2f}x)")
        rows.append([o.name, f"{wire_bits(o, numels, 4):.3f}"] + cells)
    detail = [[o.name] + [f"{v:.3g}" for v in mse[(4, 2)][o.name]] for o in STATELESS]
    steps = SNAPSHOT_STEPS[: len(mse[(4, 2)][OPTIONS[0].name])]
    return "\n\n".join([
        table(header, rows),
        "Relative MSE E‖ĝ − ĝ_exact‖² / ‖g‖² of the decoded mean, averaged over the "
        f"{len(SNAPSHOT_STEPS)} checkpoints; in brackets, how many times smaller than the "
        "per-tensor max baseline.  Per checkpoint at bits=4, n=2 (fp32 training step):",
        table(["option"] + [f"step {s}" for s in steps], detail),
    ])


def bias_section(bias: dict) -> str:
    rows = []
    for cfg, result in bias.items():
        rows += [[f"bits={cfg[0]}, n={cfg[1]}", name, f"{ratio:.3f}", f"{rel:.2e}"]
                 for name, (ratio, rel) in result.items()]
    return table(["config", "option", "ratio (≈1 if unbiased)", "‖mean − g‖² / ‖g‖²"], rows)


def exp_grid_section(mse: dict) -> str:
    rows = []
    for bits, n in CONFIGS_A:
        n_levels = core.levels(bits, n)
        top = 1 << (n_levels.bit_length() - 1)
        grid = ", ".join(["0"] + [str(1 << j) for j in range(top.bit_length())])
        exp_gap = 1.0 if top == 1 else 0.5  # the widest gap of the exponential grid, units of s
        ratio = (statistics.fmean(mse[(bits, n)]["exp grid"])
                 / statistics.fmean(mse[(bits, n)][OPTIONS[0].name]))
        rows.append([f"bits={bits}, n={n}", n_levels, f"{{{grid}}} × s/{top}",
                     f"1/{n_levels} vs 1/{top}", f"{1 / (4 * n_levels ** 2):.4f} vs "
                     f"{exp_gap ** 2 / 4:.4f}", f"{ratio:.2f}"])
    return table(["config", "L", "exponential grid (integer units)",
                  "finest step / s: linear vs exp", "worst-case variance / s²: linear vs exp",
                  "measured MSE exp / linear"], rows)


def training_section(runs: dict, names: Sequence[str], n_seeds: int | None) -> str:
    """Final accuracy and loss, and the loss paired with the max baseline's on the same seed
    (same initial weights and batches).  ``s.e.`` is the standard error of the paired mean."""
    header = ["option"]
    for _, n in CONFIGS_B:
        header += [f"acc % (n={n})", f"test loss (n={n})", f"Δ loss vs max (n={n})", "s.e."]
    rows = []
    for name in names:
        row = [name]
        for cfg in CONFIGS_B:
            base = final(runs, cfg, OPTIONS[0].name, 1, n_seeds)
            delta = [a - b for a, b in zip(final(runs, cfg, name, 1, n_seeds), base)]
            ok = [d for d in delta if math.isfinite(d)]
            se = statistics.stdev(ok) / math.sqrt(len(ok)) if len(ok) > 1 else math.nan
            row += [mean_std(final(runs, cfg, name, 0, n_seeds), 100, 1),
                    mean_std(final(runs, cfg, name, 1, n_seeds)), mean_std(delta),
                    f"{se:.3f}" if math.isfinite(se) else "-"]
        rows.append(row)
    return table(header, rows)


def cost_section(cost: dict) -> str:
    rows = [[k, f"{1e3 * sec:.1f}", f"{passes:.1f}"] for k, (sec, passes) in cost.items()]
    return table(["implementation", "ms for 16 M fp32 (64 MB), B=1024", "torch.add passes"], rows)


def plot_mse(mse: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(CONFIGS_A)
    for k, cfg in enumerate(CONFIGS_A):
        values = [statistics.fmean(mse[cfg][o.name]) for o in STATELESS]
        ax.bar(np.arange(len(STATELESS)) + k * width, values, width,
               label=f"bits={cfg[0]}, n={cfg[1]}")
    ax.set_xticks(np.arange(len(STATELESS)) + width * (len(CONFIGS_A) - 1) / 2)
    ax.set_xticklabels([o.name for o in STATELESS], rotation=25, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("relative MSE of the mean gradient")
    ax.set_title("Digits MLP gradients: quantization error per option (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(runs: dict, n_main: int, path: Path) -> None:
    """Final test loss: every option over the first ``n_main`` seeds (top), EXTENDED over all
    of them (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(CONFIGS_B), figsize=(11, 8),
                             gridspec_kw={"height_ratios": [len(OPTIONS) + 1, len(EXTENDED)]})
    for row, (names, n_seeds) in enumerate(((list(runs[CONFIGS_B[0]]), n_main),
                                            (list(EXTENDED), None))):
        for ax, cfg in zip(axes[row], CONFIGS_B):
            losses = [[v for v in final(runs, cfg, k, 1, n_seeds) if math.isfinite(v)]
                      for k in names]
            seeds = len(runs[cfg]["fp32"][:n_seeds])
            loss_bars(ax, names, losses, seeds)
            ax.set_title(f"bits={cfg[0]}, n={cfg[1]} ranks, {seeds} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_bars(ax, names: Sequence[str], losses: Sequence[Sequence[float]], seeds: int) -> None:
    means = [statistics.fmean(v) if v else math.nan for v in losses]
    errs = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in losses]
    ax.barh(np.arange(len(names)), means, xerr=errs, color="tab:blue", capsize=3)
    for y, v in enumerate(losses):
        if len(v) < seeds:
            ax.text(0, y, " diverged" if not v else " some seeds diverged", va="center")
    ax.axvline(means[0], color="k", ls="--", lw=1)
    ax.set_yticks(np.arange(len(names)))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("final test loss, mean ± std over seeds (dashed: fp32)")


def write_doc(generated: str) -> None:
    """Replace the block between the markers of docs/LOW_BITS.md; keep the prose around it."""
    text = DOC.read_text() if DOC.exists() else f"# Global-QSGD at low bits\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC} lacks the {BEGIN} / {END} markers; put them back where the "
                         "generated tables belong")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{BEGIN}\n{generated}\n{END}{tail}")


def report(plan: Plan, mse: dict, peaks: list, bias: dict, runs: dict, cost: dict,
           seconds: dict) -> str:
    numels = [p.numel() for p in model(0).parameters()]
    wall, cpu = (sum(t[k] for t in seconds.values()) for k in (0, 1))
    timing = ", ".join(f"{k} {w:.0f} s" for k, (w, _) in seconds.items())
    return "\n\n".join([
        "_Generated by `.venv/bin/python studies/low_bits_study.py`; do not edit by hand._",
        f"Run time: {wall:.0f} s wall, {cpu:.0f} s CPU, one thread ({timing}, wall).",
        "### Metric A: error of the quantized mean gradient", mse_section(mse, numels),
        "![relative MSE per option](low_bits_mse.png)",
        "### Peak-to-rms per tensor (what a max-norm scale wastes)",
        f"Rank 0 of n=2 at the step-{SNAPSHOT_STEPS[1]} checkpoint.  A Gaussian vector of N "
        "values has max/rms ≈ √(2 ln N): 4.7 at N = 65536.",
        table(["tensor", "numel", "max/rms", "after HD B=1024", "after HD whole"],
              [[n, m, *(f"{r:.1f}" for r in rs)] for n, m, *rs in peaks]),
        "### Unbiasedness", f"{plan.draws_bias} draws at the step-{SNAPSHOT_STEPS[1]} checkpoint.",
        bias_section(bias),
        "### Exponential levels on the integer grid", exp_grid_section(mse),
        "### Metric B: training, final test accuracy and loss after "
        f"{plan.epochs} epochs, mean ± std over seeds {', '.join(map(str, plan.seeds))}",
        training_section(runs, list(runs[CONFIGS_B[0]]), len(plan.seeds)),
        "The same for the leading options over seeds "
        f"{', '.join(map(str, plan.seeds + plan.extra_seeds))}:",
        training_section(runs, EXTENDED, None),
        "![final test loss per option](low_bits_training.png)",
        "### CPU cost of the rotation", cost_section(cost),
    ])


def timed(seconds: dict, name: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` and record its (wall, CPU) seconds under ``name``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    seconds[name] = (time.perf_counter() - wall, time.process_time() - cpu)
    print(f"{name}: {seconds[name][0]:.0f} s wall, {seconds[name][1]:.0f} s CPU", flush=True)
    return result


def compute(plan: Plan) -> dict:
    seconds: dict[str, tuple[float, float]] = {}
    states = timed(seconds, "checkpoints", lambda: snapshots(plan))
    mse = timed(seconds, "metric A", lambda: metric_a(states, plan))
    peaks = spread(states)
    check = states[min(1, len(states) - 1)]
    bias = timed(seconds, "unbiasedness",
                 lambda: {cfg: unbiasedness(check, *cfg, plan) for cfg in CONFIGS_B})
    runs = timed(seconds, "metric B", lambda: metric_b(plan))
    cost = timed(seconds, "rotation cost", rotation_cost)
    return {"plan": plan, "mse": mse, "peaks": peaks, "bias": bias, "runs": runs, "cost": cost,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test; writes no docs")
    parser.add_argument("--save-raw", type=Path, help="also pickle the raw results to this file")
    parser.add_argument("--load-raw", type=Path, help="rebuild the docs from saved raw results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.load_raw:
        raw = pickle.loads(args.load_raw.read_bytes())
    else:
        quick = Plan(seeds=(0,), extra_seeds=(1,), draws_a=2, draws_bias=20, epochs=1)
        raw = compute(quick if args.quick else Plan())
    if args.save_raw:
        args.save_raw.write_bytes(pickle.dumps(raw))
    generated = report(**raw)
    print(generated)
    if not args.quick:
        plot_mse(raw["mse"], ROOT / "docs" / "low_bits_mse.png")
        plot_training(raw["runs"], len(raw["plan"].seeds), ROOT / "docs" / "low_bits_training.png")
        write_doc(generated)


if __name__ == "__main__":
    main()
