"""Degenerate but valid inputs give the answer of torch's BCEWithLogitsLoss on the materialized
logits, at every public entry point (tests/_bad_input_entries.py): N = 0, D = 0, every accepted id
dtype (narrow ones with a catalog beyond their range), int64 ids beyond int32, numpy integer
block_v, a bias of another float dtype, half inputs; ids >= V under jit are padding. The errors:
test_all_bad_input.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from _bad_input_entries import (
    ENTRIES,
    ENTRY_NAMES,
    HAVE_JAX,
    T,
    call,
    entries,
    f32,
    good_arguments,
    run,
)
from parity import assert_close
from torch_cutbce import ids_to_multi_hot

# The JAX tests' names, where jax is installed; without it the JAX entries skip (`jax` mark).
if HAVE_JAX:
    import jax
    import jax.numpy as jnp

    import jax_kernels
    from parity import enable_x64

pytestmark = [pytest.mark.rung0, pytest.mark.rung1, pytest.mark.rung2]


@pytest.mark.parametrize("entry", ENTRIES)
def test_good_arguments_pass(entry):
    options = {"bias": np.zeros(7, f32), "weight": np.ones((2, 3), f32), "class_weight": np.ones(7, f32),
               "pos_weight": np.ones(7, f32), "targets": np.zeros(T, np.uint8)}
    want = call("torch-dense", {**good_arguments(), **options})
    for ids in (np.int8, np.int16, np.int32, np.int64, np.uint8):
        got = call(entry, {**good_arguments(), **options, "targets": options["targets"].astype(ids)})
        assert_close(got, want, dtype="float32", name=f"{entry} {ids.__name__} ids")


@pytest.mark.parametrize("entry", ENTRIES)
def test_narrow_id_dtypes_with_a_catalog_beyond_their_range(entry):
    """int8 / uint8 / int16 ids with V = 40,000: never compared with a V wrapped to their width."""
    rng = np.random.default_rng(4)
    arguments = {"hidden": rng.normal(size=(3, 4)).astype(f32), "item_weight": rng.normal(size=(40_000, 4)).astype(f32)}
    targets = np.array([[1, 127], [5, 0], [100, 100]])

    def rows_and_counts(ids):  # a lost positive moves its row's FN count by 1
        loss, counts = call(entry, {**arguments, "targets": ids, "reduction": "none", "return_metrics": True})
        return {"loss": loss, **dict(zip(("tp", "fp", "fn", "tn"), counts))}

    want = rows_and_counts(targets)
    for ids in (np.int8, np.uint8, np.int16, np.int32):
        assert_close(rows_and_counts(targets.astype(ids)), want, dtype="float32", name=f"{entry} {ids.__name__} ids")


@pytest.mark.parametrize("entry", entries([e for e in ENTRY_NAMES if e != "jax-dense"]))
def test_block_v_takes_numpy_integers(entry):
    want = call(entry, {**good_arguments(), "block_v": 3})
    assert_close(call(entry, {**good_arguments(), "block_v": np.int64(3)}), want, dtype="float32", name=entry)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("lead_shape", [(0,), (2, 0)])
def test_zero_positions(entry, reduction, lead_shape):
    """N = 0: as BCEWithLogitsLoss on an empty [0, V] tensor: 'mean' is nan, the gradients are zeros."""
    rng = np.random.default_rng(1)
    arguments = {"hidden": np.zeros((*lead_shape, 4), f32), "item_weight": rng.normal(size=(7, 4)).astype(f32),
                 "targets": np.zeros((*lead_shape, 2), np.int64), "bias": rng.normal(size=7).astype(f32),
                 "weight": np.ones(lead_shape, f32), "reduction": reduction}
    out, dtypes = run(entry, arguments, grads=("hidden", "item_weight", "bias", "weight"),
                      upstream=np.zeros(lead_shape) if reduction == "none" else None)
    logits = torch.zeros(0, 7, requires_grad=True)
    expected = torch.nn.BCEWithLogitsLoss(reduction=reduction)(logits, torch.zeros(0, 7))
    assert out["loss"].shape == (lead_shape if reduction == "none" else ())
    np.testing.assert_array_equal(out["loss"], expected.detach().numpy().reshape(out["loss"].shape))
    assert dtypes["loss"] == "float32"
    for name, shape in (("hidden", (*lead_shape, 4)), ("item_weight", (7, 4)), ("bias", (7,)), ("weight", lead_shape)):
        np.testing.assert_array_equal(out[f"d_{name}"], np.zeros(shape), err_msg=f"{entry} d_{name}")


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_zero_hidden_size(entry, reduction):
    """D = 0: z = bias, item_weight still requires grad and gets an empty gradient."""
    rng = np.random.default_rng(2)
    bias = rng.normal(size=7)
    targets = np.array([[0, 3], [-1, -1], [6, 6]])
    arguments = {"hidden": np.zeros((3, 0), f32), "item_weight": np.zeros((7, 0), f32), "targets": targets,
                 "bias": bias.astype(f32), "reduction": reduction}
    upstream = rng.normal(size=3) if reduction == "none" else 1.5
    out, _ = run(entry, arguments, upstream=upstream)
    logits = torch.tensor(np.broadcast_to(bias, (3, 7)).copy(), requires_grad=True)
    elementwise = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, ids_to_multi_hot(torch.tensor(targets), 7, dtype=torch.float64), reduction="none")
    truth = elementwise.sum(-1) if reduction == "none" else elementwise.mean()
    (d_logits,) = torch.autograd.grad(truth, logits, torch.as_tensor(upstream, dtype=torch.float64))
    assert_close(out["loss"], truth.detach().numpy(), dtype="float32", name=f"{entry} loss")
    assert_close(out["d_bias"], d_logits.sum(0).numpy(), dtype="float32", name=f"{entry} d_bias")
    assert out["d_hidden"].shape == (3, 0) and out["d_item_weight"].shape == (7, 0)


def _padding_cases():
    """int64 ids beyond int32: negatives of any size are padding; ids >= 2**32 are >= V, not item id % 2**32."""
    base = np.array([[[0, -1]] * 3] * 2)
    far_padding = base.copy()
    far_padding[0, :, 1] = [-(2**32), -(2**32) + 5, -(2**40)]
    far_padding[1, 0, 1] = -(2**63)
    return base, far_padding


@pytest.mark.parametrize("entry", ENTRIES)
def test_int64_ids_are_checked_before_narrowing(entry):
    base, far_padding = _padding_cases()
    x64_off = enable_x64(False) if HAVE_JAX else contextlib.nullcontext()
    with x64_off:  # JAX would wrap int64 -> int32: -2**32 + 5 -> item 5
        want, _ = run(entry, {**good_arguments(), "targets": base}, grads=("hidden",))
        got, _ = run(entry, {**good_arguments(), "targets": far_padding}, grads=("hidden",))
        assert_close(got, want, dtype="float32", name=entry)
        with pytest.raises(ValueError, match=r"targets holds item id 4294967301, but item_weight has only V=7"):
            call(entry, {**good_arguments(), "targets": base + 2**32 + 5})


@pytest.mark.jax
def test_jax_traced_int64_ids_compare_in_int64():
    """With x64 on, a traced int64 id -2**32 + 5 is padding (not item 5) and 2**32 + 5 is ignored like padding."""
    base, far_padding = _padding_cases()
    far_padding[1, 1, 1] = 2**32 + 5
    with enable_x64(True):  # the session runs with x64 off; int64 arrays exist in JAX only with it on
        arguments = {k: jnp.asarray(v) for k, v in good_arguments().items()}
        fn = jax.jit(jax_kernels.cut_bce, static_argnames=("reduction", "impl"))
        targets = jnp.asarray(far_padding)
        assert targets.dtype == jnp.int64
        got = fn(arguments["hidden"], arguments["item_weight"], targets, reduction="none", impl="blocked")
        want = fn(arguments["hidden"], arguments["item_weight"], jnp.asarray(base), reduction="none", impl="blocked")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("entry", ENTRIES)
def test_bias_of_another_float_dtype(entry):
    """bias (and the weights) may have any accepted float dtype: cast to the compute dtype, as native does."""
    rng = np.random.default_rng(3)
    bias = rng.normal(size=7)
    want, _ = run("torch-native", {**good_arguments(), "bias": bias.astype(f32)})
    arguments = {**good_arguments(), "bias": bias, "weight": np.ones((2, 3))}
    jax_entry = entry.startswith("jax")
    with enable_x64(True) if jax_entry else contextlib.nullcontext():  # a float64 JAX array needs x64
        got, dtypes = run(entry, arguments)
    assert dtypes == {"loss": "float32", "d_hidden": "float32", "d_item_weight": "float32", "d_bias": "float64"}
    assert_close(got, want, dtype="float32", name=entry)
    if jax_entry:  # x64 off (JAX's default): JAX takes the float64 bias as float32, its gradient too
        got, dtypes = run(entry, arguments)
        assert dtypes == {"loss": "float32", "d_hidden": "float32", "d_item_weight": "float32", "d_bias": "float32"}
        assert_close(got, want, dtype="float32", name=f"{entry} x64 off")


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_inputs_give_a_float32_loss_and_half_gradients(entry, dtype):
    arguments = {**good_arguments(), "bias": np.zeros(7, f32)}
    out, dtypes = run(entry, arguments, dtype=dtype)
    assert dtypes == {"loss": "float32", "d_hidden": dtype, "d_item_weight": dtype, "d_bias": dtype}
    want, _ = run("torch-dense", arguments, dtype=dtype)  # float32 logits of the same half inputs
    assert_close(out["loss"], want["loss"], dtype="float32", name=f"{entry} {dtype} loss")


@pytest.mark.jax
def test_jax_ids_at_or_above_V_under_jit_are_padding():
    """Documented: under jit the check would need a host sync, so ids >= V are ignored like padding."""
    arguments = {k: jnp.asarray(v) for k, v in good_arguments().items()}
    bad = arguments["targets"].at[0, 0, 0].set(7).at[1, 2, 1].set(99)
    padded = arguments["targets"].at[0, 0, 0].set(-1).at[1, 2, 1].set(-1)
    fn = jax.jit(jax_kernels.cut_bce, static_argnames=("reduction", "impl"))
    got = fn(arguments["hidden"], arguments["item_weight"], bad, reduction="none", impl="blocked")
    want = fn(arguments["hidden"], arguments["item_weight"], padded, reduction="none", impl="blocked")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
