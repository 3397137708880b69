"""A NumPy implementation of ``hvd_gqsgd.core.TensorOps`` for single-process tests."""

from __future__ import annotations

import numpy as np


class NumpyOps:
    def floor(self, x):
        return np.floor(x)

    def clamp(self, x, low, high):
        return np.clip(x, low, high)

    def less(self, a, b):
        return a < b

    def to_int64(self, x):
        return np.asarray(x).astype(np.int64)

    def pad_reshape(self, x, rows, cols):
        return np.pad(x, (0, rows * cols - x.size)).reshape(rows, cols)

    def column(self, x, k):
        return x[:, k]

    def stack_columns(self, cols, numel):
        return np.stack(cols, axis=1).reshape(-1)[:numel]

    def bitand(self, x, mask):
        return np.bitwise_and(x, mask)

    def rshift(self, x, shift):
        return np.right_shift(x, shift)

    def isfinite(self, x):
        return np.isfinite(x)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def copy(self, x):
        return np.array(x, copy=True)

    def row_index(self, starts, width, like):
        return np.asarray(starts, dtype=np.int64).reshape(-1, 1) + np.arange(width)

    def gather_rows(self, x, index):
        return x[index]

    def scatter_rows(self, out, index, rows):
        out[index] = rows
        return out

    def butterfly(self, rows, h):
        pairs = rows.reshape(rows.shape[0], -1, 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        return np.stack([a + b, a - b], axis=2).reshape(rows.shape)

    def bitxor(self, x, y):
        return np.bitwise_xor(x, y)

    def cast_like(self, x, like):
        return np.asarray(x).astype(like.dtype)
