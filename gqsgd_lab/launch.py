"""Launch a worker script of tests/workers/ under real Horovod (horovodrun --gloo, mpirun, or
mpirun across emulated hosts) and load what each rank recorded.

Every job gets ``PYTHONPATH`` = this checkout, so its ranks import this checkout's
``hvd_gqsgd`` and ``gqsgd_lab`` whatever the virtualenv's editable install points at.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from .emulated_hosts import EmulatedHosts

ROOT = Path(__file__).resolve().parent.parent  # the checkout
WORKERS = ROOT / "tests" / "workers"
BIN = Path(sys.executable).parent
TIMEOUT_S = int(os.environ.get("GQSGD_TEST_LAUNCH_TIMEOUT", "600"))


def command(worker: str, controller: str, n: int, *args: str) -> list[str]:
    script = [sys.executable, str(WORKERS / worker), *args]
    if controller == "gloo":
        return [str(BIN / "horovodrun"), "--gloo", "-np", str(n), "-H", f"localhost:{n}", *script]
    if controller == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-np", str(n), "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "TF_USE_LEGACY_KERAS", *script]
    raise ValueError(f"unknown controller {controller!r}: expected 'gloo' or 'mpi'")


def run(worker: str, controller: str, n: int, *args: str,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "TF_USE_LEGACY_KERAS": "0",
                "PYTHONPATH": str(ROOT), **(env or {})}
    if controller == "hosts":  # one emulated host (network namespace) per rank
        with EmulatedHosts(n, rate=None) as hosts:
            return hosts.mpirun([sys.executable, str(WORKERS / worker), *args],
                                env={k: full_env[k] for k in (
                                    "OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL",
                                    "TF_USE_LEGACY_KERAS", "PYTHONPATH")},
                                timeout=TIMEOUT_S)
    return subprocess.run(command(worker, controller, n, *args), env=full_env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def launch(worker: str, controller: str, n: int, out: Path, *args: str,
           env: dict[str, str] | None = None) -> list[dict]:
    """Run ``worker`` on ``n`` ranks with ``out`` and ``args`` as its arguments; it must write
    ``rank{r}.pkl`` into ``out``."""
    proc = run(worker, controller, n, str(out), *args, env=env)
    if proc.returncode != 0:
        raise AssertionError(
            f"{controller} job with {n} ranks failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    results = []
    for r in range(n):
        with open(out / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    assert [r["size"] for r in results] == [n] * n
    return results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a torchrun rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_dist_worker(out_dir: str, rank: int, result: dict) -> None:
    """End a torch.distributed test worker: COLLECTIVE barrier, ``rank{rank}.pkl`` with
    ``result`` into ``out_dir``, the group destroyed, and the process left at once.  torch/Gloo
    sometimes aborts in the interpreter's teardown ("terminate called without an active
    exception", with and without hvd_gqsgd; tests/test_ddp_frameworks.py): everything the
    worker checks is written before, so it leaves without the teardown."""
    import torch.distributed as dist

    dist.barrier()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
