"""Dense PyTorch reference: `binary_cross_entropy_with_logits` on materialized logits (test oracle).

The formula is stated once, in `jax_kernels/reference.py` (docs/design.md, 'The math'). This module
builds the `[N, V]` logits, the dense multi-hot target and the `[N, V]` weight, and hands them to
torch's own BCE, so it is independent of every fast path (it never imports them). It is also
`backend='dense'` of `cut_bce_with_logits`: the "before" code that CutBCE replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cutbce_common.focal import check_focal
from cutbce_common.loss import check_label_smoothing
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
    focal=None,
    label_smoothing: float = 0.0,
):
    """CutBCE's loss computed the O(N V)-memory way. Arguments as `cut_bce_with_logits`.

    With `label_smoothing` eps, torch's BCE of the smoothed target `y (1 - eps) + eps / 2` (Keras'
    definition), times `pos_weight` at a positive (a weight on the positive's whole term, as under
    focal; `BCEWithLogitsLoss(pos_weight=)` would weight the smoothed target's positive part of
    every element instead).

    With `focal` (a `cutbce_common.focal.Focal`) the focal loss, written from its definition in logit
    space and independent of the engines' formulas: each element's BCE `log(1 + exp(u))` (u the
    logit seen from the element's label) times `exp(gamma * logsigmoid(u))` = `(1 - p_t)^gamma`,
    times alpha / 1 - alpha with class balancing; `pos_weight` and the weights multiply as in BCE.

    Computes in float32, or float64 for float64 `hidden` (the native path's rule): every float
    input is cast to that dtype first, so a bias (or weight) of another float dtype works, and
    float16 / bfloat16 inputs give float32 logits (exact products of the half inputs, as a
    low-precision matmul accumulating in float32) and a float32 loss. Gradients come back in each
    input's dtype through the casts. N = 0 and D = 0 work ('mean' of N = 0 is nan, as torch's).
    """
    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    hidden, item_weight, bias, weight, class_weight, pos_weight = (
        None if t is None else t.to(compute) for t in (hidden, item_weight, bias, weight, class_weight, pos_weight)
    )
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
    focal = check_focal(focal)  # a TypeError / ValueError naming focal, as every entry gives
    label_smoothing = check_label_smoothing(label_smoothing)
    if focal is None and not label_smoothing:
        elementwise = F.binary_cross_entropy_with_logits(logits, multi_hot, pos_weight=pos_weight, reduction="none")
    else:
        elementwise = _smoothed_focal_elementwise(logits, multi_hot, pos_weight, focal, label_smoothing)
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


def _smoothed_focal_elementwise(logits, multi_hot, pos_weight, focal, label_smoothing):
    """`[*S, V]` Keras terms on the smoothed target `t = y (1 - eps) + eps / 2`: the BCE of t,
    times `(1 - p_t)^gamma` with `1 - p_t = t sigmoid(-z) + (1 - t) sigmoid(z)` (from logsigmoid:
    no power of a rounded probability), times `t alpha + (1 - t)(1 - alpha)` with class balancing,
    times pos_weight at a positive."""
    # t and 1 - t each from its own branch (eps / 2 or 1 - eps / 2): 1 - t formed from t rounds
    # eps / 2 < 2**-53 away at a positive, the smoothed term of every confident positive with it.
    positive = multi_hot > 0
    half = label_smoothing / 2
    high, low = torch.full_like(logits, 1 - half), torch.full_like(logits, half)
    target, rest = torch.where(positive, high, low), torch.where(positive, low, high)
    zero = torch.zeros_like(logits)
    # BCE of the soft target from logaddexp: torch's own BCE forms log(1 + e) without log1p, so a
    # term of 1e-21 at z = -31 is 3% off even in float64 (it is the plain oracle only where exact).
    terms = target * torch.logaddexp(-logits, zero) + rest * torch.logaddexp(logits, zero)
    if focal is not None:
        one_minus_p = torch.logaddexp(torch.log(target) + F.logsigmoid(-logits),
                                      torch.log(rest) + F.logsigmoid(logits))
        terms = terms * torch.exp(focal.gamma * one_minus_p)
        if focal.apply_class_balancing:
            terms = terms * (target * focal.alpha + rest * (1 - focal.alpha))
    if pos_weight is not None:
        terms = terms * torch.where(multi_hot > 0, pos_weight, 1.0)
    return terms
