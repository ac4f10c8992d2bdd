"""Rung L1 (JAX): the blocked pure-JAX implementation against the float64 dense oracle.

The oracle is the parity ladder's (docs/design.md): torch's binary_cross_entropy_with_logits on materialized logits in
float64 (`dense_bce_with_logits`, equal to `jax_kernels.dense_cut_bce` by test_reference.py, and
free of JAX compilations), on the very values the fast path sees; without torch (the JAX-only
environment of ci/jax_newest.sh) `dense_cut_bce` in float64 (`parity.float64_truth`). bfloat16's
same-dtype reference is `jax_kernels.dense_cut_bce(compute_dtype=bfloat16)`. Gradients come from
`jax.vjp` with random, non-uniform cotangents. The last tests put torch's native path and this one
side by side.

Every eager call of the blocked loop compiles it (about 0.5 s of CPU), so the dtype x options x
reduction matrix is covered pairwise: float64 runs all of it; float32 and bfloat16 run every
option with reduction='none' (a random cotangent per row) and every reduction with all options.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_kernels  # noqa: E402
from parity import (  # noqa: E402
    DTYPES, GRADS, OPTION_SETS, OPTIONAL, REDUCTIONS, assert_close, check_against_oracle, float64_truth, jax_x64,
    make_inputs, make_upstream, needs_torch, run_jax, run_torch, select,
)

pytestmark = pytest.mark.rung1

# N = 15 positions, V = 37 items, block_v = 8: a ragged last tile.
LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, BLOCK_V = (3, 5), 37, 8, 5, 8


def blocked(*args, **kwargs):
    return jax_kernels.cut_bce(*args, impl="blocked", **kwargs)


def dense_bf16(*args, **kwargs):
    return jax_kernels.dense_cut_bce(*args, compute_dtype=jnp.bfloat16, **kwargs)


def check_blocked(inputs, lead_shape, *, fn=blocked, **kwargs):
    """`parity.check_against_oracle` for the blocked JAX path (`fn`, default: the path itself)."""
    return check_against_oracle(run_jax, fn, dense_bf16, inputs, lead_shape, name="blocked", **kwargs)


MATRIX = [
    (dtype, options, reduction)
    for dtype in DTYPES for options in OPTION_SETS for reduction in REDUCTIONS
    if dtype == "float64" or reduction == "none" or options == "all"
]


@pytest.mark.parametrize("dtype, options, reduction", MATRIX)
def test_blocked_matches_oracle(dtype, options, reduction):
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=21)
    inputs = select(raw, OPTION_SETS[options], dtype)
    out = check_blocked(inputs, LEAD_SHAPE, dtype=dtype, reduction=reduction, seed=21, block_v=BLOCK_V)
    assert {f"d_{k}" for k in GRADS if k in inputs} <= set(out)


@pytest.mark.parametrize(
    "lead_shape, num_items, num_slots, block_v",
    [
        ((5,), 37, 3, 64),  # N < block_v, and block_v > V
        ((2, 3, 4), 49, 4, 7),  # rank-3 lead shape; block_v divides V (no shifted last tile)
        ((7,), 13, 1, 1),  # one column per tile; L = 1
        ((1,), 5, 3, 2),  # a single position; a shifted last tile
        ((3, 1, 2), 129, 6, None),  # the default block_v
    ],
)
def test_odd_shapes(lead_shape, num_items, num_slots, block_v):
    # One reduction ('none': a random cotangent per row) keeps compilations down; every
    # reduction runs on the ragged shape of test_blocked_matches_oracle.
    raw = make_inputs(lead_shape, num_items, 5, num_slots, seed=num_items)
    check_blocked(select(raw), lead_shape, dtype="float64", reduction="none", seed=3, block_v=block_v)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_large_logits_everywhere(dtype):
    """Logits ~ N(0, 30^2): most |z| are tens, many 50 to 100, on positives and negatives alike."""
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=5, scale=30.0)
    for reduction in REDUCTIONS:
        check_blocked(select(raw, OPTIONAL, dtype), LEAD_SHAPE, dtype=dtype, reduction=reduction, seed=5,
                      block_v=BLOCK_V)


@pytest.mark.parametrize(
    "grad_names", [("hidden",), ("item_weight",), ("bias",), ("weight",)], ids=lambda names: "+".join(names)
)
def test_single_gradients(grad_names):
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=22))
    out = check_blocked(inputs, LEAD_SHAPE, dtype="float64", reduction="none", seed=22,
                        grad_names=grad_names, block_v=BLOCK_V)
    assert {k for k in out if k.startswith("d_")} == {f"d_{k}" for k in grad_names}


def test_class_weight_and_pos_weight_are_constants():
    """Documented: class_weight and pos_weight get a zero cotangent (torch refuses requires_grad)."""
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=23))
    out = run_jax(blocked, inputs, dtype="float64", upstream=make_upstream("sum", LEAD_SHAPE, seed=23),
                  grad_names=("hidden", "class_weight", "pos_weight"), reduction="sum", block_v=BLOCK_V)
    assert not out["d_class_weight"].any() and not out["d_pos_weight"].any()
    assert out["d_hidden"].any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_under_jit_with_static_options(reduction):
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=24), OPTIONAL, "float32")
    jitted = jax.jit(blocked, static_argnames=("reduction", "return_metrics", "block_v"))
    eager = run_jax(blocked, inputs, dtype="float32", upstream=make_upstream(reduction, LEAD_SHAPE, seed=24),
                    reduction=reduction, block_v=BLOCK_V)
    for _ in range(2):  # the second call reuses the compiled function
        out = run_jax(jitted, inputs, dtype="float32", upstream=make_upstream(reduction, LEAD_SHAPE, seed=24),
                      reduction=reduction, block_v=BLOCK_V)
        assert_close(out, eager, dtype="float32", name="jit vs eager")
    truth = float64_truth(inputs, upstream=make_upstream(reduction, LEAD_SHAPE, seed=24), reduction=reduction)
    assert_close(out, truth, dtype="float32", name="jit vs oracle")


def test_jit_of_whole_training_step():
    """Loss and gradients inside one jitted function (options closed over as Python constants)."""
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=25)
    with jax_x64("float64"):
        args = [jnp.asarray(raw[k]) for k in ("hidden", "item_weight", "targets", "bias", "weight")]
        g = jnp.asarray(make_upstream("none", LEAD_SHAPE, seed=25))

        def objective(fn, hidden, item_weight, targets, bias, weight):
            rows = fn(hidden, item_weight, targets, bias, weight=weight, reduction="none")
            return (rows * g).sum()

        step = jax.jit(jax.value_and_grad(functools.partial(objective, blocked), argnums=(0, 1, 3, 4)))
        ref = jax.value_and_grad(functools.partial(objective, jax_kernels.dense_cut_bce), argnums=(0, 1, 3, 4))
        (value, grads), (ref_value, ref_grads) = step(*args), ref(*args)
    assert_close({"loss": value, **dict(enumerate(grads))}, {"loss": ref_value, **dict(enumerate(ref_grads))},
                 dtype="float64", name="jitted step")


def test_auto_impl_off_tpu_is_blocked():
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=26))
    auto = functools.partial(jax_kernels.cut_bce, impl="auto")
    check_blocked(inputs, LEAD_SHAPE, dtype="float64", reduction="mean", seed=26, fn=auto, block_v=BLOCK_V)


def test_int32_targets():
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=27))
    inputs["targets"] = inputs["targets"].astype(np.int32)
    check_blocked(inputs, LEAD_SHAPE, dtype="float64", reduction="sum", seed=27, block_v=BLOCK_V)


def test_nan_in_hidden_propagates():
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=28))
    inputs["hidden"][1, 2, 3] = np.nan
    upstream = make_upstream("none", LEAD_SHAPE, seed=28)
    fast = run_jax(blocked, inputs, dtype="float64", upstream=upstream, reduction="none", block_v=BLOCK_V)
    truth = float64_truth(inputs, upstream=upstream, reduction="none")
    for key in ("loss", "d_hidden", "d_item_weight"):
        np.testing.assert_array_equal(np.isnan(fast[key]), np.isnan(truth[key]), err_msg=key)
    assert np.isnan(fast["loss"][1, 2]) and np.isfinite(np.delete(fast["loss"].ravel(), 7)).all()


# -- the fused pass of the scalar reductions (core.cut_bce_value_and_grad) --------------------------


@pytest.mark.parametrize("options", ["plain", "all"])
def test_value_and_grad_equals_forward_then_backward(options):
    """One loop computing rows, counts and gradients for a known row gradient == the two-pass path."""
    from cutbce_common.options import CutBCEOptions
    from jax_kernels.core import cut_bce_backward, cut_bce_forward, cut_bce_value_and_grad

    n = int(np.prod(LEAD_SHAPE))
    raw = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=30), OPTION_SETS[options])
    with jax_x64("float64"):
        hidden = jnp.asarray(raw["hidden"]).reshape(n, HIDDEN_SIZE) * 20  # |logits| well past softplus's linear range
        operands = (hidden, jnp.asarray(raw["item_weight"]), jnp.asarray(raw["targets"]).reshape(n, NUM_SLOTS),
                    *(None if raw.get(k) is None else jnp.asarray(raw[k]) for k in ("bias", "class_weight", "pos_weight")))
        g = jnp.asarray(make_upstream("none", (n,), seed=30))  # mixed signs, non-uniform
        options = CutBCEOptions(block_v=BLOCK_V, compute_metrics=True, impl="blocked")
        (rows, counts), grads = cut_bce_value_and_grad(*operands, g, options=options)
        ref_rows, ref_counts = cut_bce_forward(*operands, options=options)
        ref_grads = cut_bce_backward(*operands, g, options=options)
    np.testing.assert_array_equal(counts, ref_counts)
    fused = {"rows": rows, **{f"d{i}": x for i, x in enumerate(grads) if x is not None}}
    two_pass = {"rows": ref_rows, **{f"d{i}": x for i, x in enumerate(ref_grads) if x is not None}}
    assert fused.keys() == two_pass.keys()
    assert_close(fused, two_pass, dtype="float64", name="fused vs two passes")


def test_core_runs_resolved_options_only():
    """The entries take `CutBCEOptions.resolved` values: an unsized tile or 'auto' is named, not run."""
    from cutbce_common.options import CutBCEOptions
    from jax_kernels.core import OneDevice, cut_bce_forward

    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=30)
    n = int(np.prod(LEAD_SHAPE))
    operands = (jnp.asarray(raw["hidden"]).reshape(n, HIDDEN_SIZE), jnp.asarray(raw["item_weight"]),
                jnp.asarray(raw["targets"]).reshape(n, NUM_SLOTS), None, None, None)
    for unresolved in (CutBCEOptions(impl="blocked"), CutBCEOptions(block_v=BLOCK_V)):
        with pytest.raises(ValueError, match="options must be resolved .*CutBCEOptions.resolved"):
            cut_bce_forward(*operands, options=unresolved)
        with pytest.raises(ValueError, match="options must be resolved"):
            OneDevice(unresolved)
    resolved = CutBCEOptions().resolved(num_positions=n, num_items=NUM_ITEMS, impl="blocked")
    rows, _ = OneDevice(resolved).forward(*operands)
    assert rows.shape == (n,) and resolved.block_v == NUM_ITEMS  # the default tile, at most V


def _count_loops(fn, *args):
    jaxpr = str(jax.make_jaxpr(fn)(*args))  # fori_loop with a static trip count traces to a scan
    return jaxpr.count("scan[") + jaxpr.count("while[")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_scalar_loss_gradient_takes_one_pass_over_the_items(reduction):
    """The gradient of 'mean'/'sum' runs one loop over the vocabulary tiles; 'none' needs two."""
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=31)
    hidden, item_weight, targets = (jnp.asarray(raw[k]) for k in ("hidden", "item_weight", "targets"))

    def loss(h, e, reduction):
        return blocked(h, e, targets, reduction=reduction, block_v=BLOCK_V).sum()

    def grad(reduction):
        return jax.grad(functools.partial(loss, reduction=reduction), argnums=(0, 1))

    assert _count_loops(grad(reduction), hidden, item_weight) == 1
    assert _count_loops(grad("none"), hidden, item_weight) == 2
    # Without differentiation, the plain forward: one loop and no gradient accumulators.
    assert _count_loops(functools.partial(loss, reduction=reduction), hidden, item_weight) == 1


# -- cross-framework parity: torch native vs JAX blocked on the same numpy inputs ---------------


def native(*args, **kwargs):
    from torch_cutbce import cut_bce_with_logits

    return cut_bce_with_logits(*args, backend="native", **kwargs)


@needs_torch
@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_native_matches_jax_blocked(options, reduction):
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=29)
    inputs = select(raw, OPTION_SETS[options], "float32")
    upstream = make_upstream(reduction, LEAD_SHAPE, seed=29, dtype="float32")
    common = dict(dtype="float32", upstream=upstream, reduction=reduction, block_v=BLOCK_V)
    assert_close(run_torch(native, inputs, **common), run_jax(blocked, inputs, **common),
                 dtype="float32", name="torch native vs jax blocked")


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_mixed_dtypes_compute_in_the_promoted_dtype_and_return_each_inputs_dtype(impl):
    rng = np.random.default_rng(9)
    hidden = jnp.asarray(rng.normal(size=(37, 16)), jnp.float32)
    items = jnp.asarray(rng.normal(size=(301, 16)) * 0.5, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(-1, 301, size=(37, 3)), jnp.int32)

    def loss(h, e):
        return jax_kernels.cut_bce(h, e, targets, reduction="sum", impl=impl, block_v=128)

    value, (d_h, d_e) = jax.value_and_grad(loss, argnums=(0, 1))(hidden, items)
    assert (d_h.dtype, d_e.dtype) == (jnp.float32, jnp.bfloat16)
    # The reference: the same loss with the bfloat16 table widened, all in float32 (the promoted dtype).
    truth, (t_h, t_e) = jax.value_and_grad(loss, argnums=(0, 1))(hidden, items.astype(jnp.float32))
    assert_close({"loss": value, "d_hidden": d_h}, {"loss": truth, "d_hidden": t_h}, dtype="float32",
                 name=f"{impl} mixed dtypes")
    # d_item_weight is returned in bfloat16: CCE's rule against the float32 gradient, with that
    # gradient rounded to bfloat16 as the same-dtype reference.
    assert_close(d_e, t_e.astype(jnp.bfloat16), t_e, dtype="bfloat16", name=f"{impl} mixed dtypes:d_item_weight")
