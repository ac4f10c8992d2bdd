"""The Triton engine's three calls, with the native loop's signatures (`torch_cutbce/native/loop.py`), so
that one set of custom ops (`torch_cutbce/chunked_ops.py`) serves both engines.

Each call prepares what the kernels take (`launch.py`): the rows' positive ids once each as int32
(`positives.positive_ids`: sorted, duplicates and ids outside this table's slice `[offset, offset +
V)` set to -1), the float32 weights and the row gradient, contiguous inputs in one dtype; then runs
the row pass (rows, counts, `d_hidden`) and, for the table's gradients, the item pass. Counts come
back as the entry's `[4, N]` TP / FP / FN / TN.
"""

from __future__ import annotations

import torch

from torch_cutbce import positives
from torch_cutbce.reduction import weighted_count_sums
from torch_cutbce.triton import interpreter, launch


def _operands(hidden, item_weight, ids, bias, class_weight, pos_weight):
    """The kernels' operands `(h, w, ids, bias, cw, pw)`: contiguous, the table in hidden's dtype, ids
    int32, the per-item vectors float32. (The entry has already refused dtypes the kernels do not
    take: `Engine.dtypes`.)"""
    interpreter.check_runs_here(hidden.device)
    f32 = lambda x: None if x is None else x.to(torch.float32).contiguous()  # noqa: E731
    return (hidden.contiguous(), item_weight.to(hidden.dtype).contiguous(), ids.to(torch.int32).contiguous(),
            f32(bias), f32(class_weight), f32(pos_weight))


def _positive_ids(targets, item_weight, options):
    """`positives.positive_ids` for this table's slice: int64, as the custom ops' fakes say."""
    return positives.positive_ids(targets, item_weight.shape[0], options.offset)


def _counts(counts, ids, num_items):
    """Kernel counts `[2, N]` (predicted negatives, predicted positives) -> `[4, N]` TP / FP / FN / TN."""
    fp, tp = counts.to(torch.float32)
    num_pos = positives.num_positives(ids)
    return torch.stack([tp, fp, num_pos - tp, num_items - num_pos - fp])


def _item_grads(operands, g, need, loss):
    _, need_items, need_bias = need
    if not (need_items or need_bias):
        return None, None
    return launch.items_pass(*operands, g, loss, with_items=need_items, with_bias=need_bias and operands[3] is not None)


def saved_shape(hidden_shape, targets_shape, hidden_grad: bool) -> tuple:
    """The shape of what `rows_forward` hands `rows_backward`: `d_hidden` for a row gradient of 1,
    `[N, D]`, when hidden's gradient is wanted, else `[N, 0]`."""
    return (hidden_shape[0], hidden_shape[1] if hidden_grad else 0)


def rows_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, hidden_grad, options):
    """Per-position rows, counts `[4, N]` (or `[0, N]`) and what the backward needs: `(rows, counts,
    saved, ids [N, L])`. `saved` is `d_hidden` for the row gradient 1 when `hidden_grad` (the row pass
    makes it beside the rows, one product more than the rows alone; `d_hidden` is linear in the row
    gradient, so the backward scales it per row instead of recomputing the logits), else `[N, 0]`."""
    ids = _positive_ids(targets, item_weight, options)
    operands = _operands(hidden, item_weight, ids, bias, class_weight, pos_weight)
    n, compute_metrics = hidden.shape[0], options.compute_metrics
    ones = torch.ones(n, dtype=torch.float32, device=hidden.device) if hidden_grad else None
    rows, counts, d_hidden = launch.rows_pass(*operands, ones, options.loss, with_rows=True,
                                              with_counts=compute_metrics)
    if compute_metrics:
        counts = _counts(counts, ids, item_weight.shape[0])
    else:
        counts = torch.zeros((0, n), dtype=torch.float32, device=hidden.device)
    saved = d_hidden if hidden_grad else rows.new_zeros(saved_shape(hidden.shape, targets.shape, False))
    return rows, counts, saved, ids


def rows_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, saved, g, need, options):
    """`(d_hidden, d_items, d_bias)` of `sum_n g[n] rows[n]` in float32, None where `need` says no:
    `d_hidden` is the forward's (`saved`, for the row gradient 1) scaled by `g` per row, the table's
    gradients come from the item pass."""
    operands = _operands(hidden, item_weight, ids, bias, class_weight, pos_weight)
    g = g.to(torch.float32).contiguous()
    d_hidden = None
    if need[0]:
        if saved.shape != hidden.shape:  # the forward did not make it (hidden_grad was False)
            saved = launch.rows_pass(*operands, torch.ones_like(g), options.loss, with_rows=False,
                                     with_counts=False)[2]
        d_hidden = saved * g[:, None]
    return (d_hidden, *_item_grads(operands, g, need, options.loss))


def loss_and_grads(hidden, item_weight, targets, bias, class_weight, pos_weight, weight, divisor, need, options):
    """The 'sum' / 'mean' loss `sum_n weight[n] rows[n] / divisor` and its gradients in one forward
    (the row gradient `weight / divisor` is known): `(loss, counts [4] or [0], rows, d_hidden,
    d_items, d_bias)`, float32, None where `need` says no."""
    ids = _positive_ids(targets, item_weight, options)
    operands = _operands(hidden, item_weight, ids, bias, class_weight, pos_weight)
    n, compute_metrics = hidden.shape[0], options.compute_metrics
    divisor = torch.tensor(divisor, dtype=torch.float32)  # 'mean' of N = 0 is 0 / 0 = nan, as torch
    g = (torch.ones(n, dtype=torch.float32, device=hidden.device) if weight is None
         else weight.detach().to(torch.float32)) / divisor
    rows, counts, d_hidden = launch.rows_pass(*operands, g if need[0] else None, options.loss, with_rows=True,
                                              with_counts=compute_metrics)
    d_items, d_bias = _item_grads(operands, g, need, options.loss)
    weighted = rows.double() if weight is None else rows.double() * weight.double()
    loss = (weighted.sum() / divisor.double()).to(torch.float32)
    if compute_metrics:
        counts = weighted_count_sums(_counts(counts, ids, item_weight.shape[0]), weight)
    else:
        counts = torch.zeros((0,), dtype=torch.float32, device=hidden.device)
    return loss, counts, rows, d_hidden, d_items, d_bias
