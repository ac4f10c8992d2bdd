"""Where a benchmark result holds: the commit, the command and the host, recorded beside each number.

Every script that writes to benchmarks/results/ takes these from here: `stamp()` for a text
result's first line, `git_sha()`, `machine()` and `command()` for CSV columns, and `append_rows`,
which widens an older CSV's header when a script gains a column and writes no machine's paths.
Plain Python: imports neither torch nor jax.
"""

from __future__ import annotations

import contextlib
import csv
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT_VARIABLE = "CUTBCE_LIBRARY_AT_COMMIT"  # set by at_commit.run: the library is another commit's


def git_sha() -> str:
    """The working tree's short commit, with "-dirty" when tracked files differ from it."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    library = os.environ.get(COMMIT_VARIABLE)
    sha += "-dirty" if dirty else ""
    return f"{library} (library, via at_commit; scripts {sha})" if library else sha


def _cpuinfo() -> dict[str, str]:
    """The first value of each /proc/cpuinfo key (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def isa_of_cpu() -> str:
    """The widest SIMD level of this CPU: AVX-512, AVX2, NEON or SSE/other."""
    flags = (_cpuinfo().get("flags") or _cpuinfo().get("Features") or "").split()
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")):
        if flag in flags:
            return name
    return "SSE/other" if flags else "unknown"


def machine() -> str:
    """CPU model (with family/model: "AMD EPYC" alone does not tell Zen 3 from Zen 4), ISA, cores, RAM."""
    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:
        model += f" (family {info['cpu family']} model {info.get('model', '?')})"
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{model}, {isa_of_cpu()}, {os.cpu_count()} cores, {ram_gib:.0f} GiB"


def command() -> str:
    """This process's command line, the script relative to the repository root where it lies inside."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c") else None
    shown = str(script.relative_to(ROOT)) if script and script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join(["python", shown, *sys.argv[1:]])


def scrub(text: str) -> str:
    """`text` with this checkout's absolute paths made repository-relative and the home folder `~`:
    results name files as any checkout would (compiler messages quote source paths)."""
    return text.replace(f"{ROOT}{os.sep}", "").replace(str(ROOT), ".").replace(str(Path.home()), "~")


def stamp() -> str:
    """One line naming the host, the commit and the command (a text result's first line)."""
    return f"host: {machine()}; commit {git_sha()}; command: {command()}"


@contextlib.contextmanager
def append_rows(path: Path, fields):
    """`write(row)` appending CSV rows to `path`, each flushed, text cells `scrub`bed.

    A new file gets the header first. An existing file whose header lacks some of `fields` is
    rewritten once with the wider header (its old rows get empty cells there), so rows stay aligned.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            old = list(reader)
            header = list(reader.fieldnames or [])
        wider = header + [k for k in fields if k not in header]
        if wider != header:
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, wider, restval="")
                writer.writeheader()
                writer.writerows(old)
        fields = wider
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fields, restval="", extrasaction="ignore")
        if new:
            writer.writeheader()

        def write(row):
            writer.writerow({k: scrub(v) if isinstance(v, str) else v for k, v in row.items()})
            f.flush()

        yield write
