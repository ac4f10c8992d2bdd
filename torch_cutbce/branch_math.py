"""Each element's `(loss, slope)` on its own branch, in torch: the one place this math is written.

Used by the tile functions (`native/fused_tile.py`, compiled and eager) and the positives' own terms
(`positives.py`). Its sisters: `jax_kernels/branch_math.py` (the blocked loop, the positives and the
Pallas kernels) and the C kernel `cutbce_common/cpu_tile.c` (plain BCE, float32 CPU tiles);
`tests/test_branch_math.py` pins the three against float64. With `u` the logit seen from the
element's label (`z` for a negative, `-z` at a positive) and `e = exp(-|u|)` in (0, 1]:

    softplus(u) = max(u, 0) + log1p(e)          sigmoid(u) = (1 if u >= 0 else e) / (1 + e)
    focal:  term(u) = sigmoid(u)^gamma softplus(u)
            term'(u) = sigmoid(u)^gamma (gamma sigmoid(-u) softplus(u) + sigmoid(u))

Every factor is nonnegative and formed without cancellation, exact to rounding for any u (the
derivation: docs/design.md, 'The focal variant'). A negative at z = -inf (a positive taken out of
its tile) has loss 0 and slope 0. Plain tensor ops that never write their inputs (unless told:
`log1p_tail(over_e=True)`): `torch.compile` fuses them into one loop per tile function; eager, they
update their own temporaries in place (a third less time than fresh ones for the focal tile), so
autograd cannot differentiate through them: the engines call them inside their custom ops, whose
backward is written by hand.
"""

from __future__ import annotations

import torch


def log1p_from_t(t):
    """`log1p(e)` given `t = e / (2 + e)` in [0, 1/3]: `2 atanh(t) = 2 t P(t^2)`.

    P(s) ~ atanh(sqrt(s)) / sqrt(s) on [0, 1/9] (a degree-4 least-squares fit in float64): relative
    error 4e-9 for every e, e -> 0 included, under float32's 6e-8. The coefficients are the C
    kernel's and jax_kernels/branch_math.py's. They are literals, not a global tuple: dynamo would
    lift global floats into float64 graph inputs.
    """
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2 * t * (1.0000000038619887 + s * p)


def log1p_unit(e):
    """`log1p(e)` for e in [0, 1] by the polynomial (`log1p_from_t`)."""
    return log1p_from_t(e / (2 + e))


def log1p_tail(e, *, over_e: bool = False):
    """`log1p(e)`, e in [0, 1]: the polynomial under `torch.compile` (fused into the loop, where
    Sleef's log1p costs about 4 exps), else ATen's log1p (one kernel; the polynomial would be a
    dozen eager kernels over the tile; float64 always), written over e with `over_e` (eager code
    done with e saves a tile)."""
    if torch.compiler.is_compiling() and e.dtype != torch.float64:
        return log1p_unit(e)
    return e.log1p_() if over_e else torch.log1p(e)


def exp_neg_abs(u):
    """`e = exp(-|u|)` in (0, 1]: never overflows; one exp serves softplus, sigmoid and focal."""
    return u.abs().neg_().exp_()


def softplus(u, e, tail=None):
    """`softplus(u) = max(u, 0) + log1p(e)`, from `e = exp(-|u|)` (or its `tail = log1p(e)`)."""
    return torch.clamp_min(u, 0).add_(log1p_tail(e) if tail is None else tail)


def softplus_one_exp(z):
    """`softplus(z)` alone, for fused code: `t = e / (2 + e)` written as `1 / (2 exp(|z|) + 1)` so
    that the exponential has one user (inductor on CPU writes an exp with several users to memory
    before a reduction: two loops over the tile). exp(|z|) = inf for |z| > 88 gives t = 0, and
    log1p(e) is then below float32's smallest normal."""
    return torch.clamp_min(z, 0) + log1p_from_t(1 / (2 * torch.exp(z.abs()) + 1))


def sigmoid(u, e, out=None):
    """`sigmoid(u) = (1 if u >= 0 else e) / (1 + e)`, from `e = exp(-|u|)` (into `out` if given)."""
    return torch.div(torch.where(u >= 0, 1.0, e), e + 1, out=out)


def focal_factor(u, e, tail, gamma, k: int, f):
    """`sigmoid(u)^gamma = exp(-gamma softplus(-u))`, split so that no large exp argument is rounded.

    With gamma = k + f (k an integer, f in [0, 1)) and `softplus(-u) = max(-u, 0) + tail`:

        sigmoid(u)^gamma = exp(-gamma tail - f max(-u, 0)) (e if u < 0 else 1)^k

    `exp(-gamma softplus(-u))` taken at once carries the rounding of `gamma |u|` into the result;
    here e^k is k roundings and `f |u|` has f < 1 (benchmarks/results/cpu_speed.md, 'Focal'). `gamma` and `f`
    are floats or 0-d tensors (a compiled tile's inputs: one kernel serves every gamma with this k);
    f is None when gamma is an integer, and its term is left out: at u = -inf (a positive taken out
    of its tile) 0 * inf would be NaN, where e = 0 makes the factor 0.
    """
    exponent = tail * -gamma
    if f is not None:
        exponent.add_(torch.clamp_max(u, 0).mul_(f))  # - f max(-u, 0), exactly
    factor = exponent.exp_()
    return factor.mul_(_integer_power(torch.where(u < 0, e, 1.0), k)) if k else factor


def _integer_power(x, k: int):
    """`x ** k` for a static int k >= 1 by squaring: k roundings, plain multiplies."""
    result = None
    while k:
        if k & 1:
            result = x if result is None else result * x
        k >>= 1
        if k:
            x = x * x
    return result


def loss_terms(u, e, form, numbers):
    """`(term(u), term'(u))` of a `cutbce_common.loss.Loss` given as its `form()` and
    `numbers()` (floats, or a compiled tile's 0-d tensors), before the branch scale, from
    `e = exp(-|u|)`. The formulas: the Loss module's docstring; with c = 0 the focal factor is
    `focal_factor`'s exact split, with c > 0 `q^gamma = exp(gamma log q)` (q >= c: no log of 0).

        B = (1 - c) max(u, 0) + c max(-u, 0) + log1p(e)         B' = sigmoid(u) - c
        term' = q^gamma (B' + gamma (1 - 2c) sigmoid(u) sigmoid(-u) B / q)
    """
    tail = log1p_tail(e)
    one_plus_e, flip = e + 1, u >= 0
    sigmoid_u = torch.where(flip, 1.0, e).div_(one_plus_e)
    c = numbers.half_smoothing
    if form.smoothing:
        plus = torch.clamp_min(u, 0).mul_(1 - c).add_(torch.clamp_max(u, 0).mul_(-c)).add_(tail)
        slope = sigmoid_u - c
    else:
        plus, slope = softplus(u, e, tail), sigmoid_u
    if not form.focal:
        return plus, slope
    sigmoid_flip = torch.where(flip, e, 1.0).div_(one_plus_e)
    if form.smoothing:
        q = sigmoid_u * (1 - 2 * c) + c
        factor = torch.log(q).mul_(numbers.gamma).exp_()
        bend = sigmoid_u * sigmoid_flip * (1 - 2 * c) / q
    else:
        factor = focal_factor(u, e, tail, numbers.gamma, form.power, numbers.fraction if form.fraction else None)
        bend = sigmoid_flip
    # bend -> 0 as B -> inf (|u| = inf): their product's limit is 0, not 0 x inf = NaN (a NaN z keeps
    # its NaN through the slope's other term).
    bent = bend.mul_(numbers.gamma).mul_(plus).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    slope = bent.add_(slope).mul_(factor)
    return plus.mul_(factor), slope


def form_terms(z, positive: bool, form, numbers):
    """`branch_terms` for a Loss given as its `form()` and `numbers()` (a compiled tile's way)."""
    u = -z if positive else z
    loss, slope = loss_terms(u, exp_neg_abs(u), form, numbers)
    if form.balanced:
        scale = numbers.positive_scale if positive else numbers.negative_scale
        loss, slope = loss.mul_(scale), slope.mul_(scale)
    if form.smoothing and not positive:
        # z = -inf marks a positive taken out of its tile: it adds nothing (smoothing's c |u| is inf there).
        loss = loss.masked_fill_(z == float("-inf"), 0.0)
    return loss, (slope.neg_() if positive else slope)  # du/dz = -1 at a positive


def branch_terms(z, positive: bool, loss=None):
    """`(loss, slope)` of every element of `z` on one branch, before any weight: a negative's
    `(softplus(z), sigmoid(z))` or a positive's `(softplus(-z), -sigmoid(-z))` for plain BCE (None
    or a plain Loss); for a `cutbce_common.loss.Loss`, its term and slope times its class
    balance (`loss_terms`). `slope` is d loss / dz. A negative at z = -inf (a positive taken out of
    its tile) has loss 0 and slope 0 where the tile masks its gradient (`fused_tile`)."""
    if loss is None or loss.plain:
        u = -z if positive else z
        e = exp_neg_abs(u)
        plain, slope = softplus(u, e), sigmoid(u, e)
        return plain, (slope.neg_() if positive else slope)
    return form_terms(z, positive, loss.form(), loss.numbers())
