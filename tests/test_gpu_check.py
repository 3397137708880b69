"""scripts/gpu_check.sh, the one command a GPU machine runs, on this machine (no GPU): it must
exit 0, say that the CUDA parts were skipped, and have pytest collect every CUDA test and
skip it (not miss it).  Its --cpu-rehearsal runs the same tests on CPU tensors through the
torch ops CUDA tensors take, so a change that would trip the GPU run shows here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
TIMEOUT_S = 600
LINE = re.compile(r"gpu_check: (?P<device>[^:]+(?:: CUDA parts skipped)?): (?P<passed>\d+) "
                  r"passed, (?P<skipped>\d+) skipped, (?P<failed>\d+) failed; (?P<bench>.*)")


def _collected() -> int:
    """How many tests pytest finds in tests/test_cuda.py, counted apart from the script."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "tests/test_cuda.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line for line in proc.stdout.splitlines() if line.startswith("tests/test_cuda.py::")]
    assert ids, proc.stdout
    return len(ids)


def _run(*args: str) -> tuple[subprocess.CompletedProcess, re.Match]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GQSGD_TEST_DEVICE", "HVD_GQSGD_KERNELS", "GPU_CHECK_JSON")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    match = LINE.fullmatch(last)
    assert match, f"no summary line at the end:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    return proc, match


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script "
                    "runs the CUDA checks for real there")
def test_without_cuda_every_cuda_test_is_collected_and_skipped():
    proc, line = _run()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert line["device"] == "no CUDA device: CUDA parts skipped"
    assert (int(line["passed"]), int(line["failed"])) == (0, 0)
    assert int(line["skipped"]) == _collected()
    assert line["bench"] == "64 MB round not measured"
    assert "needs a CUDA device" in proc.stdout  # pytest -rs lists why each was skipped


def test_cpu_rehearsal_runs_the_cuda_checks_on_cpu():
    """Everything but the CUDA memory figures runs (real Horovod's one-rank check too, where
    the venv has Horovod) and passes."""
    proc, line = _run("--cpu-rehearsal")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert line["device"] == "CPU rehearsal (torch ops, Gloo)"
    skipped = int(line["skipped"])
    assert int(line["failed"]) == 0 and int(line["passed"]) + skipped == _collected()
    reasons = re.findall(r"^SKIPPED \[(\d+)\] \S+: (.*)$", proc.stdout, re.M)
    assert all(why == "peak memory is measured with torch.cuda's allocator statistics"
               or why.startswith("horovod.torch is not importable") for _, why in reasons), \
        reasons
    assert sum(int(k) for k, _ in reasons) == skipped
    assert re.fullmatch(r"4 MB round [\d.]+ ms \(fp16 [\d.]+ ms\), peak not measured; "
                        r"DDP hook [\d.]+ ms \(fp16 hook [\d.]+ ms\)", line["bench"]), line
