"""Each logit's `(loss, slope)` on its own branch, in Triton: the sister of `torch_cutbce/branch_math.py`.

The same formulas (that module's docstring and `cutbce_common/loss.py`), written for a kernel's
registers: `u` is the logit seen from its label (`z` at a negative, `-z` at a positive, `y` says
which), `e = exp(-|z|)` in (0, 1] serves softplus, sigmoid and the focal factor, and no term is
formed as a difference of large ones, so each element is exact to rounding for any z.

For float32, only what both Triton's interpreter and its CUDA backend run exactly as written: `x / y` lowers to
PTX's approximate `div.full.f32` and `tl.exp` to `ex2.approx` of `x log2(e)` (whose rounding costs
|x| 6e-8 relative, 5e-6 at x = -80), so divisions are `tl.div_rn` and `exp(-|z|)` is reduced to
[-ln2 / 2, ln2 / 2] first (Cody-Waite, as libdevice's expf; libdevice itself has no interpreter
twin); every exponent here is <= 0, so `exp_neg_abs` serves them all. `log1p` is the degree-4
polynomial of the other engines (4e-9 relative).

`FAST` (16-bit inputs, held to docs/precision.md's 16-bit contract, not the float32 rule): `exp(-|z|)`
is `tl.exp2(-|z| log2 e)` (one multiply and PTX's `ex2.approx.ftz`), and every division is `x / y`
(`div.full.f32`, approximate to 2 ulp, no IEEE slow path). Each is itself the approximation, so the
interpreter runs the same formulas (exactly rounded where the GPU's are within ulps).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cutbce_common.loss import Loss


def loss_numbers(loss: Loss) -> tuple[float, ...]:
    """A `Loss`'s run-time numbers as the kernels read them (`numbers_ptr`, float32 [5]): gamma, its
    fraction, c = smoothing / 2, the positive and negative branch scales."""
    numbers = loss.numbers()
    return tuple(float(x) for x in (numbers.gamma, numbers.fraction, numbers.half_smoothing,
                                    numbers.positive_scale, numbers.negative_scale))


def loss_constexprs(loss: Loss) -> dict:
    """A `Loss`'s `form()` as the kernels' constexprs (what a compiled kernel specialises on)."""
    form = loss.form()
    return dict(FOCAL=form.focal, POWER=form.power, FRACTION=form.fraction, SMOOTHING=form.smoothing,
                BALANCED=form.balanced)


@triton.jit
def exp_neg_abs(z):
    """`exp(-|z|)` to about 2 ulp: `2^k exp(r)` with `k = round(-|z| / ln2)` (at least -126, so that
    2^k is a normal float built from its bits) and `r = -|z| - k ln2` (ln2 in two parts, k ln2_hi
    exact). NaN stays NaN; z = inf gives 0."""
    x = -tl.abs(z)
    k = tl.maximum(tl.floor(x * 1.4426950408889634 + 0.5), -126.0)
    k = tl.where(x == x, k, 0.0)  # NaN: keep the integer conversion defined (x carries the NaN)
    r = (x - k * 0.693145751953125) - k * 1.428606765330187e-06
    two_to_k = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.exp(r) * two_to_k


@triton.jit
def exp_neg(x, FAST: tl.constexpr):
    """`exp(x)` for x <= 0 (NaN stays NaN): `exp_neg_abs`, or with `FAST` `ex2.approx` of `x log2 e`."""
    if FAST:
        return tl.exp2(x * 1.4426950408889634)
    return exp_neg_abs(x)


@triton.jit
def divide(x, y, FAST: tl.constexpr):
    """`x / y`: correctly rounded (`tl.div_rn`), or with `FAST` PTX's approximate `div.full.f32`."""
    if FAST:
        return x / y
    return tl.div_rn(x, y)


@triton.jit
def log1p_unit(e, FAST: tl.constexpr):
    """`log1p(e)` for e in [0, 1]: `2 atanh(t) = 2 t P(t^2)`, `t = e / (2 + e)` (the other engines'
    fit: `torch_cutbce/branch_math.log1p_from_t`)."""
    t = divide(e, 2.0 + e, FAST)
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2.0 * t * (1.0000000038619887 + s * p)


@triton.jit
def integer_power(x, POWER: tl.constexpr):
    """`x ** POWER` for a static POWER >= 1, as plain multiplies."""
    result = x
    for _ in tl.static_range(POWER - 1):
        result = result * x
    return result


@triton.jit
def labelled_terms(z, y, numbers_ptr, FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr,
                   SMOOTHING: tl.constexpr, BALANCED: tl.constexpr, FAST: tl.constexpr):
    """`(loss, d loss / dz)` of each logit `z` whose label is `y` (bool), before the weights; `FAST`:
    the module docstring's approximations (16-bit inputs).

    The `Loss` arrives as its `form()` (the constexprs: `loss_constexprs`) and its numbers
    (`numbers_ptr`: `loss_numbers`, read where the form uses them; loop-invariant loads). With `u = -z if y else z` and `B(u) = (1 - c) max(u, 0) +
    c max(-u, 0) + log1p(e)`: term = q^gamma B, slope = q^gamma (B' + gamma bend B), where q^gamma
    is `focal_factor`'s exact split without smoothing and `exp(gamma log q)` with it.
    """
    gamma = tl.load(numbers_ptr)
    fraction = tl.load(numbers_ptr + 1)
    c = tl.load(numbers_ptr + 2)
    u = tl.where(y, -z, z)
    e = exp_neg(-tl.abs(z), FAST)
    tail = log1p_unit(e, FAST)
    one_plus_e = 1.0 + e
    sigmoid_u = divide(tl.where(u >= 0, 1.0, e), one_plus_e, FAST)
    if SMOOTHING:
        plus = (1.0 - c) * tl.maximum(u, 0.0) - c * tl.minimum(u, 0.0) + tail
        slope = sigmoid_u - c
    else:
        plus = tl.maximum(u, 0.0) + tail
        slope = sigmoid_u
    if FOCAL:
        sigmoid_flip = divide(tl.where(u >= 0, e, 1.0), one_plus_e, FAST)
        if SMOOTHING:
            q = c + (1.0 - 2.0 * c) * sigmoid_u
            factor = exp_neg(gamma * tl.log(q), FAST)  # q in (0, 1]: the exponent is <= 0
            bend = divide((1.0 - 2.0 * c) * sigmoid_u * sigmoid_flip, q, FAST)
        else:
            exponent = -gamma * tail
            if FRACTION:
                exponent += tl.minimum(u, 0.0) * fraction  # - f max(-u, 0), exactly
            factor = exp_neg(exponent, FAST)  # exponent <= 0
            if POWER > 0:
                factor = factor * integer_power(tl.where(u < 0, e, 1.0), POWER)
            bend = sigmoid_flip
        # bend is 0 where plus is inf (|u| = inf): the limit of their product is 0, not NaN
        slope = factor * (gamma * bend * tl.minimum(plus, 3.4028234663852886e38) + slope)
        plus = factor * plus
    if BALANCED:
        scale = tl.where(y, tl.load(numbers_ptr + 3), tl.load(numbers_ptr + 4))
        plus = plus * scale
        slope = slope * scale
    return plus, tl.where(y, -slope, slope)  # du/dz = -1 at a positive
