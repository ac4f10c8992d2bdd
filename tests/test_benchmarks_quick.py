"""The benchmark scripts run end to end (`bench.py --quick`, a tiny `headline.py`, a tiny
`cpu_tile_isa.py`) and write their outputs; `at_commit` imports a commit's packages beside today's.

Numbers are not checked here (CI machines are noisy); benchmarks/README.md holds the measured ones.
The quick preset times every provider at N=256, D=16, V in {1024, 4096} and measures peak memory
of two providers in fresh subprocesses, so every code path of the full run is exercised.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
in_git_checkout = pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None,
                                     reason="at_commit reads git history: not in an unpacked sdist")


def _run(args, timeout=300):
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.jax  # the quick preset times every provider: jax_blocked, and the bridge's two
@pytest.mark.xla
def test_bench_quick_writes_table_csv_and_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="bench.py's plots need the [examples] extra")
    out = _run([BENCHMARKS / "bench.py", "--quick", "--out-dir", tmp_path])
    assert "median ms" in out
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    providers = {r["provider"] for r in rows}
    assert {"dense_eager", "native", "jax_blocked", "xla_bridge", "xla_dense", "mm_floor"} <= providers
    for r in rows:
        assert r["git_sha"] and r["machine"] and r["command"] and r["dtype"] == "float32", r
        assert r["status"] == "ok", r
        assert float(r["median_ms"]) > 0, r
    memory = [r for r in rows if r["peak_mib"]]
    assert {r["provider"] for r in memory} == {"dense_eager", "native"}
    assert all(float(r["peak_mib"]) >= 0 for r in memory)
    for name in ("time_vs_v.png", "memory_vs_v.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_headline_smoke(tmp_path):
    out = _run([BENCHMARKS / "headline.py", "--num-items", "3000", "--batch-size", "2", "--seq-len", "16",
                "--steps", "1", "--skip-dense", "--out", tmp_path / "headline.csv"])
    assert "steps/s" in out
    with (tmp_path / "headline.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["steps_per_s"]) > 0 and float(row["loss_last"]) < float(row["loss_first"])
    assert row["git_sha"] and row["machine"] and "headline.py" in row["command"], row


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_cpu_tile_isa_smoke(isa, tmp_path):
    out = _run([BENCHMARKS / "cpu_tile_isa.py", "--num-positions", "64", "--num-items", "700", "--rounds", "1",
                "--isa", isa, "--out", tmp_path / "isa.txt"])
    text = (tmp_path / "isa.txt").read_text()
    assert text.strip() in out
    for variant in ("native[c_kernel]", "native[compiled]", "native[eager]", "mm_floor", "dense_eager"):
        assert variant in text
    assert "ISA run: " + ("AVX2 (capped" if isa == "avx2" else "") in text and "commit" in text


@in_git_checkout
def test_at_commit_imports_a_commit_beside_the_working_tree():
    from benchmarks import at_commit

    sha = at_commit.resolve("HEAD")
    with at_commit.Snapshot("HEAD") as old:
        shapes = old.module("cutbce_common.shapes")  # plain Python: imports no framework
        assert shapes.__name__ == f"cutbce_common_at_{sha[:7]}.shapes"
        assert pathlib.Path(shapes.__file__).is_relative_to(old.path)
        assert old.name("torch_cutbce.native") == f"torch_cutbce_at_{sha[:7]}.native"
        folder = old.path
    assert not folder.exists() and shapes.__name__ not in sys.modules
    import cutbce_common.shapes as today

    assert pathlib.Path(today.__file__).is_relative_to(ROOT)
    with pytest.raises(ValueError, match="commit="):
        at_commit.resolve("no-such-revision")


@in_git_checkout
def test_at_commit_runs_a_command_on_a_commits_packages(tmp_path):
    probe = "import os, jax_kernels; print(jax_kernels.__file__); print(os.environ['CUTBCE_LIBRARY_AT_COMMIT'])"
    done = subprocess.run([sys.executable, BENCHMARKS / "at_commit.py", "HEAD", "--", sys.executable, "-c", probe],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    package, commit = done.stdout.split()
    assert not pathlib.Path(package).is_relative_to(ROOT), package  # the commit's copy, not the tree's
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.startswith(commit)


@in_git_checkout
@pytest.mark.parametrize("commit, modules", [("9e6b519", ("torch_cutbce/native.py", "jax_kernels/blocked.py")),
                                             ("c6712c3", ("torch_cutbce/native.py", "jax_kernels/core.py"))])
def test_the_ablations_before_commits_hold_their_engines(commit, modules, tmp_path):
    """ablation.py and ablation_exact_rows.py time these commits' engines as their "before" rows."""
    from benchmarks import at_commit

    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT).returncode:
        pytest.skip(f"a shallow clone: {commit} is not fetched")
    at_commit.materialise(commit, tmp_path)
    for module in modules:
        assert (tmp_path / module).is_file(), module


def test_cuda_loss_reference_mode(tmp_path):
    """benchmarks/cuda_loss.py without a GPU: the agreement check (triton in the interpreter), CPU rows
    of dense, native and the floor, its skips, and the plan of the default H100 run (dense skipped at
    V = 2**20 by its estimate, the CutBCE engines run)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    args = [sys.executable, BENCHMARKS / "cuda_loss.py", "--device", "cpu", "--small", "--v", "1024", "--rounds", "2",
            "--out", tmp_path / "cuda_loss.csv"]
    done = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    has_triton = importlib.util.find_spec("triton") is not None
    assert ("check triton  vs float64" if has_triton else "triton is not installed") in done.stdout
    assert "FAILED" not in done.stdout and "targets:" in done.stdout
    with (tmp_path / "cuda_loss.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["dtype"], r["contender"]) for r in rows} == {(d, c) for d in ("bfloat16", "float32")
                                                            for c in ("dense_eager", "native", "triton", "mm_floor",
                                                                      "torch_lce")}
    for r in rows:
        assert r["git_sha"] and r["device"] and r["torch"] and "cuda_loss.py" in r["command"], r
        if r["contender"] in ("dense_eager", "native", "mm_floor"):
            assert r["status"] == "ok" and float(r["median_ms"]) > 0 and float(r["x_floor"]) > 0, r
        elif r["contender"] == "triton":
            assert r["status"] == "skipped" and "CUDA only" in r["note"], r
    assert (tmp_path / "cuda_loss.jsonl").read_text().count("\n") == len(rows)
    plan = _run([BENCHMARKS / "cuda_loss.py", "--plan", "--memory-gib", "78.5"])
    lines = [line for line in plan.splitlines() if "D=128" in line]
    assert len(lines) == 24, plan
    for line in lines:
        big_dense = "V=1048576" in line and "dense" in line
        if big_dense:
            assert "skipped (needs ~" in line, line
        elif "triton" in line or "native" in line or "mm_floor" in line:
            assert line.endswith("runs"), line
