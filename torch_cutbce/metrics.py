"""The count-based metrics CutBCE returns beside the loss."""

from __future__ import annotations

from typing import NamedTuple

import torch


class CutBCEMetrics(NamedTuple):
    """TP, FP, FN, TN counts (float32; z > 0 is a positive prediction), times the position weight.

    Shape S with reduction='none', else scalars summed over positions. Not differentiable.
    Rates are left to the caller, e.g. `precision = tp / (tp + fp)`.
    """

    tp: torch.Tensor
    fp: torch.Tensor
    fn: torch.Tensor
    tn: torch.Tensor

    def reshape(self, shape) -> "CutBCEMetrics":
        return CutBCEMetrics(*(c.reshape(shape) for c in self))
