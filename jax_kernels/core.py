"""The CutBCE rows: forward and backward as module-level functions, and two `jax.custom_vjp`s.

`cut_bce_forward` and `cut_bce_backward` are the entry points into the math. `cut_bce_rows` (the
custom_vjp of the per-position rows) uses them, and so does torch_cutbce's torch_xla bridge (through
`torch_xla.core.xla_builder.call_jax`, whose lowering cache is keyed by the function's id: these are
module-level functions and must stay so). The backward never re-runs the whole forward: it
recomputes the logit tiles for the gradient, nothing else. Every engine computes each element's
exact loss inside its tile, positives included (`positives.py`).
`cut_bce_weighted_sum` serves the scalar reductions: their row gradients are known up front, so
`cut_bce_value_and_grad` computes loss and gradients with one fewer pass over the tiles (blocked:
one loop instead of two; Pallas: two kernels instead of three).
Every entry runs resolved options (`cutbce_common.options.CutBCEOptions.resolved`: the one config
type of both frameworks); `OneDevice` holds them as the custom_vjps' one-device place.

Per-position `weight` is not seen here: rows are computed with `w[n, v] = class_weight[v]`, and the
caller multiplies by `weight[n]` in plain JAX / torch, where autodiff gives `weight` its gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_kernels import positives
from cutbce_common.options import CutBCEOptions
from jax_kernels.engines import ENGINES, engine_for

IMPLS = tuple(ENGINES)


def check_resolved(options) -> None:
    """The entries below run resolved options only (`CutBCEOptions.resolved`): a tile width and an engine."""
    if not isinstance(options, CutBCEOptions):
        raise TypeError(f"options must be a CutBCEOptions, got {options!r}")
    if options.block_v is None or options.impl not in IMPLS:
        raise ValueError(
            f"options must be resolved (CutBCEOptions.resolved: block_v an int, impl one of {IMPLS}), "
            f"got block_v={options.block_v!r}, impl={options.impl!r}"
        )


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """One device as the place of the custom_vjps below (`sharded.ShardedLayout` is the other: a mesh).

    Hashable (a `nondiff_argnums` of the custom_vjps and a `call_jax` key): it holds only the
    resolved `options` (`CutBCEOptions.resolved`), the one config type.
    """

    options: CutBCEOptions

    def __post_init__(self):
        check_resolved(self.options)

    def forward(self, *operands):
        return cut_bce_forward(*operands, options=self.options)

    def backward(self, *operands_and_g):
        return cut_bce_backward(*operands_and_g, options=self.options)

    def value_and_grad(self, *operands_and_g):
        return cut_bce_value_and_grad(*operands_and_g, options=self.options)


def _metric_counts(options, counted, ids, num_items):
    """`[4, N]` TP, FP, FN, TN from the tiles' `[predicted, hits]` (or the `[0, N]` placeholder)."""
    if not options.compute_metrics:
        return jnp.zeros((0, ids.shape[0]), jnp.float32)
    predicted, hits = counted
    num_pos = positives.num_positives(ids)
    fp = predicted - hits
    return jnp.stack([hits, fp, num_pos - hits, num_items - num_pos - fp])


def _in_input_dtypes(hidden, item_weight, bias, grads):
    """Gradients accumulated in float32/float64, returned in the inputs' dtypes.

    The Pallas d_item_weight arrives in the table's dtype already (the kernel rounds its f32
    accumulator once), so its `astype` is a no-op and adds no table-sized buffer.
    """
    d_hidden, d_item_weight, d_bias = grads
    return (
        d_hidden.astype(hidden.dtype),
        d_item_weight.astype(item_weight.dtype),
        None if bias is None else d_bias.astype(bias.dtype),
    )


def cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, *, options: CutBCEOptions):
    """Per-position loss rows (reference.py's formula with weight = 1, the loss `options.loss`).

    Args:
      hidden: `[N, D]`. item_weight: `[V, D]` (same dtype). targets: `[N, L]` int; ids outside
        `[0, V)` are padding. bias, class_weight, pos_weight: `[V]` or None.
      options: resolved (`CutBCEOptions.resolved`); the engine reads block_v, compute_metrics,
        impl, block_sizes, loss and cpu_kernel.

    Returns:
      `rows [N]` in the accumulation dtype (float32, or float64 for float64 inputs), and with
      `options.compute_metrics` a `[4, N]` float32 array of unweighted TP, FP, FN, TN counts
      (else a `[0, N]` placeholder, so the output structure is always the same pair).
    """
    check_resolved(options)
    ids = positives.positive_ids(targets, item_weight.shape[0])
    engine = engine_for(options.impl, hidden)
    rows, counted = engine.forward(options, hidden, item_weight, ids, bias, class_weight, pos_weight)
    return rows, _metric_counts(options, counted, ids, item_weight.shape[0])


def cut_bce_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, options: CutBCEOptions):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden, d_item_weight, d_bias or None)` in the input dtypes."""
    check_resolved(options)
    ids = positives.positive_ids(targets, item_weight.shape[0])
    engine = engine_for(options.impl, hidden)
    grads = engine.backward(options, hidden, item_weight, ids, bias, class_weight, pos_weight, g)
    return _in_input_dtypes(hidden, item_weight, bias, grads)


def cut_bce_value_and_grad(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *,
                           options: CutBCEOptions):
    """`cut_bce_forward`'s `(rows, counts)` and the gradients of `sum_n g[n] rows[n]`, in one pass.

    For a row gradient `g [N]` known before the forward (scalar reductions) no tile is computed
    for the loss alone: the blocked loop computes each logit tile once (three matmuls per tile,
    not four), the Pallas path runs the d_hidden kernel, which also sums the rows and counts, and
    the d_item kernel (four `N x V x D` matmul passes, not five).

    Returns:
      `((rows, counts), (d_hidden, d_item_weight, d_bias or None))`. The gradients stay in the
      accumulation dtype (float32 for bfloat16 inputs), except the Pallas d_item_weight, which the
      kernel rounds once to the table's dtype (a float32 copy would be a table-sized HBM buffer):
      the caller scales them by the upstream scalar in float32 and rounds to each input's dtype.
    """
    check_resolved(options)
    ids = positives.positive_ids(targets, item_weight.shape[0])
    engine = engine_for(options.impl, hidden)
    rows, counted, *grads = engine.value_and_grad(options, hidden, item_weight, ids, bias, class_weight, pos_weight, g)
    counts = _metric_counts(options, counted, ids, item_weight.shape[0])
    return (rows, counts), tuple(grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def cut_bce_rows(place, hidden, item_weight, targets, bias, class_weight, pos_weight):
    """Differentiable rows: gradients reach hidden, item_weight and bias.

    `place`: a `OneDevice` or a `sharded.ShardedLayout` (a mesh), hashable; its
    `forward` / `backward` run there (the one custom_vjp pair of both). class_weight and pos_weight
    are constants here (their cotangents are zero); targets get none.
    """
    return place.forward(hidden, item_weight, targets, bias, class_weight, pos_weight)


def _rows_fwd(place, hidden, item_weight, targets, bias, class_weight, pos_weight):
    out = place.forward(hidden, item_weight, targets, bias, class_weight, pos_weight)
    # Only the inputs are saved: no [N, V] residual, not even an [N, block_v] one.
    return out, (hidden, item_weight, targets, bias, class_weight, pos_weight)


def _rows_bwd(place, residuals, cotangents):
    g_rows, _ = cotangents  # the metric counts are not differentiable
    d_hidden, d_item_weight, d_bias = place.backward(*residuals, g_rows)
    # None is JAX's "zero cotangent": targets are integers, the two class weights are constants.
    return d_hidden, d_item_weight, None, d_bias, None, None


cut_bce_rows.defvjp(_rows_fwd, _rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def cut_bce_weighted_sum(place, hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight):
    """`sum_n row_weight[n] rows[n]` and the `[4, N]` counts, with the gradients computed in the forward.

    The scalar reductions ('mean': row_weight = weight / (N V); 'sum': = weight) know every row's
    gradient before the forward runs, so the differentiated forward is `cut_bce_value_and_grad`
    (one pass fewer over the tiles) and the backward only scales the saved gradients by the scalar
    cotangent. Without differentiation this is the plain forward. `row_weight` gets the rows as
    its gradient; class_weight and pos_weight are constants, as in `cut_bce_rows` (`place` too).
    """
    rows, counts = place.forward(hidden, item_weight, targets, bias, class_weight, pos_weight)
    return (rows * row_weight.astype(rows.dtype)).sum(), counts


def _weighted_sum_fwd(place, hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight):
    value_and_grad = place.value_and_grad(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight)
    return _weighted_sum_and_residuals(value_and_grad, (hidden, item_weight, bias), row_weight)


def _weighted_sum_bwd(place, residuals, cotangents):
    d_hidden, d_item_weight, d_bias, d_row_weight = _weighted_sum_cotangents(residuals, cotangents)
    return d_hidden, d_item_weight, None, d_bias, None, None, d_row_weight


cut_bce_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


def _weighted_sum_and_residuals(value_and_grad, differentiable, row_weight):
    """The forward rule's output and residuals of the weighted-sum custom_vjp (one device or a mesh: its place).

    Args:
      value_and_grad: `((rows, counts), (d_hidden, d_item_weight, d_bias or None))`, as
        `cut_bce_value_and_grad` returns them for the row gradient `row_weight`.
      differentiable: `(hidden, item_weight, bias or None)`, whose dtypes the gradients return in.
      row_weight: `[N]`, each row's factor in the loss.

    Returns:
      `((loss, counts), residuals)`: residuals are the gradients (the size of the inputs), rows and
      row_weight, and empty arrays that carry the inputs' dtypes; nothing of size N x block_v.
    """
    (rows, counts), grads = value_and_grad
    loss = (rows * row_weight.astype(rows.dtype)).sum()
    dtypes = tuple(None if x is None else jnp.zeros((0,), x.dtype) for x in differentiable)
    return (loss, counts), (grads, dtypes, rows, row_weight)


def _weighted_sum_cotangents(residuals, cotangents):
    """`(d_hidden, d_item_weight, d_bias or None, d_row_weight)` for the `(loss, counts)` cotangents:
    the saved gradients scaled by the loss's scalar cotangent (the counts have none)."""
    grads, dtypes, rows, row_weight = residuals
    g, _ = cotangents

    def scaled(x, like):
        # Scaled in float32 or wider (the Pallas d_item_weight arrives in bfloat16 for a bfloat16
        # table: a bfloat16 product would round the cotangent too), then rounded to the input's
        # dtype: once, or for that bfloat16 table twice, the second time exactly when g is 1.
        if x is None:
            return None
        acc = jnp.promote_types(x.dtype, jnp.float32)
        return (x.astype(acc) * g.astype(acc)).astype(like.dtype)

    d_hidden, d_item_weight, d_bias = (scaled(x, like) for x, like in zip(grads, dtypes))

    return d_hidden, d_item_weight, d_bias, (rows * g).astype(row_weight.dtype)
