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

from jax_kernels.shapes import accumulation_dtype_name


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

    A tile `[start, stop)` is an `[N, stop - start]` view of a flat buffer with one spare element
    after it: ids outside the tile are pointed at the spare, so a tile's reads and writes are one
    gather and one fill of N L elements, never a pass over the tile. Tiles start at multiples of
    `block_v`, so each id's tile and column are computed once, not per tile. After every tile has
    been through `take_out`, `logits` `[N, L]` holds each valid id's logit (undefined elsewhere).
    """

    def __init__(self, ids: torch.Tensor, block_v: int, dtype: torch.dtype):
        n = ids.shape[0]
        self.block_v = block_v
        self.tile = torch.where(ids >= 0, torch.div(ids, block_v, rounding_mode="floor"), -1)
        self.row = torch.arange(n, device=ids.device).unsqueeze(-1)
        self.column = ids - self.tile * block_v
        self.full_tile_slots = self.row * block_v + self.column
        self.logits = torch.zeros(ids.shape, dtype=dtype, device=ids.device)

    def _slots(self, start: int, stop: int):
        width = stop - start
        here = self.tile == start // self.block_v
        slots = self.full_tile_slots if width == self.block_v else self.row * width + self.column
        spare = self.row.shape[0] * width  # the element just past the tile in the flat buffer
        return here, torch.where(here, slots, spare).reshape(-1)

    def take_out(self, flat: torch.Tensor, start: int, stop: int, *, keep_logits: bool = True) -> None:
        """Reads the tile's positive logits into `self.logits` and sets them to -inf in `flat`, the
        buffer the tile is a view of (`N * (stop - start) + 1` elements or more)."""
        here, slots = self._slots(start, stop)
        if keep_logits:
            gathered = flat.index_select(0, slots).view(here.shape)
            torch.where(here, gathered, self.logits, out=self.logits)
        flat.index_fill_(0, slots, float("-inf"))


def positive_terms(logits, ids, class_weight, pos_weight, g=None, focal=None):
    """Each positive's own loss and gradient: `[N, L]` loss and, with the row gradient `g` `[N]`, dz.

    `loss = w softplus(-z)`, `dz = -g w sigmoid(-z)`, `w = cw pw`, at valid ids (`ids >= 0`), exactly
    0 elsewhere (`where`, not a product: a padded slot's undefined logit never leaks in). With a
    `jax_kernels.focal.Focal`, the focal term of u = -z (`focal.py`) and `w = cw pw positive_scale`.
    Weights are `[V]` or None; computed in `logits`' dtype.
    """
    valid = ids >= 0
    index = ids.clamp(min=0)
    weight = None
    for w in (class_weight, pos_weight):
        if w is not None:
            w = w.to(logits.dtype)[index]
            weight = w if weight is None else weight * w
    if focal is not None and focal.positive_scale != 1.0:
        weight = focal.positive_scale if weight is None else weight * focal.positive_scale
    u = -logits  # the logit seen from the positive's label
    log1p_e = torch.log1p(torch.exp(-u.abs()))
    softplus = u.clamp(min=0) + log1p_e
    focusing = None
    if focal is not None and focal.gamma != 0.0:
        focusing = torch.exp(-focal.gamma * ((-u).clamp(min=0) + log1p_e))  # sigmoid(u)^gamma
    loss = softplus if focusing is None else focusing * softplus
    if weight is not None:
        loss = loss * weight
    loss = torch.where(valid, loss, 0.0)
    if g is None:
        return loss, None
    d_term = torch.sigmoid(u)  # d softplus(u) / du
    if focusing is not None:
        d_term = focusing * (focal.gamma * torch.sigmoid(-u) * softplus + d_term)
    dz = d_term.neg_() * g.unsqueeze(-1)  # du / dz = -1
    if weight is not None:
        dz = dz * weight
    return loss, torch.where(valid, dz, 0.0)


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
