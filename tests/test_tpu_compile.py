"""The Pallas kernels compile for real TPU chips (v4, v5e, v5p, v6e), on a host without a TPU.

libtpu's compile-only client (jax_kernels/tpu_compile.py) runs in a subprocess,
`_tpu_compile_worker.py`, with `.venv/libtpu-overlay` (built by ci/setup.sh) on PYTHONPATH: this
process never loads libtpu, so its JAX and torch_xla stay on the CPU. The worker compiles, nothing
runs: for each chip, every subset of {bias, class_weight, pos_weight, counts} with L = 0 and L > 0,
float32 and bfloat16 alternating, at odd small shapes (32 cases per chip), three programs each: the
raw `pallas_background_forward`, `pallas_background_backward`, and `jax.value_and_grad` of
`jax_kernels.cut_bce(impl='pallas')` (385 compiles in all with the temp-bytes case). Measured:
2-3 min for this file under pytest on this shared 2-core host (1 min 59 s and 2 min 52 s in two runs;
about 0.3 s a compile, 1.3 s at most).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _tpu_compile_worker as worker

pytestmark = pytest.mark.tpu_compile

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
OVERLAY = ROOT / ".venv" / "libtpu-overlay"
PROGRAMS = ("forward", "backward", "cut_bce_value_and_grad")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    assert (OVERLAY / "libtpu").is_dir(), f"{OVERLAY} is missing: run ci/setup.sh"
    out = tmp_path_factory.mktemp("tpu_compile") / "records.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OVERLAY), str(ROOT), str(TESTS)]))
    # libtpu takes /tmp/libtpu_lockfile to guard a real chip; a compile-only client guards nothing,
    # and without this a second compile-only process on the host (another test run) fails to start.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run([sys.executable, str(TESTS / "_tpu_compile_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("chip", worker.CHIPS)
def test_every_variant_compiles(records, chip):
    mine = [r for r in records if r["chip"] == chip and r["what"] in PROGRAMS]
    assert len(mine) == len(PROGRAMS) * len([c for c, _ in worker.cases() if c == chip])
    failed = [(r["what"], r["n"], r["v"], r["d"], r["num_slots"], r["dtype"], r["options"], r["error"][:500])
              for r in mine if r["error"] is not None]
    assert not failed, failed
    # Coverage: each option on and off, with each dtype and with L = 0 and L > 0, on this chip.
    seen = {(o, o in r["options"], r["dtype"], r["num_slots"] > 0) for r in mine for o in worker.OPTIONS}
    assert len(seen) == len(worker.OPTIONS) * 2 * 2 * 2, seen


def test_forward_temp_bytes_bounded(records):
    """v5e, bfloat16, N 8192, V 876,939, D 64, L 8: the forward's HBM temp holds at most one copy of
    the table with its 64-wide rows padded to 128 lanes (the table parameter's layout is {0,1}, the
    kernel's {1,0}: 214 MiB measured), never anything [N, V] (27 GiB as float32 logits)."""
    (r,) = [r for r in records if r["what"] == "forward_temp_bound"]
    c = worker.TEMP_CASE
    assert r["error"] is None, r["error"]
    padded_table_bytes = c["v"] * 128 * 2
    assert r["temp_bytes"] <= padded_table_bytes + 2**20, r


def test_this_process_never_loads_libtpu(records):
    import jax

    assert "libtpu" not in sys.modules
    assert {d.platform for d in jax.devices()} == {"cpu"}
