"""The exact-as-dense rule (issue 11, docs/design.md 'Precision'): `assert_exact_as_dense`; import it
from `parity`. Its float64 oracle is tests/_properties_oracle.py; its relative tolerance is
`parity.TOLERANCES`, the one table.
"""

from __future__ import annotations

import numpy as np

from parity import _TINY, HALF_DTYPES, METRIC_NAMES, TOLERANCES, to_numpy


# Per dtype: machine epsilon (`eps`); the relative tolerance (`tol`) is TOLERANCES, the one table.
EPSILON = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
# The absolute error of underflow per term, per result dtype (`Oracle.flush`): the smallest normal
# number (XLA on CPU flushes subnormals to zero); float16 (torch only, which keeps subnormals) one
# subnormal step, as its 'mean' gradients are often there.
UNDERFLOW = {"float64": 2.0**-1022, "float32": 2.0**-126, "bfloat16": 2.0**-126, "float16": 2.0**-24}
# The largest finite value per dtype: a truth beyond it must overflow (or saturate) with its sign.
LARGEST = {"float64": float(np.finfo(np.float64).max), "float32": float(np.finfo(np.float32).max),
           "bfloat16": 3.3895313892515355e38, "float16": 65504.0}


def normwise_error(x, truth) -> tuple[float, tuple[int, ...]]:
    """`(max |x - truth| / max |truth|, index of the max)`; NaN / Inf against a finite truth is infinite."""
    x, truth = to_numpy(x), to_numpy(truth)
    if x.shape != truth.shape:
        raise AssertionError(f"shape mismatch: {x.shape} vs truth {truth.shape}")
    if x.size == 0:
        return 0.0, ()
    with np.errstate(invalid="ignore"):
        diff = np.abs(x - truth)
    same = (x == truth) | (np.isnan(x) & np.isnan(truth))
    diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
    index = np.unravel_index(int(np.argmax(diff)), diff.shape)
    scale = float(np.max(np.abs(truth), initial=0.0, where=np.isfinite(truth)))
    if diff[index] == 0:
        return 0.0, tuple(int(i) for i in index)
    return float(diff[index]) / max(scale, _TINY), tuple(int(i) for i in index)


def _failure(name, rule, index, fast, dense, truth):
    index = tuple(int(i) for i in index)
    at = lambda a: None if a is None else float(np.asarray(a)[index])
    values = f"fast={at(fast)!r}, dense={at(dense)!r}, truth={at(truth)!r}"
    return AssertionError(f"{name}: {rule} at index {index}: {values}")


def assert_exact_as_dense(fast, dense, oracle, *, dtype: str, name: str) -> None:
    """The exact-as-dense rule (docs/design.md, 'Precision') for one example's results.

    `fast`: {name: array} from the path under test; `dense`: `dense_same_dtype`'s results on the
    same inputs; `oracle`: `float64_oracle`'s (both in tests/_properties_oracle.py).
    tol = TOLERANCES[dtype] (the same table as `assert_close`), eps = EPSILON[dtype].

    - loss, float32 / float64, elementwise (each row of 'none', or the scalar):
      |fast - truth| <= tol * A + 4 * eps * B + flush, with A = the float64 sum of |element losses|
      feeding that output, B = its first-order sensitivity to rounding the logits,
      sum of |d output / d z[n, v]| * (sum_d |h[n, d] E[v, d]| + |b[v]|) over those elements, and
      flush = `Oracle.flush` (subnormal terms: XLA on CPU flushes them to zero).
    - loss, bfloat16 / float16 (CCE's rule), normwise: err(fast) <= err(dense) + tol, with
      err(x) = max |x - truth| / max |truth| (+ flush, absolute).
    - every gradient, every dtype, CCE's rule plus the conditioning of each entry, elementwise:
      |fast - truth| <= (err(dense) + tol) * max |truth| + slack, where C is the entry's
      `grad_scale` (sum of |terms| and their logit-rounding sensitivity: a heavily cancelling entry
      has as few correct digits in any summation order) and flush = `Oracle.flush`:
      float32 / float64: slack = 4 * eps * C + flush (eps of the accumulation, the input dtype);
      bfloat16 / float16: slack = eps / 2 * (C + |truth|) + flush: their matmul inputs (dz too) may
      be rounded to the half dtype (unit roundoff eps / 2 on every term), and the result, returned
      in it, may round to the other neighbour (tol, 2e-3, is less than half an ulp above 2^k).
    - loss, all dtypes: fast >= 0 wherever every element loss feeding it is >= 0 (so truth >= 0;
      with negative weights a tiny true sum may round either way).
    - metrics (tp, fp, fn, tn): |fast - truth| <= the oracle's slack: exact, except for logits
      within rounding of 0 and the float32 rounding of weighted counts.

    Missing or extra result names fail. On failure the message has the max error, where, and the
    fast / dense / truth values there.
    """
    truth, tol, eps = oracle.truth, TOLERANCES[dtype], EPSILON[dtype]
    missing = set(truth) ^ set(fast)
    assert not missing, f"{name}: results differ in keys {sorted(missing)} (fast {sorted(fast)}, truth {sorted(truth)})"
    got = {k: to_numpy(v) for k, v in fast.items()}
    for key in truth:
        if got[key].shape != truth[key].shape:
            raise AssertionError(f"{name}:{key} shape {got[key].shape} != truth's {truth[key].shape}")
    loss, true_loss, dense_loss = got["loss"], truth["loss"], to_numpy(dense["loss"])
    if dtype in HALF_DTYPES:
        _normwise(f"{name}:loss", loss, dense_loss, true_loss, tol, oracle.flush["loss"], dtype, "float32")
    else:
        bound = tol * oracle.loss_abs + 4 * eps * oracle.loss_sensitivity + oracle.flush["loss"]
        i = _worst_excess(loss, true_loss, bound)
        if i is not None:
            rule = (f"|fast - truth| = {abs(loss[i] - true_loss[i]):.3e} > tol*A + 4*eps*B + flush = {bound[i]:.3e} "
                    f"(A={oracle.loss_abs[i]:.3e}, B={oracle.loss_sensitivity[i]:.3e}) [{dtype}]")
            raise _failure(f"{name}:loss", rule, i, loss, dense_loss, true_loss)
    below = oracle.nonnegative & (loss < 0)
    if np.any(below):
        i = np.unravel_index(int(np.argmax(below)), below.shape)
        raise _failure(f"{name}:loss", "below zero where every element loss is >= 0", i, loss, dense_loss, true_loss)
    for key in truth:
        if key.startswith("d_"):
            if dtype in HALF_DTYPES:
                slack = eps / 2 * (oracle.grad_scale[key] + np.abs(truth[key])) + oracle.flush[key]
            else:
                slack = 4 * eps * oracle.grad_scale[key] + oracle.flush[key]
            _normwise(f"{name}:{key}", got[key], to_numpy(dense[key]), truth[key], tol, slack, dtype, dtype)
        elif key in METRIC_NAMES:
            i = _worst_excess(got[key], truth[key], oracle.count_slack[key])
            if i is not None:
                rule = f"count off by {abs(got[key][i] - truth[key][i]):g} > slack {oracle.count_slack[key][i]:g}"
                raise _failure(f"{name}:{key}", rule, i, got[key], None, truth[key])


def _worst_excess(got, truth, allowed):
    """The index where |got - truth| - allowed is largest if positive, else None (NaN vs a number: inf)."""
    with np.errstate(invalid="ignore"):
        excess = np.abs(got - truth) - allowed
    same = (got == truth) | (np.isnan(got) & np.isnan(truth))
    excess = np.where(same, -np.inf, np.where(np.isnan(excess), np.inf, excess))
    if not excess.size or np.max(excess) <= 0:
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), excess.shape))


def _normwise(name, fast, dense, truth, tol, slack, dtype, result_dtype):
    """|fast - truth| <= (err(dense) + tol) * max |truth| + slack, elementwise (slack: a scalar or
    an array of truth's shape); NaN / Inf where truth is finite fail. Entries whose truth is beyond
    `result_dtype`'s range must overflow (to inf or the largest finite) with the truth's sign, and
    are left out of the norms."""
    beyond = np.abs(truth) > LARGEST[result_dtype]
    if np.any(beyond):
        wrong = beyond & ~((np.sign(fast) == np.sign(truth)) & (np.abs(fast) >= LARGEST[result_dtype]))
        if np.any(wrong):
            i = tuple(int(j) for j in np.argwhere(wrong)[0])
            raise _failure(name, f"truth beyond {result_dtype}'s range, fast neither overflows nor saturates",
                           i, fast, dense, truth)
        fast, dense, truth = (np.where(beyond, 0.0, x) for x in (fast, dense, truth))
    err, _ = normwise_error(fast, truth)
    dense_err, _ = normwise_error(dense, truth)
    if not np.isfinite(dense_err):
        return  # the dense reference itself overflowed: no finite bound to hold fast to
    scale = float(np.max(np.abs(truth), initial=0.0, where=np.isfinite(truth)))
    allowed = (dense_err + tol) * scale if scale > 0 else 0.0  # inf * 0 would be NaN
    i = _worst_excess(fast, truth, allowed + slack)
    if i is not None:
        rule = (f"normwise error {err:.3e} > dense {dtype} error {dense_err:.3e} + {tol:g} "
                f"(+ slack {float(np.broadcast_to(slack, np.shape(truth))[i]):.1e} at the worst entry)")
        raise _failure(name, rule, i, fast, dense, truth)
