"""The library as it was at a commit, beside the working tree's: the "before" of a before/after run.

    before = at_commit.load("9e6b519")                   # in this process, beside today's packages
    native = before.module("torch_cutbce.native")        # imported as torch_cutbce_at_9e6b519.native
    .venv/bin/python benchmarks/at_commit.py 9e6b519 -- .venv/bin/python benchmarks/bench.py --quick

Benchmarks keep numbers, the commit and the command, never copies of old code: `git archive`
unpacks the commit's `torch_cutbce/` and `jax_kernels/` into a temporary folder. In a process each
package is renamed `<name>_at_<sha>` (its imports and torch.library namespaces rewritten to match),
so both versions live side by side and one script can interleave their rounds. The command form
runs a child with the unrenamed packages first on its PYTHONPATH.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch_cutbce", "jax_kernels", "cutbce_common")
# Set in the command form's child: provenance.stamp() then names the library's commit.
COMMIT_VARIABLE = "CUTBCE_LIBRARY_AT_COMMIT"

_loaded: dict[str, "Snapshot"] = {}


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True).stdout


def resolve(commit: str) -> str:
    """The full sha of `commit` (a sha, a prefix, a tag, `HEAD~2`...); ValueError if git does not know it."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").decode().strip()
    except (OSError, subprocess.CalledProcessError):
        raise ValueError(f"commit={commit!r} is not a commit of the repository at {ROOT.name}/ "
                         f"(expected a sha, a tag or a revision that `git rev-parse` knows)") from None


def materialise(commit: str, dest: Path, *, suffix: str = "") -> list[str]:
    """Unpack `commit`'s packages into `dest`, each renamed `<name><suffix>`; returns the package names.

    With a suffix, every `torch_cutbce` / `jax_kernels` in the packages' Python files becomes
    `<name><suffix>` and every `cutbce::` op namespace `cutbce<suffix>::`, so the copy imports
    beside the working tree's packages and registers torch.library ops of its own.
    """
    sha = resolve(commit)
    present = set(_git("ls-tree", "--name-only", sha).decode().split())
    names = [p for p in PACKAGES if p in present]
    if not names:
        raise ValueError(f"commit={commit!r} holds none of {PACKAGES}")
    with tarfile.open(fileobj=io.BytesIO(_git("archive", "--format=tar", sha, *names))) as archive:
        # The "data" filter refuses links and paths out of `dest` (Python >= 3.11.4 / 3.10.12).
        archive.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    if suffix:
        packages = re.compile(r"\b(" + "|".join(PACKAGES) + r")\b")
        for name in names:
            for path in (dest / name).rglob("*.py"):
                text = packages.sub(lambda m: m.group(1) + suffix, path.read_text())
                path.write_text(re.sub(r"(?<![\w])cutbce::", f"cutbce{suffix}::", text))
            (dest / name).rename(dest / f"{name}{suffix}")
    return [f"{name}{suffix}" for name in names]


class Snapshot:
    """`commit`'s packages, importable in this process under `<name>_at_<short sha>`.

    Attributes:
        sha: the full commit sha; `short` its first 7 hex digits.
        path: the temporary folder the renamed packages live in (on `sys.path` until `close`).
    """

    def __init__(self, commit: str):
        self.sha = resolve(commit)
        self.short = self.sha[:7]
        self.suffix = f"_at_{self.short}"
        self.path = Path(tempfile.mkdtemp(prefix=f"cutbce{self.suffix}_"))
        self.packages = materialise(self.sha, self.path, suffix=self.suffix)
        sys.path.append(str(self.path))

    def name(self, module: str) -> str:
        """`module` as named in this snapshot: 'torch_cutbce.native' -> 'torch_cutbce_at_9e6b519.native'."""
        top, dot, rest = module.partition(".")
        if top not in PACKAGES:
            raise ValueError(f"module={module!r} is not in one of the packages {PACKAGES}")
        return f"{top}{self.suffix}{dot}{rest}"

    def module(self, module: str):
        """Import `module` (named as in the working tree, e.g. 'jax_kernels.blocked') from this commit."""
        return importlib.import_module(self.name(module))

    def close(self) -> None:
        """Forget the snapshot's modules, take its folder off `sys.path` and delete it."""
        for key in [k for k in sys.modules if k.split(".")[0] in self.packages]:
            del sys.modules[key]
        if str(self.path) in sys.path:
            sys.path.remove(str(self.path))
        shutil.rmtree(self.path, ignore_errors=True)
        _loaded.pop(self.sha, None)

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(commit: str) -> Snapshot:
    """The `Snapshot` of `commit` (one per commit and process; deleted at exit unless closed first)."""
    sha = resolve(commit)
    if sha not in _loaded:
        _loaded[sha] = Snapshot(sha)
    return _loaded[sha]


@atexit.register
def _close_all() -> None:
    for snapshot in list(_loaded.values()):
        snapshot.close()


def run(commit: str, command: list[str]) -> int:
    """Run `command` with `commit`'s packages (original names) first on its PYTHONPATH; its exit status."""
    with tempfile.TemporaryDirectory(prefix="cutbce_at_") as folder:
        materialise(commit, Path(folder))
        path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, **{COMMIT_VARIABLE: resolve(commit)[:7]})
        return subprocess.run(command, env=env).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commit", help="the commit whose torch_cutbce/ and jax_kernels/ the command imports")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after an optional --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required, e.g. -- .venv/bin/python benchmarks/bench.py --quick")
    return run(args.commit, command)


if __name__ == "__main__":
    sys.exit(main())
