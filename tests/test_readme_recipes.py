"""docs/USAGE.md's "Recipes" run as written: each recipe's code block, after the section's
setup block, as one script on 2 ranks under horovodrun.  A check appended here (not part of
the page) records the parameters of both ranks and what the recipe promises."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gqsgd_lab.launch import BIN, TIMEOUT_S

ROOT = Path(__file__).parent.parent

# after the setup block: the starting parameters, to tell that training happened
AFTER_SETUP = "_initial = torch.cat([p.detach().flatten() for p in model.parameters()])\n"

CHECK = '''
import pickle as _pickle

def _flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])

_grads = [p.grad for p in model.parameters() if p.grad is not None]
_momenta = [opt.state[p]["momentum_buffer"] for p in model.parameters() if p in opt.state]
_out = {"rank": hvd.rank(), "size": hvd.size(), "initial": _initial.numpy(),
        "params": hvd.allgather(_flat(model.parameters()).unsqueeze(0), name="chk.p").numpy(),
        "rounds": opt._compression.stats.rounds,
        "grad_norm": float(torch.linalg.vector_norm(_flat(_grads))) if _grads else None,
        "grad_dtypes": sorted({str(g.dtype) for g in _grads}),
        "momenta": hvd.allgather(_flat(_momenta).unsqueeze(0), name="chk.m").numpy()
        if _momenta else None}
if os.path.exists("ckpt.pt"):
    _saved = torch.load("ckpt.pt")
    _out["saved_params"] = _flat(_saved["model"].values()).numpy()
    _out["saved_momenta"] = _flat(s["momentum_buffer"] for s in
                                  _saved["opt"]["state"].values()).numpy()
with open(f"rank{hvd.rank()}.pkl", "wb") as _f:
    _pickle.dump(_out, _f)
'''


def recipes() -> dict[str, str]:
    """The "Recipes" section's code: ``"setup"`` (its first python block), then each
    ``###`` heading's first python block."""
    text = (ROOT / "docs" / "USAGE.md").read_text()
    section = text.split("\n## Recipes", 1)[1].split("\n## ", 1)[0]
    out = {}
    for i, part in enumerate(re.split(r"\n### ", section)):
        code = re.search(r"```python\n(.*?)```", part, re.S)
        assert code, f"no python block in the Recipes section's part {i}"
        out["setup" if i == 0 else part.splitlines()[0].strip()] = code.group(1)
    return out


def run(recipe: str, tmp_path: Path) -> list[dict]:
    blocks = recipes()
    script = tmp_path / "recipe.py"
    script.write_text("import os\n" + blocks["setup"] + AFTER_SETUP + blocks[recipe] + CHECK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2",
                           sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    params = ranks[0]["params"]
    np.testing.assert_array_equal(params[0], params[1])  # both ranks hold the same model
    assert not np.array_equal(params[0], ranks[0]["initial"])  # and it trained
    return ranks


def test_the_section_has_the_four_recipes():
    assert list(recipes()) == ["setup", "Gradient clipping", "Mixed precision (autocast)",
                               "Gradient accumulation", "Checkpointing"]


@pytest.mark.multiproc
def test_clipping_clips_the_averaged_gradient_with_one_round_per_step(tmp_path):
    for r in run("Gradient clipping", tmp_path):
        assert r["grad_norm"] <= 0.1 * (1 + 1e-5)  # max_norm in the recipe
        assert r["rounds"] == 8  # synchronize() reduced, step() did not reduce again


@pytest.mark.multiproc
def test_autocast_sends_fp32_gradients_through_globalqsgd(tmp_path):
    for r in run("Mixed precision (autocast)", tmp_path):
        assert r["grad_dtypes"] == ["torch.float32"] and r["rounds"] == 8


@pytest.mark.multiproc
def test_accumulation_reduces_once_per_two_passes(tmp_path):
    for r in run("Gradient accumulation", tmp_path):
        assert r["rounds"] == 4  # 8 batches, backward_passes_per_step=2


@pytest.mark.multiproc
def test_checkpoint_resumes_every_rank_at_rank_0s_state(tmp_path):
    for r in run("Checkpointing", tmp_path):
        np.testing.assert_array_equal(r["params"][r["rank"]], r["saved_params"])
        momenta = r["momenta"]
        np.testing.assert_array_equal(momenta[0], momenta[1])
        np.testing.assert_array_equal(momenta[0], r["saved_momenta"])
