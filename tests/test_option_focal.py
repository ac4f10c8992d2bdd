"""The focal option (issue 15): what is focal's alone, beyond the conformance suite.

Every engine's oracle, exact-row, zero-logit and plain-bit-for-bit checks of focal run in the
conformance suite (`conformance.py`, `LOSSES`). Here: gammas at the bounds, gamma = 0 with
balancing (plain BCE scaled by alpha), the compiled and eager native tiles, the module, torchvision's
`sigmoid_focal_loss`, bad focal arguments at every entry, and the JAX mesh (a 2x2 CPU mesh, in a
subprocess: a process whose device count is its subject) with focal and with label smoothing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import conformance_engines as conformance
from cutbce_common.focal import MAX_GAMMA, MIN_GAMMA, Focal
from conformance_engines import ENGINES, FRAMEWORK_MARKS, NEEDS_TORCH
from cutbce_common.loss import Loss
from parity import OPTIONAL, TOLERANCES, assert_close, make_upstream

TESTS = Path(__file__).resolve().parent
LEAD, V, D, L = (3, 7), 203, 16, 4  # N = 21; V a multiple of neither tile
BLOCK_V = 64
GAMMAS = (0.5, 1.0, 2.0, 3.0)
FOCALS = [Focal(gamma, 0.25, balanced) for gamma in GAMMAS for balanced in (False, True)]
BALANCED = Focal(2.0, 0.25, True)
def engines(*names):
    """pytest params for `names`, each marked with its rung and what its framework needs."""
    return [pytest.param(name, marks=[FRAMEWORK_MARKS[ENGINES[name][0]], ENGINES[name][1]], id=name) for name in names]


def case_id(value) -> str:
    """A test id `-k` can select: `Focal(2.0, 0.25, True)` -> 'gamma2-alpha0.25-balanced'."""
    if isinstance(value, Focal):
        return f"gamma{value.gamma:g}-alpha{value.alpha:g}" + ("-balanced" if value.apply_class_balancing else "")
    return str(value)


def cases(*rows):
    """pytest params for `(engine, *values)` rows, marked like `engines`."""
    return [pytest.param(*row, marks=[FRAMEWORK_MARKS[ENGINES[row[0]][0]], ENGINES[row[0]][1]], id="-".join(map(case_id, row)))
            for row in rows]


def run(engine, inputs, *, focal=None, **kwargs):
    """`conformance.run` with the focal option given as `focal`."""
    return conformance.run(engine, inputs, loss=Loss(focal), **kwargs)


def oracle(engine, inputs, *, focal=None, **kwargs):
    return conformance.oracle(engine, inputs, loss=Loss(focal), **kwargs)


def _inputs(seed, dtype="float32", options=OPTIONAL, **kwargs):
    return conformance.inputs_for(seed, dtype, options, **kwargs)


# -- the bounds of gamma ----------------------------------------------------------------------------


@pytest.mark.parametrize("focal", [Focal(MAX_GAMMA), Focal(MIN_GAMMA), Focal(MIN_GAMMA + 1.0, 0.25, True)], ids=case_id)
@pytest.mark.parametrize("engine", engines("torch-native", "torch-dense", "jax-blocked", "jax-pallas"))
@pytest.mark.parametrize("reduction", ["none"])  # rows and the recomputing backward: every branch-math call
def test_gammas_at_the_bounds_match_the_oracle(engine, focal, reduction):
    """Issue 31: a gamma float32 could not hold gave NaN rows (`Focal(1e39)`: [nan, nan, 0] where the
    truth is [0, 0, 0]); those are refused now, and the largest and the smallest gamma taken (with a
    fraction of 2**-126, which float32 rounds away) meet the oracle, loss and gradients."""
    inputs = _inputs(3, "float32")
    upstream = make_upstream(reduction, LEAD, seed=3, dtype="float32")
    common = dict(upstream=upstream, reduction=reduction, focal=focal)
    fast = run(engine, inputs, dtype="float32", **common)
    assert all(np.isfinite(np.asarray(v)).all() for v in fast.values()), {k: v for k, v in fast.items()}
    assert_close(fast, oracle(engine, inputs, **common), dtype="float32", name=f"{engine} {focal} {reduction}")


# -- closed forms and special cases --------------------------------------------------------------


@pytest.mark.parametrize("engine,dtype", cases(("torch-native", "float64"), ("torch-native", "float32"),
                                               ("jax-blocked", "float32")))
def test_gamma_zero_with_balancing_is_plain_bce_scaled(engine, dtype):
    """gamma = 0 with balancing runs the focal code: positives times alpha, negatives times 1 - alpha,
    i.e. (1 - alpha) x plain BCE with pos_weight x alpha / (1 - alpha). The engine and its framework's
    focal oracle both meet the plain float64 oracle so scaled."""
    alpha = 0.3
    inputs = _inputs(6, dtype)
    common = dict(upstream=1.0, reduction="sum", return_metrics=False)
    scaled = {**inputs, "pos_weight": inputs["pos_weight"] * alpha / (1 - alpha)}
    plain = {k: x * (1 - alpha) for k, x in oracle(engine, scaled, **common).items()}
    focal = Focal(0.0, alpha, True)
    assert_close(oracle(engine, inputs, focal=focal, **common), plain, dtype="float64", name="oracle, gamma 0")
    assert_close(run(engine, inputs, dtype=dtype, focal=focal, **common), plain, dtype=dtype, name="gamma 0 balanced")


@pytest.mark.rung1
@NEEDS_TORCH
def test_compiled_and_eager_native_tiles_agree(monkeypatch):
    """torch native: the torch.compile'd focal tile and the eager one (TORCH_CUTBCE_NO_COMPILE)."""
    focal = Focal(gamma=1.5, apply_class_balancing=True)
    for reduction in ("none", "mean"):
        upstream = make_upstream(reduction, LEAD, seed=4)
        common = dict(dtype="float32", upstream=upstream, reduction=reduction, focal=focal)
        monkeypatch.delenv("TORCH_CUTBCE_NO_COMPILE", raising=False)
        compiled = run("torch-native", _inputs(4), **common)
        monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")
        eager = run("torch-native", _inputs(4), **common)
        assert_close(compiled, eager, dtype="float32", name=f"compiled vs eager focal tiles, {reduction}")


@pytest.mark.rung1
def test_the_module_takes_focal():
    torch = pytest.importorskip("torch")
    from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits

    inputs = _inputs(7)
    h, e, b = (torch.tensor(inputs[k], dtype=torch.float32) for k in ("hidden", "item_weight", "bias"))
    t = torch.tensor(inputs["targets"])
    module = CutBCEWithLogitsLoss(reduction="sum", focal=BALANCED, block_v=BLOCK_V)
    direct = cut_bce_with_logits(h, e, t, b, reduction="sum", focal=BALANCED, block_v=BLOCK_V)
    torch.testing.assert_close(module(h, e, t, b), direct, rtol=0, atol=0)
    assert "focal=Focal(gamma=2.0" in repr(module)


@pytest.mark.rung1
@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_matches_torchvision_sigmoid_focal_loss(gamma, alpha):
    """torchvision's op on materialized logits: alpha >= 0 is our class balancing, alpha < 0 none."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops", reason="torchvision not installed (ci/setup.sh installs it)")
    from torch_cutbce import cut_bce_with_logits

    h, e, t, b = (torch.tensor(_inputs(8, "float64")[k]) for k in ("hidden", "item_weight", "targets", "bias"))
    multi_hot = torch.zeros(math.prod(LEAD), V, dtype=torch.float64).scatter_(
        1, t.reshape(-1, L).clamp(min=0), (t.reshape(-1, L) >= 0).double())
    theirs = ops.sigmoid_focal_loss(h.reshape(-1, D) @ e.T + b, multi_hot, alpha=alpha, gamma=gamma, reduction="sum")
    focal = Focal(gamma=gamma, alpha=max(alpha, 0.0), apply_class_balancing=alpha >= 0)
    ours = cut_bce_with_logits(h, e, t, b, reduction="sum", focal=focal, block_v=BLOCK_V)
    assert_close(ours, theirs, dtype="float64", name=f"torchvision gamma={gamma} alpha={alpha}")


# -- bad focal arguments -----------------------------------------------------------------------------


@pytest.mark.rung1
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(gamma=-1.0), ValueError, "focal gamma must be >= 0"),
    # Issue 31: gammas float32 cannot hold gave NaN, and large ones unrolled huge compiled tiles.
    (dict(gamma=1e39), ValueError, "focal gamma must be at most 32"),
    (dict(gamma=1e4), ValueError, "focal gamma must be at most 32"),
    (dict(gamma=32.5), ValueError, "focal gamma must be at most 32"),
    (dict(gamma=5e-324), ValueError, "focal gamma must be 0 or at least 1.1754943508222875e-38"),
    (dict(gamma=1e-46), ValueError, "focal gamma must be 0 or at least"),
    (dict(gamma=1e-44), ValueError, "focal gamma must be 0 or at least"),
    (dict(alpha=1.5), ValueError, r"focal alpha must be in \[0, 1\]"),
    (dict(gamma=float("nan")), TypeError, "focal gamma must be a finite float"),
    (dict(gamma="2"), TypeError, "focal gamma must be a finite float"),
    (dict(apply_class_balancing=1), TypeError, "focal apply_class_balancing must be a bool"),
])
@pytest.mark.parametrize("package", ["torch_cutbce", pytest.param("jax_kernels", marks=pytest.mark.jax)])
def test_bad_focal_options_are_clear_errors(package, kwargs, error, match):
    focal_class = pytest.importorskip(package).Focal
    with pytest.raises(error, match=match):
        focal_class(**kwargs)


# Every entry that takes focal= (docs/precision.md, 'What each bad input gets'): (package, function, extra
# arguments). torch's dense_bce_with_logits is the oracle, not an entry: backend='dense' checks first.
ENTRIES = [
    pytest.param("torch_cutbce", "cut_bce_with_logits", {}, id="torch"),
    pytest.param("torch_cutbce", "cut_bce_with_logits", {"backend": "dense"}, id="torch-dense"),
    pytest.param("jax_kernels", "cut_bce", {}, marks=pytest.mark.jax, id="jax"),
    pytest.param("jax_kernels", "cut_bce", {"mesh": "infer"}, marks=pytest.mark.jax, id="jax-mesh"),
    pytest.param("jax_kernels", "dense_cut_bce", {}, marks=pytest.mark.jax, id="jax-dense-oracle"),
]


def _call_entry(package, function, extra, focal):
    inputs = {k: x.astype(np.float32) if x.dtype.kind == "f" else x for k, x in _inputs(0).items()}
    if package == "torch_cutbce":
        torch = pytest.importorskip("torch")
        inputs = {k: torch.tensor(x) for k, x in inputs.items()}
    fn = getattr(pytest.importorskip(package), function)
    return fn(inputs["hidden"], inputs["item_weight"], inputs["targets"], focal=focal, **extra)


@pytest.mark.rung1
@pytest.mark.parametrize("bad", [2.0, {"gamma": 2.0}], ids=["float", "dict"])
@pytest.mark.parametrize("package,function,extra", ENTRIES)
def test_focal_must_be_a_focal(package, function, extra, bad):
    with pytest.raises(TypeError, match="focal must be None or a Focal"):
        _call_entry(package, function, extra, bad)


@pytest.mark.rung1
@pytest.mark.parametrize("field,value,error", [("gamma", -1.0, ValueError), ("alpha", 2.0, ValueError),
                                               ("gamma", float("inf"), TypeError)])
@pytest.mark.parametrize("package,function,extra", [e for e in ENTRIES if e.id != "jax-mesh"])
def test_a_focal_changed_after_construction_is_checked_again(package, function, extra, field, value, error):
    """A frozen dataclass can still be changed through object.__setattr__: each call re-validates."""
    focal = Focal(2.0)
    object.__setattr__(focal, field, value)
    with pytest.raises(error, match=f"focal {field}"):
        _call_entry(package, function, extra, focal)


# -- JAX sharded: a 2 x 2 mesh of CPU devices, in a subprocess ----------------------------------------

SHARDED_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np
    import jax_kernels
    from jax_kernels import Focal
    from parity import make_inputs, make_upstream, relative_error, run_jax, select
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    inputs = select(make_inputs((3, 7), 203, 16, 4, seed=9), dtype="float32")  # N 21, V 203: padded
    out = {}
    focal = dict(focal=Focal(2.0, 0.25, True))
    smoothed = dict(focal=Focal(1.5, 0.25, True), label_smoothing=0.1)
    for reduction, impl, loss in (("none", "blocked", focal), ("none", "blocked", smoothed), ("mean", "pallas", smoothed)):
        upstream = make_upstream(reduction, (3, 7), seed=9, dtype="float32")
        kwargs = dict(dtype="float32", upstream=upstream, reduction=reduction, block_v=32, **loss)
        sharded = run_jax(jax_kernels.cut_bce, inputs, mesh=mesh, impl=impl, **kwargs)
        single = run_jax(jax_kernels.cut_bce, inputs, impl="blocked", **kwargs)
        out[f"{reduction}-{impl}-{sorted(loss)}"] = {k: relative_error(sharded[k], single[k])[0] for k in single}
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.jax
@pytest.mark.rung3
def test_jax_sharded_mesh_matches_single_device(tmp_path):
    """2 x 2 CPU devices (data, model), N and V divisible by neither: blocked shards with 'none'
    (forward then backward) with focal and with label smoothing and focal, Pallas shards with
    'mean' (one pass) with both, within 1e-5 of the single device."""
    pytest.importorskip("jax")
    out = tmp_path / "sharded.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    assert len(errors) == 3
    worst = max(((case, key, err) for case, e in errors.items() for key, err in e.items()), key=lambda x: x[2])
    assert worst[2] <= TOLERANCES["float32"], (worst, errors)
