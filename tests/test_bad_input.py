"""Bad input gets a clear ValueError / TypeError naming the argument, in both frameworks.

Every case runs through `torch_cutbce.cut_bce_with_logits` and `jax_kernels.cut_bce` (their checks
are shared in `jax_kernels/shapes.py`), and the match includes the argument's name and, where it
applies, the shape or dtype it got and what was expected. Tensors on different devices are left
to the torch_xla bridge tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_kernels
from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits, ids_to_multi_hot

FRAMEWORKS = ("torch", "jax")
POSITIONAL = ("hidden", "item_weight", "targets", "bias")


def good_arguments():
    """S = (2, 3), D = 4, V = 7, L = 2, float32."""
    rng = np.random.default_rng(0)
    return {
        "hidden": rng.normal(size=(2, 3, 4)).astype(np.float32),
        "item_weight": rng.normal(size=(7, 4)).astype(np.float32),
        "targets": rng.integers(-1, 7, size=(2, 3, 2)),
    }


def call(framework, arguments):
    convert = torch.as_tensor if framework == "torch" else jnp.asarray
    arguments = {k: convert(v) if isinstance(v, (np.ndarray, np.generic)) else v for k, v in arguments.items()}
    args = [arguments.pop(k, None) for k in POSITIONAL]
    fn = cut_bce_with_logits if framework == "torch" else jax_kernels.cut_bce
    return fn(*args, **arguments)


f32 = np.float32
CASES = {
    # ranks
    "hidden-rank-0": ({"hidden": f32(1.0)}, ValueError,
        r"hidden must have shape \[\*S, D\] with rank >= 1, got shape \(\)"),
    "item_weight-rank-1": ({"item_weight": np.zeros(7, f32)}, ValueError,
        r"item_weight must have shape \[V, D\], got shape \(7,\)"),
    "item_weight-rank-3": ({"item_weight": np.zeros((7, 4, 1), f32)}, ValueError,
        r"item_weight must have shape \[V, D\]"),
    "targets-missing-L": ({"targets": np.zeros((2, 3), np.int64)}, ValueError,
        r"targets must have shape \[\*S, L\] = \[2, 3, 'L'\].*got shape \(2, 3\)"),
    # sizes that must agree
    "leading-dims": ({"targets": np.zeros((2, 4, 2), np.int64)}, ValueError,
        r"targets must have shape .* got shape \(2, 4, 2\)"),
    "D-mismatch": ({"item_weight": np.zeros((7, 5), f32)}, ValueError,
        r"hidden's last dimension D=4 must equal item_weight's D=5"),
    "V-zero": ({"item_weight": np.zeros((0, 4), f32)}, ValueError,
        r"item_weight must hold at least one item \(V >= 1\), got shape \(0, 4\)"),
    # dtypes
    "float-targets": ({"targets": np.zeros((2, 3, 2), f32)}, TypeError,
        r"targets must be integer item ids .* got dtype float32.*multi_hot_to_ids"),
    "bool-targets": ({"targets": np.zeros((2, 3, 2), bool)}, TypeError,
        r"targets must be integer item ids .* got dtype bool"),
    "integer-hidden": ({"hidden": np.zeros((2, 3, 4), np.int32)}, TypeError,
        r"hidden must be a floating-point tensor, got dtype int32"),
    "integer-item_weight": ({"item_weight": np.zeros((7, 4), np.int32)}, TypeError,
        r"item_weight must be a floating-point tensor, got dtype int32"),
    "mixed-dtypes": ({"item_weight": np.zeros((7, 4), np.float64)}, TypeError,
        r"hidden and item_weight must share a dtype, got float32 and float64"),
    "integer-weight": ({"weight": np.ones((2, 3), np.int32)}, TypeError,
        r"weight must be floating point, got dtype int32"),
    # option shapes
    "bias-length": ({"bias": np.zeros(8, f32)}, ValueError,
        r"bias must have shape \[V\] = \(7,\), got shape \(8,\)"),
    "bias-rank": ({"bias": np.zeros((7, 1), f32)}, ValueError,
        r"bias must have shape \[V\] = \(7,\), got shape \(7, 1\)"),
    "weight-shape": ({"weight": np.ones(6, f32)}, ValueError,
        r"weight must have shape \[\*S\] .* = \(2, 3\), got shape \(6,\)"),
    "weight-with-L": ({"weight": np.ones((2, 3, 1), f32)}, ValueError,
        r"weight must have shape \[\*S\] .* got shape \(2, 3, 1\)"),
    "class_weight-length": ({"class_weight": np.ones(6, f32)}, ValueError,
        r"class_weight must have shape \[V\] = \(7,\), got shape \(6,\)"),
    "pos_weight-shape": ({"pos_weight": np.ones((7, 2), f32)}, ValueError,
        r"pos_weight must have shape \[V\] = \(7,\), got shape \(7, 2\)"),
    # values
    "unknown-reduction": ({"reduction": "avg"}, ValueError,
        r"reduction must be one of \('none', 'sum', 'mean'\), got 'avg'"),
    "block_v-zero": ({"block_v": 0}, ValueError, r"block_v must be a positive int or None, got 0"),
    "block_v-float": ({"block_v": 2.5}, ValueError, r"block_v must be a positive int or None, got 2.5"),
    "id-equal-to-V": ({"targets": np.array([[[0, 7]] * 3] * 2)}, ValueError,
        r"targets holds item id 7, but item_weight has only V=7 items"),
    "id-far-above-V": ({"targets": np.full((2, 3, 2), 1000)}, ValueError, r"targets holds item id 1000"),
}


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument(framework, case):
    changes, error, match = CASES[case]
    with pytest.raises(error, match=match):
        call(framework, {**good_arguments(), **changes})


def test_good_arguments_pass():
    for framework in FRAMEWORKS:
        call(framework, {**good_arguments(), "bias": np.zeros(7, f32), "weight": np.ones((2, 3), f32),
                         "class_weight": np.ones(7, f32), "pos_weight": np.ones(7, f32)})


@pytest.mark.parametrize("framework, name, value", [("torch", "backend", "fast"), ("jax", "impl", "fast")])
def test_unknown_backend(framework, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be one of .*got 'fast'"):
        call(framework, {**good_arguments(), name: value})


def test_pallas_refuses_float64():
    arguments = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in good_arguments().items()}
    with pytest.raises(TypeError, match=r"impl='pallas' supports float32 and bfloat16 inputs, got float64"):
        call("jax", {**arguments, "impl": "pallas"})


@pytest.mark.parametrize("name", ["class_weight", "pos_weight"])
def test_torch_constant_weights_must_not_require_grad(name):
    value = torch.ones(7, requires_grad=True)
    with pytest.raises(ValueError, match=rf"{name} requires grad.*pass {name}.detach\(\)"):
        call("torch", {**good_arguments(), name: value})


def test_torch_xla_backend_needs_xla_tensors():
    with pytest.raises(ValueError, match=r"backend='xla_blocked' needs tensors on an XLA device"):
        call("torch", {**good_arguments(), "backend": "xla_blocked"})


def test_torch_rejects_non_tensors():
    arguments = {k: torch.as_tensor(v) for k, v in good_arguments().items()}
    with pytest.raises(TypeError, match=r"expected a torch.Tensor, got list"):
        cut_bce_with_logits(arguments["hidden"], arguments["item_weight"].tolist(), arguments["targets"])


def test_module_reports_bad_reduction_and_shapes():
    arguments = {k: torch.as_tensor(v) for k, v in good_arguments().items()}
    with pytest.raises(ValueError, match="reduction must be one of"):
        CutBCEWithLogitsLoss(reduction="avg")(*arguments.values())
    with pytest.raises(ValueError, match=r"pos_weight must have shape \[V\]"):
        CutBCEWithLogitsLoss(pos_weight=torch.ones(3))(*arguments.values())


def test_target_helpers_report_bad_input():
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        ids_to_multi_hot(torch.zeros(2, 3), 5)
    with pytest.raises(ValueError, match=r"ids holds item id 5, but num_items=5"):
        ids_to_multi_hot(torch.tensor([[0, 5]]), 5)


def test_jax_ids_at_or_above_V_under_jit_are_padding():
    """Documented: under jit the check would need a host sync, so ids >= V are ignored like padding."""
    arguments = {k: jnp.asarray(v) for k, v in good_arguments().items()}
    bad = arguments["targets"].at[0, 0, 0].set(7).at[1, 2, 1].set(99)
    padded = arguments["targets"].at[0, 0, 0].set(-1).at[1, 2, 1].set(-1)
    fn = jax.jit(jax_kernels.cut_bce, static_argnames=("reduction", "impl"))
    got = fn(arguments["hidden"], arguments["item_weight"], bad, reduction="none", impl="blocked")
    want = fn(arguments["hidden"], arguments["item_weight"], padded, reduction="none", impl="blocked")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
