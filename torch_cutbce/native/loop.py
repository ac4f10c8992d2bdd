"""The native chunked path for CPU and CUDA tensors: `torch.autograd.Function`s over vocabulary tiles.

Extra memory is O(N x block_v) for one logits tile and its gradient (buffers reused by every tile),
whatever V is; nothing of size N x V exists. Each tile's positives are taken out (set to -inf, their
logits kept: `positives.TilePositives`), the tile's negatives go through `fused_tile`, and each
positive gets its own exact terms afterwards (`positives.positive_terms`, O(N L)).

- `rows_forward` / `rows_backward`: per-position rows (reduction='none') and, for an arbitrary
  upstream g[n], their gradients (each logits tile recomputed).
- `loss_and_grads`: the 'sum' / 'mean' loss with its gradients computed in the same pass.

Each takes the call's `cutbce_common.options.CutBCEOptions` (tile width, metrics, the
vocabulary-parallel offset) and hands its `loss` (`cutbce_common.loss.Loss`) unopened to the
tile functions and the positives' terms. The tile is sized here, for the rows that reach the tiles
(`_tile_width`).

How torch sees these functions (custom ops, autograd, torch.compile) is `ops.py`'s job.
"""

from __future__ import annotations

import torch

from cutbce_common.shapes import MAX_CONTRACTION, tile_width
from torch_cutbce import positives
from torch_cutbce.native import fused_tile
from torch_cutbce.reduction import weighted_count_sums  # the counts tail, shared with the entries


def _row_sums(n: int, device) -> torch.Tensor:
    """Where each row's loss is summed over the tiles: float64, so that a row's sum over any V is as
    exact as one tile's (a float32 running sum over 4096 tiles drifts by about 1e-4); O(N)."""
    return torch.zeros(n, dtype=torch.float64, device=device)


def _tile_width(options, hidden, item_weight) -> int:
    """`options.block_v`, or a default sized for these rows (fewer rows: wider tiles); at most V."""
    return tile_width(options.block_v, hidden.shape[0], item_weight.shape[0])


def _tiles(num_items: int, block_v: int):
    for start in range(0, num_items, block_v):
        yield start, min(start + block_v, num_items)


class _Tiles:
    """Logits tiles `z = h @ item_weight[start:stop].T + bias[start:stop]`, positives taken out.

    Yields `(start, stop, z, dz, items, cw)`: `z` with the tile's positives at -inf (their logits go
    to `self.positives.logits` unless `keep_logits` is False), `cw` a `[1, bv]` row or None. Each
    tile is a contiguous `[N, stop - start]` view of one reused flat buffer (the ragged last tile
    too), so the compiled tile functions always see the same layout.
    With `with_grad`, `dz` is where the tile's gradient goes: `z` itself with `grad_in_place` (the
    tile function reads each logit before writing its gradient), else a view of a second buffer.
    """

    def __init__(self, h, item_weight, bias, class_weight, ids, block_v, with_grad=False, keep_logits=True,
                 grad_in_place=False):
        self.h, self.item_weight, self.bias, self.class_weight = h, item_weight, bias, class_weight
        self.block_v, self.keep_logits = block_v, keep_logits
        self.positives = positives.TilePositives(ids, min(block_v, item_weight.shape[0]), h.dtype)
        size = h.shape[0] * min(block_v, item_weight.shape[0])
        self.buffer = torch.empty(size, dtype=h.dtype, device=h.device)
        self.grad_buffer = None
        if with_grad:
            self.grad_buffer = self.buffer if grad_in_place else torch.empty(size, dtype=h.dtype, device=h.device)

    def __iter__(self):
        h, acc, n = self.h, self.h.dtype, self.h.shape[0]
        for start, stop in _tiles(self.item_weight.shape[0], self.block_v):
            items = self.item_weight[start:stop].to(acc)
            z = self.buffer[: n * (stop - start)].view(n, stop - start)
            if self.bias is None:
                torch.mm(h, items.T, out=z)
            else:
                torch.addmm(self.bias[start:stop].to(acc), h, items.T, out=z)
            self.positives.take_out(self.buffer, start, stop, keep_logits=self.keep_logits)
            dz = None if self.grad_buffer is None else self.grad_buffer[: z.numel()].view(z.shape)
            cw = None if self.class_weight is None else self.class_weight[start:stop].to(acc).unsqueeze(0)
            yield start, stop, z, dz, items, cw


def _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias):
    """`d_hidden += dz @ items`, `d_items[tile] = dz.T @ h`, `d_bias[tile] = dz.sum(0)`.

    `d_hidden` sums in float64 across tiles (as `_row_sums`), and each product over at most
    `MAX_CONTRACTION` of the tile's columns (shapes.py says why: tiles are millions wide at small N):
    one batched product of the whole chunks, their `[chunks, N, D]` results summed in float64."""
    if d_hidden is not None:
        n, width = dz.shape
        chunks, head = width // MAX_CONTRACTION, width - width % MAX_CONTRACTION
        if chunks > 1:
            parts = torch.bmm(dz[:, :head].reshape(n, chunks, MAX_CONTRACTION).transpose(0, 1),
                              items[:head].reshape(chunks, MAX_CONTRACTION, -1))
            d_hidden += parts.sum(0, dtype=torch.float64)
        else:
            head = 0
        if head < width:
            d_hidden += dz[:, head:] @ items[head:]
    if d_items is not None:
        torch.mm(dz.T, h, out=d_items[start:stop])
    if d_bias is not None:
        torch.sum(dz, 0, out=d_bias[start:stop])


def _grad_in_place(loss, h) -> bool:
    """Whether the tiles' gradient may overwrite their logits (`fused_tile.writes_grad_in_place`:
    the plain CPU kernel reads each element before writing it)."""
    return loss.plain and fused_tile.writes_grad_in_place(h.dtype, h.device)


def _metric_counts(fp, logits, ids, num_items):
    """`[4, N]` TP/FP/FN/TN: FP is the tiles' count of z > 0 (negatives only), TP the positives' own."""
    tp, num_pos = positives.hits(logits, ids), positives.num_positives(ids)
    return torch.stack([tp, fp, num_pos - tp, num_items - num_pos - fp])


def _grad_buffers(h, item_weight, bias, need_h, need_items, need_bias):
    """Accumulators `(d_hidden, d_items, d_bias)`, None where not needed: `d_hidden` in float64
    (`_add_tile_grads`; `_in_acc` returns it in the accumulation dtype), the others in the
    accumulation dtype."""
    return (
        torch.zeros(h.shape, dtype=torch.float64, device=h.device) if need_h else None,
        torch.empty(item_weight.shape, dtype=h.dtype, device=h.device) if need_items else None,
        torch.empty(item_weight.shape[0], dtype=h.dtype, device=h.device) if need_bias else None,
    )


def saved_shape(hidden_shape, targets_shape, hidden_grad: bool) -> tuple:
    """The shape of what `rows_forward` hands `rows_backward`: the positives' logits `[N, L]`."""
    return tuple(targets_shape)


def rows_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, hidden_grad, options):
    """Per-position rows (weight 1) over the table's items `[offset, offset + V)`.

    `targets [N, L]` are global ids; ids outside the table's range are ignored like padding
    (vocab-parallel ranks pass their slice's start as `options.offset`). Reads `options.block_v`,
    `compute_metrics`, `offset` and `loss`; `hidden_grad` changes nothing here (the backward
    recomputes every tile, the positives' logits aside).

    Returns:
      `rows` `[N]`, `counts` `[4, N]` TP/FP/FN/TN (`[0, N]` without `compute_metrics`), and what the
      backward needs: each positive's logit `[N, L]` and the local positive ids `[N, L]`.
    """
    block_v, compute_metrics, loss = _tile_width(options, hidden, item_weight), options.compute_metrics, \
        options.loss
    acc = positives.accumulation_dtype(hidden.dtype)
    n, num_items = hidden.shape[0], item_weight.shape[0]
    ids = positives.positive_ids(targets, num_items, options.offset)
    h = hidden.to(acc)
    rows = _row_sums(n, hidden.device)
    false_positives = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    tiles = _Tiles(h, item_weight, bias, class_weight, ids, block_v)
    for _, _, z, _, _, cw in tiles:
        if compute_metrics:
            false_positives += fused_tile.counts(z)
        rows += fused_tile.rows(z, cw, loss)
    logits = tiles.positives.logits
    rows += positives.positive_terms(logits, ids, class_weight, pos_weight, loss=loss)[0].sum(-1)
    if compute_metrics:
        counts = _metric_counts(false_positives, logits, ids, num_items)
    else:
        counts = torch.zeros((0, n), dtype=torch.float32, device=hidden.device)
    return rows.to(acc), counts, logits, ids


def rows_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, logits, g, need, options):
    """Gradients of `sum_n g[n] rows[n]`: `(d_hidden, d_items, d_bias)` in the accumulation dtype,
    None where `need` (three bools) says no. Recomputes every logits tile (a fourth matmul per tile).
    Reads `options.block_v` and `loss`."""
    block_v, loss = _tile_width(options, hidden, item_weight), options.loss
    h = hidden.to(positives.accumulation_dtype(hidden.dtype))
    g = g.to(h.dtype)
    g_column = g.unsqueeze(-1).clone()  # not a view: the compiled tile functions take it as is
    d_hidden, d_items, d_bias = _grad_buffers(h, item_weight, bias, *need)
    if any(need):
        tiles = _Tiles(h, item_weight, bias, class_weight, ids, block_v, with_grad=True,
                       keep_logits=False, grad_in_place=_grad_in_place(loss, h))
        for start, stop, z, dz, items, cw in tiles:
            fused_tile.grad(z, cw, g_column, dz, loss)
            _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias)
        dz_positives = positives.positive_terms(logits, ids, class_weight, pos_weight, g, loss)[1]
        positives.add_positive_grads(dz_positives, ids, h, item_weight, d_hidden, d_items, d_bias)
    return _in_acc(d_hidden, h), d_items, d_bias


def _in_acc(d_hidden, h):
    return None if d_hidden is None else d_hidden.to(h.dtype)


def loss_and_grads(hidden, item_weight, targets, bias, class_weight, pos_weight, weight, divisor, need, options):
    """The 'sum' / 'mean' loss `sum_n weight[n] rows[n] / divisor` and its gradients, in one pass.

    Reads `options.block_v`, `compute_metrics`, `offset` and `loss`.

    The row gradient `g[n] = weight[n] / divisor` is known before the forward, so each logits tile
    serves the loss, `d_hidden += dz @ items` and `d_items[tile] = dz.T @ h` (3 matmuls per tile,
    not 4); the caller scales the gradients by the upstream scalar.

    Returns:
      `(loss [], counts [4] or [0], rows [N], d_hidden, d_items, d_bias)`: counts weighted by
      `weight` and summed; gradients (for an upstream 1) in the accumulation dtype, None where `need`
      (three bools) says no.
    """
    block_v, compute_metrics, loss = _tile_width(options, hidden, item_weight), options.compute_metrics, \
        options.loss
    acc = positives.accumulation_dtype(hidden.dtype)
    num_items, n = item_weight.shape[0], hidden.shape[0]
    ids = positives.positive_ids(targets, num_items, options.offset)  # global ids -> the table's (as rows_forward)
    h = hidden.to(acc)
    # A tensor division: 'mean' over zero positions divides by 0 and gives nan, as torch does.
    divisor = torch.tensor(divisor, dtype=acc)
    g = (torch.ones(n, dtype=acc, device=h.device) if weight is None else weight.detach().to(acc)) / divisor
    g_column = g.unsqueeze(-1).clone()  # not a view: the compiled tile functions take it as is
    d_hidden, d_items, d_bias = _grad_buffers(h, item_weight, bias, *need)
    with_grads = any(need)
    rows = _row_sums(n, h.device)
    false_positives = torch.zeros(n, dtype=torch.float32, device=h.device)
    tiles = _Tiles(h, item_weight, bias, class_weight, ids, block_v, with_grads,
                   grad_in_place=_grad_in_place(loss, h))
    for start, stop, z, dz, items, cw in tiles:
        if compute_metrics:
            false_positives += fused_tile.counts(z)
        if with_grads:
            rows += fused_tile.rows_grad(z, cw, g_column, dz, loss)
            _add_tile_grads(dz, items, h, start, stop, d_hidden, d_items, d_bias)
        else:
            rows += fused_tile.rows(z, cw, loss)
    logits = tiles.positives.logits
    loss_positives, dz_positives = positives.positive_terms(
        logits, ids, class_weight, pos_weight, g if with_grads else None, loss)
    rows += loss_positives.sum(-1)
    if with_grads:
        positives.add_positive_grads(dz_positives, ids, h, item_weight, d_hidden, d_items, d_bias)
    loss = ((rows if weight is None else rows * weight.to(rows.dtype)).sum() / divisor).to(acc)
    if compute_metrics:
        counts = weighted_count_sums(_metric_counts(false_positives, logits, ids, num_items), weight)
    else:
        counts = torch.zeros((0,), dtype=torch.float32, device=h.device)
    return loss, counts, rows.to(acc), _in_acc(d_hidden, h), d_items, d_bias
