"""The README's Layout section names every module (the library's and gqsgd_lab's), example,
benchmark script, study and docs page the repository has, and nothing it lacks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def layout_paths() -> set[str]:
    """Paths in the first column of the Layout block: ``a/x[_tf].py`` names ``a/x.py`` and
    ``a/x_tf.py``; ``a/x.py, y.py`` names ``a/x.py`` and ``a/y.py``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"\n## Layout\n+```\n(.*?)```", text, re.S)
    assert block, "README has no Layout block"
    found = set()
    for line in block.group(1).splitlines():
        first = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if not first or " " in first.replace(", ", ","):
            continue  # a continuation line
        names = [n.strip() for n in first.split(",")]
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0] else ""
        for name in names:
            name = name if "/" in name else folder + name
            found |= {name.replace("[_tf]", v) for v in ("", "_tf")} if "[_tf]" in name \
                else {name}
    return found


def test_layout_expansion():
    assert {"benchmarks/train_worker.py", "benchmarks/train_worker_tf.py",
            "benchmarks/ddp_bench_worker.py", "docs/TWO_STAGE.md", "tests/"} <= layout_paths()


def test_layout_names_every_module_example_benchmark_and_page():
    have = {str(p.relative_to(ROOT)) for pattern in (
        "hvd_gqsgd/*.py", "gqsgd_lab/*.py", "examples/*.py", "benchmarks/*.py", "studies/*",
        "scripts/*", "docs/*.md")
        for p in ROOT.glob(pattern)}
    listed = layout_paths()
    assert not have - listed, f"missing from the README's Layout: {sorted(have - listed)}"
    gone = sorted(p for p in listed if not (ROOT / p).exists())
    assert not gone, f"the README's Layout names paths that do not exist: {gone}"
