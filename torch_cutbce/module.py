"""`CutBCEWithLogitsLoss`: the nn.Module twin of `cut_bce_with_logits`, built like BCEWithLogitsLoss."""

from __future__ import annotations

import torch
from torch import nn

from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from cutbce_common.shapes import AxisName, check_block_v, check_reduction
from torch_cutbce.engines import check_backend, check_parallel_options
from torch_cutbce.functional import cut_bce_with_logits
from torch_cutbce.route import VocabParallelOptions
from torch_cutbce.special_rows import SpecialRows


class CutBCEWithLogitsLoss(nn.Module):
    """Drop-in for `BCEWithLogitsLoss(hidden @ item_weight.T + bias, multi_hot)` without the logits.

    `pos_weight` and `class_weight` (`[V]`) are registered as buffers, so they follow `.to()` and
    live in the state dict, as BCEWithLogitsLoss's do. Every other option of `cut_bce_with_logits`
    (see it for the arguments) is fixed here too, the torch_xla SPMD `mesh` and `vocab_parallel`
    included, and checked when the module is built as far as it can be without tensors.

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
        label_smoothing: float = 0.0,
        mesh=None,
        vocab_axis: AxisName = "model",
        data_axis: AxisName = "data",
        vocab_parallel: VocabParallelOptions | None = None,
        special_rows: SpecialRows | None = None,
    ):
        super().__init__()
        # Checked here too, so a bad option fails where it is written, not at the first step: by
        # the function's own rules (shapes, arguments, the loss options), so with its messages.
        check_reduction(reduction)
        check_backend(backend)
        check_parallel_options(backend, mesh, vocab_parallel, vocab_axis, data_axis)
        self.reduction = reduction
        self.block_v = check_block_v(block_v)
        self.backend = backend
        self.return_metrics = return_metrics
        self.loss = Loss(focal, label_smoothing)
        self.mesh = mesh
        self.vocab_axis = vocab_axis
        self.data_axis = data_axis
        self.vocab_parallel = vocab_parallel
        if special_rows is not None and not isinstance(special_rows, SpecialRows):
            raise TypeError(f"special_rows: expected a torch_cutbce.SpecialRows or None, "
                            f"got {type(special_rows).__name__}")
        self.special_rows = special_rows
        self.register_buffer("pos_weight", pos_weight)
        self.register_buffer("class_weight", class_weight)

    def forward(self, hidden, item_weight, targets, bias=None, weight=None):
        return cut_bce_with_logits(
            hidden, item_weight, targets, bias,
            weight=weight, class_weight=self.class_weight, pos_weight=self.pos_weight,
            reduction=self.reduction, return_metrics=self.return_metrics,
            block_v=self.block_v, backend=self.backend, **self.loss.arguments(), mesh=self.mesh,
            vocab_axis=self.vocab_axis, data_axis=self.data_axis, vocab_parallel=self.vocab_parallel,
            special_rows=self.special_rows,
        )

    def extra_repr(self) -> str:
        parts = [f"reduction={self.reduction!r}", f"block_v={self.block_v}", f"backend={self.backend!r}"]
        parts += [f"{name}={value}" for name, value in self.loss.arguments().items() if value != Loss().arguments()[name]]
        if self.mesh is not None:
            shape = tuple(getattr(self.mesh, "mesh_shape", ()))
            parts += [f"mesh=Mesh({shape}, {tuple(self.mesh.axis_names)})",
                      f"vocab_axis={self.vocab_axis!r}", f"data_axis={self.data_axis!r}"]
        if self.vocab_parallel is not None:
            o = self.vocab_parallel
            parts.append(f"vocab_parallel=VocabParallelOptions(start={o.start}, stop={o.stop}, num_items={o.num_items})")
        if self.special_rows is not None:
            parts.append(f"special_rows={self.special_rows}")
        return ", ".join(parts)
