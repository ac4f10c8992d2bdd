"""The conformance suite: every check of an engine written once, run for every engine and `Loss`.

An engine is a key of `conformance_engines.ENGINES` (how its entry is called). A check family is a
mixin class in a `conformance_*.py` module:
- `OracleChecks` (`conformance_oracle.py`): the float64 oracle for every `Loss`, the rows that
  cancelled before row by row, large logits, closed forms, plain options bit for bit;
- `PropertyChecks` (`conformance_properties.py`): hypothesis examples against the oracle, bad
  arguments one at a time, out-of-range ids under jit equal to padding;
- `BadInputChecks` (`conformance_bad_input.py`): docs/precision.md's table of bad inputs, and the
  degenerate but valid ones, at the entry;
- `OptionChecks` (`conformance_options.py`): each option's own definition (Keras', gamma's bounds)
  and its bad values.
`EngineConformance` joins them; each engine is a subclass that names it (`engine`) and narrows what
it runs by each family's attributes (a slow engine runs fewer cases). Subclasses live in the
`test_conformance_*.py` files (one per engine group), so a new engine inherits every check by adding
one class, and a new `Loss` value by adding one entry to `LOSSES`. An entry that is no engine of its
own (the `CutBCEWithLogitsLoss` module, the dense JAX reference) subclasses the families that apply.

The paths whose process is the subject run the same cases in files of their own: the JAX mesh (the
device count is fixed when JAX starts) and vocab-parallel ranks (`test_sharded_exact_rows.py`,
`test_jax_mesh_properties.py`, `test_torch_vocab_parallel_properties.py`, `test_jax_sharded.py`,
`test_torch_sharded.py`, `test_torch_dtensor.py`); Pallas compiled for TPU:
`test_jax_pallas_tpu_compile.py`.
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
