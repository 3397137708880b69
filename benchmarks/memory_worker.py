"""One rank of benchmarks/memory.py: the peak memory that one round of an entry point adds
over its own uncompressed round, on a gradient of ``--mb`` MB (one ``Linear`` weight).

Entries (``--entry``): ``hvd`` and ``hvd-two-stage`` (``hvd.allreduce`` of the gradient,
with no compression and with GlobalQSGD(8), flat or ``two_stage=True``; launched by
horovodrun), ``ddp`` (a DDP ``Linear``'s backward, DDP's own allreduce against the
GlobalQSGD hook) and ``fsdp`` (a ``fully_shard`` ``Linear``'s backward, FSDP2's own
reduce-scatter against ``hvd_gqsgd.fsdp.register``), both under torchrun on Gloo.

Memory is the process's resident set: the peak (``VmHWM``, reset through
``/proc/self/clear_refs``) during the round minus the resident set just before it, after
two warm-up rounds.  Buffers of 128 KiB and more are mmapped (``mallopt``) and the heap is
trimmed before each round (``malloc_trim``), so memory freed earlier is not counted as in
use and what a round frees leaves the resident set at once; garbage is collected before
each round for the same reason.  Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os

import torch

_LIBC = ctypes.CDLL("libc.so.6")
_M_MMAP_THRESHOLD = -3

VARIANTS = ("none", "gqsgd8")


def _status(field: str) -> int:
    """``field`` of /proc/self/status in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def added_bytes(round_fn) -> int:
    """Peak resident bytes that ``round_fn()`` adds to what is resident before it."""
    gc.collect()  # an earlier round's output still held by a reference cycle would be freed
    _LIBC.malloc_trim(0)  # during this round and hide what this round allocates
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _status("VmRSS")
    round_fn()
    return _status("VmHWM") - before


def _rounds(make_round, rounds: int = 3, warmup: int = 2) -> int:
    """The median added memory of the measured rounds, after warm-up rounds (pools and
    lazily built state settle there)."""
    for _ in range(warmup):
        make_round()
    return sorted(added_bytes(make_round) for _ in range(rounds))[rounds // 2]


def horovod(args, variant: str, mb: int) -> int:
    import horovod.torch as hvd

    from hvd_gqsgd import GlobalQSGD

    grad = torch.randn(mb * (1 << 18), generator=torch.Generator().manual_seed(hvd.rank()))
    kwargs = {}
    if variant != "none":
        kwargs["compression"] = GlobalQSGD(bits=8, two_stage=args.entry == "hvd-two-stage")

    def one_round() -> None:
        out = hvd.allreduce(grad, op=hvd.Average, **kwargs)
        del out

    return _rounds(one_round)


def _linear(mb: int) -> torch.nn.Module:
    side = int((mb * (1 << 18)) ** 0.5)
    torch.manual_seed(0)
    return torch.nn.Linear(side, side, bias=False)


def ddp(args, variant: str, mb: int) -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_gqsgd.ddp import GlobalQSGDState, global_qsgd_hook

    model = DDP(_linear(mb))
    if variant != "none":
        model.register_comm_hook(GlobalQSGDState(bits=8), global_qsgd_hook)
    x = torch.randn(4, model.module.in_features,
                    generator=torch.Generator().manual_seed(dist.get_rank()))

    def one_round() -> None:
        model.zero_grad(set_to_none=False)  # the gradient stays allocated between rounds
        model(x).sum().backward()

    return _rounds(one_round)


def fsdp(args, variant: str, mb: int) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hvd_gqsgd.fsdp

    model = _linear(mb)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                reshard_after_forward=False)
    if variant != "none":
        hvd_gqsgd.fsdp.register(model, bits=8)
    x = torch.randn(4, model.in_features, generator=torch.Generator().manual_seed(
        dist.get_rank()))

    def one_round() -> None:
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()

    return _rounds(one_round)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry", choices=("hvd", "hvd-two-stage", "ddp", "fsdp"),
                        required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--mb", default="256", help="gradient sizes in MB (fp32), e.g. 4,16")
    args = parser.parse_args()
    _LIBC.mallopt(_M_MMAP_THRESHOLD, 128 << 10)  # fixed: glibc otherwise raises it on frees
    torch.set_num_threads(1)
    if args.entry.startswith("hvd"):
        import horovod.torch as hvd

        hvd.init()
        run, rank = horovod, hvd.rank()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        run, rank = (ddp if args.entry == "ddp" else fsdp), dist.get_rank()
    for mb in (int(m) for m in args.mb.split(",")):
        for variant in args.variants.split(","):
            added = run(args, variant, mb)
            if rank == 0:
                print(json.dumps({"entry": args.entry, "variant": variant, "mb": mb,
                                  "kernels": os.environ.get("HVD_GQSGD_KERNELS", "1") != "0",
                                  "added_bytes": added}), flush=True)


if __name__ == "__main__":
    main()
