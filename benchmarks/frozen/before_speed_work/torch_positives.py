"""The sparse correction at the positives (torch twin of `jax_kernels/positives.py`, which derives it).

    corr[n, t]   = cw[t] * (pw[t] * softplus(-z) - softplus(z))       (= -cw[t] z   if pw = 1)
    dcorr/dz     = cw[t] * (pw[t] * (sigmoid(z) - 1) - sigmoid(z))     (= -cw[t]     if pw = 1)
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, bfloat16 and float16 accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def positive_slots(targets: torch.Tensor, num_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids `[N, L]` -> `(ids [N, L] long, mask [N, L] bool)`: each valid id once, padding masked.

    Sorting puts duplicates side by side, so "first of its run" dedupes in O(L log L) per row.
    Masked slots point at item 0 so gathers stay in bounds; the mask zeroes what they add.
    """
    ids = targets.sort(dim=-1).values
    mask = (ids >= 0) & (ids < num_items)
    mask[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    return torch.where(mask, ids, torch.zeros_like(ids)).long(), mask


def softplus(z: torch.Tensor) -> torch.Tensor:
    """max(z, 0) + log1p(exp(-|z|)): exact and finite for any z (F.softplus switches to z above a threshold)."""
    return z.clamp(min=0) + torch.log1p(torch.exp(-z.abs()))


def _gather(values, ids, acc):
    return None if values is None else values.to(acc)[ids]


def _positive_logits(hidden_acc, item_weight, bias, ids):
    rows = item_weight[ids].to(hidden_acc.dtype)  # [N, L, D]
    z = torch.einsum("nd,nld->nl", hidden_acc, rows)
    if bias is not None:
        z = z + bias.to(hidden_acc.dtype)[ids]
    return z, rows


def correction_forward(hidden_acc, item_weight, bias, class_weight, pos_weight, ids, mask):
    """`(corr_row [N], positive_hits [N], num_positives [N])`; hits = positives with z > 0 (the TP)."""
    acc = hidden_acc.dtype
    z, _ = _positive_logits(hidden_acc, item_weight, bias, ids)
    pw = _gather(pos_weight, ids, acc)
    corr = -z if pw is None else pw * softplus(-z) - softplus(z)
    cw = _gather(class_weight, ids, acc)
    if cw is not None:
        corr = corr * cw
    corr_row = torch.where(mask, corr, torch.zeros_like(corr)).sum(-1)
    hits = (mask & (z > 0)).sum(-1, dtype=torch.float32)
    return corr_row, hits, mask.sum(-1, dtype=torch.float32)


def correction_backward(hidden_acc, item_weight, bias, class_weight, pos_weight, ids, mask, g, d_hidden, d_items, d_bias):
    """Adds the correction's gradients in place into `d_hidden [N, D]`, `d_items [V, D]`, `d_bias [V]`.

    Each buffer may be None (that gradient is not needed). `g [N]` is the upstream gradient of each
    row. Adding into the background's buffers avoids a second `[V, D]` allocation.
    """
    acc = hidden_acc.dtype
    pw = _gather(pos_weight, ids, acc)
    if pw is None:
        dz = torch.full(ids.shape, -1.0, dtype=acc, device=ids.device)
        rows = item_weight[ids].to(acc)
    else:
        z, rows = _positive_logits(hidden_acc, item_weight, bias, ids)
        s = torch.sigmoid(z)
        dz = pw * (s - 1) - s
    cw = _gather(class_weight, ids, acc)
    if cw is not None:
        dz = dz * cw
    dz = torch.where(mask, dz * g.to(acc).unsqueeze(-1), torch.zeros_like(dz))
    if d_hidden is not None:
        d_hidden.add_(torch.einsum("nl,nld->nd", dz, rows))
    flat_ids = ids.reshape(-1)
    if d_items is not None:
        contrib = (dz.unsqueeze(-1) * hidden_acc.unsqueeze(1)).reshape(-1, hidden_acc.shape[-1])
        d_items.index_add_(0, flat_ids, contrib)
    if d_bias is not None:
        d_bias.index_add_(0, flat_ids, dz.reshape(-1))
