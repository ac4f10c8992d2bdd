"""The conformance suite (`conformance.EngineConformance`) on the torch_xla bridge's engines, blocked
and Pallas, on XLA:CPU (fewer cases: each compiles)."""

from __future__ import annotations

from conformance import EngineConformance, marks


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
