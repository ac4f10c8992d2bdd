"""CutBCE in JAX: a loop over vocabulary tiles, nothing of size N x V.

Each element's exact loss and gradient comes from its own branch, so a confident positive's tiny
loss never meets a softplus(z) it would cancel against (docs/design.md, 'The math'):

- **Negatives, tile by tile.** Each logits tile `z = h @ E_t.T (+ b_t)` gets the row's positives
  set to -inf (`take_out`), then `negative_tile` computes `sum_v w softplus(z)` and
  `dz = g w sigmoid(z)`, which are 0 at -inf; on the CPU a C kernel does it in one pass and writes
  dz over z (negative_tile.py).
- **Positives, once per call** (`_Positives`, O(N L D)): each positive's logit from its own item
  row, its loss `cw pw softplus(-z)` and gradient `-g cw pw sigmoid(-z)`, added to the rows and to
  the gradients after the loop.

Another `Loss` (focal, label smoothing): the same two branches with softplus(u) and its slope
replaced by the loss's `term(u)` and `term'(u)` (u = z for a negative, -z at a positive; the Loss
goes unopened to `branch_math.branch_terms`). Metrics: the tiles count their negatives with z > 0, the positives their hits.

Three loops: forward; backward (recomputes each tile: four matmuls per tile in all); and
forward-with-gradient for a row gradient `g` known up front (scalar reductions: three matmuls).

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

from cutbce_common.shapes import MAX_CONTRACTION
from jax_kernels.blocked import negative_tile
from jax_kernels.compensated import pairwise_sum, two_sum
from jax_kernels.branch_math import branch_terms
from jax_kernels.positives import accumulation_dtype


class _Table:
    """The operands every tile reads: `h` in the accumulation dtype, the table and its `[V]` rows."""

    def __init__(self, hidden, item_weight, ids, bias, class_weight, pos_weight, block_v, loss=None,
                 cpu_kernel=True):
        self.acc = accumulation_dtype(hidden.dtype)
        self.loss = loss
        self.negatives = negative_tile.NegativeTile(loss, cpu_kernel)
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
        """Tile j: `(z [N, bv], weight [bv], start, items)`, z with the tile's positives at -inf.

        `weight` is the class weight on the columns this tile owns, 0 on the overlap of a shifted
        last tile.
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
        local = self.ids - start  # padding (-1) and other tiles' ids fall outside [0, bv): dropped
        column = jnp.where((local >= 0) & (local < bv), local, bv)
        z = z.at[self.rows, column].set(-jnp.inf, mode="drop")
        return z, weight, start, items

    def fresh_counts(self, z, start, j):
        """`[N]`: the negatives with z > 0 among the columns this tile owns."""
        fresh = start + jnp.arange(self.block_v) >= j * self.block_v
        return ((z > 0) & fresh).astype(jnp.float32).sum(-1)


class _Positives:
    """Every row's positives `[N, L]`, once per call: logits, weights (0 at padding), own terms."""

    def __init__(self, t: _Table):
        valid = t.ids >= 0
        at = jnp.where(valid, t.ids, 0)
        self.valid, self.drop_at = valid, jnp.where(valid, t.ids, t.num_items)  # scatters drop V
        self.items = t.item_weight[at].astype(t.acc)  # [N, L, D]
        # Elementwise products and a sum, not a dot: float32 on every platform (no TF32 / bf16 pass).
        self.logits = (self.items * t.h[:, None, :]).sum(-1)
        weight = jnp.ones(at.shape, t.acc)
        if t.bias is not None:
            self.logits = self.logits + t.bias[at]
        if t.class_weight is not None:
            weight = weight * t.class_weight[at]
        if t.pos_weight is not None:
            weight = weight * t.pos_weight[at]
        self.weight = weight
        self.loss, self.slope = branch_terms(self.logits, True, t.loss)

    def rows(self):
        """`[N]`: `sum_l cw pw loss` over each row's positives."""
        return jnp.where(self.valid, self.weight * self.loss, 0).sum(-1)

    def hits(self):
        return (self.valid & (self.logits > 0)).astype(jnp.float32).sum(-1)

    def add_grads(self, grads, t: _Table, g):
        """Adds the positives' `dz = g cw pw slope` to the `_zero_grads` accumulators."""
        (d_hidden, d_hidden_error), d_items, d_bias = grads
        d_hidden = d_hidden + d_hidden_error
        dz = jnp.where(self.valid, g[:, None] * self.weight * self.slope, 0)
        # Padded slots are masked after the product: their gathered row (item 0) may hold an inf.
        d_hidden = d_hidden + jnp.where(self.valid[..., None], dz[..., None] * self.items, 0).sum(1)
        d_items = d_items.at[self.drop_at].add(dz[..., None] * t.h[:, None, :], mode="drop")
        if d_bias is not None:
            d_bias = d_bias.at[self.drop_at].add(dz, mode="drop")
        return d_hidden, d_items, d_bias


def _two_sum(total, compensation, x):
    """`total + x`, its rounding error added to `compensation` (`compensated.two_sum`): rows and
    `d_hidden` summed over thousands of tiles stay as exact as one tile's sum."""
    total, error = two_sum(total, x)
    return total, compensation + error


def _counts(negatives_above_zero, p: _Positives):
    """`[2, N]` float32: predicted positives (TP + FP) and hits (TP)."""
    hits = p.hits()
    return jnp.stack([negatives_above_zero + hits, hits])


def blocked_forward(hidden, item_weight, ids, bias, class_weight, pos_weight, *, block_v: int, compute_counts: bool,
                    loss=None, cpu_kernel: bool = True):
    """Returns `(rows [N], counts [2, N] float32 or None)`: the rows in the accumulation dtype, and
    the predicted positives and hits (positives with z > 0) per row. `ids`: `positives.positive_ids`.
    `cpu_kernel`: whether the tiles may run `negative_tile`'s C kernel on the CPU (`CutBCEOptions.cpu_kernel`)."""
    t = _Table(hidden, item_weight, ids, bias, class_weight, pos_weight, block_v, loss, cpu_kernel)
    n = hidden.shape[0]

    def body(j, carry):
        rows, rows_error, above_zero = carry
        z, weight, start, _ = t.tile(j)
        if compute_counts:
            above_zero = above_zero + t.fresh_counts(z, start, j)
        return *_two_sum(rows, rows_error, t.negatives.rows(z, weight)), above_zero

    init = (jnp.zeros((n,), t.acc), jnp.zeros((n,), t.acc), jnp.zeros((n,), jnp.float32))
    rows, rows_error, above_zero = lax.fori_loop(0, t.num_tiles, body, init)
    p = _Positives(t)
    return rows + (rows_error + p.rows()), (_counts(above_zero, p) if compute_counts else None)


def blocked_value_and_grad(hidden, item_weight, ids, bias, class_weight, pos_weight, g, *, block_v: int,
                           compute_counts: bool, loss=None, cpu_kernel: bool = True):
    """Forward and backward in one loop, for an upstream gradient `g [N]` known before the forward.

    A scalar loss `sum_n g[n] rows[n]` (reductions 'mean' and 'sum') knows its row gradient up
    front, so each logit tile is computed once and serves softplus and sigmoid from one exponential:
    three matmuls per tile instead of the four of forward + backward. Returns
    `(rows, counts or None, d_hidden, d_item_weight, d_bias or None)` in the accumulation dtype.
    """
    t = _Table(hidden, item_weight, ids, bias, class_weight, pos_weight, block_v, loss, cpu_kernel)
    g = g.astype(t.acc)
    n = hidden.shape[0]

    def body(j, carry):
        rows, rows_error, above_zero, grads = carry
        z, weight, start, items = t.tile(j)
        if compute_counts:
            above_zero = above_zero + t.fresh_counts(z, start, j)
        tile_rows, dz = t.negatives.rows_grad(z, weight, g)
        return *_two_sum(rows, rows_error, tile_rows), above_zero, _add_tile_grads(grads, dz, t.h, items, start)

    zeros = jnp.zeros((n,), t.acc)
    init = (zeros, zeros, jnp.zeros((n,), jnp.float32), _zero_grads(hidden, item_weight, bias, t.acc))
    rows, rows_error, above_zero, grads = lax.fori_loop(0, t.num_tiles, body, init)
    p = _Positives(t)
    counts = _counts(above_zero, p) if compute_counts else None
    return (rows + (rows_error + p.rows()), counts, *p.add_grads(grads, t, g))


def blocked_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, g, *, block_v: int, loss=None,
                     cpu_kernel: bool = True):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden [N, D], d_item_weight [V, D], d_bias [V] or None)`
    in the accumulation dtype."""
    t = _Table(hidden, item_weight, ids, bias, class_weight, pos_weight, block_v, loss, cpu_kernel)
    g = g.astype(t.acc)

    def body(j, grads):
        z, weight, start, items = t.tile(j)
        return _add_tile_grads(grads, t.negatives.grad(z, weight, g), t.h, items, start)

    grads = lax.fori_loop(0, t.num_tiles, body, _zero_grads(hidden, item_weight, bias, t.acc))
    return _Positives(t).add_grads(grads, t, g)


def _zero_grads(hidden, item_weight, bias, acc):
    """The accumulators `((d_hidden [N, D], its rounding error), d_item_weight [V, D], d_bias [V] or None)`."""
    return (
        (jnp.zeros(hidden.shape, acc), jnp.zeros(hidden.shape, acc)),
        jnp.zeros(item_weight.shape, acc),
        None if bias is None else jnp.zeros(bias.shape, acc),
    )


def _add_tile_grads(grads, dz, h, items, start):
    """Adds tile j's share, from `dz [N, block_v]`, to the `_zero_grads` accumulators; `d_hidden`
    is carried compensated across tiles (`_two_sum`), as the rows are."""
    (d_hidden, d_hidden_error), d_items, d_bias = grads
    d_hidden, d_hidden_error = _two_sum(d_hidden, d_hidden_error, _hidden_grad_tile(dz, items))
    d_items = _add_rows(d_items, _table_grad_tile(h, dz), start)
    if d_bias is not None:
        d_bias = _add_rows(d_bias, dz.sum(0), start)
    return (d_hidden, d_hidden_error), d_items, d_bias


def _hidden_grad_tile(dz, items):
    """`dz @ items` `[N, D]`, no dot summing more than `MAX_CONTRACTION` terms (shapes.py says why):
    the tile's columns in chunks, one batched dot, the chunks' products added pairwise
    (`compensated.pairwise_sum`). The partial products take `D / MAX_CONTRACTION` of the tile's size."""
    n, width = dz.shape
    if width <= MAX_CONTRACTION:
        return dz @ items
    chunks, rest = divmod(width, MAX_CONTRACTION)
    head = chunks * MAX_CONTRACTION
    parts = jnp.einsum("nck,ckd->cnd", dz[:, :head].reshape(n, chunks, MAX_CONTRACTION),
                       items[:head].reshape(chunks, MAX_CONTRACTION, -1))
    if rest:
        parts = jnp.concatenate([parts, (dz[:, head:] @ items[head:])[None]])
    return pairwise_sum(parts)


def _table_grad_tile(h, dz):
    """`dz.T @ h`, the `[block_v, D]` tile of the table gradient, computed as `(h.T @ dz).T`.

    XLA:CPU runs the product with the `[D, block_v]` output about twice as fast as the one with the
    `[block_v, D]` output, which made the table gradient the costliest matmul of the loop
    (benchmarks/results/cpu_speed.md). The barrier keeps XLA's simplifier from folding the transpose back into
    the slow product; transposing the small tile costs little, and the `[V, D]` accumulator stays
    the only table-sized buffer (a `[D, V]` one would need a `[V, D]` copy at the end).
    """
    return lax.optimization_barrier(h.T @ dz).T


def _add_rows(total, tile, start):
    current = lax.dynamic_slice_in_dim(total, start, tile.shape[0])
    return lax.dynamic_update_slice_in_dim(total, current + tile, start, axis=0)
