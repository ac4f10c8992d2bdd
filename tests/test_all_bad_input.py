"""Every bad input gets a clear error, at every public entry point (tests/_bad_input_entries.py).

The same input runs through `cut_bce_with_logits` (backend 'native' and 'dense'),
`CutBCEWithLogitsLoss`, `jax_kernels.cut_bce` (impl 'blocked') and `jax_kernels.dense_cut_bce`.
Errors are ValueError / TypeError whose message names the argument, shows the shape, dtype or
value it got and says what was expected (the checks are shared, in `cutbce_common/shapes.py`).
Degenerate but valid inputs: test_all_bad_input_accepted.py. Tensors on different devices are left
to the torch_xla bridge tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _bad_input_entries import (
    ENTRIES,
    HAVE_JAX,
    TORCH_ENTRIES,
    T,
    Zeros,
    call,
    convert,
    f32,
    good_arguments,
)
from parity import assert_close
from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits, ids_to_multi_hot

# The JAX tests' names, where jax is installed; without it the JAX entries skip (`jax` mark).
if HAVE_JAX:
    import jax.numpy as jnp

    import jax_kernels
    from parity import enable_x64

pytestmark = [pytest.mark.rung0, pytest.mark.rung1, pytest.mark.rung2]

FLOATS = r"float16 / bfloat16 / float32 / float64"
CASES = {
    # ranks
    "hidden-rank-0": ({"hidden": np.array(1.0, f32)}, ValueError,
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
    # dtypes: one list of accepted float and id dtypes (shapes.FLOAT_DTYPES, shapes.ID_DTYPES)
    "float-targets": ({"targets": np.zeros(T, f32)}, TypeError,
        r"targets must be integer item ids .* got dtype float32.*multi_hot_to_ids"),
    "bool-targets": ({"targets": np.zeros(T, bool)}, TypeError, r"targets must be integer item ids .* got dtype bool"),
    "complex-targets": ({"targets": Zeros(T, "complex64")}, TypeError,
        r"targets must be integer item ids .* got dtype complex64"),
    "integer-hidden": ({"hidden": np.zeros((2, 3, 4), np.int32)}, TypeError,
        rf"hidden must be a floating-point array of dtype {FLOATS}, got dtype int32"),
    "integer-item_weight": ({"item_weight": np.zeros((7, 4), np.int32)}, TypeError,
        rf"item_weight must be a floating-point array of dtype {FLOATS}, got dtype int32"),
    # (hidden and item_weight of different float dtypes are valid: promoted, tests/test_torch_toolchain.py)
    "integer-weight": ({"weight": np.ones((2, 3), np.int32)}, TypeError,
        rf"weight must be a floating-point array of dtype {FLOATS}, got dtype int32"),
    "complex-bias": ({"bias": Zeros((7,), "complex64")}, TypeError,
        rf"bias must be a floating-point array of dtype {FLOATS}, got dtype complex64"),
    # option shapes
    "bias-length": ({"bias": np.zeros(8, f32)}, ValueError, r"bias must have shape \[V\] = \(7,\), got shape \(8,\)"),
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
    "block_v-float": ({"block_v": 2.5}, TypeError, r"block_v must be a positive int or None, got 2.5 of type float"),
    "block_v-bool": ({"block_v": True}, TypeError, r"block_v must be a positive int or None, got True of type bool"),
    "id-equal-to-V": ({"targets": np.array([[[0, 7]] * 3] * 2)}, ValueError,
        r"targets holds item id 7, but item_weight has only V=7 items"),
    "id-far-above-V": ({"targets": np.full(T, 1000)}, ValueError, r"targets holds item id 1000"),
}
# float8 and complex are not floating for us; torch's uint16/32/64 lack sort / max / indexing.
for _name in ("float8_e4m3fn", "float8_e5m2", "complex64"):
    CASES[f"{_name}-inputs"] = ({"hidden": Zeros((2, 3, 4), _name), "item_weight": Zeros((7, 4), _name)}, TypeError,
                                rf"hidden must be a floating-point array of dtype {FLOATS}, got dtype {_name}")
for _name in ("uint16", "uint32", "uint64"):
    CASES[f"{_name}-targets"] = ({"targets": Zeros(T, _name)}, TypeError,
                                 rf"targets must be signed integer ids .* or uint8, got dtype {_name}.*cast to int64")


def applies(entry, changes):
    return not (entry == "jax-dense" and "block_v" in changes)  # the dense reference has no tiles


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument(entry, case):
    changes, error, match = CASES[case]
    if not applies(entry, changes):
        pytest.skip("the dense reference has no block_v")
    with pytest.raises(error, match=match):
        call(entry, {**good_arguments(), **changes})


@pytest.mark.jax
def test_jax_accepts_array_likes():
    """Lists and numpy arrays go through jnp.asarray (ids checked first); a non-array is a TypeError."""
    arguments = good_arguments()
    want = jax_kernels.cut_bce(*(jnp.asarray(v) for v in arguments.values()), impl="blocked")
    for fn in (jax_kernels.cut_bce, jax_kernels.dense_cut_bce):
        got = fn(*(v.tolist() for v in arguments.values()), weight=np.ones((2, 3), f32).tolist())
        assert_close(got, want, dtype="float32", name=fn.__name__)
        with pytest.raises(TypeError, match=r"hidden must be an array \(jax.Array, numpy array or nested list"):
            fn("hidden", *list(arguments.values())[1:])
        with pytest.raises(TypeError, match=r"targets must be an integer array .* got list"):
            fn(*list(arguments.values())[:2], [[[0, 1], [2]]])


@pytest.mark.parametrize("entry", TORCH_ENTRIES)
@pytest.mark.parametrize("name", ["hidden", "item_weight", "targets", "bias", "weight"])
def test_torch_rejects_non_tensors(entry, name):
    arguments = {**good_arguments(), "bias": np.zeros(7, f32), "weight": np.ones((2, 3), f32)}
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        call(entry, {**arguments, name: arguments[name].tolist()})


def test_torch_double_backward_of_rows_raises():
    hidden = torch.tensor(good_arguments()["hidden"], requires_grad=True)
    rows = cut_bce_with_logits(hidden, *(torch.as_tensor(v) for v in list(good_arguments().values())[1:]),
                               reduction="none", backend="native")
    with pytest.raises(RuntimeError, match="twice differentiable"):  # when asked for a graph, or when used
        (d_hidden,) = torch.autograd.grad(rows, hidden, torch.randn(2, 3), create_graph=True)
        d_hidden.square().sum().backward()


@pytest.mark.parametrize("entry, name, value", [("torch-native", "backend", "fast"),
                                                pytest.param("jax-blocked", "impl", "fast", marks=pytest.mark.jax)])
def test_unknown_backend(entry, name, value):
    fn = cut_bce_with_logits if entry == "torch-native" else jax_kernels.cut_bce
    with pytest.raises(ValueError, match=rf"{name} must be one of .*got 'fast'"):
        fn(*(convert(entry, v) for v in good_arguments().values()), **{name: value})


@pytest.mark.jax
def test_pallas_refuses_float64():
    arguments = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in good_arguments().items()}
    # x64 on: without it JAX itself turns the float64 inputs into float32, which Pallas takes.
    with enable_x64(True), pytest.raises(TypeError, match=r"impl='pallas' supports float32 and bfloat16 inputs, got float64"):
        jax_kernels.cut_bce(*arguments.values(), impl="pallas")


@pytest.mark.parametrize("entry", ["torch-native", "torch-module"])
@pytest.mark.parametrize("name", ["class_weight", "pos_weight"])
def test_torch_constant_weights_must_not_require_grad(entry, name):
    with pytest.raises(ValueError, match=rf"{name} requires grad.*pass {name}.detach\(\)"):
        call(entry, {**good_arguments(), name: torch.ones(7, requires_grad=True)})


def test_torch_xla_backend_needs_xla_tensors():
    with pytest.raises(ValueError, match=r"backend='xla_blocked' needs tensors on an XLA device"):
        call("torch-native", {**good_arguments(), "backend": "xla_blocked"})


def test_module_checks_its_options_when_built():
    with pytest.raises(ValueError, match=r"reduction must be one of .*got 'avg'"):
        CutBCEWithLogitsLoss(reduction="avg")
    with pytest.raises(ValueError, match=r"backend must be one of .*got 'fast'"):
        CutBCEWithLogitsLoss(backend="fast")
    with pytest.raises(TypeError, match=r"block_v must be a positive int or None, got True of type bool"):
        CutBCEWithLogitsLoss(block_v=True)


def test_target_helpers_report_bad_input():
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        ids_to_multi_hot(torch.zeros(2, 3), 5)
    with pytest.raises(ValueError, match=r"ids holds item id 5, but num_items=5"):
        ids_to_multi_hot(torch.tensor([[0, 5]]), 5)
