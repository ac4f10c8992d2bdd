"""Each element's `(loss, slope)` on its own branch, in JAX: the one place this math is written.

Used by the blocked loop's tiles (`blocked/negative_tile.py`), its positives (`blocked/loop.py`) and
the Pallas kernel bodies (`pallas/kernels.py`, float32 inside Mosaic). Its sisters:
`torch_cutbce/branch_math.py` and the C kernel `cutbce_common/cpu_tile.c` (plain BCE, float32
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
    divide and five multiply-adds (benchmarks/results/cpu_speed.md, 'The tile kernel').
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
    here e^k is k roundings and `f |u|` has f < 1 (the errors of both forms: benchmarks/results/cpu_speed.md,
    'Focal'). gamma is a static Python float; f = 0 leaves its term out (at u = -inf, a
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


def loss_terms(u, e, loss):
    """`(term(u), term'(u))` of a `cutbce_common.loss.Loss` (static), before the branch scale,
    from `e = exp(-|u|)` (the formulas: the Loss module's docstring). With c = 0 the focal factor
    is `focal_factor`'s exact split; with c > 0 it is `q^gamma = exp(gamma log q)`, q >= c > 0.

        B = (1 - c) max(u, 0) + c max(-u, 0) + log1p(e)         B' = sigmoid(u) - c
        term' = q^gamma (B' + gamma (1 - 2c) sigmoid(u) sigmoid(-u) B / q)
    """
    form, numbers = loss.form(), loss.numbers()
    c = numbers.half_smoothing
    tail = log1p_tail(e)
    sigmoid_u = sigmoid(u, e)
    if form.smoothing:
        plus = (1 - c) * jnp.maximum(u, 0) - c * jnp.minimum(u, 0) + tail
        slope = sigmoid_u - c
    else:
        plus, slope = softplus(u, e, tail), sigmoid_u
    if not form.focal:
        return plus, slope
    if form.smoothing:
        q = c + (1 - 2 * c) * sigmoid_u
        factor = jnp.exp(numbers.gamma * jnp.log(q))
        bend = (1 - 2 * c) * sigmoid_u * sigmoid_flip(u, e) / q
    else:
        factor, bend = focal_factor(u, e, tail, numbers.gamma), sigmoid_flip(u, e)
    bent = jnp.where(bend == 0, 0.0, numbers.gamma * bend * plus)  # bend -> 0 as plus -> inf: the limit 0, not NaN
    return factor * plus, factor * (bent + slope)


def _scaled(loss_value, slope, positive, loss):
    """Times the branch's class balance (`Loss.numbers()`: 1 unless balanced); `positive` a bool or
    a boolean array."""
    if not loss.form().balanced:
        return loss_value, slope
    numbers = loss.numbers()
    if isinstance(positive, bool):
        scale = numbers.positive_scale if positive else numbers.negative_scale
    else:
        scale = jnp.where(positive, jnp.asarray(numbers.positive_scale, slope.dtype),
                          jnp.asarray(numbers.negative_scale, slope.dtype))
    return loss_value * scale, slope * scale


def branch_terms(z, positive: bool, loss=None):
    """`(loss, slope)` of every element of `z` on one branch, before any weight: a negative's
    `(softplus(z), sigmoid(z))` or a positive's `(softplus(-z), -sigmoid(-z))` for plain BCE (None
    or a plain `Loss`); for a `cutbce_common.loss.Loss`, its term and slope times its class
    balance. `slope` is d loss / dz. A negative at z = -inf (a positive taken out of its tile) adds
    0 (its slope is masked by the tile: `blocked/negative_tile.py`)."""
    u = -z if positive else z
    value, slope = _label_terms(u, exp_neg_abs(z), positive, loss)
    if loss is not None and loss.form().smoothing and not positive:  # c |u| is inf at a taken-out positive
        value = jnp.where(z == -jnp.inf, jnp.zeros((), value.dtype), value)
    return value, (-slope if positive else slope)  # du/dz = -1 at a positive


def labelled_terms(z, y, e, loss=None):
    """`(loss, slope)` of a tile whose labels are the boolean `y` (None: all negatives), from
    `e = exp(-|z|)`: `branch_terms` of each element's own branch, in one pass (the Pallas kernels'
    way: they mask by label, never take a positive out)."""
    u = z if y is None else jnp.where(y, -z, z)
    value, slope = _label_terms(u, e, False if y is None else y, loss)
    return value, (slope if y is None else jnp.where(y, -slope, slope))


def _label_terms(u, e, positive, loss):
    """`(term, d term / du)` of the logit `u` seen from its label (`positive`: a bool or a boolean
    array), with the class balance: plain BCE's `(softplus(u), sigmoid(u))` for None or a plain Loss."""
    if loss is None or loss.plain:
        return softplus(u, e), sigmoid(u, e)
    return _scaled(*loss_terms(u, e, loss), positive, loss)
