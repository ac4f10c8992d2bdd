"""The conformance suite (`conformance.EngineConformance`) on the torch engines of the CPU: native
and dense (the torch_xla bridge's: test_conformance_xla.py)."""

from __future__ import annotations

from conformance import CheckFamilies, EngineConformance, marks
from conformance_bad_input import BadInputChecks
from conformance_options import OptionChecks


class TestNative(EngineConformance):
    pytestmark = marks("torch-native")
    engine = "torch-native"
    dtypes = ("float32", "float64")


class TestDense(EngineConformance):
    pytestmark = marks("torch-dense")
    engine = "torch-dense"
    reductions = ("none", "mean")


class TestModule(CheckFamilies, BadInputChecks, OptionChecks):
    """`CutBCEWithLogitsLoss` (the native engine behind it, checked above): what an entry must meet."""

    pytestmark = marks("torch-module")
    engine = "torch-module"
