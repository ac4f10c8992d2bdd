"""The Pallas TPU engine's launchers: every element's exact loss and gradients, one logits tile at a time.

Each kernel compares the tile's columns with its rows' ids and evaluates each element on its own
branch inside the tile (docs/design.md, 'How each engine stays exact'); nothing is corrected
afterwards. These launchers check dtypes, pad N to a tile multiple (the table is never copied:
columns past V are masked in the kernels), choose the table's layout (`_items_in_lanes`) and sum
the lane partials. The formulas, grids, VMEM use, ragged shapes and the interpret / Mosaic choice:
docs/jax.md; the layout's HBM saving: benchmarks/results/tpu_temp_before_after.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cutbce_common.shapes import KERNEL_DTYPES, ArraySpec, check_arguments
from jax_kernels.pallas.block_sizes import LANES, BlockSizes, default_block_sizes
from cutbce_common.loss import PLAIN, Loss
from jax_kernels.pallas.calls import d_hidden_call, d_item_call, forward_call, on_platform

def _spec(x):
    return None if x is None else ArraySpec(tuple(x.shape), jnp.dtype(x.dtype).name)


def _check_inputs(hidden, item_weight, ids, bias, class_weight, pos_weight):
    """The launchers run on their own too (tests, benchmarks): the entries' rules (`shapes`), plus
    what the kernels add: one dtype of `KERNEL_DTYPES` for hidden and the table, and `[N, D]` hidden."""
    for name, x in (("hidden", hidden), ("item_weight", item_weight)):
        if jnp.dtype(x.dtype).name not in KERNEL_DTYPES:
            raise TypeError(
                f"Pallas kernels take {' or '.join(KERNEL_DTYPES)} {name}, got {x.dtype}: TPU has no "
                "float64 (use the blocked JAX path) and float16 should be cast to bfloat16"
            )
    if hidden.dtype != item_weight.dtype:
        raise TypeError(f"{hidden.dtype=} and {item_weight.dtype=} must match")
    if hidden.ndim != 2:
        raise ValueError(f"hidden must have shape [N, D], got {hidden.shape}")
    # The launchers take deduplicated `ids`, not the entries' `targets`: their checks name them.
    if len(ids.shape) != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must have shape [N, L] with N = {hidden.shape[0]}, got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer, got {ids.dtype}")
    check_arguments(_spec(hidden), _spec(item_weight), ArraySpec(tuple(ids.shape), "int32"), _spec(bias), None,
                    _spec(class_weight), _spec(pos_weight))


def _items_in_lanes(d):
    """Whether the kernels take the item table as `[D, V]` (items along lanes) rather than `[V, D]`.

    XLA on TPU stores a `[V, D]` array whose D is no multiple of 128 with V along lanes (layout
    `{0,1}`); a Pallas call takes row-major operands, so a `[V, D]` operand would cost a lane-padded
    copy of the table and of its gradient, while `item_weight.T` of a `{0,1}` array (and the `[D, V]`
    gradient's `.T`) is a free bitcast. The layouts measured and the HBM saved: benchmarks/results/tpu_temp_before_after.md. Off TPU (the interpreter) either form is correct, and the same rule keeps both tested.
    """
    return d % LANES != 0


def _prepare(hidden, item_weight, ids, bias, class_weight, pos_weight, block_sizes, loss):
    """Pick and clip the tiles, pad hidden rows (zeros) and ids (-1) to a tile multiple, shape the
    row vectors. Returns `(operands, static)`: the kernels' inputs in order and the options."""
    _check_inputs(hidden, item_weight, ids, bias, class_weight, pos_weight)
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
                          items_in_lanes=items_in_lanes, loss=loss)


def pallas_forward(
    hidden: jax.Array,
    item_weight: jax.Array,
    ids: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    *,
    compute_counts: bool,
    block_sizes: BlockSizes | None = None,
    loss: Loss = PLAIN,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Exact per-row loss, without materializing `[N, V]` logits (formulas: docs/jax.md).

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
        loss: the call's `cutbce_common.loss.Loss`: each element's softplus(zs) becomes its
            `term(zs)`, scaled by its class balance (`branch_math.labelled_terms`); static.

    Returns:
        `rows` `[N]` float32, `sum_v cw * (pw * softplus(-z) if y else softplus(z))`; and, when
        `compute_counts` (else None each), `predicted` `[N]` float32, the count of `z > 0`, and
        `hits` `[N]` float32, the count of positives with `z > 0` (both unweighted).

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    n = hidden.shape[0]
    operands, static = _prepare(hidden, item_weight, ids, bias, class_weight, pos_weight,
                                block_sizes, loss)
    call = functools.partial(forward_call, compute_counts=compute_counts, **static)
    return _summed_rows(on_platform(call, *operands), n, compute_counts, static)


def pallas_backward(
    hidden: jax.Array,
    item_weight: jax.Array,
    ids: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    g: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    loss: Loss = PLAIN,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `sum_n g[n] * rows[n]` with respect to hidden, item_weight and bias.

    `dz[n, v] = g[n] * cw[v] * (-pw[v] * sigmoid(-z) if y else sigmoid(z))`; two kernels recompute
    the logits: one reduces over items for d_hidden, the other over positions for d_item_weight
    and d_bias.

    Args:
        hidden, item_weight, ids, bias, class_weight, pos_weight: as in `pallas_forward`.
        g: `[N]` upstream gradient of rows (cast to float32).
        block_sizes: tiles and VMEM limit; None derives them from the chip.
        loss: as in `pallas_forward` (dz / g is its `term'`, signed and weighted).

    Returns:
        `d_hidden` `[N, D]` float32, `d_item_weight` `[V, D]` in item_weight's dtype (accumulated
        in float32 and rounded once), and `d_bias` `[V]` float32 (None when bias is None).

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    _check_g(g, hidden.shape[0])
    operands, static = _prepare(hidden, item_weight, ids, bias, class_weight, pos_weight,
                                block_sizes, loss)
    acc = on_platform(functools.partial(d_hidden_call, **static), *operands)
    return (_times_g(g, acc, hidden.shape[0]),
            *_table_grads(operands, static, g, has_bias=bias is not None))


def pallas_value_and_grad(
    hidden: jax.Array,
    item_weight: jax.Array,
    ids: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    g: jax.Array,
    *,
    compute_counts: bool,
    block_sizes: BlockSizes | None = None,
    loss: Loss = PLAIN,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array, jax.Array, jax.Array | None]:
    """`pallas_forward` and `pallas_backward` in two kernels instead of three.

    For an upstream gradient `g` known before the forward (the scalar reductions 'mean' and 'sum'),
    the d_hidden kernel also accumulates the rows and counts from the logits tile it computes
    anyway, so the forward kernel does not run: 4 `N x V x D` matmul passes instead of 5 (the
    d_hidden kernel's two, the d_item kernel's two), and the forward kernel's reads of the table
    (one per token tile) are saved.

    Args:
        hidden, item_weight, ids, bias, class_weight, pos_weight, compute_counts, loss: as in
            `pallas_forward`.
        g: `[N]` upstream gradient of rows (cast to float32).
        block_sizes: tiles and VMEM limit; None derives them from the chip.

    Returns:
        `(rows, predicted, hits)` as `pallas_forward` returns them, then
        `(d_hidden, d_item_weight, d_bias)` as `pallas_backward` does.

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    n = hidden.shape[0]
    _check_g(g, n)
    operands, static = _prepare(hidden, item_weight, ids, bias, class_weight, pos_weight,
                                block_sizes, loss)
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
