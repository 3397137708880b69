"""Where one GlobalQSGD step of the deep model spends its time, rank by rank (issue 26).

    # 2 ranks on loopback
    horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python studies/deep_timeline.py
    # 2 emulated hosts at 1 Gbit/s (root; gqsgd_lab/emulated_hosts.py)
    .venv/bin/python studies/deep_timeline.py --hosts 2 --rate 1gbit

benchmarks/deep_worker.py's model (16 x ``Linear(1024, 1024)`` + Tanh) under
``hvd.DistributedOptimizer(compression=GlobalQSGD(bits=8))``.  The PyTorch backend's local
work (``flat_concat``, ``local_norms``, ``encode``, ``decoder``, ``rescale_bucket``) and
collectives (each scale and codes allreduce launched, the first poll that finds one back, each
wait) are timed for ``--steps`` steps.  Rank 0 prints, for every rank, each method's
milliseconds per step, in wall time and (``<method> cpu``) in CPU time of the calling thread,
which on a shared core is less than the wall time by what other threads took; then the
events of the last step side by side, in milliseconds from that rank's start of backward.
Timing costs a few microseconds a call; ranks' clocks are aligned only by the barrier before
each step.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ("flat_concat", "local_norms", "encode", "decoder", "rescale_bucket")


def instrument(backend_cls: type, events: list[tuple[float, str]],
               totals: dict[str, float]) -> None:
    """Wrap ``backend_cls``'s methods so that they log into ``events`` and ``totals``."""
    names: dict[Any, str] = {}
    back: set[Any] = set()

    def timed(meth: str) -> None:
        inner = getattr(backend_cls, meth)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            out = inner(self, *args, **kwargs)
            totals[meth] += time.perf_counter() - start
            totals[f"{meth} cpu"] += time.thread_time() - cpu
            if meth != "wait":
                events.append((start, f"{meth} {1e3 * (time.perf_counter() - start):.1f} ms"))
            return out
        setattr(backend_cls, meth, wrapper)

    def launched(meth: str) -> None:
        inner = getattr(backend_cls, meth)

        def wrapper(self: Any, tensor: Any, name: str, process_set: Any) -> Any:
            handle = inner(self, tensor, name, process_set)
            names[handle] = name
            events.append((time.perf_counter(), f"launch {name} ({tensor.numel() * 8} B)"))
            return handle
        setattr(backend_cls, meth, wrapper)

    poll = backend_cls.poll

    def polled(self: Any, handle: Any) -> bool:
        done = poll(self, handle)
        if done and handle not in back:
            back.add(handle)
            events.append((time.perf_counter(), f"back {names.get(handle, handle)}"))
        return done

    for meth in (*LOCAL, "wait"):
        timed(meth)
    for meth in ("allreduce_max_async", "allreduce_sum_async"):
        launched(meth)
    backend_cls.poll = polled


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch
    from deep_worker import model

    from hvd_gqsgd import GlobalQSGD
    from hvd_gqsgd.torch import TorchBackend

    events: list[tuple[float, str]] = []
    totals: dict[str, float] = collections.defaultdict(float)
    instrument(TorchBackend, events, totals)
    hvd.init()
    torch.set_num_threads(1)
    net = model(1024, 16)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5),
                                   named_parameters=net.named_parameters(),
                                   compression=GlobalQSGD(bits=8))
    gen = torch.Generator().manual_seed(hvd.rank())
    steps = []
    for i in range(args.steps + 1):
        x = torch.randn(16, 1024, generator=gen)
        hvd.allreduce(torch.zeros(1), name="barrier")
        if i == 1:  # the first step warms up (numba compilation, buffers)
            totals.clear()
        events.clear()
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), torch.sin(x.roll(1, dims=1)))
        events.append((time.perf_counter(), "backward starts"))
        loss.backward()
        events.append((time.perf_counter(), "backward ends"))
        opt.step()
        events.append((time.perf_counter(), "step ends"))
        steps.append(time.perf_counter() - start)
    t0 = events[0][0]  # the last step's start of backward
    mine = {"rank": hvd.rank(), "step_ms": 1e3 * statistics.median(steps[1:]),
            "per_step_ms": {k: 1e3 * v / args.steps for k, v in totals.items()},
            "events": [f"{1e3 * (t - t0):8.2f}  {what}" for t, what in events]}
    everyone = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        report(everyone)


def report(ranks: list[dict]) -> None:
    for r in ranks:
        work = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["per_step_ms"].items()))
        print(f"rank {r['rank']}: median step {r['step_ms']:.1f} ms; per step (ms): {work}")
    width = max(len(e) for r in ranks for e in r["events"]) + 2
    print("\nlast step, ms from backward's start on each rank:")
    print("".join(f"rank {r['rank']}".ljust(width) for r in ranks))
    for row in range(max(len(r["events"]) for r in ranks)):
        print("".join((r["events"][row] if row < len(r["events"]) else "").ljust(width)
                      for r in ranks).rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hosts", type=int, default=0,
                        help="launch on this many emulated hosts (root) instead of running "
                        "as one rank under horovodrun/mpirun")
    parser.add_argument("--rate", default="1gbit")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if not args.hosts:
        worker(args)
        return 0
    from deep_bench import ENV, rank0_lines

    from gqsgd_lab.emulated_hosts import EmulatedHosts, require_root

    require_root()
    with EmulatedHosts(args.hosts, rate=args.rate) as net:
        proc = net.mpirun([sys.executable, __file__, "--steps", str(args.steps)], env=ENV,
                          timeout=600)
    print("\n".join(rank0_lines(proc.stdout)))
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
