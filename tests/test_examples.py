"""The examples run end to end under horovodrun (short runs) and print their comparison; the
PyTorch ones accept ``--cuda`` and, where torch sees no CUDA device, stop with a message that
says so before starting Horovod."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gqsgd_lab.launch import BIN, TIMEOUT_S

ROOT = Path(__file__).parent.parent


@pytest.mark.multiproc
@pytest.mark.parametrize("script, legacy_keras", [
    ("torch_digits.py", "0"), ("tf_digits.py", "0"), ("tf_digits.py", "1")])
def test_example_trains_and_reports(script, legacy_keras):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_USE_LEGACY_KERAS": legacy_keras}
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
           str(ROOT / "examples" / script), "--epochs", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m.group(1): (float(m.group(2)), float(m.group(3).replace(",", "")))
            for m in re.finditer(r"(fp32 \(none\)|GlobalQSGD\(8\))\s+([\d.]+)\s+[\d.]+\s+([\d,]+)",
                                 proc.stdout)}
    assert set(rows) == {"fp32 (none)", "GlobalQSGD(8)"}, proc.stdout
    (acc_none, bytes_none), (acc_gq, bytes_gq) = rows["fp32 (none)"], rows["GlobalQSGD(8)"]
    assert acc_none > 0.85 and acc_gq > 0.85
    assert 3.5 < bytes_none / bytes_gq <= 4.0


@pytest.mark.parametrize("script", ["torch_digits.py", "char_lm.py"])
def test_cuda_flag_is_listed(script):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--help"],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "--cuda" in proc.stdout and "cuda:<local rank>" in re.sub(r"\s+", " ", proc.stdout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
@pytest.mark.parametrize("script", ["torch_digits.py", "char_lm.py"])
def test_cuda_flag_without_a_cuda_device_stops_with_a_message(script):
    """Run as one plain process (no horovodrun): the refusal comes before hvd.init()."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--cuda"],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"examples/{script} --cuda: torch sees no CUDA device (") and \
        last.endswith("). Run without --cuda to train on the CPU."), proc.stderr
