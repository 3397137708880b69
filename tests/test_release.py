"""The release is stated once and everywhere alike: pyproject's version, the package's
``__version__`` and CHANGELOG.md's newest release section (Keep a Changelog form)."""

from __future__ import annotations

import re
from pathlib import Path

import hvd_gqsgd

ROOT = Path(__file__).parent.parent


def test_version_is_the_changelogs_newest_release():
    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert pyproject and releases
    assert pyproject.group(1) == hvd_gqsgd.__version__ == releases[0]


def test_changelog_sections_are_keep_a_changelog_kinds():
    text = (ROOT / "CHANGELOG.md").read_text()
    kinds = set(re.findall(r"^### (\w+)", text, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds
    assert "## [Unreleased]" in text
