"""Single-process: each framework adapter's primitives, run through the core's functions, give
exactly what the NumPy oracle gives for the same inputs and noise."""

from __future__ import annotations

import numpy as np
import pytest

from gqsgd_lab.numpy_ops import NumpyOps
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
    scales = np.array([2.0, 0.0, np.inf, 0.5, 2.0**-100, 2.0**-101])
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


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_local_norms_per_block(backend, norm):
    """scale_block segments: one norm per block of each tensor; a NaN poisons only its block."""
    ops, make, to_np = backend
    xs = [np.random.default_rng(i).normal(size=n).astype(np.float32)
          for i, n in enumerate((23, 8))]
    xs[0][12] = np.nan
    counts, first = core.segments([x.size for x in xs], 5)
    assert counts == (5, 5, 5, 5, 3, 5, 3) and first == [0, 5, 7]
    flat = ops.flat_concat([make(x) for x in xs])
    got = to_np(ops.local_norms([make(x) for x in xs], flat, counts, norm, [1.0, -1.0]))
    cat, pos = np.concatenate(xs), np.cumsum([0, *counts])
    for k in range(len(counts)):
        part = cat[pos[k]:pos[k + 1]].astype(np.float64)
        want = np.inf if np.isnan(part).any() else (
            np.abs(part).max() if norm == "max" else np.linalg.norm(part))
        assert got[k] == pytest.approx(want, rel=1e-6), k
    assert np.isinf(got[2]) and np.isfinite(got[[0, 1, 3, 4, 5, 6]]).all()


@pytest.mark.parametrize("path", ["torch-fused", "torch-generic", "tensorflow"])
@pytest.mark.parametrize("block", [0, 4, 7])
def test_decode_with_per_block_scales(path, block):
    ops, make, to_np = BACKENDS[path.split("-")[0]]()
    if path == "torch-generic":  # the CUDA path, here on CPU tensors
        ops._fused = lambda t: False
    bits, total, offset, numel = 8, 40, 9, 25
    codes = np.random.default_rng(block).integers(-63, 64, total)
    words = core.pack(NP, codes, bits)
    state = ops.decoder(make(words), bits, total)
    like = make(np.zeros((5, 5), np.float32))
    nblocks = -(-numel // block) if block else 1
    scales = np.linspace(0.5, 2.0, nblocks)
    scale = make(scales if block else scales[0])
    got = to_np(ops.decode(state, offset, like, scale, block))
    per_element = np.repeat(scales, block)[:numel] if block else scales[0]
    want = (codes[offset:offset + numel] * per_element.astype(np.float32)).astype(np.float32)
    assert got.shape == (5, 5)
    np.testing.assert_array_equal(got.reshape(-1), want)


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
    got = ops.decode(sums, 0, x, torch.tensor(1 / 63, dtype=torch.float64), 0)
    assert got.shape == x.shape and float((got - x.detach()).abs().max()) <= 1 / 63 + 1e-6


@pytest.mark.parametrize("dtypes, want", [
    (("float32", "float32"), "float32"),
    (("float16", "bfloat16", "float32"), "float32"),
    (("float16", "float16"), "float32"),
    (("float32", "float64"), "float64"),
])
def test_torch_flat_concat_dtype_and_fresh_buffer(dtypes, want):
    """A bucket of several tensors is copied, in float64 when one of them is, else float32,
    into recycled host memory that no earlier bucket still holds (shapes kept in order)."""
    import torch

    from hvd_gqsgd.torch import TorchBackend

    ops = TorchBackend(seed=0)
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (2, 2, 2)][:len(dtypes)]
    tensors = [torch.tensor(rng.normal(size=s)).to(getattr(torch, d)).requires_grad_()
               for s, d in zip(shapes, dtypes)]
    big = [torch.randn(600_000) for _ in range(2)]  # past the pool's threshold: recycled
    held = ops.flat_concat(big)
    for _ in range(2):  # the second call may reuse memory the first one freed
        flat = ops.flat_concat(tensors)
        assert flat.dtype == getattr(torch, want) and not flat.requires_grad
        want_np = np.concatenate([t.detach().to(torch.float64).numpy().reshape(-1)
                                  for t in tensors]).astype(want)
        np.testing.assert_array_equal(flat.numpy(), want_np)
        again = ops.flat_concat(big)
        assert again.data_ptr() != held.data_ptr()  # held is still in use
        np.testing.assert_array_equal(held.numpy(), torch.cat(big).numpy())
        del again
