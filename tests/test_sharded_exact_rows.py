"""Every row as exact as the float64 truth on the sharded paths: confident positives, single-item rows
and rows whose truth is exactly 0 (`exact_rows_cases.py`; the in-process engines meet the same rows in
the conformance suite, `conformance_oracle.OracleChecks.test_confident_rows_row_by_row`). The sharded
JAX path (2x2 mesh of CPU devices: the device count is fixed when JAX starts) and torch.distributed
vocab-parallel (2 gloo ranks) run in an `_exact_rows_worker.py` subprocess and hand back their rows
and gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import exact_rows_cases as cases

pytestmark = [pytest.mark.rung1]

TESTS = Path(__file__).resolve().parent
CASES = cases.cases()
TRUTH = {name: cases.truth(case) for name, case in CASES.items()}
HAVE_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    if not HAVE_TORCH_XLA:
        # The core-only environment (torch 2.13, no extras): there a gloo rank has aborted now and
        # then ("terminate called without an active exception"; intermittent, not reproduced alone;
        # the ranks now end with a barrier and os._exit). vocab-parallel is still checked there by
        # tests/test_torch_sharded.py, which retries such an abort once.
        pytest.skip("the vocab-parallel worker runs in the full environment only (a rank aborts under torch 2.13)")
    out = tmp_path_factory.mktemp("exact_rows") / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
               TORCH_CUTBCE_NO_COMPILE="1")  # eager tiles: no compile per rank
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    proc = subprocess.run([sys.executable, str(TESTS / "_exact_rows_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("path", [pytest.param("jax sharded 2x2", marks=pytest.mark.jax), "vocab-parallel 2 ranks"])
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_paths(worker_results, path, name):
    if name == "single" and path.startswith("vocab"):
        assert name not in worker_results[path]  # a 1-item table cannot be split over 2 ranks
        return
    result = worker_results[path][name]
    grads = {k: np.array(result[k]) for k in ("d_hidden", "d_item_weight")}
    cases.check_rows(f"{path}:{name}", np.array(result["rows"]), TRUTH[name]["rows"], "float32")
    cases.check_grads(f"{path}:{name}", grads, TRUTH[name], "float32")
