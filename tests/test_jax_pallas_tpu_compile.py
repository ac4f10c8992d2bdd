"""The Pallas kernels compile for real TPU chips, on a host without a TPU.

libtpu's compile-only client (benchmarks/tpu_compile.py) runs in a subprocess,
`_tpu_compile_worker.py`, with this environment's libtpu overlay on PYTHONPATH: this process never
loads libtpu, so its JAX and torch_xla stay on the CPU. The worker compiles, nothing runs: for each
chip, every subset of {bias, class_weight, pos_weight, counts} with L = 0 and L > 0, float32 and
bfloat16 alternating, at odd small shapes (32 cases per chip), four programs each: the raw
`pallas_forward`, `pallas_backward` and `pallas_value_and_grad` (the one-pass kernels of
'mean'/'sum'), and `jax.value_and_grad` of `jax_kernels.cut_bce(impl='pallas')`; the other
Loss values, three cases per chip (`worker.LOSS_CASES`), the same four programs (140 compiles a
chip); and the four HBM temp cases on v5e: 424 compiles in all.

Which chips depends on the environment's libtpu (`worker.chips_here()`), so that CI compiles each
chip once or twice and each side about three chips' time:
- .venv (ci/test.sh): jax 0.7.1, libtpu 0.0.20, Mosaic pinned to 7: v4, v5e and v5p;
- .venv-jax (ci/jax_newest.sh, which runs the worker beside its pytest selection, or
  `bash ci/jax_newest.sh tests/test_jax_pallas_tpu_compile.py`): jax 0.12.0.1, libtpu 0.0.50.1,
  no pin: v5e, v6e and tpu7x (libtpu 0.0.20 knows no TPU7x).
Measured on the shared host (AMD EPYC Zen 3, 2 cores; other jobs running, load 2.6-5): this file
in .venv 6 min 9 s (4 min 2 s of CPU); it took 4-5 min for the four chips of before (v6e too).
In .venv-jax, beside ci/jax_newest.sh's pytest: the worker for its three chips 11 min 50 s at
load 3.6-4.5, 10 min 52 s at load 4-8; tpu7x alone 1 min 47 s (1 min 23 s of CPU, load 2-3):
0.7 s a compile, 3.1 s at most. Each side compiles three chips of about 1 min 25 s of CPU each,
one more than before (four in .venv, v5e in .venv-jax), the extra one beside pytest's other core.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]' (and .venv/libtpu-overlay: ci/setup.sh)")

import _tpu_compile_worker as worker  # noqa: E402
from benchmarks import tpu_compile  # noqa: E402

pytestmark = [pytest.mark.tpu_compile, pytest.mark.rung2]

TESTS = Path(__file__).resolve().parent
OVERLAY = tpu_compile.OVERLAY  # .venv/libtpu-overlay (.venv-jax/libtpu-overlay under ci/jax_newest.sh)
PROGRAMS = ("forward", "backward", "value_and_grad", "cut_bce_value_and_grad")
CHIPS = worker.chips_here()  # v4, v5e, v5p with libtpu 0.0.20; v5e, v6e, tpu7x with 0.0.50


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    assert (OVERLAY / "libtpu").is_dir(), f"{OVERLAY} is missing: run ci/setup.sh"
    out = tmp_path_factory.mktemp("tpu_compile") / "records.json"
    env = tpu_compile.child_env(TESTS)  # the overlay, the root and tests/ on PYTHONPATH
    proc = subprocess.run([sys.executable, str(TESTS / "_tpu_compile_worker.py"), str(out), *CHIPS],
                          env=env, capture_output=True, text=True, timeout=1800)  # 12 min seen under load
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("chip", CHIPS)
def test_every_variant_compiles(records, chip):
    mine = [r for r in records if r["chip"] == chip and r["what"] in PROGRAMS]
    assert len(mine) == len(PROGRAMS) * len([c for c, _ in worker.cases() if c == chip])
    failed = [(r["what"], r["n"], r["v"], r["d"], r["num_slots"], r["dtype"], r["options"], r["error"][:500])
              for r in mine if r["error"] is not None]
    assert not failed, failed
    # Coverage: each option on and off, with each dtype and with L = 0 and L > 0, on this chip.
    seen = {(o, o in r["options"], r["dtype"], r["num_slots"] > 0) for r in mine for o in worker.OPTIONS}
    assert len(seen) == len(worker.OPTIONS) * 2 * 2 * 2, seen


@pytest.mark.parametrize("chip", CHIPS)
def test_loss_variants_compile(records, chip):
    """Every other Loss (focal: issue 15; label smoothing: issue 30): the four programs of each
    `worker.LOSS_CASES` entry (gamma 2 in float32; gamma 0.5 class-balanced in bfloat16; label
    smoothing 0.1 with a balanced gamma 1.5 in float32) compile for this chip."""
    mine = [r for r in records if r["chip"] == chip and r["what"].startswith("loss_")]
    assert len(mine) == len(PROGRAMS) * len(worker.LOSS_CASES), [r["what"] for r in mine]
    failed = [(r["what"], r["dtype"], r["loss"], r["error"][:500]) for r in mine if r["error"] is not None]
    assert not failed, failed


@pytest.mark.parametrize("what", sorted(worker.TEMP_CASES))
def test_hbm_temp_holds_nothing_table_sized(records, what):
    """v5e, N 8192, V 876,939, L 8 (issue 12): the forward and the training step
    (`value_and_grad` wrt hidden and item_weight) hold no table-sized HBM temp, and never anything
    [N, V] (27 GiB as float32 logits).

    Before: 642.6 MiB at bfloat16, D 64: a copy of the table into the kernels' row-major layout
    (D padded to 128 lanes: 214 MiB), the float32 table gradient out of the d_item kernel
    (428 MiB lane-padded), and its copy back. Now the kernels take the table as [D, V] where XLA
    stores it so (`pallas.launch._items_in_lanes`) and write the gradient in the table's dtype:
    0 bytes measured for every case here (benchmarks/results/tpu_temp_before_after.md). The bound
    is a quarter of the table's bytes, so that any table-sized buffer (a copy of the table in any
    dtype or layout, an f32 gradient) fails, while the token-sized ones (hidden and d_hidden in
    the kernels' layout, ids, g, the forward's partial sums: 2-4 MiB each at bf16, D 64, about
    20 MiB in all, in VMEM today) may move to HBM without failing the test."""
    (r,) = [r for r in records if r["what"] == what]
    c = worker.TEMP_CASES[what]
    assert r["error"] is None, r["error"]
    table_bytes = c["v"] * c["d"] * (2 if c["dtype"] == "bfloat16" else 4)
    assert r["temp_bytes"] <= table_bytes // 4, r


def test_this_process_never_loads_libtpu(records):
    import jax

    assert "libtpu" not in sys.modules
    assert {d.platform for d in jax.devices()} == {"cpu"}
