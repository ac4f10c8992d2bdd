"""`without_padding_row`: a table whose padding row sits anywhere, passed to the loss exactly.

The rule (docs/converting.md, 'The padding rule'): the loss scores every row of `item_weight` as an
item. A padding row is not an item, so it must never be scored: not as a negative of every
position, not as a target, and its gradient (and its bias's) must stay exactly 0. Passing the whole
table of an `nn.Embedding(V + 1, D, padding_idx=p)` breaks that rule silently (the padding row
becomes a negative for every position); this function applies it for any `p`:

- padding first (`p = 0`, most PyTorch code): the view `item_weight[1:]`, ids shifted down by one;
- padding last (`p = V`, RePlay's `padding_value = cardinality`): the view `item_weight[:-1]`,
  ids unchanged;
- padding elsewhere: no view of the table leaves one row out, and a copy of `[V, D]` is what this
  library exists to avoid, so the whole table is passed with a `class_weight` that is 0 on row `p`
  (a zero class weight multiplies that column's loss and its slope, so the row is never scored and
  gets exactly 0 gradient), and ids are left as they are. Here `reduction='mean'` would count the
  padding row among the items; use `'sum'` (or `'none'`) and divide by what you mean.

In every layout, ids equal to `p` become -1 (no target), and the bias, `class_weight` and
`pos_weight` are the items' own, `[V]`, in table order without the padding row (as RePlay's
`get_item_weights()` columns and as the row-0 recipe's `item_emb.weight[1:]`).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch


class CatalogArguments(NamedTuple):
    """What `cut_bce_with_logits` takes for the catalog: `(hidden, item_weight, targets, bias,
    class_weight=class_weight, pos_weight=pos_weight)`."""

    item_weight: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    class_weight: torch.Tensor | None
    pos_weight: torch.Tensor | None


def _check(item_weight, targets, padding_idx, per_item) -> int:
    if not isinstance(item_weight, torch.Tensor) or item_weight.dim() != 2:
        shape = tuple(item_weight.shape) if isinstance(item_weight, torch.Tensor) else type(item_weight).__name__
        raise ValueError(f"item_weight: expected the whole table [V + 1, D], padding row included; got {shape}")
    rows = item_weight.shape[0]
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise TypeError(f"padding_idx: expected an int row of item_weight, got {padding_idx!r} "
                        f"({type(padding_idx).__name__})")
    if not 0 <= int(padding_idx) < rows:
        raise ValueError(f"padding_idx: expected a row of item_weight, 0 <= padding_idx < {rows} "
                         f"(item_weight is {tuple(item_weight.shape)}; negative rows are not taken), "
                         f"got {padding_idx}")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex() \
            or targets.dtype == torch.bool:
        what = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TypeError(f"targets: expected integer item ids (rows of item_weight), got {what}")
    for name, value in per_item.items():
        if value is not None and tuple(value.shape) != (rows - 1,):
            raise ValueError(f"{name}: expected [V] = [{rows - 1}], one entry per item in table order "
                             f"without the padding row (item_weight is {tuple(item_weight.shape)}), "
                             f"got {tuple(value.shape)}")
    return int(padding_idx)


def _insert(value: torch.Tensor | None, p: int, fill: float) -> torch.Tensor | None:
    """`[V]` per item -> `[V + 1]` per table row, `fill` at the padding row (O(V), never O(V D))."""
    if value is None:
        return None
    return torch.cat([value[:p], value.new_full((1,), fill), value[p:]])


def without_padding_row(
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    padding_idx: int,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
) -> CatalogArguments:
    """The loss's catalog arguments for a table with a padding row at `padding_idx`; no table copy.

    Args:
      item_weight: `[V + 1, D]`, the whole table (an `nn.Embedding`'s `weight`), padding row included.
      targets: `[*S, L]` integer ids, rows of `item_weight`; ids equal to `padding_idx` and negative
        ids are no target.
      padding_idx: the padding row, `0 <= padding_idx <= V` (`nn.Embedding.padding_idx`, RePlay's
        `padding_value`).
      bias, class_weight, pos_weight: `[V]` per item, in table order without the padding row, or None.

    Returns:
      `CatalogArguments(item_weight, targets, bias, class_weight, pos_weight)`: views of the table
      when the padding row is first or last; the whole table with `class_weight` 0 on the padding
      row otherwise (then use `reduction='sum'` or `'none'`). Gradients reach the table and the
      bias through them; the padding row's gradient is exactly 0.

    Example:
      >>> c = without_padding_row(emb.weight, ids, emb.padding_idx, item_bias)
      >>> loss = cut_bce_with_logits(hidden, c.item_weight, c.targets, c.bias, class_weight=c.class_weight,
      ...                            pos_weight=c.pos_weight, weight=mask, reduction="sum") / mask.sum()
    """
    p = _check(item_weight, targets, padding_idx, dict(bias=bias, class_weight=class_weight, pos_weight=pos_weight))
    rows = item_weight.shape[0]
    no_target = torch.full_like(targets, -1)
    if p == 0:
        return CatalogArguments(item_weight[1:], torch.where(targets > 0, targets - 1, no_target),
                                bias, class_weight, pos_weight)
    targets = torch.where(targets == p, no_target, targets)
    if p == rows - 1:
        return CatalogArguments(item_weight[:-1], targets, bias, class_weight, pos_weight)
    keep = torch.ones(rows, dtype=item_weight.dtype, device=item_weight.device)
    keep[p] = 0
    class_weight = keep if class_weight is None else _insert(class_weight, p, 0.0)
    return CatalogArguments(item_weight, targets, _insert(bias, p, 0.0), class_weight, _insert(pos_weight, p, 1.0))
