"""The conformance suite (`conformance.EngineConformance`) on every torch engine of one process:
native, dense, and the torch_xla bridge's blocked and Pallas engines (XLA:CPU; fewer cases: each
compiles)."""

from __future__ import annotations

from conformance import EngineConformance, marks


class TestNative(EngineConformance):
    pytestmark = marks("torch-native")
    engine = "torch-native"
    dtypes = ("float32", "float64")


class TestDense(EngineConformance):
    pytestmark = marks("torch-dense")
    engine = "torch-dense"
    reductions = ("none", "mean")


class TestXlaBlocked(EngineConformance):
    pytestmark = marks("xla-blocked")
    engine = "xla-blocked"
    reductions = ("none", "mean")
    losses = ("focal0.5-balanced", "smoothing0.2-focal1.5-balanced")
    row_losses = ()


class TestXlaPallas(EngineConformance):
    pytestmark = marks("xla-pallas")
    engine = "xla-pallas"
    reductions = ("mean",)
    losses = ("smoothing0.2-focal1.5-balanced",)
    row_losses = ()
