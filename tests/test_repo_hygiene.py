"""No file of the repository names a path of the machine it was written on, and no old code is kept.

Every text file git tracks is searched for absolute paths of a
development machine: home folders (`/home/`, `/root/`, `/Users/`), `/work/`, a `.pyenv/`
interpreter, and the private notes that the facts in docs/toolchain.md came from. No user has
these paths; what the code relies on is cited from `docs/`. `/tmp/` is flagged too, except as a
location a command writes to (`--out /tmp/x.csv`, `TORCHINDUCTOR_CACHE_DIR=/tmp/ind`): an
example for the reader, not a citation of a file only one machine had. Left alone on purpose:
system locations read at run time (`/proc/cpuinfo`, `/proc/self/clear_refs`, `/usr/bin/env`),
and `/opt/wheels` in ci/core_only.sh, where CI machines keep their wheels (used only if present).
`.ci/` belongs to the hosting machinery, not the project, and is not searched.

Benchmarks keep numbers and commits, not copies of old code (`benchmarks/at_commit.py`
materialises a commit's packages on demand), so `benchmarks/frozen/` must not come back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
NOT_SEARCHED = (".ci/",)
MACHINE_PATHS = re.compile(r"/home/|/root/|/Users/|/work/|\.pyenv/|shared/reference|TOOLCHAIN\.md")
TMP = re.compile(r"/tmp/")
# `/tmp/` right after one of these is where a command writes, not a file being cited.
COMMAND_TARGET = re.compile(r"(--[\w-]+[ =]|\b[A-Z][A-Z0-9_]*=|-C |rm -rf |mkdir -p )$")


def _text_files() -> list[Path]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an unpacked sdist): there is no file list to search")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    files = []
    for name in sorted(set(filter(None, listed))):
        path = ROOT / name
        if name == THIS or name.startswith(NOT_SEARCHED) or not path.is_file():  # deleted, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (plots)
        files.append(path)
    return files


def _findings(path: Path) -> list[str]:
    found = []
    text = path.read_text(errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        hits = [m.group() for m in MACHINE_PATHS.finditer(line)]
        hits += [m.group() for m in TMP.finditer(line) if not COMMAND_TARGET.search(line[: m.start()])]
        if hits:
            where = path.relative_to(ROOT).as_posix()
            found.append(f"{where}:{number}: {', '.join(sorted(set(hits)))}: {line.strip()[:160]}")
    return found


def test_no_file_names_a_path_of_the_development_machine():
    files = _text_files()
    assert len(files) > 50, f"found only {len(files)} files to search: is this the repository?"
    found = [finding for path in files for finding in _findings(path)]
    assert not found, "absolute paths of a development machine (cite docs/ instead):\n" + "\n".join(found)


def test_the_search_flags_what_it_should():
    def flags(line: str) -> bool:
        return bool(MACHINE_PATHS.search(line)) or any(
            not COMMAND_TARGET.search(line[: m.start()]) for m in TMP.finditer(line))

    assert flags("see /work/shared/notes.md section 8") and flags("logs in /tmp/run3/out.txt")
    assert flags('source_file="/root/.pyenv/versions/3.11.7/lib/x.py"') and flags("reference/TOOLCHAIN.md")
    assert not flags("--out /tmp/mine.csv") and not flags("rm -rf /tmp/ind; TORCHINDUCTOR_CACHE_DIR=/tmp/ind")
    assert not flags("open('/proc/cpuinfo')") and not flags("[ -d /opt/wheels ]")
    assert not flags("docs/toolchain.md, 'Mosaic version'")


def test_no_frozen_code_copies_in_benchmarks():
    assert not (ROOT / "benchmarks" / "frozen").exists(), (
        "benchmarks/frozen/ is back: time an old commit with benchmarks/at_commit.py instead of copying its code")
