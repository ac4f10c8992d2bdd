"""Rows -> the loss of a reduction, and the row weights of the scalar reductions (JAX entries)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_kernels.positives import accumulation_dtype
from jax_kernels.shapes import reduction_divisor


def reduce_rows(rows, reduction, num_items):
    """'none': the rows; 'sum': their sum; 'mean': the sum over N x V (`shapes.reduction_divisor`)."""
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / reduction_divisor(reduction, rows.shape[0], num_items)


def scalar_row_weight(weight, reduction, num_positions, num_items, dtype):
    """Each row's factor in the scalar loss: weight (or 1) over the reduction's divisor (as reduce_rows)."""
    acc = accumulation_dtype(dtype)
    w = jnp.ones((num_positions,), acc) if weight is None else weight.reshape(num_positions).astype(acc)
    return w / reduction_divisor(reduction, num_positions, num_items)
