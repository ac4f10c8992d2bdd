"""RePlay (`replay-rec` 0.22, `replay.nn`): `CutBCE`, a loss object for `SasRec(body, loss=CutBCE())`.

RePlay's loss protocol (`replay.nn.loss.LossProto`) is structural: a module with a settable
`logits_callback` and `forward(model_embeddings, feature_tensors, positive_labels, negative_labels,
padding_mask, target_padding_mask)`. The model sets `loss.logits_callback = model.get_logits` when
it is built; RePlay's own `BCE` calls it for the dense `[B, T, V]` logits. `CutBCE` never calls it:
it takes the model from the bound method and reads the item table as a view of the embedding's
`weight` (RePlay's `get_item_weights()` returns a copy: `weight[mask]`), then computes the same
loss as RePlay's `BCE` with `torch_cutbce.cut_bce_with_logits`, without the logits. Nothing is
imported from RePlay, here or at `import torch_cutbce`.

The value is RePlay `BCE`'s: over the M positions with at least one real label, the sum over all
items of BCE with the multi-hot of the real labels, divided by M. Labels are taken as RePlay's
batches give them: `[B, T, P]` ids padded with any id (RePlay pads with V) and a bool
`target_padding_mask` per label; a padded label in a real position is no target (RePlay's `BCE`
fails there with an index error). The padding row of the table (`padding_idx`, first, last or
elsewhere) is never scored and gets no gradient (`torch_cutbce.without_padding_row`).

BERT4Rec: RePlay 0.22's `Bert4Rec` (`replay.models.nn.sequential`) picks its loss by a string
(`loss_type="BCE"`) and takes no loss object, so only models of `replay.nn` with a
`body.embedder` (SasRec) take this class.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from torch_cutbce.functional import cut_bce_with_logits
from torch_cutbce.special_rows import without_padding_row

# Set by CutBCE itself from RePlay's batch; every other keyword of cut_bce_with_logits may be given.
_SET_HERE = {"hidden", "item_weight", "targets", "bias", "weight", "reduction", "return_metrics"}


def item_embedding(model: nn.Module) -> nn.Embedding:
    """The item id `nn.Embedding` of a RePlay `SasRec` (its `weight` is `[V + 1, D]`, the padding row
    at `padding_idx`); reached through `model.body.embedder`, whose `get_item_weights()` copies."""
    embedder = getattr(getattr(model, "body", None), "embedder", None)
    name = getattr(embedder, "_item_feature_name", None)
    embedders = getattr(embedder, "feature_embedders", None)
    found = getattr(embedders[name], "emb", None) if embedders is not None and name in embedders else None
    if not isinstance(found, nn.Embedding):
        raise TypeError(
            f"CutBCE: cannot find the item table of {type(model).__name__}: expected a RePlay SasRec whose "
            "`body.embedder` is a SequenceEmbedding with a categorical item id feature (an nn.Embedding); "
            "pass CutBCE(item_embedding=...) for other models")
    return found


_NO_CALLBACK = (
    "CutBCE.logits_callback is not set yet, so the loss has no item table to read: a RePlay model sets it "
    "(`loss.logits_callback = model.get_logits`) when it is built with this loss; call the loss through "
    "the model, set logits_callback yourself, or pass CutBCE(item_embedding=...)")


class CutBCE(nn.Module):
    """RePlay's full-catalog `BCE` (`replay.nn.loss.BCE`), exact, without the `[B, T, V]` logits.

    Args:
      item_bias: give the items a bias (a `[V]` parameter of this module, `item_bias`, started at
        `bias_init`), used by the loss; `score_with_bias(model)` adds it to RePlay's inference scores.
      bias_init: the bias's start, default log(1 / V): the log-odds of one positive among V items.
      item_embedding: the item `nn.Embedding`, for models that are not a RePlay `SasRec`; by default
        it is read from the model that sets `logits_callback`.
      **options: any other keyword of `cut_bce_with_logits` (`block_v`, `backend`, the loss options).

    Example:
      >>> model = SasRec(body=body, loss=CutBCE(item_bias=True))
      >>> score_with_bias(model)              # inference and top-k score with the same bias
    """

    def __init__(self, *, item_bias: bool = False, bias_init: float | None = None,
                 item_embedding: nn.Embedding | None = None, **options):
        super().__init__()
        allowed = set(inspect.signature(cut_bce_with_logits).parameters) - _SET_HERE
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"CutBCE: unknown options {unknown}; expected keywords of cut_bce_with_logits: "
                            f"{sorted(allowed)}")
        if item_embedding is not None and not isinstance(item_embedding, nn.Embedding):
            raise TypeError(f"item_embedding: expected an nn.Embedding, got {type(item_embedding).__name__}")
        if not isinstance(item_bias, bool):
            raise TypeError(f"item_bias: expected True or False, got {item_bias!r}")
        self.options = options
        self.wants_bias = item_bias
        self.bias_init = bias_init
        self.item_bias: nn.Parameter | None = None
        self._embedding = item_embedding
        self._logits_callback = None
        if item_embedding is not None:
            self._make_bias(item_embedding)

    @property
    def logits_callback(self):
        """The model's `get_logits` (RePlay's protocol); `CutBCE` reads the table, not the logits."""
        if self._logits_callback is None:
            raise AttributeError(_NO_CALLBACK)
        return self._logits_callback

    def __getattr__(self, name: str):
        # nn.Module's __getattr__ runs when the property above raises, and its own message ("'CutBCE'
        # object has no attribute 'logits_callback'") replaced the cause: said here instead (still an
        # AttributeError: RePlay's protocol, hasattr).
        if name == "logits_callback":
            raise AttributeError(_NO_CALLBACK)
        return super().__getattr__(name)

    @logits_callback.setter
    def logits_callback(self, func) -> None:
        if getattr(func, "__func__", None) is CutBCE.logits:
            raise ValueError("logits_callback: got CutBCE.logits itself; set it to the model's own get_logits")
        self._logits_callback = func
        if func is not None and self._embedding is None:
            self._make_bias(item_embedding(getattr(func, "__self__", None)))

    def _make_bias(self, emb: nn.Embedding) -> None:
        num_items = emb.num_embeddings - (emb.padding_idx is not None)
        if self.wants_bias and (self.item_bias is None or self.item_bias.shape[0] != num_items):
            start = math.log(1 / num_items) if self.bias_init is None else float(self.bias_init)
            w = emb.weight
            self.item_bias = nn.Parameter(torch.full((num_items,), start, dtype=w.dtype, device=w.device))

    def table(self) -> nn.Embedding:
        """The item `nn.Embedding` this loss reads (its `weight` itself, never a copy)."""
        if self._embedding is not None:
            return self._embedding
        return item_embedding(getattr(self.logits_callback, "__self__", None))

    def forward(self, model_embeddings, feature_tensors, positive_labels, negative_labels, padding_mask,
                target_padding_mask):
        """RePlay `BCE`'s loss. `model_embeddings`: `[B, T, D]`; `positive_labels`: `[B, T, P]`
        (or `[B, T]`) item ids; `target_padding_mask`: bool, their shape, True for a real label."""
        del feature_tensors, negative_labels, padding_mask  # full catalog: every other item is a negative
        labels, mask = positive_labels, target_padding_mask
        if labels.dim() == model_embeddings.dim() - 1:
            labels, mask = labels.unsqueeze(-1), mask.unsqueeze(-1)
        if labels.shape[:-1] != model_embeddings.shape[:-1] or mask.shape != labels.shape:
            raise ValueError(f"positive_labels and target_padding_mask: expected [B, T, P] with [B, T] = "
                             f"{tuple(model_embeddings.shape[:-1])} of model_embeddings and one mask entry "
                             f"per label; got {tuple(positive_labels.shape)} and {tuple(target_padding_mask.shape)}")
        if mask.dtype != torch.bool:
            raise TypeError(f"target_padding_mask: expected bool (True = a real label), got {mask.dtype}")
        emb = self.table()
        targets = labels.masked_fill(~mask, -1)
        real = mask.any(-1).to(model_embeddings.dtype)  # RePlay's rows: any real label
        if emb.padding_idx is None:
            catalog = (emb.weight, targets, self.item_bias)
            weights = {}
        else:
            c = without_padding_row(emb.weight, targets, emb.padding_idx, self.item_bias)
            catalog, weights = (c.item_weight, c.targets, c.bias), dict(class_weight=c.class_weight)
        loss = cut_bce_with_logits(model_embeddings, *catalog, weight=real, reduction="sum",
                                   **weights, **self.options)
        return loss / real.sum()

    def logits(self, model_embeddings: torch.Tensor, candidates_to_score: torch.LongTensor | None = None):
        """The model's `get_logits` plus the item bias: what `score_with_bias` puts in its place.

        With no candidates the columns are the items in table order without the padding row (as
        RePlay's); candidates are item ids (table rows), the padding id scoring -inf."""
        logits = self.logits_callback(model_embeddings, candidates_to_score)
        if self.item_bias is None:
            return logits
        if candidates_to_score is None:
            return logits + self.item_bias
        p = self.table().padding_idx
        if p is None:
            return logits + self.item_bias[candidates_to_score]
        index = candidates_to_score - (candidates_to_score > p).long()  # rows after the padding shift down
        bias = self.item_bias[index.clamp(0, len(self.item_bias) - 1)].masked_fill(candidates_to_score == p, -math.inf)
        return logits + bias


def score_with_bias(model: nn.Module) -> nn.Module:
    """Make `model.get_logits` (and so RePlay's `forward_inference`, its predictions and top-k) add
    `model.loss`'s item bias, the one the model was trained with. Returns the model."""
    loss = getattr(model, "loss", None)
    if not isinstance(loss, CutBCE):
        raise TypeError(f"score_with_bias: expected a model whose `loss` is a CutBCE, got {type(loss).__name__}")
    if loss.item_bias is None:
        raise ValueError("score_with_bias: the model's CutBCE has no item bias (build it with CutBCE(item_bias=True))")
    model.get_logits = loss.logits  # an instance attribute: forward_inference calls self.get_logits
    return model
