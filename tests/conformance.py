"""The conformance suite: every check of an engine written once, run for every engine and `Loss`.

An engine is a key of `conformance_engines.ENGINES` (how its entry is called). A check family is a
mixin class in a `conformance_*.py` module: `OracleChecks` (the float64 oracle, rows row by row,
closed forms, plain options bit for bit), ... . `EngineConformance` joins them; each engine is a
subclass that names it (`engine`) and may narrow what it runs (a slow engine runs fewer cases).
Subclasses live in the `test_conformance_*.py` files (one per engine group), so a new engine
inherits every check by adding one class, and a new `Loss` value by adding one entry to `LOSSES`.
An entry that is no engine of its own (the `CutBCEWithLogitsLoss` module, the dense JAX reference)
subclasses the families that apply to it.

The engines that need a process of their own (the JAX mesh, torch.distributed) run the same
Loss values in their own files (`test_jax_sharded.py`, `test_torch_sharded.py`,
`test_torch_dtensor.py`); Pallas compiled for TPU: `test_jax_pallas_tpu_compile.py`.
"""

from __future__ import annotations

import pytest

from conformance_engines import ENGINES, marks
from conformance_bad_input import BadInputChecks
from conformance_options import OptionChecks
from conformance_oracle import OracleChecks
from conformance_properties import PropertyChecks

__all__ = ["CheckFamilies", "EngineConformance", "marks"]


class CheckFamilies:
    """What every family shares: the engine's name, its framework's imports (a missing one skips),
    and one `pytest_generate_tests` that asks each family in the class to parametrize its checks
    (a family's `parametrize(self, metafunc)`, from its class attributes)."""

    engine: str

    def pytest_generate_tests(self, metafunc):
        for family in type(self).__mro__:
            hook = family.__dict__.get("parametrize")
            if hook is not None:
                hook(self, metafunc)

    @pytest.fixture(autouse=True)
    def _needs(self):
        framework = ENGINES[self.engine][0]
        if framework in ("jax", "xla"):
            pytest.importorskip("jax")
        if framework == "xla":
            pytest.importorskip("torch_xla")
        if framework in ("torch", "xla"):
            pytest.importorskip("torch")


class EngineConformance(CheckFamilies, OracleChecks, PropertyChecks, BadInputChecks, OptionChecks):
    """Every check family (module docstring). Subclass, name `engine`, narrow as needed."""
