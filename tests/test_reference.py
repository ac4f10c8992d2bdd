"""Rung L0: the two dense references against a hand-computed case and against each other.

Everything above this rung is compared with these references, so they are pinned down here:
by numbers worked out with math.log1p / math.exp, by torch's own BCEWithLogitsLoss on the
materialized logits, and torch dense vs JAX dense on the same numpy inputs in float64.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from parity import (
    OPTION_SETS, REDUCTIONS, assert_close, jax_x64, make_inputs, make_upstream, run_jax, run_torch, select,
)
from torch_cutbce import dense_bce_with_logits, ids_to_multi_hot

pytestmark = pytest.mark.rung0

# The JAX reference needs the [jax] extra: without jax the cases marked `jax` skip (conftest.py) and
# the torch ones run; with jax, any import error below still fails the module.
if importlib.util.find_spec("jax") is not None:
    import jax.numpy as jnp

    import jax_kernels
    from jax_kernels.reference import multi_hot

FRAMEWORKS = ["torch", pytest.param("jax", marks=pytest.mark.jax)]

# torch BCE is not differentiable in pos_weight, so the references are compared on these gradients.
ALL_GRADS = ("hidden", "item_weight", "bias", "weight", "class_weight")


def sp(x):
    return math.log1p(math.exp(x))


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# z = hidden @ item_weight.T + bias = [[1.5, -1, 1], [0.5, 1, 2]]; positives {0} and {2} (dup).
HAND = {
    "hidden": np.array([[1.0, 0.0], [0.0, 2.0]]),
    "item_weight": np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
    "targets": np.array([[0, -1], [2, 2]]),
    "bias": np.array([0.5, -1.0, 0.0]),
}
HAND_OPTIONS = {
    "weight": np.array([1.0, 0.5]),
    "class_weight": np.array([1.0, 2.0, 0.5]),
    "pos_weight": np.array([3.0, 1.0, 2.0]),
}
# Per-position loss rows: positives take pos_weight * softplus(-z), negatives softplus(z).
HAND_ROWS = {
    "plain": [sp(-1.5) + sp(-1.0) + sp(1.0), sp(0.5) + sp(1.0) + sp(-2.0)],
    "all": [
        1.0 * (1.0 * 3.0 * sp(-1.5) + 2.0 * sp(-1.0) + 0.5 * sp(1.0)),
        0.5 * (1.0 * sp(0.5) + 2.0 * sp(1.0) + 0.5 * 2.0 * sp(-2.0)),
    ],
}
# Predicted z > 0: row 0 [T, F, T] vs truth [T, F, F]; row 1 [T, T, T] vs [F, F, T].
HAND_COUNTS = {"plain": [[1, 1], [1, 2], [0, 0], [1, 0]], "all": [[1, 0.5], [1, 1], [0, 0], [1, 0]]}


def hand_inputs(options):
    return {**HAND, **(HAND_OPTIONS if options == "all" else {})}


def run_dense(framework, inputs, reduction, upstream, grad_names=ALL_GRADS):
    if framework == "torch":
        return run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream,
                         grad_names=grad_names, reduction=reduction)
    return run_jax(jax_kernels.dense_cut_bce, inputs, dtype="float64", upstream=upstream,
                   grad_names=grad_names, reduction=reduction)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_hand_case_loss_and_metrics(framework, options, reduction):
    out = run_dense(framework, hand_inputs(options), reduction, upstream=np.ones(2 if reduction == "none" else ()))
    rows, counts = np.array(HAND_ROWS[options]), np.array(HAND_COUNTS[options], dtype=float)
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / 6}[reduction]
    assert_close(out["loss"], expected, dtype="float64", name=f"{framework} loss")
    for name, count in zip(("tp", "fp", "fn", "tn"), counts):
        want = count if reduction == "none" else count.sum()
        np.testing.assert_array_equal(out[name], want, err_msg=name)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hand_case_gradients(framework):
    # dz = g (sigmoid(z) - y): z = [[1.5, -1, 1], [0.5, 1, 2]], y = [[1, 0, 0], [0, 0, 1]].
    g = np.array([0.7, -1.3])  # a non-uniform upstream gradient of the two rows
    dz = np.array([[sig(1.5) - 1, sig(-1.0), sig(1.0)], [sig(0.5), sig(1.0), sig(2.0) - 1]]) * g[:, None]
    expected = {
        "d_bias": dz.sum(0),
        # d_hidden[n] = sum_v dz[n, v] item_weight[v], item_weight rows [1, 0], [0, 1], [1, 1]
        "d_hidden": np.stack([dz[:, 0] + dz[:, 2], dz[:, 1] + dz[:, 2]], axis=1),
        # d_item_weight[v] = sum_n dz[n, v] hidden[n], hidden rows [1, 0], [0, 2]
        "d_item_weight": np.stack([dz[0], 2 * dz[1]], axis=1),
    }
    out = run_dense(framework, HAND, "none", upstream=g, grad_names=("hidden", "item_weight", "bias"))
    for name, value in expected.items():
        assert_close(out[name], value, dtype="float64", name=f"{framework} {name}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_dense_is_bce_with_logits_loss(reduction):
    """The torch oracle is torch's own BCEWithLogitsLoss on the materialized logits and multi-hot."""
    inputs = make_inputs((3, 4), 11, 5, 4, seed=1)
    t = {k: torch.tensor(v) for k, v in inputs.items()}
    logits = t["hidden"] @ t["item_weight"].T + t["bias"]
    elem_weight = t["weight"][..., None] * t["class_weight"]
    target = ids_to_multi_hot(t["targets"], 11, dtype=torch.float64)
    bce = torch.nn.BCEWithLogitsLoss(weight=elem_weight, pos_weight=t["pos_weight"],
                                     reduction="none" if reduction == "none" else reduction)
    expected = bce(logits, target)
    expected = expected.sum(-1) if reduction == "none" else expected
    loss = dense_bce_with_logits(t["hidden"], t["item_weight"], t["targets"], t["bias"], weight=t["weight"],
                                 class_weight=t["class_weight"], pos_weight=t["pos_weight"], reduction=reduction)
    assert_close(loss, expected, dtype="float64", name="dense vs BCEWithLogitsLoss")


@pytest.mark.parametrize("options", sorted(OPTION_SETS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.jax
def test_torch_dense_matches_jax_dense(options, reduction):
    lead_shape = (3, 5)
    inputs = select(make_inputs(lead_shape, 23, 6, 5, seed=2), OPTION_SETS[options])
    upstream = make_upstream(reduction, lead_shape, seed=2)
    ref_torch = run_dense("torch", inputs, reduction, upstream)
    ref_jax = run_dense("jax", inputs, reduction, upstream)
    assert_close(ref_jax, ref_torch, dtype="float64", name=f"jax dense vs torch dense ({options})")


@pytest.mark.jax
def test_multi_hot_references_agree():
    targets = make_inputs((4, 3), 9, 2, 5, seed=3)["targets"]
    dense_torch = ids_to_multi_hot(torch.tensor(targets), 9, dtype=torch.float64)
    with jax_x64("float64"):
        dense_jax = multi_hot(jnp.asarray(targets), 9, jnp.float64)
    np.testing.assert_array_equal(dense_torch.numpy(), np.asarray(dense_jax))
    # duplicates count once; -1 and -7 are padding; row 0 has no positives
    assert dense_torch.max() == 1 and dense_torch[0, 0].sum() == 0
    assert dense_torch[0, 1].tolist() == [0] * 8 + [1]


def test_assert_close_reports_the_error_where_and_all_three_values():
    reference, truth = np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[1.0, 2.0], [3.0, 4.001]])
    assert_close(reference * (1 + 1e-12), reference, dtype="float64", name="ok")
    with pytest.raises(AssertionError, match=r"x \[float32\]: relative error 2.500e-04 > 1e-05 at index \(1, 0\): "
                                             r"fast=.*3\.001.*reference=.*3\.0.*truth=.*3\.0"):
        assert_close(reference + np.array([[0, 0], [1e-3, 0]]), reference, truth, dtype="float32", name="x")
    # bfloat16: the 16-bit contract, no further from the truth than the bfloat16 reference or its floor
    assert_close(truth + 1e-3, truth + 4e-3, truth, dtype="bfloat16", name="ok")
    with pytest.raises(AssertionError, match=r"error vs float64 truth 9.998e-03 > max\(dense bfloat16's 9.998e-04, "
                                             r"floor 3.9e-03\) at flat index 0: fast=.*1\.04.*dense=.*1\.004"):
        assert_close(truth + 0.04, truth + 4e-3, truth, dtype="bfloat16", name="x")
    assert_close(np.array([np.nan, np.inf]), np.array([np.nan, np.inf]), dtype="float64", name="ok")
    with pytest.raises(AssertionError, match="relative error inf"):
        assert_close(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), dtype="float64", name="x")


def test_assert_close_elementwise_holds_each_entry_to_its_own_value():
    truth = np.array([1.0, 1e-12])
    off = truth + np.array([0.0, 1e-14])  # 1e-14 absolute: nothing next to 1, 1% of the small entry
    assert_close(off, truth, dtype="float32", name="normwise")
    with pytest.raises(AssertionError, match=r"x \[float32\]: relative error 1.000e-02 > 1e-05 at index \(1,\)"):
        assert_close(off, truth, dtype="float32", name="x", elementwise=True)
    # float16 follows the half-dtype rule, with the same tolerance as bfloat16
    assert_close(truth + 1e-3, truth + 4e-3, truth, dtype="float16", name="ok")


@pytest.mark.jax
def test_jax_x64_is_off_in_the_session_and_on_only_inside_a_float64_case():
    import jax

    assert not jax.config.jax_enable_x64  # JAX's default, what users run (conftest.py sets nothing)
    with jax_x64("float32"):
        assert jnp.asarray(np.zeros(2)).dtype == jnp.float32
    with jax_x64("float64"):
        assert jnp.asarray(np.zeros(2)).dtype == jnp.float64
    assert not jax.config.jax_enable_x64


def test_torch_oracle_checks_focal():
    h, w = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
    targets = torch.tensor([[0], [1]])
    with pytest.raises(TypeError, match="focal"):
        dense_bce_with_logits(h, w, targets, focal=2.0)
