"""Dense PyTorch reference: `binary_cross_entropy_with_logits` on materialized logits (test oracle).

The formula is stated once, in `jax_kernels/reference.py` (DESIGN.md section 2). This module
builds the `[N, V]` logits, the dense multi-hot target and the `[N, V]` weight, and hands them to
torch's own BCE, so it is independent of every fast path (it never imports them). It is also
`backend='dense'` of `cut_bce_with_logits`: the "before" code that CutBCE replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_cutbce.metrics import CutBCEMetrics
from torch_cutbce.targets import ids_to_multi_hot


def dense_bce_with_logits(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    reduction: str = "mean",
    return_metrics: bool = False,
):
    """CutBCE's loss computed the O(N V)-memory way. Arguments as `cut_bce_with_logits`."""
    lead_shape = hidden.shape[:-1]
    num_items = item_weight.shape[0]
    logits = F.linear(hidden, item_weight, bias)  # [*S, V]
    multi_hot = ids_to_multi_hot(targets, num_items, dtype=logits.dtype)
    elem_weight = None
    if weight is not None or class_weight is not None:
        elem_weight = torch.ones((), dtype=logits.dtype, device=logits.device)
        if weight is not None:
            elem_weight = elem_weight * weight.unsqueeze(-1)
        if class_weight is not None:
            elem_weight = elem_weight * class_weight
    elementwise = F.binary_cross_entropy_with_logits(logits, multi_hot, pos_weight=pos_weight, reduction="none")
    if elem_weight is not None:
        # Same as BCE's weight= argument (an elementwise factor), but differentiable in `weight`.
        elementwise = elementwise * elem_weight
    if reduction == "none":
        loss = elementwise.sum(-1)
    elif reduction == "sum":
        loss = elementwise.sum()
    else:
        loss = elementwise.mean()
    if not return_metrics:
        return loss
    predicted = logits.detach() > 0
    truth = multi_hot > 0
    counts = [
        (predicted & truth).sum(-1),
        (predicted & ~truth).sum(-1),
        (~predicted & truth).sum(-1),
        (~predicted & ~truth).sum(-1),
    ]
    counts = [c.float() if weight is None else c.float() * weight.detach().float() for c in counts]
    if reduction != "none":
        counts = [c.sum() for c in counts]
    return loss, CutBCEMetrics(*counts).reshape(lead_shape if reduction == "none" else ())
