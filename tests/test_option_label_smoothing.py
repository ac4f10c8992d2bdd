"""Label smoothing (issue 30): what is the option's alone, beyond the conformance suite.

Every engine's oracle, exact-row, large-logit, zero-logit, plain-bit-for-bit and bad-argument
checks of label smoothing run in the conformance suite (`conformance.py`, `LOSSES`); the sharded
and distributed paths in their own files. Here: both float64 oracles, and the engines, against
Keras' definition transcribed from `keras.losses.binary_crossentropy(..., from_logits=True,
label_smoothing=eps)` and `BinaryFocalCrossentropy(..., label_smoothing=eps)` in probability space
(numpy, float64, logits where no probability rounds to 0 or 1); the module; the native compiled
and eager tiles.
"""

from __future__ import annotations

import numpy as np
import pytest

import conformance_engines as conformance
from conformance_engines import LEAD, V
from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from parity import assert_close, make_upstream

OPTIONS = ("bias", "class_weight", "weight")  # Keras has no pos_weight (ours scales a positive's whole term)


def keras_elements(logits, multi_hot, eps, focal=None):
    """Keras' elementwise loss on the smoothed target, in probability space as Keras computes it."""
    y = multi_hot * (1 - eps) + 0.5 * eps  # keras.losses: y_true * (1 - label_smoothing) + 0.5 * label_smoothing
    p = 1 / (1 + np.exp(-logits))
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    if focal is None:
        return bce
    p_t = y * p + (1 - y) * (1 - p)
    out = (1 - p_t) ** focal.gamma * bce
    if focal.apply_class_balancing:
        out = out * (y * focal.alpha + (1 - y) * (1 - focal.alpha))
    return out


def keras_rows(inputs, eps, focal=None):
    """Each position's Keras loss summed over the catalog, times its weight and the class weight."""
    h = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1])
    logits = h @ inputs["item_weight"].T + inputs.get("bias", 0.0)
    targets = inputs["targets"].reshape(h.shape[0], -1)
    multi_hot = np.zeros(logits.shape)
    for n, row in enumerate(targets):
        multi_hot[n, [t for t in row if 0 <= t < logits.shape[1]]] = 1.0
    elements = keras_elements(logits, multi_hot, eps, focal) * inputs.get("class_weight", 1.0)
    return (elements.sum(-1) * inputs.get("weight", np.ones(h.shape[0])).reshape(-1)).reshape(LEAD)


KERAS_CASES = [(0.1, None), (0.3, Focal(2.0)), (0.2, Focal(1.5, 0.3, True)), (1.0, Focal(0.5, 0.25, True))]


@pytest.mark.parametrize("eps,focal", KERAS_CASES, ids=str)
@pytest.mark.parametrize("engine", ["torch-dense", "torch-native", pytest.param("jax-blocked", marks=pytest.mark.jax)])
def test_matches_keras_definition(engine, eps, focal):
    """float64 rows within 1e-12 of Keras' formula (logits within +-12: no probability rounds)."""
    inputs = conformance.inputs_for(11, "float64", OPTIONS, large_logits=False)
    keras = keras_rows(inputs, eps, focal)
    loss = Loss(focal, eps)
    ours = conformance.run(engine, inputs, dtype="float64", upstream=np.zeros(LEAD), reduction="none", loss=loss,
                           grad_names=(), return_metrics=False)["loss"]
    assert_close(ours, keras, dtype="float64", name=f"{engine} vs Keras eps={eps} {focal}", elementwise=True)
    if engine == "jax-blocked":
        oracle = conformance.oracle(engine, inputs, upstream=np.zeros(LEAD), reduction="none", loss=loss,
                                    grad_names=(), return_metrics=False)["loss"]
        assert_close(oracle, keras, dtype="float64", name="dense_cut_bce vs Keras", elementwise=True)


def test_the_keras_transcription_can_fail():
    """The comparison sees a wrong smoothing: eps 0.1 vs Keras at 0.11 differ past the tolerance."""
    inputs = conformance.inputs_for(11, "float64", OPTIONS, large_logits=False)
    a, b = keras_rows(inputs, 0.1), keras_rows(inputs, 0.11)
    assert (a > 0).sum() >= 10 and np.abs(a[b > 0] / b[b > 0] - 1).max() > 1e-4  # weight 0 rows are 0 in both


def test_the_module_takes_label_smoothing():
    torch = pytest.importorskip("torch")
    from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits

    inputs = conformance.inputs_for(7)
    h, e, b = (torch.tensor(inputs[k], dtype=torch.float32) for k in ("hidden", "item_weight", "bias"))
    t = torch.tensor(inputs["targets"])
    module = CutBCEWithLogitsLoss(reduction="sum", label_smoothing=0.1, block_v=64)
    direct = cut_bce_with_logits(h, e, t, b, reduction="sum", label_smoothing=0.1, block_v=64)
    torch.testing.assert_close(module(h, e, t, b), direct, rtol=0, atol=0)
    assert "label_smoothing=0.1" in repr(module) and "focal" not in repr(module)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        CutBCEWithLogitsLoss(label_smoothing=2.0)


def test_compiled_and_eager_native_tiles_agree(monkeypatch):
    """torch native: the torch.compile'd tile of a smoothed focal Loss and the eager one."""
    pytest.importorskip("torch")
    loss = Loss(Focal(1.5, 0.25, True), 0.2)
    for reduction in ("none", "mean"):
        common = dict(dtype="float32", upstream=make_upstream(reduction, LEAD, seed=4), reduction=reduction,
                      loss=loss)
        monkeypatch.delenv("TORCH_CUTBCE_NO_COMPILE", raising=False)
        compiled = conformance.run("torch-native", conformance.inputs_for(4), **common)
        monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")
        eager = conformance.run("torch-native", conformance.inputs_for(4), **common)
        assert_close(compiled, eager, dtype="float32", name=f"compiled vs eager smoothed tiles, {reduction}")


def test_half_of_v_is_the_floor_at_full_smoothing():
    """eps = 1: every target is 1/2, so every element is at least ln 2 (at z = 0): V ln 2 per row."""
    pytest.importorskip("torch")
    inputs = conformance.inputs_for(2, "float64", ())
    rows = conformance.run("torch-native", inputs, dtype="float64", upstream=np.zeros(LEAD), reduction="none",
                           loss=Loss(label_smoothing=1.0), grad_names=(), return_metrics=False)["loss"]
    assert (np.asarray(rows) >= V * np.log(2) * (1 - 1e-12)).all()
