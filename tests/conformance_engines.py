"""The conformance suite's engines and how to run them: `ENGINES` (name -> framework, parity rung, the
entry's options), `LOSSES` (every `Loss` value the suite runs), `run` / `oracle` (an engine and its
framework's float64 oracle on numpy inputs) and `marks` (an engine class's `pytestmark`). The checks
are in the `conformance_*.py` families; `conformance.py` joins them into `EngineConformance`.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

from cutbce_common.focal import Focal
from cutbce_common.loss import PLAIN, Loss
from parity import GRADS, OPTIONAL, make_inputs, run_jax, run_torch, select

LEAD, V, D, L = (3, 7), 203, 16, 4  # N = 21; V a multiple of neither tile
BLOCK_V = 64
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (a JAX-only install)")
FRAMEWORK_MARKS = {"jax": pytest.mark.jax, "xla": pytest.mark.xla, "torch": NEEDS_TORCH}

# engine -> (framework, its parity rung (`pytest -m rung2`: the Pallas cases), the entry's options)
ENGINES = {
    "torch-native": ("torch", pytest.mark.rung1, dict(backend="native", block_v=BLOCK_V)),
    "torch-dense": ("torch", pytest.mark.rung0, dict(backend="dense")),
    # The Triton kernels in Triton's interpreter (CPU tensors; TRITON_INTERPRET=1 in a process of its
    # own: test_conformance_triton.py). Their tiles are the kernels' own: block_v is not theirs.
    "torch-triton": ("torch", pytest.mark.rung2, dict(backend="triton")),
    # The chunked engine (library matmuls around one Triton elementwise kernel, in the interpreter on
    # CPU tensors: test_conformance_chunked.py); block_v 64: four chunks of V = 203, the last ragged.
    "torch-chunked": ("torch", pytest.mark.rung2, dict(backend="chunked", block_v=BLOCK_V)),
    "xla-blocked": ("xla", pytest.mark.rung3, dict(backend="xla_blocked", block_v=BLOCK_V)),
    "xla-pallas": ("xla", pytest.mark.rung3, dict(backend="xla_pallas", block_v=BLOCK_V)),
    "jax-blocked": ("jax", pytest.mark.rung1, dict(impl="blocked", block_v=BLOCK_V)),
    "jax-pallas": ("jax", pytest.mark.rung2, dict(impl="pallas")),  # 128 x 128 tiles (`_engine_options`)
    # Entries that are no engine of their own: the module (the native engine behind it) and the dense
    # JAX reference; they run the families that check an entry (bad input, options).
    "torch-module": ("torch", pytest.mark.rung1, dict(backend="native", block_v=BLOCK_V)),
    "jax-dense": ("jax", pytest.mark.rung0, {}),
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

        entry = jax_kernels.dense_cut_bce if engine == "jax-dense" else jax_kernels.cut_bce
        if engine == "jax-blocked" and dtype != "float64":
            jitted = _jitted(entry, **options, **kwargs, return_metrics=return_metrics)
            return run_jax(jitted, inputs, **adapter)
        return run_jax(entry, inputs, **adapter, **options, **kwargs)
    from torch_cutbce import cut_bce_with_logits

    device = pytest.importorskip("torch_xla").device() if framework == "xla" else "cpu"
    entry = _module_call if engine == "torch-module" else cut_bce_with_logits
    return run_torch(entry, inputs, **adapter, device=device, **options, **kwargs)


def _module_call(hidden, item_weight, targets, bias, *, weight, class_weight, pos_weight, **options):
    """`CutBCEWithLogitsLoss(**options)` built and called, in `cut_bce_with_logits`' convention."""
    from torch_cutbce import CutBCEWithLogitsLoss

    module = CutBCEWithLogitsLoss(pos_weight=pos_weight, class_weight=class_weight, **options)
    return module(hidden, item_weight, targets, bias, weight)


def oracle(engine, inputs, *, upstream, loss=PLAIN, **kwargs):
    """`engine`'s framework's dense oracle in float64 (the bridge's is torch's)."""
    kwargs = {**loss.arguments(), **kwargs}
    if ENGINES[engine][0] == "jax":
        from jax_kernels.reference import dense_cut_bce

        return run_jax(dense_cut_bce, inputs, dtype="float64", upstream=upstream, **kwargs)
    from torch_cutbce import dense_bce_with_logits

    return run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, **kwargs)


def same_dtype_dense(engine, inputs, *, dtype, upstream, loss, **kwargs):
    """The dense loss run in `dtype`: the 16-bit contract's yardstick (`parity.assert_16bit_contract`).
    It is JAX's dense loss: environments without jax (core-only, RecTools') skip the 16-bit checks."""
    pytest.importorskip("jax", reason="the 16-bit yardstick is jax_kernels.reference.dense_cut_bce")
    import jax.numpy as jnp
    from jax_kernels.reference import dense_cut_bce

    return run_jax(dense_cut_bce, inputs, dtype=dtype, upstream=upstream, compute_dtype=jnp.dtype(dtype),
                   **loss.arguments(), **kwargs)


def inputs_for(seed, dtype="float32", options=OPTIONAL, *, trained=False, **kwargs):
    """`parity.make_inputs` at the suite's shape, rounded to `dtype`. `trained`: logits about
    N(-8, 3^2), as a trained recommender's are (its large-logit rows kept, shifted by -8): the last
    hidden unit is 1 and every item's last entry -8, exact in every dtype."""
    inputs = make_inputs(LEAD, V, D, L, seed=seed, **({"scale": 3.0} if trained else {}), **kwargs)
    if trained:
        inputs["hidden"][..., -1] = 1.0
        inputs["item_weight"][:, -1] = -8.0
    return select(inputs, options, dtype)


def closed_form_at_zero_logits(loss: Loss, num_items: int, positives: np.ndarray) -> np.ndarray:
    """Each row's loss when every logit is 0 (sigmoid = 1/2, softplus = ln 2 on both branches):
    every element is `scale (1/2)^gamma ln 2`, with each branch's scale (`Loss.numbers()`)."""
    numbers = loss.numbers()
    element = 0.5**numbers.gamma * math.log(2)
    return element * (positives * numbers.positive_scale + (num_items - positives) * numbers.negative_scale)


def marks(engine: str) -> list:
    """An engine class's `pytestmark`: its framework's (skips where it is missing) and its rung."""
    framework, rung, _ = ENGINES[engine]
    return [FRAMEWORK_MARKS[framework], rung]
