"""The sparse correction at the positives, shared by every background implementation.

The fused form (reference.py, DESIGN.md section 2) writes each row as a dense background
`sum_v cw[v] softplus(z[n, v])`, which treats every item as a negative, plus a correction over the
at most L positives of the row:

    corr[n, t] = cw[t] * (pw[t] * softplus(-z[n, t]) - softplus(z[n, t]))     (= -cw[t] z[n, t] if pw = 1)

and the gradient of the correction with respect to z[n, t] is

    dcorr/dz = cw[t] * (pw[t] * (sigmoid(z) - 1) - sigmoid(z))              (= -cw[t] if pw = 1)

so that background + correction give `g cw pw (sigmoid(z) - 1)` at a positive, as BCE does.
Positive logits are recomputed here from a gather of L item rows (O(N L D), small beside O(N V D)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accumulation_dtype(dtype) -> jnp.dtype:
    """float64 stays float64; everything else (float32, bfloat16, float16) accumulates in float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def positive_slots(targets: jax.Array, num_items: int) -> tuple[jax.Array, jax.Array]:
    """Turns padded target ids `[N, L]` into a set: `(ids [N, L], mask [N, L] bool)`.

    Sorting each row puts duplicates side by side, so "first of its run" keeps each id once without
    an O(L^2) comparison. Ids outside [0, V) are masked (padding); masked slots point at item 0 so
    that gathers stay in bounds, and their mask zeroes every contribution.
    """
    ids = jnp.sort(targets, axis=-1)
    valid = (ids >= 0) & (ids < num_items)
    first_of_run = jnp.concatenate(
        [jnp.ones_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]], axis=-1
    )
    mask = valid & first_of_run
    return jnp.where(mask, ids, 0).astype(jnp.int32), mask


def _positive_logits(hidden, item_weight, bias, ids):
    acc = accumulation_dtype(hidden.dtype)
    rows = item_weight[ids]  # [N, L, D]
    z = jnp.einsum("nd,nld->nl", hidden, rows, preferred_element_type=acc)
    if bias is not None:
        z = z + bias.astype(acc)[ids]
    return z, rows


def _gathered(values, ids, acc):
    return None if values is None else values.astype(acc)[ids]


def correction_forward(hidden, item_weight, bias, class_weight, pos_weight, ids, mask):
    """Returns `(corr_row [N], positive_hits [N], num_positives [N])`.

    `positive_hits` counts positives with z > 0 (the TP of the metrics); `num_positives` is |T_n|.
    """
    acc = accumulation_dtype(hidden.dtype)
    z, _ = _positive_logits(hidden, item_weight, bias, ids)
    cw = _gathered(class_weight, ids, acc)
    pw = _gathered(pos_weight, ids, acc)
    if pw is None:
        corr = -z  # softplus(-z) - softplus(z) = -z exactly: no cancellation
    else:
        corr = pw * jax.nn.softplus(-z) - jax.nn.softplus(z)
    if cw is not None:
        corr = corr * cw
    corr_row = jnp.where(mask, corr, 0).sum(-1)
    hits = (mask & (z > 0)).astype(jnp.float32).sum(-1)
    return corr_row, hits, mask.astype(jnp.float32).sum(-1)


def correction_backward(hidden, item_weight, bias, class_weight, pos_weight, ids, mask, g):
    """Adds the correction's share of the gradients: `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] | None)`.

    `g [N]` is the upstream gradient of each row; all outputs are in the accumulation dtype.
    """
    acc = accumulation_dtype(hidden.dtype)
    cw = _gathered(class_weight, ids, acc)
    pw = _gathered(pos_weight, ids, acc)
    rows = item_weight[ids]
    if pw is None:
        dz = -jnp.ones(ids.shape, acc)
    else:
        z, rows = _positive_logits(hidden, item_weight, bias, ids)
        s = jax.nn.sigmoid(z)
        dz = pw * (s - 1) - s
    if cw is not None:
        dz = dz * cw
    dz = jnp.where(mask, dz * g.astype(acc)[:, None], 0)
    d_hidden = jnp.einsum("nl,nld->nd", dz, rows.astype(acc))
    contrib = dz[:, :, None] * hidden.astype(acc)[:, None, :]  # [N, L, D]
    num_items = item_weight.shape[0]
    d_item_weight = jnp.zeros(item_weight.shape, acc).at[ids].add(contrib)
    d_bias = None if bias is None else jnp.zeros((num_items,), acc).at[ids].add(dz)
    return d_hidden, d_item_weight, d_bias
