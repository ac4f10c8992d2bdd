"""The whole PyTorch training step (SASRec, CutBCE through the bridge, backward, Adam) compiles for TPU.

benchmarks/tpu_torch_step.py at its 'tiny' preset (v5e, one chip, batch 4 x 16, V 1,000, D 64,
L 8, float32, CutBCE only): torch_xla stages the step on the CPU with the bridge lowered for TPU,
and libtpu's compile-only client compiles the graph in a second subprocess (`.venv/libtpu-overlay`
on its PYTHONPATH only, so this process never loads libtpu). Skipped when the overlay is missing.
Measured: 14 s and 26 s in two runs on this shared 2-core host.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = ROOT / ".venv" / "libtpu-overlay"

pytestmark = [
    pytest.mark.tpu_compile, pytest.mark.rung3,
    pytest.mark.skipif(not (OVERLAY / "libtpu").is_dir(), reason=f"{OVERLAY} is missing: run ci/setup.sh"),
]


def test_cutbce_training_step_compiles_for_tpu(tmp_path):
    out = tmp_path / "step.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tpu_torch_step.py"), "--presets", "tiny", "--losses", "cutbce",
         "--timeout-s", "240", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (row,) = list(csv.DictReader(open(out, newline="")))
    assert row["status"] == "ok", row["error"]
    # The bridge's Pallas kernels are in the graph as Mosaic kernels, not the CPU path call_jax would
    # lower by default: 2 for this 'sum' step (the one-pass d_hidden kernel, which also sums the
    # rows, and the d_item kernel; 3 before the one-pass bridge).
    assert int(row["tpu_custom_calls"]) == 2, row
    # Adam's update is in the program: the parameters and both moments are outputs donated from
    # their inputs (aliased), so the aliased bytes are most of the argument bytes (the rest: the batch).
    argument, alias = int(row["argument_bytes"]), int(row["alias_bytes"])
    assert 0.9 * argument <= alias <= argument, row
    assert int(row["peak_bytes"]) == (argument + int(row["output_bytes"]) - alias + int(row["temp_bytes"])
                                      + int(row["code_bytes"]))
    assert (tmp_path / "step.md").read_text().count("| cutbce | ok |") == 1
