"""The conformance suite (`conformance.EngineConformance`) on JAX's Pallas kernels, in interpret mode on
the CPU (compiled for TPU: test_jax_pallas_tpu_compile.py)."""

from __future__ import annotations

from conformance import CheckFamilies, EngineConformance, marks
from conformance_oracle import OracleChecks


class TestPallas(EngineConformance):
    pytestmark = marks("jax-pallas")
    engine = "jax-pallas"
    reductions = ("none", "mean")


class TestPallasBfloat16(CheckFamilies, OracleChecks):
    """bfloat16 against the dense reference run in bfloat16 (CCE's rule), one pass: the oracle family only."""

    pytestmark = marks("jax-pallas")
    engine = "jax-pallas"
    dtypes = ("bfloat16",)
    reductions = ("sum",)
    losses = ("focal0.5-balanced", "smoothing0.2-focal1.5-balanced")
    row_losses = ()
