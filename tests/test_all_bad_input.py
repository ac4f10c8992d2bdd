"""Every bad input gets a correct answer or a clear error, at every public entry point.

The same input runs through `cut_bce_with_logits` (backend 'native' and 'dense'),
`CutBCEWithLogitsLoss`, `jax_kernels.cut_bce` (impl 'blocked') and `jax_kernels.dense_cut_bce`.
Errors are ValueError / TypeError whose message names the argument, shows the shape, dtype or
value it got and says what was expected (the checks are shared, in `jax_kernels/neutral/shapes.py`).
Degenerate but valid inputs (N = 0, D = 0, int64 ids beyond int32, a bias of another float dtype,
half inputs on the dense path) give the answer of torch's BCEWithLogitsLoss on the materialized
logits. Tensors on different devices are left to the torch_xla bridge tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from parity import assert_close, to_numpy
from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits, ids_to_multi_hot

pytestmark = [pytest.mark.rung0, pytest.mark.rung1, pytest.mark.rung2]

# The JAX entries need the [jax] extra. Without jax they carry the `jax` mark and skip (conftest.py)
# while the torch entries run; with jax, any import error below still fails the module.
HAVE_JAX = importlib.util.find_spec("jax") is not None
if HAVE_JAX:
    import jax
    import jax.numpy as jnp

    import jax_kernels
    from parity import enable_x64

ENTRY_NAMES = ("torch-native", "torch-dense", "torch-module", "jax-blocked", "jax-dense")
TORCH_ENTRIES = ENTRY_NAMES[:3]


def entries(names=ENTRY_NAMES):
    """pytest params for `names`, the JAX ones marked `jax`."""
    return [pytest.param(name, marks=pytest.mark.jax) if name.startswith("jax") else name for name in names]


ENTRIES = entries()
POSITIONAL = ("hidden", "item_weight", "targets", "bias")
MODULE_OPTIONS = ("reduction", "pos_weight", "class_weight", "block_v", "backend", "return_metrics")
FUNCTIONS = {
    "torch-native": (cut_bce_with_logits, {"backend": "native"}),
    "torch-dense": (cut_bce_with_logits, {"backend": "dense"}),
}
if HAVE_JAX:
    FUNCTIONS["jax-blocked"] = (jax_kernels.cut_bce, {"impl": "blocked"})
    FUNCTIONS["jax-dense"] = (jax_kernels.dense_cut_bce, {})


# 64-bit dtypes: JAX arrays have them only with x64 on (the session runs with it off, as users do).
WIDE_DTYPES = ("int64", "uint64", "float64", "complex128")


@dataclasses.dataclass(frozen=True)
class Zeros:
    """An array each framework builds itself (numpy has no float8 or bfloat16 that torch takes)."""

    shape: tuple[int, ...]
    dtype: str


def convert(entry, value, dtype=None):
    """numpy -> the entry's framework (JAX entries take numpy as is: they convert it themselves)."""
    torch_side = entry.startswith("torch")
    if isinstance(value, Zeros):
        if torch_side:
            return torch.zeros(value.shape, dtype=getattr(torch, value.dtype))
        if value.dtype in WIDE_DTYPES and not jax.config.jax_enable_x64:
            return np.zeros(value.shape, value.dtype)  # a JAX array cannot hold it with x64 off: numpy can
        return jnp.zeros(value.shape, getattr(jnp, value.dtype))
    if not isinstance(value, np.ndarray):
        return value
    is_float = value.dtype.kind == "f"
    if torch_side:
        t = torch.as_tensor(value)
        return t.to(getattr(torch, dtype)) if dtype and is_float else t
    return jnp.asarray(value, getattr(jnp, dtype)) if dtype and is_float else value


def call(entry, arguments, dtype=None):
    a = {k: convert(entry, v, dtype) for k, v in arguments.items()}
    positional = [a.pop(k, None) for k in POSITIONAL]
    if entry == "torch-module":
        options = {k: a.pop(k) for k in MODULE_OPTIONS if k in a}
        return CutBCEWithLogitsLoss(**options)(*positional, **a)
    fn, defaults = FUNCTIONS[entry]
    return fn(*positional, **{**defaults, **a})


def run(entry, arguments, *, grads=("hidden", "item_weight", "bias"), upstream=None, dtype=None):
    """`(values, dtypes)`: the loss and the gradients `d_<name>` of the arguments in `grads`.

    Values are float64 numpy, dtypes the names of the dtypes the entry returned them in.
    `upstream` is the cotangent of the loss (a scalar or an array of shape S); default 1.5.
    """
    names = [k for k in grads if arguments.get(k) is not None]
    if entry.startswith("torch"):
        diff = {k: convert(entry, arguments[k], dtype).requires_grad_() for k in names}
        loss = call(entry, {**arguments, **diff}, dtype)
        g = torch.as_tensor(1.5 if upstream is None else upstream, dtype=loss.dtype)
        values = torch.autograd.grad(loss, list(diff.values()), grad_outputs=g, allow_unused=True)
    else:
        diff = {k: jnp.asarray(convert(entry, arguments[k], dtype)) for k in names}
        loss, vjp = jax.vjp(lambda d: call(entry, {**arguments, **d}, dtype), diff)
        (cotangents,) = vjp(jnp.asarray(1.5 if upstream is None else upstream, loss.dtype))
        values = [cotangents[k] for k in names]
    out = {"loss": loss, **{f"d_{k}": v for k, v in zip(names, values)}}
    return {k: to_numpy(v) for k, v in out.items()}, {k: str(v.dtype).removeprefix("torch.") for k, v in out.items()}


def good_arguments():
    """S = (2, 3), D = 4, V = 7, L = 2, float32."""
    rng = np.random.default_rng(0)
    return {
        "hidden": rng.normal(size=(2, 3, 4)).astype(np.float32),
        "item_weight": rng.normal(size=(7, 4)).astype(np.float32),
        "targets": rng.integers(-1, 7, size=(2, 3, 2)),
    }


f32 = np.float32
T = (2, 3, 2)  # the shape of targets
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
