"""The torch-ops path (what CUDA tensors run; here on CPU tensors with the kernels switched
off) keeps nothing per element between rounds, and reads from the device only what the
algorithm needs, once per bucket (issue 42).  The engine runs on tests/test_engine.py's fake
one-rank Horovod."""

from __future__ import annotations

import gc

import pytest
import torch
from test_engine import OneRank, _engine, _grid


def _torch_ops(backend: OneRank) -> OneRank:
    backend._fused = lambda t: False  # the CUDA path, on CPU tensors
    return backend


def _round(eng, backend, xs):
    ctxs = [eng.compress(x) for x in xs]
    backend.finish()
    return [eng.decompress(p, ctx) for p, ctx in ctxs]


def _tensor_elements(root, skip) -> int:
    """Elements of every torch tensor reachable from ``root``'s attributes (containers
    followed, tensors in ``skip`` not counted)."""
    seen, total, stack = set(), 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not any(obj is s for s in skip):
                total += obj.numel()
            continue
        if isinstance(obj, (str, bytes, int, float, type)) or callable(obj) and not hasattr(
                obj, "__dict__"):
            continue
        stack.extend(gc.get_referents(obj))
    return total


@pytest.mark.parametrize("two_stage", [False, True])
def test_no_per_element_state_survives_a_round(two_stage):
    """After rounds of a 600K-element bucket (plus small tensors; over the 2 MiB under which
    CPU buckets keep a flat buffer, FlatRows, which CUDA buckets never do), what the engine
    and its backend still hold is a few tables per scale block at most, not per element:
    no index table, multiplier or code buffer is kept."""
    b = _torch_ops(OneRank())
    eng = _engine(b, two_stage=two_stage, bucket_bytes=0)
    xs = [_grid(600_000, 0), _grid(1000, 1), _grid(3, 2)]
    for _ in range(2):
        outs = _round(eng, b, xs)
    for o, x in zip(outs, xs):  # one rank: within one step (0.25 / 127) of the input
        torch.testing.assert_close(o, x, rtol=0, atol=0.25 / 127)
    b.handles.clear()  # the fake Horovod's record of its collectives, not the library's
    kept = _tensor_elements(eng, skip=xs + outs)
    assert kept < sum(x.numel() for x in xs) / 64, kept  # a few tables per scale block


def test_the_bucket_reads_the_device_once_per_check_not_per_tensor(monkeypatch):
    """A round of 200 tensors in one bucket copies from the device to the host three times:
    the layout check, the first probe, and the comparison of every other probe with it at
    the end (a copy per tensor would wait for the CUDA stream 200 times)."""
    b = _torch_ops(OneRank())
    eng = _engine(b, bucket_bytes=0)
    xs = [_grid(40, i) for i in range(200)]
    _round(eng, b, xs)  # layouts, probes and tables made once
    reads = []
    for name in ("tolist", "item", "__bool__"):  # every way the code reads a device value
        original = getattr(torch.Tensor, name)

        def counted(self, original=original, name=name):
            reads.append((name, self.numel()))
            return original(self)

        monkeypatch.setattr(torch.Tensor, name, counted)
    outs = _round(eng, b, xs)
    monkeypatch.undo()
    assert len(reads) == 3, reads
    for o, x in zip(outs, xs):  # on the grid: exact up to the float32 rounding of s / L
        torch.testing.assert_close(o, x, rtol=1e-6, atol=1e-9)
