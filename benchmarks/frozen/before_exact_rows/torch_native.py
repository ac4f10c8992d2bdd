"""The native chunked path for CPU and CUDA tensors: `torch.autograd.Function`s over vocabulary tiles.

Extra memory is O(N x block_v) for one logits tile and its gradient (two buffers, reused by every tile), plus
O(N L D) for the positives, whatever V is; nothing of size N x V exists. The math is the fused form
of `jax_kernels/reference.py`: a dense background over tiles plus the sparse correction of
`positives.py`. The elementwise work on a tile is one fused pass (`fused_tile.py`).

Two Functions:
- `NativeCutBCERows` returns the per-position rows (reduction='none'); its backward recomputes
  each logits tile (saved: the inputs only) for an arbitrary upstream gradient g[n].
- `NativeCutBCELoss` returns the 'sum' or 'mean' loss, weight included. There the upstream
  gradient of row n is known up to one scalar before the backward starts:

      loss = sum_n weight[n] rows[n] / divisor       (divisor = 1 for 'sum', N V for 'mean')
      d loss / d rows[n] = weight[n] / divisor  =: g[n]

  so the forward computes the gradients of `sum_n g[n] rows[n]` from the very logits tile it
  already holds (dz = g cw sigmoid(z) shares softplus's exponential), and the backward only
  multiplies them by the incoming scalar. That saves the backward's recomputed logits matmul and
  its second elementwise pass: 3 matmul passes instead of 4. `weight` gets
  `d loss / d weight[n] = rows[n] / divisor` times the scalar. The forward skips the gradient work
  when grad mode is off or nothing it would differentiate requires grad. Because the backward scales
  the precomputed gradients in place, the graph can be backpropagated once (retain_graph=True and a
  second backward raise); use reduction='none' and sum it yourself for that.

Both compute only the gradients autograd asks for (`ctx.needs_input_grad`): with a frozen item
table, for example, the `[V, D]` gradient and its matmul are skipped.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import torch_fused_tile as fused_tile, torch_positives as positives


def _tiles(num_items: int, block_v: int):
    for start in range(0, num_items, block_v):
        yield start, min(start + block_v, num_items)


class _Tiles:
    """Logits tiles `z = h @ item_weight[start:stop].T + bias[start:stop]` written into one reused buffer.

    Yields `(start, stop, z, dz, items, cw)`. Each tile is a contiguous `[N, stop - start]` view of
    a flat buffer (the ragged last tile too), so the compiled tile functions always see the same
    layout. With `with_grad`, `dz` is a view of a second buffer for the tile's gradient.
    """

    def __init__(self, h, item_weight, bias, class_weight, block_v, with_grad=False):
        self.h, self.item_weight, self.bias, self.class_weight = h, item_weight, bias, class_weight
        self.block_v = block_v
        size = h.shape[0] * min(block_v, item_weight.shape[0])
        self.buffer = torch.empty(size, dtype=h.dtype, device=h.device)
        self.grad_buffer = torch.empty(size, dtype=h.dtype, device=h.device) if with_grad else None

    def __iter__(self):
        h, acc, n = self.h, self.h.dtype, self.h.shape[0]
        for start, stop in _tiles(self.item_weight.shape[0], self.block_v):
            items = self.item_weight[start:stop].to(acc)
            z = self.buffer[: n * (stop - start)].view(n, stop - start)
            if self.bias is None:
                torch.mm(h, items.T, out=z)
            else:
                torch.addmm(self.bias[start:stop].to(acc), h, items.T, out=z)
            cw = None if self.class_weight is None else self.class_weight[start:stop].to(acc).unsqueeze(0)
            dz = None if self.grad_buffer is None else self.grad_buffer[: z.numel()].view(z.shape)
            yield start, stop, z, dz, items, cw


def _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias):
    """`d_hidden += dz @ items`, `d_items[tile] = dz.T @ h`, `d_bias[tile] = dz.sum(0)`."""
    if d_hidden is not None:
        d_hidden.addmm_(dz, items)
    if d_items is not None:
        torch.mm(dz.T, h, out=d_items[start:stop])
    if d_bias is not None:
        torch.sum(dz, 0, out=d_bias[start:stop])


def _metric_counts(predicted, hits, num_pos, num_items):
    # TP and FN come from the positives; FP and TN from the dense count of z > 0 minus the TP.
    fp = predicted - hits
    return torch.stack([hits, fp, num_pos - hits, num_items - num_pos - fp])


def _cast(grad, like):
    """Gradients are accumulated in float32/float64 and returned in the input's dtype."""
    return None if grad is None else grad.to(like.dtype)


class NativeCutBCERows(torch.autograd.Function):
    """Per-position rows of the fused form (weight = 1) and, optionally, the `[4, N]` TP/FP/FN/TN counts."""

    @staticmethod
    def forward(ctx, hidden, item_weight, bias, class_weight, pos_weight, targets, block_v, compute_metrics):
        acc = positives.accumulation_dtype(hidden.dtype)
        num_items = item_weight.shape[0]
        h = hidden.to(acc)
        rows = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)
        predicted = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for _, _, z, _, _, cw in _Tiles(h, item_weight, bias, class_weight, block_v):
            if compute_metrics:
                predicted += fused_tile.counts(z)
            rows += fused_tile.rows(z, cw)
        ids, mask = positives.positive_slots(targets, num_items)
        corr, hits, num_pos = positives.correction_forward(h, item_weight, bias, class_weight, pos_weight, ids, mask)
        rows += corr
        if compute_metrics:
            counts = _metric_counts(predicted, hits, num_pos, num_items)
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
        g = g_rows.to(acc).unsqueeze(-1).contiguous()
        d_hidden = torch.zeros_like(h) if need_h else None
        d_items = torch.empty(item_weight.shape, dtype=acc, device=h.device) if need_items else None
        d_bias = torch.empty(item_weight.shape[0], dtype=acc, device=h.device) if need_bias else None
        if need_h or need_items or need_bias:
            for start, stop, z, dz, items, cw in _Tiles(h, item_weight, bias, class_weight, ctx.block_v, True):
                fused_tile.grad(z, g, cw, out=dz)  # dz = g cw sigmoid(z): the background's gradient
                _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias)
            ids, mask = positives.positive_slots(targets, item_weight.shape[0])
            positives.correction_backward(
                h, item_weight, bias, class_weight, pos_weight, ids, mask, g_rows, d_hidden, d_items, d_bias
            )
        return (
            _cast(d_hidden, hidden), _cast(d_items, item_weight), _cast(d_bias, bias),
            None, None, None, None, None,
        )


class NativeCutBCELoss(torch.autograd.Function):
    """The 'sum' / 'mean' loss `sum_n weight[n] rows[n] / divisor`, gradients computed in the forward.

    Returns `(loss [], counts [4] or [0])`: the counts are weighted by `weight` and summed.
    """

    @staticmethod
    def forward(ctx, hidden, item_weight, bias, weight, class_weight, pos_weight, targets, divisor, block_v,
                compute_metrics, grad_enabled):
        acc = positives.accumulation_dtype(hidden.dtype)
        num_items, n = item_weight.shape[0], hidden.shape[0]
        need_h, need_items, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        h = hidden.to(acc)
        # g[n] = d loss / d rows[n] for an upstream gradient of 1 (the backward rescales).
        g = torch.full((n,), 1.0 / divisor, dtype=acc, device=h.device)
        if weight is not None:
            g = g * weight.detach().to(acc)
        g_column = g.unsqueeze(-1).contiguous()
        d_hidden = torch.zeros_like(h) if need_h else None
        d_items = torch.empty(item_weight.shape, dtype=acc, device=h.device) if need_items else None
        d_bias = torch.empty(num_items, dtype=acc, device=h.device) if need_bias else None
        with_grads = need_h or need_items or need_bias
        rows = torch.zeros(n, dtype=acc, device=h.device)
        predicted = torch.zeros(n, dtype=torch.float32, device=h.device)
        for start, stop, z, dz, items, cw in _Tiles(h, item_weight, bias, class_weight, block_v, with_grads):
            if compute_metrics:
                predicted += fused_tile.counts(z)
            if with_grads:
                rows += fused_tile.rows_grad(z, g_column, cw, out=dz)
                _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias)
            else:
                rows += fused_tile.rows(z, cw)
        ids, mask = positives.positive_slots(targets, num_items)
        corr, hits, num_pos = positives.correction_forward(h, item_weight, bias, class_weight, pos_weight, ids, mask)
        rows += corr
        if with_grads:
            positives.correction_backward(
                h, item_weight, bias, class_weight, pos_weight, ids, mask, g, d_hidden, d_items, d_bias
            )
        weighted = rows if weight is None else rows * weight.to(acc)
        loss = weighted.sum() / divisor
        if compute_metrics:
            counts = _metric_counts(predicted, hits, num_pos, num_items)
            if weight is not None:
                counts = counts * weight.detach().to(torch.float32)
            counts = counts.sum(-1)
        else:
            counts = rows.new_zeros((0,), dtype=torch.float32)
        ctx.mark_non_differentiable(counts)
        need_weight = grad_enabled and ctx.needs_input_grad[3]
        ctx.save_for_backward(d_hidden, d_items, d_bias, rows if need_weight else None)
        ctx.dtypes = (hidden.dtype, item_weight.dtype, None if bias is None else bias.dtype,
                      None if weight is None else weight.dtype)
        ctx.divisor, ctx.used = divisor, False
        return loss, counts

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss, _g_counts):
        if ctx.used:
            raise RuntimeError(
                "cut_bce_with_logits(reduction='sum'/'mean') computes its gradients during the forward "
                "and scales them in place, so its graph can be backpropagated once; for retain_graph / "
                "several backward passes use reduction='none' and reduce the rows yourself"
            )
        ctx.used = True
        d_hidden, d_items, d_bias, rows = ctx.saved_tensors
        h_dtype, items_dtype, bias_dtype, weight_dtype = ctx.dtypes
        grads = []
        for grad, dtype in ((d_hidden, h_dtype), (d_items, items_dtype), (d_bias, bias_dtype)):
            grads.append(None if grad is None else grad.mul_(g_loss.to(grad.dtype)).to(dtype))
        d_weight = None if rows is None else (rows * (g_loss.to(rows.dtype) / ctx.divisor)).to(weight_dtype)
        return (*grads, d_weight, None, None, None, None, None, None, None)
