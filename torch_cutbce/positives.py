"""Where the positives are, and their own terms: padded target ids -> ids per row -> per tile.

The positives are taken out of the dense pass inside the tile where they fall (docs/design.md,
'How each engine stays exact'): `TilePositives` reads each positive's logit from the tile and sets it to
-inf there (softplus(-inf) = sigmoid(-inf) = 0: the tile's elementwise work sees negatives only);
`positive_terms` then gives each positive its own branch, `cw pw softplus(-z)`, from that logit.
No `softplus(z)` is summed and `z` subtracted later, so a confident positive's tiny loss is never
lost in a row sum. The tile's work on positives is O(N L), whatever its size.
"""

from __future__ import annotations

import torch

from cutbce_common.shapes import accumulation_dtype_name
from torch_cutbce import branch_math


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """`shapes.accumulation_dtype_name` for a torch dtype."""
    return getattr(torch, accumulation_dtype_name(str(dtype).removeprefix("torch.")))


def positive_ids(targets: torch.Tensor, num_items: int, offset: int = 0) -> torch.Tensor:
    """Padded ids `[N, L]` -> `[N, L]` int64 ids in `[0, num_items)`, each valid id once, -1 elsewhere.

    An id t is valid iff `offset <= t < offset + num_items`; it becomes `t - offset` (a rank's or
    shard's local id). Comparisons run in int64 before any narrowing, so no id can
    wrap into another item (every accepted id dtype widens to int64 losslessly). Sorting puts
    duplicates side by side ("first of its run" dedupes).
    """
    ids = targets.long().sort(dim=-1).values  # widening: int8/uint8/int16 ids would wrap V in their dtype
    keep = (ids >= offset) & (ids < offset + num_items)
    keep[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    local = ids - offset if offset else ids
    return torch.where(keep, local, torch.full_like(local, -1))


class TilePositives:
    """Takes each vocabulary tile's positives out of its logits, and keeps their logits.

    A tile `[start, stop)` is an `[N, stop - start]` view of a flat buffer. The valid ids are sorted
    by tile once per call, so a tile's work is one gather and one fill of its own positives (about
    N L / #tiles elements), never a pass over the tile or over all N L ids. Tiles start at multiples
    of `block_v`. After every tile has been through `take_out`, `logits` `[N, L]` holds each valid
    id's logit (0 elsewhere). Grouping by tile reads the per-tile counts back to the host once per
    call (free on CPU, one sync on CUDA).
    """

    def __init__(self, ids: torch.Tensor, block_v: int, dtype: torch.dtype):
        self.shape, self.block_v = ids.shape, block_v
        where = (ids >= 0).reshape(-1).nonzero().squeeze(-1)  # flat [N L] positions of the valid ids
        valid_ids = ids.reshape(-1)[where]
        tile = torch.div(valid_ids, block_v, rounding_mode="floor")
        tile, order = torch.sort(tile, stable=True)
        self.where = where[order]
        self.row = torch.div(self.where, ids.shape[1], rounding_mode="floor")
        self.column = valid_ids[order] - tile * block_v
        self.full_tile_index = self.row * block_v + self.column
        self.bounds = [0, *torch.bincount(tile).cumsum(0).tolist()]  # tile k: [bounds[k], bounds[k + 1])
        self.sorted_logits = torch.zeros(self.where.shape, dtype=dtype, device=ids.device)

    def take_out(self, flat: torch.Tensor, start: int, stop: int, *, keep_logits: bool = True) -> None:
        """Reads the tile's positive logits and sets them to -inf in `flat`, the buffer the tile is a
        view of (`N * (stop - start)` elements or more)."""
        k = start // self.block_v
        if k + 1 >= len(self.bounds) or self.bounds[k] == self.bounds[k + 1]:
            return
        lo, hi = self.bounds[k], self.bounds[k + 1]
        width = stop - start
        index = (self.full_tile_index[lo:hi] if width == self.block_v
                 else self.row[lo:hi] * width + self.column[lo:hi])
        if keep_logits:
            torch.index_select(flat, 0, index, out=self.sorted_logits[lo:hi])
        flat.index_fill_(0, index, float("-inf"))

    @property
    def logits(self) -> torch.Tensor:
        """`[N, L]`: each valid id's logit, 0 at padding and duplicates."""
        out = self.sorted_logits.new_zeros(self.shape[0] * self.shape[1])
        return out.index_copy_(0, self.where, self.sorted_logits).view(self.shape)


def positive_terms(logits, ids, class_weight, pos_weight, g=None, loss=None):
    """Each positive's own loss and gradient: `[N, L]` loss and, with the row gradient `g` `[N]`, dz.

    `loss = w term(-z)`, `dz = g w d term(-z) / dz`, `w = cw pw`, at valid ids (`ids >= 0`), exactly
    0 elsewhere (`where`, not a product: a padded slot's undefined logit never leaks in). The term
    of the call's `cutbce_common.loss.Loss` (plain: softplus) and its class balance are
    `branch_math.branch_terms`'. Weights are `[V]` or None; computed in `logits`' dtype.
    """
    valid = ids >= 0
    index = ids.clamp(min=0)
    weight = None
    for w in (class_weight, pos_weight):
        if w is not None:
            w = w.to(logits.dtype)[index]
            weight = w if weight is None else weight * w
    value, slope = branch_math.branch_terms(logits, True, loss)  # slope: d loss / dz
    if weight is not None:
        value = value * weight
    value = torch.where(valid, value, 0.0)
    if g is None:
        return value, None
    dz = slope * g.unsqueeze(-1)
    if weight is not None:
        dz = dz * weight
    return value, torch.where(valid, dz, 0.0)


def add_positive_grads(dz, ids, h, item_weight, d_hidden, d_items, d_bias):
    """Adds the positives' `dz` `[N, L]` to the gradients (None where not needed): `d_hidden[n] +=
    sum_l dz[n, l] item_weight[id]`, `d_items[id] += dz[n, l] h[n]`, `d_bias[id] += dz[n, l]`.
    Padded slots add an exact 0 (masked after the product, so an inf in h or the table cannot make
    nan). One `[N, L, D]` temporary at a time."""
    padded = (ids < 0).unsqueeze(-1)
    index = ids.clamp(min=0)
    if d_hidden is not None:
        rows = item_weight[index].to(dz.dtype).mul_(dz.unsqueeze(-1)).masked_fill_(padded, 0.0)
        d_hidden += rows.sum(1)
        del rows
    if d_items is not None:
        per_slot = (h.unsqueeze(1) * dz.unsqueeze(-1)).masked_fill_(padded, 0.0)
        d_items.index_add_(0, index.reshape(-1), per_slot.flatten(0, 1))
    if d_bias is not None:
        d_bias.index_add_(0, index.reshape(-1), dz.reshape(-1))


def num_positives(ids: torch.Tensor) -> torch.Tensor:
    """`|T_n|` per row as float32 (the metrics' TP + FN)."""
    return (ids >= 0).sum(-1, dtype=torch.float32)


def hits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Positives with `z > 0` per row as float32 (the metrics' TP)."""
    return ((ids >= 0) & (logits > 0)).sum(-1, dtype=torch.float32)
