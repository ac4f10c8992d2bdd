"""The focal option (issue 15) on every engine of both frameworks, against the float64 focal oracle.

Edit `Focal`, a focal branch of an engine or an oracle's focal formula: run this file. Engines
(`ENGINES`): torch native and dense, the torch_xla bridge (blocked, Pallas; XLA:CPU), JAX blocked
and Pallas (interpret mode), JAX sharded (a 2x2 CPU mesh, in a subprocess). Each engine is held to
its framework's oracle, `dense_bce_with_logits` / `dense_cut_bce` run in float64: the focal loss
written from its definition in logit space on materialized logits. Checked: gamma in
{0.5, 1, 2, 3} with and without class balancing, every reduction, bias and all weights, the awkward
ids of `parity.make_inputs`, confident-logit rows row by row, zero logits (closed form), gamma = 0
(plain CutBCE bit for bit; balanced: plain BCE scaled by alpha), bad focal arguments at every entry,
torchvision's `sigmoid_focal_loss`. torch, jax and torch_xla are imported inside the tests: an
engine whose framework is missing skips (marks `jax`, `xla`, `NEEDS_TORCH`). Each case carries its
engine's parity rung as a marker (`pytest -m rung2 tests/test_option_focal.py`: the Pallas cases).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import exact_rows_cases
from jax_kernels.neutral.focal import MAX_GAMMA, MIN_GAMMA, Focal
from parity import GRADS, OPTIONAL, TOLERANCES, assert_close, make_inputs, make_upstream, run_jax, run_torch, select

TESTS = Path(__file__).resolve().parent
LEAD, V, D, L = (3, 7), 203, 16, 4  # N = 21; V a multiple of neither tile
BLOCK_V = 64
GAMMAS = (0.5, 1.0, 2.0, 3.0)
FOCALS = [Focal(gamma, 0.25, balanced) for gamma in GAMMAS for balanced in (False, True)]
BALANCED = Focal(2.0, 0.25, True)
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (a JAX-only install)")
MARKS = {"jax": pytest.mark.jax, "xla": pytest.mark.xla, "torch": NEEDS_TORCH}
# engine -> (framework, its parity rung (the marker: `pytest -m rung2` runs the Pallas cases), the entry's options)
ENGINES = {
    "torch-native": ("torch", pytest.mark.rung1, dict(backend="native", block_v=BLOCK_V)),
    "torch-dense": ("torch", pytest.mark.rung0, dict(backend="dense")),
    "xla-blocked": ("xla", pytest.mark.rung3, dict(backend="xla_blocked", block_v=BLOCK_V)),
    "xla-pallas": ("xla", pytest.mark.rung3, dict(backend="xla_pallas", block_v=BLOCK_V)),
    "jax-blocked": ("jax", pytest.mark.rung1, dict(impl="blocked", block_v=BLOCK_V)),
    "jax-pallas": ("jax", pytest.mark.rung2, dict(impl="pallas")),  # 128 x 128 tiles (`_engine_options`)
}


def engines(*names):
    """pytest params for `names`, each marked with its rung and what its framework needs."""
    return [pytest.param(name, marks=[MARKS[ENGINES[name][0]], ENGINES[name][1]], id=name) for name in names]


def case_id(value) -> str:
    """A test id `-k` can select: `Focal(2.0, 0.25, True)` -> 'gamma2-alpha0.25-balanced'."""
    if isinstance(value, Focal):
        return f"gamma{value.gamma:g}-alpha{value.alpha:g}" + ("-balanced" if value.apply_class_balancing else "")
    return str(value)


def cases(*rows):
    """pytest params for `(engine, *values)` rows, marked like `engines`."""
    return [pytest.param(*row, marks=[MARKS[ENGINES[row[0]][0]], ENGINES[row[0]][1]], id="-".join(map(case_id, row)))
            for row in rows]


def _engine_options(engine, overrides):
    options = {**ENGINES[engine][2], **overrides}
    if engine == "jax-pallas":
        from jax_kernels.pallas.block_sizes import BlockSizes

        options["block_sizes"] = BlockSizes(block_n=128, block_v=128)  # 2 x 2 ragged tiles of N, V
    return options


def _jitted(cut_bce, **static):
    """`cut_bce` jitted with its static options bound, in `parity.run_jax`'s calling convention."""
    import jax

    fn = jax.jit(lambda h, w, t, b, weight, class_weight, pos_weight: cut_bce(
        h, w, t, b, weight=weight, class_weight=class_weight, pos_weight=pos_weight, **static))
    return lambda h, w, t, b, *, weight, class_weight, pos_weight, return_metrics: fn(
        h, w, t, b, weight, class_weight, pos_weight)


def run(engine, inputs, *, dtype, upstream, overrides=None, grad_names=GRADS, return_metrics=True, **kwargs):
    """`engine` on numpy `inputs` (`parity.run_torch` / `run_jax`): loss, d_<name>, metrics.

    `kwargs` go to the entry (reduction, focal); `overrides` replace `ENGINES`' options. JAX's
    blocked loop runs jitted with x64 off for float32 / bfloat16 (as users run it), eagerly with x64
    on for float64 (`run_jax`); XLA tensors live on `torch_xla.device()`.
    """
    framework, options = ENGINES[engine][0], _engine_options(engine, overrides or {})
    adapter = dict(dtype=dtype, upstream=upstream, grad_names=grad_names, return_metrics=return_metrics)
    if framework == "jax":
        import jax_kernels

        if engine == "jax-blocked" and dtype != "float64":
            jitted = _jitted(jax_kernels.cut_bce, **options, **kwargs, return_metrics=return_metrics)
            return run_jax(jitted, inputs, **adapter)
        return run_jax(jax_kernels.cut_bce, inputs, **adapter, **options, **kwargs)
    from torch_cutbce import cut_bce_with_logits

    device = pytest.importorskip("torch_xla").device() if framework == "xla" else "cpu"
    return run_torch(cut_bce_with_logits, inputs, **adapter, device=device, **options, **kwargs)


def oracle(engine, inputs, *, upstream, **kwargs):
    """`engine`'s framework's dense oracle in float64 (the bridge's is torch's)."""
    if ENGINES[engine][0] == "jax":
        from jax_kernels.reference import dense_cut_bce

        return run_jax(dense_cut_bce, inputs, dtype="float64", upstream=upstream, **kwargs)
    from torch_cutbce import dense_bce_with_logits

    return run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, **kwargs)


def _inputs(seed, dtype="float32", options=OPTIONAL, **kwargs):
    return select(make_inputs(LEAD, V, D, L, seed=seed, **kwargs), options, dtype)


# -- every engine against its oracle -----------------------------------------------------------------

ORACLE_CASES = cases(
    *[("torch-native", dtype, f, r) for f in FOCALS for r in ("none", "sum", "mean")
      for dtype in ("float32", "float64")],
    # float32 under jit: 'none' and 'mean' alternate (the two-loop and the one-loop gradient)
    *[("jax-blocked", "float32", f, ("none", "mean")[i % 2]) for i, f in enumerate(FOCALS)],
    ("jax-blocked", "float64", Focal(0.5, 0.3, True), "none"),
    ("jax-pallas", "float32", Focal(2.0), "none"),  # forward kernel, then the d_hidden and d_item kernels
    ("jax-pallas", "float32", Focal(0.5, 0.25, True), "mean"),  # the one-pass kernels
    ("jax-pallas", "bfloat16", BALANCED, "sum"),
    ("xla-blocked", "float32", BALANCED, "none"),  # the bridge hands focal to the JAX engines
    ("xla-blocked", "float32", BALANCED, "mean"),
    ("xla-pallas", "float32", BALANCED, "mean"),
)


@pytest.mark.parametrize("engine,dtype,focal,reduction", ORACLE_CASES)
def test_matches_the_float64_oracle(engine, dtype, focal, reduction):
    """Loss, every gradient and the metrics within the dtype's tolerance of the oracle. bfloat16
    follows CCE's rule: no further from the truth than the dense reference run in bfloat16, + 2e-3."""
    seed = GAMMAS.index(focal.gamma) if focal.gamma in GAMMAS else 7
    inputs = _inputs(seed, dtype)
    upstream = make_upstream(reduction, LEAD, seed=seed, dtype=dtype)
    common = dict(upstream=upstream, reduction=reduction, focal=focal)
    truth = oracle(engine, inputs, **common)
    fast = run(engine, inputs, dtype=dtype, **common)
    name = f"{engine} {dtype} {focal} {reduction}"
    if dtype == "bfloat16":
        import jax.numpy as jnp
        from jax_kernels.reference import dense_cut_bce

        same_dtype = run_jax(dense_cut_bce, inputs, dtype=dtype, compute_dtype=jnp.bfloat16, **common)
        assert_close(fast, same_dtype, truth, dtype=dtype, name=name)
    else:
        assert_close(fast, truth, dtype=dtype, name=name)


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


@pytest.mark.parametrize("focal", [Focal(0.5, 0.25, True), Focal(3.0)], ids=case_id)
@pytest.mark.parametrize("engine", engines("torch-native", "jax-blocked", "jax-pallas"))
def test_confident_rows_row_by_row(engine, focal):
    """A positive at z = 5 .. 100 among negatives at -10, and single-item rows at +-31: each float32
    row within 1e-5 of its own float64 truth (or of the smallest normal float32 below it), never
    below zero; gradients within 1e-5 of the largest."""
    for name, case in exact_rows_cases.cases().items():
        inputs = {k: case[k] for k in ("hidden", "item_weight", "targets", "pos_weight") if case[k] is not None}
        common = dict(upstream=case["g"], reduction="none", focal=focal, grad_names=("hidden", "item_weight"),
                      return_metrics=False)
        truth = oracle(engine, inputs, **common)
        fast = run(engine, inputs, dtype="float32", overrides=dict(block_v=16), **common)
        rows, truth_rows = fast.pop("loss"), truth.pop("loss")
        exact_rows_cases.check_rows(f"{engine}:{name}:{focal}", rows, truth_rows, "float32")
        exact_rows_cases.check_grads(f"{engine}:{name}:{focal}", fast, truth, "float32")
        if name == "confident":  # the focal factor shrinks the confident rows below the plain ones
            plain = exact_rows_cases.truth(case)["rows"]
            assert (truth_rows <= plain).all() and (truth_rows > 0).all()


@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("engine", engines("torch-native", "jax-blocked"))
def test_large_logit_rows_are_exact_row_by_row(engine, dtype, gamma):
    """Logits in the hundreds (hidden scaled by 8, one row by 64) with bias and class balancing:
    each row's loss within the dtype's tolerance of the float64 truth on its own, never below zero."""
    inputs = _inputs(3, dtype, options=("bias",), scale=8.0)
    inputs["hidden"][0, 2] *= 8  # a power of two: still representable in the dtype
    common = dict(upstream=np.zeros(LEAD), reduction="none", focal=Focal(gamma, 0.25, True), grad_names=(),
                  return_metrics=False)
    rows = run(engine, inputs, dtype=dtype, **common)["loss"]
    assert_close(rows, oracle(engine, inputs, **common)["loss"], dtype=dtype, name=f"{engine} rows", elementwise=True)
    assert (rows >= 0).all()


# -- closed forms and special cases --------------------------------------------------------------


ZERO_LOGIT_FOCALS = [Focal(2.0), Focal(0.5), Focal(1.5, 0.3), Focal(2.0, 0.25, True), Focal(1.5, 0.3, True)]


@pytest.mark.parametrize("focal", ZERO_LOGIT_FOCALS, ids=case_id)
@pytest.mark.parametrize("engine", engines("torch-native", "torch-dense", "jax-blocked", "jax-pallas"))
def test_zero_logits_give_the_closed_form(engine, focal):
    """z = 0 everywhere: every element is 0.5^gamma ln 2; with balancing a row with k positives is
    0.5^gamma ln 2 (k alpha + (V - k)(1 - alpha)). Rows of one positive, one duplicated, none."""
    n, v = 5, 40
    targets = np.full((n, 2), -1)
    targets[1:, 0] = np.arange(1, n) * 7  # row 0: no positive
    targets[1, 1] = targets[1, 0]  # a duplicate counts once
    inputs = {"hidden": np.zeros((n, 4)), "item_weight": np.zeros((v, 4)), "targets": targets}
    rows = run(engine, inputs, dtype="float32", upstream=np.zeros(n), reduction="none", focal=focal, grad_names=(),
               return_metrics=False)["loss"]
    k = np.minimum(np.arange(n), 1)
    element = 0.5**focal.gamma * math.log(2)
    want = element * (k * focal.alpha + (v - k) * (1 - focal.alpha) if focal.apply_class_balancing else np.full(n, v))
    assert_close(rows, want, dtype="float32", name=f"{engine} zero logits", elementwise=True)


@pytest.mark.parametrize("engine,reduction", cases(("torch-native", "none"), ("torch-native", "mean"),
                                                   ("jax-blocked", "none"), ("jax-pallas", "none")))
def test_gamma_zero_without_balancing_is_plain_bit_for_bit(engine, reduction):
    """`Focal(gamma=0)` without balancing runs the plain code (alpha is then unused)."""
    inputs = _inputs(5)
    common = dict(upstream=make_upstream(reduction, LEAD, seed=5, dtype="float32"), reduction=reduction)
    plain = run(engine, inputs, dtype="float32", focal=None, **common)
    focal = run(engine, inputs, dtype="float32", focal=Focal(0.0, 0.9), **common)
    for key in plain:
        np.testing.assert_array_equal(focal[key], plain[key], err_msg=key)


@pytest.mark.rung1
@pytest.mark.jax
def test_jax_config_drops_an_inert_focal():
    """The JAX engines see `Focal(gamma=0)` without balancing as no focal (one compiled program)."""
    from jax_kernels.core import CutBCEConfig

    assert CutBCEConfig(block_v=8, focal=Focal(0.0, 0.9)) == CutBCEConfig(block_v=8)
    assert CutBCEConfig(block_v=8, focal=Focal(0.0, 0.9, True)).focal == Focal(0.0, 0.9, True)


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
    for reduction, impl in (("none", "blocked"), ("mean", "pallas")):
        upstream = make_upstream(reduction, (3, 7), seed=9, dtype="float32")
        kwargs = dict(dtype="float32", upstream=upstream, reduction=reduction, focal=Focal(2.0, 0.25, True), block_v=32)
        sharded = run_jax(jax_kernels.cut_bce, inputs, mesh=mesh, impl=impl, **kwargs)
        single = run_jax(jax_kernels.cut_bce, inputs, impl="blocked", **kwargs)
        out[f"{reduction}-{impl}"] = {k: relative_error(sharded[k], single[k])[0] for k in single}
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.jax
@pytest.mark.rung3
def test_jax_sharded_mesh_matches_single_device(tmp_path):
    """2 x 2 CPU devices (data, model), N and V divisible by neither: blocked shards with 'none'
    (forward then backward), Pallas shards with 'mean' (one pass), within 1e-5 of the single device."""
    pytest.importorskip("jax")
    out = tmp_path / "sharded.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    errors = json.loads(out.read_text())
    assert len(errors) == 2
    worst = max(((case, key, err) for case, e in errors.items() for key, err in e.items()), key=lambda x: x[2])
    assert worst[2] <= TOLERANCES["float32"], (worst, errors)
