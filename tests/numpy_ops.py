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
