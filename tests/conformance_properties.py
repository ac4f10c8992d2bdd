"""Property-based checks (hypothesis) of an engine against the float64 oracle: `PropertyChecks`.

Three properties (issue 11), over `_properties_examples.Spec`s drawn by `_properties_strategies` (a
failure prints a short spec that `build(spec)` turns back into the arrays):

- A, exact as dense (`_properties_checks.check_exact`): each example whose spec the documented rules
  accept meets `parity.assert_exact_as_dense` against `_properties_oracle.float64_oracle` (loss,
  every row, every gradient, metrics); one they refuse (a block_v < 1, float64 on the Pallas
  kernels) raises exactly an error of `_properties_examples.allowed_refusals`. The run's explicit
  examples (CONFIDENT, WIDE, REFUSED, ...) come first; each outcome is a `hypothesis.event`, and at
  least half of a run's examples, and 3, must reach the oracle (`counts_outcomes`).
- B, refuses bad input (`check_refused`): every bad argument, one at a time on a drawn valid
  example, raises a ValueError / TypeError naming it.
- C, ignores bad ids (`assert_bitwise_equal`): where ids cannot be checked (JAX under jit, XLA
  tensors), ids outside [0, V) give the results of -1 in their slots, bit for bit.

An engine class lists its runs in `property_runs` (`PropertyRun`s: the property, its budget, what it
draws), one case of `test_property` each; the default, what a new engine gets, is `default_runs` of
its framework. The hypothesis test is built inside the case from the run, so its events are not in
`--hypothesis-show-statistics`: a run that fails its count prints them. JAX runs as users run it,
with x64 off (float64 examples switch it on locally). The JAX mesh and torch vocab-parallel run the
same properties in processes of their own (test_jax_mesh_properties.py,
test_torch_vocab_parallel_properties.py).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import hypothesis
from hypothesis import given
from hypothesis import strategies as st

from _properties_checks import assert_bitwise_equal, check_exact, check_refused, counts_outcomes
from _properties_examples import ID_MUTATIONS, MUTATIONS, build, corrupt
from _properties_runners import bridge_results, jax_results, torch_results
from _properties_strategies import (
    IGNORED_IDS_DTYPES,
    JAX_DTYPES,
    JAX_MUTATIONS,
    TORCH_DTYPES,
    bad_id_cases,
    bad_ids_example,
    budget,
    explicit,
    small_specs,
    specs,
)
from conformance_engines import ENGINES

# The float dtypes each framework's engines take (a run's `dtypes` narrows them).
FRAMEWORK_DTYPES = {"torch": TORCH_DTYPES, "jax": JAX_DTYPES, "xla": ("float32", "bfloat16", "float64")}
# A's and C's explicit examples where a run names none (`_properties_strategies.EXAMPLES`).
DEFAULT_EXAMPLES = {"exact_as_dense": ("confident", "wide", "wide-random", "refused"), "refuses_bad_input": (),
                    "ignores_bad_ids": ("confident",)}


@dataclasses.dataclass(frozen=True)
class PropertyRun:
    """One hypothesis run of one property on the engine: one case of `PropertyChecks.test_property`.

    Attributes:
      check: 'exact_as_dense' (A), 'refuses_bad_input' (B) or 'ignores_bad_ids' (C).
      max_examples, shrink: its budget (`_properties_strategies.budget`; shrink=False where every
        new shape compiles: a failure there prints the example as found).
      jit: JAX engines: jitted (True) or eager (False); None: A jitted, B draws both per example.
        C is always jitted (eager JAX checks ids: B's).
      dtypes: the float dtypes drawn; (): `FRAMEWORK_DTYPES` of the engine (C: `IGNORED_IDS_DTYPES`).
      max_n, max_v: the largest N and V drawn (A and C; B draws small bases).
      layouts: A also draws transposed, strided and expanded torch CPU tensors.
      examples: the explicit examples A and C run first (`_properties_strategies.EXAMPLES` names);
        None: the check's `DEFAULT_EXAMPLES`.
      infinities: A also draws infinite hidden / item entries (`Spec.infinite`), checked against the limit.
    """

    check: str
    max_examples: int
    shrink: bool = True
    jit: bool | None = None
    dtypes: tuple[str, ...] = ()
    max_n: int = 64
    max_v: int = 5000
    layouts: bool = False
    examples: tuple[str, ...] | None = None
    infinities: bool = True

    def __post_init__(self):
        if self.check not in CHECKS:
            raise ValueError(f"check must be one of {sorted(CHECKS)}, got {self.check!r}")
        if self.check == "refuses_bad_input" and self.examples:
            raise ValueError(f"examples: refuses_bad_input runs none (it mutates drawn ones), got {self.examples!r}")

    @property
    def id(self) -> str:
        return self.check + {True: "-jit", False: "-eager", None: ""}[self.jit]


def default_runs(framework: str) -> tuple[PropertyRun, ...]:
    """What a new engine runs: A (JAX: jitted and eager), B, and C where ids cannot be checked (JAX
    under jit, XLA tensors; CPU torch tensors check them: B's), at the compiling engines' budgets."""
    jits = (True, False) if framework == "jax" else (None,)
    runs = [PropertyRun("exact_as_dense", 12, shrink=False, jit=jit) for jit in jits]
    runs.append(PropertyRun("refuses_bad_input", 8, shrink=False))
    if framework != "torch":
        runs.append(PropertyRun("ignores_bad_ids", 8, shrink=False))
    return tuple(runs)


class PropertyChecks:
    """The property family (module docstring). Narrow with `property_runs`; `conformance.CheckFamilies`
    parametrizes `test_property` over it."""

    engine: str

    @property
    def property_runs(self) -> tuple[PropertyRun, ...]:
        return default_runs(ENGINES[self.engine][0])

    def parametrize(self, metafunc):
        """`test_property` once per run (ids like 'exact_as_dense-jit')."""
        if "property_run" in metafunc.fixturenames:
            runs = self.property_runs
            metafunc.parametrize("property_run", runs, ids=[run.id for run in runs])

    def test_property(self, property_run):
        """The run's property holds on its explicit examples and on every example it draws."""
        CHECKS[property_run.check](self.engine, property_run)


def exact_as_dense(engine: str, run: PropertyRun) -> None:
    """Property A: `run`'s explicit examples, then its drawn ones, each meets the rule or is refused
    as the rules say; at least half of them reach the oracle."""
    jit = run.jit is not False
    ids = _ids(engine, jit)

    def holds(spec):
        example = build(spec)
        check_exact(lambda: results(engine, example, jit=jit), example, f"{engine} {run.id}", engine)

    examples = [{"spec": explicit(name, ids)} for name in _examples(run)]
    strategy = specs(dtypes=_dtypes(engine, run), max_n=run.max_n, max_v=run.max_v, ids=ids,
                     layouts=run.layouts, refusable=True, narrow_ids=True, infinities=run.infinities)
    counts_outcomes(_hypothesis_test(holds, engine, run, examples, spec=strategy))()


def refuses_bad_input(engine: str, run: PropertyRun) -> None:
    """Property B: every bad argument of `_mutations`, one at a time, raises naming it."""
    jits = st.booleans() if run.jit is None and ENGINES[engine][0] == "jax" else st.just(run.jit)

    def holds(spec, jit):
        check_refused(lambda ex, i, o, m: results(engine, ex, jit=jit, inputs=i, options=o), spec,
                      _mutations(engine, jit))

    strategy = small_specs(dtypes=_dtypes(engine, run), ids="any" if ENGINES[engine][0] == "jax" else "int64")
    _hypothesis_test(holds, engine, run, [], spec=strategy, jit=jits)()


def ignores_bad_ids(engine: str, run: PropertyRun) -> None:
    """Property C: ids outside [0, V) give, bit for bit, the results of -1 in their slots (JAX: in
    the same jitted program)."""
    id_dtype = "int32" if ENGINES[engine][0] == "jax" else "int64"  # JAX's x64 is off: int32 under jit

    def holds(case):
        spec, ids = case
        example = build(spec)
        bad, clean = corrupt(example.inputs["targets"], ids, spec.seed)
        assert_bitwise_equal(*results(engine, example, jit=True, variants=[bad, clean]), name=engine)

    examples = [{"case": bad_ids_example(name, id_dtype)} for name in _examples(run)]
    strategy = bad_id_cases(id_dtype=id_dtype, dtypes=_dtypes(engine, run), max_n=run.max_n, max_v=run.max_v)
    _hypothesis_test(holds, engine, run, examples, case=strategy)()


CHECKS = {"exact_as_dense": exact_as_dense, "refuses_bad_input": refuses_bad_input, "ignores_bad_ids": ignores_bad_ids}


def results(engine: str, example, *, jit: bool, inputs=None, options=None, variants=None):
    """`engine` on one example (`_properties_runners`): its entry's options but block_v (the spec
    draws it). `variants`: targets arrays run through the same step (a list of results)."""
    framework, _, entry = ENGINES[engine]
    entry = {key: value for key, value in entry.items() if key != "block_v"}
    if framework == "jax":
        return jax_results(example, jit=jit, inputs=inputs, options=options, variants=variants, **entry)
    if variants is not None:
        return [results(engine, example, jit=jit, inputs={**example.inputs, "targets": t}, options=options)
                for t in variants]
    from torch_cutbce import cut_bce_with_logits

    run_torch = bridge_results if framework == "xla" else torch_results
    return run_torch(example, functools.partial(cut_bce_with_logits, **entry), inputs=inputs, options=options)


def _hypothesis_test(holds, engine: str, run: PropertyRun, examples: list[dict], **strategies):
    """`holds` under `run`'s budget, drawing `strategies`, its explicit `examples` first (in order).

    Seeded by the engine and the run: every engine shares `holds`' source, from which a derandomized
    test takes its seed, and would otherwise draw what the others draw."""
    for kwargs in reversed(examples):  # hypothesis runs the last-applied example first
        holds = hypothesis.example(**kwargs)(holds)
    seeded = hypothesis.seed(zlib.crc32(f"{engine} {run.id}".encode()))
    return seeded(budget(run.max_examples, run.shrink)(given(**strategies)(holds)))


def _ids(engine: str, jit: bool) -> str:
    """The ids A draws (`specs`): int32 under jit with JAX's x64 off, either eagerly; torch's int64."""
    if ENGINES[engine][0] == "jax":
        return "jit" if jit else "any"
    return "int64"


def _dtypes(engine: str, run: PropertyRun) -> tuple[str, ...]:
    if run.dtypes:
        return run.dtypes
    return IGNORED_IDS_DTYPES if run.check == "ignores_bad_ids" else FRAMEWORK_DTYPES[ENGINES[engine][0]]


def _examples(run: PropertyRun) -> tuple[str, ...]:
    return DEFAULT_EXAMPLES[run.check] if run.examples is None else run.examples


def _mutations(engine: str, jit: bool | None) -> tuple[str, ...]:
    """B's bad arguments: ids >= V only where they can be checked (CPU tensors, concrete JAX arrays;
    elsewhere they are C's), a list where a tensor belongs only for torch (JAX takes array-likes)."""
    framework = ENGINES[engine][0]
    if framework == "torch":
        return MUTATIONS
    if framework == "xla":
        return tuple(m for m in MUTATIONS if m not in ID_MUTATIONS)
    return tuple(m for m in JAX_MUTATIONS if not (jit and m in ID_MUTATIONS))
