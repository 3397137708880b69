"""Global-QSGD as FSDP2's reduce-scatter (hvd_gqsgd.fsdp), through real torch.distributed Gloo
collectives under torchrun: 2, 3 and 4 ranks, 8 ranks oversubscribed, and the torch-ops path
(the one CUDA tensors take) with the numba kernels switched off.

Each configuration launches tests/workers/fsdp_checks.py once; every test compares what the
ranks recorded with gqsgd_lab/two_stage_oracle.py (stage_one_rows, a NumPy simulation written
from the algorithm's statement) or with expectations computed here from the inputs.
Quantized results match bit for bit; only statistics get a tolerance.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from fsdp_inputs import (  # noqa: E402
    BLOCK,
    GRID_CASES,
    SHAPES,
    grid,
    grid_rows,
    params_input,
    random_rows,
)

from gqsgd_lab.launch import free_port  # noqa: E402
from gqsgd_lab.two_stage_oracle import lane_width, stage_levels, stage_one_rows  # noqa: E402
from hvd_gqsgd import core  # noqa: E402

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).parent.parent
WORKER = ROOT / "tests" / "workers" / "fsdp_checks.py"
TIMEOUT_S = int(os.environ.get("GQSGD_TEST_LAUNCH_TIMEOUT", "600"))
ALL = ("grid", "recorded", "rotation", "unbiased", "error", "non_finite", "through_fsdp",
       "training", "checkpoint", "refusals")
# name -> (ranks, extra env, checks run)
CONFIGS = {
    "np2": (2, {}, ALL),
    "np3": (3, {}, ALL),
    "np4": (4, {}, ALL),
    "np8": (8, {}, ("grid", "recorded", "rotation", "error", "through_fsdp")),
    # the torch-ops path of CUDA tensors, run on CPU tensors
    "generic-np2": (2, {"HVD_GQSGD_KERNELS": "0"},
                    ("grid", "recorded", "rotation", "unbiased", "error", "non_finite",
                     "through_fsdp", "checkpoint")),
}
_JOBS: dict[str, list[dict]] = {}




def _launch(name: str, out: Path) -> list[dict]:
    n, extra, checks = CONFIGS[name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "FSDP_CHECKS": ",".join(checks), **extra}
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(n),
                "--master_port", str(free_port()), str(WORKER), str(out)]
    proc = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"{name} failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    results = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(n)]
    assert [r["size"] for r in results] == [n] * n
    return results


def _configs(check: str) -> list:
    return [pytest.param(name, id=name) for name, c in CONFIGS.items() if check in c[2]]


def _ranks(name: str, tmp_path_factory) -> list[dict]:
    if name not in _JOBS:
        _JOBS[name] = _launch(name, tmp_path_factory.mktemp(name))
    return _JOBS[name]


def _keys(seed: int, n: int, serial: int) -> list[list[int]]:
    """Each rank's noise key of each row for a call that starts after ``serial``: one key
    per row, in row order, from the rank's stream."""
    return [[core.noise_key(core.rank_seed(seed, r), serial + 1 + t) for t in range(n)]
            for r in range(n)]


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    return torch.from_numpy(np.asarray(values, np.float64)).to(getattr(torch, dtype)).double(
        ).numpy()


# --------------------------------------------------------------------------- the hook alone


@pytest.mark.parametrize("name", _configs("grid"))
def test_grid_rows_average_exactly_up_to_the_lane_bound(name, tmp_path_factory):
    """Grid inputs round deterministically: every shard is the exact average (lane sums at
    +-n L1 included) times one float32 rounding, on every path and world size."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    for case in GRID_CASES:
        bits, dtype, shard = case
        level = stage_levels(bits, n)[0]
        assert level >= 2 ** (bits - 1) - 1 or level == 2**15 - 1
        rows = [grid_rows(r, n, bits, shard).astype(np.float64) for r in range(n)]
        for t, rank in enumerate(ranks):
            got, stats = rank["grid"][case]
            codes = sum(np.rint(x[t] / grid(shard)) for x in rows)  # exact integers
            if shard > 2:
                assert codes[1] == n * level and codes[2] == -n * level  # the lane bound
            step = (level * grid(shard) / level / n).astype(np.float32).astype(np.float64)
            want = _cast((codes * step).astype(np.float32), dtype)
            np.testing.assert_array_equal(got, want, err_msg=str(case))
            width = lane_width(bits, n)
            words = -(-shard // (64 // width))
            assert stats["rounds"] == 1 and stats["total_payload"] == 8 * n * words


@pytest.mark.parametrize("name", _configs("recorded"))
def test_random_rows_replay_the_oracle_bit_for_bit(name, tmp_path_factory):
    """Random rows, noise keyed per row: uneven shard sizes (3000, 1, 4097 elements: partial
    blocks, a row shorter than a word), the L2 norm, 4 bits with a divide factor of 2.5."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    cases = [(0, 8, "max", n), (1, 8, "max", n), (2, 8, "max", n), (7, 8, "l2", n),
             (8, 4, "max", 2.5)]
    for i, (step, bits, norm, divisor) in enumerate(cases):
        serial, shard, _ = ranks[0]["recorded"][i]
        xs = [random_rows(r, n, step, shard).reshape(-1) for r in range(n)]
        want = stage_one_rows(xs, bits, _keys(5, n, serial), divisor,
                              core.default_scale_block(bits), norm)
        for t, rank in enumerate(ranks):
            assert rank["recorded"][i][0] == serial  # every rank at the same serial
            np.testing.assert_array_equal(rank["recorded"][i][2], want[t], err_msg=str(i))


@pytest.mark.parametrize("name", _configs("rotation"))
def test_rotated_rows_replay_the_oracle_bit_for_bit(name, tmp_path_factory):
    """rotation="hadamard": every rank rotates its whole input (blocks of the bits' default
    scale block in each row, signs keyed by the call count), the oracle sums the rotated
    rows, and each rank rotates its decoded row back (its blocks start at input element
    rank * shard): bit for bit."""
    from gqsgd_lab.rotation_oracle import forward, inverse

    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    steps = {0: 0, 1: 1, 2: 1, 3: 2}  # the input of each call (the second state ran twice)
    for i, (bits, serial, rotated, _) in enumerate(ranks[0]["rotation"]):
        block = core.default_scale_block(bits)
        row, _ = core.segments([2500], block)
        key = core.rotation_key(5, 0, rotated + 1)
        xs = [forward(random_rows(r, n, 20 + steps[i], 2500).reshape(-1), row * n, block, key)
              for r in range(n)]
        want = stage_one_rows(xs, bits, _keys(5, n, serial), n, block)
        for t, rank in enumerate(ranks):
            assert rank["rotation"][i][1:3] == (serial, rotated)
            back = inverse(want[t].astype(np.float32), row, block, key, start=t * 2500)
            np.testing.assert_array_equal(rank["rotation"][i][3], back, err_msg=str(i))


@pytest.mark.parametrize("name", _configs("unbiased"))
def test_mean_of_many_calls_is_unbiased(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    level = stage_levels(4, n)[0]
    for t, rank in enumerate(ranks):
        res = rank["unbiased"]
        xs = [random_rows(r, n, 0, 1500)[t].astype(np.float64) for r in range(n)]
        scale = np.max([np.abs(x) for x in xs], axis=0)
        blocks = np.arange(1500) // BLOCK
        scale = np.maximum.reduceat(scale, [0, BLOCK])[blocks]
        # each rank's code has variance <= 1/4: the average's is <= n/4 (s / L1 / n)**2
        se = np.sqrt(n / 4) * scale / level / n / np.sqrt(res["trials"])
        err = np.abs(res["mean"] - sum(xs) / n)
        assert np.all(err <= 5 * se), f"max error {(err / se).max():.2f} standard errors"


@pytest.mark.parametrize("name", _configs("error"))
def test_error_matches_one_rounding_per_rank_whatever_the_rank_count(name, tmp_path_factory):
    """Heavy-tailed rows, 20 calls: every element within s / L1 of the true average (the
    stage-1 bound, L1 >= 127 at any n), and the mean squared error within 15% of the
    predicted rounding variance sum_r frac (1 - frac) (s / L1 / n)**2."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    level = stage_levels(8, n)[0]
    assert level >= 127
    for t, rank in enumerate(ranks):
        xs = [random_rows(r, n, 1, 8192, heavy=True)[t].astype(np.float64) for r in range(n)]
        blocks = np.arange(8192) // BLOCK
        scale = np.max([np.abs(x) for x in xs], axis=0)
        scale = np.maximum.reduceat(scale, np.arange(0, 8192, BLOCK))[blocks]
        truth = sum(xs) / n
        predicted = 0.0
        for x in xs:
            y = np.abs(x) * level / scale
            f = y - np.floor(y)
            predicted += float(np.sum(f * (1 - f) * (scale / level / n) ** 2))
        errs = np.stack([out - truth for out in rank["error"]])
        assert np.all(np.abs(errs) <= scale / level * (1 + 1e-5))
        measured = float(np.mean(np.sum(errs**2, axis=1)))
        assert 0.85 < measured / predicted < 1.15, (measured, predicted)


@pytest.mark.parametrize("name", _configs("non_finite"))
def test_nan_and_inf_poison_their_block_in_every_shard(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    level = stage_levels(8, n)[0]
    rows = [grid_rows(r, n, 8, 3000).astype(np.float64) for r in range(n)]
    for t, rank in enumerate(ranks):
        got = rank["non_finite"]
        codes = sum(np.rint(x[t] / grid(3000)) for x in rows)
        want = (codes * (grid(3000) / n).astype(np.float32)).astype(np.float32)
        if t == 0:  # NaN in block 0 and +inf in block 1 of row 0 on the last rank
            assert np.isnan(got[:2 * BLOCK]).all()
            np.testing.assert_array_equal(got[2 * BLOCK:], want[2 * BLOCK:])
        else:
            np.testing.assert_array_equal(got, want)
    assert level >= 127


# --------------------------------------------------------------------------- through FSDP


def _fsdp_rows(grads: list[np.ndarray], n: int) -> np.ndarray:
    """FSDP2's reduce-scatter input for these full gradients (written from its definition):
    each gradient padded along dim 0 to a multiple of n and cut into n dim-0 chunks; row r is
    every gradient's chunk r, flattened, in parameter order."""
    rows: list[list[np.ndarray]] = [[] for _ in range(n)]
    for g in grads:
        dim0 = -(-g.shape[0] // n) * n
        padded = np.zeros((dim0, *g.shape[1:]), dtype=g.dtype)
        padded[:g.shape[0]] = g
        for r, chunk in enumerate(np.split(padded, n)):
            rows[r].append(chunk.reshape(-1))
    return np.stack([np.concatenate(r) for r in rows])


def _unshard(shards: list[np.ndarray], n: int) -> list[np.ndarray]:
    """The full gradients from every rank's decoded shard (the inverse of _fsdp_rows)."""
    out, offset = [], 0
    for shape in SHAPES:
        dim0 = -(-shape[0] // n) * n
        size = dim0 // n * int(np.prod(shape[1:], dtype=np.int64))
        full = np.concatenate([s[offset:offset + size] for s in shards])
        out.append(full.reshape(dim0, *shape[1:])[:shape[0]])
        offset += size
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", _configs("through_fsdp"))
def test_fully_shard_gradients_replay_the_oracle(name, dtype, tmp_path_factory):
    """A model whose gradients are the inputs, under fully_shard with padded dim-0 shards:
    each reduce-scatter's input is FSDP's layout of the inputs, its output the oracle's bit
    for bit (the torch-ops path draws the kernels' noise too), and FSDP's gradients are
    those outputs, unpadded and in the reduce dtype."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    runs = [r["through_fsdp"][dtype] for r in ranks]
    assert len(runs[0]["calls"]) == 2  # one module, one call per backward
    for step in range(2):
        serial = runs[0]["calls"][step][0]
        grads = [[_cast(x, dtype) for x in params_input(r, step)] for r in range(n)]
        rows = [_fsdp_rows(g, n) for g in grads]
        for r, run in enumerate(runs):
            np.testing.assert_array_equal(run["calls"][step][1], rows[r].reshape(-1))
        xs = [row.reshape(-1).astype(np.float32) for row in rows]
        shards = [run["calls"][step][2] for run in runs]
        want = stage_one_rows(xs, 8, _keys(9, n, serial), n, BLOCK)
        for got, w in zip(shards, want):
            np.testing.assert_array_equal(got, _cast(w, dtype))
        for run in runs:
            for g, want in zip(run["grads"][step], _unshard(shards, n)):
                np.testing.assert_array_equal(g, want)
    stats = runs[0]["stats"]
    assert stats["rounds"] == 2 and stats["tensors"] == 2 * len(SHAPES)
    shard = runs[0]["calls"][0][1].size // n
    words = -(-shard // (64 // lane_width(8, n)))  # per row
    size = 4 if dtype == "float32" else 2
    sent = 8 * n * words + 8 * n * -(-shard // BLOCK)  # codes and the MAX exchange
    assert stats["last_ratio"] == pytest.approx(n * shard * size / sent, rel=1e-12)


@pytest.mark.parametrize("name", _configs("training"))
def test_training_tracks_plain_fsdp(name, tmp_path_factory):
    """Digits MLP, a module per layer, 150 steps, 2 seeds: held-out loss within 2% of plain
    FSDP2's with fp32 and with bf16 reduce dtype; every rank sees the same loss."""
    ranks = _ranks(name, tmp_path_factory)
    res = ranks[0]["training"]
    assert all(r["training"] == res for r in ranks)
    for dtype in ("float32", "bfloat16"):
        plain, hooked = np.mean(res[(dtype, False)]), np.mean(res[(dtype, True)])
        assert plain < 0.2, f"plain FSDP reached only {plain:.3f}: too short to compare"
        assert abs(hooked - plain) <= 0.02 * plain, (dtype, hooked, plain)


@pytest.mark.parametrize("name", _configs("checkpoint"))
def test_state_dict_checkpoint_resumes_bit_for_bit(name, tmp_path_factory):
    """Model, optimizer and hook state_dicts at step 20, loaded into a freshly built model:
    steps 20-40 give the parameters of an uninterrupted run, bit for bit (the hook's noise
    stream continues)."""
    for rank in _ranks(name, tmp_path_factory):
        c = rank["checkpoint"]
        for a, b in zip(c["straight"], c["resumed"]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", _configs("refusals"))
def test_refusals_name_the_fix(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    for r in ranks:
        got = r["refusals"]
        assert "ValueError" in got["no_fsdp"] and "call fully_shard()" in got["no_fsdp"]
        assert "ValueError" in got["bits"] and "bits must be in [2, 16]" in got["bits"]
        assert "ValueError" in got["twice"] and "once per model" in got["twice"]
        assert "RuntimeError" in got["changed"] and "force-sum" in got["changed"]
        if n % 2 == 0 and n >= 4:
            assert "ValueError" in got["hsdp"] and "HSDP or replicate" in got["hsdp"]
        else:
            assert "hsdp" not in got


# --------------------------------------------------------------------------- no ranks needed


def _fake_module(groups):
    state = SimpleNamespace(_fsdp_param_groups=groups)
    return SimpleNamespace(_get_fsdp_state=lambda: state)


class _FakeGroup:
    """What hvd_gqsgd.fsdp reads of an FSDP parameter group, for a group of ``size`` ranks."""

    def __init__(self, size: int, replicate=None):
        self.mesh_info = SimpleNamespace(replicate_process_group=replicate)
        self._reduce_scatter_comm = None
        self.gradient_divide_factor = None
        self.fsdp_params = [1, 2]
        self._reduce_scatter_process_group = SimpleNamespace(size=lambda: size)


def test_group_checks_refuse_what_no_lane_or_mesh_allows():
    from hvd_gqsgd.fsdp import FSDPState, _comm

    state = FSDPState(bits=16)
    with pytest.raises(ValueError, match=r"wider than 32 bits\. Use bits <= 15\."):
        _comm(state, _fake_module([_FakeGroup(2**17)]), None)
    with pytest.raises(ValueError, match="2 FSDP parameter groups"):
        _comm(state, _fake_module([_FakeGroup(2), _FakeGroup(2)]), None)
    with pytest.raises(ValueError, match="HSDP or replicate"):
        _comm(state, _fake_module([_FakeGroup(2, replicate=object())]), None)
    assert _comm(state, _fake_module([]), None) is None
    comm = _comm(state, _fake_module([_FakeGroup(2**15)]), 3.0)
    assert comm is not None and comm.divide_factor == 3.0 and comm.tensors == 2


def test_import_loads_no_horovod_or_tensorflow():
    code = ("import sys, hvd_gqsgd.fsdp; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('horovod', 'tensorflow', 'keras')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "[]", out.stdout
