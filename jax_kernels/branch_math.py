"""Each element's `(loss, slope)` on its own branch, in JAX: the one place this math is written.

Used by the blocked loop's tiles (`blocked/negative_tile.py`), its positives (`blocked/loop.py`) and
the Pallas kernel bodies (`pallas/kernels.py`, float32 inside Mosaic). Its sisters:
`torch_cutbce/branch_math.py` and the C kernel `jax_kernels/neutral/cpu_tile.c` (plain BCE, float32
CPU tiles); `tests/test_branch_math.py` pins the three against float64. With `u` the logit seen
from the element's label (`z` for a negative, `-z` at a positive) and `e = exp(-|u|)` in (0, 1]:

    softplus(u) = max(u, 0) + log1p(e)          sigmoid(u) = (1 if u >= 0 else e) / (1 + e)
    focal:  term(u) = sigmoid(u)^gamma softplus(u)
            term'(u) = sigmoid(u)^gamma (gamma sigmoid(-u) softplus(u) + sigmoid(u))

Every factor is nonnegative and formed without cancellation, exact to rounding for any u (the
derivation: docs/design.md, 'The focal variant'). A negative at z = -inf (a positive taken out of
its tile) has loss 0 and slope 0. Only jnp ops and static Python control flow: Mosaic lowers all of
it (no log1p: the polynomial below).
"""

from __future__ import annotations

import jax.numpy as jnp


def log1p_unit(e):
    """log1p(e) for e in [0, 1] without log1p: 2 atanh(t) = 2 t P(t^2), t = e / (2 + e) in [0, 1/3].

    P(s) ~ atanh(sqrt(s)) / sqrt(s) is a degree-4 least-squares fit on s in [0, 1/9] (float64
    fit): relative error 4e-9 for every e, e -> 0 included, under float32's 6e-8. The coefficients
    are the C kernel's and torch_cutbce/branch_math.py's. XLA:CPU's log1p costs about 3x this
    divide and five multiply-adds (benchmarks/NOTES.md).
    """
    t = e / (2 + e)
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2 * t * (1.0000000038619887 + s * p)


def log1p_tail(e):
    """log1p(e), e in [0, 1]: the polynomial (float32 and narrower), or float64's own log1p."""
    return jnp.log1p(e) if e.dtype == jnp.float64 else log1p_unit(e)


def exp_neg_abs(u):
    """`e = exp(-|u|)` in (0, 1]: never overflows; one exp serves softplus, sigmoid and focal."""
    return jnp.exp(-jnp.abs(u))


def softplus(u, e, tail=None):
    """`softplus(u) = max(u, 0) + log1p(e)`, from `e = exp(-|u|)` (or its `tail = log1p(e)`)."""
    return jnp.maximum(u, 0) + (log1p_tail(e) if tail is None else tail)


def _one(x):
    """1 in x's dtype: under x64 a Python scalar in `jnp.where` would not lower in a Pallas kernel."""
    return jnp.ones((), x.dtype)


def sigmoid(u, e):
    """`sigmoid(u) = (1 if u >= 0 else e) / (1 + e)`, from `e = exp(-|u|)`."""
    return jnp.where(u >= 0, _one(e), e) / (1 + e)


def sigmoid_flip(u, e):
    """`sigmoid(-u) = (e if u >= 0 else 1) / (1 + e)`, from `e = exp(-|u|)`."""
    return jnp.where(u >= 0, e, _one(e)) / (1 + e)


def focal_factor(u, e, tail, gamma: float):
    """`sigmoid(u)^gamma = exp(-gamma softplus(-u))`, split so that no large exp argument is rounded.

    With gamma = k + f (k an integer, f in [0, 1)) and `softplus(-u) = max(-u, 0) + tail`:

        sigmoid(u)^gamma = exp(-gamma tail - f max(-u, 0)) (e if u < 0 else 1)^k

    `exp(-gamma softplus(-u))` taken at once carries the rounding of `gamma |u|` into the result;
    here e^k is k roundings and `f |u|` has f < 1 (the errors of both forms: benchmarks/NOTES.md
    section 11). gamma is a static Python float; f = 0 leaves its term out (at u = -inf, a
    positive taken out of its tile, 0 * inf would be NaN; there e = 0 and the factor is 0).
    """
    k = int(gamma)
    frac = gamma - k
    exponent = -gamma * tail
    if frac:
        exponent = exponent + jnp.minimum(u, 0) * frac  # - f max(-u, 0), exactly
    factor = jnp.exp(exponent)
    if k:
        factor = factor * _integer_power(jnp.where(u < 0, e, _one(e)), k)
    return factor


def _integer_power(x, k: int):
    """`x ** k` for a static int k >= 1 by squaring (plain multiplies: Mosaic lowers them all)."""
    result = None
    while k:
        if k & 1:
            result = x if result is None else result * x
        k >>= 1
        if k:
            x = x * x
    return result


def focal_terms(u, e, gamma: float):
    """`(term(u), term'(u))` of focal CutBCE (module docstring) from `e = exp(-|u|)`. gamma is a
    static float (`gamma = 0` without class balancing never comes here: the plain code runs)."""
    tail = log1p_tail(e)
    factor = focal_factor(u, e, tail, gamma)
    plus = softplus(u, e, tail)
    return factor * plus, factor * (gamma * sigmoid_flip(u, e) * plus + sigmoid(u, e))


def branch_terms(z, positive: bool, focal=None):
    """`(loss, slope)` of every element of `z` on one branch, before any weight: a negative's
    `(softplus(z), sigmoid(z))` or a positive's `(softplus(-z), -sigmoid(-z))`; with a
    `jax_kernels.neutral.focal.Focal`, `term` and its slope times focal's scale of that branch.
    `slope` is d loss / dz."""
    u = -z if positive else z
    e = exp_neg_abs(z)
    if focal is None:
        loss, slope = softplus(u, e), sigmoid(u, e)
    else:
        loss, slope = focal_terms(u, e, focal.gamma)
        scale = focal.positive_scale if positive else focal.negative_scale
        if scale != 1.0:
            loss, slope = loss * scale, slope * scale
    return loss, (-slope if positive else slope)  # du/dz = -1 at a positive
