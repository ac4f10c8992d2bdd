"""Focal CutBCE on the torch paths (issue 15) against the float64 focal oracle.

The oracle is `dense_bce_with_logits(..., focal=...)` in float64: the focal loss written from its
definition in logit space (logsigmoid, logaddexp) on materialized logits, independent of the
engines' formulas. Checked: every reduction, gamma in {0.5, 1, 2, 3} (fractional included) with and
without class balancing, bias and all weights, duplicates and padding, confident logits (each row
within the parity table's tolerance of the oracle (1e-5 relative in float32, 1e-10 in float64, never below zero), compiled and
eager tiles, gamma = 0 without balancing equal to plain CutBCE bit for bit, zero logits, bad
options, and torchvision's `sigmoid_focal_loss` where its semantics overlap.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parity import assert_close
from torch_cutbce import CutBCEWithLogitsLoss, Focal, cut_bce_with_logits, dense_bce_with_logits

N, V, D, L = 37, 301, 12, 4
BLOCK_V = 128
GAMMAS = [0.5, 1.0, 2.0, 3.0]


def _inputs(dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64) * scale
    items = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) - 2
    targets = torch.randint(-1, V, (N, L), generator=g)
    targets[:, 1] = targets[:, 0]  # duplicates
    targets[0] = -1  # no positives
    weight = torch.rand(N, generator=g, dtype=torch.float64)
    class_weight = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    pos_weight = torch.rand(V, generator=g, dtype=torch.float64) * 3 + 0.25
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in dict(
        hidden=hidden, item_weight=items, bias=bias, targets=targets, weight=weight,
        class_weight=class_weight, pos_weight=pos_weight).items()}


def _run(fn, inputs, reduction, focal, **kwargs):
    """Loss and the gradients of `sum(loss * upstream)` (upstream drawn in float64 for every dtype)."""
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("hidden", "item_weight", "bias", "weight")}
    loss = fn(leaves["hidden"], leaves["item_weight"], inputs["targets"], leaves["bias"], weight=leaves["weight"],
              class_weight=inputs["class_weight"], pos_weight=inputs["pos_weight"], reduction=reduction,
              focal=focal, **kwargs)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return {"loss": loss.detach(), **{f"d_{k}": v.grad for k, v in leaves.items()}}


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("balancing", [False, True])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_native_focal_matches_the_float64_oracle(gamma, balancing, reduction):
    focal = Focal(gamma=gamma, alpha=0.25, apply_class_balancing=balancing)
    truth = _run(dense_bce_with_logits, _inputs(), reduction, focal)
    native = _run(cut_bce_with_logits, _inputs(torch.float32), reduction, focal, backend="native",
                  block_v=BLOCK_V)
    assert_close(native, truth, dtype="float32", name=f"focal gamma={gamma} balancing={balancing}")
    native64 = _run(cut_bce_with_logits, _inputs(), reduction, focal, backend="native", block_v=BLOCK_V)
    assert_close(native64, truth, dtype="float64", name="focal float64")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("gamma", [0.5, 2.0])
def test_confident_rows_are_exact_row_by_row(gamma, dtype):
    """Logits up to |z| ~ 100: each row's loss within the dtype's tolerance of the float64 truth (each
    row on its own), never below zero."""
    focal = Focal(gamma=gamma, apply_class_balancing=True)
    inputs = _inputs(scale=8.0, seed=3)
    inputs["hidden"][2] *= 10
    truth = dense_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"], inputs["bias"],
                                  reduction="none", focal=focal)
    cast = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v) for k, v in inputs.items()}
    rows = cut_bce_with_logits(cast["hidden"], cast["item_weight"], cast["targets"], cast["bias"],
                               reduction="none", focal=focal, block_v=BLOCK_V)
    assert_close(rows, truth, dtype=dtype, name=f"focal rows gamma={gamma}", elementwise=True)
    assert (rows >= 0).all()


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_compiled_and_eager_focal_tiles_agree(reduction, monkeypatch):
    focal = Focal(gamma=1.5, apply_class_balancing=True)
    compiled = _run(cut_bce_with_logits, _inputs(torch.float32, seed=4), reduction, focal, block_v=BLOCK_V)
    monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")
    eager = _run(cut_bce_with_logits, _inputs(torch.float32, seed=4), reduction, focal, block_v=BLOCK_V)
    assert_close(compiled, eager, dtype="float32", name="compiled vs eager focal tiles")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_gamma_zero_without_balancing_is_plain_bce_bit_for_bit(reduction):
    plain = _run(cut_bce_with_logits, _inputs(torch.float32, seed=5), reduction, None, block_v=BLOCK_V)
    focal = _run(cut_bce_with_logits, _inputs(torch.float32, seed=5), reduction, Focal(gamma=0.0),
                 block_v=BLOCK_V)
    for key in plain:
        assert torch.equal(plain[key], focal[key]), key


def test_gamma_zero_with_balancing_is_bce_weighted_by_alpha():
    inputs = _inputs(seed=6)
    focal = _run(cut_bce_with_logits, inputs, "sum", Focal(gamma=0.0, alpha=0.3, apply_class_balancing=True),
                 block_v=BLOCK_V)
    truth = _run(dense_bce_with_logits, inputs, "sum", Focal(gamma=0.0, alpha=0.3, apply_class_balancing=True))
    assert_close(focal, truth, dtype="float64", name="gamma 0, balanced")


@pytest.mark.parametrize("focal", [Focal(2.0), Focal(0.5), Focal(2.0, 0.25, True)])
def test_zero_logits_give_the_closed_form(focal):
    hidden, items = torch.zeros(3, 4), torch.zeros(10, 4)
    targets = torch.tensor([[2], [-1], [7]])
    rows = cut_bce_with_logits(hidden, items, targets, reduction="none", focal=focal)
    per_element = 0.5 ** focal.gamma * math.log(2)
    if focal.apply_class_balancing:
        expected = [per_element * (focal.alpha + 9 * (1 - focal.alpha)), per_element * 10 * (1 - focal.alpha),
                    per_element * (focal.alpha + 9 * (1 - focal.alpha))]
    else:
        expected = [per_element * 10] * 3
    assert_close(rows, np.asarray(expected), dtype="float32", name="closed form", elementwise=True)


def test_the_module_takes_focal():
    inputs = _inputs(torch.float32, seed=7)
    focal = Focal(gamma=2.0, apply_class_balancing=True)
    module = CutBCEWithLogitsLoss(reduction="sum", focal=focal, block_v=BLOCK_V)
    direct = cut_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"], inputs["bias"],
                                 reduction="sum", focal=focal, block_v=BLOCK_V)
    torch.testing.assert_close(module(inputs["hidden"], inputs["item_weight"], inputs["targets"], inputs["bias"]),
                               direct, rtol=0, atol=0)
    assert "focal=Focal(gamma=2.0" in repr(module)


@pytest.mark.parametrize("bad,error,match", [
    (dict(gamma=-1.0), ValueError, "focal gamma must be >= 0"),
    (dict(alpha=1.5), ValueError, r"focal alpha must be in \[0, 1\]"),
    (dict(gamma=float("nan")), TypeError, "focal gamma must be a finite float"),
    (dict(apply_class_balancing=1), TypeError, "focal apply_class_balancing must be a bool"),
])
def test_bad_focal_options_are_clear_errors(bad, error, match):
    with pytest.raises(error, match=match):
        Focal(**bad)


@pytest.mark.parametrize("field,value,error", [("gamma", -1.0, ValueError), ("alpha", 2.0, ValueError),
                                               ("gamma", float("inf"), TypeError)])
def test_a_focal_changed_after_construction_is_checked_again(field, value, error):
    """A frozen dataclass can still be changed through object.__setattr__: each call re-validates."""
    inputs = _inputs(torch.float32)
    focal = Focal(2.0)
    object.__setattr__(focal, field, value)
    with pytest.raises(error, match=f"focal {field}"):
        cut_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"], focal=focal)


def test_focal_must_be_a_focal():
    inputs = _inputs(torch.float32)
    with pytest.raises(TypeError, match="focal must be None or a Focal"):
        cut_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"], focal=2.0)


@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_matches_torchvision_sigmoid_focal_loss(gamma, alpha):
    """torchvision's op on materialized logits: alpha >= 0 is our class balancing, alpha < 0 none."""
    ops = pytest.importorskip("torchvision.ops", reason="torchvision not installed (ci/setup.sh installs it)")
    inputs = _inputs(seed=8)
    logits = inputs["hidden"] @ inputs["item_weight"].T + inputs["bias"]
    multi_hot = torch.zeros(N, V, dtype=torch.float64).scatter_(1, inputs["targets"].clamp(min=0),
                                                                (inputs["targets"] >= 0).double())
    theirs = ops.sigmoid_focal_loss(logits, multi_hot, alpha=alpha, gamma=gamma, reduction="sum")
    focal = Focal(gamma=gamma, alpha=max(alpha, 0.0), apply_class_balancing=alpha >= 0)
    ours = cut_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"], inputs["bias"],
                               reduction="sum", focal=focal, block_v=BLOCK_V)
    assert_close(ours, theirs, dtype="float64", name=f"torchvision gamma={gamma} alpha={alpha}")


@pytest.mark.xla
@pytest.mark.parametrize("backend,reduction", [("xla_blocked", "none"), ("xla_blocked", "mean"), ("xla_pallas", "mean")])
def test_the_bridge_computes_focal_too(backend, reduction):
    """XLA tensors: the torch_xla bridge hands the focal option to the JAX engines (two- and one-pass)."""
    torch_xla = pytest.importorskip("torch_xla", reason="needs torch_xla: pip install 'torch-cutbce[xla]'")
    focal = Focal(gamma=2.0, alpha=0.25, apply_class_balancing=True)
    inputs = _inputs(torch.float32, seed=9)
    device = torch_xla.device()
    on_xla = {k: v.to(device) for k, v in inputs.items()}
    bridge = _run(cut_bce_with_logits, on_xla, reduction, focal, backend=backend, block_v=BLOCK_V)
    truth = _run(dense_bce_with_logits, _inputs(seed=9), reduction, focal)
    assert_close({k: v.cpu() for k, v in bridge.items()}, truth, dtype="float32", name=f"bridge {backend}")
