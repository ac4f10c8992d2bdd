"""Each element's `(loss, slope)` on its own branch, in torch: the one place this math is written.

Used by the tile functions (`fused_tile.py`, compiled and eager) and the positives' own terms
(`positives.py`). Its sisters: `jax_kernels/branch_math.py` (the blocked loop, the positives and the
Pallas kernels) and the C kernel `jax_kernels/neutral/cpu_tile.c` (plain BCE, float32 CPU tiles);
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


def gamma_split(gamma: float) -> tuple[int, float]:
    """`(k, f)` with gamma = k + f, k an integer (static: `focal_factor` unrolls e^k) and f in [0, 1)."""
    k = int(gamma)
    return k, gamma - k


def focal_factor(u, e, tail, gamma, k: int, f):
    """`sigmoid(u)^gamma = exp(-gamma softplus(-u))`, split so that no large exp argument is rounded.

    With gamma = k + f (`gamma_split`) and `softplus(-u) = max(-u, 0) + tail`:

        sigmoid(u)^gamma = exp(-gamma tail - f max(-u, 0)) (e if u < 0 else 1)^k

    `exp(-gamma softplus(-u))` taken at once carries the rounding of `gamma |u|` into the result;
    here e^k is k roundings and `f |u|` has f < 1 (benchmarks/NOTES.md section 11). `gamma` and `f`
    are floats or 0-d tensors (a compiled tile's inputs: one kernel serves every gamma with this k);
    f is None or 0.0 when gamma is an integer, and its term is left out: at u = -inf (a positive
    taken out of its tile) 0 * inf would be NaN, where e = 0 makes the factor 0.
    """
    exponent = tail * -gamma
    if f is not None and not (isinstance(f, float) and f == 0.0):
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


def focal_terms(u, e, gamma, k: int, f):
    """`(term(u), term'(u))` of focal CutBCE (module docstring) from `e = exp(-|u|)`; gamma = k + f
    as `focal_factor` takes them."""
    tail = log1p_tail(e)
    factor = focal_factor(u, e, tail, gamma, k, f)
    plus = softplus(u, e, tail)
    one_plus_e, flip = e + 1, u >= 0
    sigmoid_u = torch.where(flip, 1.0, e).div_(one_plus_e)
    slope = torch.where(flip, e, 1.0).div_(one_plus_e).mul_(gamma).mul_(plus).add_(sigmoid_u).mul_(factor)
    return plus.mul_(factor), slope  # slope: sigmoid(-u) gamma softplus(u) + sigmoid(u), times the factor


def branch_terms(z, positive: bool, gamma: float | None = None):
    """`(loss, slope)` of every element of `z` on one branch, before any weight: a negative's
    `(softplus(z), sigmoid(z))` or a positive's `(softplus(-z), -sigmoid(-z))`; with `gamma`
    (a float > 0, or None for plain BCE), focal's `term` and its slope. `slope` is d loss / dz."""
    u = -z if positive else z
    e = exp_neg_abs(u)
    if gamma is None:
        loss, slope = softplus(u, e), sigmoid(u, e)
    else:
        loss, slope = focal_terms(u, e, gamma, *gamma_split(gamma))
    return loss, (slope.neg_() if positive else slope)  # du/dz = -1 at a positive
