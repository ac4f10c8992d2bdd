"""The dense background in pure JAX: a loop over vocabulary tiles, nothing of size N x V.

Computes only the background half of the fused form (positives.py has the other half):

    row_bg[n]  = sum_v cw[v] softplus(z[n, v])            count_pos[n] = #{v : z[n, v] > 0}
    dz[n, v]   = g[n] cw[v] sigmoid(z[n, v])               (backward, recomputing z per tile)

Three loops: forward; backward (recomputes each tile: four matmuls per tile in all); and
forward-with-gradient for a row gradient `g` known up front (scalar reductions: three matmuls).

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


def _log1p_unit(e):
    """log1p(e) for e in [0, 1] without log1p: 2 atanh(t) = 2 t P(t^2), t = e / (2 + e) in [0, 1/3].

    P(s) ~ atanh(sqrt(s)) / sqrt(s) is a degree-4 least-squares fit on s in [0, 1/9] (float64
    fit): relative error 4e-9 for every e, e -> 0 included, under float32's 6e-8. XLA:CPU's log1p
    costs about 4 ns per element, 3x this divide and five multiply-adds (the twin of
    torch_cutbce/fused_tile.py; measured in benchmarks/NOTES.md).
    """
    t = e / (2 + e)
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2 * t * (1.0000000038619887 + s * p)


def _softplus(z, e=None):
    """max(z, 0) + log1p(exp(-|z|)); log1p is the polynomial above unless z is float64.

    `e = exp(-|z|)` may be passed in, to share one exponential with `_sigmoid`.
    """
    e = jnp.exp(-jnp.abs(z)) if e is None else e
    tail = jnp.log1p(e) if z.dtype == jnp.float64 else _log1p_unit(e)
    return jnp.maximum(z, 0) + tail


def _sigmoid(z, e):
    """sigmoid(z) from `e = exp(-|z|)`: 1 / (1 + e) for z >= 0, e / (1 + e) below (never overflows)."""
    return jnp.where(z >= 0, 1, e) / (1 + e)


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


def _count_positive(z, start, j, block_v):
    """Per row, the logits > 0 of tile j; counts skip only the overlapped columns, not items whose class_weight is 0."""
    fresh = start + jnp.arange(block_v) >= j * block_v
    return ((z > 0) & fresh).astype(jnp.float32).sum(-1)


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
        z, w, start, _ = _tile(h, item_weight, bias, class_weight, j, block_v)
        loss = loss + _softplus(z) @ w  # a matrix-vector product: the masked, weighted row sum
        if compute_counts:
            count = count + _count_positive(z, start, j, block_v)
        return loss, count

    init = (jnp.zeros((n,), acc), jnp.zeros((n,), jnp.float32))
    loss, count = lax.fori_loop(0, _num_tiles(item_weight.shape[0], block_v), body, init)
    return loss, (count if compute_counts else None)


def blocked_background_value_and_grad(hidden, item_weight, bias, class_weight, g, *, block_v: int, compute_counts: bool):
    """Forward and backward in one loop, for an upstream gradient `g [N]` known before the forward.

    A scalar loss `sum_n g[n] rows[n]` (reductions 'mean' and 'sum') knows its row gradient up
    front, so each logit tile is computed once and serves softplus and sigmoid from one exponential:
    three matmuls per tile instead of the four of forward + backward. Returns
    `(row_bg, count_pos or None, d_hidden, d_item_weight, d_bias or None)` in the accumulation dtype.
    """
    acc = accumulation_dtype(hidden.dtype)
    block_v = min(block_v, item_weight.shape[0])
    h = hidden.astype(acc)
    g = g.astype(acc)
    n = hidden.shape[0]

    def body(j, carry):
        loss, count, grads = carry
        z, w, start, items = _tile(h, item_weight, bias, class_weight, j, block_v)
        e = jnp.exp(-jnp.abs(z))
        loss = loss + _softplus(z, e) @ w
        if compute_counts:
            count = count + _count_positive(z, start, j, block_v)
        dz = g[:, None] * _sigmoid(z, e) * w
        return loss, count, _add_tile_grads(grads, dz, h, items, start)

    init = (jnp.zeros((n,), acc), jnp.zeros((n,), jnp.float32), _zero_grads(hidden, item_weight, bias, acc))
    loss, count, grads = lax.fori_loop(0, _num_tiles(item_weight.shape[0], block_v), body, init)
    return (loss, count if compute_counts else None, *grads)


def blocked_background_backward(hidden, item_weight, bias, class_weight, g, *, block_v: int):
    """Returns `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] or None)` in the accumulation dtype."""
    acc = accumulation_dtype(hidden.dtype)
    block_v = min(block_v, item_weight.shape[0])
    h = hidden.astype(acc)
    g = g.astype(acc)

    def body(j, grads):
        z, w, start, items = _tile(h, item_weight, bias, class_weight, j, block_v)
        dz = g[:, None] * jax.nn.sigmoid(z) * w
        return _add_tile_grads(grads, dz, h, items, start)

    init = _zero_grads(hidden, item_weight, bias, acc)
    return lax.fori_loop(0, _num_tiles(item_weight.shape[0], block_v), body, init)


def _zero_grads(hidden, item_weight, bias, acc):
    """The accumulators `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] or None)`."""
    return (
        jnp.zeros(hidden.shape, acc),
        jnp.zeros(item_weight.shape, acc),
        None if bias is None else jnp.zeros(bias.shape, acc),
    )


def _add_tile_grads(grads, dz, h, items, start):
    """Adds tile j's share, from `dz [N, block_v]`, to the `_zero_grads` accumulators."""
    d_hidden, d_items, d_bias = grads
    d_hidden = d_hidden + dz @ items
    d_items = _add_rows(d_items, _table_grad_tile(h, dz), start)
    if d_bias is not None:
        d_bias = _add_rows(d_bias, dz.sum(0), start)
    return d_hidden, d_items, d_bias


def _table_grad_tile(h, dz):
    """`dz.T @ h`, the `[block_v, D]` tile of the table gradient, computed as `(h.T @ dz).T`.

    XLA:CPU runs the product with the `[D, block_v]` output about twice as fast as the one with the
    `[block_v, D]` output, which made the table gradient the costliest matmul of the loop
    (benchmarks/NOTES.md). The barrier keeps XLA's simplifier from folding the transpose back into
    the slow product; transposing the small tile costs little, and the `[V, D]` accumulator stays
    the only table-sized buffer (a `[D, V]` one would need a `[V, D]` copy at the end).
    """
    return lax.optimization_barrier(h.T @ dz).T


def _add_rows(total, tile, start):
    current = lax.dynamic_slice_in_dim(total, start, tile.shape[0])
    return lax.dynamic_update_slice_in_dim(total, current + tile, start, axis=0)
