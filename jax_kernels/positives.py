"""Where the positives are: padded target ids -> a set of ids per row (JAX; torch twin in torch_cutbce).

Every implementation takes the positives out of the dense pass inside the tile where they fall
(docs/design.md ('The math')): an element's loss is `cw softplus(z)` or `cw pw softplus(-z)`,
chosen element by element, so a confident positive's tiny loss is never lost in a row sum. The
tiles learn which of their elements are positives from `positive_ids`: the blocked loop scatters
-inf at them in each logits tile (and gives them their own terms once per call), the Pallas kernels
compare the row's ids with the tile's columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_kernels.neutral.shapes import accumulation_dtype_name


def accumulation_dtype(dtype) -> jnp.dtype:
    """`shapes.accumulation_dtype_name` for a JAX dtype."""
    return jnp.dtype(accumulation_dtype_name(jnp.dtype(dtype).name))


def positive_ids(targets: jax.Array, num_items: int) -> jax.Array:
    """Padded ids `[N, L]` -> `[N, L]` int32 ids in `[0, num_items)`, each valid id once, -1 elsewhere.

    Ids outside `[0, V)` are padding. The comparisons run in the targets' own dtype (int64 under
    x64; narrow ids widened to int32 first) before the cast to int32, so no id wraps into another item. Sorting each row puts
    duplicates side by side, so "first of its run" keeps each id once.
    """
    if jnp.dtype(targets.dtype).itemsize < 4:  # int8/uint8/int16 would wrap V in their own dtype
        targets = targets.astype(jnp.int32)
    ids = jnp.sort(targets, axis=-1)
    valid = (ids >= 0) & (ids < num_items)
    first_of_run = jnp.concatenate([jnp.ones_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]], axis=-1)
    return jnp.where(valid & first_of_run, ids, -1).astype(jnp.int32)


def num_positives(ids: jax.Array) -> jax.Array:
    """`|T_n|` per row as float32 (the metrics' TP + FN)."""
    return (ids >= 0).astype(jnp.float32).sum(-1)


def element_terms(z, y, e):
    """`(softplus(zs), +-sigmoid(zs))` with `zs = where(y, -z, z)` and `e = exp(-|z|)`.

    The loss of element (n, v) is `weight * softplus(zs)` and its gradient `g * weight * (+-sigmoid(zs))`
    (minus at positives), `weight = cw * where(y, pw, 1)`: BCE's two branches without cancellation.
    """
    zs = jnp.where(y, -z, z)
    sigmoid = jnp.where(zs >= 0, 1, e) / (1 + e)
    return jnp.maximum(zs, 0) + _tail(e), jnp.where(y, -sigmoid, sigmoid)


def branch_terms(z, positive: bool, focal=None):
    """`(loss, slope)` of every element of `z` on one branch, before any weight: a negative's
    `(softplus(z), sigmoid(z))` or a positive's `(softplus(-z), -sigmoid(-z))`; with focal, `term`
    and its slope in `u = +-z` times focal's scale of that branch (jax_kernels/neutral/focal.py). A negative
    at z = -inf (a positive taken out of its tile) gives 0 and 0."""
    e = jnp.exp(-jnp.abs(z))
    if focal is None:
        return element_terms(z, jnp.full(z.shape, positive), e)
    term, slope = focal_terms(-z if positive else z, e, _tail(e), focal.gamma)
    if positive:
        slope = -slope  # du/dz = -1
    scale = focal.positive_scale if positive else focal.negative_scale
    return (term, slope) if scale == 1.0 else (term * scale, slope * scale)


def _tail(e):
    """log1p(e), e in [0, 1]: the float32 polynomial, or float64's own log1p."""
    return jnp.log1p(e) if e.dtype == jnp.float64 else log1p_unit(e)


def log1p_unit(e):
    """log1p(e) for e in [0, 1] without log1p: 2 atanh(t) = 2 t P(t^2), t = e / (2 + e) in [0, 1/3].

    P(s) ~ atanh(sqrt(s)) / sqrt(s) is a degree-4 least-squares fit on s in [0, 1/9] (float64
    fit): relative error 4e-9 for every e, e -> 0 included, under float32's 6e-8. XLA:CPU's log1p
    costs about 3x this divide and five multiply-adds (benchmarks/NOTES.md).
    """
    t = e / (2 + e)
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2 * t * (1.0000000038619887 + s * p)


def focal_terms(u, e, tail, gamma: float):
    """`(term(u), d term / du)` of focal CutBCE (jax_kernels/neutral/focal.py), from `e = exp(-|u|)` and
    `tail = log1p(e)`; u is the logit seen from the element's label (`-z` at a positive).

        term(u) = sigmoid(u)^gamma * softplus(u),   d term / du = sigmoid(u)^gamma * (gamma *
        sigmoid(-u) * softplus(u) + sigmoid(u))

    Every factor is nonnegative and formed without cancellation. The modulating factor
    `sigmoid(u)^gamma = exp(-gamma * softplus(-u))` is split so that no large exp argument is
    rounded: with gamma = k + f (k an integer, f in [0, 1)) and `softplus(-u) = max(-u, 0) + tail`,

        sigmoid(u)^gamma = exp(-gamma * tail - f * max(-u, 0)) * (e if u < 0 else 1)^k

    `exp(-gamma * softplus(-u))` taken at once carries the rounding of `gamma * |u|` into the
    result; here e^k is k roundings and `f * |u|` has f < 1 (the errors of both forms:
    benchmarks/NOTES.md section 11). gamma is a static Python float
    (`gamma = 0` never comes here: the plain code runs for it, see core.CutBCEConfig); the same
    code runs in the blocked loop (float32/float64) and inside the Pallas kernels (float32).
    """
    negative = u < 0
    inverse = 1 / (1 + e)
    sigmoid = jnp.where(negative, e, 1) * inverse  # sigmoid(u)
    sigmoid_flip = jnp.where(negative, 1, e) * inverse  # sigmoid(-u)
    softplus = jnp.maximum(u, 0) + tail
    k = int(gamma)
    frac = gamma - k
    exponent = -gamma * tail
    if frac:
        exponent = exponent - frac * jnp.maximum(-u, 0)
    modulating = jnp.exp(exponent)
    if k:
        modulating = modulating * _integer_power(jnp.where(negative, e, 1), k)
    return modulating * softplus, modulating * (gamma * sigmoid_flip * softplus + sigmoid)


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
