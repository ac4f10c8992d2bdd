"""Where the positives are: padded target ids -> a set of ids per row (JAX; torch twin in torch_cutbce).

Every implementation takes the positives out of the dense pass inside the tile where they fall
(docs/design.md ('The math')): an element's loss is `cw softplus(z)` or `cw pw softplus(-z)`,
chosen element by element, so a confident positive's tiny loss is never lost in a row sum. The
tiles learn which of their elements are positives from `positive_ids`: the blocked loop scatters
-inf at them in each logits tile (and gives them their own terms once per call), the Pallas kernels
compare the row's ids with the tile's columns. Each element's own terms: `branch_math.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cutbce_common.shapes import accumulation_dtype_name


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
