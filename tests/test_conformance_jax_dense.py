"""The conformance suite's entry families on `jax_kernels.dense_cut_bce`, the dense JAX reference (it is
the JAX oracle, so the oracle family does not run on it)."""

from __future__ import annotations

from conformance import CheckFamilies, marks
from conformance_bad_input import UNTILED_CASES, BadInputChecks


class TestJaxDense(CheckFamilies, BadInputChecks):
    pytestmark = marks("jax-dense")
    engine = "jax-dense"
    bad_input_cases = UNTILED_CASES  # it takes no block_v
    bad_input_entry_checks = ("test_jax_accepts_array_likes",)
