"""The conformance suite (`conformance.EngineConformance`) on the torch engines of the CPU: native
and dense (the torch_xla bridge's: test_conformance_xla.py)."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import CheckFamilies, EngineConformance, marks
from conformance_bad_input import BadInputChecks
from conformance_options import OptionChecks
from conformance_properties import PropertyRun


class TestNative(EngineConformance):
    pytestmark = marks("torch-native")
    engine = "torch-native"
    infinite_cases = ("positives",)  # a -inf logit at a negative: a taken-out positive (docs/precision.md)
    dtypes = ("float32", "float64", "bfloat16", "float16")
    bad_input_entry_checks = ("test_torch_rejects_non_tensors", "test_block_v_takes_numpy_integers",
                              "test_unknown_backend", "test_torch_constant_weights_must_not_require_grad",
                              "test_torch_double_backward_of_rows_raises", "test_torch_xla_backend_needs_xla_tensors",
                              "test_torch_special_rows_are_never_read")
    row_dtypes = ("float32", "float64")
    property_runs = (PropertyRun("exact_as_dense", 100, layouts=True), PropertyRun("refuses_bad_input", 25))
    option_scaled_dtypes = ("float64", "float32")


class TestDense(EngineConformance):
    pytestmark = marks("torch-dense")
    engine = "torch-dense"
    reductions = ("none", "mean")
    bad_input_entry_checks = ("test_torch_rejects_non_tensors", "test_block_v_takes_numpy_integers",
                              "test_torch_special_rows_are_never_read")
    # Not exact_as_dense: this is torch's own BCEWithLogitsLoss, whose rounded log(1 + exp(-|z|)) is
    # 1e-3 relative off at z = -10 in float32 (docs/precision.md, 'Precision').
    property_runs = (PropertyRun("refuses_bad_input", 25),)
    test_infinite_logits_give_their_limits = None  # torch's formula: NaN (docs/precision.md's table)

    def row_matrix(self):
        """Plain BCE is torch's BCEWithLogitsLoss on the logits, checked in float64 only: in float32
        it loses 1e-3 relative on the confident rows (the log of a rounded 1.0000454), where every
        tile is within 1e-7: the library is more exact than the code it replaces."""
        return [(loss_id, "float64" if loss_id == "plain" else "float32") for loss_id in self.row_losses]

    def row_case_names(self, loss_id, dtype):
        """Not "single" for plain BCE: torch evaluates softplus(-31) as log(1 + exp(-31)) of a rounded
        sum, 3.55e-14 for 3.44e-14, even in float64."""
        names = super().row_case_names(loss_id, dtype)
        return tuple(n for n in names if n != "single") if loss_id == "plain" else names


class TestModule(CheckFamilies, BadInputChecks, OptionChecks):
    """`CutBCEWithLogitsLoss` (the native engine behind it, checked above): what an entry must meet."""

    pytestmark = marks("torch-module")
    engine = "torch-module"
    bad_input_entry_checks = ("test_torch_rejects_non_tensors", "test_block_v_takes_numpy_integers",
                              "test_torch_constant_weights_must_not_require_grad",
                              "test_module_checks_its_options_when_built",
                              "test_torch_special_rows_are_never_read")
    # The native engine's numbers are TestNative's: one case each shows the module hands them on.
    option_gammas = ("largest",)
    option_keras_cases = ("smoothing0.2-focal1.5-balanced",)


def test_the_16bit_contract_can_fail():
    """The contract fails outputs a careless 16-bit engine returns, on trained-like logits: the loss
    one bfloat16 ulp (2^-7) off, or d_hidden truncated to bfloat16 from its exact float32 value
    (triton 3.5's interpreter truncated; a GPU rounds to nearest). The native engine's own results pass."""
    from conformance_engines import LEAD, LOSSES, inputs_for, oracle, run, same_dtype_dense
    from parity import assert_16bit_contract, make_upstream

    inputs = inputs_for(1, "bfloat16", trained=True)
    common = dict(upstream=make_upstream("none", LEAD, seed=1, dtype="bfloat16"), reduction="none", loss=LOSSES["plain"])
    fast = run("torch-native", inputs, dtype="bfloat16", **common)
    dense = same_dtype_dense("torch-native", inputs, dtype="bfloat16", **common)
    truth = oracle("torch-native", inputs, **common)
    assert_16bit_contract(fast, dense, truth, dtype="bfloat16", name="native")
    truncated = (truth["d_hidden"].astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    for key, wrong in (("loss", truth["loss"] * (1 + 2.0**-7)), ("d_hidden", truncated.astype(np.float64))):
        with pytest.raises(AssertionError, match=key):
            assert_16bit_contract({**fast, key: wrong}, dense, truth, dtype="bfloat16", name="native")
