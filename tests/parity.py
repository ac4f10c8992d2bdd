"""The parity ladder's shared pieces: one tolerance table (`TOLERANCES`) and its two checks
(`assert_close`, `assert_exact_as_dense`), the input generators, and `jax_x64` / `enable_x64`.

Framework-neutral: inputs are numpy float64 arrays whose values are already representable in the
dtype under test (`select` rounds them), so the float64 oracle ("ground truth") sees exactly the
numbers the fast path sees and only the computation's error is measured. `run_torch` / `run_jax`
are the small adapters that turn those arrays into tensors, run a loss function with a random
upstream gradient, and hand back numpy results keyed by name (loss, d_<input>, tp, fp, fn, tn).
torch and jax are imported lazily, inside the adapters. `float64_truth` is the oracle's results:
torch's dense loss, or JAX's where torch is not installed (the JAX-only environment of
ci/jax_newest.sh); `needs_torch` skips the comparisons with torch's own paths there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
from collections.abc import Mapping

import numpy as np
import pytest

# THE tolerance table of the parity ladder, used by `assert_close` and `assert_exact_as_dense`
# alike: the relative error allowed per dtype. float64 and float32 compare the fast path with the
# float64 oracle directly. The half dtypes (bfloat16; float16, torch only) follow Apple CCE's rule:
# the fast path's error against the float64 truth may exceed the dense reference's error in that
# dtype by at most this (2e-3 ~ 2^-9, one bfloat16 rounding: the fast path returns its gradients in
# the half dtype). A test comparing with the oracle takes its bound from here, never a literal.
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-3, "float16": 2e-3}
HALF_DTYPES = ("bfloat16", "float16")
DTYPES = ("float64", "float32", "bfloat16")  # the dtypes every path takes (float16: torch only)
REDUCTIONS = ("none", "sum", "mean")
OPTIONAL = ("bias", "weight", "class_weight", "pos_weight")
OPTION_SETS = {
    "plain": (),
    "bias": ("bias",),
    "weight": ("weight",),
    "class_weight": ("class_weight",),
    "pos_weight": ("pos_weight",),
    "all": OPTIONAL,
}
METRIC_NAMES = ("tp", "fp", "fn", "tn")
GRADS = ("hidden", "item_weight", "bias", "weight")  # the differentiable inputs (class/pos weights are constants)
_TINY = 1e-30
HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="compares with torch_cutbce's torch paths; this environment has jax only (ci/jax_newest.sh)"
)


def to_numpy(x) -> np.ndarray:
    """A float64 numpy copy of a numpy / torch / JAX array (bfloat16 included)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch
        return x.detach().cpu().to(dtype=_torch().float64).numpy()
    return np.asarray(x, dtype=np.float64)


def relative_error(fast, reference, *, elementwise=False) -> tuple[float, tuple[int, ...]]:
    """`(max |fast - reference| / max(max |finite reference|, tiny), index of the max)`; with
    `elementwise`, `max |fast - reference| / max(|reference|, tiny)` (each entry on its own).

    Equal values (NaN and NaN, Inf and Inf included) differ by 0; NaN against a number is infinite.
    """
    fast, reference = to_numpy(fast), to_numpy(reference)
    if fast.shape != reference.shape:
        raise AssertionError(f"shape mismatch: fast {fast.shape} vs reference {reference.shape}")
    if fast.size == 0:
        return 0.0, ()
    with np.errstate(invalid="ignore"):
        diff = np.abs(fast - reference)
    same = (fast == reference) | (np.isnan(fast) & np.isnan(reference))  # equal infinities too
    diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
    if elementwise:
        with np.errstate(invalid="ignore"):
            diff = np.where(diff == 0, 0.0, diff / np.maximum(np.abs(reference), _TINY))
        diff = np.where(np.isnan(diff), np.inf, diff)
        index = np.unravel_index(int(np.argmax(diff)), diff.shape)
        return float(diff[index]), tuple(int(i) for i in index)
    index = np.unravel_index(int(np.argmax(diff)), diff.shape)
    finite = np.abs(reference[np.isfinite(reference)])
    scale = max(float(finite.max()) if finite.size else 0.0, _TINY)
    return float(diff[index]) / scale, tuple(int(i) for i in index)


def assert_close(fast, reference, truth=None, *, dtype: str, name: str, elementwise: bool = False) -> None:
    """Asserts the parity rule for `dtype`; a mapping of results is checked key by key.

    float64 / float32: relative_error(fast, reference) <= TOLERANCES[dtype] (reference = the
    float64 oracle; `truth`, if given, is only printed). bfloat16 / float16: `reference` is the
    dense reference run in that dtype and `truth` the float64 oracle; the rule is
    relative_error(fast, truth) <= relative_error(reference, truth) + TOLERANCES[dtype].
    `elementwise`: each entry relative to its own reference value, not to the largest (for results
    whose entries span many orders of magnitude, e.g. per-row losses of confident rows).
    On failure the message has the max error, where it is, and the fast / reference / truth values.
    """
    tol = TOLERANCES[dtype]
    if isinstance(fast, Mapping):
        missing = set(reference) ^ set(fast)
        assert not missing, f"{name}: results differ in keys {sorted(missing)}"
        for key in reference:
            sub_truth = None if truth is None else truth[key]
            # Metric counts are float32 by contract (docs/design.md, 'Metrics'), whatever the input dtype.
            sub_dtype = "float32" if key in METRIC_NAMES and dtype == "float64" else dtype
            assert_close(fast[key], reference[key], sub_truth, dtype=sub_dtype, name=f"{name}:{key}",
                         elementwise=elementwise)
        return
    fast_np, ref_np = to_numpy(fast), to_numpy(reference)
    truth_np = None if truth is None else to_numpy(truth)
    if dtype in HALF_DTYPES:
        if truth_np is None:
            raise ValueError(f"{name}: the {dtype} rule needs the float64 truth")
        err, index = relative_error(fast_np, truth_np, elementwise=elementwise)
        ref_err, _ = relative_error(ref_np, truth_np, elementwise=elementwise)
        bound = ref_err + tol
        rule = f"error vs float64 truth {err:.3e} > dense {dtype} reference's {ref_err:.3e} + {tol:g}"
    else:
        err, index = relative_error(fast_np, ref_np, elementwise=elementwise)
        bound = tol
        rule = f"relative error {err:.3e} > {tol:g}"
    if err <= bound:
        return
    values = [f"fast={fast_np[index]!r}", f"reference={ref_np[index]!r}"]
    if truth_np is not None:
        values.append(f"truth={truth_np[index]!r}")
    raise AssertionError(f"{name} [{dtype}]: {rule} at index {index}: " + ", ".join(values))


# -- inputs -----------------------------------------------------------------------------------


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 array of the values `x` takes in `dtype` (round to nearest even)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x.copy()
    f32 = x.astype(np.float32)
    if dtype == "float32":
        return f32.astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"unknown dtype {dtype!r}")
    bits = f32.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def make_inputs(lead_shape, num_items, hidden_size, num_slots, *, seed=0, scale=1.0, large_logits=True):
    """Random CutBCE inputs as float64 / int64 numpy arrays, with every awkward case built in.

    Logits are about N(0, scale^2). Targets `[*S, L]` hold -1 padding spread through the rows, a
    -7 padding id, duplicate ids, a row with no positives (row 0), a row repeating id V-1 (row 1).
    With `large_logits` (and N >= 4): row N-1 has a positive whose logit is ~ +80 and negatives of
    magnitude ~ 80/sqrt(D); row N-2 a positive at ~ -60; row N-3 logits ~ N(0, 40^2).
    Options: bias ~ N(0, 0.5); weight in [0.5, 1.5] with zeros (masked positions);
    class_weight in [0.5, 2] with zeros; pos_weight in [0.5, 3].
    """
    rng = np.random.default_rng(seed)
    lead_shape = tuple(lead_shape)
    n, v, d, slots = math.prod(lead_shape), num_items, hidden_size, num_slots
    item_weight = rng.normal(size=(v, d)) / math.sqrt(d)
    hidden = scale * rng.normal(size=(n, d))
    targets = np.full((n, slots), -1, dtype=np.int64)
    for row in range(n):
        count = int(rng.integers(1, slots + 1))
        targets[row, :count] = rng.integers(0, v, size=count)
        if count >= 2 and row % 2 == 0:
            targets[row, 1] = targets[row, 0]  # a duplicate: counts once
        rng.shuffle(targets[row])  # padding between ids, not only at the end
    if n > 2 and slots > 1:
        targets[2, -1] = -7  # any negative id is padding
    targets[0] = -1  # a row with no positives
    if n > 1:
        targets[1] = v - 1  # the last item, repeated
    if large_logits and n >= 4:
        for row, logit in ((n - 1, 80.0), (n - 2, -60.0)):
            item = int(rng.integers(0, v))
            targets[row, 0] = item
            hidden[row] = logit * item_weight[item] / (item_weight[item] @ item_weight[item])
        hidden[n - 3] *= 40.0 / scale
    weight = rng.uniform(0.5, 1.5, size=n)
    weight[2 : max(n - 3, 2) : 4] = 0.0  # masked positions, away from the large-logit rows
    class_weight = rng.uniform(0.5, 2.0, size=v)
    class_weight[3::7] = 0.0
    return {
        "hidden": hidden.reshape(*lead_shape, d),
        "item_weight": item_weight,
        "targets": targets.reshape(*lead_shape, slots),
        "bias": rng.normal(scale=0.5, size=v),
        "weight": weight.reshape(lead_shape),
        "class_weight": class_weight,
        "pos_weight": rng.uniform(0.5, 3.0, size=v),
    }


def select(inputs, options=OPTIONAL, dtype="float64"):
    """hidden, item_weight, targets and the named options, float values rounded to `dtype`."""
    names = ("hidden", "item_weight", "targets", *options)
    return {k: inputs[k] if k == "targets" else round_to_dtype(inputs[k], dtype) for k in names}


def make_upstream(reduction, lead_shape, *, seed=0, dtype="float64"):
    """A random, non-uniform upstream gradient: shape S for 'none' (mixed signs), else a scalar."""
    rng = np.random.default_rng(10_000 + seed)
    shape = tuple(lead_shape) if reduction == "none" else ()
    upstream = rng.normal(size=shape) + (0.0 if reduction == "none" else 1.5)
    return round_to_dtype(upstream, dtype)


# -- framework adapters -----------------------------------------------------------------------


def _torch():
    import torch

    return torch


def torch_dtype(dtype: str):
    return getattr(_torch(), dtype)


def jax_dtype(dtype: str):
    import jax.numpy as jnp

    return getattr(jnp, dtype)


def enable_x64(on: bool = True):
    """A context that sets JAX's x64 mode to `on` in this thread, on every JAX the tests run.

    `jax.enable_x64` from jax 0.8.0; before it `jax.experimental.enable_x64`, which jax 0.9.0 removed.
    """
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(on)
    from jax.experimental import enable_x64 as experimental_enable_x64

    return experimental_enable_x64(on)


def jax_x64(dtype: str = "float64"):
    """A context with JAX's x64 mode on for a float64 case, else one that changes nothing.

    The test session runs with x64 off, JAX's default and what users run (tests/conftest.py); only
    a float64 case switches it on, locally (`enable_x64`, thread-local). Without x64, JAX would
    silently turn float64 inputs into float32. Arrays and jitted functions made inside stay valid
    outside; a jitted function traces again under the other setting.
    """
    if dtype != "float64":
        return contextlib.nullcontext()
    return enable_x64(True)


def _collect(loss, metrics, grads):
    results = {"loss": loss, **grads}
    if metrics is not None:
        results.update(zip(METRIC_NAMES, metrics))
    return {k: to_numpy(x) for k, x in results.items()}


def check_against_oracle(run, fn, same_dtype_reference, inputs, lead_shape, *, dtype, reduction, name, seed=0,
                         grad_names=GRADS, **kwargs):
    """The parity rule of `dtype` for the loss, gradients and metrics of `fn` vs the float64 dense oracle.

    `run` is `run_torch` or `run_jax` (the fast path's framework); the upstream gradient is random
    and non-uniform. For bfloat16 the rule is CCE's: `fn`'s error against the float64 truth may
    exceed `same_dtype_reference`'s (the dense loss run in bfloat16 by `run`) by the tolerance.
    Returns `fn`'s results.
    """
    upstream = make_upstream(reduction, lead_shape, seed=seed, dtype=dtype)
    common = dict(upstream=upstream, grad_names=grad_names, reduction=reduction)
    fast = run(fn, inputs, dtype=dtype, **common, **kwargs)
    truth = float64_truth(inputs, **common)
    if dtype == "bfloat16":
        same_dtype = run(same_dtype_reference, inputs, dtype="bfloat16", **common)
        assert_close(fast, same_dtype, truth, dtype=dtype, name=name)
    else:
        assert_close(fast, truth, dtype=dtype, name=name)
    return fast


def float64_truth(inputs, *, upstream, grad_names=GRADS, reduction, **kwargs):
    """The float64 oracle's loss, gradients and metrics: torch's `dense_bce_with_logits`, or without
    torch `jax_kernels.dense_cut_bce` (x64 on), the same loss (test_reference.py checks the two)."""
    common = dict(dtype="float64", upstream=upstream, grad_names=grad_names, reduction=reduction, **kwargs)
    if HAVE_TORCH:
        from torch_cutbce import dense_bce_with_logits

        return run_torch(dense_bce_with_logits, inputs, **common)
    return run_jax(_jitted_dense_cut_bce(), inputs, **common)


@functools.cache
def _jitted_dense_cut_bce():
    """`jax_kernels.dense_cut_bce` under one `jit` (eagerly, each of its ops would compile apart)."""
    import jax

    from jax_kernels import dense_cut_bce

    return jax.jit(dense_cut_bce, static_argnames=("reduction", "return_metrics"))


def run_torch(fn, inputs, *, dtype, upstream, grad_names=GRADS,
              device="cpu", return_metrics=True, **kwargs):
    """Runs `fn(hidden, item_weight, targets, bias, *, weight, class_weight, pos_weight, **kwargs)`.

    Float inputs become `dtype` tensors on `device`; those in `grad_names` require grad and get
    `d_<name>` from `torch.autograd.grad(loss, ..., grad_outputs=upstream)`.
    """
    torch = _torch()
    tensors = {}
    for key, value in inputs.items():
        if key == "targets":
            tensors[key] = torch.tensor(value, device=device)
        else:
            t = torch.tensor(value, dtype=torch.float64).to(device=device, dtype=torch_dtype(dtype))
            tensors[key] = t.requires_grad_(key in grad_names)
    out = fn(tensors["hidden"], tensors["item_weight"], tensors["targets"], tensors.get("bias"),
             weight=tensors.get("weight"), class_weight=tensors.get("class_weight"),
             pos_weight=tensors.get("pos_weight"), return_metrics=return_metrics, **kwargs)
    loss, metrics = out if return_metrics else (out, None)
    wrt = [k for k in tensors if tensors[k].requires_grad]
    grads = {}
    if wrt:
        g = torch.tensor(upstream, dtype=torch.float64).to(device=device, dtype=loss.dtype)
        values = torch.autograd.grad(loss, [tensors[k] for k in wrt], grad_outputs=g)
        grads = {f"d_{k}": value for k, value in zip(wrt, values)}
    return _collect(loss, metrics, grads)


def run_jax(fn, inputs, *, dtype, upstream, grad_names=GRADS,
            return_metrics=True, **kwargs):
    """The JAX twin of `run_torch`: gradients from `jax.vjp` with `upstream` as the cotangent.

    Runs eagerly (pass a `jax.jit`-ed `fn` to test under jit): for the small shapes of the tests,
    eager dispatch compiles less on CPU than one `jit` of the loss and its vjp. x64 is on for
    float64 only (`jax_x64`); other dtypes run in the caller's setting (off, unless it switched it on).
    """
    import jax
    import jax.numpy as jnp

    with jax_x64(dtype):
        arrays = {k: jnp.asarray(v) if k == "targets" else jnp.asarray(v, dtype=jax_dtype(dtype))
                  for k, v in inputs.items()}
        diff = {k: arrays.pop(k) for k in grad_names if k in arrays}

        def loss_fn(diff_arrays):
            a = {**arrays, **diff_arrays}
            out = fn(a["hidden"], a["item_weight"], a["targets"], a.get("bias"), weight=a.get("weight"),
                     class_weight=a.get("class_weight"), pos_weight=a.get("pos_weight"),
                     return_metrics=return_metrics, **kwargs)
            return out if return_metrics else (out, None)

        loss, vjp, metrics = jax.vjp(loss_fn, diff, has_aux=True)
        (cotangents,) = vjp(jnp.asarray(upstream, dtype=loss.dtype))
        return _collect(loss, metrics, {f"d_{k}": value for k, value in cotangents.items()})


# -- the exact-as-dense rule (issue 11); its float64 oracle is tests/_properties_oracle.py -------

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
