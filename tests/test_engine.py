"""The engine's schedule (issue 26), in one process: buckets sealed from ``compress``, their
scale exchange asynchronous, codes launched by a later ``compress`` once it has finished,
``decompress`` waiting only for what it needs.  A one-rank fake Horovod (the torch backend's
local half, with collectives whose completion the test controls) records every collective;
multi-rank behaviour through real Horovod is in tests/test_multiproc.py
(``test_buckets_go_on_the_wire_while_backward_runs``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_gqsgd import core
from hvd_gqsgd.engine import Engine
from hvd_gqsgd.torch_ops import TorchLocal


class _Set:
    def included(self):
        return True

    def rank(self):
        return 0

    def size(self):
        return 1


class _Handle:
    def __init__(self, value):
        self.value, self.ready = value, False


class OneRank(TorchLocal):
    """One rank's collectives (a sum or max over one rank is the input); each handle stays
    not ready until the test calls :meth:`finish`.  ``log`` lists (event, name)."""

    def __init__(self, auto: int = core.AUTO_BUCKET_BYTES):
        super().__init__(seed=3)
        self.log: list[tuple[str, str]] = []
        self.handles: list[_Handle] = []
        self.auto = auto

    def _start(self, what, value, name):
        self.log.append((what, name))
        handle = _Handle(value)
        self.handles.append(handle)
        return handle

    def finish(self):
        for h in self.handles:
            h.ready = True

    def global_process_set(self):
        return _Set()

    def allreduce_max(self, vec, name, pset):  # pragma: no cover - the engine must not block
        raise AssertionError("blocking scale exchange")

    def allreduce_max_async(self, vec, name, pset):
        return self._start("max", vec.clone(), name)

    def allreduce_sum_async(self, words, name, pset):
        return self._start("sum", words, name)

    def reducescatter_sum_async(self, words, name, pset):
        return self._start("rs", words, name)

    def allgather_async(self, tensor, name, pset):
        return self._start("ag", tensor, name)

    def poll(self, handle):
        return handle.ready

    def wait(self, handle):
        if not handle.ready:
            self.log.append(("blocked", ""))
            handle.ready = True
        return handle.value

    def auto_bucket_bytes(self):
        return self.auto


def _grid(numel: int, seed: int) -> torch.Tensor:
    """Values on the 8-bit one-rank grid of their block's max: quantized exactly."""
    rng = np.random.default_rng(seed)
    k = rng.integers(-127, 128, numel)
    k[0] = 127
    return torch.tensor(k * 0.25 / 127, dtype=torch.float32)


def _engine(backend, **settings):
    return Engine(backend, core.Settings(bits=8, **settings), None, uid=0)


def _events(backend):
    return [e for e, _ in backend.log]


@pytest.mark.parametrize("two_stage", [False, True])
def test_full_bucket_sealed_in_compress_and_sent_by_the_next(two_stage):
    b = OneRank()
    eng = _engine(b, bucket_bytes=400, two_stage=two_stage)
    xs = [_grid(100, i) for i in range(3)]  # 400 bytes each: one bucket per tensor
    probes = []
    probes.append(eng.compress(xs[0]))
    assert _events(b) == ["max"]  # sealed, exchange started, nothing waited for
    probes.append(eng.compress(xs[1]))
    assert _events(b) == ["max", "max"]  # bucket 0's scales are not back yet: no codes
    b.finish()
    probes.append(eng.compress(xs[2]))
    first = "rs" if two_stage else "sum"
    # bucket 2 is sealed, then buckets 0 and 1 advance (two-stage: to their reduce-scatters)
    assert _events(b) == ["max", "max", "max", first, first]
    if two_stage:
        b.finish()
        xs.append(_grid(10, 3))  # too small to seal a bucket, but moves the queue on
        probes.append(eng.compress(xs[3]))
        assert _events(b)[5:] == ["ag", "ag", "rs"]  # 0, 1 requantized and gathered; 2 on
    outs = [eng.decompress(p, ctx) for p, ctx in probes]
    for x, out in zip(xs, outs):  # grid values: exact codes (one step is 2e-3)
        torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-9)
    assert ("blocked", "") in b.log  # bucket 2 was still in flight: decompress waited
    assert eng.stats.rounds == 1 and eng.stats.tensors == len(xs)


def test_decompress_waits_only_for_buckets_up_to_its_own():
    b = OneRank()
    eng = _engine(b, bucket_bytes=400, two_stage=False)
    xs = [_grid(100, i) for i in range(3)]
    probes = [eng.compress(x) for x in xs]
    assert _events(b) == ["max"] * 3
    out = eng.decompress(*probes[0])  # needs bucket 0 only
    torch.testing.assert_close(out, xs[0], rtol=1e-6, atol=1e-9)
    assert _events(b) == ["max"] * 3 + ["blocked", "sum", "blocked"]
    b.finish()
    for x, p in zip(xs[1:], probes[1:]):
        torch.testing.assert_close(eng.decompress(*p), x, rtol=1e-6, atol=1e-9)
    assert _events(b).count("sum") == 3


def test_bucketing_depends_on_the_round_alone():
    """The same tensors make the same buckets and names whatever ran before (a rank that
    elastic adds mid-run has no history): a partly filled last bucket is always sealed by
    the first decompress, also after rounds of other sizes."""
    def schedule(history):
        b = OneRank(auto=1 << 20)  # automatic buckets far larger than the tensors
        eng = _engine(b)  # bucket_bytes=None: the backend's choice
        for numels in history + [[50, 50, 50, 50]]:
            b.log.clear()
            xs = [_grid(k, i) for i, k in enumerate(numels)]
            probes = [eng.compress(x) for x in xs]
            assert b.log == []  # nothing full: nothing sealed in compress
            b.finish()
            for x, p in zip(xs, probes):
                torch.testing.assert_close(eng.decompress(*p), x, rtol=1e-6, atol=1e-9)
        return [e for e in b.log if e[0] != "blocked"]

    fresh = schedule([])
    assert fresh == [("max", "gqsgd.0.b0.scale"), ("sum", "gqsgd.0.b0.codes")]
    assert schedule([[50, 50, 50, 50], [7], [50]]) == fresh


def test_bucket_bytes_zero_and_hierarchical_seal_only_in_decompress():
    eng = _engine(OneRank(auto=1), bucket_bytes=0)
    for _ in range(2):  # also once the round's size is known
        eng.backend.log.clear()
        probes = [eng.compress(_grid(50, i)) for i in range(3)]
        assert eng.backend.log == []
        for p in probes:
            eng.decompress(*p)
        assert _events(eng.backend) == ["max", "blocked", "sum", "blocked"]
    # hierarchical's collectives block, so its automatic bucket_bytes is 0 (compress only
    # queues; its decompress needs real Horovod: tests/test_hierarchical.py)
    eng = _engine(OneRank(auto=1), hierarchical=True, chunk_bytes=0)
    held = [eng.compress(_grid(50, i)) for i in range(3)]  # a caller holds its ctxs
    assert eng.backend.log == [] and len(eng._round.queued) == len(held)


def test_bucket_bytes_is_validated():
    assert core.Settings().bucket_bytes is None
    with pytest.raises(ValueError, match="None \\(automatic\\) or an int >= 0"):
        core.Settings(bucket_bytes=-1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        core.Settings(bucket_bytes=1.5)  # type: ignore[arg-type]


def test_a_failure_in_compress_resets_the_round():
    b = OneRank()
    eng = _engine(b, bucket_bytes=400, two_stage=False)
    held = eng.compress(_grid(100, 0))  # noqa: F841 -- a caller holds its ctx
    b.finish()
    b.handles[0].value[-1] = 1.0  # a layout mismatch: max(h) != -max(-h)
    with pytest.raises(RuntimeError, match="ranks compressed different tensors"):
        eng.compress(_grid(100, 1))  # the error surfaces where the exchange is waited for
    assert eng._round.pending == [] and eng._round.queued == []


def test_probes_are_reused_only_after_their_round():
    """Horovod reduces each probe in place.  Within a round every tensor gets a probe of its
    own (no shared memory); once the round's results are all taken, the next round hands
    the same tensors out again, their values restored; after a failed round none of its
    probes comes back, since some may still be inside a collective."""
    from hvd_gqsgd.torch_ops import PROBE_BLOCK

    b = OneRank()
    eng = _engine(b)
    xs = [_grid(10, i) for i in range(PROBE_BLOCK + 36)]  # two blocks of rows

    def compress_all():
        probes = [eng.compress(x) for x in xs]
        assert all(p.tolist() == [1.0, 1.0] for p, _ in probes)  # one rank: [1, rank + 1]
        assert len({p.data_ptr() for p, _ in probes}) == len(xs)
        b.finish()
        return probes

    first = compress_all()
    for x, (p, ctx) in zip(xs, first):
        p.fill_(0.5)  # reduced in place, as by a postscale of 1/2: a factor of 1/2
        torch.testing.assert_close(eng.decompress(p, ctx), x / 2, rtol=1e-6, atol=1e-9)
    second = compress_all()  # values restored
    assert [p.data_ptr() for p, _ in second] == [p.data_ptr() for p, _ in first]
    for x, (p, ctx) in zip(xs[:3], second[:3]):
        torch.testing.assert_close(eng.decompress(p, ctx), x, rtol=1e-6, atol=1e-9)
    # a probe that no sum produces: found once the bucket's last tensor is taken (the
    # probes of a bucket are read together, one host copy per bucket)
    eng.decompress(torch.tensor([1.0, 5.0], dtype=torch.float64), second[3][1])
    for p, ctx in second[4:-1]:
        eng.decompress(p, ctx)
    with pytest.raises(ValueError, match="op=Sum or op=Average"):
        eng.decompress(second[-1][0], second[-1][1])
    failed = {p.data_ptr() for p, _ in second}
    third = compress_all()  # the failed round's probes may be in flight: all new
    assert not {p.data_ptr() for p, _ in third} & failed
    for x, (p, ctx) in zip(xs, third):
        torch.testing.assert_close(eng.decompress(p, ctx), x, rtol=1e-6, atol=1e-9)
    fourth = compress_all()  # after a clean round: its probes again, never the failed one's
    assert [p.data_ptr() for p, _ in fourth] == [p.data_ptr() for p, _ in third]
    for x, (p, ctx) in zip(xs, fourth):
        torch.testing.assert_close(eng.decompress(p, ctx), x, rtol=1e-6, atol=1e-9)
    assert eng.stats.rounds == 3


def test_bucket_buffers_are_reused_only_after_their_round():
    """A CPU bucket of several tensors is copied into a flat buffer kept from round to round
    (``torch_ops.FlatRows``): two buckets of one layout in a round get two buffers, a clean
    round's buffers come back the next round in the same order, a failed round's never (one
    may still be read by a collective), and every round's results are right."""
    b = OneRank()
    flats = []
    real = b.round_flat
    b.round_flat = lambda tensors: flats.append(real(tensors)) or flats[-1]
    eng = _engine(b, bucket_bytes=800)
    shapes = [(10, 10), (100,), (10, 10), (100,), (4, 25)]  # buckets: 2 + 2 + 1 tensors
    xs = [_grid(100, i).view(s) for i, s in enumerate(shapes)]

    def one_round(fail_at=None):
        flats.clear()
        probes = [eng.compress(x) for x in xs]
        b.finish()
        for i, (x, (p, ctx)) in enumerate(zip(xs, probes)):
            if i == fail_at:
                with pytest.raises(ValueError, match="op=Sum or op=Average"):
                    eng.decompress(torch.tensor([1.0, 5.0], dtype=torch.float64), ctx)
                break
            out = eng.decompress(p, ctx)
            assert out.shape == x.shape
            torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-9)
        return [f.data_ptr() for f in flats]

    def held():  # the round's buffers, as a collective still reading them would hold them
        return list(flats)

    first = one_round()
    assert len(first) == 3 and first[0] != first[1]  # one layout, two buffers
    assert first[2] == xs[4].data_ptr()  # a bucket of one tensor is that tensor, no copy
    assert one_round() == first
    failed = one_round(fail_at=1)  # fails in the first bucket: the last is never sealed
    assert failed == first[:2]
    in_flight = held()
    after = one_round()  # the failed round's buffers may be in flight: all new
    assert not set(after[:2]) & set(failed)
    del in_flight
    assert one_round() == after
    assert eng.stats.rounds == 4


def test_bucket_layouts_are_told_apart_by_dtype():
    """The engine works a bucket's segments and fingerprint out once per layout; tensors of
    the same sizes in another dtype are another layout (another fingerprint, so ranks that
    disagree on dtypes still fail the layout check)."""
    b = OneRank()
    eng = _engine(b)
    for dtype in (torch.float32, torch.float64, torch.float32):
        xs = [_grid(100, i).to(dtype) for i in range(3)]
        probes = [eng.compress(x) for x in xs]
        b.finish()
        for x, (p, ctx) in zip(xs, probes):
            out = eng.decompress(p, ctx)
            assert out.dtype == dtype
            torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-9)
    layouts = list(eng._layouts.values())
    assert len(layouts) == 2 and layouts[0].fingerprint != layouts[1].fingerprint
    assert layouts[0].fingerprint == core.layout_fingerprint([100] * 3, ["float32"] * 3)


def test_a_round_nobody_can_finish_is_dropped_at_the_next_compress():
    """After a step fails outside GlobalQSGD (a Horovod elastic reset drops the optimizer's
    ctxs), the round holds tensors that no caller can decompress.  The next compress drops it,
    with a warning: the new round gets none of its tensors, its names start again from the
    first (as a rank that elastic has just added starts them), its probes are new (the dead
    round's may still be in a collective), and it ends and counts as a round."""
    b = OneRank()
    eng = _engine(b, bucket_bytes=400, two_stage=False)
    xs = [_grid(100, i) for i in range(3)]  # 400 bytes each: a bucket each
    dead = [eng.compress(x) for x in xs[:2]]  # both sealed, their scales never come back
    in_flight = [p for p, _ in dead]  # the probes, as a collective still holding them would
    del dead  # the ctxs go, as elastic's state restore drops them
    b.log.clear()
    with pytest.warns(RuntimeWarning, match="dropped an unfinished round: 2 tensor"):
        probes = [eng.compress(x) for x in xs]
    assert b.log[0] == ("max", "gqsgd.0.b0.scale")  # names start again
    assert not {p.data_ptr() for p, _ in probes} & {p.data_ptr() for p in in_flight}
    b.finish()
    for x, (p, ctx) in zip(xs, probes):
        torch.testing.assert_close(eng.decompress(p, ctx), x, rtol=1e-6, atol=1e-9)
    assert eng.stats.rounds == 1 and eng.stats.tensors == len(xs)


def test_a_ctx_is_finished_once_and_only_in_its_own_round():
    """A ctx decompressed twice, or one of a round that an error abandoned, is refused with
    an error that says which; the refusal leaves the round in progress intact.  A round that
    some caller still holds a ctx of is never dropped."""
    b = OneRank()
    eng = _engine(b, bucket_bytes=400, two_stage=False)
    xs = [_grid(100, i) for i in range(3)]
    failed = [eng.compress(x) for x in xs]
    b.finish()
    with pytest.raises(ValueError, match="op=Sum or op=Average"):
        eng.decompress(torch.tensor([1.0, 5.0], dtype=torch.float64), failed[0][1])
    with pytest.raises(RuntimeError, match="its round was abandoned"):
        eng.decompress(*failed[1])
    kept = [eng.compress(x) for x in xs]
    b.finish()
    eng.decompress(*kept[0])
    with pytest.raises(RuntimeError, match="decompressed already"):
        eng.decompress(*kept[0])
    more = eng.compress(xs[0])  # the round goes on: kept[1:] are still held
    for p, ctx in [*kept[1:], more]:
        eng.decompress(p, ctx)
    assert eng.stats.rounds == 1 and eng.stats.tensors == len(xs) + 1
