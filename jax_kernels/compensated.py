"""Float sums that stay as exact as one tile's sum however many tiles they run over (JAX has x64
off: no float64 carry). Shared by the blocked loop and the Pallas kernels."""

from __future__ import annotations

import jax.numpy as jnp


def two_sum(total, x):
    """`(total + x, its rounding error)`: Knuth's TwoSum, no branch. Add the errors up beside the
    total and fold them in once at the end. XLA and Mosaic do not reassociate floats, so the error
    terms survive compilation."""
    new_total = total + x
    back = new_total - total
    error = (total - (new_total - back)) + (x - back)
    # An infinite total has no rounding error to keep: TwoSum's inf - inf would make it NaN, where
    # docs/precision.md's infinities table says +inf (a +inf logit at a negative).
    # Typed constants: Python floats would be float64 under jax_enable_x64, which Mosaic lacks.
    finite = jnp.abs(new_total) < new_total.dtype.type(jnp.inf)
    return new_total, jnp.where(finite, error, jnp.zeros_like(error))


def pairwise_sum(x):
    """`x.sum(0)` as a pairwise sum: about log2(len(x)) roundings whatever order XLA adds in."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        folded = x[:half] + x[half:2 * half]
        x = folded.at[-1].add(x[-1]) if x.shape[0] % 2 else folded
    return x[0]
