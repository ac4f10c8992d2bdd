"""`CutBCEWithLogitsLoss`: the nn.Module twin of `cut_bce_with_logits`, built like BCEWithLogitsLoss."""

from __future__ import annotations

import torch
from torch import nn

from jax_kernels.focal import Focal, check_focal
from jax_kernels.shapes import check_block_v, check_reduction
from torch_cutbce.arguments import check_backend
from torch_cutbce.functional import cut_bce_with_logits


class CutBCEWithLogitsLoss(nn.Module):
    """Drop-in for `BCEWithLogitsLoss(hidden @ item_weight.T + bias, multi_hot)` without the logits.

    `pos_weight` and `class_weight` (`[V]`) are registered as buffers, so they follow `.to()` and
    live in the state dict, as BCEWithLogitsLoss's do. See `cut_bce_with_logits` for the arguments.

    Example:
      >>> loss_fn = CutBCEWithLogitsLoss()
      >>> loss = loss_fn(hidden, model.item_embedding.weight, target_ids, weight=mask)
    """

    def __init__(
        self,
        reduction: str = "mean",
        pos_weight: torch.Tensor | None = None,
        class_weight: torch.Tensor | None = None,
        *,
        block_v: int | None = None,
        backend: str = "auto",
        return_metrics: bool = False,
        focal: Focal | None = None,
    ):
        super().__init__()
        # Checked here too, so a bad option fails where it is written, not at the first step.
        check_reduction(reduction)
        check_backend(backend)
        self.reduction = reduction
        self.block_v = check_block_v(block_v)
        self.backend = backend
        self.return_metrics = return_metrics
        self.focal = check_focal(focal)
        self.register_buffer("pos_weight", pos_weight)
        self.register_buffer("class_weight", class_weight)

    def forward(self, hidden, item_weight, targets, bias=None, weight=None):
        return cut_bce_with_logits(
            hidden, item_weight, targets, bias,
            weight=weight, class_weight=self.class_weight, pos_weight=self.pos_weight,
            reduction=self.reduction, return_metrics=self.return_metrics,
            block_v=self.block_v, backend=self.backend, focal=self.focal,
        )

    def extra_repr(self) -> str:
        focal = "" if self.focal is None else f", focal={self.focal}"
        return f"reduction={self.reduction!r}, block_v={self.block_v}, backend={self.backend!r}{focal}"
