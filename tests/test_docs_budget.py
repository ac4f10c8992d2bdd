"""The Markdown budget of issue 48, so that the docs do not creep back: all git-tracked Markdown at most
200,000 bytes, no page over 25,000, the README at most 12,000. Docs say what is true now, once;
measurement logs live in benchmarks/results/ as short result files, and git keeps the history.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOTAL, PAGE, README = 200_000, 25_000, 12_000


def _markdown_sizes() -> dict[str, int]:
    """Bytes of every Markdown file git tracks or would track (new, not ignored)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an unpacked sdist): there is no file list to measure")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.md"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    return {name: (ROOT / name).stat().st_size for name in sorted(set(out)) if name and (ROOT / name).is_file()}


def test_no_page_over_its_budget():
    sizes = _markdown_sizes()
    over = {name: size for name, size in sizes.items() if size > PAGE}
    assert not over, f"pages over {PAGE:,} bytes: {over}"


def test_the_readme_is_within_its_budget():
    assert _markdown_sizes()["README.md"] <= README


def test_all_markdown_within_budget():
    sizes = _markdown_sizes()
    assert sum(sizes.values()) <= TOTAL, f"{sum(sizes.values()):,} bytes of Markdown, budget {TOTAL:,}"
