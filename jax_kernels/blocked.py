"""CutBCE in pure JAX: a loop over vocabulary tiles, nothing of size N x V.

Each tile computes every element's exact loss and gradient, its positives included
(`positives.element_terms`): with `y` the tile's positives and `weight = cw * where(y, pw, 1)`,

    rows[n]   = sum_v weight * softplus(where(y, -z, z))         count_pos[n] = #{v : z > 0}
    dz[n, v]  = g[n] weight (sigmoid(z) - y)   [as +-sigmoid(+-z)]   hits[n] = #{v : y and z > 0}

`y` comes from a scatter of the row's O(L) ids into a boolean `[N, block_v]` tile (no compare
against all L ids per element). Three loops: forward; backward (recomputes each tile: four
matmuls per tile in all); and forward-with-gradient for a row gradient `g` known up front
(scalar reductions: three matmuls).

Ragged last tile without padding the table: tile j starts at min(j * block_v, V - block_v), so the
last tile is shifted back to end exactly at V; its columns below j * block_v were covered by tile
j - 1 and get weight 0. Gradients of the table are added (not written) into the `[V, D]`
accumulator, so the masked overlap adds zeros.

Precision: logits, softplus, sigmoid and every sum run in float32 (float64 for float64 inputs);
bfloat16 tiles are upcast before the matmul, so this path is at least as accurate as a bf16 MXU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_kernels.positives import accumulation_dtype, element_terms


class _Table:
    """The operands every tile reads: `h` in the accumulation dtype, the table and its `[V]` rows."""

    def __init__(self, hidden, item_weight, bias, class_weight, pos_weight, ids, block_v):
        self.acc = accumulation_dtype(hidden.dtype)
        self.h = hidden.astype(self.acc)
        self.item_weight, self.ids = item_weight, ids
        self.bias, self.class_weight, self.pos_weight = (
            None if x is None else x.astype(self.acc) for x in (bias, class_weight, pos_weight)
        )
        self.num_items = item_weight.shape[0]
        self.block_v = min(block_v, self.num_items)
        self.num_tiles = -(-self.num_items // self.block_v)

    def tile(self, j):
        """Tile j: `(z [N, bv], y [N, bv] bool, weight [bv] or [N, bv], fresh [bv], start, items)`.

        `fresh` marks the columns this tile owns (not the overlap of a shifted last tile); `weight`
        is 0 off them.
        """
        bv = self.block_v
        start = jnp.minimum(j * bv, self.num_items - bv)
        items = lax.dynamic_slice_in_dim(self.item_weight, start, bv).astype(self.acc)
        z = self.h @ items.T
        if self.bias is not None:
            z = z + lax.dynamic_slice_in_dim(self.bias, start, bv)
        fresh = start + jnp.arange(bv) >= j * bv
        weight = fresh.astype(self.acc)
        if self.class_weight is not None:
            weight = weight * lax.dynamic_slice_in_dim(self.class_weight, start, bv)
        y = self._positives(start)
        if self.pos_weight is not None:
            weight = weight * jnp.where(y, lax.dynamic_slice_in_dim(self.pos_weight, start, bv), 1)
        return z, y, weight, fresh, start, items

    def _positives(self, start):
        """`[N, bv]` bool: a scatter of the ids inside `[start, start + bv)`; the rest drop out of range."""
        n, bv = self.h.shape[0], self.block_v
        local = self.ids - start
        local = jnp.where((local >= 0) & (local < bv), local, bv)
        rows = jnp.broadcast_to(jnp.arange(n)[:, None], local.shape)
        return jnp.zeros((n, bv), bool).at[rows, local].set(True, mode="drop")


def _weighted_rows(loss, weight):
    # A matrix-vector product when the weight is one row (no pos_weight), else a weighted row sum.
    return loss @ weight if weight.ndim == 1 else (loss * weight).sum(-1)


def _counts(z, y, fresh):
    """Per row: logits > 0 and positives with logit > 0 among the tile's own columns (float32)."""
    positive = (z > 0) & fresh
    return jnp.stack([positive.astype(jnp.float32).sum(-1), (positive & y).astype(jnp.float32).sum(-1)])


def blocked_forward(hidden, item_weight, bias, class_weight, pos_weight, ids, *, block_v: int, compute_counts: bool):
    """Returns `(rows [N], counts [2, N] float32 or None)`: the rows in the accumulation dtype, and
    the predicted positives and hits (positives with z > 0) per row. `ids`: `positives.positive_ids`."""
    t = _Table(hidden, item_weight, bias, class_weight, pos_weight, ids, block_v)
    n = hidden.shape[0]

    def body(j, carry):
        rows, counts = carry
        z, y, weight, fresh, _, _ = t.tile(j)
        loss, _ = element_terms(z, y, jnp.exp(-jnp.abs(z)))
        rows = rows + _weighted_rows(loss, weight)
        if compute_counts:
            counts = counts + _counts(z, y, fresh)
        return rows, counts

    init = (jnp.zeros((n,), t.acc), jnp.zeros((2, n), jnp.float32))
    rows, counts = lax.fori_loop(0, t.num_tiles, body, init)
    return rows, (counts if compute_counts else None)


def blocked_value_and_grad(hidden, item_weight, bias, class_weight, pos_weight, ids, g, *, block_v: int,
                           compute_counts: bool):
    """Forward and backward in one loop, for an upstream gradient `g [N]` known before the forward.

    A scalar loss `sum_n g[n] rows[n]` (reductions 'mean' and 'sum') knows its row gradient up
    front, so each logit tile is computed once and serves softplus and sigmoid from one exponential:
    three matmuls per tile instead of the four of forward + backward. Returns
    `(rows, counts or None, d_hidden, d_item_weight, d_bias or None)` in the accumulation dtype.
    """
    t = _Table(hidden, item_weight, bias, class_weight, pos_weight, ids, block_v)
    g = g.astype(t.acc)
    n = hidden.shape[0]

    def body(j, carry):
        rows, counts, grads = carry
        z, y, weight, fresh, start, items = t.tile(j)
        loss, slope = element_terms(z, y, jnp.exp(-jnp.abs(z)))
        rows = rows + _weighted_rows(loss, weight)
        if compute_counts:
            counts = counts + _counts(z, y, fresh)
        dz = g[:, None] * slope * weight
        return rows, counts, _add_tile_grads(grads, dz, t.h, items, start)

    init = (jnp.zeros((n,), t.acc), jnp.zeros((2, n), jnp.float32), _zero_grads(hidden, item_weight, bias, t.acc))
    rows, counts, grads = lax.fori_loop(0, t.num_tiles, body, init)
    return (rows, counts if compute_counts else None, *grads)


def blocked_backward(hidden, item_weight, bias, class_weight, pos_weight, ids, g, *, block_v: int):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] or None)`
    in the accumulation dtype."""
    t = _Table(hidden, item_weight, bias, class_weight, pos_weight, ids, block_v)
    g = g.astype(t.acc)

    def body(j, grads):
        z, y, weight, _, start, items = t.tile(j)
        _, slope = element_terms(z, y, jnp.exp(-jnp.abs(z)))
        dz = g[:, None] * slope * weight
        return _add_tile_grads(grads, dz, t.h, items, start)

    return lax.fori_loop(0, t.num_tiles, body, _zero_grads(hidden, item_weight, bias, t.acc))


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
