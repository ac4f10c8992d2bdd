"""The loss options' definitions, apart from any engine (every engine's checks of them: the
conformance suite's `OptionChecks`, tests/conformance_options.py).

- `Focal` refuses bad fields when built (one class, `cutbce_common.focal`, exported by both packages);
- the Keras transcription (`keras_reference.py`) can fail, and at eps = 0 is torchvision's
  `sigmoid_focal_loss` on materialized logits;
- both float64 oracles meet Keras' definition, and plain BCE scaled at gamma 0 with balancing;
- the module shows its loss options, refuses a bad one when built, and equals the function.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance_engines import BLOCK_V, LEAD, NEEDS_TORCH, inputs_for, marks, oracle
from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from keras_reference import (
    KERAS_CASES,
    KERAS_FLOAT64_BOUND,
    KERAS_OPTIONS,
    keras_elements,
    keras_rows,
    multi_hot_targets,
)
from parity import assert_close, relative_error

# The two float64 oracles, by the entry each is (`conformance_engines.oracle` picks the framework's).
ORACLES = [pytest.param(engine, marks=marks(engine), id=engine.split("-")[0]) for engine in ("torch-dense", "jax-dense")]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(gamma=-1.0), ValueError, "focal gamma must be >= 0"),
    # Issue 31: gammas float32 cannot hold gave NaN, and large ones unrolled huge compiled tiles.
    (dict(gamma=1e39), ValueError, "focal gamma must be at most 32"),
    (dict(gamma=1e4), ValueError, "focal gamma must be at most 32"),
    (dict(gamma=32.5), ValueError, "focal gamma must be at most 32"),
    (dict(gamma=5e-324), ValueError, "focal gamma must be 0 or at least 1.1754943508222875e-38"),
    (dict(gamma=1e-46), ValueError, "focal gamma must be 0 or at least"),
    (dict(gamma=1e-44), ValueError, "focal gamma must be 0 or at least"),
    (dict(alpha=1.5), ValueError, r"focal alpha must be in \[0, 1\]"),
    (dict(gamma=float("nan")), TypeError, "focal gamma must be a finite real number"),
    (dict(gamma="2"), TypeError, "focal gamma must be a finite real number"),
    (dict(apply_class_balancing=1), TypeError, "focal apply_class_balancing must be a bool"),
    (dict(gamma=np.bool_(True)), TypeError, "focal gamma must be a finite real number"),
])
def test_bad_focal_fields_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Focal(**kwargs)


@pytest.mark.parametrize("scalar", [np.float32, np.float64, np.int64])
def test_numeric_options_take_numpy_scalars_as_python_numbers(scalar):
    """Issue 39: np.float32(0.1) was refused as 'must be a finite float ... got np.float32(0.1)' where
    np.float64 and int were taken; each is now the Python float of its value."""
    value = scalar(0) if scalar is np.int64 else scalar(0.25)
    assert Loss(label_smoothing=value).label_smoothing == float(value)
    focal = Focal(scalar(2), value, True)
    assert (focal.gamma, focal.alpha) == (2.0, float(value))
    assert type(focal.gamma) is float and type(Loss(label_smoothing=value).label_smoothing) is float


@pytest.mark.parametrize("package", [pytest.param("torch_cutbce", marks=NEEDS_TORCH),
                                     pytest.param("jax_kernels", marks=pytest.mark.jax)])
def test_each_package_exports_the_one_focal(package):
    assert pytest.importorskip(package).Focal is Focal


def test_the_keras_transcription_can_fail():
    """The comparison sees a wrong smoothing: eps 0.1 vs Keras at 0.11 differ past the tolerance."""
    inputs = inputs_for(11, "float64", KERAS_OPTIONS, large_logits=False)
    a, b = keras_rows(inputs, Loss(label_smoothing=0.1)), keras_rows(inputs, Loss(label_smoothing=0.11))
    assert (a > 0).sum() >= 10 and np.abs(a[b > 0] / b[b > 0] - 1).max() > 1e-4  # weight 0 rows are 0 in both


@pytest.mark.rung1
@pytest.mark.parametrize("gamma", [0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_the_transcription_is_torchvisions_sigmoid_focal_loss(gamma, alpha):
    """torchvision's op on materialized logits: alpha >= 0 is class balancing, alpha < 0 none; the
    engines meet the transcription (`OptionChecks.test_matches_keras_definition`, 'focal2-balanced')."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops", reason="torchvision not installed (ci/setup.sh installs it)")
    inputs = inputs_for(8, "float64", ("bias",), large_logits=False)  # probability space: no 0 or 1
    logits = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1]) @ inputs["item_weight"].T + inputs["bias"]
    multi_hot = multi_hot_targets(inputs["targets"], logits.shape[1])
    theirs = ops.sigmoid_focal_loss(torch.tensor(logits), torch.tensor(multi_hot), alpha=alpha, gamma=gamma,
                                    reduction="sum")
    focal = Focal(gamma=gamma, alpha=max(alpha, 0.0), apply_class_balancing=alpha >= 0)
    ours = keras_elements(logits, multi_hot, 0.0, focal).sum()
    assert_close(ours, theirs, dtype="float64", name=f"torchvision gamma={gamma} alpha={alpha}")


@pytest.mark.parametrize("engine", ORACLES)
def test_both_oracles_meet_keras_definition(engine):
    """Each float64 row of every `KERAS_CASES` Loss within 1e-12 of Keras' formula."""
    inputs = inputs_for(11, "float64", KERAS_OPTIONS, large_logits=False)
    for case, loss in KERAS_CASES.items():
        rows = oracle(engine, inputs, upstream=np.zeros(LEAD), reduction="none", loss=loss, grad_names=(),
                      return_metrics=False)["loss"]
        err, where = relative_error(rows, keras_rows(inputs, loss), elementwise=True)
        assert err <= KERAS_FLOAT64_BOUND, f"{engine} oracle vs Keras {case}: {err:.3e} at {where}"


@pytest.mark.parametrize("engine", ORACLES)
def test_both_oracles_at_gamma_zero_with_balancing_are_plain_bce_scaled(engine):
    """(1 - alpha) x plain BCE with pos_weight x alpha / (1 - alpha), loss and gradients (what
    `OptionChecks` holds every engine to)."""
    alpha = 0.3
    inputs = inputs_for(6, "float64")
    common = dict(upstream=1.0, reduction="sum", return_metrics=False)
    scaled = {**inputs, "pos_weight": inputs["pos_weight"] * alpha / (1 - alpha)}
    plain = {k: x * (1 - alpha) for k, x in oracle(engine, scaled, **common).items()}
    focal = oracle(engine, inputs, loss=Loss(Focal(0.0, alpha, True)), **common)
    assert_close(focal, plain, dtype="float64", name=f"{engine} oracle, gamma 0 balanced")


@pytest.mark.rung1
def test_the_module_shows_and_checks_its_loss_options():
    """The module's numbers are the conformance suite's (TestModule); here what only a module has:
    its repr (options left at their defaults unshown), its check when built, the function's bits."""
    torch = pytest.importorskip("torch")
    from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits

    inputs = inputs_for(7)
    h, e, b = (torch.tensor(inputs[k], dtype=torch.float32) for k in ("hidden", "item_weight", "bias"))
    t = torch.tensor(inputs["targets"])
    options = dict(reduction="sum", focal=Focal(2.0, 0.25, True), label_smoothing=0.1, block_v=BLOCK_V)
    module = CutBCEWithLogitsLoss(**options)
    torch.testing.assert_close(module(h, e, t, b), cut_bce_with_logits(h, e, t, b, **options), rtol=0, atol=0)
    assert "focal=Focal(gamma=2.0" in repr(module) and "label_smoothing=0.1" in repr(module)
    assert "focal" not in repr(CutBCEWithLogitsLoss(label_smoothing=0.1))
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        CutBCEWithLogitsLoss(label_smoothing=2.0)
