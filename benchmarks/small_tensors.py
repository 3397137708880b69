"""Goal 2 of the performance issue: step time of a 300-tensor model (150 Linear(32, 32)
layers) with DistributedOptimizer, GlobalQSGD(bits=8) vs uncompressed, on unthrottled loopback.

    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/small_tensors.py

Prints the median step time of each and their ratio (goal: <= 1.5x), then one JSON line
per compressor (``--compressors``: names as in benchmarks/bench_common.py, e.g.
``gqsgd8b0k`` for ``bucket_bytes=0``; benchmarks/deep_bench.py reads them).

``floor`` is not a compressor but the part of a GlobalQSGD step that no local speed-up
removes: Horovod gets the same 2-element probe per tensor, and after backward the first
``decompress`` makes the same two blocking collectives (a MAX allreduce of one float64 per
tensor plus two, then a Sum allreduce of the bucket's packed 8-bit words), but nothing is
quantized and the gradients stay local.  GlobalQSGD's own work is the gap between it and
``gqsgd8``.  Its probes are made once and reused, as GlobalQSGD's are
(``hvd_gqsgd.torch_ops.ProbeRows``); ``floorfresh`` builds a fresh one per tensor per step
instead, which is what GlobalQSGD did before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch
from bench_common import compressor

from hvd_gqsgd import core


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


def make_compressor(name: str):
    """``--compressors`` names: ``floor``/``floorfresh`` (see the docstring) or a name of
    benchmarks/bench_common.py."""
    if name.startswith("floor"):
        return Floor(fresh=name == "floorfresh")
    return compressor(name, hvd)


def training_step(compression) -> Callable[[], None]:
    """The 300-tensor model under ``hvd.DistributedOptimizer``: one training step a call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(150)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    x = torch.randn(16, 32)

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
    results: dict[str, list[float]] = {}
    for _ in range(2):  # interleave to even out machine noise
        for name in names:
            results.setdefault(name, []).extend(
                step_times(make_compressor(name), args.steps, args.warmup))
    if hvd.rank() == 0:
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
