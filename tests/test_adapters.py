"""Single-process: each framework adapter's primitives, run through the core's functions, give
exactly what the NumPy oracle gives for the same inputs and noise."""

from __future__ import annotations

import numpy as np
import pytest
from numpy_ops import NumpyOps

from hvd_gqsgd import core

NP = NumpyOps()


def _torch():
    import torch

    from hvd_gqsgd.torch import TorchBackend

    return TorchBackend(seed=0), torch.tensor, lambda t: t.numpy()


def _tf():
    import tensorflow as tf

    from hvd_gqsgd.tensorflow import TensorFlowBackend

    return TensorFlowBackend(seed=0), tf.constant, lambda t: t.numpy()


BACKENDS = {"torch": _torch, "tensorflow": _tf}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


@pytest.mark.parametrize("bits", [3, 8, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encode_and_unpack_match_numpy(backend, bits, dtype):
    ops, make, to_np = backend
    level = core.levels(bits, 2)
    rng = np.random.default_rng(bits)
    x = rng.normal(size=301).astype(dtype)
    x[:3] = [np.abs(x).max(), -np.abs(x).max(), 0.0]
    mult = dtype(level / np.abs(x).max())
    noise = rng.random(301).astype(dtype)
    expected = core.encode(NP, x, mult, noise, level, bits)
    got = core.encode(ops, make(x), make(np.full(301, mult)), make(noise), level, bits)
    np.testing.assert_array_equal(to_np(got), expected)
    summed = expected + core.encode(NP, -x, mult, noise, level, bits)
    np.testing.assert_array_equal(to_np(core.unpack(ops, make(summed), bits, 301)),
                                  core.unpack(NP, summed, bits, 301))


def test_multipliers_and_steps_match_numpy(backend):
    ops, make, to_np = backend
    scales = np.array([2.0, 0.0, np.inf, 0.5])
    np.testing.assert_array_equal(to_np(core.multipliers(ops, make(scales), 10)),
                                  core.multipliers(NP, scales, 10))
    np.testing.assert_array_equal(to_np(core.step_sizes(ops, make(scales), 10)),
                                  core.step_sizes(NP, scales, 10))


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_local_norms_match_numpy(backend, norm):
    ops, make, to_np = backend
    xs = [np.random.default_rng(i).normal(size=10 + i).astype(np.float32) for i in range(3)]
    xs[1][4] = np.nan
    tensors = [make(x) for x in xs]
    flat = ops.flat_concat(tensors)
    got = to_np(ops.local_norms(tensors, flat, [x.size for x in xs], norm, [7.0, -7.0]))
    for g, x in zip(got[:3], xs):
        if np.isnan(x).any():
            assert g == np.inf
        else:
            want = np.abs(x).max() if norm == "max" else np.linalg.norm(x.astype(np.float64))
            assert g == pytest.approx(want, rel=1e-6)
    assert list(got[3:]) == [7.0, -7.0]


def test_torch_input_that_requires_grad():
    import torch

    from hvd_gqsgd.torch import TorchBackend

    ops = TorchBackend(seed=0)
    x = torch.linspace(-1, 1, 40, requires_grad=True)
    flat = ops.flat_concat([x])
    norms = ops.local_norms([x], flat, [40], "max", [0.0, 0.0])
    assert norms[0].item() == 1.0
    words = ops.encode(flat, torch.tensor([63.0], dtype=torch.float64), [40], 63, 8, 0)
    sums = ops.decoder(words, 8, 40)
    got = ops.decode(sums, 0, x, torch.tensor(1 / 63, dtype=torch.float64))
    assert got.shape == x.shape and float((got - x.detach()).abs().max()) <= 1 / 63 + 1e-6
