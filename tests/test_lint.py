"""Static checks run as part of `make test`, so style and type regressions fail CI."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent


def test_ruff_clean():
    subprocess.run([str(BIN / "ruff"), "check", "hvd_gqsgd", "gqsgd_lab", "tests", "examples",
                    "benchmarks", "studies", "scripts"], cwd=ROOT,
                   check=True)


def test_mypy_clean():
    subprocess.run([str(BIN / "mypy"), "hvd_gqsgd"], cwd=ROOT, check=True)
