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


def pairwise_sum(x, axis: int = 0, leaves: int = 1):
    """`x.sum(axis)` as a pairwise sum: the first half added to the second until `leaves` are left,
    those summed as XLA does; about log2(length / leaves) roundings more than `leaves` terms take,
    whatever order XLA adds in. Slices along `axis` in place (no transpose of a tile)."""
    axis = axis % x.ndim
    along = lambda index: (slice(None),) * axis + (index,)  # noqa: E731
    while x.shape[axis] > leaves:
        length = x.shape[axis]
        half = length // 2
        folded = x[along(slice(0, half))] + x[along(slice(half, 2 * half))]
        x = folded.at[along(-1)].add(x[along(-1)]) if length % 2 else folded
    return x.sum(axis)
