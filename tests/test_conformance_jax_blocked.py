"""The conformance suite (`conformance.EngineConformance`) on JAX's blocked loop: jitted with x64 off
in float32, as users run it; float64 with x64 on (the Pallas kernels: test_conformance_jax_pallas.py)."""

from __future__ import annotations

from conformance import EngineConformance, marks


class TestBlocked(EngineConformance):
    pytestmark = marks("jax-blocked")
    engine = "jax-blocked"
    dtypes = ("float32", "float64")
    reductions = ("none", "mean")
