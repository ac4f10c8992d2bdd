"""The native chunked path for CPU and CUDA tensors: `torch.autograd.Function`s over vocabulary tiles.

Extra memory is O(N x block_v) for one logits tile, its gradient and its positives mask (buffers
reused by every tile), whatever V is; nothing of size N x V exists. Each tile computes every
element's exact loss, positives included (`fused_tile.py`; the tile's positives are marked by
`positives.TileTargets`), so no correction is added afterwards.

- `NativeCutBCERows` returns the per-position rows (reduction='none'); its backward recomputes
  each logits tile (saved: the inputs only) for an arbitrary upstream gradient g[n].
- `NativeCutBCELoss` returns the 'sum' / 'mean' loss `sum_n weight[n] rows[n] / divisor`. Its row
  gradient `g[n] = weight[n] / divisor` is known before the forward, so the forward computes the
  gradients from the logits tile it already holds (3 matmuls per tile instead of 4) and the
  backward scales them by the incoming scalar; `weight` gets `rows[n] / divisor`. The graph can
  therefore be backpropagated once (use reduction='none' for retain_graph).

Both compute only the gradients autograd asks for (`ctx.needs_input_grad`), and neither is twice
differentiable (a second-order backward raises).
"""

from __future__ import annotations

import torch

from torch_cutbce import fused_tile, positives


def _tiles(num_items: int, block_v: int):
    for start in range(0, num_items, block_v):
        yield start, min(start + block_v, num_items)


class _Tiles:
    """Logits tiles `z = h @ item_weight[start:stop].T + bias[start:stop]` written into one reused buffer.

    Yields `(start, stop, z, y, dz, items, cw, pw)`: `y` marks the tile's positives, `cw` and `pw`
    are `[1, bv]` rows or None. Each tile is a contiguous `[N, stop - start]` view of a flat buffer
    (the ragged last tile too), so the compiled tile functions always see the same layout. With
    `with_grad`, `dz` is a view of a second buffer for the tile's gradient.
    """

    def __init__(self, h, item_weight, bias, class_weight, pos_weight, ids, block_v, with_grad=False):
        self.h, self.item_weight, self.bias = h, item_weight, bias
        self.class_weight, self.pos_weight = class_weight, pos_weight
        self.block_v = block_v
        self.targets = positives.TileTargets(ids, min(block_v, item_weight.shape[0]))
        size = h.shape[0] * min(block_v, item_weight.shape[0])
        self.buffer = torch.empty(size, dtype=h.dtype, device=h.device)
        self.grad_buffer = torch.empty(size, dtype=h.dtype, device=h.device) if with_grad else None

    def _row(self, values, start, stop):
        return None if values is None else values[start:stop].to(self.h.dtype).unsqueeze(0)

    def __iter__(self):
        h, acc, n = self.h, self.h.dtype, self.h.shape[0]
        for start, stop in _tiles(self.item_weight.shape[0], self.block_v):
            items = self.item_weight[start:stop].to(acc)
            z = self.buffer[: n * (stop - start)].view(n, stop - start)
            if self.bias is None:
                torch.mm(h, items.T, out=z)
            else:
                torch.addmm(self.bias[start:stop].to(acc), h, items.T, out=z)
            dz = None if self.grad_buffer is None else self.grad_buffer[: z.numel()].view(z.shape)
            y = self.targets.mark(start, stop)
            yield (start, stop, z, y, dz, items,
                   self._row(self.class_weight, start, stop), self._row(self.pos_weight, start, stop))
            self.targets.unmark()


def _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias):
    """`d_hidden += dz @ items`, `d_items[tile] = dz.T @ h`, `d_bias[tile] = dz.sum(0)`."""
    if d_hidden is not None:
        d_hidden.addmm_(dz, items)
    if d_items is not None:
        torch.mm(dz.T, h, out=d_items[start:stop])
    if d_bias is not None:
        torch.sum(dz, 0, out=d_bias[start:stop])


def _metric_counts(predicted, hits, num_pos, num_items):
    # FP and TN from the dense count of z > 0 minus the TP; FN from the row's number of positives.
    fp = predicted - hits
    return torch.stack([hits, fp, num_pos - hits, num_items - num_pos - fp])


def _grad_buffers(h, item_weight, bias, need_h, need_items, need_bias):
    """Accumulators `(d_hidden, d_items, d_bias)` in the accumulation dtype, None where not needed."""
    return (
        torch.zeros_like(h) if need_h else None,
        torch.empty(item_weight.shape, dtype=h.dtype, device=h.device) if need_items else None,
        torch.empty(item_weight.shape[0], dtype=h.dtype, device=h.device) if need_bias else None,
    )


def _cast(grad, like):
    """Gradients are accumulated in float32/float64 and returned in the input's dtype."""
    return None if grad is None else grad.to(like.dtype)


def _refuse_double_backward():
    # create_graph=True runs the backward with grad mode on: say so instead of failing inside mm(out=).
    if torch.is_grad_enabled():
        raise RuntimeError(
            "cut_bce_with_logits is not twice differentiable: its backward is a hand-written pass "
            "over the tiles, not a differentiable graph (backward(create_graph=True) and "
            "torch.autograd.grad(..., create_graph=True) are not supported)"
        )


class NativeCutBCERows(torch.autograd.Function):
    """Per-position rows (weight = 1) and, optionally, the `[4, N]` TP/FP/FN/TN counts.

    `targets [N, L]` are global ids; the table holds items `[offset, offset + V)` (vocab-parallel
    ranks pass their slice's start), other ids are ignored like padding.
    """

    @staticmethod
    def forward(ctx, hidden, item_weight, bias, class_weight, pos_weight, targets, block_v, compute_metrics,
                offset=0):
        acc = positives.accumulation_dtype(hidden.dtype)
        n, num_items = hidden.shape[0], item_weight.shape[0]
        ids = positives.positive_ids(targets, num_items, offset)
        h = hidden.to(acc)
        rows = torch.zeros(n, dtype=acc, device=hidden.device)
        counted = torch.zeros((2, n), dtype=torch.float32, device=hidden.device)
        for _, _, z, y, _, _, cw, pw in _Tiles(h, item_weight, bias, class_weight, pos_weight, ids, block_v):
            if compute_metrics:
                counted += fused_tile.counts(z, y)
            rows += fused_tile.rows(z, y, cw, pw)
        if compute_metrics:
            counts = _metric_counts(*counted, positives.num_positives(ids), num_items)
        else:
            counts = rows.new_zeros((0, n), dtype=torch.float32)
        ctx.mark_non_differentiable(counts)
        ctx.save_for_backward(hidden, item_weight, bias, class_weight, pos_weight, ids)
        ctx.block_v = block_v
        return rows, counts

    @staticmethod
    def backward(ctx, g_rows, _g_counts):
        _refuse_double_backward()
        hidden, item_weight, bias, class_weight, pos_weight, ids = ctx.saved_tensors
        need_h, need_items, need_bias = ctx.needs_input_grad[:3]
        h = hidden.to(positives.accumulation_dtype(hidden.dtype))
        g = g_rows.to(h.dtype).unsqueeze(-1).contiguous()
        d_hidden, d_items, d_bias = _grad_buffers(h, item_weight, bias, need_h, need_items, need_bias)
        if need_h or need_items or need_bias:
            tiles = _Tiles(h, item_weight, bias, class_weight, pos_weight, ids, ctx.block_v, with_grad=True)
            for start, stop, z, y, dz, items, cw, pw in tiles:
                fused_tile.grad(z, y, cw, pw, g, out=dz)
                _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias)
        return (
            _cast(d_hidden, hidden), _cast(d_items, item_weight), _cast(d_bias, bias),
            None, None, None, None, None, None,
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
        ids = positives.positive_ids(targets, num_items)
        need_h, need_items, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        h = hidden.to(acc)
        # g[n] = d loss / d rows[n] for an upstream gradient of 1 (the backward rescales). A tensor
        # division: 'mean' over zero positions divides by 0 and gives nan, as torch does.
        g = torch.ones(n, dtype=acc, device=h.device) if weight is None else weight.detach().to(acc)
        g = g / torch.tensor(divisor, dtype=acc)
        g_column = g.unsqueeze(-1).contiguous()
        d_hidden, d_items, d_bias = _grad_buffers(h, item_weight, bias, need_h, need_items, need_bias)
        with_grads = need_h or need_items or need_bias
        rows = torch.zeros(n, dtype=acc, device=h.device)
        counted = torch.zeros((2, n), dtype=torch.float32, device=h.device)
        tiles = _Tiles(h, item_weight, bias, class_weight, pos_weight, ids, block_v, with_grads)
        for start, stop, z, y, dz, items, cw, pw in tiles:
            if compute_metrics:
                counted += fused_tile.counts(z, y)
            if with_grads:
                rows += fused_tile.rows_grad(z, y, cw, pw, g_column, out=dz)
                _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias)
            else:
                rows += fused_tile.rows(z, y, cw, pw)
        weighted = rows if weight is None else rows * weight.to(acc)
        loss = weighted.sum() / torch.tensor(divisor, dtype=acc)
        if compute_metrics:
            counts = _metric_counts(*counted, positives.num_positives(ids), num_items)
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
    def backward(ctx, g_loss, _g_counts):
        _refuse_double_backward()
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
        d_weight = None
        if rows is not None:
            d_weight = (rows * (g_loss.to(rows.dtype) / torch.tensor(ctx.divisor, dtype=rows.dtype))).to(weight_dtype)
        return (*grads, d_weight, None, None, None, None, None, None, None)
