"""Train a character-level language model (2-layer LSTM) on Python's own documentation with
Horovod's PyTorch binding, uncompressed and with GlobalQSGD(bits=8), and compare the
validation loss.

    horovodrun --gloo -np 2 -H localhost:2 python examples/char_lm.py

The text ships with Python: the 79 help topics of ``pydoc_data.topics`` (what ``help("if")``
shows), about 465,000 characters of English prose and code samples.  (The module file is
about 750 kB because of the string-literal syntax around the text.)  The last 10% is held out
for validation; losses are in nats per character, and the unigram entropy of the text, about
3.25 nats, is what a model that learned only character frequencies would reach.  This stands
in for the TransformerXL language model of the Global-QSGD paper.

Each rank samples its own windows of the training text; the global batch is split evenly over
the ranks.  Every compressor trains from the same initial weights and sees the same windows for
a given seed, with identical hyper-parameters.  More compressors, seeds and the curves::

    horovodrun --gloo -np 2 -H localhost:2 python examples/char_lm.py \\
        --variants none,fp16,gq8,gq4,gq4:l2 --seeds 0,1,2 --csv lm.csv --png lm.png

``--cuda`` puts each rank's model and data on ``cuda:<local rank>`` (Horovod's
``hvd.local_rank()``; one GPU per rank)::

    horovodrun -np 2 -H localhost:2 python examples/char_lm.py --cuda

Local SGD (``QPRSGD``, hvd_gqsgd.qprsgd) runs as a variant too: ``qprsgd8:k=4`` syncs
GlobalQSGD(8) model differences by ring allreduce every 4 steps, ``qprsgd8:k=8:gossip``
between ring neighbours every 8 (3 ranks or more)::

    horovodrun --gloo -np 3 -H localhost:3 python examples/char_lm.py \\
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
from corpus import Corpus

from hvd_gqsgd import GlobalQSGD


class CharLSTM(torch.nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.lstm = torch.nn.LSTM(embed, hidden, layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch, seq, vocab)
        return self.head(self.lstm(self.embed(x))[0])


def lm_loss(net: torch.nn.Module, windows: torch.Tensor, reduction: str = "mean"):
    logits = net(windows[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             windows[:, 1:].reshape(-1), reduction=reduction)


def sum_over_ranks(values: list[float], name: str) -> list[float]:
    """COLLECTIVE: element-wise sum over all ranks."""
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum,
                         name=name).tolist()


def val_loss(net: torch.nn.Module, windows: torch.Tensor) -> float:
    """COLLECTIVE: mean loss per character over all validation windows; each rank scores
    every size-th window."""
    mine = windows[hvd.rank()::hvd.size()]
    with torch.no_grad():
        total = float(lm_loss(net, mine, "sum")) if len(mine) else 0.0
    summed, count = sum_over_ranks([total, mine[:, 1:].numel()], "lm.val")
    return summed / count


def log_point(step: int, losses: list[float], net, windows) -> dict:
    """COLLECTIVE: the training loss since the last point (mean over ranks) and val loss."""
    train = None
    if losses:
        total, count = sum_over_ranks([sum(losses), len(losses)], "lm.train")
        train = total / count
    return {"step": step, "train_loss": train, "val_loss": val_loss(net, windows)}


def make_model(seed: int, vocab: int, args) -> torch.nn.Module:
    torch.manual_seed(seed)
    return CharLSTM(vocab, args.embed, args.hidden, args.layers)


def train(variant, seed: int, corpus: Corpus, windows, args, bar) -> dict:
    """One run, on the device ``windows`` (the validation windows) are on."""
    device = windows.device
    net = make_model(seed, len(corpus.chars), args).to(device)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    opt, compression = build_optimizer(variant, hvd, torch.optim.Adam(net.parameters(), lr=args.lr),
                                       list(net.named_parameters()), seed)
    local_sgd = is_local_sgd(variant)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps, eta_min=args.lr / 10)
    rng = np.random.default_rng(rank_seed(seed, hvd.rank()))
    batch = args.global_batch // hvd.size()
    curve, losses, start = [log_point(0, [], net, windows)], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss = lm_loss(net, corpus.train_batch(rng, batch, args.seq).to(device))
        loss.backward()
        if local_sgd:  # each rank clips its own gradient; step() syncs every K-th call
            torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
            opt.step()
        else:
            opt.synchronize()  # the reduced gradient, identical on every rank, gets clipped
            torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
            with opt.skip_synchronize():
                opt.step()
        sched.step()
        losses.append(loss.item())
        bar.update()
        if step % args.eval_every == 0 or step == args.steps:
            if local_sgd and not opt.is_sync_step(step):
                opt.synchronize()  # evaluate right after a sync (see module docstring)
            curve.append(log_point(step, losses, net, windows))
            losses = []
            bar.set_postfix_str(f"val loss {curve[-1]['val_loss']:.3f}")
    wall = time.perf_counter() - start
    fp32_bytes = sum(p.numel() * 4 for p in net.parameters())
    if local_sgd:  # a sync's bytes, spread over the steps between syncs
        wire = opt.stats.total_bytes / args.steps
    elif isinstance(compression, GlobalQSGD):
        st = compression.stats
        wire = (st.total_payload + st.total_overhead) / st.rounds
    else:  # plus Horovod's own framing, the same for every compressor
        wire = fp32_bytes / 2 if variant.kind == "fp16" else fp32_bytes
    return {"spec": variant.spec, "label": variant.label, "seed": seed, "steps": args.steps,
            "val_loss": curve[-1]["val_loss"], "train_loss": curve[-1]["train_loss"],
            "bytes_per_step": wire, "bytes_vs_fp32": fp32_bytes / wire, "wall_s": wall,
            "curve": curve}


COLUMNS = [("val loss", "val_loss", ".4f", 10, ""), ("train loss", "train_loss", ".4f", 12, ""),
           ("bytes/step", "bytes_per_step", ",.0f", 12, ""),
           ("vs fp32", "bytes_vs_fp32", ".2f", 9, "x"), ("wall s", "wall_s", ".1f", 8, "")]


def report(runs: list[dict], corpus: Corpus, args, n_params: int) -> None:
    """Rank 0: the comparison table and each compressor's val loss relative to fp32."""
    print(f"\nhvd_gqsgd char-LM: {args.layers}-layer LSTM ({n_params:,} parameters) on the "
          f"pydoc topics text, {hvd.size()} ranks, {args.steps} steps of "
          f"{args.global_batch}x{args.seq} characters, seeds {args.seeds}")
    print_table(runs, COLUMNS)
    print("Losses in nats per character (mean±std over seeds when there are several); val on "
          f"{len(corpus.val):,} held-out characters' first {args.val_chars:,}; train loss over "
          f"the last {args.eval_every} steps.  Unigram entropy of the text: "
          f"{corpus.unigram_entropy():.3f} nats.")
    groups = group_runs(runs)
    base = groups.get("none")
    if base is None:
        return
    for spec, group in groups.items():
        if spec != "none":
            rel = [100 * (r["val_loss"] / b["val_loss"] - 1) for r, b in zip(group, base)]
            print(f"{group[0]['label']}: val loss {np.mean(rel):+.2f}% vs fp32 "
                  f"({group[0]['bytes_vs_fp32']:.2f}x fewer bytes per step)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=32,
                        help="windows per step over all ranks (split evenly)")
    parser.add_argument("--seq", type=int, default=64, help="characters per window")
    parser.add_argument("--lr", type=float, default=1e-2,
                        help="Adam learning rate, cosine-decayed to a tenth")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=20, help="steps between log points")
    parser.add_argument("--val-chars", type=int, default=16384,
                        help="validation characters scored at each log point")
    add_common_args(parser, default_variants="none,gq8")
    add_cuda_arg(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    variants = parse_variants(args.variants)
    check_cuda(args.cuda, "examples/char_lm.py")
    hvd.init()
    if hvd.size() < 2:  # one process sends nothing: there would be nothing to compare
        raise SystemExit("examples/char_lm.py compares compressors across ranks but runs as "
                         "one process; start 2 or more: "
                         "horovodrun -np 2 -H localhost:2 python examples/char_lm.py")
    torch.set_num_threads(1)
    if args.global_batch % hvd.size():
        raise SystemExit(f"--global-batch {args.global_batch} does not split evenly over "
                         f"{hvd.size()} ranks; use a multiple of {hvd.size()}")
    corpus = Corpus()
    windows = corpus.val_windows(args.seq, args.val_chars).to(
        rank_device(args.cuda, hvd.local_rank()))
    jobs = [(seed, v) for seed in seeds_of(args.seeds) for v in variants]
    bar = make_progress(len(jobs) * args.steps, hvd.rank(), args.progress)
    runs = []
    for k, (seed, variant) in enumerate(jobs, 1):
        bar.set_description_str(f"{variant.label} seed {seed}")
        runs.append(train(variant, seed, corpus, windows, args, bar))
        if hvd.rank() == 0:
            r = runs[-1]
            say(bar, f"run {k}/{len(jobs)}: {r['label']}, seed {seed}: val loss "
                     f"{r['val_loss']:.4f} nats/char ({r['wall_s']:.1f} s)")
    bar.close()
    if hvd.rank() == 0:
        n_params = sum(p.numel() for p in make_model(0, len(corpus.chars), args).parameters())
        report(runs, corpus, args, n_params)
        write_outputs(args, {"experiment": "char_lm", "world_size": hvd.size(),
                             "title": f"char-level LSTM on pydoc topics, {hvd.size()} ranks",
                             "metric": "val_loss", "settings": settings_of(args),
                             "unigram_entropy": corpus.unigram_entropy(),
                             "n_params": n_params, "runs": runs},
                      ylabel="validation loss (nats/char)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
