"""The conformance suite (`conformance.EngineConformance`) on every JAX engine of one process: the
blocked loop (jitted with x64 off in float32, as users run it; float64 with x64 on) and the Pallas
kernels (interpret mode on the CPU; compiled for TPU: test_jax_pallas_tpu_compile.py)."""

from __future__ import annotations

from conformance import EngineConformance, marks


class TestBlocked(EngineConformance):
    pytestmark = marks("jax-blocked")
    engine = "jax-blocked"
    dtypes = ("float32", "float64")
    reductions = ("none", "mean")


class TestPallas(EngineConformance):
    pytestmark = marks("jax-pallas")
    engine = "jax-pallas"
    reductions = ("none", "mean")


class TestPallasBfloat16(EngineConformance):
    """bfloat16 against the dense reference run in bfloat16 (CCE's rule), one pass."""

    pytestmark = marks("jax-pallas")
    engine = "jax-pallas"
    dtypes = ("bfloat16",)
    reductions = ("sum",)
    losses = ("focal0.5-balanced", "smoothing0.2-focal1.5-balanced")
    row_losses = ()
