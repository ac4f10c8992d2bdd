"""Bad and degenerate-but-valid input at an entry: `BadInputChecks`, a check family of the conformance
suite (`conformance.py`). An entry is called as in `_bad_input_entries` (its name is the engine's).

- Every case of docs/precision.md's bad-input table (`CASES`) is a ValueError / TypeError whose
  message names the argument, shows the shape, dtype or value it got and says what was expected
  (the checks are shared, in `cutbce_common/shapes.py`). Tensors on different devices: the torch_xla
  bridge's tests.
- Degenerate but valid input gives the answer of torch's BCEWithLogitsLoss on the materialized
  logits: N = 0, D = 0, every accepted id dtype (narrow ones with a catalog beyond their range),
  int64 ids beyond int32, a bias of another float dtype, half inputs.
- Checks of one entry or a few (`ENTRY_CHECKS`: non-tensors, numpy block_v, the module's options,
  JAX array-likes, ids under jit, Pallas and Triton refusing float64, ...) run only in the classes that name them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from _bad_input_entries import T, Zeros, call, f32, good_arguments, is_torch, run
from conformance_engines import ENGINES
from parity import assert_close, enable_x64, needs_torch

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
UNTILED_CASES = tuple(name for name, (changes, _, _) in CASES.items() if "block_v" not in changes)

# The checks that not every entry meets; a class runs those it names in `bad_input_entry_checks`.
ENTRY_CHECKS = (
    "test_torch_rejects_non_tensors", "test_block_v_takes_numpy_integers", "test_unknown_backend",
    "test_torch_constant_weights_must_not_require_grad", "test_torch_double_backward_of_rows_raises",
    "test_torch_xla_backend_needs_xla_tensors", "test_module_checks_its_options_when_built",
    "test_jax_accepts_array_likes", "test_jax_traced_int64_ids_compare_in_int64",
    "test_jax_ids_at_or_above_V_under_jit_are_padding", "test_pallas_refuses_float64", "test_kernel_engine_refuses_float64",
    "test_torch_special_rows_are_never_read",
)


class BadInputChecks:
    """The bad-input family. Narrow with `bad_input_cases` (test_bad_argument's; the dense JAX
    reference has no block_v: `UNTILED_CASES`), `bad_input_every_entry` (False: only the entry checks)
    and `bad_input_entry_checks` (names from `ENTRY_CHECKS`)."""

    engine: str
    bad_input_cases: tuple[str, ...] = tuple(CASES)
    bad_input_every_entry: bool = True
    bad_input_entry_checks: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        """Sets each check the class does not run to None (pytest collects no test that is None): an
        entry's own check runs in no other class, and leaves no skip there. A check the class runs
        and defines itself (calling the family's through `super()`) is kept."""
        super().__init_subclass__(**kwargs)
        unknown = set(cls.bad_input_entry_checks) - set(ENTRY_CHECKS)
        if unknown:
            raise TypeError(f"{cls.__name__}.bad_input_entry_checks names no check of ENTRY_CHECKS: {sorted(unknown)}")
        checks = [name for name in vars(BadInputChecks) if name.startswith("test_")]
        for name in checks:
            runs = name in cls.bad_input_entry_checks if name in ENTRY_CHECKS else cls.bad_input_every_entry
            if not (runs and name in vars(cls)):
                setattr(cls, name, vars(BadInputChecks)[name] if runs else None)

    def parametrize(self, metafunc):
        if "bad_input_case" in metafunc.fixturenames:
            metafunc.parametrize("bad_input_case", self.bad_input_cases)

    # -- every entry: errors -----------------------------------------------------------------------

    def test_bad_argument(self, bad_input_case):
        changes, error, match = CASES[bad_input_case]
        with pytest.raises(error, match=match):
            call(self.engine, {**good_arguments(), **changes})

    # -- every entry: degenerate but valid input ---------------------------------------------------

    @needs_torch
    def test_good_arguments_pass(self):
        options = {"bias": np.zeros(7, f32), "weight": np.ones((2, 3), f32), "class_weight": np.ones(7, f32),
                   "pos_weight": np.ones(7, f32), "targets": np.zeros(T, np.uint8)}
        want = call("torch-dense", {**good_arguments(), **options})
        for ids in (np.int8, np.int16, np.int32, np.int64, np.uint8):
            got = call(self.engine, {**good_arguments(), **options, "targets": options["targets"].astype(ids)})
            assert_close(got, want, dtype="float32", name=f"{self.engine} {ids.__name__} ids")

    def test_narrow_id_dtypes_with_a_catalog_beyond_their_range(self):
        """int8 / uint8 / int16 ids with V = 40,000: never compared with a V wrapped to their width."""
        rng = np.random.default_rng(4)
        arguments = {"hidden": rng.normal(size=(3, 4)).astype(f32),
                     "item_weight": rng.normal(size=(40_000, 4)).astype(f32)}
        targets = np.array([[1, 127], [5, 0], [100, 100]])

        def rows_and_counts(ids):  # a lost positive moves its row's FN count by 1
            loss, counts = call(self.engine, {**arguments, "targets": ids, "reduction": "none", "return_metrics": True})
            return {"loss": loss, **dict(zip(("tp", "fp", "fn", "tn"), counts))}

        want = rows_and_counts(targets)
        for ids in (np.int8, np.uint8, np.int16, np.int32):
            assert_close(rows_and_counts(targets.astype(ids)), want, dtype="float32",
                         name=f"{self.engine} {ids.__name__} ids")

    @needs_torch
    @pytest.mark.parametrize("bad_input_reduction", ["none", "sum", "mean"])
    @pytest.mark.parametrize("lead_shape", [(0,), (2, 0)])
    def test_zero_positions(self, bad_input_reduction, lead_shape):
        """N = 0: as BCEWithLogitsLoss on an empty [0, V] tensor: 'mean' is nan, the gradients are zeros."""
        import torch

        rng = np.random.default_rng(1)
        arguments = {"hidden": np.zeros((*lead_shape, 4), f32), "item_weight": rng.normal(size=(7, 4)).astype(f32),
                     "targets": np.zeros((*lead_shape, 2), np.int64), "bias": rng.normal(size=7).astype(f32),
                     "weight": np.ones(lead_shape, f32), "reduction": bad_input_reduction}
        out, dtypes = run(self.engine, arguments, grads=("hidden", "item_weight", "bias", "weight"),
                          upstream=np.zeros(lead_shape) if bad_input_reduction == "none" else None)
        expected = torch.nn.BCEWithLogitsLoss(reduction=bad_input_reduction)(torch.zeros(0, 7), torch.zeros(0, 7))
        assert out["loss"].shape == (lead_shape if bad_input_reduction == "none" else ())
        np.testing.assert_array_equal(out["loss"], expected.numpy().reshape(out["loss"].shape))
        assert dtypes["loss"] == "float32"
        for name, shape in (("hidden", (*lead_shape, 4)), ("item_weight", (7, 4)), ("bias", (7,)),
                            ("weight", lead_shape)):
            np.testing.assert_array_equal(out[f"d_{name}"], np.zeros(shape), err_msg=f"{self.engine} d_{name}")

    @needs_torch
    @pytest.mark.parametrize("bad_input_reduction", ["none", "mean"])
    def test_zero_hidden_size(self, bad_input_reduction):
        """D = 0: z = bias, item_weight still requires grad and gets an empty gradient."""
        import torch

        from torch_cutbce import ids_to_multi_hot

        rng = np.random.default_rng(2)
        bias = rng.normal(size=7)
        targets = np.array([[0, 3], [-1, -1], [6, 6]])
        arguments = {"hidden": np.zeros((3, 0), f32), "item_weight": np.zeros((7, 0), f32), "targets": targets,
                     "bias": bias.astype(f32), "reduction": bad_input_reduction}
        upstream = rng.normal(size=3) if bad_input_reduction == "none" else 1.5
        out, _ = run(self.engine, arguments, upstream=upstream)
        logits = torch.tensor(np.broadcast_to(bias, (3, 7)).copy(), requires_grad=True)
        elementwise = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, ids_to_multi_hot(torch.tensor(targets), 7, dtype=torch.float64), reduction="none")
        truth = elementwise.sum(-1) if bad_input_reduction == "none" else elementwise.mean()
        (d_logits,) = torch.autograd.grad(truth, logits, torch.as_tensor(upstream, dtype=torch.float64))
        assert_close(out["loss"], truth.detach().numpy(), dtype="float32", name=f"{self.engine} loss")
        assert_close(out["d_bias"], d_logits.sum(0).numpy(), dtype="float32", name=f"{self.engine} d_bias")
        assert out["d_hidden"].shape == (3, 0) and out["d_item_weight"].shape == (7, 0)

    def test_int64_ids_are_checked_before_narrowing(self):
        base, far_padding = _padding_cases()
        x64_off = contextlib.nullcontext() if is_torch(self.engine) else enable_x64(False)
        with x64_off:  # JAX would wrap int64 -> int32: -2**32 + 5 -> item 5
            want, _ = run(self.engine, {**good_arguments(), "targets": base}, grads=("hidden",))
            got, _ = run(self.engine, {**good_arguments(), "targets": far_padding}, grads=("hidden",))
            assert_close(got, want, dtype="float32", name=self.engine)
            with pytest.raises(ValueError, match=r"targets holds item id 4294967301, but item_weight has only V=7"):
                call(self.engine, {**good_arguments(), "targets": base + 2**32 + 5})

    @needs_torch
    def test_bias_of_another_float_dtype(self):
        """bias (and the weights) may have any accepted float dtype: cast to the compute dtype, as native does."""
        bias = np.random.default_rng(3).normal(size=7)
        want, _ = run("torch-native", {**good_arguments(), "bias": bias.astype(f32)})
        arguments = {**good_arguments(), "bias": bias, "weight": np.ones((2, 3))}
        jax_entry = not is_torch(self.engine)
        with enable_x64(True) if jax_entry else contextlib.nullcontext():  # a float64 JAX array needs x64
            got, dtypes = run(self.engine, arguments)
        assert dtypes == {"loss": "float32", "d_hidden": "float32", "d_item_weight": "float32", "d_bias": "float64"}
        assert_close(got, want, dtype="float32", name=self.engine)
        if jax_entry:  # x64 off (JAX's default): JAX takes the float64 bias as float32, its gradient too
            got, dtypes = run(self.engine, arguments)
            assert dtypes == {"loss": "float32", "d_hidden": "float32", "d_item_weight": "float32", "d_bias": "float32"}
            assert_close(got, want, dtype="float32", name=f"{self.engine} x64 off")

    @needs_torch
    @pytest.mark.parametrize("bad_input_half", ["bfloat16", "float16"])
    def test_half_inputs_give_a_float32_loss_and_half_gradients(self, bad_input_half):
        arguments = {**good_arguments(), "bias": np.zeros(7, f32)}
        out, dtypes = run(self.engine, arguments, dtype=bad_input_half)
        assert dtypes == {"loss": "float32", "d_hidden": bad_input_half, "d_item_weight": bad_input_half,
                          "d_bias": bad_input_half}
        want, _ = run("torch-dense", arguments, dtype=bad_input_half)  # float32 logits of the same half inputs
        assert_close(out["loss"], want["loss"], dtype="float32", name=f"{self.engine} {bad_input_half} loss")

    # -- entries that take tensors (torch) or tiles (block_v) --------------------------------------

    @pytest.mark.parametrize("bad_input_argument", ["hidden", "item_weight", "targets", "bias", "weight"])
    def test_torch_rejects_non_tensors(self, bad_input_argument):
        arguments = {**good_arguments(), "bias": np.zeros(7, f32), "weight": np.ones((2, 3), f32)}
        with pytest.raises(TypeError, match=rf"{bad_input_argument} must be a torch.Tensor, got list"):
            call(self.engine, {**arguments, bad_input_argument: arguments[bad_input_argument].tolist()})

    def test_block_v_takes_numpy_integers(self):
        want = call(self.engine, {**good_arguments(), "block_v": 3})
        got = call(self.engine, {**good_arguments(), "block_v": np.int64(3)})
        assert_close(got, want, dtype="float32", name=self.engine)

    def test_unknown_backend(self):
        """The option that picks the engine: torch's `backend`, JAX's `impl`."""
        name = "backend" if is_torch(self.engine) else "impl"
        with pytest.raises(ValueError, match=rf"{name} must be one of .*got 'fast'"):
            call(self.engine, {**good_arguments(), name: "fast"})

    @pytest.mark.parametrize("bad_input_argument", ["class_weight", "pos_weight"])
    def test_torch_constant_weights_must_not_require_grad(self, bad_input_argument):
        import torch

        with pytest.raises(ValueError, match=rf"{bad_input_argument} requires grad.*pass {bad_input_argument}.detach\(\)"):
            call(self.engine, {**good_arguments(), bad_input_argument: torch.ones(7, requires_grad=True)})

    def test_torch_special_rows_are_never_read(self):
        """Round 7: special rows inside the table (class weight 0) holding inf or NaN, or a +inf bias,
        made the loss NaN (0 x inf). Loss and gradients equal those of finite special rows, bit for
        bit, and the special rows' gradients are exactly 0."""
        import torch

        from torch_cutbce import SpecialRows

        rng = np.random.default_rng(5)
        table, bias = rng.normal(size=(9, 4)).astype(f32), rng.normal(size=9).astype(f32)
        arguments = {**good_arguments(), "targets": rng.integers(-1, 9, size=T), "special_rows": SpecialRows([0, 4, 6])}
        poisoned_table, poisoned_bias = table.copy(), bias.copy()
        poisoned_table[[0, 4, 6]] = [[np.inf] * 4, [np.nan] * 4, [np.inf, -np.inf, 0, 1]]
        poisoned_bias[[0, 4, 6]] = np.inf
        want, _ = run(self.engine, {**arguments, "item_weight": table, "bias": bias})
        got, _ = run(self.engine, {**arguments, "item_weight": poisoned_table, "bias": poisoned_bias})
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{self.engine} {name}")
        assert not got["d_item_weight"][[0, 4, 6]].any() and not got["d_bias"][[0, 4, 6]].any()
        assert torch.isfinite(torch.as_tensor(got["loss"])).all()

    # -- one entry ---------------------------------------------------------------------------------

    def test_torch_double_backward_of_rows_raises(self):
        import torch

        hidden = torch.tensor(good_arguments()["hidden"], requires_grad=True)
        rows = call(self.engine, {**good_arguments(), "hidden": hidden, "reduction": "none"})
        with pytest.raises(RuntimeError, match="twice differentiable"):  # when asked for a graph, or when used
            (d_hidden,) = torch.autograd.grad(rows, hidden, torch.randn(2, 3), create_graph=True)
            d_hidden.square().sum().backward()

    def test_torch_xla_backend_needs_xla_tensors(self):
        with pytest.raises(ValueError, match=r"backend='xla_blocked' needs tensors on an XLA device"):
            call(self.engine, {**good_arguments(), "backend": "xla_blocked"})

    def test_module_checks_its_options_when_built(self):
        from torch_cutbce import CutBCEWithLogitsLoss

        with pytest.raises(ValueError, match=r"reduction must be one of .*got 'avg'"):
            CutBCEWithLogitsLoss(reduction="avg")
        with pytest.raises(ValueError, match=r"backend must be one of .*got 'fast'"):
            CutBCEWithLogitsLoss(backend="fast")
        with pytest.raises(TypeError, match=r"block_v must be a positive int or None, got True of type bool"):
            CutBCEWithLogitsLoss(block_v=True)

    def test_jax_accepts_array_likes(self):
        """Lists and numpy arrays go through jnp.asarray (ids checked first); a non-array is a TypeError."""
        import jax.numpy as jnp

        arguments = good_arguments()
        want = call(self.engine, {k: jnp.asarray(v) for k, v in arguments.items()})
        lists = {k: v.tolist() for k, v in arguments.items()}
        got = call(self.engine, {**lists, "weight": np.ones((2, 3), f32).tolist()})
        assert_close(got, want, dtype="float32", name=self.engine)
        with pytest.raises(TypeError, match=r"hidden must be an array \(jax.Array, numpy array or nested list"):
            call(self.engine, {**arguments, "hidden": "hidden"})
        with pytest.raises(TypeError, match=r"targets must be an integer array .* got list"):
            call(self.engine, {**arguments, "targets": [[[0, 1], [2]]]})

    def test_jax_traced_int64_ids_compare_in_int64(self):
        """With x64 on, a traced int64 id -2**32 + 5 is padding (not item 5) and 2**32 + 5 is ignored like padding."""
        import jax.numpy as jnp

        base, far_padding = _padding_cases()
        far_padding[1, 1, 1] = 2**32 + 5
        with enable_x64(True):  # the session runs with x64 off; int64 arrays exist in JAX only with it on
            targets = jnp.asarray(far_padding)
            assert targets.dtype == jnp.int64
            got = _jitted_rows(self.engine, targets)
            want = _jitted_rows(self.engine, jnp.asarray(base))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def test_jax_ids_at_or_above_V_under_jit_are_padding(self):
        """Documented: under jit the check would need a host sync, so ids >= V are ignored like padding."""
        import jax.numpy as jnp

        targets = jnp.asarray(good_arguments()["targets"])
        bad = targets.at[0, 0, 0].set(7).at[1, 2, 1].set(99)
        padded = targets.at[0, 0, 0].set(-1).at[1, 2, 1].set(-1)
        np.testing.assert_array_equal(np.asarray(_jitted_rows(self.engine, bad)),
                                      np.asarray(_jitted_rows(self.engine, padded)))

    def test_pallas_refuses_float64(self):
        arguments = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in good_arguments().items()}
        # x64 on: without it JAX itself turns the float64 inputs into float32, which Pallas takes.
        with enable_x64(True), pytest.raises(
                TypeError, match=r"impl='pallas' supports float32 and bfloat16 inputs, got float64"):
            call(self.engine, arguments)

    def test_kernel_engine_refuses_float64(self):
        """An engine whose kernels compute in float32 (Triton's, the chunked one's) names itself."""
        backend = ENGINES[self.engine][2]["backend"]
        arguments = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in good_arguments().items()}
        with pytest.raises(ValueError, match=rf"backend='{backend}' computes in float32, bfloat16, float16, got "
                                             r"hidden.dtype=torch.float64; backend='native' takes any float dtype"):
            call(self.engine, arguments)


def _padding_cases():
    """int64 ids beyond int32: negatives of any size are padding; ids >= 2**32 are >= V, not item id % 2**32."""
    base = np.array([[[0, -1]] * 3] * 2)
    far_padding = base.copy()
    far_padding[0, :, 1] = [-(2**32), -(2**32) + 5, -(2**40)]
    far_padding[1, 0, 1] = -(2**63)
    return base, far_padding


def _jitted_rows(engine, targets):
    """The rows of the JAX `engine` (`cut_bce`'s impl) under jit, on `good_arguments` with `targets`."""
    import jax
    import jax.numpy as jnp

    import jax_kernels

    arguments = good_arguments()
    fn = jax.jit(jax_kernels.cut_bce, static_argnames=("reduction", "impl"))
    return fn(jnp.asarray(arguments["hidden"]), jnp.asarray(arguments["item_weight"]), targets, reduction="none",
              impl=engine.removeprefix("jax-"))
