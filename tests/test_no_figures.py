"""No file of the package states a benchmark figure: measurements live in the generated docs
pages (docs/*.md), which one command regenerates; docstrings and comments keep the
algorithm, the hazards and the reasons, and point to the page or script that measures."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
# a time (12 ms, 0.5 us, 3 s a step), a measured speed ratio (2.1x slower, 3.4x faster), a
# measured percentage against a baseline (+4.3%), a measured error (0.02 from ... ranks)
FIGURE = re.compile(
    r"\b\d+(\.\d+)?\s?(ms|us|µs|ns)\b"
    r"|\b\d+(\.\d+)?\s?s (a|per) (step|round|call)\b"
    r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)?x (slower|faster)\b"
    r"|[+-]\d+(\.\d+)?% (of|vs|against|above|below)\b"
    r"|\bmeasured \d")


def test_the_package_states_no_benchmark_figure():
    found = []
    for path in sorted((ROOT / "hvd_gqsgd").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FIGURE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "benchmark figures belong in docs/:\n" + "\n".join(found)


def test_the_pattern_catches_figures():
    for text in ("took 12 ms", "0.5 us per call", "2.1x slower", "1.5-2x faster",
                 "3 s a step", "+4.3% of fp32's loss", "measured 15"):
        assert FIGURE.search(text), text
    for text in ("4x fewer bytes than fp32", "8 bits", "2**-24 of a step", "64 MB"):
        assert not FIGURE.search(text), text
