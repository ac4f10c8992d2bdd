"""Full-catalog evaluation: every item is a candidate, no sampled negatives.

For each user the recommender's query vector is scored against the whole catalog with
`torch_cutbce.full_catalog_topk` (vocabulary tiles and a running top-k, so a 1e7-item catalog
never holds `[batch, V]` scores), and the ranking is compared with the held-out items:

- HR@K: the next item (the first held-out one) is among the top K.
- NDCG@K: 1 / log2(rank + 2) of the next item if it is in the top K (rank 0 = first), else 0.
- Hit@k (next k): some held-out item is among the top k (k = the training horizon). With the
  leave-one-out split (holdout 1) there is one held-out item and Hit@k equals HR@k; use
  `--holdout k` for the paper-style "next k items" evaluation.

Items the user has already seen are excluded from the ranking when `exclude_seen` is on (RecBole's
full-sort convention, right for data without repeat consumption such as MovieLens); training
decides 'auto' from the data. The popularity baseline ranks by interaction counts before the
evaluated items through the same scorer, exclusions and tie rule (lower id first).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from examples.data import SeqDataset, eval_arrays, item_counts, to_catalog_ids
from torch_cutbce.topk import full_catalog_topk

# query(context [B, T] on device) -> (hidden [B, D], item_weight [V, D], bias [V] or None)
QueryFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


def ranking_metrics(top_ids: torch.Tensor, targets: torch.Tensor, ks: tuple[int, ...], k_next: int) -> dict[str, torch.Tensor]:
    """Per-user metrics from top ids `[B, >= max(ks, k_next)]` and held-out catalog ids `[B, h]`."""
    hits = top_ids == targets[:, :1]  # [B, K]: where the next item sits, if anywhere
    out = {}
    for k in ks:
        discount = 1.0 / torch.log2(torch.arange(2, k + 2, device=top_ids.device, dtype=torch.float32))
        out[f"HR@{k}"] = hits[:, :k].any(1).float()
        out[f"NDCG@{k}"] = (hits[:, :k].float() * discount).sum(1)
    in_future = (top_ids[:, :k_next, None] == targets[:, None, :]).any(-1)  # [B, k_next]
    out[f"Hit@{k_next}(next{targets.shape[1]})"] = in_future.any(1).float()
    return out


# The metrics' cut-offs (HR@K, NDCG@K); with Hit@k (k = --k) they set how many items are ranked.
KS = (10, 20)


def ranked_items(k_next: int, ks: tuple[int, ...] = KS) -> int:
    """How many of each user's top items the metrics read: the catalog must hold at least as many."""
    return max(*ks, k_next)


@torch.no_grad()
def evaluate(query: QueryFn, ds: SeqDataset, holdout: int, stage: str, **kwargs) -> dict[str, float]:
    """Mean metrics over all users for stage 'val' or 'test' (see module docstring and `evaluate_users`)."""
    return {name: float(values.mean()) for name, values in evaluate_users(query, ds, holdout, stage, **kwargs).items()}


@torch.no_grad()
def evaluate_users(query: QueryFn, ds: SeqDataset, holdout: int, stage: str, *, context_len: int,
                   ks: tuple[int, ...] = KS, k_next: int = 8, exclude_seen: bool = True, batch_size: int = 256,
                   device: torch.device | str = "cpu", block_v: int | None = None) -> dict[str, np.ndarray]:
    """Every user's metrics for stage 'val' or 'test': `{name: [U] float64}`, users in data order.

    Two runs on the same data hold the same users in the same order, so their per-user metrics pair
    up (examples/compare.py's bootstrap of a difference).

    Raises:
        ValueError: the catalog has fewer than `ranked_items(k_next, ks)` items.
    """
    context, targets, history = eval_arrays(ds, holdout, stage, context_len)
    top = ranked_items(k_next, ks)
    if top > ds.num_items:
        raise ValueError(f"cannot rank the top {top} of a catalog of {ds.num_items} items")
    chunks: dict[str, list[np.ndarray]] = {}
    for lo in range(0, ds.num_users, batch_size):
        rows = slice(lo, min(lo + batch_size, ds.num_users))
        n = rows.stop - rows.start
        # Pad the last batch to a fixed shape (XLA compiles one graph per shape).
        ctx = _pad_rows(torch.from_numpy(context[rows]), batch_size).to(device)
        hidden, item_weight, bias = query(ctx)
        exclude = None
        if exclude_seen:
            exclude = _pad_rows(to_catalog_ids(torch.from_numpy(history[rows])), batch_size, fill=-1).to(device)
        _, ids = full_catalog_topk(hidden, item_weight, top, bias, block_v=block_v, exclude=exclude)
        per_user = ranking_metrics(ids[:n].cpu(), to_catalog_ids(torch.from_numpy(targets[rows])), ks, k_next)
        for name, values in per_user.items():
            chunks.setdefault(name, []).append(values.double().numpy())
    return {name: np.concatenate(parts) for name, parts in chunks.items()}


def _pad_rows(x: torch.Tensor, rows: int, fill: int = 0) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), fill)])


def model_query(model) -> QueryFn:
    """The query of a SASRec/BERT4Rec model: `model.user_state(context)` against its tied item table."""
    def query(context):
        bias = None if model.item_bias is None else model.item_bias.detach()
        return model.user_state(context), model.item_weight.detach(), bias
    return query


def popularity_query(ds: SeqDataset, holdout: int, stage: str, device="cpu") -> QueryFn:
    """Scores every item by its interaction count: hidden = 1, item_weight = counts `[V, 1]`."""
    counts = torch.from_numpy(item_counts(ds, holdout, stage)[1:]).to(torch.float32)[:, None].to(device)

    def query(context):
        return torch.ones(context.shape[0], 1, device=context.device), counts, None
    return query


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{name} {value:.4f}" for name, value in metrics.items() if not math.isnan(value))


__all__ = ["KS", "evaluate", "evaluate_users", "ranked_items", "model_query", "popularity_query", "ranking_metrics", "format_metrics"]
