"""A NumPy simulation of two-stage Global-QSGD, written from the algorithm's statement
(hvd_gqsgd/two_stage.py's docstring), not from the code under test: it computes lane
widths, levels, shards and parts on its own, and only shares the definition of the rounding
noise stream (``kernels.noise`` keyed by ``core.noise_key(core.rank_seed(seed, rank),
serial)``), so that a real run's fused path can be replayed bit for bit, and the default
scale block by bits (``core.default_scale_block``) where ``block`` is left None.

``simulate`` returns every rank's result; ``predicted_variance`` the rounding variance that
the error tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hvd_gqsgd import core, kernels

CODE_CAP = 2**15 - 1


def lane_width(bits: int, n: int) -> int:
    """The narrowest width keeping ``2**(bits-1) - 1`` levels for each of ``n`` ranks,
    widened to the widest with the same lanes per 64-bit word."""
    need = 2 ** (bits - 1) - 1
    w = bits
    while (2 ** (w - 1) - 1) // n < need:
        w += 1
    return 64 // (64 // w)


def stage_levels(bits: int, n: int) -> tuple[int, int]:
    w = lane_width(bits, n)
    return min((2 ** (w - 1) - 1) // n, CODE_CAP), 2 ** (bits - 1) - 1


def _block(block: int | None, bits: int) -> int:
    """``block``, or when None the library's documented default for ``bits``
    (``core.default_scale_block``), as every entry point's ``scale_block=None`` gives."""
    return core.default_scale_block(bits) if block is None else block


def segment_ids(numels: list[int], block: int) -> np.ndarray:
    """Scale segment of every bucket element: blocks of ``block`` inside each tensor."""
    ids, next_id = [], 0
    for n in numels:
        local = np.arange(n) // block if block else np.zeros(n, dtype=np.int64)
        ids.append(local + next_id)
        next_id += int(local.max()) + 1 if n else 0
    return np.concatenate(ids)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round(y: np.ndarray, u: np.ndarray) -> np.ndarray:
    low = np.floor(y)
    return low.astype(np.int64) + (u < (y - low).astype(np.float64))


@dataclass
class Result:
    out: np.ndarray  # the decoded sum times factor, float64 (from float32)
    sums: np.ndarray  # stage-1 lane sums S, int64
    part_max: np.ndarray  # per element: max |S| of its part
    steps: np.ndarray  # per element: value of one stage-2 code before factor


def simulate(xs: list[np.ndarray], numels: list[int], bits: int, seed: int, factor: float,
             block: int | None = None, serial: int = 1) -> Result:
    """Two-stage Global-QSGD of the inputs ``xs`` (one per rank, float32 or float64), as the
    fused kernels round: stage 1 with key serial ``serial``, stage 2 with ``serial + 1``."""
    seg = segment_ids(numels, _block(block, bits))
    scale = np.zeros(seg.max() + 1)
    for x in xs:
        np.maximum.at(scale, seg, np.abs(x.astype(np.float64)))
    keys = [(core.noise_key(core.rank_seed(seed, r), serial),
             core.noise_key(core.rank_seed(seed, r), serial + 1)) for r in range(len(xs))]
    return across(xs, seg, scale, bits, keys, factor)


def across(xs: list[np.ndarray], seg: np.ndarray, scale: np.ndarray, bits: int,
           keys: list[tuple[int, int]], factor: float) -> Result:
    """The two stages over ``len(xs)`` ranks for elements whose scale segments are ``seg``
    (ids into ``scale``, the agreed global scales); rank ``r`` rounds with ``keys[r]`` (its
    stage-1 and stage-2 noise keys).  Inputs are quantized in their own dtype."""
    n, total = len(xs), xs[0].size
    w = lane_width(bits, n)
    l1, l2 = stage_levels(bits, n)
    sums = np.zeros(total, dtype=np.int64)
    for x, (key, _) in zip(xs, keys):
        mult1 = np.where(scale > 0, l1 / np.where(scale > 0, scale, 1.0), 0.0).astype(x.dtype)
        y = np.clip(x * mult1[seg], -l1, l1)
        sums += _round(y, kernels.noise(key, 0, total))
    assert np.abs(sums).max(initial=0) <= 2 ** (w - 1) - 1  # the lane bound
    k1 = 64 // w
    shard = _ceil(_ceil(total, k1), n) * k1  # elements per shard: whole words, equal shards
    out, part_max, steps = np.zeros(total), np.zeros(total), np.zeros(total)
    for r in range(n):
        lo, hi = r * shard, min(total, (r + 1) * shard)
        if lo >= hi:
            continue
        s_part = sums[lo:hi].astype(np.float64)
        part = seg[lo:hi]  # parts: the segments, cut at the shard's edges
        m = np.zeros(scale.size)
        np.maximum.at(m, part, np.abs(s_part))
        mult2 = np.where(m > 0, l2 / np.where(m > 0, m, 1.0), 0.0)
        codes = _round(np.clip(s_part * mult2[part], -l2, l2),
                       kernels.noise(keys[r][1], 0, hi - lo))
        step = (m[part] / l2) * (scale[part] / l1)
        scaled = (step * factor).astype(np.float32).astype(np.float64)
        out[lo:hi] = (codes * scaled).astype(np.float32)
        part_max[lo:hi], steps[lo:hi] = m[part], step
    return Result(out, sums, part_max, steps)


def simulate_hierarchical(xs: list[np.ndarray], numels: list[int], bits: int, seed: int,
                          factor: float, nodes: int, local: int, rank_of: dict,
                          block: int | None = None) -> np.ndarray:
    """Hierarchical two-stage: node sums in float64, each node shard (``local`` shards of
    whole ``bits``-lane words) summed two-stage across the ``nodes`` by the ranks holding
    that shard; ``rank_of[(c, j)]`` is the global rank of local rank ``j`` on node ``c``."""
    total = xs[0].size
    seg = segment_ids(numels, _block(block, bits))
    node_sum = [np.sum([xs[rank_of[(c, j)]].astype(np.float64) for j in range(local)], axis=0)
                for c in range(nodes)]
    scale = np.zeros(seg.max() + 1)
    for y in node_sum:
        np.maximum.at(scale, seg, np.abs(y))
    k = 64 // bits
    width = _ceil(_ceil(total, k), local) * k
    out = np.zeros(total)
    for j in range(local):
        lo, hi = j * width, min(total, (j + 1) * width)
        if lo >= hi:
            continue
        keys = [(core.noise_key(core.rank_seed(seed, rank_of[(c, j)]), 1),
                 core.noise_key(core.rank_seed(seed, rank_of[(c, j)]), 2))
                for c in range(nodes)]
        out[lo:hi] = across([y[lo:hi] for y in node_sum], seg[lo:hi], scale, bits, keys,
                            factor).out
    return out


def predicted_variance(xs: list[np.ndarray], numels: list[int], bits: int,
                       block: int | None = None) -> tuple[float, float]:
    """Expected squared error of the *sum*, summed over elements, for flat and two-stage
    Global-QSGD: unbiased rounding of ``y`` adds ``frac(y) (1 - frac(y))`` times the squared
    step.  Two-stage's second stage is estimated with its mean over a uniform fraction
    (1/6), taking each part's max |S| as ``n L1`` times the segment's share of the scale."""
    n = len(xs)
    seg = segment_ids(numels, _block(block, bits))
    scale = np.zeros(seg.max() + 1)
    for x in xs:
        np.maximum.at(scale, seg, np.abs(x.astype(np.float64)))

    def rounding(level: int) -> float:
        total = 0.0
        for x in xs:
            y = x.astype(np.float64) * (level / scale[seg])
            f = y - np.floor(y)
            total += float(np.sum(f * (1 - f) * (scale[seg] / level) ** 2))
        return total

    l1, l2 = stage_levels(bits, n)
    flat = rounding(core.flat_levels(bits, n))
    sums = sum(x.astype(np.float64) for x in xs)
    top = np.zeros(seg.max() + 1)
    np.maximum.at(top, seg, np.abs(sums))
    second = float(np.sum((top[seg] / l2) ** 2 / 6))
    return flat, rounding(l1) + second


def stage_one_rows(xs: list[np.ndarray], bits: int, keys: list[list[int]], divisor: float,
                   block: int | None = None, norm: str = "max") -> list[np.ndarray]:
    """FSDP2's reduce-scatter by stage 1 alone (hvd_gqsgd/fsdp.py's docstring): every rank's
    input ``xs[r]`` is ``n`` rows of ``S`` elements; each row is cut into scale blocks of
    ``block`` elements, quantized with ``L1`` levels and rounded with that rank's key for the
    row (``keys[r][row]``, the kernels' noise from the row's first element), and rank ``t``
    decodes the lane sums of row ``t``: ``sum * float32(s / L1 / divisor)`` rounded once to
    float32.  Returns each rank's shard (float32 values as float64)."""
    n = len(xs)
    shard = xs[0].size // n
    l1, _ = stage_levels(bits, n)
    w = lane_width(bits, n)
    rows = [x.reshape(n, shard) for x in xs]
    block = _block(block, bits)
    seg = np.arange(shard) // block if block else np.zeros(shard, dtype=np.int64)
    out = []
    for t in range(n):
        parts = [np.abs(r[t].astype(np.float64)) for r in rows]
        scale = np.zeros(seg.max() + 1)
        for p in parts:
            if norm == "max":
                np.maximum.at(scale, seg, p)
            else:
                scale = np.maximum(scale, np.sqrt(np.bincount(seg, p * p)))
        finite = np.all([np.isfinite(r[t]) for r in rows], axis=0)
        bad = np.bincount(seg, ~finite) > 0
        scale[bad] = np.inf
        sums = np.zeros(shard, dtype=np.int64)
        for r in range(n):
            ok = np.isfinite(scale) & (scale > 0)
            mult = np.where(ok, l1 / np.where(ok, scale, 1.0), 0.0).astype(rows[r].dtype)
            y = np.clip(np.nan_to_num(rows[r][t]) * mult[seg], -l1, l1)
            sums += _round(y, kernels.noise(keys[r][t], 0, shard))
        assert np.abs(sums).max(initial=0) <= 2 ** (w - 1) - 1  # the lane bound
        step = np.where(np.isfinite(scale), scale / l1, np.nan) / divisor
        out.append((sums * step[seg].astype(np.float32).astype(np.float64))
                   .astype(np.float32).astype(np.float64))
    return out
