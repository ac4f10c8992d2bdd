"""The checks of the three properties (conformance_properties.py), one example at a time.

- `check_exact` (A): a spec the documented rules accept must reach the float64 oracle and meet
  `parity.assert_exact_as_dense`; one they refuse must raise exactly an error of
  `_properties_examples.allowed_refusals`. Each outcome is a hypothesis event ('reached oracle',
  'refused: <argument>') and a count in OUTCOMES, which `counts_outcomes` checks after the test.
- `check_refused` (B): every mutation of a valid spec raises a ValueError / TypeError naming it.
- `assert_bitwise_equal` (C): results with out-of-range ids equal those with padding, bit for bit.
"""

from __future__ import annotations

import collections
import functools
import math
import re

import numpy as np
from hypothesis import event

from _properties_examples import ID_MUTATIONS, MUTATIONS, Example, Spec, allowed_refusals, build, mutate
from _properties_oracle import dense_same_dtype, float64_oracle
from parity import assert_exact_as_dense

REACHED = "reached oracle"
MIN_REACHED = 3  # per A test: its explicit valid examples plus at least one drawn one
OUTCOMES = collections.Counter()  # the running A test's outcomes (pytest runs tests one at a time)


def names_one_of(error: Exception, names) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", str(error)) for n in names)


def check_exact(run, example: Example, name: str, engine: str) -> None:
    """Property A for one example; `run()` returns `engine`'s results (`allowed_refusals` says what
    it may refuse). Records the outcome in OUTCOMES and as a hypothesis event."""
    s = example.spec
    allowed = allowed_refusals(s, engine)
    if allowed:
        expected = sorted(map(str, allowed))
        try:
            run()
        except Exception as error:  # exactly an allowed type (not a subclass), naming its argument
            refusal = next((r for r in allowed if type(error) is r.error and names_one_of(error, [r.argument])), None)
            if refusal is None:
                raise AssertionError(f"{name}: {type(error).__name__}: {error}; expected one of {expected}") from error
        else:
            raise AssertionError(f"{name}: no error, expected one of {expected}")
        outcome = f"refused: {refusal.argument}"
    else:
        try:
            fast = run()
        except (ValueError, TypeError) as error:
            refused = f"{type(error).__name__}: {error}"
            raise AssertionError(f"{name}: a spec the rules accept was refused: {refused}") from error
        common = dict(dtype=s.dtype, reduction=s.reduction, upstream=example.upstream)
        if any(np.isinf(x).any() for x in example.inputs.values()):
            check_limits(fast, example, name)
        else:
            oracle = float64_oracle(example.inputs, return_metrics=s.return_metrics, **common)
            assert_exact_as_dense(fast, dense_same_dtype(example.inputs, **common), oracle, dtype=s.dtype, name=name)
        outcome = REACHED
    event(outcome)
    OUTCOMES[outcome] += 1


LIMIT_TOLERANCES = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
HUGE = 1e100  # the limit's stand-in for an infinite input entry; results above 1e50 are infinite limits


def check_limits(fast: dict, example: Example, name: str) -> None:
    """docs/precision.md's infinities: the float64 oracle with +-HUGE for +-inf is the limit (what
    it makes infinite is beyond 1e50 there, whatever the scales). Each result it makes infinite is
    that infinity (a gradient entry that multiplies the infinite entry may be NaN: 0 x inf); the
    others match it (relative to each result's largest finite entry)."""
    s = example.spec
    huge = {k: np.where(np.isinf(x), np.sign(x) * HUGE, x) for k, x in example.inputs.items() if k != "targets"}
    limit = float64_oracle({**example.inputs, **huge}, dtype=s.dtype, reduction=s.reduction, upstream=example.upstream,
                           return_metrics=s.return_metrics).truth
    d = example.inputs["hidden"].shape[-1]
    inf_columns = {"d_hidden": np.isinf(example.inputs["item_weight"]).any(0),
                   "d_item_weight": np.isinf(example.inputs["hidden"].reshape(-1, d)).any(0)}
    assert fast.keys() == limit.keys(), (sorted(fast), sorted(limit))
    for key, want in limit.items():
        got, want = np.asarray(fast[key], np.float64), np.asarray(want, np.float64)
        infinite = np.abs(want) > 1e50
        may_be_nan = np.broadcast_to(inf_columns.get(key, False), got.shape)
        ok = (got == np.sign(want) * np.inf) | (np.isnan(got) & may_be_nan)
        assert ok[infinite].all(), f"{name}:{key}: {got[infinite]} where the limit is {want[infinite]}"
        finite = ~infinite & ~may_be_nan
        if not finite.any():
            continue
        assert np.isfinite(got[finite]).all(), f"{name}:{key}: {got} where the limit is {want}"
        scale = max(float(np.abs(want[finite]).max()), 1e-30)
        error = float(np.abs(got[finite] - want[finite]).max()) / scale
        slack = 2.0 if key in ("tp", "fp", "fn", "tn") else 0.0  # a count at z = 0 may round either way
        assert error <= LIMIT_TOLERANCES[s.dtype] or np.abs(got[finite] - want[finite]).max() <= slack, (
            f"{name}:{key}: {error:.3e} off the limit: {got} vs {want}")


def counts_outcomes(test):
    """Wraps an A test (outside @given): after all its examples passed, at least half of them and
    MIN_REACHED reached the oracle (a strategy or an `assume` that drifted to refused specs fails)."""

    @functools.wraps(test)
    def counted(*args, **kwargs):
        OUTCOMES.clear()
        test(*args, **kwargs)
        reached, total = OUTCOMES[REACHED], sum(OUTCOMES.values())
        enough = max(MIN_REACHED, -(-total // 2))
        assert reached >= enough, f"{reached} of {total} examples reached the oracle: {OUTCOMES}"

    return counted


def check_refused(run, spec: Spec, mutations=MUTATIONS) -> None:
    """Property B for every mutation of `spec`'s arguments (all failures are reported together).

    `run(example, inputs, options, mutation)` runs the path on the mutated arguments; it must
    raise a ValueError or TypeError whose message names the mutated argument.
    """
    example, failures = build(spec), []
    for mutation in mutations:
        if mutation in ID_MUTATIONS and math.prod(spec.lead_shape) == 0:
            continue  # no slot for a bad id
        inputs, options, names = mutate(example.inputs, example.call_options, mutation, spec, spec.num_items)
        try:
            run(example, inputs, options, mutation)
        except (ValueError, TypeError) as error:
            if not names_one_of(error, names):
                failures.append(f"{mutation}: {type(error).__name__} naming none of {names}: {error}")
        except Exception as error:  # any other type is itself the failure to report
            failures.append(f"{mutation}: {type(error).__name__}, not a ValueError / TypeError: {error}")
        else:
            failures.append(f"{mutation}: no error (a silent answer)")
    assert not failures, "bad input not refused:\n" + "\n".join(f[:400] for f in failures)


def assert_bitwise_equal(bad: dict, clean: dict, name: str) -> None:
    """Property C: the same keys and the same bits (results are float64 copies: exact)."""
    assert bad.keys() == clean.keys(), (sorted(bad), sorted(clean))
    for key in clean:
        a, b = np.asarray(bad[key], np.float64), np.asarray(clean[key], np.float64)
        if a.shape != b.shape:
            raise AssertionError(f"{name}:{key}: shape {a.shape} with bad ids, {b.shape} with -1")
        if not np.array_equal(a.view(np.uint64), b.view(np.uint64)):
            with np.errstate(invalid="ignore"):
                diff = np.where(a.view(np.uint64) == b.view(np.uint64), 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf))
            where = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
            raise AssertionError(f"{name}:{key}: bad ids change the result: at {where} {float(a[where])!r} "
                                 f"with bad ids vs {float(b[where])!r} with -1")
