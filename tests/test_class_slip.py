"""``compression=GlobalQSGD`` (the class, no parentheses, as Horovod's own
``hvd.Compression.fp16`` is written) fails at the first call at the latest, with an error that
shows the fix, in every entry point that takes a compressor.  Single-process checks of the
hook, then 2-rank horovodrun jobs (tests/workers/class_slip_checks.py) through real
``hvd.DistributedOptimizer``, ``hvd.allreduce``, QPRSGD, ``DistributedGradientTape`` and the
Keras 3 optimizer."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gqsgd_lab.launch import BIN, TIMEOUT_S
from hvd_gqsgd import GlobalQSGD, QSGDAllgather
from hvd_gqsgd.compressor import refuse_class

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "workers" / "class_slip_checks.py"


def _fix(cls: type) -> str:
    return f"compression={cls.__name__}(bits=8)"


@pytest.mark.parametrize("cls", [GlobalQSGD, QSGDAllgather])
@pytest.mark.parametrize("hook", ["compress", "decompress"])
def test_hook_called_on_the_class_names_the_fix(cls, hook):
    args = (np.ones(3, np.float32),) if hook == "compress" else (np.ones(3), None)
    fix = r"passes the class.*was called on the class.*\(bits=8\), with parentheses"
    with pytest.raises(TypeError, match=fix) as info:
        getattr(cls, hook)(*args)
    assert _fix(cls) in str(info.value)


def test_hooks_on_an_instance_are_plain_methods():
    comp = GlobalQSGD(bits=8)
    assert comp.compress.__self__ is comp and comp.decompress.__func__.__name__ == "decompress"
    assert comp.decompress("untouched", None) == "untouched"  # no ctx: passed through
    assert "Queues" in GlobalQSGD.compress.__doc__  # the class attribute keeps its docs


def test_refuse_class_accepts_instances_and_other_compressors():
    refuse_class(GlobalQSGD(bits=8), "here")
    refuse_class(None, "here")
    refuse_class(type("NotOurs", (), {}), "here")  # another library's class compressor
    with pytest.raises(TypeError, match=r"=QSGDAllgather passes the class, not a compr.* \(here"):
        refuse_class(QSGDAllgather, "here")


def _job(framework: str, out: Path) -> list[dict]:
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
           str(WORKER), str(out), framework]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_USE_LEGACY_KERAS": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = []
    for r in range(2):
        with open(out / f"rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    assert [r["size"] for r in ranks] == [2, 2]
    return ranks


def _assert_refused(ranks: list[dict], key: str, at: str, cls: type) -> None:
    for r in ranks:
        got = r[key]
        assert got["at"] == at and got["type"] == "TypeError", (key, got)
        assert _fix(cls) in got["message"], got["message"]
        assert "missing 1 required positional argument" not in got["message"]


@pytest.mark.multiproc
def test_torch_entry_points_refuse_the_class_by_the_first_call(tmp_path):
    ranks = _job("torch", tmp_path)
    for cls in (GlobalQSGD, QSGDAllgather):
        # Horovod calls compress from the gradient hook: the first backward raises
        _assert_refused(ranks, f"optimizer/{cls.__name__}", "backward", cls)
        _assert_refused(ranks, f"allreduce/{cls.__name__}", "allreduce", cls)
    _assert_refused(ranks, "qprsgd/GlobalQSGD", "construction", GlobalQSGD)  # before any step
    # an instance then trains: both ranks apply the same averaged gradient.  Rank r's input
    # is 3 rows of r + 1, so d(sum)/dW is 3 (r + 1) everywhere: mean 4.5, within one
    # quantization step (scale 6, 63 levels) of it; lr 0.1.
    np.testing.assert_array_equal(ranks[0]["instance_weights"], ranks[1]["instance_weights"])
    step = ranks[0]["instance_start"] - ranks[0]["instance_weights"]
    np.testing.assert_allclose(step, 0.1 * 4.5, atol=0.1 * 6 / 63 + 1e-6)


@pytest.mark.multiproc
def test_tensorflow_entry_points_refuse_the_class_by_the_first_call(tmp_path):
    ranks = _job("tf", tmp_path)
    for cls in (GlobalQSGD, QSGDAllgather):
        _assert_refused(ranks, f"tape/{cls.__name__}", "gradient", cls)
    _assert_refused(ranks, "keras/GlobalQSGD", "construction", GlobalQSGD)
