"""The conformance suite (`conformance.EngineConformance`) on JAX's Pallas kernels, in interpret mode on
the CPU (compiled for TPU: test_jax_pallas_tpu_compile.py)."""

from __future__ import annotations

from conformance import CheckFamilies, EngineConformance, marks
from conformance_oracle import OracleChecks
from conformance_properties import PropertyRun


class TestPallas(EngineConformance):
    pytestmark = marks("jax-pallas")
    engine = "jax-pallas"
    # Not yet (open, found by issue 46's check): the item pass gives NaN in d_bias / d_item_weight of an item
    # whose row has an infinite entry (likely the block's rows past N: zeros times inf; not verified).
    test_infinite_logits_give_their_limits = None
    reductions = ("none", "mean")
    row_sums = False  # interpret mode is slow; the one-pass kernel meets the oracle check's 'mean'
    bad_input_every_entry = False  # `cut_bce`'s checks: TestBlocked's
    bad_input_entry_checks = ("test_pallas_refuses_float64",)
    # Each new shape compiles (interpret mode): small budgets, the kernels' dtypes (float64 refused:
    # the explicit example 'confident-float64').
    property_runs = (PropertyRun("exact_as_dense", 12, shrink=False, jit=True, dtypes=("float32", "bfloat16"),
                                 max_n=24, max_v=600, examples=("confident", "refused", "confident-float64"),
                                 # Not yet: a finite-limit d_item_weight entry came out non-finite beside an
                                 # infinite input entry (bfloat16, found by issue 46's draws; open).
                                 infinities=False),
                     PropertyRun("refuses_bad_input", 6, shrink=False, dtypes=("float32", "bfloat16")),
                     PropertyRun("ignores_bad_ids", 10, shrink=False, max_n=24, max_v=600))
    # float32 only; each Loss compiles: plain smoothing and its end point (TestBlocked runs all five).
    option_dtype = "float32"
    option_keras_cases = ("smoothing0.1", "smoothing1-focal0.5-balanced")


class TestPallasBfloat16(CheckFamilies, OracleChecks):
    """The 16-bit contract (docs/precision.md) in bfloat16, one pass: the oracle family only."""

    pytestmark = marks("jax-pallas")
    engine = "jax-pallas"
    # Not yet (open, found by issue 46's check): the item pass gives NaN in d_bias / d_item_weight of an item
    # whose row has an infinite entry (likely the block's rows past N: zeros times inf; not verified).
    test_infinite_logits_give_their_limits = None
    dtypes = ("bfloat16",)
    reductions = ("sum",)
    losses = ("focal0.5-balanced", "smoothing0.2-focal1.5-balanced")
    row_losses = ()
