"""`full_catalog_topk`: the k best items of every position over the whole catalog, in vocabulary tiles.

Full-catalog evaluation (HR@K, NDCG@K) needs the top-k of `hidden @ item_weight.T + bias`, an
`[N, V]` matrix as large as the logits the loss avoids. This scores one `[N, block_v]` tile at a
time and keeps a running top-k: O(N x (block_v + k)) extra memory whatever V is. Among equal scores
the lower item id ranks first (untrained models produce many ties; torch.topk promises nothing),
and the selection uses masks and fixed shapes only, so it also runs on XLA.
"""

from __future__ import annotations

import numbers

import torch

from cutbce_common.shapes import tile_width
from torch_cutbce.positives import accumulation_dtype
from torch_cutbce.special_rows import Plan, SpecialRows, check_per_item


def _exclude_in_tile(scores: torch.Tensor, exclude: torch.Tensor, start: int) -> torch.Tensor:
    """Sets scores of excluded ids that fall in this tile to -inf, in place.

    A fixed-shape scatter instead of a data-dependent gather: ids outside
    `[start, start + width)` (and the -1 padding) are clamped onto some column but carry +inf, which
    an `amin` scatter leaves without effect.
    """
    width = scores.shape[1]
    local = exclude - start
    inside = (local >= 0) & (local < width)
    src = torch.where(inside, float("-inf"), float("inf")).to(scores.dtype)
    return scores.scatter_reduce_(1, local.clamp(0, width - 1), src, reduce="amin")


def _tile_topk(scores: torch.Tensor, k: int, check_ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best columns of `scores` `[N, W]`, ties to the lower column, returned in column order.

    torch.topk finds the right set unless the k-th largest value t of a row also occurs outside
    it; then which of the columns equal to t it kept is unspecified. Everything above t is in; of
    the columns equal to t, the first `k - #(> t)` by position must be in (a cumulative count picks
    them), and a second topk over the distinct keys `W - column` of the chosen columns lists them.
    That exact pass costs about three topk's, so on CPU/CUDA it runs only for tiles where such a
    boundary tie occurs (rare with float scores; common in count-based baselines). On XLA, where
    the check would be a host sync per tile, it always runs.
    """
    values, columns = torch.topk(scores, k, dim=1)
    kth = values[:, -1:]
    tied = scores == kth
    if check_ties and not bool((tied.sum(1) > (values == kth).sum(1)).any()):
        columns = columns.sort(dim=1).values  # column order, for the stable merge
        return scores.gather(1, columns), columns
    width = scores.shape[1]
    need = k - (scores > kth).sum(1, keepdim=True, dtype=torch.int32)
    chosen = (scores > kth) | (tied & (tied.to(torch.int32).cumsum(1, dtype=torch.int32) <= need))
    key = torch.where(chosen, width - torch.arange(width, device=scores.device, dtype=torch.int32), 0)
    columns = torch.topk(key, k, dim=1).indices  # ascending column order: the keys are distinct
    return scores.gather(1, columns), columns


def full_catalog_topk(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
    exclude: torch.Tensor | None = None,
    special_rows: SpecialRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k items of `hidden @ item_weight.T + bias` without building the `[N, V]` scores.

    Args:
      hidden: `[*S, D]` float (N = prod(S) positions).
      item_weight: `[V, D]`, the item table used by the loss (same device); with `special_rows`, the
        whole table `[R, D]`.
      k: how many items to return per position, 1 <= k <= V.
      bias: `[V]` or None; with `special_rows`, `[V]` (the items) or `[R]` (the table's rows).
      block_v: vocabulary tile width (default: a ~16 MiB float32 `[N, block_v]` tile); any value
        >= 1 works, it need not divide V. Tiles narrower than k are widened to k.
      exclude: `[*S, X]` integer item ids to leave out per position (the items a user has already
        seen, say), padded with negative ids; ids >= V are ignored. Or a bool mask, True = leave out:
        `[*S, V]` / `[*S, R]` per position, `[V]` / `[R]` for every position (V items, R rows). Excluded items score -inf, so
        they come last and appear in the result only when fewer than k items remain.
      special_rows: a `SpecialRows` naming the rows of the table that are not items (PAD, MASK,
        ...), or None. They are never returned; ids (of the result and of `exclude`) are then rows of
        the whole table, the model's own ids. The items between them are scored as views of the
        table (no copy).

    Returns:
      `(scores, ids)`, each `[*S, k]`, best first; scores are float32 (float64 for float64
      inputs). Equal scores rank by ascending item id, so the result equals the first k columns of
      `torch.sort(scores, descending=True, stable=True)` on the materialized `[N, V]` scores.
    """
    for name, x in (("hidden", hidden), ("item_weight", item_weight), ("bias", bias), ("exclude", exclude)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__} (convert it with torch.as_tensor)")
    if hidden.dim() < 1 or item_weight.dim() != 2 or hidden.shape[-1] != item_weight.shape[1]:
        raise ValueError(
            f"hidden must be [*S, D] and item_weight [V, D] with the same D, got shapes "
            f"{tuple(hidden.shape)} and {tuple(item_weight.shape)}"
        )
    rows = item_weight.shape[0]
    plan = _plan(special_rows, rows)
    segments = _item_segments(plan)  # [(first row, stop row, first item)]: runs of items
    num_items = plan.num_items
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k: expected an int in [1, V={num_items}], got {k!r} ({type(k).__name__})")
    if not 1 <= k <= num_items:
        raise ValueError(f"k must be in [1, V={num_items}], got {k=}")
    if block_v is not None and block_v < 1:
        raise ValueError(f"block_v must be >= 1, got {block_v=}")
    if bias is not None:
        check_per_item("bias", bias, plan)
    per_row_bias = bias is not None and bias.shape[0] == rows
    lead = tuple(hidden.shape[:-1])
    h = hidden.reshape(-1, hidden.shape[-1])
    excluded_rows = None  # a bool mask [N or 1, R] over the table's rows
    if exclude is not None and exclude.dtype == torch.bool:
        excluded_rows = _mask_over_rows(exclude, lead, plan)
        exclude = None
    elif exclude is not None:
        if exclude.is_floating_point() or exclude.is_complex() or tuple(exclude.shape[:-1]) != lead:
            raise ValueError(
                f"exclude must be integer ids of shape [*S, X] with S={lead}, or a bool mask [*S, V] / [*S, R] "
                f"/ [V] / [R], got {tuple(exclude.shape)} {exclude.dtype}"
            )
        exclude = exclude.reshape(h.shape[0], -1).long()
    acc = accumulation_dtype(hidden.dtype)
    h = h.to(acc)
    block_v = max(tile_width(block_v, h.shape[0], num_items), k)  # the loss's tile, at least k wide

    check_ties = h.device.type != "xla"
    best_scores = best_ids = None
    for seg_start, seg_stop, first_item in segments:
        for start in range(seg_start, seg_stop, block_v):
            stop = min(start + block_v, seg_stop)
            scores = h @ item_weight[start:stop].to(acc).T
            if bias is not None:
                b0 = start if per_row_bias else first_item + start - seg_start
                scores = scores + bias[b0:b0 + stop - start].to(acc)
            if exclude is not None:
                scores = _exclude_in_tile(scores, exclude, start)
            if excluded_rows is not None:
                scores = scores.masked_fill(excluded_rows[:, start:stop], float("-inf"))
            tile_k = min(k, stop - start)
            tile_scores, tile_cols = _tile_topk(scores, tile_k, check_ties)
            tile_ids = tile_cols + start
            if best_scores is None:
                cand_scores, cand_ids = tile_scores, tile_ids
            else:
                # Earlier tiles hold lower ids and come first, so a stable sort keeps "lower id first"
                # among equal scores across tiles too.
                cand_scores = torch.cat([best_scores, tile_scores], dim=1)
                cand_ids = torch.cat([best_ids, tile_ids], dim=1)
            order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :k]
            best_scores, best_ids = cand_scores.gather(1, order), cand_ids.gather(1, order)
    return best_scores.reshape(*lead, k), best_ids.reshape(*lead, k)


def _plan(special_rows: SpecialRows | None, rows: int) -> Plan:
    if special_rows is None:
        return Plan(rows, (), 0, 0)
    if not isinstance(special_rows, SpecialRows):
        raise TypeError(f"special_rows: expected a torch_cutbce.SpecialRows or None, got {type(special_rows).__name__}")
    return special_rows.resolve(rows)


def _item_segments(plan: Plan) -> list[tuple[int, int, int]]:
    """The runs of item rows between the special rows: `(first row, stop row, index of its first item)`."""
    segments, start, items = [], 0, 0
    for r in (*plan.special, plan.rows):
        if r > start:
            segments.append((start, r, items))
            items += r - start
        start = r + 1
    return segments


def _mask_over_rows(mask: torch.Tensor, lead: tuple[int, ...], plan: Plan) -> torch.Tensor:
    """A bool `exclude` (True = leave out): `[*S, C]` per position or `[C]` for every position, C the
    items V or the table's rows R, as `[N or 1, R]` over the rows (a `[V]` mask gets False at the
    special rows, which are never returned anyway)."""
    v, r = plan.num_items, plan.rows
    per_position = mask.dim() == len(lead) + 1 and tuple(mask.shape[:-1]) == lead
    if not (per_position or mask.dim() == 1) or mask.shape[-1] not in (v, r):
        raise ValueError(f"exclude: a bool mask must be [*S, V] or [*S, R] (S={lead}, one row per position) or "
                         f"[V] or [R] (every position), with V = {v} items and R = {r} table rows; got "
                         f"{tuple(mask.shape)}")
    mask = mask.reshape(-1, mask.shape[-1])
    if mask.shape[-1] == r:
        return mask
    items = torch.ones(r, dtype=torch.bool, device=mask.device)
    items[list(plan.special)] = False
    return mask.new_zeros((mask.shape[0], r)).index_copy(1, items.nonzero().squeeze(1), mask)
