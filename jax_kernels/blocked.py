"""CutBCE in pure JAX: a loop over vocabulary tiles, nothing of size N x V.

Each tile computes every element's exact loss and gradient, its positives included. The tile is
first evaluated as if every item were a negative (`cw softplus(z)`, `g cw sigmoid(z)`), then the
at most L elements of each row that are positives in this tile are *replaced*, before any sum, by
their own branch (`cw pw softplus(-z)`, `-g cw pw sigmoid(-z)`, from the same rounded logits):

    rows[n]   = sum_v weight * l[n, v]                count_pos[n] = #{v : z > 0}
    dz[n, v]  = g[n] weight (+-sigmoid(+-z))          hits[n] = #{positives v : z > 0}

Focal CutBCE (`focal`): the same two branches with softplus(u) and its slope replaced by focal's
`term(u)` and `term'(u)` (u = z for a negative, -z at a positive; `positives.focal_terms`), times
its class balance.

A replacement, not a subtraction: a confident positive's tiny loss never meets its softplus(z).
The positives of a tile are a gather and a scatter of O(N L) elements (on XLA:CPU about 4x
cheaper than a boolean `[N, block_v]` mask: the tile's passes stay as they were). Three loops:
forward; backward (recomputes each tile: four matmuls per tile in all); and forward-with-gradient
for a row gradient `g` known up front (scalar reductions: three matmuls).

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

from jax_kernels.positives import accumulation_dtype, element_terms, focal_terms, log1p_unit


class _Table:
    """The operands every tile reads: `h` in the accumulation dtype, the table and its `[V]` rows."""

    def __init__(self, hidden, item_weight, bias, class_weight, pos_weight, ids, block_v, focal=None):
        self.acc = accumulation_dtype(hidden.dtype)
        self.focal = focal
        self.h = hidden.astype(self.acc)
        self.item_weight, self.ids = item_weight, ids
        self.bias, self.class_weight, self.pos_weight = (
            None if x is None else x.astype(self.acc) for x in (bias, class_weight, pos_weight)
        )
        self.num_items = item_weight.shape[0]
        self.block_v = min(block_v, self.num_items)
        self.num_tiles = -(-self.num_items // self.block_v)
        self.rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)

    def tile(self, j):
        """Tile j: `(z [N, bv], weight [bv], start, items, positives)`.

        `weight` is the class weight on the columns this tile owns, 0 on the overlap of a shifted
        last tile. `positives` is `(column [N, L], z_pos, weight_pos, pw_pos)`: each row's
        positives in this tile, columns out of the tile (bv: scatters drop them) weighted 0.
        """
        bv = self.block_v
        start = jnp.minimum(j * bv, self.num_items - bv)
        items = lax.dynamic_slice_in_dim(self.item_weight, start, bv).astype(self.acc)
        z = self.h @ items.T
        if self.bias is not None:
            z = z + lax.dynamic_slice_in_dim(self.bias, start, bv)
        weight = (start + jnp.arange(bv) >= j * bv).astype(self.acc)
        if self.class_weight is not None:
            weight = weight * lax.dynamic_slice_in_dim(self.class_weight, start, bv)
        local = self.ids - start
        inside = (local >= 0) & (local < bv)
        gather_at = jnp.where(inside, local, 0)
        z_pos = z[self.rows, gather_at]
        weight_pos = jnp.where(inside, weight[gather_at], 0)
        pw_pos = 1 if self.pos_weight is None else lax.dynamic_slice_in_dim(self.pos_weight, start, bv)[gather_at]
        return z, weight, start, items, (jnp.where(inside, local, bv), z_pos, weight_pos, pw_pos)

    def replace(self, tile_values, column, values):
        """`tile_values` with each row's positives set to `values` `[N, L]` (out-of-tile columns dropped)."""
        return tile_values.at[self.rows, column].set(values, mode="drop")


def _negative_terms(z, focal):
    """`(loss, slope)` of every element as if it were a negative: `(softplus(z), sigmoid(z))`, or
    with focal `ns * (term(z), term'(z))` (jax_kernels/focal.py, ns its negative_scale)."""
    e = jnp.exp(-jnp.abs(z))
    if focal is None:
        return element_terms(z, jnp.zeros(z.shape, bool), e)
    term, slope = focal_terms(z, e, _tail(e), focal.gamma)
    return _scaled(term, focal.negative_scale), _scaled(slope, focal.negative_scale)


def _positive_terms(z_pos, focal):
    """`(loss, slope)` at the positives `[N, L]`: `(softplus(-z), -sigmoid(-z))`, or with focal
    `ps * (term(-z), -term'(-z))` (u = -z at a positive, du/dz = -1; ps the positive_scale)."""
    e = jnp.exp(-jnp.abs(z_pos))
    if focal is None:
        return element_terms(z_pos, jnp.ones(z_pos.shape, bool), e)
    term, slope = focal_terms(-z_pos, e, _tail(e), focal.gamma)
    return _scaled(term, focal.positive_scale), _scaled(-slope, focal.positive_scale)


def _tail(e):
    """log1p(e), e in [0, 1], as `element_terms` computes it."""
    return jnp.log1p(e) if e.dtype == jnp.float64 else log1p_unit(e)


def _scaled(x, scale: float):
    return x if scale == 1.0 else x * scale


def _tile_rows_and_counts(t, z, weight, start, j, positives, compute_counts):
    column, z_pos, weight_pos, pw_pos = positives
    loss, slope = _negative_terms(z, t.focal)
    loss = t.replace(loss, column, pw_pos * _positive_terms(z_pos, t.focal)[0])
    rows = loss @ weight
    counts = None
    if compute_counts:
        fresh = start + jnp.arange(t.block_v) >= j * t.block_v
        owned = jnp.where(column < t.block_v, fresh[jnp.minimum(column, t.block_v - 1)], False)
        predicted = ((z > 0) & fresh).astype(jnp.float32).sum(-1)
        hits = (owned & (z_pos > 0)).astype(jnp.float32).sum(-1)
        counts = jnp.stack([predicted, hits])
    return rows, counts, slope


def _tile_grad(t, slope, weight, g, positives):
    column, z_pos, weight_pos, pw_pos = positives
    dz = g[:, None] * slope * weight
    return t.replace(dz, column, g[:, None] * weight_pos * pw_pos * _positive_terms(z_pos, t.focal)[1])


def blocked_forward(hidden, item_weight, bias, class_weight, pos_weight, ids, *, block_v: int, compute_counts: bool,
                    focal=None):
    """Returns `(rows [N], counts [2, N] float32 or None)`: the rows in the accumulation dtype, and
    the predicted positives and hits (positives with z > 0) per row. `ids`: `positives.positive_ids`."""
    t = _Table(hidden, item_weight, bias, class_weight, pos_weight, ids, block_v, focal)
    n = hidden.shape[0]

    def body(j, carry):
        rows, counts = carry
        z, weight, start, _, positives = t.tile(j)
        tile_rows, tile_counts, _ = _tile_rows_and_counts(t, z, weight, start, j, positives, compute_counts)
        return rows + tile_rows, (counts + tile_counts if compute_counts else counts)

    init = (jnp.zeros((n,), t.acc), jnp.zeros((2, n), jnp.float32))
    rows, counts = lax.fori_loop(0, t.num_tiles, body, init)
    return rows, (counts if compute_counts else None)


def blocked_value_and_grad(hidden, item_weight, bias, class_weight, pos_weight, ids, g, *, block_v: int,
                           compute_counts: bool, focal=None):
    """Forward and backward in one loop, for an upstream gradient `g [N]` known before the forward.

    A scalar loss `sum_n g[n] rows[n]` (reductions 'mean' and 'sum') knows its row gradient up
    front, so each logit tile is computed once and serves softplus and sigmoid from one exponential:
    three matmuls per tile instead of the four of forward + backward. Returns
    `(rows, counts or None, d_hidden, d_item_weight, d_bias or None)` in the accumulation dtype.
    """
    t = _Table(hidden, item_weight, bias, class_weight, pos_weight, ids, block_v, focal)
    g = g.astype(t.acc)
    n = hidden.shape[0]

    def body(j, carry):
        rows, counts, grads = carry
        z, weight, start, items, positives = t.tile(j)
        tile_rows, tile_counts, slope = _tile_rows_and_counts(t, z, weight, start, j, positives, compute_counts)
        dz = _tile_grad(t, slope, weight, g, positives)
        counts = counts + tile_counts if compute_counts else counts
        return rows + tile_rows, counts, _add_tile_grads(grads, dz, t.h, items, start)

    init = (jnp.zeros((n,), t.acc), jnp.zeros((2, n), jnp.float32), _zero_grads(hidden, item_weight, bias, t.acc))
    rows, counts, grads = lax.fori_loop(0, t.num_tiles, body, init)
    return (rows, counts if compute_counts else None, *grads)


def blocked_backward(hidden, item_weight, bias, class_weight, pos_weight, ids, g, *, block_v: int, focal=None):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] or None)`
    in the accumulation dtype."""
    t = _Table(hidden, item_weight, bias, class_weight, pos_weight, ids, block_v, focal)
    g = g.astype(t.acc)

    def body(j, grads):
        z, weight, start, items, positives = t.tile(j)
        _, slope = _negative_terms(z, t.focal)
        return _add_tile_grads(grads, _tile_grad(t, slope, weight, g, positives), t.h, items, start)

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
