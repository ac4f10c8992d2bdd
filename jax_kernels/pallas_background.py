"""Pallas TPU kernels of CutBCE: every element's exact loss, one logits tile at a time.

Each kernel sees the positive ids of its rows and evaluates every element of the `[N, V]` loss of
docs/design.md ('The math') inside the `[block_n, block_v]` tile where it falls: the positives are taken out
of the background there, and nothing is corrected afterwards. With
`z[n, v] = hidden[n] . item_weight[v] + bias[v]`, `y[n, v] = 1` iff v is in `ids[n, :]`, cw the
class weight and pw the pos weight (each 1 when None):

    zs[n, v]     = -z if y else z             (the logit the element's loss is a softplus of)
    wgt[n, v]    = cw[v] * (pw[v] if y else 1)
    rows[n]      = sum_v wgt * softplus(zs)   (= sum_v cw * (pw softplus(-z) if y else softplus(z)))
    predicted[n] = sum_v (z > 0),  hits[n] = sum_v y * (z > 0)              (unweighted, float32)
    dz[n, v]     = g[n] * wgt * (-sigmoid(zs) if y else sigmoid(zs))        (g: upstream of rows)
    d_hidden     = dz @ item_weight,  d_item_weight = dz^T @ hidden,  d_bias = sum_n dz

Why in the tile: a background `sum_v cw softplus(z)` over all items followed by `-z` at each
positive computes `softplus(-z) = softplus(z) - z` by cancellation. At a confident positive (z = 31)
the row sum holds 31 and loses the true loss, 3.4e-14, in its rounding. Here each element costs one
exp: `e = exp(-|z|)` (= exp(-|zs|)) gives `softplus(zs) = max(zs, 0) + log1p(e)` and
`sigmoid(zs) = (1 if zs >= 0 else e) / (1 + e)`, both free of cancellation for either label.

y of a tile: the rows' ids block `[block_n, L]` (int32; -1 in unused slots and padded rows, so it
never equals a column index) is compared, slot by slot, with the tile's global column indices (an
iota plus the tile's first column) and the L results OR-ed. L = 0 passes no ids at all (y = False).

Three kernels (bodies in `pallas_kernels.py`, their `pallas_call`s in `pallas_calls.py`), each
recomputing its logits tile with one MXU matmul into a `[block_n, block_v]` f32 VMEM scratch and
then walking it in strips of 8 rows for the elementwise work (targets, softplus or sigmoid,
weights), so that the VMEM of the temporaries does not grow with L (README.md has the grids, bytes
moved and VMEM use):
- forward, grid (token tiles "parallel", item tiles "arbitrary"): per-row sums accumulate in output
  blocks that stay resident across the item axis;
- d_hidden, same grid: the `[block_n, D]` f32 output block accumulates `(dz / g) @ W`; g is applied
  afterwards (it is constant along the reduction). Since dz / g does not depend on g, the same
  kernel can also accumulate the forward's rows and counts from the same tile: that is
  `pallas_background_value_and_grad`, the one-pass gradient of the scalar reductions (g known up
  front): 4 `N x V x D` matmul passes instead of forward + backward's 5;
- d_item_weight and d_bias, grid (item tiles "parallel", token tiles "arbitrary"): an f32 block
  resident across the token axis accumulates the tile's `dz^T @ hidden`, written once in the
  table's dtype.
No `[v_tiles, N, D]` partial sums reach HBM (the reference backward's flaw).

The table's layout: where XLA stores a `[V, D]` table with V in lanes (TPU does so when D is no
multiple of 128, to avoid padding D to 128 lanes), the kernels take `item_weight.T` `[D, V]`, a
free bitcast of that storage, and give back d_item_weight as `[D, V]` too; otherwise they take
`[V, D]` as is (`_items_in_lanes`). Either way no table-sized copy and no f32 table-sized
gradient reaches HBM: the compiled training step's HBM temp at V 876,939, D 64, bf16 on v5e went
from 642.6 MiB to 0 (benchmarks/results/tpu_temp_before_after.md).

Ragged shapes: N is zero-padded to a tile multiple in the launcher (hidden rows are cheap to copy;
padded rows get ids -1 and g = 0, so they add nothing). The item table is never copied: the last
item tile reads past V, Pallas fills that part of the block with unspecified values (NaN in
interpret mode), and the kernels mask those columns wherever they are summed over; outputs past V
are dropped. Ids are < V, so y is False in those columns. D is never padded: the blocks span it.

Focal CutBCE (`focal`, static): softplus(zs) and sigmoid(zs) above become the focal `term(zs)`
and its derivative (jax_kernels/focal.py, `positives.focal_terms`: one more exp per element), and
with class balancing wgt is also multiplied by alpha at a positive and 1 - alpha elsewhere. The
masked columns past V (z = -1e30) give term = term' = 0 exactly there too. The strips' temporaries
grow by a few `[8, bv]` values, which the VMEM model's full-tile terms already cover.

Mode selection (`pallas_calls.on_platform`): `jax.lax.platform_dependent` picks the Mosaic kernel
when the computation is lowered for TPU and the same kernel under `interpret=True` otherwise, so an
export for TPU from a CPU host contains `tpu_custom_call` and a CPU `jit` runs the interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_kernels.block_sizes import LANES, BlockSizes, default_block_sizes
from jax_kernels.focal import Focal
from jax_kernels.pallas_calls import d_hidden_call, d_item_call, forward_call, on_platform

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_inputs(hidden, item_weight, bias, class_weight, pos_weight, ids):
    for name, x in (("hidden", hidden), ("item_weight", item_weight)):
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"Pallas kernels take float32 or bfloat16 {name}, got {x.dtype}: "
                "TPU has no float64 (use the blocked JAX path) and float16 should be cast to "
                "bfloat16"
            )
    if hidden.dtype != item_weight.dtype:
        raise TypeError(f"{hidden.dtype=} and {item_weight.dtype=} must match")
    if hidden.ndim != 2 or item_weight.ndim != 2 or hidden.shape[1] != item_weight.shape[1]:
        raise ValueError(f"expected hidden [N, D] and item_weight [V, D], got "
                         f"{hidden.shape} and {item_weight.shape}")
    v = item_weight.shape[0]
    for name, x in (("bias", bias), ("class_weight", class_weight), ("pos_weight", pos_weight)):
        if x is not None and x.shape != (v,):
            raise ValueError(f"{name} must have shape [V] = ({v},), got {x.shape}")
    if ids.ndim != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must have shape [N, L] with N = {hidden.shape[0]}, got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer, got {ids.dtype}")


def _items_in_lanes(d):
    """Whether the kernels take the item table as `[D, V]` (items along lanes) rather than `[V, D]`.

    XLA's TPU layout assignment stores a `[V, D]` array whose D is no multiple of 128 with V as
    its minor (lane) dimension, layout `{0,1}`: D along lanes would be padded to 128 (D = 64: twice
    the bytes). Measured with libtpu 0.0.20 for v5e and v6e: `{0,1}` for D = 8, 40, 64, 72, 96,
    192 and `{1,0}` for D = 128, 256. A Pallas call takes row-major (`{1,0}`) operands, so a
    `[V, D]` operand cost a lane-padded copy of the table (214 MiB at V 876,939, D 64, bf16) and
    its gradient a copy back; `item_weight.T` of a `{0,1}` array is a free bitcast to a row-major
    `[D, V]`, and so is the `[D, V]` gradient's `.T` into a `{0,1}` output. Off TPU (the
    interpreter) either form is correct, and the same rule keeps both tested.
    """
    return d % LANES != 0


def _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids, block_sizes, focal):
    """Pick and clip the tiles, pad hidden rows (zeros) and ids (-1) to a tile multiple, shape the
    row vectors. Returns `(operands, static)`: the kernels' inputs in order and the options."""
    _check_inputs(hidden, item_weight, bias, class_weight, pos_weight, ids)
    n, d = hidden.shape
    v = item_weight.shape[0]
    num_slots = ids.shape[1]
    bs = block_sizes or default_block_sizes(n, v, d, hidden.dtype, num_targets=num_slots)
    bs = bs.clipped(n, v)
    n_pad = -(-n // bs.block_n) * bs.block_n
    items_in_lanes = _items_in_lanes(d)
    operands = [jnp.pad(hidden, ((0, n_pad - n), (0, 0))) if n_pad != n else hidden,
                item_weight.T if items_in_lanes else item_weight]
    operands += [x.astype(jnp.float32).reshape(1, v)
                 for x in (bias, class_weight, pos_weight) if x is not None]
    if num_slots:
        operands.append(jnp.pad(ids.astype(jnp.int32), ((0, n_pad - n), (0, 0)),
                                constant_values=-1))
    flags = (bias is not None, class_weight is not None, pos_weight is not None, num_slots > 0)
    return operands, dict(n_pad=n_pad, v=v, d=d, num_slots=num_slots, bs=bs, flags=flags,
                          items_in_lanes=items_in_lanes, focal=focal)


def pallas_background_forward(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    ids: jax.Array,
    *,
    compute_counts: bool,
    block_sizes: BlockSizes | None = None,
    focal: Focal | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Exact per-row loss, without materializing `[N, V]` logits (formulas: module docstring).

    Args:
        hidden: `[N, D]` float32 or bfloat16.
        item_weight: `[V, D]`, same dtype as hidden.
        bias: `[V]` (cast to float32) or None for 0.
        class_weight: `[V]` (cast to float32) or None for 1.
        pos_weight: `[V]` (cast to float32) or None for 1; scales the positives' terms only.
        ids: `[N, L]` integer, the positive item ids of each row, de-duplicated and in `[0, V)`;
            every other slot holds -1. L may be 0 (no positives).
        compute_counts: also count, per row, the items with `z > 0` and the positives among them.
        block_sizes: tiles and VMEM limit; None derives them from the chip (`default_block_sizes`).
        focal: a `jax_kernels.focal.Focal`: each element's softplus(zs) becomes the focal
            `term(zs)`, scaled by its class balance (`positives.focal_terms`); None: plain.

    Returns:
        `rows` `[N]` float32, `sum_v cw * (pw * softplus(-z) if y else softplus(z))`; and, when
        `compute_counts` (else None each), `predicted` `[N]` float32, the count of `z > 0`, and
        `hits` `[N]` float32, the count of positives with `z > 0` (both unweighted).

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    n = hidden.shape[0]
    operands, static = _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids,
                                block_sizes, focal)
    call = functools.partial(forward_call, compute_counts=compute_counts, **static)
    return _summed_rows(on_platform(call, *operands), n, compute_counts, static)


def pallas_background_backward(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    ids: jax.Array,
    g: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    focal: Focal | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `sum_n g[n] * rows[n]` with respect to hidden, item_weight and bias.

    `dz[n, v] = g[n] * cw[v] * (-pw[v] * sigmoid(-z) if y else sigmoid(z))`; two kernels recompute
    the logits: one reduces over items for d_hidden, the other over positions for d_item_weight
    and d_bias.

    Args:
        hidden, item_weight, bias, class_weight, pos_weight, ids: as in `pallas_background_forward`.
        g: `[N]` upstream gradient of rows (cast to float32).
        block_sizes: tiles and VMEM limit; None derives them from the chip.
        focal: as in `pallas_background_forward` (dz / g is focal's `term'`, signed and weighted).

    Returns:
        `d_hidden` `[N, D]` float32, `d_item_weight` `[V, D]` in item_weight's dtype (accumulated
        in float32 and rounded once), and `d_bias` `[V]` float32 (None when bias is None).

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    _check_g(g, hidden.shape[0])
    operands, static = _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids,
                                block_sizes, focal)
    acc = on_platform(functools.partial(d_hidden_call, **static), *operands)
    return (_times_g(g, acc, hidden.shape[0]),
            *_table_grads(operands, static, g, has_bias=bias is not None))


def pallas_background_value_and_grad(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    ids: jax.Array,
    g: jax.Array,
    *,
    compute_counts: bool,
    block_sizes: BlockSizes | None = None,
    focal: Focal | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array, jax.Array, jax.Array | None]:
    """`pallas_background_forward` and `pallas_background_backward` in two kernels instead of three.

    For an upstream gradient `g` known before the forward (the scalar reductions 'mean' and 'sum'),
    the d_hidden kernel also accumulates the rows and counts from the logits tile it computes
    anyway, so the forward kernel does not run: 4 `N x V x D` matmul passes instead of 5 (the
    d_hidden kernel's two, the d_item kernel's two), and the forward kernel's reads of the table
    (one per token tile) are saved.

    Args:
        hidden, item_weight, bias, class_weight, pos_weight, ids, compute_counts, focal: as in
            `pallas_background_forward`.
        g: `[N]` upstream gradient of rows (cast to float32).
        block_sizes: tiles and VMEM limit; None derives them from the chip.

    Returns:
        `(rows, predicted, hits)` as `pallas_background_forward` returns them, then
        `(d_hidden, d_item_weight, d_bias)` as `pallas_background_backward` does.

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    n = hidden.shape[0]
    _check_g(g, n)
    operands, static = _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids,
                                block_sizes, focal)
    call = functools.partial(d_hidden_call, with_rows=True, compute_counts=compute_counts,
                             **static)
    acc, *row_outs = on_platform(call, *operands)
    return (*_summed_rows(row_outs, n, compute_counts, static), _times_g(g, acc, n),
            *_table_grads(operands, static, g, has_bias=bias is not None))


def _check_g(g, n):
    if g.shape != (n,):
        raise ValueError(f"g must have shape [N] = ({n},), got {g.shape}")


def _summed_rows(lane_partials, n, compute_counts, static):
    """`(rows, predicted, hits)` `[N]` from the kernels' `[n_pad, 128]` lane-partial outputs: the
    cross-lane sum runs here, once, in XLA. Without ids there are no hits: zeros."""
    outs = [jnp.sum(x[:n], axis=1) for x in lane_partials]
    if not compute_counts:
        return outs[0], None, None
    hits = outs[2] if static["num_slots"] else jnp.zeros((n,), jnp.float32)
    return outs[0], outs[1], hits


def _times_g(g, acc, n):
    """d_hidden `[N, D]` f32 from the kernel's `(dz / g) @ W`: g is constant along the items."""
    return g.astype(jnp.float32)[:, None] * acc[:n]


def _table_grads(operands, static, g, *, has_bias):
    """`(d_item_weight [V, D] in the table's dtype, d_bias [V] f32 or None)` from the d_item kernel."""
    n_pad = static["n_pad"]
    # Padded rows get g = 0, so their (finite) sigmoids add nothing to d_item_weight or d_bias.
    g32 = g.astype(jnp.float32)
    g_lanes = jnp.broadcast_to(jnp.pad(g32, (0, n_pad - g.shape[0]))[:, None], (n_pad, LANES))
    outs = on_platform(functools.partial(d_item_call, **static), *operands, g_lanes)
    d_bias = outs[1][0] if has_bias else None
    return (outs[0].T if static["items_in_lanes"] else outs[0]), d_bias
