"""Train a small character-level transformer under FSDP2 (``fully_shard``), with FSDP2's own
reduce-scatter and with Global-QSGD's (``hvd_gqsgd.fsdp.register``), and compare the
validation loss.  torch.distributed only, no Horovod:

    torchrun --nproc_per_node 4 examples/fsdp_lm.py --seeds 0,1,2

The text is Python's own help topics (examples/corpus.py); losses are in nats per character.
The model is GPT-like: embeddings, ``--layers`` pre-norm causal self-attention blocks, a
head; each block and the root are ``fully_shard`` modules with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``--param-dtype`` and
``--reduce-dtype`` change them).  Both variants start from the same weights, see the same
windows and use the same hyper-parameters; the global batch is split over the ranks.
``--cuda`` runs on one GPU per rank over NCCL.  ``--json FILE`` writes every run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from corpus import Corpus
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hvd_gqsgd.fsdp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device,
                                                                    dtype=x.dtype)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharGPT(torch.nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.zeros(seq, width))
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch * seq, vocab)
        h = self.embed(x) + self.pos[:x.shape[1]]
        for block in self.blocks:
            h = block(h)
        # the head on 2-D rows: its output is a tensor of its own, not a view of one, which
        # FSDP2 warns about for a root module's output
        return self.head(self.norm(h).reshape(-1, h.shape[-1]))


def lm_loss(net: torch.nn.Module, windows: torch.Tensor, reduction: str = "mean"):
    logits = net(windows[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits, windows[:, 1:].reshape(-1),
                                             reduction=reduction)


def build(seed: int, vocab: int, args, mesh, device) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = CharGPT(vocab, args.width, args.heads, args.layers, args.seq).to(device)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[args.param_dtype],
                              reduce_dtype=DTYPES[args.reduce_dtype])
    for block in net.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    return net


def val_loss(net: torch.nn.Module, windows: torch.Tensor) -> float:
    """COLLECTIVE: mean loss per character over all validation windows (each rank scores
    every size-th window; FSDP's forward all-gathers on every rank)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = windows[rank::size]
    with torch.no_grad():
        total = lm_loss(net, mine, "sum").double() if len(mine) else torch.zeros(
            (), dtype=torch.float64, device=windows.device)
    summed = torch.stack([total, torch.tensor(float(mine[:, 1:].numel()),
                                              dtype=torch.float64, device=windows.device)])
    dist.all_reduce(summed)
    return float(summed[0] / summed[1])


def train(hook: bool, seed: int, corpus: Corpus, windows, args, mesh, device) -> dict:
    net = build(seed, len(corpus.chars), args, mesh, device)
    state = hvd_gqsgd.fsdp.register(net, bits=args.bits, seed=seed) if hook else None
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps, eta_min=args.lr / 10)
    rng = np.random.default_rng([seed, dist.get_rank()])
    batch = args.global_batch // dist.get_world_size()
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad()
        lm_loss(net, corpus.train_batch(rng, batch, args.seq).to(device)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
        opt.step()
        sched.step()
    wall = time.perf_counter() - start
    row = {"variant": f"GlobalQSGD({args.bits})" if hook else "FSDP2", "seed": seed,
           "val_loss": val_loss(net, windows), "wall_s": wall}
    if state is not None:
        row["bytes_ratio"] = state.stats.total_uncompressed / (state.stats.total_payload +
                                                                state.stats.total_overhead)
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--param-dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--reduce-dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--val-chars", type=int, default=16384)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--cuda", action="store_true",
                        help="one GPU per rank (LOCAL_RANK), NCCL")
    parser.add_argument("--json", help="write every run (and the settings) to this file")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    torch.set_num_threads(1)
    size = dist.get_world_size()
    if size < 2 or args.global_batch % size:
        raise SystemExit(f"run 2 or more ranks that split --global-batch {args.global_batch} "
                         "evenly, e.g. torchrun --nproc_per_node 4 examples/fsdp_lm.py")
    mesh = init_device_mesh(device.type, (size,))
    corpus = Corpus()
    windows = corpus.val_windows(args.seq, args.val_chars).to(device)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for hook in (False, True):
            runs.append(train(hook, seed, corpus, windows, args, mesh, device))
            if dist.get_rank() == 0:
                print(json.dumps(runs[-1]), flush=True)
    if dist.get_rank() == 0:
        plain = np.mean([r["val_loss"] for r in runs if r["variant"] == "FSDP2"])
        mine = np.mean([r["val_loss"] for r in runs if r["variant"] != "FSDP2"])
        print(f"{size} ranks, {args.steps} steps, seeds {args.seeds}: FSDP2 val loss "
              f"{plain:.4f}, GlobalQSGD({args.bits}) {mine:.4f} ({100 * (mine / plain - 1):+.2f}%)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"settings": vars(args), "world_size": size, "runs": runs}, f,
                          indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
