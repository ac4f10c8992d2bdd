"""The conformance suite (`conformance.EngineConformance`) on JAX's blocked loop: jitted with x64 off
in float32, as users run it; float64 with x64 on (the Pallas kernels: test_conformance_jax_pallas.py)."""

from __future__ import annotations

from conformance import EngineConformance, marks
from conformance_properties import PropertyRun


class TestBlocked(EngineConformance):
    pytestmark = marks("jax-blocked")
    engine = "jax-blocked"
    dtypes = ("float32", "float64", "bfloat16", "float16")
    row_dtypes = ("float32", "float64")
    reductions = ("none", "mean")
    infinite_cases = ("positives",)  # a -inf logit at a negative: a taken-out positive (docs/precision.md)
    bad_input_entry_checks = ("test_block_v_takes_numpy_integers", "test_unknown_backend", "test_jax_accepts_array_likes",
                              "test_jax_traced_int64_ids_compare_in_int64",
                              "test_jax_ids_at_or_above_V_under_jit_are_padding")
    property_runs = (PropertyRun("exact_as_dense", 60, jit=True),
                     PropertyRun("exact_as_dense", 12, shrink=False, jit=False, examples=("confident", "wide-random", "refused")),
                     PropertyRun("refuses_bad_input", 6, shrink=False),  # and 6 on TestPallas
                     PropertyRun("ignores_bad_ids", 10, shrink=False, max_n=24, max_v=600))
    option_entries = ("entry", "mesh")
