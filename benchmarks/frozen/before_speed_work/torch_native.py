"""The native chunked path for CPU and CUDA tensors: a `torch.autograd.Function` over vocabulary tiles.

Extra memory is O(N x block_v) for one logits tile and its temporaries, plus O(N L D) for the
positives, whatever V is; nothing of size N x V exists. The math is the fused form of
`jax_kernels/reference.py`: a dense background over tiles plus the sparse correction of
`positives.py`. The backward recomputes each logits tile (saved: the inputs only) and computes only
the gradients autograd asks for (`ctx.needs_input_grad`): with a frozen item table, for example,
the `[V, D]` gradient and its matmul are skipped.
"""

from __future__ import annotations

import torch

from . import torch_positives as positives


def _softplus_(z: torch.Tensor) -> torch.Tensor:
    """softplus(z) = max(z, 0) + log1p(exp(-|z|)), exact for any z; overwrites z."""
    tail = z.abs().neg_().exp_().log1p_()
    return z.clamp_(min=0).add_(tail)


def _tiles(num_items: int, block_v: int):
    for start in range(0, num_items, block_v):
        yield start, min(start + block_v, num_items)


def _logits(hidden_acc, item_weight, bias, start, stop):
    items = item_weight[start:stop].to(hidden_acc.dtype)
    if bias is None:
        return hidden_acc @ items.T, items
    return torch.addmm(bias[start:stop].to(hidden_acc.dtype), hidden_acc, items.T), items


class NativeCutBCERows(torch.autograd.Function):
    """Per-position rows of the fused form (weight = 1) and, optionally, the `[4, N]` TP/FP/FN/TN counts."""

    @staticmethod
    def forward(ctx, hidden, item_weight, bias, class_weight, pos_weight, targets, block_v, compute_metrics):
        acc = positives.accumulation_dtype(hidden.dtype)
        num_items = item_weight.shape[0]
        h = hidden.to(acc)
        rows = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)
        predicted = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start, stop in _tiles(num_items, block_v):
            z, _ = _logits(h, item_weight, bias, start, stop)
            if compute_metrics:
                predicted += (z > 0).sum(-1, dtype=torch.float32)
            loss = _softplus_(z)
            if class_weight is None:
                rows += loss.sum(-1)
            else:
                rows += loss @ class_weight[start:stop].to(acc)
        ids, mask = positives.positive_slots(targets, num_items)
        corr, hits, num_pos = positives.correction_forward(h, item_weight, bias, class_weight, pos_weight, ids, mask)
        rows += corr
        if compute_metrics:
            fp = predicted - hits
            counts = torch.stack([hits, fp, num_pos - hits, num_items - num_pos - fp])
        else:
            counts = rows.new_zeros((0, hidden.shape[0]), dtype=torch.float32)
        ctx.mark_non_differentiable(counts)
        ctx.save_for_backward(hidden, item_weight, bias, class_weight, pos_weight, targets)
        ctx.block_v = block_v
        return rows, counts

    @staticmethod
    def backward(ctx, g_rows, _g_counts):
        hidden, item_weight, bias, class_weight, pos_weight, targets = ctx.saved_tensors
        need_h, need_items, need_bias = ctx.needs_input_grad[:3]
        acc = positives.accumulation_dtype(hidden.dtype)
        h = hidden.to(acc)
        g = g_rows.to(acc).unsqueeze(-1)
        d_hidden = torch.zeros_like(h) if need_h else None
        d_items = torch.zeros(item_weight.shape, dtype=acc, device=h.device) if need_items else None
        d_bias = torch.zeros(item_weight.shape[0], dtype=acc, device=h.device) if need_bias else None
        for start, stop in _tiles(item_weight.shape[0], ctx.block_v):
            z, items = _logits(h, item_weight, bias, start, stop)
            dz = z.sigmoid_().mul_(g)  # dz = g cw sigmoid(z): the background's gradient
            if class_weight is not None:
                dz.mul_(class_weight[start:stop].to(acc))
            if need_h:
                d_hidden.addmm_(dz, items)
            if need_items:
                torch.mm(dz.T, h, out=d_items[start:stop])
            if need_bias:
                torch.sum(dz, 0, out=d_bias[start:stop])
        ids, mask = positives.positive_slots(targets, item_weight.shape[0])
        positives.correction_backward(
            h, item_weight, bias, class_weight, pos_weight, ids, mask, g_rows, d_hidden, d_items, d_bias
        )
        return (
            _cast(d_hidden, hidden), _cast(d_items, item_weight), _cast(d_bias, bias),
            None, None, None, None, None,
        )


def _cast(grad, like):
    """Gradients are accumulated in float32/float64 and returned in the input's dtype."""
    return None if grad is None else grad.to(like.dtype)
