"""Train a small MLP on sklearn's handwritten digits with Horovod, uncompressed and with
GlobalQSGD(bits=8), and print what compression bought.

    horovodrun --gloo -np 2 -H localhost:2 python examples/torch_digits.py

The data (1,797 real 8x8 digits) ships with scikit-learn, so nothing is downloaded.  Each rank
trains on its own shard; the 360 test digits are the same on every rank.  More compressors and
seeds, with the loss curves written out (docs/CONVERGENCE.md is made this way)::

    horovodrun --gloo -np 2 -H localhost:2 python examples/torch_digits.py \\
        --variants none,fp16,gq8,gq4,gq4:l2 --seeds 0,1,2 --csv digits.csv --png digits.png

Every compressor trains from the same initial weights and sees the same batches for a given
seed, with identical hyper-parameters, so differences come from the compression alone.

``--cuda`` puts each rank's model and data on ``cuda:<local rank>`` (Horovod's
``hvd.local_rank()``; one GPU per rank), so the gradients go through Horovod's GPU
collectives (NCCL in docker/Dockerfile.gpu's image)::

    horovodrun -np 2 -H localhost:2 python examples/torch_digits.py --cuda

Local SGD (``QPRSGD``, hvd_gqsgd.qprsgd) runs as a variant too: ``qprsgd8:k=4`` syncs
GlobalQSGD(8) model differences by ring allreduce every 4 steps, ``qprsgd8:k=8:gossip``
between ring neighbours every 8 (3 ranks or more)::

    horovodrun --gloo -np 3 -H localhost:3 python examples/torch_digits.py \\
        --variants none,qprsgd8:k=4,qprsgd8:k=8:gossip

Between syncs the ranks' models differ, so a local-SGD run also syncs at each log point that
is not a sync step (the evaluated model is then the shared one; with gossip, the ranks' models
after a gossip round).  Its bytes per step are a sync's bytes spread over the steps.
"""

from __future__ import annotations

import argparse
import time

import horovod.torch as hvd
import numpy as np
import torch
from _common import (
    add_common_args,
    add_cuda_arg,
    build_optimizer,
    check_cuda,
    group_runs,
    is_local_sgd,
    make_progress,
    parse_variants,
    print_table,
    rank_device,
    rank_seed,
    say,
    seeds_of,
    settings_of,
    write_outputs,
)
from sklearn.datasets import load_digits

from hvd_gqsgd import GlobalQSGD

N_TEST = 360


def shard(rank: int, size: int):
    """(x_train, y_train) of this rank, (x_test, y_test) shared.  Every shard has the same
    length, so all ranks take the same number of steps (a rank with one more batch would wait
    forever in its extra allreduce)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:N_TEST], order[N_TEST:]
    mine = train[rank::size][:len(train) // size]
    as_t = torch.from_numpy
    return as_t(x[mine]), as_t(y[mine]), as_t(x[test]), as_t(y[test])


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def log_point(step: int, train_loss: float | None, net, xte, yte) -> dict:
    with torch.no_grad():
        logits = net(xte)
        loss = float(torch.nn.functional.cross_entropy(logits, yte))
        acc = float((logits.argmax(1) == yte).float().mean())
    return {"step": step, "train_loss": train_loss, "test_loss": loss, "test_acc": acc}


def mean_over_ranks(total: float, count: int) -> float:
    """COLLECTIVE: the mean training loss of an epoch over all ranks' batches."""
    summed = hvd.allreduce(torch.tensor([total, count], dtype=torch.float64), op=hvd.Sum,
                           name="digits.train_loss")
    return float(summed[0] / summed[1])


def train(variant, seed: int, data, args, bar) -> dict:
    """One run; ``data`` (shard's tensors) already on the run's device."""
    xtr, ytr, xte, yte = data
    net = model(seed).to(xtr.device)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt, compression = build_optimizer(
        variant, hvd, torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9),
        list(net.named_parameters()), seed)
    gen = torch.Generator().manual_seed(rank_seed(seed, hvd.rank()))
    curve = [log_point(0, None, net, xte, yte)]
    steps, start = 0, time.perf_counter()
    for _ in range(args.epochs):
        perm = torch.randperm(len(xtr), generator=gen)
        total = 0.0
        for i in range(0, len(perm) - args.batch + 1, args.batch):
            idx = perm[i:i + args.batch].to(xtr.device)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
            bar.update()
        if is_local_sgd(variant) and not opt.is_sync_step(steps):
            opt.synchronize()  # local SGD: evaluate right after a sync (see module docstring)
        epoch_steps = steps - curve[-1]["step"]
        curve.append(log_point(steps, mean_over_ranks(total, epoch_steps), net, xte, yte))
        bar.set_postfix_str(f"test loss {curve[-1]['test_loss']:.3f}")
    wall = time.perf_counter() - start
    fp32_bytes = sum(p.numel() * 4 for p in net.parameters())
    extra = {}
    if is_local_sgd(variant):  # a sync's bytes, spread over the steps between syncs
        wire = opt.stats.total_bytes / steps
    elif isinstance(compression, GlobalQSGD):
        st = compression.stats
        wire = (st.total_payload + st.total_overhead) / st.rounds
        extra = {"quantize_ms": 1e3 * st.total_quantize_s / st.rounds,
                 "scale_wait_ms": 1e3 * st.total_scale_wait_s / st.rounds}
    else:  # plus Horovod's own framing, the same for every compressor
        wire = fp32_bytes / 2 if variant.kind == "fp16" else fp32_bytes
    return {"spec": variant.spec, "label": variant.label, "seed": seed, "steps": steps,
            "test_acc": curve[-1]["test_acc"], "test_loss": curve[-1]["test_loss"],
            "bytes_per_step": wire, "bytes_vs_fp32": fp32_bytes / wire, "wall_s": wall,
            **extra, "curve": curve}


COLUMNS = [("test acc", "test_acc", ".4f", 10, ""), ("test loss", "test_loss", ".4f", 11, ""),
           ("bytes/step", "bytes_per_step", ",.0f", 12, ""),
           ("vs fp32", "bytes_vs_fp32", ".2f", 9, "x"), ("wall s", "wall_s", ".2f", 8, "")]


def report(runs: list[dict], args, world_size: int,
           extra_columns: tuple = (), footer: list[str] | None = None) -> None:
    """Rank 0 (or examples/demo.py after the job): the comparison table, then what each
    GlobalQSGD setting bought.  ``extra_columns`` (print_table's format) read more keys of
    the runs, e.g. the demo's step times on 1 Gbit/s links; ``footer`` replaces the closing
    note about loopback."""
    groups = group_runs(runs)
    seeds = seeds_of(args.seeds)
    print(f"\nhvd_gqsgd demo: digits MLP, {world_size} ranks, {args.epochs} epochs, "
          f"{runs[0]['steps']} steps per run" + (f", seeds {args.seeds}" if len(seeds) > 1
                                                 else ""))
    print_table(runs, [*COLUMNS, *extra_columns])
    if len(seeds) > 1:
        print("(mean±std over seeds; test acc/loss on the 360 held-out digits)")
    base = groups.get("none")
    for group in groups.values():
        if base is None or "quantize_ms" not in group[0]:
            continue
        ratio = np.mean([r["bytes_vs_fp32"] for r in group])
        delta = 100 * np.mean([g["test_acc"] - b["test_acc"] for g, b in zip(group, base)])
        print(f"\n{group[0]['label']} sent {ratio:.2f}x fewer gradient bytes per step per rank; "
              f"test accuracy {delta:+.2f} points vs fp32.")
        print(f"Per step it spent {np.mean([r['quantize_ms'] for r in group]):.2f} ms "
              f"quantizing and {np.mean([r['scale_wait_ms'] for r in group]):.2f} ms waiting "
              "on the scale exchange (GlobalQSGD.stats).")
    for line in footer if footer is not None else [
            "Wall time here is loopback on one machine, where bandwidth is free; the byte "
            "saving pays off on real links."]:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--bits", type=int, default=8,
                        help="GlobalQSGD bits of the default comparison (--variants none,gq8)")
    parser.add_argument("--no-report", action="store_true",
                        help="skip the table (examples/demo.py prints it, with link times, "
                        "from --json)")
    add_common_args(parser, default_variants=None, variants_help="none,gq<--bits>")
    add_cuda_arg(parser)
    args = parser.parse_args()
    variants = parse_variants(args.variants or f"none,gq{args.bits}")
    check_cuda(args.cuda, "examples/torch_digits.py")
    hvd.init()
    if hvd.size() < 2:  # one process sends nothing: there would be nothing to compare
        raise SystemExit("examples/torch_digits.py compares compressors across ranks but runs as "
                         "one process; start 2 or more: "
                         "horovodrun -np 2 -H localhost:2 python examples/torch_digits.py")
    torch.set_num_threads(1)
    device = rank_device(args.cuda, hvd.local_rank())
    data = tuple(t.to(device) for t in shard(hvd.rank(), hvd.size()))
    jobs = [(seed, v) for seed in seeds_of(args.seeds) for v in variants]
    bar = make_progress(len(jobs) * args.epochs * (len(data[0]) // args.batch), hvd.rank(),
                        args.progress)
    runs = []
    for k, (seed, variant) in enumerate(jobs, 1):
        bar.set_description_str(f"{variant.label} seed {seed}")
        runs.append(train(variant, seed, data, args, bar))
        if hvd.rank() == 0:
            r = runs[-1]
            say(bar, f"run {k}/{len(jobs)}: {r['label']}, seed {seed}: test acc "
                     f"{r['test_acc']:.4f}, test loss {r['test_loss']:.4f} ({r['wall_s']:.1f} s)")
    bar.close()
    if hvd.rank() == 0:
        if not args.no_report:
            report(runs, args, hvd.size())
        write_outputs(args, {"experiment": "digits_torch", "world_size": hvd.size(),
                             "title": f"PyTorch MLP on sklearn digits, {hvd.size()} ranks",
                             "metric": "test_loss", "settings": settings_of(args),
                             "runs": runs}, ylabel="test loss (360 held-out digits)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
