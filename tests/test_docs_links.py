"""Every link between the repository's documents resolves, and so does every pointer from code into them.

- Markdown: in every tracked (or new, not ignored) `.md` file, each relative link `[text](path)`, `[text](path#anchor)`
  and `[text](#anchor)` (images too) names a file that exists, and each `#anchor` is a heading of
  that file under GitHub's rules (lowercase; drop every character but letters, digits, spaces, `-`
  and `_`; spaces to `-`; repeated headings get `-1`, `-2`) or an explicit `<a id="...">`. Links
  in fenced code blocks and code spans are not links.
- Code: in every tracked `.py`, `.c`, `.cc`, `.sh` and `.md` file, a pointer such as
  `docs/design.md, 'The focal variant'`, `benchmarks/NOTES.md section 11`, `README, 'Cloud TPU'`
  names a file that exists (from the repository root, or beside the citing file), and a section
  quoted right after it is a heading of that file (`section N`: a heading `N. ...`). Lines are
  joined first, so a pointer wrapped over two comment lines counts. A name right after a quote
  (`"step.md"`) is a file name the code builds, not a pointer.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
# Files that name paths only to forbid them (the hygiene test's examples).
NOT_POINTERS = {THIS, "tests/test_repo_hygiene.py"}

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=[\"']([^\"']+)[\"']", re.I)
# A pointer: a Markdown file's path, or README, then optionally the section it names.
POINTER = re.compile(
    r"(?<![\w/.'\"-])((?:[\w-]+/)*[\w-]+\.md|README)\b"
    r"`?(?:(?:'s)?[\s,(]+(?:'([^'\n]{1,80})'|\"([^\"\n]{1,80})\"|sections?\s+(\d+(?:(?:\s*[-,]\s*|\s+and\s+)\d+)*)\b))?")


def _tracked(*patterns: str) -> list[str]:
    """The files git tracks or would track (new, not ignored) that match `patterns`, as they are on disk."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an unpacked sdist): there is no file list to check")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *patterns], cwd=ROOT, capture_output=True, check=True)
    return [name for name in sorted(set(out.stdout.decode().split("\0"))) if name and (ROOT / name).is_file()]


def _prose(text: str) -> str:
    """The Markdown without its fenced blocks and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (inline links reduced to their text first)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def headings(path: Path) -> tuple[list[str], set[str]]:
    """The heading texts of a Markdown file and the anchors a link may name."""
    text = FENCE.sub("", path.read_text())
    titles = [m.group(2) for m in HEADING.finditer(text)]
    anchors, seen = set(HTML_ANCHOR.findall(text)), {}
    for title in titles:
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return titles, anchors


def link_problems(name: str) -> list[str]:
    source = ROOT / name
    found = []
    for target in LINK.findall(_prose(source.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (source.parent / path).resolve() if path else source
        if not dest.exists():
            found.append(f"{name}: ({target}): no file {path}")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in headings(dest)[1]:
            found.append(f"{name}: ({target}): no heading #{anchor} in {dest.relative_to(ROOT).as_posix()}")
        elif anchor and dest.suffix != ".md":
            found.append(f"{name}: ({target}): an anchor into a file that is not Markdown")
    return found


def _resolve(citing: str, path: str) -> Path | None:
    if path == "README":
        path = "README.md"
    for base in (ROOT, (ROOT / citing).parent):
        if (base / path).is_file():
            return base / path
    return None


def pointer_problems(name: str) -> list[str]:
    text = (ROOT / name).read_text(errors="replace")
    # Join wrapped lines, dropping comment leaders, so a pointer split over two lines reads as one.
    joined = re.sub(r"[ \t]*\n[ \t]*(?:#(?![#!])|//|\*(?!\*)|-(?=\s))?[ \t]*", " ", text)
    found = []
    for m in POINTER.finditer(joined):
        path, title = m.group(1), m.group(2) or m.group(3)
        dest = _resolve(name, path)
        if dest is None:
            found.append(f"{name}: {m.group(0)!r}: no file {path}")
            continue
        titles = headings(dest)[0]
        if title:
            wanted = title.strip().lstrip("#").strip().rstrip(".…").strip()
            if not any(wanted in t for t in titles):
                found.append(f"{name}: {m.group(0)!r}: no heading containing {wanted!r} in {path}")
        if m.group(4):
            numbers = re.findall(r"\d+", m.group(4))
            missing = [n for n in numbers if not any(re.match(rf"{n}\.(\s|$)", t) for t in titles)]
            if missing:
                found.append(f"{name}: {m.group(0)!r}: no section {', '.join(missing)} in {path}")
    return found


def test_markdown_links_resolve():
    files = _tracked("*.md")
    assert "README.md" in files and len(files) > 5, files
    found = [problem for name in files for problem in link_problems(name)]
    assert not found, "broken links:\n" + "\n".join(found)


def test_pointers_from_code_into_docs_resolve():
    files = [n for n in _tracked("*.py", "*.c", "*.cc", "*.sh", "*.md") if n not in NOT_POINTERS]
    assert len(files) > 50, files
    found = [problem for name in files for problem in pointer_problems(name)]
    assert not found, "pointers to files or sections that do not exist:\n" + "\n".join(found)


def test_the_checks_catch_what_they_should():
    assert slug("PyTorch's distributed engine: DTensor, FSDP2, DDP") == "pytorchs-distributed-engine-dtensor-fsdp2-ddp"
    assert slug("PyTorch on CPU/CUDA processes: `vocab_parallel`") == "pytorch-on-cpucuda-processes-vocab_parallel"
    assert slug("Speed and memory (N = 4096, D = 64)") == "speed-and-memory-n--4096-d--64"
    assert [m.group(1) for m in POINTER.finditer("see docs/design.md, 'The math' and (NOTES.md section 7)")] == [
        "docs/design.md", "NOTES.md"]
    m = POINTER.search("(benchmarks/NOTES.md sections 1, 7 and 12)")
    assert m.group(4) and re.findall(r"\d+", m.group(4)) == ["1", "7", "12"]
    assert POINTER.search("README's \"Decisions where\"").group(3) == "Decisions where"
    assert not POINTER.search('(tmp_path / "step.md")')
    assert POINTER.search("`benchmarks/NOTES.md` section 12").group(4) == "12"
    assert LINK.findall("[a](docs/x.md#y) and ![b](p.png)") == ["docs/x.md#y", "p.png"]
    assert LINK.findall(_prose("`[a](b)` and\n```\n[c](d)\n```\n")) == []
