"""The dense background in pure JAX: a loop over vocabulary tiles, nothing of size N x V.

Computes only the background half of the fused form (positives.py has the other half):

    row_bg[n]  = sum_v cw[v] softplus(z[n, v])            count_pos[n] = #{v : z[n, v] > 0}
    dz[n, v]   = g[n] cw[v] sigmoid(z[n, v])               (backward, recomputing z per tile)

Ragged last tile without padding the table: tile j starts at min(j * block_v, V - block_v), so the
last tile is shifted back to end exactly at V; its columns below j * block_v were covered by tile
j - 1 and are masked out. Gradients of the table are added (not written) into the `[V, D]`
accumulator, so the masked overlap adds zeros.

Precision: logits, softplus, sigmoid and every sum run in float32 (float64 for float64 inputs);
bfloat16 tiles are upcast before the matmul, so this path is at least as accurate as a bf16 MXU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .jax_positives import accumulation_dtype


def _softplus(z):
    return jnp.maximum(z, 0) + jnp.log1p(jnp.exp(-jnp.abs(z)))


def _tile(hidden_acc, item_weight, bias, class_weight, j, block_v):
    """Logits of tile j and the per-column weight (0 on overlapped columns): `(z [N, bv], w [bv], start)`."""
    num_items = item_weight.shape[0]
    acc = hidden_acc.dtype
    start = jnp.minimum(j * block_v, num_items - block_v)
    items = lax.dynamic_slice_in_dim(item_weight, start, block_v).astype(acc)
    z = hidden_acc @ items.T
    if bias is not None:
        z = z + lax.dynamic_slice_in_dim(bias.astype(acc), start, block_v)
    column = start + jnp.arange(block_v)
    w = (column >= j * block_v).astype(acc)
    if class_weight is not None:
        w = w * lax.dynamic_slice_in_dim(class_weight.astype(acc), start, block_v)
    return z, w, start, items


def _num_tiles(num_items, block_v):
    return -(-num_items // block_v)


def blocked_background_forward(hidden, item_weight, bias, class_weight, *, block_v: int, compute_counts: bool):
    """Returns `(row_bg [N], count_pos [N] float32 or None)` in the accumulation dtype."""
    acc = accumulation_dtype(hidden.dtype)
    block_v = min(block_v, item_weight.shape[0])
    h = hidden.astype(acc)
    n = hidden.shape[0]

    def body(j, carry):
        loss, count = carry
        z, w, _, _ = _tile(h, item_weight, bias, class_weight, j, block_v)
        loss = loss + (_softplus(z) * w).sum(-1)
        if compute_counts:
            count = count + ((z > 0) & (w != 0)).astype(jnp.float32).sum(-1)
        return loss, count

    init = (jnp.zeros((n,), acc), jnp.zeros((n,), jnp.float32))
    loss, count = lax.fori_loop(0, _num_tiles(item_weight.shape[0], block_v), body, init)
    return loss, (count if compute_counts else None)


def blocked_background_backward(hidden, item_weight, bias, class_weight, g, *, block_v: int):
    """Returns `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] or None)` in the accumulation dtype."""
    acc = accumulation_dtype(hidden.dtype)
    block_v = min(block_v, item_weight.shape[0])
    h = hidden.astype(acc)
    g = g.astype(acc)

    def body(j, carry):
        d_hidden, d_items, d_bias = carry
        z, w, start, items = _tile(h, item_weight, bias, class_weight, j, block_v)
        dz = g[:, None] * jax.nn.sigmoid(z) * w
        d_hidden = d_hidden + dz @ items
        d_items = _add_rows(d_items, dz.T @ h, start)
        if d_bias is not None:
            d_bias = _add_rows(d_bias, dz.sum(0), start)
        return d_hidden, d_items, d_bias

    init = (
        jnp.zeros(hidden.shape, acc),
        jnp.zeros(item_weight.shape, acc),
        None if bias is None else jnp.zeros(bias.shape, acc),
    )
    return lax.fori_loop(0, _num_tiles(item_weight.shape[0], block_v), body, init)


def _add_rows(total, tile, start):
    current = lax.dynamic_slice_in_dim(total, start, tile.shape[0])
    return lax.dynamic_update_slice_in_dim(total, current + tile, start, axis=0)
