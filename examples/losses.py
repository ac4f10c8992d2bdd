"""The training example's losses: full-catalog BCE (CutBCE, focal, dense) and two baselines.

`bce_loss` scores every position against all V items; `--normalization` says what its sum is
divided by. `sampled_bce_loss` is what common PyTorch SASRec code trains with: the next item
against a few sampled items, the baseline that CutBCE's full catalog replaces. `softmax_ce_loss`
is the other common full-catalog objective: cross-entropy of a softmax over all V items, one
target item per position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from torch_cutbce import Focal, cut_bce_with_logits


def multi_hot(targets: torch.Tensor, num_items: int) -> torch.Tensor:
    """`[*S, k]` catalog ids (-1 = padding) -> `[*S, V]` 0/1 labels, the dense target BCE needs."""
    labels = torch.zeros(*targets.shape[:-1], num_items + 1, device=targets.device)
    labels.scatter_(-1, torch.where(targets < 0, num_items, targets), 1.0)
    return labels[..., :num_items]


def bce_loss(hidden, item_weight, bias, targets, weight, pos_weight, cfg, mesh=None) -> torch.Tensor:
    """Full-catalog BCE, `S = sum_n weight[n] sum_v l[n, v]` divided as `cfg.normalization` says.

    positions (the default): S / sum_n weight[n]; items: S / (sum_n weight[n] V), the mean over
    real positions and all items; mean: reduction='mean', S / (B T V), padded positions included.
    Under Adam a constant factor only moves the gradients against eps: items and mean put them
    below eps = 1e-8 from V ~ 2e4 on (benchmarks/results/ml100k.md, 'Normalisation'). 'cutbce' never builds
    the `[B, T, V]` logits; 'dense' is the code it replaces.

    Args:
        hidden: `[B, T, D]` position states.
        item_weight: `[V, D]` item vectors; bias: `[V]` or None.
        targets: `[B, T, k]` positive catalog ids, -1 = padding.
        weight: `[B, T]` 1 at real positions, 0 at padding.
        pos_weight: `[V]` or None. cfg: the run's TrainConfig (loss, normalization, focal, block_v).
        mesh: a torch_xla SPMD mesh, or None.
    """
    num_items = item_weight.shape[0]
    real = weight.sum().clamp(min=1)
    denominator = {"items": real * num_items, "positions": real, "mean": None}[cfg.normalization]
    if cfg.loss in ("cutbce", "focal"):
        focal = Focal(cfg.focal_gamma, cfg.focal_alpha, cfg.focal_balancing) if cfg.loss == "focal" else None
        reduction = "mean" if denominator is None else "sum"
        total = cut_bce_with_logits(hidden, item_weight, targets, bias, weight=weight, pos_weight=pos_weight,
                                    reduction=reduction, block_v=cfg.block_v or None, mesh=mesh, focal=focal)
        return total if denominator is None else total / denominator
    logits = hidden @ item_weight.T  # [B, T, V]
    if bias is not None:
        logits = logits + bias
    per_item = F.binary_cross_entropy_with_logits(logits, multi_hot(targets, num_items),
                                                  pos_weight=pos_weight, reduction="none")
    if denominator is None:
        denominator = weight.numel() * num_items
    return (per_item.sum(-1) * weight).sum() / denominator


def sampled_bce_loss(hidden, item_weight, bias, positives, negatives, weight, pos_weight: float = 1.0) -> torch.Tensor:
    """BCE of the positive logit against 1 plus the negatives' against 0, as PyTorch SASRec code has it.

    pmixer/SASRec.pytorch computes `bce(pos_logits[real], 1) + bce(neg_logits[real], 0)`, two
    BCEWithLogitsLoss means: the mean positive term over real positions plus the mean negative
    term over real positions x K negatives. Logits include the item bias. No host sync: the real
    positions are a mask, not an index.

    Args:
        hidden: `[B, T, D]` position states.
        item_weight: `[V, D]` item vectors; bias: `[V]` or None.
        positives: `[B, T]` catalog ids of each position's next item (-1 = padding).
        negatives: `[B, T, K]` catalog ids of sampled items.
        weight: `[B, T]` 1 at real positions, 0 at padding.
        pos_weight: factor of the positive term (1 in SASRec code).
    """
    positives = positives.clamp(min=0)  # padding positions get weight 0; any valid row will do
    pos_logits = (hidden * item_weight[positives]).sum(-1)  # [B, T]
    neg_logits = torch.einsum("btd,btkd->btk", hidden, item_weight[negatives])  # [B, T, K]
    if bias is not None:
        pos_logits = pos_logits + bias[positives]
        neg_logits = neg_logits + bias[negatives]
    pos_term = F.binary_cross_entropy_with_logits(pos_logits, torch.ones_like(pos_logits), reduction="none")
    neg_term = F.binary_cross_entropy_with_logits(neg_logits, torch.zeros_like(neg_logits), reduction="none")
    real = weight.sum().clamp(min=1)
    return (pos_weight * (pos_term * weight).sum() + (neg_term.mean(-1) * weight).sum()) / real


def softmax_ce_loss(hidden, item_weight, bias, targets, weight, chunk_positions: int = 4096) -> torch.Tensor:
    """Full-softmax cross-entropy over the whole catalog, the mean over real positions (exact).

    Each position's logits over all V items, `hidden @ item_weight.T + bias`, go through
    `F.cross_entropy` against one target: `targets[..., 0]`, the first positive of the example's
    multi-label lists, i.e. SASRec's next item (the k - 1 after it are not used: a softmax has one
    class per position) and BERT4Rec's hidden item itself. The logits are made for
    `chunk_positions` positions at a time; with more than one chunk each is under activation
    checkpointing, so at most one `[chunk_positions, V]` block (and its gradient) is alive. The value
    and gradients are those of the whole `[B, T, V]` computation (a batch of 64 x 50 positions is
    one chunk: exactly the plain code).

    Args:
        hidden: `[B, T, D]` position states.
        item_weight: `[V, D]` item vectors; bias: `[V]` or None.
        targets: `[B, T, k]` positive catalog ids, -1 = padding; the first one is the class.
        weight: `[B, T]` 1 at real positions, 0 at padding.
        chunk_positions: positions per logits block (>= 1).
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    classes = targets[..., 0].reshape(-1).clamp(min=0)  # padding positions get weight 0; any class will do
    weight = weight.reshape(-1).to(hidden.dtype)
    if hidden.shape[0] <= chunk_positions:  # one block: the plain computation, as model code writes it
        return _ce_sum(hidden, item_weight, bias, classes, weight) / weight.sum().clamp(min=1)
    total = hidden.new_zeros(())
    for lo in range(0, hidden.shape[0], chunk_positions):
        rows = slice(lo, lo + chunk_positions)
        total = total + torch.utils.checkpoint.checkpoint(
            _ce_sum, hidden[rows], item_weight, bias, classes[rows], weight[rows], use_reentrant=False)
    return total / weight.sum().clamp(min=1)


def _ce_sum(hidden, item_weight, bias, classes, weight) -> torch.Tensor:
    """sum_n weight[n] * CE(hidden[n] @ item_weight.T + bias, classes[n]) for one chunk of positions."""
    logits = hidden @ item_weight.T
    if bias is not None:
        logits = logits + bias
    return (F.cross_entropy(logits, classes, reduction="none") * weight).sum()
