"""Goal 2 of the performance issue: step time of a 300-tensor model (150 Linear(32, 32)
layers) with DistributedOptimizer, GlobalQSGD(bits=8) vs uncompressed, on unthrottled loopback.

    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/small_tensors.py

Prints the median step time of each and their ratio (goal: <= 1.5x), then one JSON line
per compressor (``--compressors``: names as in gqsgd_lab/bench_common.py, e.g.
``gqsgd8b0k`` for ``bucket_bytes=0``; benchmarks/deep_bench.py reads them).

``floor`` is not a compressor but the part of a GlobalQSGD step that no local speed-up
removes: Horovod gets the same 2-element probe per tensor, and after backward the first
``decompress`` makes the same two blocking collectives (a MAX allreduce of one float64 per
tensor plus two, then a Sum allreduce of the bucket's packed 8-bit words), but nothing is
quantized and the gradients stay local.  GlobalQSGD's own work is the gap between it and
``gqsgd8``.  Its probes are made once and reused, as GlobalQSGD's are
(``hvd_gqsgd.torch_ops.ProbeRows``); ``floorfresh`` builds a fresh one per tensor per step
instead, which is what GlobalQSGD did before.

``floorcpu`` is ``floor`` plus busy work as long as GlobalQSGD's own CPU a round, measured
in the same process beforehand without Horovod (gqsgd_lab/one_rank.py's one-rank engine
on this model's gradients; printed): its ``compress`` share spread over the ``compress``
calls, its ``decompress`` share at the first ``decompress``, before the exchanges.  Where
``gqsgd8`` lands on ``floorcpu``, its step is Horovod's part plus its own measured CPU, as
much as that CPU costs on these 2 shared cores, and nothing else; reaching a ratio then
needs ``floorcpu`` itself to reach it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # one thread, as with 2 ranks on 2 cores

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from gqsgd_lab import one_rank  # noqa: E402
from gqsgd_lab.bench_common import compressor  # noqa: E402
from hvd_gqsgd import core  # noqa: E402
from hvd_gqsgd.engine import Engine  # noqa: E402

WIDTH, DEPTH = 32, 150  # the model: DEPTH Linear(WIDTH, WIDTH) layers


class Floor:
    """Horovod's side of a GlobalQSGD round without GlobalQSGD's work (see the docstring).
    Not a compressor: decompress returns the local gradient."""

    def __init__(self, fresh: bool = False) -> None:
        self.queued: list[torch.Tensor] = []
        self.exchanged = False
        self.fresh = fresh
        self.probes: list[torch.Tensor] = []  # made once and reused, unless fresh

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.queued.append(tensor)
        if self.fresh:
            return self._new_probe(), tensor
        if len(self.probes) < len(self.queued):
            self.probes.append(self._new_probe())
        return self.probes[len(self.queued) - 1], tensor

    @staticmethod
    def _new_probe() -> torch.Tensor:
        return torch.tensor(core.probe_values(hvd.rank()), dtype=torch.float64)

    def decompress(self, probe: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        if not self.exchanged:
            n = len(self.queued)
            hvd.allreduce(torch.zeros(n + 2, dtype=torch.float64), name="floor.scale",
                          op=hvd.Max)
            words = core.packed_words(sum(t.numel() for t in self.queued), 8)
            hvd.allreduce(torch.zeros(words, dtype=torch.int64), name="floor.codes", op=hvd.Sum)
            self.exchanged = True
        self.queued.pop()
        if not self.queued:
            self.exchanged = False
        return tensor


class FloorCPU(Floor):
    """``floor`` plus busy work standing for GlobalQSGD's own CPU (see the docstring)."""

    def __init__(self, compress_s: float, decompress_s: float, tensors: int) -> None:
        super().__init__()
        self.per_compress = compress_s / tensors
        self.decompress_s = decompress_s

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _busy(self.per_compress)
        return super().compress(tensor)

    def decompress(self, probe: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        if not self.exchanged:
            _busy(self.decompress_s)
        return super().decompress(probe, tensor)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@functools.cache
def own_cpu(rounds: int = 50) -> tuple[float, float]:
    """GlobalQSGD(8)'s own CPU a round on this model's gradients, without Horovod (one-rank
    engine, gqsgd_lab/one_rank.py): median seconds in its compress calls and in its
    decompress calls."""
    engine = Engine(one_rank.Local(seed=0), core.Settings(bits=8), None, uid=0)
    grads = one_rank.gradients(WIDTH, DEPTH)
    for _ in range(5):  # compile the kernels, fill the caches
        one_rank.split_round(engine, grads)
    compress_s, decompress_s = zip(*(one_rank.split_round(engine, grads)
                                     for _ in range(rounds)))
    return statistics.median(compress_s), statistics.median(decompress_s)


def make_compressor(name: str):
    """``--compressors`` names: ``floor``/``floorfresh``/``floorcpu`` (see the docstring) or
    a name of gqsgd_lab/bench_common.py."""
    if name == "floorcpu":
        return FloorCPU(*own_cpu(), tensors=2 * DEPTH)
    if name.startswith("floor"):
        return Floor(fresh=name == "floorfresh")
    return compressor(name, hvd)


def training_step(compression) -> Callable[[], None]:
    """The 300-tensor model under ``hvd.DistributedOptimizer``: one training step a call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    x = torch.randn(16, WIDTH)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return step


def step_times(compression, steps: int, warmup: int) -> list[float]:
    step = training_step(compression)
    times = []
    for i in range(warmup + steps):
        hvd.allreduce(torch.zeros(1), name="sync")  # start every step together
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compressors", default="none,gqsgd8")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    names = args.compressors.split(",")
    if "floorcpu" in names:
        own_cpu()  # before any step, on every rank alike
    results: dict[str, list[float]] = {}
    for _ in range(2):  # interleave to even out machine noise
        for name in names:
            results.setdefault(name, []).extend(
                step_times(make_compressor(name), args.steps, args.warmup))
    if hvd.rank() == 0:
        if "floorcpu" in names:
            c, d = own_cpu()
            print(f"GlobalQSGD's own CPU a round without Horovod (floorcpu's busy work): "
                  f"{1e3 * (c + d):.2f} ms ({1e3 * c:.2f} in compress, {1e3 * d:.2f} in "
                  "decompress)")
            print(json.dumps({"what": "small_own_cpu", "compress_s": c, "decompress_s": d}))
        med = {k: statistics.median(v) for k, v in results.items()}
        for name in names[1:]:
            goal = " (goal <= 1.5x)" if name.startswith("gqsgd") else ""
            print(f"300 tensors, {hvd.size()} ranks: none {1e3 * med['none']:.2f} ms/step, "
                  f"{name} {1e3 * med[name]:.2f} ms/step, "
                  f"ratio {med[name] / med['none']:.2f}x{goal}")
        for name in names:
            print(json.dumps({"what": f"small_{name}", "median_s": med[name],
                              "ranks": hvd.size()}), flush=True)


if __name__ == "__main__":
    main()
