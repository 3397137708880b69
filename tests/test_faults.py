"""A rank dies mid-training: the others must fail with an error in bounded time, never hang,
and never apply a step that is missing the dead rank's gradient.

``test_survivors_raise_*`` starts the ranks itself (a Gloo rendezvous server in this process,
one subprocess per rank, exactly the environment horovodrun would give them) so that nothing
kills the survivors for us: what they do is what Horovod and GlobalQSGD do when a peer dies.
``test_launcher_*`` runs the same job under horovodrun and mpirun, which also tear the job down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gqsgd_lab.inputs import grid_input
from gqsgd_lab.launch import BIN, WORKERS, command

pytestmark = pytest.mark.multiproc

WORKER = str(WORKERS / "fault_worker.py")
N, VICTIM, KILL_STEP = 3, 2, 6
SURVIVOR_ERROR_EXIT = 3  # fault_worker.py's exit code after logging an exception
# Bound on how long survivors may take to notice the dead peer.  Gloo sees the closed TCP
# connection at once (about 1 s measured on an idle machine); the bound leaves room for a
# loaded 2-core CI machine, and is far below "hangs forever".
FAIL_WITHIN_S = 60
START_TIMEOUT_S = 180  # imports + rendezvous on a loaded machine


def _base_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}


def _read_logs(out: Path) -> list[list[dict]]:
    logs = []
    for r in range(N):
        path = out / f"rank{r}.jsonl"
        logs.append([json.loads(line) for line in path.read_text().splitlines()]
                    if path.exists() else [])
    return logs


def _check_completed_steps_agree(logs: list[list[dict]]) -> dict[int, str]:
    """Every rank logged the same parameters after every step it finished; none finished the
    step the victim died in (finishing it would mean a sum without the victim's codes)."""
    finished = [{e["step"]: e["hash"] for e in log if "error" not in e} for log in logs]
    assert set(finished[VICTIM]) == set(range(-1, KILL_STEP)), finished[VICTIM]
    for r in range(N):
        assert max(finished[r]) < KILL_STEP, f"rank {r} finished step {max(finished[r])}"
        for step, digest in finished[r].items():
            assert digest == finished[VICTIM][step], f"rank {r} diverged at step {step}"
    return finished[VICTIM]


def _gloo_rank_env(rank: int, port: int) -> dict[str, str]:
    """What horovodrun --gloo -np N -H localhost:N sets for one rank (horovod.runner.gloo_run)."""
    return {"HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(N),
            "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(N),
            "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": "lo"}


def test_survivors_raise_when_a_rank_is_killed(tmp_path):
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(f"localhost:{N}"), N))
    procs = []
    try:
        for r in range(N):
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(tmp_path), str(VICTIM), str(KILL_STEP)],
                env={**_base_env(), **_gloo_rank_env(r, port)},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        victim = procs[VICTIM]
        victim.wait(timeout=START_TIMEOUT_S)
        died_at = time.monotonic()
        assert victim.returncode == -signal.SIGKILL, victim.stdout.read()[-3000:]
        for r, p in enumerate(procs):
            if r == VICTIM:
                continue
            left = max(1.0, FAIL_WITHIN_S - (time.monotonic() - died_at))
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running {FAIL_WITHIN_S} s after rank {VICTIM} "
                            "died: it hangs instead of failing")
            assert p.returncode == SURVIVOR_ERROR_EXIT, (
                f"rank {r} exited {p.returncode}:\n{p.stdout.read()[-3000:]}")
        noticed_s = time.monotonic() - died_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        server.stop()

    logs = _read_logs(tmp_path)
    last_good = _check_completed_steps_agree(logs)
    for r in range(N):
        if r == VICTIM:
            continue
        err = logs[r][-1]
        assert err.get("error") == "HorovodInternalError", err
        assert err["step"] == KILL_STEP, err
        # The failed step left the parameters exactly as the last finished step did.
        assert err["hash"] == last_good[KILL_STEP - 1], err
    print(f"survivors failed {noticed_s:.1f} s after rank {VICTIM} was killed")


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_launcher_ends_the_job_when_a_rank_is_killed(tmp_path, controller):
    cmd = command("fault_worker.py", controller, N, str(tmp_path), str(VICTIM), str(KILL_STEP))
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=_base_env(), capture_output=True, text=True,
                              timeout=START_TIMEOUT_S + FAIL_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{controller} job still running {START_TIMEOUT_S + FAIL_WITHIN_S} s after "
                    "start with a dead rank")
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-3000:]
    text = proc.stdout + proc.stderr
    assert "non-zero" in text and "exit" in text.lower(), text[-3000:]
    logs = _read_logs(tmp_path)
    _check_completed_steps_agree(logs)
    # A survivor either logged the error at the victim's step or was stopped by the launcher
    # before it could; it never logged a later step (checked above).
    for r in range(N):
        errors = [e for e in logs[r] if "error" in e]
        assert all(e["step"] == KILL_STEP for e in errors), errors
    print(f"{controller}: job ended {elapsed:.1f} s after start, exit {proc.returncode}")



def _elastic_job(tmp_path: Path, scenario: str, hosts: str, np_: int, at: int, steps: int
                 ) -> dict[int, list[dict]]:
    """Run tests/workers/elastic_worker.py's ``scenario`` (its world changes at step ``at``,
    it stops after ``steps``) under ``horovodrun`` elastic (Gloo) with a host-discovery
    script that reads ``hosts``; return its records by step."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    # --network-interface: without it elastic mode waits for 2 hosts before starting
    cmd = [str(BIN / "horovodrun"), "--network-interface", "lo", "-np", str(np_), "--min-np",
           "2", "--max-np", "3", "--host-discovery-script", str(discover), sys.executable,
           str(WORKERS / "elastic_worker.py"), str(tmp_path), str(hosts_file), scenario,
           str(at), str(steps)]
    proc = subprocess.run(cmd, env=_base_env(), capture_output=True, text=True,
                          timeout=START_TIMEOUT_S + 120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_step: dict[int, list[dict]] = {}
    for path in tmp_path.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            by_step.setdefault(e["step"], []).append(e)
    return by_step


def _check_elastic_steps(by_step: dict[int, list[dict]]) -> dict[int, dict[int, dict]]:
    """Every step's last record of each rank (a step interrupted by a reset is repeated):
    one per rank of that step's size, exact sums through the compressor at that size's
    levels, and the same parameters on every rank."""
    last_by_step = {}
    for step, entries in sorted(by_step.items()):
        size = entries[0]["size"]
        last = {e["rank"]: e for e in entries}
        assert sorted(last) == list(range(size)) and {e["size"] for e in entries} == {size}
        level = {2: 63, 3: 42}[size]
        exact_grid = np.sum([grid_input(r, size, 8) for r in range(size)], axis=0)
        for e in last.values():
            assert e["levels"] == level
            expected_ext = np.tile([size, -size], 32).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(e["ext"], np.float32), expected_ext,
                                          err_msg=f"step {step} size {size}")
            np.testing.assert_array_equal(e["grid"], exact_grid)
            assert e["hash"] == last[0]["hash"], f"step {step}: ranks disagree"
        last_by_step[step] = last
    return last_by_step


def test_elastic_resize_rereads_world_size(tmp_path):
    """Horovod elastic grows the job from 2 to 3 ranks mid-training; the same GlobalQSGD object
    must re-read the size, so levels drop from 63 to 42 and sums stay exact and identical."""
    by_step = _elastic_job(tmp_path, "grow", "localhost:2\n", 2, at=3, steps=4)
    sizes = [by_step[s][0]["size"] for s in sorted(by_step)]
    assert sizes[0] == 2 and sizes[-1] == 3 and sizes == sorted(sizes), sizes
    _check_elastic_steps(by_step)


def test_elastic_recovers_from_a_rank_killed_mid_step(tmp_path):
    """A rank dies inside a training step, while the others compress that step and start its
    buckets' exchanges; Horovod elastic resets and a new process takes its place, in the same
    reset as a rule (the worker gives the driver time to see the free slot first), else in a
    later one.  The survivors' compressor must drop the step it can never finish (not carry
    it into the repeated step, where its tensors, its unfinished round and its collective
    names would disagree with a newcomer's fresh compressor), and every step must be exact
    and identical on all ranks, with one round per optimizer step and per allreduce."""
    at, steps = 3, 7
    by_step = _elastic_job(tmp_path, "replace", "localhost:2\n127.0.0.1:1\n", 3, at, steps)
    assert sorted(by_step) == list(range(steps)), sorted(by_step)
    last = _check_elastic_steps(by_step)
    assert all(e["size"] == 3 for s in range(at) for e in last[s].values())
    assert all(e["size"] == 3 for e in last[steps - 1].values())
    before = {e["pid"] for e in last[at - 1].values()}
    after = {e["pid"] for e in last[steps - 1].values()}
    assert len(before & after) == 2 and len(after - before) == 1, (before, after)
    # Each process's records, step by step: 3 more rounds each (the optimizer's and two
    # allreduces); a survivor's round that never ended would stop the count.
    by_pid: dict[int, list[dict]] = {}
    for s in sorted(last):
        for e in last[s].values():
            by_pid.setdefault(e["pid"], []).append(e)
    for records in by_pid.values():
        first = records[0]["step"]
        assert [e["step"] for e in records] == list(range(first, first + len(records)))
        assert [e["rounds"] for e in records] == [3 * (k + 1) for k in range(len(records))]
    joined = min(e["step"] for e in by_pid[(after - before).pop()])
    print(f"the new rank joined at step {joined} (the rank died at step {at})")
