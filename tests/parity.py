"""The parity ladder's shared pieces: one tolerance table (`TOLERANCES`) and the parity rule's
check (`assert_close`), the input generators, and `jax_x64` / `enable_x64`.

Framework-neutral: inputs are numpy float64 arrays whose values are already representable in the
dtype under test (`select` rounds them), so the float64 oracle ("ground truth") sees exactly the
numbers the fast path sees and only the computation's error is measured. torch and jax are
imported lazily. Re-exported at the end, so `from parity import X` is the one import for all of
them: the framework runners and the float64 oracle (`run_torch`, `run_jax`, `float64_truth`,
`check_against_oracle`; tests/parity_runners.py) and the exact-as-dense rule
(`assert_exact_as_dense`; tests/parity_exact.py). `needs_torch` skips the comparisons with
torch's own paths in the JAX-only environment of ci/jax_newest.sh.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Mapping

import numpy as np
import pytest

# THE tolerance table of the parity ladder, used by `assert_close` and `assert_exact_as_dense`
# alike: the relative error allowed per dtype. float64 and float32 compare the fast path with the
# float64 oracle directly. The half dtypes' entries (2e-3) are the property tests' slack
# (`assert_exact_as_dense`); `assert_close` holds 16-bit results to the contract below. A test
# comparing with the oracle takes its bound from here, never a literal.
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-3, "float16": 2e-3}
# The 16-bit contract (docs/precision.md, 'The 16-bit contract'): each output's error against the
# float64 truth is at most the dense loss's run in the same dtype, or its own dtype's floor where that
# is larger. The unit roundoff of each 16-bit dtype: a gradient comes back rounded to it.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
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
    float64 oracle; `truth`, if given, is only printed). bfloat16 / float16: the 16-bit contract
    (`assert_16bit_contract`), with `reference` the dense loss run in that dtype and `truth` the
    float64 oracle. `elementwise`: each entry relative to its own reference value, not to the
    largest (for results whose entries span many orders of magnitude, e.g. per-row losses of
    confident rows). On failure the message has the max error, where it is, and the fast /
    reference / truth values.
    """
    if dtype in HALF_DTYPES:
        if truth is None:
            raise ValueError(f"{name}: the {dtype} rule needs the float64 truth")
        if not isinstance(fast, Mapping):
            fast, reference, truth = {"output": fast}, {"output": reference}, {"output": truth}
        assert_16bit_contract(fast, reference, truth, dtype=dtype, name=name)
        return
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
    err, index = relative_error(fast_np, ref_np, elementwise=elementwise)
    if err <= tol:
        return
    values = [f"fast={fast_np[index]!r}", f"reference={ref_np[index]!r}"]
    if truth is not None:
        values.append(f"truth={to_numpy(truth)[index]!r}")
    raise AssertionError(f"{name} [{dtype}]: relative error {err:.3e} > {tol:g} at index {index}: " + ", ".join(values))


def contract_floor(key: str, dtype: str) -> float:
    """The error the 16-bit contract allows `key` whatever the dense loss does: the float32 rule for
    the float32 outputs (the loss, the metric counts), and for a gradient, which comes back in
    `dtype`, one rounding to it after that rule (no engine can return a closer `dtype` number)."""
    if key == "loss" or key in METRIC_NAMES:
        return TOLERANCES["float32"]
    return UNIT_ROUNDOFF[dtype] + TOLERANCES["float32"]


def assert_16bit_contract(fast: Mapping, dense: Mapping, truth: Mapping, *, dtype: str, name: str) -> None:
    """The 16-bit contract (docs/precision.md) for one call's results, output by output.

    `dense`: the dense loss run in `dtype` (`conformance_engines.same_dtype_dense`); `truth`: the
    float64 oracle. err(x) is the error against `truth`: per row for the loss (each entry against
    its own truth: `relative_error(..., elementwise=True)`; a scalar loss is one row), normwise
    (`relative_error`) for every gradient and metric count. Each output must have
    err(fast) <= max(err(dense), contract_floor(key, dtype)), each row of the loss on its own.
    """
    missing = (set(dense) | set(truth)) ^ set(fast)
    assert not missing, f"{name}: results differ in keys {sorted(missing)}"
    for key in truth:
        got, ref, want = to_numpy(fast[key]), to_numpy(dense[key]), to_numpy(truth[key])
        floor = contract_floor(key, dtype)
        if key == "loss":  # row by row
            got, ref, want = (np.atleast_1d(x).reshape(-1, 1) for x in (got, ref, want))
        else:  # one normwise error for the whole output
            got, ref, want = (x.reshape(1, -1) for x in (got, ref, want))
        for row, (g, r, w) in enumerate(zip(got, ref, want)):
            err, index = relative_error(g, w)
            dense_err, _ = relative_error(r, w)
            if err > max(dense_err, floor):
                where = f"row {row}" if key == "loss" else f"flat index {index[0]}"
                raise AssertionError(
                    f"{name}:{key} [{dtype}]: error vs float64 truth {err:.3e} > max(dense {dtype}'s {dense_err:.3e}, "
                    f"floor {floor:.1e}) at {where}: fast={g[index]!r}, dense={r[index]!r}, truth={w[index]!r}")


# -- inputs -----------------------------------------------------------------------------------


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 array of the values `x` takes in `dtype` (round to nearest even)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x.copy()
    f32 = x.astype(np.float32)
    if dtype == "float32":
        return f32.astype(np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"unknown dtype {dtype!r}")
    bits = f32.view(np.uint32).astype(np.uint64)
    u = np.uint64  # numpy 1.x promotes uint64 with a Python int to float64 (no shifts); typed constants do not
    bits = (bits + u(0x7FFF) + ((bits >> u(16)) & u(1))) & u(0xFFFF0000)
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


# -- re-exports: the runners and the exact-as-dense rule import the pieces above from here, so these
# imports come last (import those modules through `parity`, never first on their own).

from parity_exact import (  # noqa: E402, F401
    EPSILON,
    LARGEST,
    UNDERFLOW,
    _failure,
    _normwise,
    _worst_excess,
    assert_exact_as_dense,
    normwise_error,
)
from parity_runners import (  # noqa: E402, F401
    _collect,
    _jitted_dense_cut_bce,
    check_against_oracle,
    float64_truth,
    run_jax,
    run_torch,
)
