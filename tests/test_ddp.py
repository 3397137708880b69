"""Global-QSGD as a DDP communication hook (hvd_gqsgd.ddp), through real torch.distributed
Gloo collectives: 2 and 3 ranks on one machine (mpirun, and torchrun), the generic torch-ops
path (the one CUDA tensors take) with the numba kernels switched off, and 2 emulated hosts
over TCP (under mpirun, and under one torchrun per host as on a real multi-node job).

Each configuration launches tests/workers/ddp_checks.py once; every test below compares what
the ranks recorded with a single-process NumPy simulation written here from the algorithm's
definition.  Quantized results must match bit for bit; only statistics get a tolerance.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from ddp_inputs import (  # noqa: E402
    BLOCK,
    CHUNK_BYTES,
    EXACT_CASES,
    SHAPES,
    exact_inputs,
    grid,
    random_inputs,
)

from gqsgd_lab import launch  # noqa: E402
from hvd_gqsgd import core, kernels  # noqa: E402

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).parent.parent
WORKER = ROOT / "tests" / "workers" / "ddp_checks.py"
TIMEOUT_S = int(os.environ.get("GQSGD_TEST_LAUNCH_TIMEOUT", "600"))
ALL = ("exact", "recorded", "rotation", "unbiased", "independent", "options", "subgroup",
       "bad_bits", "non_finite", "checkpoint", "join", "training", "two_stage")
# name -> (controller, ranks, extra env, checks run)
CONFIGS = {
    "local-np2": ("local", 2, {}, ALL),
    "local-np3": ("local", 3, {}, ALL),
    # the torch-ops path of CUDA tensors, run on CPU tensors
    "generic-np2": ("local", 2, {"HVD_GQSGD_KERNELS": "0"},
                    tuple(c for c in ALL if c != "training")),
    "hosts-np2": ("hosts", 2, {}, ("exact", "recorded", "options", "subgroup", "join")),
    "torchrun-np2": ("torchrun", 2, {}, ("exact", "options")),
    # one torchrun per emulated host, static rendezvous at host 0: torchrun across nodes
    "torchrun-hosts-np2": ("torchrun-hosts", 2, {}, ("exact", "recorded", "options")),
}
_JOBS: dict[str, list[dict]] = {}




def _launch(name: str, out: Path) -> list[dict]:
    controller, n, extra, checks = CONFIGS[name]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DDP_CHECKS": ",".join(checks),
           "MASTER_PORT": str(launch.free_port()), "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_USE_LEGACY_KERAS": "0", **extra}  # launch.command exports the last two
    command = [sys.executable, str(WORKER), str(out)]
    if controller == "hosts":
        with launch.EmulatedHosts(n, rate=None) as hosts:
            # Gloo binds to what the hostname resolves to (127.0.0.1 in every namespace)
            env.update(MASTER_ADDR=hosts.addresses[0], GLOO_SOCKET_IFNAME="eth0")
            proc = hosts.mpirun(command, env=env, timeout=TIMEOUT_S)
    elif controller == "torchrun-hosts":
        proc = _torchrun_on_hosts(n, command, env)
    elif controller == "torchrun":  # it sets RANK, WORLD_SIZE and MASTER_ADDR itself
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(n),
                    "--master_port", env.pop("MASTER_PORT")]
        proc = subprocess.run([*torchrun, *command[1:]], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    else:  # mpirun's local ranks inherit env
        env["MASTER_ADDR"] = "127.0.0.1"
        proc = subprocess.run(launch.command(WORKER.name, "mpi", n, str(out)),
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"{name} failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    results = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(n)]
    assert [r["size"] for r in results] == [n] * n
    return results


def _torchrun_on_hosts(n: int, command: list[str], env: dict[str, str]
                       ) -> subprocess.CompletedProcess:
    """One ``torchrun --nnodes n --node_rank i`` per emulated host (network namespace), each
    starting one rank; they meet at host 0's address.  Bounded by TIMEOUT_S; the namespaces
    (and anything left in them) go when the block ends."""
    port = env.pop("MASTER_PORT")
    # files, not pipes: a host whose pipe filled up while we waited on the other would stall
    # both in their next collective
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]
    with launch.EmulatedHosts(n, rate=None) as hosts:
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # the hostname resolves to 127.0.0.1 in each
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", ns, str(Path(sys.executable).parent / "torchrun"),
             "--nnodes", str(n), "--nproc_per_node", "1", "--node_rank", str(i),
             "--master_addr", hosts.addresses[0], "--master_port", port, *command[1:]],
            env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, text=True)
            for i, (ns, log) in enumerate(zip(hosts.hosts, logs))]
        try:
            for p in procs:
                p.wait(timeout=TIMEOUT_S)
        finally:
            for p in procs:
                p.kill()
    output = []
    for i, log in enumerate(logs):
        log.seek(0)
        output.append(f"[host {i}] {log.read()}")
        log.close()
    failed = [p.returncode for p in procs if p.returncode != 0]
    return subprocess.CompletedProcess(procs[0].args, failed[0] if failed else 0, "",
                                       "".join(output))


def _configs(check: str) -> list:
    return [pytest.param(name, id=name) for name, c in CONFIGS.items() if check in c[3]]


def _ranks(name: str, tmp_path_factory) -> list[dict]:
    if name not in _JOBS:
        _JOBS[name] = _launch(name, tmp_path_factory.mktemp(name))
    return _JOBS[name]


# --------------------------------------------------------------------------- the oracle


def _levels(bits: int, n: int) -> int:
    """Levels per sign so that n codes sum inside a bits-bit signed lane."""
    return (2 ** (bits - 1) - 1) // n


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32/64 values to ``dtype`` the way a tensor copy does, back as float64."""
    return torch.from_numpy(values).to(getattr(torch, dtype)).double().numpy()


def _block_max(xs: list[np.ndarray]) -> np.ndarray:
    """Per element: the global scale of its block, max over ranks of the block's max |x|."""
    flat = np.abs(np.stack([np.asarray(x, np.float64).reshape(-1) for x in xs])).max(0)
    blocks = np.arange(flat.size) // BLOCK
    return np.maximum.reduceat(flat, np.flatnonzero(np.diff(blocks, prepend=-1)))[blocks]


def _rescale(sums: np.ndarray, scale: np.ndarray, level: int, n: int, dtype: str) -> np.ndarray:
    """The decoded average: lane sum times float(s / L / n), rounded once, in the dtype the
    bucket is computed in (fp64 for fp64, else fp32), then cast to the parameter dtype."""
    compute = np.float64 if dtype == "float64" else np.float32
    step = (scale / level / n).astype(compute).astype(np.float64)
    return _cast((sums * step).astype(compute), dtype)


def _exact_expected(n: int, bits: int, dtype: str) -> list[np.ndarray]:
    """Grid inputs round deterministically: the codes are x / grid exactly."""
    xs = [exact_inputs(r, n, bits) for r in range(n)]
    out = []
    for i in range(len(SHAPES)):
        per_rank = [_cast(x[i].reshape(-1), dtype) for x in xs]
        sums = np.rint(sum(per_rank) / grid(per_rank[0].size))
        out.append(_rescale(sums, _block_max(per_rank), _levels(bits, n), n, dtype))
    return out


def _uniforms(key: int, total: int) -> np.ndarray:
    """The rank's rounding noise for a bucket: the kernels' counter-based stream, which the
    torch-ops path draws too."""
    return kernels.noise(key, 0, total)


def _random_expected(n: int, step: int, buckets, chunk_bytes: int = 0) -> list[np.ndarray]:
    """Stochastic rounding simulated element by element with each rank's own noise.  With
    ``chunk_bytes`` a bucket goes in chunks of that many packed bytes (8 codes per word,
    cut at word boundaries), each with the next noise serial, its stream starting at the
    chunk's first element."""
    xs = [[x.reshape(-1) for x in random_inputs(r, step)] for r in range(n)]
    level = _levels(8, n)
    out: list = [None] * len(SHAPES)
    for serial, params in buckets:
        sizes = [xs[0][i].size for i in params]
        scale = np.concatenate([_block_max([x[i] for x in xs]) for i in params])
        mult = np.where(scale > 0, level / scale, 0).astype(np.float32)
        sums = np.zeros(sum(sizes), dtype=np.int64)
        for r in range(n):
            y = np.clip(np.concatenate([xs[r][i] for i in params]) * mult, -level, level)
            low = np.floor(y)
            step_codes = (max(1, chunk_bytes // 8) * core.lanes_per_word(8) if chunk_bytes
                          else y.size)
            u = np.concatenate([
                _uniforms(core.noise_key(core.rank_seed(5, r), serial + j),
                          min(step_codes, y.size - lo))
                for j, lo in enumerate(range(0, y.size, step_codes))])
            sums += (low + (u < (y - low).astype(np.float64))).astype(np.int64)
        decoded = _rescale(sums, scale, level, n, "float32")
        for i, part in zip(params, np.split(decoded, np.cumsum(sizes)[:-1])):
            out[i] = part
    return out


def _all_equal(values):
    for v in values[1:]:
        for a, b in zip(v, values[0]):
            np.testing.assert_array_equal(a, b)  # bit-identical, NaN == NaN
    return values[0]


def _assert_grads(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g).reshape(-1), e)


# --------------------------------------------------------------------------- the tests


def test_import_loads_no_horovod_or_tensorflow():
    code = ("import sys, hvd_gqsgd.ddp; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('horovod', 'tensorflow', 'keras')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", _configs("exact"))
def test_grid_inputs_decode_bit_exactly_and_identically(name, tmp_path_factory):
    """Every (bits, dtype): the average equals the simulation bit for bit on every rank,
    including lanes at the overflow bound +-nL; stats count one round of the right bytes."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    for bits, dtype in EXACT_CASES:
        got = _all_equal([r["exact"][(bits, dtype)][0] for r in ranks])
        _assert_grads(got, _exact_expected(n, bits, dtype))
        chunked = _all_equal([r["exact"][(bits, dtype, "chunked")] for r in ranks])
        _assert_grads(chunked, _exact_expected(n, bits, dtype))  # chunk_bytes=CHUNK_BYTES
        bound = n * _levels(bits, n)  # elements 1 and 2: every rank sent +L and -L
        assert np.rint(got[0][1] * n / grid(3)[1]) == -np.rint(got[0][2] * n / grid(3)[2]) == bound
        stats = ranks[0]["exact"][(bits, dtype)][1]
        size = torch.finfo(getattr(torch, dtype)).bits // 8
        assert stats["rounds"] == 1 and stats["total_uncompressed"] == numel * size
        assert numel * bits / 8 <= stats["total_payload"] <= numel * bits / 8 + 8 * len(SHAPES)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-sum", "chunked"])
@pytest.mark.parametrize("name", _configs("recorded"))
def test_random_inputs_match_simulated_stochastic_rounding(name, chunked, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    runs = [r["recorded"]["chunked"] if chunked else r["recorded"] for r in ranks]
    chunk_bytes = CHUNK_BYTES if chunked else 0
    buckets = list(runs[0]["buckets"])  # DDP rebuilds its buckets after step 0
    for step in range(2):
        got = _all_equal([run["grads"][step] for run in runs])
        taken = 0
        while sorted(i for _, ps in buckets[:taken] for i in ps) != list(range(len(SHAPES))):
            taken += 1
            assert taken <= len(buckets), "the recorded buckets do not cover every parameter"
        _assert_grads(got, _random_expected(n, step, buckets[:taken], chunk_bytes))
        buckets = buckets[taken:]
    assert not buckets
    if chunked:  # a key per chunk: serials advance by more than one per bucket
        serials = [serial for serial, _ in runs[0]["buckets"]]
        assert max(np.diff(serials)) > 1


@pytest.mark.parametrize("name", _configs("recorded"))
def test_l2_norm_scale_bounds_the_error_by_one_step(name, tmp_path_factory):
    """norm="l2": s is the max over ranks of each block's L2 norm; every rank's code is
    floor(xL/s) or one above, so the average is within s / L of the true one."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    got = _all_equal([r["recorded"]["l2"] for r in ranks])
    for i, g in enumerate(got):
        xs = [random_inputs(r, 0)[i].reshape(-1).astype(np.float64) for r in range(n)]
        blocks = np.arange(xs[0].size) // BLOCK
        norms = [np.sqrt(np.bincount(blocks, x * x))[blocks] for x in xs]
        step = np.max(norms, axis=0) / _levels(8, n)
        assert np.all(np.abs(g.reshape(-1) - sum(xs) / n) <= step * (1 + 1e-5))


@pytest.mark.parametrize("name", _configs("unbiased"))
def test_mean_of_many_steps_is_unbiased(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    res = _all_equal([[r["unbiased"]["mean"]] for r in ranks])[0]
    xs = [random_inputs(r, 0)[0][:2500].astype(np.float64) for r in range(n)]
    # each rank's code has variance <= 1/4, so the average's is <= n/4 * (s / L / n)**2
    se = np.sqrt(n / 4) * _block_max(xs) / _levels(4, n) / n / np.sqrt(ranks[0]["unbiased"]
                                                                           ["trials"])
    err = np.abs(res - sum(xs) / n)
    assert np.all(err <= 5 * se), f"max error {(err / se).max():.2f} standard errors"


@pytest.mark.parametrize("name", _configs("independent"))
def test_rounding_noise_is_independent_across_identically_seeded_ranks(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    assert all(r["independent"]["rng_untouched"] for r in ranks)
    sums = np.asarray(_all_equal([[r["independent"]["sums"]] for r in ranks])[0])
    scaled = np.delete(sums * n * 16, np.s_[::BLOCK], axis=1)  # sums of n codes, 10 or 11
    codes = np.rint(scaled)
    assert np.abs(scaled - codes).max() < 1e-3 and set(np.unique(codes)) <= set(
        range(10 * n, 11 * n + 1))
    var = (codes - n * 10.5).var()
    # independent: n/4; one shared stream: n**2/4
    assert 0.85 * n / 4 < var < 1.15 * n / 4, f"variance {var}, independent {n / 4}"


@pytest.mark.parametrize("name", _configs("options"))
def test_ddp_options(name, tmp_path_factory):
    """gradient_as_bucket_view, static_graph (3 steps), find_unused_parameters (2 steps) and
    no_sync accumulation (x/2 + x/4 unsynced, then x/4 synced) all give the exact average."""
    ranks = _ranks(name, tmp_path_factory)
    expected = _exact_expected(len(ranks), 8, "float32")
    opts = [r["options"] for r in ranks]
    _assert_grads(_all_equal([o["bucket_view"] for o in opts]), expected)
    _assert_grads(_all_equal([o["no_sync"] for o in opts]), expected)
    for step in range(3):
        _assert_grads(_all_equal([o["static_graph"][step] for o in opts]), expected)
    for step in range(2):
        _assert_grads(_all_equal([o["find_unused"][step] for o in opts]), expected)


@pytest.mark.parametrize("name", _configs("subgroup"))
def test_subgroup_averages_over_its_own_ranks(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    got = _all_equal([r["subgroup"] for r in ranks[:2]])
    _assert_grads(got, _exact_expected(2, 8, "float32"))
    for r in ranks[2:]:  # a state for a group this rank is not in
        assert "is not in GlobalQSGDState's process_group" in r["subgroup"], r["subgroup"]


@pytest.mark.parametrize("name", _configs("bad_bits"))
def test_too_few_bits_name_the_bits_that_work(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    works = min(b for b in range(2, 17) if _levels(b, n) >= 1)
    for r in ranks:
        assert r["bad_bits"] is not None and f"Use bits >= {works}." in r["bad_bits"]


@pytest.mark.parametrize("name", _configs("non_finite"))
def test_nan_and_inf_poison_their_block_on_every_rank(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    got = _all_equal([r["non_finite"] for r in ranks])
    expected = _exact_expected(len(ranks), 8, "float32")
    first = got[0].reshape(-1)
    assert np.isnan(first[:2 * BLOCK]).all()  # NaN in block 0, +inf in block 1
    np.testing.assert_array_equal(first[2 * BLOCK:], expected[0][2 * BLOCK:])
    _assert_grads(got[1:], expected[1:])


@pytest.mark.parametrize("name", _configs("checkpoint"))
def test_checkpointed_state_continues_its_noise_stream(name, tmp_path_factory):
    for r in _ranks(name, tmp_path_factory):
        c = r["checkpoint"]
        assert c["group_dropped"] and c["rounds_kept"] == 2
        _assert_grads(c["loaded"], [g.reshape(-1) for g in c["original"]])
        assert not all(np.array_equal(a, b) for a, b in zip(c["fresh"], c["original"]))


@pytest.mark.parametrize("name", _configs("join"))
def test_join_with_uneven_inputs_keeps_replicas_identical(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    params = _all_equal([r["join"] for r in ranks])
    assert np.isfinite(np.concatenate([p.reshape(-1) for p in params])).all()


@pytest.mark.parametrize("name", _configs("training"))
def test_digits_accuracy_within_half_a_point_of_plain_ddp(name, tmp_path_factory):
    ranks = _ranks(name, tmp_path_factory)
    res = ranks[0]["training"]
    assert all(r["training"] == res for r in ranks)  # replicas agree on held-out accuracy
    plain, hooked = np.mean(res[False]), np.mean(res[True])
    assert plain > 0.9, f"plain DDP reached only {plain:.3f}: the run is too short to compare"
    assert abs(hooked - plain) <= 0.005, f"GlobalQSGD {hooked:.4f} vs plain DDP {plain:.4f}"


# --------------------------------------------------------------------------- two-stage


def _two_stage_serials(buckets: int, start: int) -> tuple[list[int], list[int], int]:
    """Noise-key serials of a step's buckets: each hook quantizes its bucket (stage 1), then
    requantizes the previous bucket, whose reduce-scatter has had this bucket's backward to
    finish; the last hook also requantizes its own (hvd_gqsgd.ddp._two_stage_hook)."""
    serial, first, second = start, [], [0] * buckets
    for i in range(buckets):
        serial += 1
        first.append(serial)
        if i > 0:
            serial += 1
            second[i - 1] = serial
    second[-1] = serial + 1
    return first, second, serial + 1


@pytest.mark.parametrize("name", _configs("two_stage"))
def test_two_stage_hook_replays_the_oracle(name, tmp_path_factory):
    """Every bucket of three steps, fp32 and fp16 buffers, 8 and 4 bits: the result equals
    the two-stage oracle's bit for bit (same noise keys; the torch-ops path draws the
    kernels' noise too), on every rank."""
    from gqsgd_lab.two_stage_oracle import across, segment_ids

    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    for case, first_rank in ranks[0]["two_stage"].items():
        bits, dtype = case
        calls = [r["two_stage"][case]["calls"] for r in ranks]
        ends = first_rank["ends"]
        starts = [0, *ends[:-1]]
        assert ends[-1] - starts[-1] >= 2  # several buckets once DDP rebuilt them
        serial = 0
        for begin, end in zip(starts, ends):
            first, second, serial = _two_stage_serials(end - begin, serial)
            for i in range(end - begin):
                k = begin + i
                numels = calls[0][k][0]
                got = calls[0][k][2]
                for other in calls[1:]:
                    np.testing.assert_array_equal(other[k][2], got)  # bit-identical
                xs = [c[k][1].astype(np.float32) for c in calls]
                seg = segment_ids(numels, core.default_scale_block(bits))
                scale = np.zeros(seg.max() + 1)
                for x in xs:
                    np.maximum.at(scale, seg, np.abs(x.astype(np.float64)))
                keys = [(core.noise_key(core.rank_seed(7, r), first[i]),
                         core.noise_key(core.rank_seed(7, r), second[i])) for r in range(n)]
                want = across(xs, seg, scale, bits, keys, 1.0 / n).out
                np.testing.assert_array_equal(got, _cast(want, dtype), err_msg=str(case))
        stats = first_rank["stats"]
        assert stats["rounds"] == len(ends) and stats["last_payload"] > 0


# --------------------------------------------------------------------------- rotation


def _flat_rotated(xs: list[np.ndarray], numels: list[int], serial: int, key: int
                  ) -> np.ndarray:
    """Flat 4-bit Global-QSGD of one bucket with the rotation, as the DDP hook computes it:
    every rank's bucket rotated (gqsgd_lab/rotation_oracle.py), block scales of the rotated
    data, the kernels' noise of key ``serial``, the average (lane sum times float32(s/L/n)),
    rotated back."""
    from gqsgd_lab.rotation_oracle import forward, inverse

    n, block = len(xs), core.default_scale_block(4)
    counts, _ = core.segments(numels, block)
    ys = [forward(x, counts, block, key) for x in xs]
    seg = np.repeat(np.arange(len(counts)), counts)
    scale = np.zeros(len(counts))
    for y in ys:
        np.maximum.at(scale, seg, np.abs(y.astype(np.float64)))
    level = _levels(4, n)
    mult = np.where(scale > 0, level / np.where(scale > 0, scale, 1.0), 0).astype(np.float32)
    sums = np.zeros(ys[0].size, dtype=np.int64)
    for r, y in enumerate(ys):
        v = np.clip(y * mult[seg], -level, level)
        low = np.floor(v)
        u = _uniforms(core.noise_key(core.rank_seed(5, r), serial), y.size)
        sums += (low + (u < (v - low).astype(np.float64))).astype(np.int64)
    step = (scale / level / n).astype(np.float32)
    return inverse((sums * step[seg].astype(np.float64)).astype(np.float32), counts, block, key)


def _two_stage_rotated(xs, numels, first: int, second: int, key: int) -> np.ndarray:
    """Two-stage 4-bit Global-QSGD of one bucket with the rotation (gqsgd_lab/two_stage_oracle.py
    on the rotated buckets, the average, rotated back)."""
    from gqsgd_lab.rotation_oracle import forward, inverse
    from gqsgd_lab.two_stage_oracle import across, segment_ids

    n, block = len(xs), core.default_scale_block(4)
    counts, _ = core.segments(numels, block)
    ys = [forward(x, counts, block, key) for x in xs]
    seg = segment_ids(numels, block)
    scale = np.zeros(seg.max() + 1)
    for y in ys:
        np.maximum.at(scale, seg, np.abs(y.astype(np.float64)))
    keys = [(core.noise_key(core.rank_seed(5, r), first),
             core.noise_key(core.rank_seed(5, r), second)) for r in range(n)]
    out = across(ys, seg, scale, 4, keys, 1.0 / n).out.astype(np.float32)
    return inverse(out, counts, block, key)


@pytest.mark.parametrize("name", _configs("rotation"))
def test_rotation_replays_the_oracle(name, tmp_path_factory):
    """rotation="hadamard" at 4 bits, flat and two-stage, DDP's buckets over 2 steps: each
    bucket's average equals the oracle's bit for bit (rotation keyed by the seed and the
    hook's call count), on every rank."""
    ranks = _ranks(name, tmp_path_factory)
    n = len(ranks)
    for two, run in ranks[0]["rotation"].items():
        buckets = list(run["buckets"])
        for step in range(2):
            got = _all_equal([r["rotation"][two]["grads"][step] for r in ranks])
            xs = [[x.reshape(-1) for x in random_inputs(r, step)] for r in range(n)]
            taken = 0
            while sorted(i for *_, ps in buckets[:taken] for i in ps) != list(
                    range(len(SHAPES))):
                taken += 1
                assert taken <= len(buckets)
            mine = buckets[:taken]
            seconds = _two_stage_serials(len(mine), mine[0][0] - 1)[1]
            for k, (serial, rotated, params) in enumerate(mine):
                numels = [xs[0][i].size for i in params]
                flats = [np.concatenate([x[i] for i in params]) for x in xs]
                key = core.rotation_key(5, 0, rotated)
                want = (_two_stage_rotated(flats, numels, serial, seconds[k], key) if two
                        else _flat_rotated(flats, numels, serial, key))
                for i, part in zip(params, np.split(want, np.cumsum(numels)[:-1])):
                    np.testing.assert_array_equal(got[i].reshape(-1), part,
                                                  err_msg=f"two={two} step {step}")
            buckets = buckets[taken:]
