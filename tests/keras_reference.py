"""Keras' definition of label smoothing and of the focal loss, transcribed in numpy (float64).

From `keras.losses.binary_crossentropy(..., from_logits=True, label_smoothing=eps)` and
`BinaryFocalCrossentropy(..., label_smoothing=eps)`, in probability space as Keras computes them, so
a slip in our logit-space rewrite (docs/design.md, 'The math') shows against a definition written
apart from ours. At eps = 0 it is also torchvision's `sigmoid_focal_loss` (test_option_definitions.py
checks both). Valid where no probability rounds to 0 or 1: logits within about +-30 in float64.
"""

from __future__ import annotations

import numpy as np

from cutbce_common.focal import Focal
from cutbce_common.loss import Loss

# Keras has no pos_weight (ours scales a positive's whole term): the options a comparison may take.
KERAS_OPTIONS = ("bias", "class_weight", "weight")
# The Loss values compared with Keras, by test id: smoothing alone, with focal (with and without
# balancing), at its end point 1 (every target 1/2), and focal alone (eps 0: torchvision's loss too).
KERAS_CASES = {
    "smoothing0.1": Loss(label_smoothing=0.1),
    "smoothing0.3-focal2": Loss(Focal(2.0), 0.3),
    "smoothing0.2-focal1.5-balanced": Loss(Focal(1.5, 0.3, True), 0.2),
    "smoothing1-focal0.5-balanced": Loss(Focal(0.5, 0.25, True), 1.0),
    "focal2-balanced": Loss(Focal(2.0, 0.25, True)),
}
# float64 rows against the transcription: both exact to rounding away from 0 and 1 (a few ulps
# measured), so far tighter than the oracle table's float64 entry, which allows for long sums.
KERAS_FLOAT64_BOUND = 1e-12


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


def multi_hot_targets(targets, num_items):
    """`[N, V]` 0 / 1 from `[..., L]` ids (ids outside [0, V) are padding, duplicates count once)."""
    targets = targets.reshape(-1, targets.shape[-1])
    multi_hot = np.zeros((targets.shape[0], num_items))
    for n, row in enumerate(targets):
        multi_hot[n, [t for t in row if 0 <= t < num_items]] = 1.0
    return multi_hot


def keras_rows(inputs, loss: Loss):
    """Each position's Keras loss of `loss` summed over the catalog, times its weight and the class
    weight: shape `targets.shape[:-1]`."""
    h = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1])
    logits = h @ inputs["item_weight"].T + inputs.get("bias", 0.0)
    multi_hot = multi_hot_targets(inputs["targets"], logits.shape[1])
    elements = keras_elements(logits, multi_hot, loss.label_smoothing, loss.focal) * inputs.get("class_weight", 1.0)
    rows = elements.sum(-1) * inputs.get("weight", np.ones(h.shape[0])).reshape(-1)
    return rows.reshape(inputs["targets"].shape[:-1])

