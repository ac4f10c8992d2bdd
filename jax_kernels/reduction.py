"""Rows -> the loss of a reduction, and the row weights of the scalar reductions (JAX entries)."""

from __future__ import annotations

import jax.numpy as jnp

from cutbce_common.shapes import accumulation_dtype_name, reduction_divisor


def reduce_rows(rows, reduction, num_items):
    """Framework code the oracle shares (no engine in it). 'none': the rows; 'sum': their sum; 'mean': the sum over N x V (`shapes.reduction_divisor`)."""
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / reduction_divisor(reduction, rows.shape[0], num_items)


def scalar_row_weight(weight, reduction, num_positions, num_items, dtype):
    """Each row's factor in the scalar loss: weight (or 1) over the reduction's divisor (as reduce_rows)."""
    acc = accumulation_dtype_name(jnp.dtype(dtype).name)
    w = jnp.ones((num_positions,), acc) if weight is None else weight.reshape(num_positions).astype(acc)
    return w / reduction_divisor(reduction, num_positions, num_items)


def finish(rows_engine, weighted_sum_engine, operands, weight, reduction, lead_shape, num_items, return_metrics):
    """The JAX entry's tail, once for every engine: engine call -> position weight -> reduction -> metrics.

    `rows_engine(*operands)` gives `(rows [N], counts [4, N])`; `weighted_sum_engine(*operands,
    row_weight)` gives `(sum_n row_weight[n] rows[n], counts)` with the gradients computed in the
    forward, used for 'sum' / 'mean' (N = 0 takes the rows route: 'mean' is then 0 / 0 = nan, as
    torch). `operands` start with `hidden [N, D]`.
    """
    hidden = operands[0]
    n = hidden.shape[0]
    if reduction != "none" and n > 0:
        row_weight = scalar_row_weight(weight, reduction, n, num_items, hidden.dtype)
        loss, counts = weighted_sum_engine(*operands, row_weight)
    else:
        rows, counts = rows_engine(*operands)
        if weight is not None:
            rows = rows * weight.reshape(n).astype(rows.dtype)
        loss = reduce_rows(rows, reduction, num_items).reshape(lead_shape if reduction == "none" else ())
    if weight is not None:
        counts = counts * weight.reshape(1, n).astype(counts.dtype)
    if not return_metrics:
        return loss
    if reduction == "none":
        return loss, tuple(c.reshape(lead_shape) for c in counts)
    return loss, tuple(counts.sum(-1))
