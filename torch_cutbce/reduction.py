"""Per-position rows -> the loss of a reduction, with the position weight and the metrics."""

from __future__ import annotations

from cutbce_common.shapes import reduction_divisor
from torch_cutbce.metrics import CutBCEMetrics


def weighted_counts(counts, weight):
    """Counts `[4, N]` times the position weight `[*S]` (detached: the metrics get no gradient)."""
    if weight is None:
        return counts
    return counts * weight.detach().reshape(1, counts.shape[-1]).to(counts.dtype)


def weighted_count_sums(counts, weight):
    """Counts `[4, N]` weighted by `weight` and summed over the positions: `[4]` (tp, fp, fn, tn)."""
    return weighted_counts(counts, weight).sum(-1)


def reduce_rows(rows, counts, weight, reduction, lead_shape, num_items, return_metrics):
    """Per-position rows `[N]` and counts `[4, N]` -> the loss (and `CutBCEMetrics`) of a reduction.

    The position weight multiplies here, in plain torch, so autograd gives `weight` its gradient.
    """
    n = rows.shape[0]
    if weight is not None:
        rows = rows * weight.reshape(n).to(rows.dtype)
    if reduction == "none":
        loss = rows.reshape(lead_shape)
    elif reduction == "sum":
        loss = rows.sum()
    else:
        loss = rows.sum() / reduction_divisor(reduction, n, num_items)
    if not return_metrics:
        return loss
    if reduction == "none":
        return loss, CutBCEMetrics(*weighted_counts(counts, weight)).reshape(lead_shape)
    return loss, CutBCEMetrics(*weighted_count_sums(counts, weight))
