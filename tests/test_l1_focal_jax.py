"""Focal CutBCE in JAX (issue 15): `cut_bce(..., focal=Focal(...))` against the float64 dense oracle.

The oracle is `dense_cut_bce(..., focal=...)`, the focal definition on materialized logits in logit
space (jax_kernels/reference.py), run in float64. Checked: the blocked loop (jit, x64 off, float32;
and float64 with x64 on), the Pallas kernels (interpret mode; float32 and bfloat16), the sharded
path (a 2x2 mesh of CPU devices, in a subprocess), gamma in {0.5, 1, 2, 3} with and without class
balancing, confident-logit rows (|z| up to 100, row by row), the awkward ids of `parity.make_inputs`
(duplicates, padding, a row without positives), zero logits (closed form), `Focal(gamma=0)` without
balancing against plain CutBCE bit for bit, and bad focal arguments.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import enable_x64  # noqa: E402

import exact_rows_cases  # noqa: E402
import jax_kernels  # noqa: E402
from jax_kernels import Focal  # noqa: E402
from jax_kernels.core import CutBCEConfig  # noqa: E402
from parity import OPTIONAL, TOLERANCES, assert_close, make_inputs, make_upstream, run_jax, select  # noqa: E402

TESTS = Path(__file__).resolve().parent
LEAD, V, D, L = (3, 7), 203, 16, 4  # N = 21, V no multiple of a tile
FOCALS = [Focal(gamma, 0.25, balanced) for gamma in (0.5, 1.0, 2.0, 3.0) for balanced in (False, True)]


def _tiles():
    from jax_kernels.pallas.block_sizes import BlockSizes

    return BlockSizes(block_n=128, block_v=128)


def _jitted(**static):
    """`cut_bce` jitted with its static options bound, in `parity.run_jax`'s calling convention."""
    fn = jax.jit(lambda h, w, t, b, weight, class_weight, pos_weight: jax_kernels.cut_bce(
        h, w, t, b, weight=weight, class_weight=class_weight, pos_weight=pos_weight, return_metrics=True,
        **static))
    return lambda h, w, t, b, *, weight, class_weight, pos_weight, return_metrics: fn(
        h, w, t, b, weight, class_weight, pos_weight)


def _oracle(inputs, focal, reduction, upstream, compute_dtype=None):
    with enable_x64(True):
        return run_jax(jax_kernels.dense_cut_bce, inputs, dtype="float64", upstream=upstream,
                       reduction=reduction, focal=focal, compute_dtype=compute_dtype)


def _inputs(seed, dtype="float32", options=OPTIONAL):
    return select(make_inputs(LEAD, V, D, L, seed=seed), options, dtype)


FOCAL_IDS = [f"{f.gamma:g}-{'balanced' if f.apply_class_balancing else 'raw'}" for f in FOCALS]


@pytest.mark.parametrize("index", range(len(FOCALS)), ids=FOCAL_IDS)
def test_blocked_float32_under_jit(index):
    """Loss, every gradient and the metrics within 1e-5 of the float64 oracle (x64 off, as users run
    it); 'none' and 'mean' alternate (the two-loop and the one-loop gradient)."""
    focal = FOCALS[index]
    reduction = ("none", "mean")[index % 2]
    inputs = _inputs(index)
    upstream = make_upstream(reduction, LEAD, seed=index, dtype="float32")
    want = _oracle(inputs, focal, reduction, upstream)
    with enable_x64(False):
        fast = run_jax(_jitted(focal=focal, reduction=reduction, impl="blocked", block_v=64), inputs,
                       dtype="float32", upstream=upstream)
    assert_close(fast, want, dtype="float32", name=f"blocked {focal} {reduction}")


@pytest.mark.parametrize("focal", [Focal(0.5, 0.3, True)], ids=str)
def test_blocked_float64(focal):
    inputs = _inputs(7, "float64")
    upstream = make_upstream("none", LEAD, seed=7)
    want = _oracle(inputs, focal, "none", upstream)
    with enable_x64(True):
        fast = run_jax(jax_kernels.cut_bce, inputs, dtype="float64", upstream=upstream, reduction="none",
                       focal=focal, impl="blocked", block_v=50)
    assert_close(fast, want, dtype="float64", name=f"blocked float64 {focal}")


@pytest.mark.parametrize("dtype,focal,reduction", [
    ("float32", Focal(2.0), "none"),  # forward kernel, then the d_hidden and d_item kernels
    ("float32", Focal(0.5, 0.25, True), "mean"),  # the one-pass kernels (d_hidden with the rows)
    ("bfloat16", Focal(2.0, 0.25, True), "sum"),
], ids=str)
def test_pallas_interpret(dtype, focal, reduction):
    """The kernels in interpret mode: 2 x 2 tiles of 128 (ragged N and V). bfloat16 follows CCE's
    rule: no further from the float64 truth than the dense reference run in bfloat16, plus 2e-3."""
    inputs = _inputs(3, dtype)
    upstream = make_upstream(reduction, LEAD, seed=3, dtype=dtype)
    truth = _oracle(inputs, focal, reduction, upstream)
    with enable_x64(False):
        fast = run_jax(jax_kernels.cut_bce, inputs, dtype=dtype, upstream=upstream, reduction=reduction,
                       focal=focal, impl="pallas", block_sizes=_tiles())
        if dtype == "bfloat16":
            same_dtype = run_jax(jax_kernels.dense_cut_bce, inputs, dtype=dtype, upstream=upstream,
                                 reduction=reduction, focal=focal, compute_dtype=jnp.bfloat16)
            assert_close(fast, same_dtype, truth, dtype=dtype, name=f"pallas {focal}")
        else:
            assert_close(fast, truth, dtype=dtype, name=f"pallas {focal}")


def _rows_and_grads(fn, case, dtype, **kwargs):
    """`(rows [N] float64, {d_hidden, d_item_weight})` of `fn` for an exact_rows_cases case."""
    a = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    pos_weight = None if case["pos_weight"] is None else a(case["pos_weight"])

    def rows_fn(hidden, items):
        return fn(hidden, items, jnp.asarray(case["targets"], jnp.int32), pos_weight=pos_weight,
                  reduction="none", **kwargs)

    rows, vjp = jax.vjp(rows_fn, a(case["hidden"]), a(case["item_weight"]))
    d_hidden, d_items = vjp(a(case["g"]))
    return np.asarray(rows, np.float64), {"d_hidden": np.asarray(d_hidden, np.float64),
                                          "d_item_weight": np.asarray(d_items, np.float64)}


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
@pytest.mark.parametrize("focal", [Focal(0.5, 0.25, True), Focal(3.0)], ids=str)
def test_confident_rows_row_by_row(focal, impl):
    """A positive at z = 5 .. 100 among negatives at -10, and single-item rows at +-31: each float32
    row within 1e-5 of its own float64 truth (or of the smallest normal float32 below it), never
    below zero; gradients within 1e-5 of the largest."""
    for name in ("confident", "single", "zero"):
        case = exact_rows_cases.cases()[name]
        with enable_x64(True):
            truth_rows, truth_grads = _rows_and_grads(jax_kernels.dense_cut_bce, case, "float64", focal=focal)
        with enable_x64(False):
            rows, grads = _rows_and_grads(jax_kernels.cut_bce, case, "float32", focal=focal, impl=impl,
                                          block_v=16, block_sizes=_tiles() if impl == "pallas" else None)
        exact_rows_cases.check_rows(f"{impl}:{name}:{focal}", rows, truth_rows, "float32")
        exact_rows_cases.check_grads(f"{impl}:{name}:{focal}", grads, truth_grads, "float32")
        if name == "confident":  # the focal factor shrinks the confident rows below the plain ones
            plain = exact_rows_cases.truth(case)["rows"]
            assert (truth_rows <= plain).all() and (truth_rows > 0).all()


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
@pytest.mark.parametrize("balanced", [False, True])
def test_zero_logits_closed_form(impl, balanced):
    """z = 0 everywhere: every element is 0.5^gamma ln 2; with balancing and one positive a row is
    V 0.5^gamma ln 2 (alpha + (V - 1)(1 - alpha)) / V."""
    gamma, alpha, n, v = 1.5, 0.3, 5, 40
    focal = Focal(gamma, alpha, balanced)
    targets = np.full((n, 2), -1)
    targets[:, 0] = np.arange(n) * 7  # one positive per row
    targets[1, 1] = targets[1, 0]  # a duplicate counts once
    with enable_x64(False):
        rows = jax_kernels.cut_bce(jnp.zeros((n, 4)), jnp.zeros((v, 4)), targets, reduction="none",
                                   focal=focal, impl=impl, block_sizes=_tiles() if impl == "pallas" else None)
    element = 0.5**gamma * math.log(2)
    want = v * element * ((alpha + (v - 1) * (1 - alpha)) / v if balanced else 1.0)
    assert_close(rows, np.full(n, want), dtype="float32", name=f"{impl} zero logits", elementwise=True)


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_gamma_zero_is_plain_bit_for_bit(impl):
    """`Focal(gamma=0)` without balancing normalises to None in CutBCEConfig: the plain code runs."""
    assert CutBCEConfig(block_v=8, focal=Focal(0.0, 0.9)) == CutBCEConfig(block_v=8)
    assert CutBCEConfig(block_v=8, focal=Focal(0.0, 0.9, True)).focal == Focal(0.0, 0.9, True)
    inputs = _inputs(5)
    upstream = make_upstream("none", LEAD, seed=5, dtype="float32")
    kwargs = dict(reduction="none", impl=impl, block_v=64, block_sizes=_tiles() if impl == "pallas" else None)
    with enable_x64(False):
        plain = run_jax(jax_kernels.cut_bce, inputs, dtype="float32", upstream=upstream, **kwargs)
        focal = run_jax(jax_kernels.cut_bce, inputs, dtype="float32", upstream=upstream, focal=Focal(0.0), **kwargs)
    for key in plain:
        np.testing.assert_array_equal(focal[key], plain[key], err_msg=key)


def test_gamma_zero_balanced_is_scaled_plain():
    """gamma = 0 with balancing runs the focal code: positives times alpha, negatives times 1 - alpha."""
    inputs = _inputs(6, options=("bias", "pos_weight"))
    alpha = 0.25
    with enable_x64(True):
        scaled = {k: v.copy() for k, v in inputs.items()}
        scaled["pos_weight"] = inputs["pos_weight"] * alpha / (1 - alpha)
        plain = run_jax(jax_kernels.dense_cut_bce, scaled, dtype="float64", upstream=1.0, reduction="sum",
                        return_metrics=False)
    with enable_x64(False):
        fast = run_jax(jax_kernels.cut_bce, inputs, dtype="float32", upstream=1.0, reduction="sum",
                       return_metrics=False, impl="blocked", block_v=64, focal=Focal(0.0, alpha, True))
    assert_close(fast, {k: v * (1 - alpha) for k, v in plain.items()}, dtype="float32", name="gamma 0 balanced")


@pytest.mark.parametrize("fn,mesh", [("cut_bce", {}), ("dense_cut_bce", {}), ("cut_bce", {"mesh": "infer"})])
@pytest.mark.parametrize("bad,error", [(2.0, TypeError), ({"gamma": 2.0}, TypeError)])
def test_bad_focal_argument_raises(fn, mesh, bad, error):
    with pytest.raises(error, match="focal"):
        getattr(jax_kernels, fn)(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.zeros((2, 1), int),
                                 focal=bad, **mesh)


@pytest.mark.parametrize("fn", ["cut_bce", "dense_cut_bce"])
def test_a_focal_changed_after_construction_is_checked_again(fn):
    focal = Focal(2.0)
    object.__setattr__(focal, "gamma", -1.0)  # past the frozen dataclass
    with pytest.raises(ValueError, match="focal gamma must be >= 0"):
        getattr(jax_kernels, fn)(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32), np.zeros((2, 1), int),
                                 focal=focal)


@pytest.mark.parametrize("kwargs,error", [
    (dict(gamma=-1.0), ValueError), (dict(gamma=float("nan")), TypeError), (dict(gamma="2"), TypeError),
    (dict(alpha=1.5), ValueError), (dict(apply_class_balancing=1), TypeError),
])
def test_bad_focal_options_raise(kwargs, error):
    with pytest.raises(error, match="focal"):
        Focal(**kwargs)


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


def test_sharded_mesh_matches_single_device(tmp_path):
    """2 x 2 CPU devices (data, model), N and V divisible by neither: blocked shards with 'none'
    (forward then backward), Pallas shards with 'mean' (one pass), within 1e-5 of the single device."""
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
