"""The torch backend on a CUDA device, in one process (the engine's fake one-rank Horovod of
tests/test_engine.py): a round's results, and Horovod's probes, which live on the
gradient's device and are reused from round to round.  Skipped where torch sees no CUDA
device (the project's CI machines have none); run on a GPU machine with
``python -m pytest tests/test_cuda.py tests/test_engine.py``."""

from __future__ import annotations

import pytest
import torch
from test_engine import OneRank, _engine, _grid

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("two_stage", [False, True])
def test_a_round_on_cuda_tensors(two_stage):
    """Grid values quantize exactly at one rank, so each result is its input, on its device."""
    b = OneRank()
    eng = _engine(b, bucket_bytes=400, two_stage=two_stage)
    xs = [_grid(100, i).cuda() for i in range(3)] + [_grid(10, 3).cuda().half()]
    for _ in range(2):  # the second round reuses the first one's probes
        probes = [eng.compress(x) for x in xs]
        assert all(p.device == x.device and p.tolist() == [1.0, 1.0]
                   for (p, _), x in zip(probes, xs))
        b.finish()
        for (p, ctx), x in zip(probes, xs):
            p.mul_(0.5)  # reduced in place, with a postscale of 1/2
            out = eng.decompress(p, ctx)
            assert out.device == x.device and out.dtype == x.dtype
            torch.testing.assert_close(out, x / 2, rtol=1e-3 if x.dtype == torch.half else 1e-6,
                                       atol=1e-9)
    assert eng.stats.rounds == 2


def test_cuda_probes_are_reused_only_after_their_round():
    b = OneRank()
    eng = _engine(b)
    xs = [_grid(10, i).cuda() for i in range(70)]
    first = [eng.compress(x) for x in xs]
    assert len({p.data_ptr() for p, _ in first}) == len(xs)
    b.finish()
    for p, ctx in first:
        p.fill_(0.25)
        eng.decompress(p, ctx)
    second = [eng.compress(x) for x in xs]
    assert [p.data_ptr() for p, _ in second] == [p.data_ptr() for p, _ in first]
    assert all(p.tolist() == [1.0, 1.0] for p, _ in second)
