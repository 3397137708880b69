"""docs/MULTINODE.md against the code it describes.

* The levels table between the ``levels-table`` markers must equal what
  scripts/levels_table.py prints now, so the doc cannot drift from ``hvd_gqsgd.core``.
* Its cells must also match the overflow bound recomputed here from scratch, so a wrong
  formula in the core (or in the script) cannot hide behind (a).
* Every repository path the doc names in backticks must exist.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "MULTINODE.md"
SCRIPT = ROOT / "scripts" / "levels_table.py"
REGENERATE = "python scripts/levels_table.py --write docs/MULTINODE.md"


def _load_script():
    spec = importlib.util.spec_from_file_location("levels_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


levels_table = _load_script()


def _block(text: str) -> str:
    begin, end = levels_table.BEGIN, levels_table.END
    assert text.count(begin) == 1 and text.count(end) == 1, f"expected one {begin}/{end} pair"
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def _doc_block() -> str:
    return _block(DOC.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- (a) generated


def test_table_block_is_what_the_script_prints_now():
    assert _doc_block() == levels_table.render(), f"the table is stale: run `{REGENERATE}`"


def test_doc_names_the_regenerating_command():
    assert f"`{REGENERATE}`" in _doc_block()


def test_script_without_arguments_prints_the_block():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's hvd_gqsgd, as in-process
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env).stdout
    assert out.rstrip("\n") == _doc_block()


def test_write_replaces_only_the_block(tmp_path):
    begin, end = levels_table.BEGIN, levels_table.END
    doc = tmp_path / "doc.md"
    doc.write_text(f"# title\n\ntext before\n{begin}\n| stale | 1 |\n{end}\ntext after\n",
                   encoding="utf-8")
    assert levels_table.main(["--write", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == (
        f"# title\n\ntext before\n{begin}\n{levels_table.render()}\n{end}\ntext after\n")


def test_write_refuses_a_file_without_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="levels-table:begin"):
        levels_table.main(["--write", str(doc)])
    assert doc.read_text(encoding="utf-8") == "no markers here\n"


# --------------------------------------------------------------------------- (b) independent


def _levels(bits: int, n: int) -> int:
    """The overflow bound, written out again: n codes in [-L, L] fit a signed bits-bit lane."""
    return (2 ** (bits - 1) - 1) // n


def _min_bits(n: int) -> int:
    bits = 2
    while _levels(bits, n) < 1:
        bits += 1
    return bits


def _bytes_per_element(bits: int) -> Fraction:
    return Fraction(8, 64 // bits)  # one int64 word carries 64 // bits codes


def _rows(block: str, header_start: str) -> dict[str, list[str]]:
    """The markdown table whose header starts with ``header_start``, as {first cell: rest}."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    table = {}
    for line in [lines[start]] + lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = cells[1:]
    return table


def _levels_rows() -> dict[str, list[str]]:
    return _rows(_doc_block(), "| ranks n |")


def test_levels_table_has_the_promised_axes():
    rows = _levels_rows()
    assert rows["ranks n"][:3] == ["bits=4", "bits=8", "bits=16"]
    assert [int(n) for n in rows if n != "ranks n"] == [2 ** k for k in range(1, 11)]


@pytest.mark.parametrize("bits,n,cell", [
    (8, 4, "31"), (8, 8, "15"), (8, 64, "1"), (8, 128, "error (needs bits ≥ 9)"),
    (4, 4, "1"), (4, 8, "error (needs bits ≥ 5)"), (16, 2, "16383"), (16, 1024, "31"),
])
def test_known_cells(bits, n, cell):
    assert _levels_rows()[str(n)][{4: 0, 8: 1, 16: 2}[bits]] == cell


def test_every_levels_cell_matches_the_bound():
    for n, cells in _levels_rows().items():
        if n == "ranks n":
            continue
        for bits, got in zip((4, 8, 16), cells):
            level = _levels(bits, int(n))
            want = str(level) if level else f"error (needs bits ≥ {_min_bits(int(n))})"
            assert got == want, (bits, n)


def test_hierarchical_column_counts_nodes_of_eight():
    """GlobalQSGD(hierarchical=True) sums one code per node: L is the bound at n / 8 nodes;
    one node falls back to flat."""
    rows = _levels_rows()
    assert rows["ranks n"][4] == "hierarchical, 8 ranks per node: L at bits=4/8/16"
    for n, cells in rows.items():
        if n == "ranks n":
            continue
        nodes = int(n) // 8
        if nodes < 2:
            assert cells[4] == "flat (one node)", n
            continue
        want = []
        for bits in (4, 8, 16):
            level = _levels(bits, nodes)
            want.append(str(level) if level else f"error (needs bits ≥ {_min_bits(nodes)})")
        assert cells[4] == " / ".join(want), n
    assert rows["64"][4].split(" / ")[1] == "15"  # the 8 nodes x 8 GPUs at 8 bits


def test_suggested_bits_are_the_cheapest_with_15_levels():
    for n, cells in _levels_rows().items():
        if n == "ranks n":
            continue
        fits = [b for b in range(2, 17) if _levels(b, int(n)) >= 15]
        cheapest = min(_bytes_per_element(b) for b in fits)
        bits = max(b for b in fits if _bytes_per_element(b) == cheapest)
        got = re.fullmatch(r"(\d+) \(L=(\d+), ([\d.]+) B\)", cells[3])
        assert got, cells[3]
        assert int(got[1]) == bits and int(got[2]) == _levels(bits, int(n)), n
        assert float(got[3]) == pytest.approx(float(cheapest), abs=5e-3), n


def test_wire_cost_row_matches_the_packing():
    rows = _rows(_doc_block(), "| bits |")
    widths = [int(b) for b in rows["bits"]]
    assert widths == list(range(2, 17))
    for bits, per, fewer in zip(widths, rows["bytes per element"], rows["fewer bytes than fp32"]):
        assert float(per) == pytest.approx(float(_bytes_per_element(bits)), abs=5e-3), bits
        assert float(fewer.rstrip("x")) == pytest.approx(4 / float(_bytes_per_element(bits)),
                                                         abs=5e-2), bits


# --------------------------------------------------------------------------- (c) paths

# Paths the doc may name that `make setup` creates rather than the repository holds.
GENERATED = (".venv/",)
_PATH = re.compile(r"[\w.-]+(/[\w.-]+)*/[\w-]+\.\w+|[\w.-]+(/[\w.-]+)+/")
_TOP_FILE = re.compile(r"[\w-]+\.(md|toml)|Makefile")


_FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", flags=re.S | re.M)


def _candidates(text: str) -> list[str]:
    """The words of inline code spans and of fenced code blocks (indented ones too)."""
    code = _FENCE.findall(text) + re.findall(r"`([^`\n]+)`", _FENCE.sub("", text))
    return [w for chunk in code for w in re.findall(r"[\w./~$-]+", chunk)]


def _repo_paths(text: str) -> set[str]:
    """What in ``text`` looks like a path inside this repository (relative, with a file
    extension or a trailing slash), plus relative markdown link targets."""
    found = {c for c in _candidates(text)
             if (_PATH.fullmatch(c) or _TOP_FILE.fullmatch(c)) and not c.startswith(GENERATED)}
    links = re.findall(r"\]\(([^)#\s]+)[^)]*\)", text)
    found |= {str((DOC.parent / t).resolve().relative_to(ROOT)) for t in links
              if "://" not in t and not t.startswith("mailto:")}
    return found


def test_path_extraction_would_catch_a_typo():
    text = ("see `benchmark/netbench.py` or `python hvd_gqsgd/core.py --x`, not `10.0.0.0/24`, "
            "`$PWD/x/y.py`, `~/.cache/hvd_gqsgd` or `.venv/bin/python`;\n"
            "```bash\nmpirun \"$PY\" benchmarks/allreduce_worker.py --mb 64\n```\n"
            "- item:\n\n  ```python\n  open('examples/torch_digits.py')\n  ```\n"
            "[bench](BENCHMARKS.md)\n")
    assert _repo_paths(text) == {"benchmark/netbench.py", "hvd_gqsgd/core.py",
                                 "benchmarks/allreduce_worker.py", "docs/BENCHMARKS.md",
                                 "examples/torch_digits.py"}


def test_every_repo_path_in_the_doc_exists():
    paths = _repo_paths(DOC.read_text(encoding="utf-8"))
    assert {"gqsgd_lab/emulated_hosts.py", "tests/test_multiproc.py",
            "scripts/setup_env.sh"} <= paths  # the extraction itself still finds paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/MULTINODE.md names paths that do not exist: {missing}"
