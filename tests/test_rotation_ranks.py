"""The rotation through the engine on several ranks in one process (tests/threaded_ranks.py's
fake Horovod: threads whose collectives meet by name), where the multi-process tests do not
reach: hierarchical Global-QSGD, 2 nodes of 2 ranks.  Every rank rotates its own bucket; the
node sums (float64, inside each fake node) are sums of rotated buckets, that is the rotation
of the node sums; two-stage sums them across the nodes and every rank rotates the decoded
average back: gqsgd_lab.two_stage_oracle.simulate_hierarchical on the rotated inputs, rotated
back by gqsgd_lab.rotation_oracle, bit for bit, on every rank."""

from __future__ import annotations

import numpy as np
import torch
from threaded_ranks import RankBackend, World

from gqsgd_lab.rotation_oracle import forward, inverse
from gqsgd_lab.two_stage_oracle import simulate_hierarchical
from hvd_gqsgd import core
from hvd_gqsgd.engine import Engine

NUMELS = [3000, 7, 2048, 100]  # partial blocks, whole blocks, a tiny tensor
SEED = 5


def _inputs(rank: int) -> list[np.ndarray]:
    return [np.random.default_rng([rank, i]).standard_t(3, n).astype(np.float32)
            for i, n in enumerate(NUMELS)]


def test_hierarchical_two_stage_with_rotation_replays_the_oracle():
    world, nodes, local = World(4, local_size=2), 2, 2

    def rank_work(rank: int) -> np.ndarray:
        backend = RankBackend(world, rank, seed=SEED)
        eng = Engine(backend, core.Settings(bits=4, seed=SEED, hierarchical=True,
                                            rotation="hadamard"), None, uid=0)
        probes = [eng.compress(torch.from_numpy(x)) for x in _inputs(rank)]
        for i, (p, _) in enumerate(probes):
            backend.average(p, f"probe.{i}")
        return np.concatenate([eng.decompress(p, c).numpy() for p, c in probes])

    got = world.run(rank_work)
    assert any(name.endswith(".node_rs") for name in world.names), "hierarchical did not run"
    block = core.default_scale_block(4)
    counts, _ = core.segments(NUMELS, block)
    key = core.rotation_key(SEED, 0, 0)  # the first bucket of the first round
    ys = [forward(np.concatenate(_inputs(r)), counts, block, key) for r in range(4)]
    rank_of = {(c, j): c * local + j for c in range(nodes) for j in range(local)}
    rotated = simulate_hierarchical(ys, NUMELS, 4, SEED, 1.0 / 4, nodes, local, rank_of)
    want = inverse(rotated.astype(np.float32), counts, block, key)
    for out in got:
        np.testing.assert_array_equal(out, want)
