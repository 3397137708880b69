"""A NumPy oracle of the rotation, written from its definition (hvd_gqsgd/core.py's module
docstring, "Rotation"), not from the code under test.

* ``sylvester``: the Hadamard matrix by Sylvester's construction, to check the butterflies
  in float64 (where, for small integers, both are exact).
* ``butterflies``: the canonical butterfly order, vectorized over blocks, in the rows' own
  dtype.  ``forward`` and ``inverse`` apply it to a bucket's full blocks.
* ``sign_of``: a block element's sign in Python integers, one at a time, to check
  ``kernels.signs`` (the shared definition of the hash that ``forward`` uses, as
  gqsgd_lab/two_stage_oracle.py shares ``kernels.noise``).
"""

from __future__ import annotations

import numpy as np

from hvd_gqsgd import kernels

M32 = 0xFFFFFFFF


def sylvester(block: int) -> np.ndarray:
    """H_1 = [1]; H_2n = [[H_n, H_n], [H_n, -H_n]] (float64)."""
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return h


def butterflies(rows: np.ndarray) -> np.ndarray:
    """Rows of ``B`` elements times H_B: for h = 1, 2, ..., B/2 and every j with (j // h)
    even, (v[j], v[j+h]) = (v[j] + v[j+h], v[j] - v[j+h]), in ``rows``' dtype."""
    v = np.array(rows, copy=True)
    width = v.shape[1]
    j = np.arange(width)
    h = 1
    while h < width:
        top = j[(j // h) % 2 == 0]
        a, b = v[:, top].copy(), v[:, top + h].copy()
        v[:, top], v[:, top + h] = a + b, a - b
        h *= 2
    return v


def full_block_starts(counts: list[int], block: int) -> np.ndarray:
    starts, pos = [], 0
    for c in counts:
        if c == block:
            starts.append(pos)
        pos += c
    return np.asarray(starts, dtype=np.int64)


def _blocks(x: np.ndarray, counts: list[int], block: int, key: int, start: int):
    starts = full_block_starts(counts, block)
    index = starts[:, None] + np.arange(block)
    d = np.array([kernels.signs(key, start + int(g), block) for g in starts],
                 dtype=x.dtype).reshape(index.shape)
    return index, d


def forward(x: np.ndarray, counts: list[int], block: int, key: int, start: int = 0
            ) -> np.ndarray:
    """Every full block b of ``x`` replaced by H_B (d_b * x_b); the rest unchanged."""
    index, d = _blocks(x, counts, block, key, start)
    out = x.copy()
    out[index] = butterflies(x[index] * d)
    return out


def inverse(y: np.ndarray, counts: list[int], block: int, key: int, start: int = 0
            ) -> np.ndarray:
    """Every full block b of ``y`` replaced by d_b * ((H_B y_b) * (1/B))."""
    index, d = _blocks(y, counts, block, key, start)
    out = y.copy()
    out[index] = butterflies(y[index]) * y.dtype.type(1.0 / block) * d
    return out


def _mix32(z: int) -> int:
    z = ((z ^ (z >> 16)) * 0x7FEB352D) & M32
    z = ((z ^ (z >> 15)) * 0x846CA68B) & M32
    return z ^ (z >> 16)


def sign_of(key: int, g: int, t: int) -> float:
    """The sign of element ``t`` of the full block that starts at global element ``g``:
    -1 when bit ``t % 32`` of the hash of index ``g + t // 32`` is set."""
    i = g + t // 32
    seed = (key & M32) ^ _mix32(((key >> 32) + (i >> 32)) & M32)
    return -1.0 if (_mix32(((i & M32) + seed) & M32) >> (t % 32)) & 1 else 1.0


def norms(y: np.ndarray, counts: list[int], norm: str) -> np.ndarray:
    """Per segment max |y| or L2 norm in float64, inf for a segment with a NaN/Inf."""
    out = []
    for seg in np.split(y.astype(np.float64), np.cumsum(counts)[:-1]):
        if not np.isfinite(seg).all():
            out.append(np.inf)
        else:
            out.append(np.abs(seg).max() if norm == "max" else np.sqrt((seg * seg).sum()))
    return np.asarray(out)
