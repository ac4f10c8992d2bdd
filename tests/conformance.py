"""The conformance suite: every check of an engine written once, run for every engine and `Loss`.

`EngineConformance` holds the checks; each engine is a subclass that names it (`engine`, a key of
`ENGINES`) and may narrow the dtypes, reductions and `Loss` values it runs (a slow engine runs
fewer). Subclasses live in `test_conformance_torch.py` and `test_conformance_jax.py`, so a new
engine inherits every check by adding one class, and a new `Loss` value by adding one entry to
`LOSSES`. The checks:

- the float64 oracle of the engine's framework (loss, every gradient, metrics; a random
  non-uniform upstream; odd shapes, padding, duplicates, ids past V, large logits: `parity`);
- confident rows row by row (`exact_rows_cases`), and rows of logits in the hundreds;
- zero logits against the closed form of every Loss;
- a plain `Loss` given as options (gamma 0, smoothing 0) runs the plain code bit for bit;
- a bad `label_smoothing` is a clear error at the entry.

The engines that need a process of their own (the JAX mesh, torch.distributed) run the same
Loss values in their own files (`test_jax_sharded.py`, `test_torch_sharded.py`,
`test_torch_dtensor.py`); Pallas compiled for TPU: `test_jax_pallas_tpu_compile.py`.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

import exact_rows_cases
from cutbce_common.focal import Focal
from cutbce_common.loss import PLAIN, Loss
from parity import GRADS, OPTIONAL, assert_close, make_inputs, make_upstream, run_jax, run_torch, select

LEAD, V, D, L = (3, 7), 203, 16, 4  # N = 21; V a multiple of neither tile
BLOCK_V = 64
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (a JAX-only install)")
FRAMEWORK_MARKS = {"jax": pytest.mark.jax, "xla": pytest.mark.xla, "torch": NEEDS_TORCH}

# engine -> (framework, its parity rung (`pytest -m rung2`: the Pallas cases), the entry's options)
ENGINES = {
    "torch-native": ("torch", pytest.mark.rung1, dict(backend="native", block_v=BLOCK_V)),
    "torch-dense": ("torch", pytest.mark.rung0, dict(backend="dense")),
    "xla-blocked": ("xla", pytest.mark.rung3, dict(backend="xla_blocked", block_v=BLOCK_V)),
    "xla-pallas": ("xla", pytest.mark.rung3, dict(backend="xla_pallas", block_v=BLOCK_V)),
    "jax-blocked": ("jax", pytest.mark.rung1, dict(impl="blocked", block_v=BLOCK_V)),
    "jax-pallas": ("jax", pytest.mark.rung2, dict(impl="pallas")),  # 128 x 128 tiles (`_engine_options`)
}

# Every Loss value the suite runs, by test id: plain, focal (integer and fractional gamma, class
# balancing), label smoothing alone, with focal, and at its end point 1 (every target 1/2).
LOSSES = {
    "plain": Loss(),
    "focal2": Loss(Focal(2.0)),
    "focal0.5-balanced": Loss(Focal(0.5, 0.25, True)),
    "smoothing0.1": Loss(label_smoothing=0.1),
    "smoothing0.2-focal1.5-balanced": Loss(Focal(1.5, 0.3, True), 0.2),
    "smoothing1-focal3": Loss(Focal(3.0), 1.0),
}


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


def run(engine, inputs, *, dtype, upstream, loss=PLAIN, overrides=None, grad_names=GRADS, return_metrics=True,
        **kwargs):
    """`engine` on numpy `inputs` (`parity.run_torch` / `run_jax`): loss, d_<name>, metrics.

    `loss` goes to the entry as its arguments, `kwargs` too (reduction); `overrides` replace
    `ENGINES`' options. JAX's blocked loop runs jitted with x64 off for float32 / bfloat16 (as users
    run it), eagerly with x64 on for float64 (`run_jax`); XLA tensors live on `torch_xla.device()`.
    """
    framework, options = ENGINES[engine][0], _engine_options(engine, overrides or {})
    adapter = dict(dtype=dtype, upstream=upstream, grad_names=grad_names, return_metrics=return_metrics)
    kwargs = {**loss.arguments(), **kwargs}
    if framework == "jax":
        import jax_kernels

        if engine == "jax-blocked" and dtype != "float64":
            jitted = _jitted(jax_kernels.cut_bce, **options, **kwargs, return_metrics=return_metrics)
            return run_jax(jitted, inputs, **adapter)
        return run_jax(jax_kernels.cut_bce, inputs, **adapter, **options, **kwargs)
    from torch_cutbce import cut_bce_with_logits

    device = pytest.importorskip("torch_xla").device() if framework == "xla" else "cpu"
    return run_torch(cut_bce_with_logits, inputs, **adapter, device=device, **options, **kwargs)


def oracle(engine, inputs, *, upstream, loss=PLAIN, **kwargs):
    """`engine`'s framework's dense oracle in float64 (the bridge's is torch's)."""
    kwargs = {**loss.arguments(), **kwargs}
    if ENGINES[engine][0] == "jax":
        from jax_kernels.reference import dense_cut_bce

        return run_jax(dense_cut_bce, inputs, dtype="float64", upstream=upstream, **kwargs)
    from torch_cutbce import dense_bce_with_logits

    return run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, **kwargs)


def same_dtype_dense(engine, inputs, *, dtype, upstream, loss, **kwargs):
    """The dense oracle run in `dtype` (bfloat16's yardstick: CCE's rule)."""
    import jax.numpy as jnp
    from jax_kernels.reference import dense_cut_bce

    return run_jax(dense_cut_bce, inputs, dtype=dtype, upstream=upstream, compute_dtype=jnp.dtype(dtype),
                   **loss.arguments(), **kwargs)


def inputs_for(seed, dtype="float32", options=OPTIONAL, **kwargs):
    return select(make_inputs(LEAD, V, D, L, seed=seed, **kwargs), options, dtype)


def closed_form_at_zero_logits(loss: Loss, num_items: int, positives: np.ndarray) -> np.ndarray:
    """Each row's loss when every logit is 0 (sigmoid = 1/2, softplus = ln 2 on both branches):
    every element is `scale (1/2)^gamma ln 2`, with each branch's scale (`Loss.numbers()`)."""
    numbers = loss.numbers()
    element = 0.5**numbers.gamma * math.log(2)
    return element * (positives * numbers.positive_scale + (num_items - positives) * numbers.negative_scale)


class EngineConformance:
    """The checks every engine meets (module docstring). Subclass, name `engine`, narrow as needed."""

    engine: str
    dtypes: tuple[str, ...] = ("float32",)
    reductions: tuple[str, ...] = ("none", "mean", "sum")
    losses: tuple[str, ...] = tuple(LOSSES)
    row_losses: tuple[str, ...] = ("focal0.5-balanced", "smoothing0.1", "smoothing0.2-focal1.5-balanced")

    def pytest_generate_tests(self, metafunc):
        """Each check over this engine's share of the matrix (`dtypes`, `reductions`, `losses`)."""
        if "loss_id" in metafunc.fixturenames:
            ids = self.row_losses if "_rows_" in metafunc.function.__name__ else self.losses
            metafunc.parametrize("loss_id", ids)
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes)
        if "reduction" in metafunc.fixturenames:
            metafunc.parametrize("reduction", self.reductions)

    @pytest.fixture(autouse=True)
    def _needs(self):
        framework = ENGINES[self.engine][0]
        if framework in ("jax", "xla"):
            pytest.importorskip("jax")
        if framework == "xla":
            pytest.importorskip("torch_xla")
        if framework in ("torch", "xla"):
            pytest.importorskip("torch")

    def test_matches_the_float64_oracle(self, loss_id, dtype, reduction):
        """Loss, every gradient and the metrics within the dtype's tolerance of the oracle, for a
        random non-uniform upstream. bfloat16 follows CCE's rule: no further from the truth than
        the dense reference run in bfloat16, + 2e-3."""
        loss = LOSSES[loss_id]
        seed = sorted(LOSSES).index(loss_id)
        inputs = inputs_for(seed, dtype)
        upstream = make_upstream(reduction, LEAD, seed=seed, dtype=dtype)
        common = dict(upstream=upstream, reduction=reduction, loss=loss)
        truth = oracle(self.engine, inputs, **common)
        fast = run(self.engine, inputs, dtype=dtype, **common)
        name = f"{self.engine} {dtype} {loss_id} {reduction}"
        if dtype == "bfloat16":
            assert_close(fast, same_dtype_dense(self.engine, inputs, dtype=dtype, **common), truth, dtype=dtype,
                         name=name)
        else:
            assert_close(fast, truth, dtype=dtype, name=name)

    def test_confident_rows_row_by_row(self, loss_id):
        """A positive at z = 5 .. 100 among negatives at -10, and single-item rows at +-31: each
        float32 row within 1e-5 of its own float64 truth, never below zero; gradients within 1e-5
        of the largest."""
        loss = LOSSES[loss_id]
        for name, case in exact_rows_cases.cases().items():
            inputs = {k: case[k] for k in ("hidden", "item_weight", "targets", "pos_weight") if case[k] is not None}
            common = dict(upstream=case["g"], reduction="none", loss=loss, grad_names=("hidden", "item_weight"),
                          return_metrics=False)
            truth = oracle(self.engine, inputs, **common)
            fast = run(self.engine, inputs, dtype="float32", overrides=self.small_tiles(), **common)
            rows, truth_rows = fast.pop("loss"), truth.pop("loss")
            exact_rows_cases.check_rows(f"{self.engine}:{name}:{loss_id}", rows, truth_rows, "float32")
            exact_rows_cases.check_grads(f"{self.engine}:{name}:{loss_id}", fast, truth, "float32")

    def test_large_logit_rows_row_by_row(self, loss_id):
        """Logits in the hundreds (hidden scaled by 8, one row by 64) with bias: each row within
        float32's tolerance of the float64 truth on its own, never below zero (smoothing's c |z|
        and the focal factor meet no cancellation)."""
        inputs = inputs_for(3, "float32", options=("bias",), scale=8.0)
        inputs["hidden"][0, 2] *= 8  # a power of two: still representable in the dtype
        common = dict(upstream=np.zeros(LEAD), reduction="none", loss=LOSSES[loss_id], grad_names=(),
                      return_metrics=False)
        rows = run(self.engine, inputs, dtype="float32", **common)["loss"]
        truth = oracle(self.engine, inputs, **common)["loss"]
        assert_close(rows, truth, dtype="float32", name=f"{self.engine} {loss_id} rows", elementwise=True)
        assert (np.asarray(rows) >= 0).all()

    def test_zero_logit_rows_give_the_closed_form(self, loss_id):
        """z = 0 everywhere: rows of one positive, one duplicated, none (`closed_form_at_zero_logits`)."""
        n, v = 5, 40
        targets = np.full((n, 2), -1)
        targets[1:, 0] = np.arange(1, n) * 7  # row 0: no positive
        targets[1, 1] = targets[1, 0]  # a duplicate counts once
        inputs = {"hidden": np.zeros((n, 4)), "item_weight": np.zeros((v, 4)), "targets": targets}
        loss = LOSSES[loss_id]
        rows = run(self.engine, inputs, dtype="float32", upstream=np.zeros(n), reduction="none", loss=loss,
                   grad_names=(), return_metrics=False)["loss"]
        want = closed_form_at_zero_logits(loss, v, np.minimum(np.arange(n), 1))
        assert_close(rows, want, dtype="float32", name=f"{self.engine} {loss_id} zero logits", elementwise=True)

    def test_plain_loss_options_run_the_plain_code_bit_for_bit(self):
        """`Focal(gamma=0)` without balancing and `label_smoothing=0` are plain BCE, bit for bit."""
        inputs = inputs_for(5)
        common = dict(dtype="float32", upstream=make_upstream("none", LEAD, seed=5, dtype="float32"),
                      reduction="none")
        plain = run(self.engine, inputs, **common)
        options = run(self.engine, inputs, focal=Focal(0.0, 0.9), label_smoothing=0.0, **common)
        for key in plain:
            np.testing.assert_array_equal(options[key], plain[key], err_msg=key)

    @pytest.mark.parametrize("bad,error,match", [
        (-0.1, ValueError, r"label_smoothing must be in \[0, 1\]"),
        (1.5, ValueError, r"label_smoothing must be in \[0, 1\]"),
        (1e-40, ValueError, "label_smoothing must be 0 or at least"),
        (float("nan"), TypeError, "label_smoothing must be a finite float"),
        ("0.1", TypeError, "label_smoothing must be a finite float"),
        (True, TypeError, "label_smoothing must be a finite float"),
    ])
    def test_a_bad_label_smoothing_is_a_clear_error(self, bad, error, match):
        inputs = inputs_for(0, options=())
        with pytest.raises(error, match=match):
            run(self.engine, inputs, dtype="float32", upstream=np.zeros(LEAD), reduction="none",
                label_smoothing=bad, grad_names=(), return_metrics=False)

    def small_tiles(self) -> dict:
        """Options that make the confident rows' V of 16-ish span several tiles, where the engine
        takes a tile width."""
        return dict(block_v=16) if "block_v" in ENGINES[self.engine][2] else {}


def marks(engine: str) -> list:
    """An engine class's `pytestmark`: its framework's (skips where it is missing) and its rung."""
    framework, rung, _ = ENGINES[engine]
    return [FRAMEWORK_MARKS[framework], rung]
