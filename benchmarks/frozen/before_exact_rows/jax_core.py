"""The CutBCE rows: forward and backward as module-level functions, and two `jax.custom_vjp`s.

`cut_bce_forward` and `cut_bce_backward` are the entry points into the math. `cut_bce_rows` (the
custom_vjp of the per-position rows) uses them, and so does torch_cutbce's torch_xla bridge (through
`torch_xla.core.xla_builder.call_jax`, whose lowering cache is keyed by the function's id: these are
module-level functions and must stay so). The backward never re-runs the whole forward: it
recomputes logit tiles for the gradient and the O(N L D) positive logits, nothing else.
`cut_bce_weighted_sum` serves the scalar reductions: their row gradients are known up front, so
`cut_bce_value_and_grad` computes loss and gradients in one pass over the tiles.

Per-position `weight` is not seen here: rows are computed with `w[n, v] = class_weight[v]`, and the
caller multiplies by `weight[n]` in plain JAX / torch, where autodiff gives `weight` its gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import jax_positives as positives
from .jax_blocked import (
    blocked_background_backward,
    blocked_background_forward,
    blocked_background_value_and_grad,
)

IMPLS = ("blocked", "pallas")


@dataclasses.dataclass(frozen=True)
class CutBCEConfig:
    """Static options of one call (hashable: a `nondiff_argnums` of the custom_vjp and a `call_jax` key).

    Attributes:
      block_v: vocabulary tile of the blocked implementation.
      compute_metrics: also produce the per-position counts.
      impl: 'blocked' (pure JAX) or 'pallas' (Mosaic on TPU, `interpret=True` elsewhere).
      block_sizes: Pallas tile sizes (a `jax_kernels.block_sizes.BlockSizes`), None = derived.
    """

    block_v: int
    compute_metrics: bool = False
    impl: str = "blocked"
    block_sizes: object = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if not isinstance(self.block_v, int) or self.block_v < 1:
            raise ValueError(f"block_v must be a positive int, got {self.block_v!r}")


def _background_forward(config, hidden, item_weight, bias, class_weight):
    if config.impl == "pallas":
        from jax_kernels.pallas_background import pallas_background_forward

        return pallas_background_forward(
            hidden, item_weight, bias, class_weight,
            compute_counts=config.compute_metrics, block_sizes=config.block_sizes,
        )
    return blocked_background_forward(
        hidden, item_weight, bias, class_weight, block_v=config.block_v, compute_counts=config.compute_metrics
    )


def _background_backward(config, hidden, item_weight, bias, class_weight, g):
    if config.impl == "pallas":
        from jax_kernels.pallas_background import pallas_background_backward

        return pallas_background_backward(
            hidden, item_weight, bias, class_weight, g, block_sizes=config.block_sizes
        )
    return blocked_background_backward(hidden, item_weight, bias, class_weight, g, block_v=config.block_v)


def _stack_counts(predicted, hits, num_pos, num_items):
    # TP and FN come from the positives; FP and TN from the dense count of z > 0 minus the TP.
    fp = predicted - hits
    return jnp.stack([hits, fp, num_pos - hits, num_items - num_pos - fp])


def _no_counts(hidden):
    return jnp.zeros((0, hidden.shape[0]), jnp.float32)


def cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, *, config: CutBCEConfig):
    """Per-position loss rows of the fused form (reference.py's formula with weight = 1).

    Args:
      hidden: `[N, D]`. item_weight: `[V, D]` (same dtype). targets: `[N, L]` int, negative = padding.
      bias, class_weight, pos_weight: `[V]` or None.

    Returns:
      `rows [N]` in the accumulation dtype (float32, or float64 for float64 inputs), and with
      `config.compute_metrics` a `[4, N]` float32 array of unweighted TP, FP, FN, TN counts
      (else a `[0, N]` placeholder, so the output structure is always the same pair).
    """
    num_items = item_weight.shape[0]
    ids, mask = positives.positive_slots(targets, num_items)
    background, predicted = _background_forward(config, hidden, item_weight, bias, class_weight)
    corr, hits, num_pos = positives.correction_forward(hidden, item_weight, bias, class_weight, pos_weight, ids, mask)
    rows = background.astype(corr.dtype) + corr
    if not config.compute_metrics:
        return rows, _no_counts(hidden)
    return rows, _stack_counts(predicted, hits, num_pos, num_items)


def _add_correction(hidden, item_weight, bias, background_grads, correction_grads):
    """Background + correction gradients, cast to the input dtypes: `(d_hidden, d_item_weight, d_bias)`."""
    bg, sp = background_grads, correction_grads
    d_hidden = (bg[0] + sp[0]).astype(hidden.dtype)
    d_item_weight = (bg[1] + sp[1]).astype(item_weight.dtype)
    d_bias = None if bias is None else (bg[2] + sp[2]).astype(bias.dtype)
    return d_hidden, d_item_weight, d_bias


def cut_bce_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, config: CutBCEConfig):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden, d_item_weight, d_bias or None)` in the input dtypes."""
    ids, mask = positives.positive_slots(targets, item_weight.shape[0])
    bg = _background_backward(config, hidden, item_weight, bias, class_weight, g)
    sp = positives.correction_backward(hidden, item_weight, bias, class_weight, pos_weight, ids, mask, g)
    return _add_correction(hidden, item_weight, bias, bg, sp)


def cut_bce_value_and_grad(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, config: CutBCEConfig):
    """`cut_bce_forward`'s `(rows, counts)` and `cut_bce_backward`'s gradients for `g`, in one blocked loop.

    For a row gradient `g [N]` known before the forward (scalar reductions): each logit tile is
    computed once, not twice. Blocked implementation only (`config.impl == 'blocked'`).
    """
    if config.impl != "blocked":
        raise ValueError(f"cut_bce_value_and_grad runs the blocked loop only, got impl={config.impl!r}")
    num_items = item_weight.shape[0]
    ids, mask = positives.positive_slots(targets, num_items)
    background, predicted, *bg = blocked_background_value_and_grad(
        hidden, item_weight, bias, class_weight, g, block_v=config.block_v, compute_counts=config.compute_metrics
    )
    corr, hits, num_pos = positives.correction_forward(hidden, item_weight, bias, class_weight, pos_weight, ids, mask)
    sp = positives.correction_backward(hidden, item_weight, bias, class_weight, pos_weight, ids, mask, g)
    rows = background.astype(corr.dtype) + corr
    counts = _stack_counts(predicted, hits, num_pos, num_items) if config.compute_metrics else _no_counts(hidden)
    return (rows, counts), _add_correction(hidden, item_weight, bias, bg, sp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def cut_bce_rows(config, hidden, item_weight, targets, bias, class_weight, pos_weight):
    """Differentiable `cut_bce_forward`: gradients reach hidden, item_weight and bias.

    class_weight and pos_weight are constants here (their cotangents are zero); targets get none.
    """
    return cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, config=config)


def _rows_fwd(config, hidden, item_weight, targets, bias, class_weight, pos_weight):
    out = cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, config=config)
    # Only the inputs are saved: no [N, V] residual, not even an [N, block_v] one.
    return out, (hidden, item_weight, targets, bias, class_weight, pos_weight)


def _rows_bwd(config, residuals, cotangents):
    hidden, item_weight, targets, bias, class_weight, pos_weight = residuals
    g_rows, _ = cotangents  # the metric counts are not differentiable
    d_hidden, d_item_weight, d_bias = cut_bce_backward(
        hidden, item_weight, targets, bias, class_weight, pos_weight, g_rows, config=config
    )
    # None is JAX's "zero cotangent": targets are integers, the two class weights are constants.
    return d_hidden, d_item_weight, None, d_bias, None, None


cut_bce_rows.defvjp(_rows_fwd, _rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def cut_bce_weighted_sum(config, hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight):
    """`sum_n row_weight[n] rows[n]` and the `[4, N]` counts, with the gradients computed in the forward.

    The scalar reductions ('mean': row_weight = weight / (N V); 'sum': = weight) know every row's
    gradient before the forward runs, so the differentiated forward is `cut_bce_value_and_grad`
    (three matmuls per tile) and the backward only scales the saved gradients by the scalar
    cotangent. Without differentiation this is the plain forward. `row_weight` gets the rows as
    its gradient; class_weight and pos_weight are constants, as in `cut_bce_rows`.
    """
    rows, counts = cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, config=config)
    return (rows * row_weight.astype(rows.dtype)).sum(), counts


def _weighted_sum_fwd(config, hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight):
    (rows, counts), grads = cut_bce_value_and_grad(
        hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, config=config
    )
    loss = (rows * row_weight.astype(rows.dtype)).sum()
    # Residuals: the gradients (the size of the inputs), rows and row_weight; nothing of size N x block_v.
    return (loss, counts), (grads, rows, row_weight)


def _weighted_sum_bwd(config, residuals, cotangents):
    (d_hidden, d_item_weight, d_bias), rows, row_weight = residuals
    g, _ = cotangents  # the scalar cotangent of the loss; the counts are not differentiable

    def scaled(x):
        return None if x is None else (x * g).astype(x.dtype)

    d_row_weight = (rows * g).astype(row_weight.dtype)
    return scaled(d_hidden), scaled(d_item_weight), None, scaled(d_bias), None, None, d_row_weight


cut_bce_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)
