"""Hierarchical GlobalQSGD (hvd_gqsgd/hierarchical.py) through real Horovod collectives.

Horovod with Gloo treats ``horovodrun --gloo -np 4 -H localhost:2,127.0.0.1:2`` as 2 nodes of
2 ranks on one machine (local_size 2, cross_size 2; a test checks it), and adding this
machine's host name as a third host gives 3 nodes of 2.  One job per layout runs
tests/workers/hier_checks.py, one runs it on unequal nodes (2 + 1 ranks); every test
below compares what the ranks recorded with a NumPy simulation written here: node sums in
float64, one code per node per lane, ``L = floor((2^(bits-1) - 1) / nodes)``.  Integer sums
must match exactly; only the random cases get a tolerance, stated where it is used.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from gqsgd_lab.launch import BIN, TIMEOUT_S
from hvd_gqsgd import core, hierarchical

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from hier_inputs import (  # noqa: E402
    BLOCK,
    GRID,
    GRID_BITS,
    GROUP_NUMELS,
    TWO_STAGE_NUMELS,
    node_levels,
    random_input,
    rank_grid,
)

WORKER = Path(__file__).parent / "workers" / "hier_checks.py"


def _third_host() -> str | None:
    """A third name for this machine that horovodrun runs locally (it must resolve to one
    of the machine's addresses, which is how horovodrun tells local hosts from remote)."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return None
    ours = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET}
    return name if name not in ("localhost", "127.0.0.1") and address in ours else None


# (nodes, ranks per node) -> horovodrun -H; the worker's mode
LAYOUTS = {(2, 2): ("localhost:2,127.0.0.1:2", "nodes"),
           (3, 2): (f"localhost:2,127.0.0.1:2,{_third_host()}:2", "nodes-lite")}
_JOBS: dict = {}  # one job per layout per session


def _launch(hosts: str, n: int, mode: str, out: Path) -> list[dict]:
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(n), "-H", hosts, sys.executable,
           str(WORKER), str(out), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    results = []
    for r in range(n):
        with open(out / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def _job(layout, tmp_path_factory):
    if layout not in _JOBS:
        if "None" in LAYOUTS[layout][0]:
            pytest.skip("no third local host name (socket.gethostname() is not local)")
        nodes, local = layout
        _JOBS[layout] = _launch(*LAYOUTS[layout][:1], nodes * local, LAYOUTS[layout][1],
                                tmp_path_factory.mktemp(f"hier-{nodes}x{local}"))
    return _JOBS[layout]


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=[f"{c}x{s}" for c, s in LAYOUTS])
def ranks(request, tmp_path_factory):
    """Per-rank results of one job: 2 nodes x 2 ranks, then 3 x 2."""
    return _job(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ranks22(tmp_path_factory):
    """2 nodes x 2 ranks: the only layout that runs the statistical and optimizer cases."""
    return _job((2, 2), tmp_path_factory)


# layouts where the hierarchy cannot help -> horovodrun -H, world size, the warning's reason
FALLBACKS = {"2+1": ("localhost:2,127.0.0.1:1", 3, "unequal rank counts"),
             "1x2": ("localhost:2", 2, "one node holds all 2 rank"),
             "2x1": ("localhost:1,127.0.0.1:1", 2, "each of the 2 nodes has one rank")}


@pytest.fixture(scope="module")
def unequal_ranks(tmp_path_factory):
    """2 ranks on one node, 1 on the other."""
    return _launch(*FALLBACKS["2+1"][:2], "unequal", tmp_path_factory.mktemp("hier-2+1"))


def _shape(results) -> tuple[int, int, int]:
    """(nodes, ranks per node, world size) as Horovod reported them."""
    return results[0]["where"][3], results[0]["where"][1], len(results)


def _all_equal(values):
    for v in values[1:]:
        np.testing.assert_array_equal(v, values[0])  # bit-identical on every rank
    return values[0]


def _node_of(results) -> list[tuple[int, int]]:
    """(cross_rank, local_rank) of every rank, as Horovod reported it."""
    return [(r["where"][2], r["where"][0]) for r in results]


def _node_sums(xs, layout):
    """Float64 node sums of per-rank inputs ``xs`` (simulating step 2)."""
    sums = {}
    for x, (c, _) in zip(xs, layout):
        sums[c] = sums.get(c, 0) + np.asarray(x, dtype=np.float64)
    return [sums[c] for c in sorted(sums)]


def _block_max(arrays, block):
    """Per element: the max over ``arrays`` of max |a| within the element's block."""
    out = np.zeros_like(arrays[0])
    for a in arrays:
        for lo in range(0, a.size, block):
            out[lo:lo + block] = np.maximum(out[lo:lo + block], np.abs(a[lo:lo + block]).max())
    return out


# --------------------------------------------------------------------------- single process


def test_shard_plan_cuts_whole_words_and_covers_the_bucket():
    for counts, bits, parts in [([70, 45, 1, 3], 8, 2), ([5], 8, 4), ([1000, 24, 3], 3, 3),
                                ([16] * 9, 16, 2), ([1], 16, 2)]:
        shards = hierarchical.shard_plan(counts, bits, parts)
        lanes = core.lanes_per_word(bits)
        assert len(shards) == parts
        assert shards[0].lo == 0 and shards[-1].hi == sum(counts)
        for a, b in zip(shards, shards[1:]):
            # word boundaries (or the bucket's end, before empty shards), no gap
            assert a.hi == b.lo and (a.hi % lanes == 0 or a.hi == sum(counts))
        words = [core.packed_words(s.hi - s.lo, bits) for s in shards]
        assert sum(words) == core.packed_words(sum(counts), bits)
        ends = np.cumsum([0, *counts])
        for s in shards:  # counts per touched segment, as core.encode of the shard needs
            assert sum(s.counts) == s.hi - s.lo
            for seg, cnt in zip(range(s.first, s.stop), s.counts):
                assert cnt == min(s.hi, ends[seg + 1]) - max(s.lo, ends[seg]) > 0


def test_split_words():
    assert hierarchical.split_words(7, 3) == [3, 2, 2]
    assert hierarchical.split_words(1, 2) == [1, 0]
    assert hierarchical.split_words(0, 2) == [0, 0]


def test_grid_decides_like_the_issue_says():
    two_by_two = [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert hierarchical._grid(two_by_two) == ((0, 1), (2, 3))
    round_robin = [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    assert hierarchical._grid(round_robin) == ((0, 2), (1, 3))
    assert hierarchical._grid([(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]) is None  # 2 + 1
    assert hierarchical._grid([(0, 2, 0, 2), (1, 2, 0, 2)]) is None  # claims 4, has 2


class FakeBackend:
    """Just enough of a backend for :func:`hierarchical.topology` in one process: ``rows``
    is every rank's (local_rank, local_size, cross_rank, cross_size), and the MAX allreduce
    is simulated by building every rank's table vector."""

    GLOBAL = object()

    def __init__(self, rows, rank):
        self.rows, self.rank = rows, rank
        for name in hierarchical.BACKEND_METHODS:
            if not hasattr(self, name):
                setattr(self, name, None)

    def global_process_set(self):
        return self.GLOBAL

    def topology(self):
        return self.rows[self.rank]

    def probe(self, values, like):
        return np.asarray(values, dtype=np.float64)

    def allreduce_max(self, vec, name, pset):
        tables = np.zeros((len(self.rows), 4 * len(self.rows)))
        for r, row in enumerate(self.rows):
            tables[r, 4 * r:4 * r + 4] = row
        assert np.array_equal(vec, tables[self.rank])  # what this rank put in
        return tables.max(axis=0)

    def host_list(self, t):
        return [float(v) for v in t]


def _topologies(rows):
    return [hierarchical.topology(FakeBackend(rows, r), r, len(rows), FakeBackend.GLOBAL,
                                  "t", None) for r in range(len(rows))]


def test_topology_decisions(recwarn):
    trees = _topologies([(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)])
    assert [(t.cross_rank, t.local_rank) for t in trees] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert trees[3].node == (2, 3) and trees[3].peers == (1, 3) and trees[0].cross_size == 2
    assert not recwarn.list  # a real hierarchy: no warning
    for rows, why in (([(0, 1, 0, 2), (0, 1, 1, 2)], "each of the 2 nodes has one rank"),
                      ([(0, 2, 0, 1), (1, 2, 0, 1)], "one node holds all 2 rank"),
                      ([(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)], "unequal rank counts")):
        hierarchical._WARNED.clear()
        with pytest.warns(RuntimeWarning, match=why) as caught:
            assert _topologies(rows) == [None] * len(rows)
            assert _topologies(rows) == [None] * len(rows)
        assert len(caught) == 1, [str(w.message) for w in caught]  # once, not once per call
        assert f"levels for n={len(rows)} ranks" in str(caught[0].message)
        assert "hierarchical=False" in str(caught[0].message)  # how to silence it
    with pytest.raises(ValueError, match="global process set"):
        hierarchical.topology(FakeBackend([(0, 1, 0, 1)], 0), 0, 1, object(), "t", None)


def test_backend_without_the_methods_is_refused():
    class Bare:
        pass
    with pytest.raises(TypeError, match="alltoall"):
        hierarchical.check_backend(Bare())


def test_settings_validate_hierarchical():
    assert core.Settings(hierarchical=True).hierarchical
    with pytest.raises(ValueError, match="True or False"):
        core.Settings(hierarchical=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        core.Settings(hierarchical=True, chunk_bytes=1 << 20)


# --------------------------------------------------------------------------- 2x2, 3x2


@pytest.mark.multiproc
def test_horovod_sees_the_hosts_as_nodes(ranks):
    nodes, local, world = _shape(ranks)
    assert (nodes, local) in LAYOUTS and world == nodes * local
    assert [r["size"] for r in ranks] == [world] * world
    assert {r["where"][1] for r in ranks} == {local} and {r["where"][3] for r in ranks} == {nodes}
    assert sorted(_node_of(ranks)) == [(c, j) for c in range(nodes) for j in range(local)]


@pytest.mark.multiproc
@pytest.mark.parametrize("bits", GRID_BITS)
def test_grid_inputs_sum_exactly_with_levels_of_the_node_count(ranks, bits):
    """Node sums are multiples of 2**-3 with |k| <= L(bits, nodes) and every block's max is
    L: exact only if each node's sum is quantized with L set by the node count."""
    nodes, local, world = _shape(ranks)
    layout = _node_of(ranks)
    exact = np.sum([rank_grid(c, j, local, nodes, bits, 200, 0) for c, j in layout], axis=0)
    for dtype in ("float32", "float64"):
        for op in ("sum", "average"):
            got = [r["grid_exact"][(bits, dtype, op)] for r in ranks]
            assert {g[0] for g in got} == {f"torch.{dtype}"}
            result = _all_equal([g[1] for g in got])
            if op == "sum":  # integer code sums times a power of two: exact
                np.testing.assert_array_equal(result, exact)
            else:  # the integer sums exactly; then one rounding of sum / world into dtype
                assert np.all(np.round(result * world / GRID) == exact / GRID)
                rtol = {"float32": 1e-7, "float64": 1e-15}[dtype]
                np.testing.assert_allclose(result, exact / world, rtol=rtol, atol=0)
    # the extreme lanes really were reached: all nodes +L, then all -L
    level = node_levels(bits, nodes)
    assert level >= 1
    np.testing.assert_array_equal(exact[1:3], [nodes * level * GRID, -nodes * level * GRID])


@pytest.mark.multiproc
@pytest.mark.parametrize("bits", GRID_BITS)
def test_grouped_tensors_with_block_scales_sum_exactly(ranks, bits):
    """Several tensors in one bucket, 16-element scale blocks that straddle the shard
    boundary, and tensors too small to fill every shard."""
    nodes, local, world = _shape(ranks)
    layout = _node_of(ranks)
    got = _all_equal([np.concatenate(r["grid_exact"][(bits, "grouped")]) for r in ranks])
    exact = np.concatenate([np.sum([rank_grid(c, j, local, nodes, bits, n, BLOCK)
                                    for c, j in layout], axis=0) for n in GROUP_NUMELS])
    np.testing.assert_array_equal(got, exact)


@pytest.mark.multiproc
def test_a_bucket_smaller_than_one_word_per_rank_sums_exactly(ranks):
    nodes, local, world = _shape(ranks)
    layout = _node_of(ranks)
    exact = np.sum([rank_grid(c, j, local, nodes, 8, 3, 0) for c, j in layout], axis=0)
    np.testing.assert_array_equal(_all_equal([r["grid_exact"]["tiny"] for r in ranks]), exact)


@pytest.mark.multiproc
def test_bits3_works_where_flat_refuses(ranks):
    nodes, local, world = _shape(ranks)
    assert (2 ** 2 - 1) // world == 0 and node_levels(3, nodes) == 1
    for r in ranks:
        assert r["flat_refuses"].startswith("ValueError"), r["flat_refuses"]
        assert f"bits >= {core.min_bits(world)}" in r["flat_refuses"]
    assert (3, "float32", "sum") in ranks[0]["grid_exact"]  # checked exact above


@pytest.mark.multiproc
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_random_inputs_within_one_step_per_node(ranks, norm):
    """|error| <= nodes * s_b / L per element of the sum (each node's code is off by less
    than one step), divided by the world size for Average.  ``max``: s_b is the block's max
    |node sum| over nodes; ``l2``: at most the block's L2 norm of a node sum."""
    nodes, local, world = _shape(ranks)
    layout = _node_of(ranks)
    xs = [random_input(r, 3000).astype(np.float32) for r in range(world)]
    sums = _node_sums(xs, layout)
    if norm == "max":
        scale = _block_max(sums, core.DEFAULT_SCALE_BLOCK)
    else:
        scale = np.zeros(3000)
        for y in sums:
            for lo in range(0, 3000, core.DEFAULT_SCALE_BLOCK):
                block = y[lo:lo + core.DEFAULT_SCALE_BLOCK]
                scale[lo:lo + block.size] = np.maximum(scale[lo:lo + block.size],
                                                       np.linalg.norm(block))
    got = _all_equal([r["random_bounds"][norm][0] for r in ranks])
    err = np.abs(got - np.sum(xs, axis=0, dtype=np.float64) / world)
    bound = nodes * scale / node_levels(8, nodes) / world
    assert np.all(err <= bound * (1 + 1e-5)) and err.max() > 0


@pytest.mark.multiproc
def test_stats_count_the_bytes_each_rank_sends(ranks):
    """1024 fp32 elements, bits=8: 128 words, a 64-word shard per rank (2 per node), cut
    into one piece per node (32 + 32, or 22 + 21 + 21 words).  Packed bytes sent to other
    ranks: the shard but this node's piece (step 5), that piece to every other node (step 6),
    the shard to the node's other rank (step 7).  Overhead: 512 fp32 elements to the node's
    other rank, one scale, the topology table, the probe."""
    nodes, local, world = _shape(ranks)
    assert local == 2
    for r in ranks:
        stats = r["random_bounds"]["stats_1024"]
        c = r["where"][2]
        piece = 64 // nodes + (c < 64 % nodes)
        assert stats["last_uncompressed"] == 4096
        assert stats["last_payload"] == 8 * ((64 - piece) + (nodes - 1) * piece + 64)
        if nodes == 2:
            assert stats["last_payload"] == core.wire_bytes(1024, 8)  # flat sends as much
        assert stats["last_overhead"] == (512 * 4 + core.scale_exchange_bytes(1)
                                          + 8 * 4 * world + core.PROBE_BYTES)


def _predicted_variance(xs, n_levels):
    """Per element: the variance of the sum of stochastically rounded ``xs`` (one scale for
    the tensor, the max |x| over ``xs``): sum over terms of step^2 * f (1 - f), f the
    fractional part of x L / s."""
    scale = max(float(np.abs(x).max()) for x in xs)
    step = scale / n_levels
    var = np.zeros_like(xs[0], dtype=np.float64)
    for x in xs:
        y = np.asarray(x, dtype=np.float64) / step
        f = y - np.floor(y)
        var += step * step * f * (1 - f)
    return var


@pytest.mark.multiproc
def test_unbiased_and_error_lower_than_flat_by_the_predicted_factor(ranks22):
    """bits=4 at 2 nodes x 2: flat L = 1 (4 codes per lane), hierarchical L = 3 (2 codes).
    Over 40 trials x 2000 elements each MSE is within 15% of its prediction, and so is their
    ratio; the mean is within 5 standard errors of the exact sum everywhere."""
    ranks = ranks22
    nodes, local, world = _shape(ranks)
    layout = _node_of(ranks)
    mom = ranks[0]["moments"]
    trials = mom["trials"]
    xs = [random_input(r, 2000, seed=1).astype(np.float32) for r in range(world)]
    exact = np.sum(xs, axis=0, dtype=np.float64)
    predicted = {"hier": _predicted_variance(_node_sums(xs, layout), node_levels(4, nodes)),
                 "flat": _predicted_variance(xs, core.levels(4, world))}
    measured = {}
    for name in ("hier", "flat"):
        _all_equal([r["moments"][name][0] for r in ranks])
        s1, s2 = mom[name]
        mean = s1 / trials
        measured[name] = float(np.mean(s2 / trials - 2 * exact * mean + exact * exact))
        assert measured[name] == pytest.approx(float(predicted[name].mean()), rel=0.15), name
        se = np.sqrt(predicted[name] / trials) + 1e-9
        assert np.all(np.abs(mean - exact) <= 5 * se + 1e-6), name
    ratio = measured["flat"] / measured["hier"]
    want = float(predicted["flat"].mean() / predicted["hier"].mean())
    assert ratio == pytest.approx(want, rel=0.15) and ratio > 2, (ratio, want)


@pytest.mark.multiproc
def test_distributed_optimizer_grads_within_one_step_per_node(ranks22):
    nodes, _, world = _shape(ranks22)
    layout = _node_of(ranks22)
    per_rank = [r["optimizer_grads"] for r in ranks22]
    for i in range(len(per_rank[0]["local"])):
        grads = [p["local"][i] for p in per_rank]
        got = _all_equal([p["reduced"][i] for p in per_rank])
        sums = _node_sums(grads, layout)
        scale = max(float(np.abs(y).max()) for y in sums)  # each tensor < 1024 elements
        bound = nodes * scale / node_levels(8, nodes) / world * (1 + 1e-5) + 1e-12
        assert np.abs(got - np.mean(grads, axis=0)).max() <= bound, i


# --------------------------------------------------------------------------- 2 + 1 ranks


@pytest.mark.multiproc
def test_unequal_nodes_fall_back_to_flat_with_one_warning(unequal_ranks):
    n = len(unequal_ranks)
    assert sorted(r["where"][1] for r in unequal_ranks) == [1, 2, 2]  # local sizes
    exact = np.sum([r["unequal"]["codes"] for r in unequal_ranks], axis=0) * 2.0**-3
    for r in unequal_ranks:
        res = r["unequal"]
        assert len(res["warnings"]) == 1, res["warnings"]
        assert res["warnings"][0].startswith("RuntimeWarning") and "unequal" in res["warnings"][0]
        assert f"n={n}" in res["warnings"][0]
    # flat levels (42 at 3 ranks): the flat grid inputs sum exactly
    np.testing.assert_array_equal(_all_equal([r["unequal"]["sum"] for r in unequal_ranks]),
                                  exact)
    np.testing.assert_array_equal(_all_equal([r["unequal"]["sum2"] for r in unequal_ranks]),
                                  exact)
    assert math.isclose(core.levels(8, n), 42)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["1x2", "2x1"])
def test_one_node_or_one_rank_per_node_falls_back_to_flat_with_one_warning(layout, tmp_path):
    """The README's options table: one node, or one rank per node, runs flat Global-QSGD and
    says so once per process (two allreduces, one warning), with flat's exact grid sums."""
    hosts, n, why = FALLBACKS[layout]
    ranks = _launch(hosts, n, "unequal", tmp_path)
    assert {(r["where"][3], r["where"][1]) for r in ranks} == {
        (int(layout[0]), int(layout[2]))}  # Horovod's (cross_size, local_size)
    exact = np.sum([r["unequal"]["codes"] for r in ranks], axis=0) * 2.0**-3
    for r in ranks:
        caught = r["unequal"]["warnings"]
        assert len(caught) == 1, caught
        assert caught[0].startswith("RuntimeWarning") and why in caught[0], caught[0]
        assert f"n={n}" in caught[0]
    for key in ("sum", "sum2"):
        np.testing.assert_array_equal(_all_equal([r["unequal"][key] for r in ranks]), exact)


def test_two_stage_across_nodes_replays_the_oracle(ranks22):
    """hierarchical=True with two_stage=True: node sums in float64, each node shard summed
    across the nodes in wide lanes, requantized and gathered; equal to the oracle's bit for
    bit (the fused path's noise keys are each rank's serials 1 and 2), on every rank."""
    from gqsgd_lab.two_stage_oracle import simulate_hierarchical

    nodes, local, world = _shape(ranks22)
    rank_of = {(c, j): r for r, (c, j) in enumerate(_node_of(ranks22))}
    xs = [random_input(r, sum(TWO_STAGE_NUMELS)).astype(np.float32) for r in range(world)]
    cases = ranks22[0]["two_stage"]
    assert len(cases) == 4
    for bits, op in cases:
        got = _all_equal([r["two_stage"][(bits, op)] for r in ranks22])
        want = simulate_hierarchical(xs, list(TWO_STAGE_NUMELS), bits, 7,
                                     1.0 / world if op == "average" else 1.0, nodes, local,
                                     rank_of, block=BLOCK)
        np.testing.assert_array_equal(got, want, err_msg=f"{bits} {op}")
