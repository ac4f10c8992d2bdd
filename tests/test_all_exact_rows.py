"""Every row as exact as the float64 truth, on every path: confident positives, single-item rows and
rows whose truth is exactly 0 (`exact_rows_cases.py`). Before issue 11 the fused form summed
softplus(z) and subtracted z at the positives, and these rows lost up to 100% of their value.

In-process: native torch, the dense reference, blocked JAX (jit, x64 off as users run it, and
float64 with x64 on), the Pallas kernels (interpret mode), the torch_xla bridge (blocked and
Pallas). The sharded JAX path (2x2 mesh of CPU devices) and torch.distributed vocab-parallel
(2 gloo ranks) run in `_exact_rows_worker.py` subprocesses and hand back their rows and gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import exact_rows_cases as cases
from parity import assert_close
import torch_cutbce as tc

pytestmark = [pytest.mark.rung1, pytest.mark.rung2, pytest.mark.rung3]

try:
    # At import, before any backward: autograd's engine sizes its per-device queues when it first
    # runs, by the device count each backend reports then; torch_xla reports its devices once its
    # runtime has started, so start it here (a later XLA backward would fail an internal assert).
    import torch_xla

    torch_xla.device()
except ImportError:
    torch_xla = None

TESTS = Path(__file__).resolve().parent
CASES = cases.cases()
TRUTH = {name: cases.truth(case) for name, case in CASES.items()}
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def check(path, name, dtype, rows, grads=None):
    cases.check_rows(f"{path}:{name}", rows, TRUTH[name]["rows"], dtype)
    if grads is not None:
        cases.check_grads(f"{path}:{name}", grads, TRUTH[name], dtype)


def run_torch(name, dtype, device="cpu", **kwargs):
    case = CASES[name]
    t = lambda x: torch.tensor(x, dtype=TORCH_DTYPES[dtype]).to(device)  # noqa: E731
    hidden, items = t(case["hidden"]).requires_grad_(), t(case["item_weight"]).requires_grad_()
    pos_weight = None if case["pos_weight"] is None else t(case["pos_weight"])
    rows = tc.cut_bce_with_logits(hidden, items, torch.tensor(case["targets"]).to(device), pos_weight=pos_weight,
                                  reduction="none", **kwargs)
    (rows * t(case["g"])).sum().backward()
    return rows.detach().cpu(), {"d_hidden": hidden.grad.cpu(), "d_item_weight": items.grad.cpu()}


def run_jax(name, dtype, **kwargs):
    import jax
    import jax.numpy as jnp

    import jax_kernels
    from parity import enable_x64

    case = CASES[name]
    with enable_x64(dtype == "float64"):
        a = lambda x: jnp.asarray(x, dtype)  # noqa: E731
        pos_weight = None if case["pos_weight"] is None else a(case["pos_weight"])
        targets = jnp.asarray(case["targets"], jnp.int32)

        def rows_fn(hidden, items):
            return jax_kernels.cut_bce(hidden, items, targets, pos_weight=pos_weight, reduction="none", **kwargs)

        rows, vjp = jax.vjp(jax.jit(rows_fn), a(case["hidden"]), a(case["item_weight"]))
        d_hidden, d_items = vjp(a(case["g"]))
        return np.asarray(rows, np.float64), {"d_hidden": np.asarray(d_hidden), "d_item_weight": np.asarray(d_items)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(CASES))
def test_native(name, dtype):
    check("native", name, dtype, *run_torch(name, dtype, backend="native", block_v=16))


@pytest.mark.parametrize("name", ["confident", "zero"])
def test_dense_reference_float64(name):
    """The dense reference (torch's BCE on materialized logits) in float64. Not on "single": torch
    evaluates softplus(-31) as log(1 + exp(-31)) of a rounded sum, 3.55e-14 for 3.44e-14, and in
    float32 it loses 1e-3 relative on the "confident" rows (log of a rounded 1.0000454), where
    the tiles above are within 1e-7: the library is more exact than the code it replaces."""
    check("dense", name, "float64", *run_torch(name, "float64", backend="dense"))


@pytest.mark.parametrize("name", list(CASES))
def test_native_scalar_reductions(name):
    """'sum' (gradients computed in the forward) agrees with the rows' sum, and is exactly 0 for "zero"."""
    case = CASES[name]
    hidden = torch.tensor(case["hidden"], dtype=torch.float32)
    pos_weight = None if case["pos_weight"] is None else torch.tensor(case["pos_weight"], dtype=torch.float32)
    loss = tc.cut_bce_with_logits(hidden, torch.tensor(case["item_weight"], dtype=torch.float32),
                                  torch.tensor(case["targets"]), pos_weight=pos_weight, reduction="sum", block_v=16)
    total = TRUTH[name]["rows"].sum()
    assert loss.item() >= 0
    assert_close(loss, np.float64(total), dtype="float32", name=f"native sum:{name}")
    if name == "zero":
        assert loss.item() == 0.0


@pytest.mark.jax
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(CASES))
def test_jax_blocked(name, dtype):
    check("jax blocked", name, dtype, *run_jax(name, dtype, impl="blocked", block_v=16))


@pytest.mark.jax
@pytest.mark.parametrize("name", list(CASES))
def test_pallas_interpret(name):
    check("pallas", name, "float32", *run_jax(name, "float32", impl="pallas"))


@pytest.mark.xla
@pytest.mark.parametrize("backend", ["xla_blocked", "xla_pallas"])
@pytest.mark.parametrize("name", list(CASES))
def test_bridge(name, backend):
    if torch_xla is None:
        pytest.skip("torch_xla is not installed (the bridge's extra: pip install -e '.[xla]')")
    check(backend, name, "float32", *run_torch(name, "float32", device=torch_xla.device(), backend=backend))


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    if torch_xla is None:
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
    check(path, name, "float32", np.array(result["rows"]), grads)
