"""The benchmark scripts run end to end (`bench.py --quick`, a tiny `headline.py`, a tiny
`cpu_tile_isa.py`) and write their outputs.

Numbers are not checked here (CI machines are noisy); benchmarks/README.md holds the measured ones.
The quick preset times every provider at N=256, D=16, V in {1024, 4096} and measures peak memory
of two providers in fresh subprocesses, so every code path of the full run is exercised.
"""

from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


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
        assert r["git_sha"] and r["machine"] and r["dtype"] == "float32", r
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


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_cpu_tile_isa_smoke(isa, tmp_path):
    out = _run([BENCHMARKS / "cpu_tile_isa.py", "--num-positions", "64", "--num-items", "700", "--rounds", "1",
                "--isa", isa, "--out", tmp_path / "isa.txt"])
    text = (tmp_path / "isa.txt").read_text()
    assert text.strip() in out
    for variant in ("native[c_kernel]", "native[compiled]", "native[eager]", "mm_floor", "dense_eager"):
        assert variant in text
    assert "ISA run: " + ("AVX2 (capped" if isa == "avx2" else "") in text and "commit" in text
