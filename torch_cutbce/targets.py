"""Conversions between dense multi-hot targets and the padded id lists CutBCE takes."""

from __future__ import annotations

import torch


def ids_to_multi_hot(ids: torch.Tensor, num_items: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Padded ids `[*S, L]` -> dense multi-hot `[*S, V]`. Negative ids are padding; duplicates count once.

    Ids >= num_items raise (on CPU) rather than being dropped silently.
    """
    if ids.is_floating_point():
        raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
    ids = ids.long()  # uint8 / int8 / int16 ids could not hold the padding column num_items
    if ids.device.type == "cpu" and ids.numel() and int(ids.max()) >= num_items:
        raise ValueError(f"ids holds item id {int(ids.max())}, but num_items={num_items} (ids must be < num_items)")
    valid = ids >= 0
    out = torch.zeros(*ids.shape[:-1], num_items + 1, dtype=dtype, device=ids.device)
    # Padding is routed to an extra column that is dropped afterwards: no data-dependent shapes.
    safe = torch.where(valid, ids, torch.full_like(ids, num_items))
    out.scatter_(-1, safe.long(), 1)
    return out[..., :num_items]


def multi_hot_to_ids(multi_hot: torch.Tensor, max_positives: int | None = None, pad_id: int = -1) -> torch.Tensor:
    """Dense multi-hot `[*S, V]` (any nonzero = positive) -> padded ids `[*S, L]`, ascending per row.

    L is `max_positives`, or the largest number of positives in any row when None (that reads the
    data, so it syncs on accelerators; pass `max_positives` in a training loop). Rows with more
    positives than `max_positives` raise.
    """
    if pad_id >= 0:
        raise ValueError(f"pad_id must be negative (non-negative ids are items), got {pad_id}")
    positive = multi_hot != 0
    counts = positive.sum(-1)
    most = int(counts.max()) if counts.numel() else 0
    if max_positives is None:
        max_positives = most
    elif most > max_positives:
        raise ValueError(f"a row of multi_hot has {most} positives, more than max_positives={max_positives}")
    num_items = multi_hot.shape[-1]
    # Sort key: positives first, in ascending id order; then take the first L columns.
    order = torch.arange(num_items, device=multi_hot.device)
    key = torch.where(positive, order, order + num_items)
    ids = key.sort(-1).values[..., :max_positives]
    return torch.where(ids < num_items, ids, torch.full_like(ids, pad_id))
