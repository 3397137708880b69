"""Local cost of GlobalQSGD: single-rank, single-thread CPU time of compress + allreduce +
decompress of a 64 MB fp32 gradient, in units of one add pass over the same tensor, measured
in the same process.

    python benchmarks/cpu_cost.py                        # PyTorch, fused numba kernels
    HVD_GQSGD_KERNELS=0 python benchmarks/cpu_cost.py    # generic torch-op path
    python benchmarks/cpu_cost.py --framework tf         # TensorFlow, hvd.allreduce in tf.function
    python benchmarks/cpu_cost.py --framework both       # both (one process each), and TF / torch
    python benchmarks/cpu_cost.py --rotation --bits 4    # the kernels' round trip, rotated
    python benchmarks/cpu_cost.py --rotation --doc       # 4 and 8 bits, into docs/LOW_BITS.md

Goals: <= 4 passes in PyTorch (the naive fp32 torch version costs about 14); TensorFlow
within 1.3x of PyTorch.  ``both`` compares the two in milliseconds and in NumPy add passes
(each process times ``np.add`` too, so drift between the two processes cancels).

``--rotation`` times, instead, the fused kernels' own round trip of the bucket (norms,
quantize_pack, decode, as the engine runs them on one rank, without Horovod) three times:
as is, with the Hadamard rotation at the bits' default scale blocks (64 elements at 4 bits,
1024 at 8: ``core.default_scale_block``; ``kernels.rotate_norms`` in place of
``segment_norms``, ``kernels.unrotate`` after decoding), and with the inverse fused into
the decode (``Summed.unpack_bucket(..., rotation=)``), in this thread's CPU time against
``torch.add``; and the same for one rank's share of a two-stage round
(``Messages.unpack_parts(..., rotation=)``).  Goal: the rotation adds at most 1.5 passes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# One thread for the kernels too (kernels.thread_budget reads this first; numba at import).
os.environ["NUMBA_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

from gqsgd_lab.bench_common import write_section  # noqa: E402
from hvd_gqsgd import GlobalQSGD, core, kernels  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

Fns = dict[str, Callable[[], object]]


def median_times(fns: Fns, repeats: int, clock: Callable[[], float] = time.perf_counter
                 ) -> dict[str, float]:
    """Median seconds of each function.  The functions take turns within every repeat, so
    a slow spell of this shared machine hits the baseline and the candidates alike instead
    of skewing their ratio."""
    for fn in fns.values():
        fn()  # warm-up (numba compilation, tracing)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def variants(bits: int) -> dict[str, GlobalQSGD]:
    """label -> compressor; the first is the default configuration."""
    return {f"GlobalQSGD({bits})": GlobalQSGD(bits=bits),
            "with scale_block=0": GlobalQSGD(bits=bits, scale_block=0),
            "with chunk_bytes=0": GlobalQSGD(bits=bits, chunk_bytes=0),
            "with chunk_bytes=2 MiB": GlobalQSGD(bits=bits, chunk_bytes=2 << 20)}


def torch_fns(n: int, bits: int) -> Fns:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    fns: Fns = {"add": lambda: torch.add(x, y, out=out),
                "allreduce(none)": lambda: hvd.allreduce(x, name="none")}
    for i, (label, comp) in enumerate(variants(bits).items()):
        fns[label] = functools.partial(hvd.allreduce, x, compression=comp, name=f"gq{i}")
    return fns


def tf_fns(n: int, bits: int) -> Fns:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    x, y = tf.random.normal([n]), tf.random.normal([n])

    def reducer(comp, name: str) -> Callable[[], object]:
        return tf.function(lambda: hvd.allreduce(x, compression=comp, name=name))

    fns: Fns = {"add": tf.function(lambda: tf.add(x, y)),
                "allreduce(none)": reducer(hvd.Compression.none, "none")}
    for i, (label, comp) in enumerate(variants(bits).items()):
        fns[label] = reducer(comp, f"gq{i}")
    return fns


ROUND_TRIP = "kernels round trip"
ROTATED = "kernels round trip, rotated"
FUSED = "kernels round trip, rotated, decode fused with the inverse"
TWO_STAGE = "two-stage round trip"
TWO_ROTATED = "two-stage round trip, rotated"
TWO_FUSED = "two-stage round trip, rotated, decode fused with the inverse"


def rotation_fns(n: int, bits: int) -> Fns:
    """The kernels' round trip of one ``n``-element float32 bucket on one rank (the sum of
    one rank's words is those words), without and with the rotation."""
    block = core.default_scale_block(bits)
    counts = core.segments([n], block)[0]  # the tuple the engine passes (kernels._derived)
    level = core.levels(bits, 1)
    x = np.random.default_rng(0).normal(size=n).astype(np.float32)
    rotated, out = kernels.host_array(n, np.float32), kernels.host_array(n, np.float32)
    words = kernels.host_array(core.packed_words(n, bits), np.int64)
    key = core.rotation_key(0, 0, 1)

    def round_trip(rotate: bool, fused: bool = False) -> None:
        if rotate:
            norms = kernels.rotate_norms(x, counts, block, key, "max", rotated)
        else:
            norms = kernels.segment_norms(x, counts, "max")
        mult = np.divide(level, norms, out=np.zeros_like(norms), where=norms > 0)
        kernels.quantize_pack(rotated if rotate else x, counts, mult, level, bits, 7, words)
        steps = (norms / level).astype(np.float32)
        kernels.Summed(words, bits).unpack_bucket(out, counts, steps,
                                                  rotation=(block, key) if fused else None)
        if rotate and not fused:
            kernels.unrotate(out, counts, block, key)

    return {ROUND_TRIP: functools.partial(round_trip, False),
            ROTATED: functools.partial(round_trip, True),
            FUSED: functools.partial(round_trip, True, True)}


def two_stage_fns(n: int, bits: int, ranks: int = 2) -> Fns:
    """One rank's local work in a two-stage round of one ``n``-element float32 bucket over
    ``ranks`` ranks, on the torch backend's kernels (:class:`TorchLocal`): the norms (with
    the forward rotation when rotated), the stage-1 encode of the whole bucket, the
    requantize of its own shard of the summed words and the decode of every rank's message
    (the collectives' results made once beforehand: the other ranks' gradients are this
    one's, with their own noise).  Without the rotation, rotated with the inverse after the
    decode (:meth:`TorchLocal.unrotate`), and with the inverse fused into it."""
    import torch

    from hvd_gqsgd import two_stage
    from hvd_gqsgd.torch_ops import TorchLocal, host_empty

    block = core.default_scale_block(bits)
    counts = core.segments([n], block)[0]
    plan, layout = two_stage.plan_of(("cpu_cost", n), counts, ranks, bits)
    local = TorchLocal(0)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=n).astype(np.float32))
    key = core.rotation_key(0, 0, 1)
    q = plan.shard_words

    def stage_one(rotate: bool, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat, norms = ((local.rotate_norms(x, counts, block, key, "max", [])) if rotate
                       else (x, local.local_norms(None, x, counts, "max", [])))
        mult = core.multipliers(local, norms, plan.levels1)
        return local.encode(flat, mult, counts, plan.levels1, plan.lane_bits, rank,
                            pad_to=plan.scatter_words), norms

    # the collectives' results: the words summed over the ranks, every rank's message
    results = {}
    for rotate in (False, True):
        summed = sum(stage_one(rotate, r)[0] for r in range(ranks))
        results[rotate] = torch.cat([two_stage.requantize(
            local, summed[r * q:(r + 1) * q].clone(), plan, r, r) for r in range(ranks)]), summed

    def round_trip(rotate: bool, fused: bool = False) -> None:
        _, norms = stage_one(rotate, 0)
        gathered, summed = results[rotate]
        two_stage.requantize(local, summed[:q].clone(), plan, 0, 0)
        state = local.messages(gathered, layout, core.step_sizes(local, norms, plan.levels1))
        out = local.decode_into(state, host_empty(n, np.float32), 1 / ranks,
                                rotation=(block, key) if fused else None)
        if rotate and not fused:
            local.unrotate(out, counts, block, key)

    return {TWO_STAGE: functools.partial(round_trip, False),
            TWO_ROTATED: functools.partial(round_trip, True),
            TWO_FUSED: functools.partial(round_trip, True, True)}


SCHEMES = (("flat", ROUND_TRIP, ROTATED, FUSED),
           ("two-stage", TWO_STAGE, TWO_ROTATED, TWO_FUSED))


def rotation_times(mb: int, bits: int, repeats: int) -> dict[str, float]:
    """The round trips without and with the rotation, and ``torch.add``, all in this
    thread's CPU time (every one of them runs on this thread alone, and unlike wall time,
    CPU time leaves out the spells when other work on a shared machine holds the core)."""
    import torch

    torch.set_num_threads(1)
    n = mb * 2**20 // 4
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    fns: Fns = {"add": lambda: torch.add(x, y, out=out), **rotation_fns(n, bits),
                **two_stage_fns(n, bits)}
    return median_times(fns, repeats, clock=time.thread_time)


def rotation_report(mb: int, bits: int, t: dict[str, float]) -> str:
    t_add = t["add"]
    lines = [f"kernels, {mb} MB fp32, bits={bits}, 1 thread, thread CPU time: add "
             f"{1e3 * t_add:.1f} ms"]
    for name, plain, rotated, fused in SCHEMES:
        base = t[plain]
        lines.append(
            f"{name}: round trip {1e3 * base:.1f} ms ({base / t_add:.2f} passes), rotated "
            f"{1e3 * t[rotated]:.1f} ms ({(t[rotated] - base) / t_add:+.2f} passes), decode "
            f"fused with the inverse {1e3 * t[fused]:.1f} ms "
            f"({(t[fused] - base) / t_add:+.2f} passes; goal: at most +1.5)")
    return "\n".join(lines)


def rotation_section(mb: int, repeats: int) -> list[str]:
    """docs/LOW_BITS.md's cost section: 4 and 8 bits, flat and two-stage."""
    import platform

    import numba

    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    rows = ["| bits | scheme | round trip | rotated, inverse after the decode | rotated, "
            "inverse fused into the decode | goal |", "|---|---|---|---|---|---|"]
    for bits in (4, 8):
        t = rotation_times(mb, bits, repeats)
        print(rotation_report(mb, bits, t), flush=True)
        for name, plain, rotated, fused in SCHEMES:
            base, add = t[plain], t["add"]
            extra = (t[fused] - base) / add
            rows.append(f"| {bits} | {name} | {1e3 * base:.1f} ms ({base / add:.2f} passes) | "
                        f"{(t[rotated] - base) / add:+.2f} passes | {extra:+.2f} passes | "
                        f"+1.5: {'met' if extra <= 1.5 else 'not met'} |")
    return [f"`python benchmarks/cpu_cost.py --rotation --doc` ({time.strftime('%Y-%m-%d')}): "
            f"the kernels' round trip of a {mb} MB fp32 bucket on one thread, without and with "
            "the rotation (the bits' default scale blocks: 64 elements at 4 bits, 1024 at "
            "8), in this thread's CPU time and in `torch.add` "
            f"passes over the same bucket ({1e3 * t['add']:.1f} ms), median of {repeats}; "
            "flat is norms, quantize, pack and decode of one rank's words; two-stage is one "
            "rank's share of a 2-rank round (stage 1 of the whole bucket, the requantize of "
            f"its shard, the decode of every message).  {model}, numba {numba.__version__}.",
            "", *rows]


def measure(framework: str, mb: int, bits: int, repeats: int) -> dict[str, float]:
    n = mb * 2**20 // 4
    fns = (torch_fns if framework == "torch" else tf_fns)(n, bits)
    a, b, c = np.random.rand(n).astype(np.float32), np.random.rand(n).astype(np.float32), \
        np.empty(n, np.float32)
    fns["np.add"] = lambda: np.add(a, b, out=c)
    return median_times(fns, repeats)


def report(framework: str, t: dict[str, float], mb: int, bits: int) -> str:
    t_add = t["add"]
    path = "fused numba kernels" if kernels.available() else "generic framework ops"
    default = next(iter(variants(bits)))
    figures = [f"{label} {1e3 * s:.1f} ms ({s / t_add:.2f} passes"
               f"{'; goal <= 4' if label == default and framework == 'torch' else ''})"
               for label, s in t.items() if label not in ("add", "np.add")]
    return (f"{framework}: {mb} MB fp32, 1 rank, 1 thread, {path}: add {1e3 * t_add:.1f} ms, "
            + ", ".join(figures))


def compare(args: argparse.Namespace) -> None:
    """Each framework in its own process (never import horovod.torch next to horovod.tensorflow),
    then TF's default GlobalQSGD against torch's."""
    got = {}
    for framework in ("torch", "tf"):
        proc = subprocess.run([sys.executable, __file__, "--framework", framework, "--json",
                               "--mb", str(args.mb), "--bits", str(args.bits),
                               "--repeats", str(args.repeats)],
                              capture_output=True, text=True, check=True)
        got[framework] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(report(framework, got[framework], args.mb, args.bits))
    label = next(iter(variants(args.bits)))
    ms = got["tf"][label] / got["torch"][label]
    passes = (got["tf"][label] / got["tf"]["np.add"]) / (got["torch"][label]
                                                         / got["torch"]["np.add"])
    print(f"{label} round trip, TF / torch: {ms:.2f}x in ms, {passes:.2f}x in np.add passes "
          "(goal: within 1.3x)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--framework", choices=("torch", "tf", "both"), default="torch")
    parser.add_argument("--json", action="store_true", help="print the raw medians as JSON")
    parser.add_argument("--rotation", action="store_true",
                        help="only time the kernels' round trip without and with the rotation")
    parser.add_argument("--doc", action="store_true",
                        help="with --rotation: 4 and 8 bits, written to docs/LOW_BITS.md")
    args = parser.parse_args()
    if args.rotation and args.doc:
        write_section(ROOT / "docs" / "LOW_BITS.md", "rotation_cost",
                      ["### Rotation: CPU cost", "", *rotation_section(args.mb, args.repeats)])
        return
    if args.rotation:
        print(rotation_report(args.mb, args.bits, rotation_times(args.mb, args.bits,
                                                                  args.repeats)))
        return
    if args.framework == "both":
        compare(args)
        return
    t = measure(args.framework, args.mb, args.bits, args.repeats)
    print(json.dumps(t) if args.json else report(args.framework, t, args.mb, args.bits))


if __name__ == "__main__":
    main()
