"""One Global-QSGD sum simulated in a single process on real gradients, with the library's
own steps: shared by the studies of flat, hierarchical and two-stage error
(studies/hierarchical_sim.py, studies/two_stage_sim.py) and benchmarks/rotation.py.

* :func:`gradients`: the digits MLP of examples/torch_digits.py (64-256-256-10, 85,002
  weights) after 2 epochs of SGD on one process, then one gradient per rank on its own random
  batch of ``BATCH`` images, as a data-parallel step would see them;
* :func:`block_max`: the per-block MAX scale every rank gets from the scale exchange;
* :func:`quantized_sum`: flat Global-QSGD's sum, ``hvd_gqsgd.core``'s rounding driven by the
  NumPy ``TensorOps`` (gqsgd_lab/numpy_ops.py), the integer codes summed and rescaled;
* :func:`two_stage_sum`: two-stage Global-QSGD through ``hvd_gqsgd.two_stage`` and the torch
  backend's fused kernels, the reduce-scatter a NumPy sum of every rank's words and the
  allgather a concatenation of the shards' messages.

Packing is left out of the flat sum: the tests prove it exact, so it cannot change the error.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

from hvd_gqsgd import core, two_stage
from hvd_gqsgd.torch_ops import TorchLocal

from .numpy_ops import NumpyOps

__all__ = ["BATCH", "OPS", "ROWS", "block_max", "gradients", "quantized_sum", "two_stage_sum"]

OPS = NumpyOps()
BATCH = 32  # images per rank's batch
ROWS = 64  # ranks quantized at once (bounds the float64 temporaries to ~45 MB each)


def gradients(ranks: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """``ranks`` gradients (float32 rows) of the digits MLP mid-training, one batch each."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2 * len(x) // 256):  # 2 epochs at batch 256
        idx = torch.randint(len(x), (256,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    numels = [p.numel() for p in net.parameters()]
    out = np.empty((ranks, sum(numels)), dtype=np.float32)
    for r in range(ranks):
        idx = torch.randint(len(x), (BATCH,), generator=gen)
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        out[r] = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).numpy()
    return out, numels


def block_max(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per scale segment: max |x| over the rows (the MAX allreduce of local norms)."""
    return np.maximum.reduceat(np.abs(rows), starts, axis=1).max(axis=0).astype(np.float64)


def quantized_sum(rows: np.ndarray, scales: np.ndarray, counts: list[int], n_levels: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Sum over rows of the rescaled integer codes, with core's rounding (float64)."""
    mult = np.repeat(core.multipliers(OPS, scales, n_levels), counts)
    steps = np.repeat(core.step_sizes(OPS, scales, n_levels), counts)
    codes = np.zeros(rows.shape[1], dtype=np.int64)
    for lo in range(0, rows.shape[0], ROWS):
        part = rows[lo:lo + ROWS].astype(np.float64)
        codes += core.quantize(OPS, part, mult, rng.random(part.shape), n_levels).sum(axis=0)
    return codes * steps



def two_stage_sum(rows: np.ndarray, numels: list[int], bits: int, seed: int,
                  block: int = core.DEFAULT_SCALE_BLOCK) -> np.ndarray:
    """The sum over ``rows`` (one gradient per rank) by two-stage Global-QSGD with a scale
    per ``block`` elements: every rank's stage-1 words summed, each shard requantized by its
    rank, every message decoded."""
    n = rows.shape[0]
    counts, _ = core.segments(numels, block)
    plan, layout = two_stage.plan_of(("sim", tuple(numels), block), counts, n, bits)
    local = TorchLocal(seed)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    scales = torch.from_numpy(block_max(rows, starts))
    mult = core.multipliers(local, scales, plan.levels1)
    total = np.zeros(plan.scatter_words, dtype=np.int64)
    for r in range(n):  # the reduce-scatter's sum, done whole
        total += local.encode(torch.from_numpy(rows[r]), mult, counts, plan.levels1,
                              plan.lane_bits, r, pad_to=plan.scatter_words).numpy()
    q = plan.shard_words
    messages = [two_stage.requantize(local, torch.from_numpy(total[r * q:(r + 1) * q].copy()),
                                     plan, r, r) for r in range(n)]
    state = local.messages(torch.cat(messages), layout,
                           core.step_sizes(local, scales, plan.levels1))
    out = torch.empty(rows.shape[1], dtype=torch.float64)
    local.decode_into(state, out, 1.0)
    return out.numpy()
