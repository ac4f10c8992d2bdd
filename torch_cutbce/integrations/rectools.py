"""RecTools (`rectools[torch]` 0.19): `CutBCEModule`, a Lightning module for its SASRec and BERT4Rec.

    model = SASRecModel(..., loss="cutbce", lightning_module_type=CutBCEModule,
                        lightning_module_kwargs={"item_bias": True})   # BERT4RecModel: the same

RecTools' transformer models train through a `TransformerLightningModule`; a loss name it does not
know reaches `_calc_custom_loss` (training) and `_calc_custom_loss_outputs` (validation). This
subclass computes there the full-catalog BCE with `torch_cutbce.cut_bce_with_logits`, exactly,
without the `[B, T, V]` logits RecTools' softmax builds. Importing this module imports RecTools;
`import torch_cutbce` never does.

The loss: over the positions whose target `y` is a real item, the sum over all V real items of BCE
with the one-hot of `y`, times the interaction weight `yw`, divided by the number of those
positions (RecTools' `BCE` reduction, with every item a negative instead of sampled ones).

What it takes care of (each one a silent error when done by hand):
- The item table (`item_model.get_all_embeddings()`, `[V + n, D]`) opens with n rows that are not
  items: PAD (and MASK for BERT4Rec): `item_extra_tokens`. They are never scored
  (`SpecialRows.first(n)`), and targets that are one of them are no target.
- BERT4Rec's `yw` is the weight of every input position, masked or not; the positions it scores
  are those whose `y` is a real item (unmasked ones have `y = 0`). `yw` alone is no target mask.
- The bias is `torch_model.item_bias` (`[V]`, the real items in id order), a parameter of the torch
  model, because RecTools' optimizer takes `torch_model.parameters()`: a bias kept on this module
  would get gradients and never change. It is saved and loaded with the model.
- `recommend()` ranks by a stored-embedding dot product; with a bias, the user vectors get a last
  column of ones and the items one of their bias (PAD and MASK 0, never recommended anyway), so
  RecTools' ranker scores `u . i / logits_t + b`, the training logit (cosine: of the normalized
  vectors, as the similarity module computes it).
- With a validation split, RecTools' `validation_step` calls `_calc_custom_loss_outputs`, which
  raises for any custom loss; here it returns the same loss on the validation targets.
"""

from __future__ import annotations

import inspect
import math
import numbers
import typing as tp

import numpy as np
import torch
from rectools.models.nn.transformers.lightning import TransformerLightningModule
from rectools.models.nn.transformers.similarity import DistanceSimilarityModule
from rectools.models.rank import Distance, TorchRanker
from torch import nn

from torch_cutbce.functional import cut_bce_with_logits
from torch_cutbce.special_rows import SpecialRows

LOSS_NAME = "cutbce"
# Set here from RecTools' batch; every other keyword of cut_bce_with_logits may go in `options`.
_SET_HERE = {"hidden", "item_weight", "targets", "bias", "weight", "reduction", "return_metrics", "special_rows"}


def batch_loss(hidden: torch.Tensor, table: torch.Tensor, y: torch.Tensor, yw: torch.Tensor, *, n_special: int,
               bias: torch.Tensor | None = None, **options) -> torch.Tensor:
    """The loss of one RecTools batch from its scoring vectors: `hidden` `[B, T, D]`, the whole table
    `[V + n_special, D]` (its first `n_special` rows PAD, MASK: not items), targets `y` `[B, T]` (table
    rows; special ids are no target), weights `yw` `[B, T]`, the items' `bias` `[V]`.

    Over the positions whose `y` is a real item: the sum over the V items of BCE with the one-hot of
    `y`, times `yw`, divided by the number of those positions."""
    real = y >= n_special  # PAD (0) and MASK are no target; BERT4Rec's unmasked positions have y = 0
    weight = yw.to(hidden.dtype) * real
    loss = cut_bce_with_logits(hidden, table, y[..., None], bias, weight=weight, reduction="sum",  # one label each
                               special_rows=SpecialRows.first(n_special), **options)
    return loss / real.sum().clamp_min(1)


class CutBCEModule(TransformerLightningModule):
    """RecTools' `TransformerLightningModule` with the exact full-catalog BCE (`loss="cutbce"`).

    Args (through `lightning_module_kwargs`; the rest are RecTools' own):
      item_bias: give the items a bias, `torch_model.item_bias` (`[V]`), trained with the model and
        used by `recommend()`.
      bias_init: the bias's start, default log(1 / V): the log-odds of one positive among V items.
      options: other keywords of `cut_bce_with_logits` (`block_v`, `backend`, the loss options).
    """

    def __init__(self, *args: tp.Any, item_bias: bool = False, bias_init: float | None = None,
                 options: dict | None = None, **kwargs: tp.Any):
        # RecTools' module takes **kwargs and drops them: a misspelt keyword (`itembias`) would train
        # without a bias and say nothing.
        known = set(inspect.signature(TransformerLightningModule.__init__).parameters) - {"self", "kwargs"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"lightning_module_kwargs: unknown keywords {unknown}; CutBCEModule takes item_bias, "
                            f"bias_init and options (RecTools passes its own: {sorted(known)})")
        if bias_init is not None and (isinstance(bias_init, bool) or not isinstance(bias_init, numbers.Real)
                                      or not math.isfinite(bias_init)):
            raise TypeError(f"bias_init: expected a finite number (the bias's start) or None (log(1 / V)), "
                            f"got {bias_init!r}")
        super().__init__(*args, **kwargs)
        if self.loss != LOSS_NAME:
            raise ValueError(f"loss: CutBCEModule computes loss={LOSS_NAME!r}; got loss={self.loss!r} "
                             "(RecTools' own losses need no custom module)")
        if not isinstance(item_bias, bool):
            raise TypeError(f"item_bias: expected True or False, got {item_bias!r}")
        options = dict(options or {})
        allowed = set(inspect.signature(cut_bce_with_logits).parameters) - _SET_HERE
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"options: unknown keywords {unknown}; expected keywords of cut_bce_with_logits: "
                            f"{sorted(allowed)}")
        self.options = options
        self.n_special = len(self.item_extra_tokens)  # PAD (, MASK): the first rows of the id map
        sim = self.torch_model.similarity_module
        if not isinstance(sim, DistanceSimilarityModule):
            raise TypeError(f"similarity_module: CutBCEModule scores with a dot product or cosine "
                            f"(DistanceSimilarityModule); got {type(sim).__name__}")
        if item_bias and getattr(self.torch_model, "item_bias", None) is None:
            num_items = int(self.torch_model.item_model.n_items) - self.n_special
            start = math.log(1 / num_items) if bias_init is None else float(bias_init)
            self.torch_model.item_bias = nn.Parameter(torch.full((num_items,), start))

    @staticmethod
    def requires_negatives(loss: str) -> tp.Optional[bool]:
        """Every item is a negative: the data preparator samples none."""
        return False if loss == LOSS_NAME else TransformerLightningModule.requires_negatives(loss)

    @property
    def item_bias(self) -> nn.Parameter | None:
        return getattr(self.torch_model, "item_bias", None)

    def _scoring(self, session: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(hidden, table)` whose dot products are RecTools' logits: its similarity module's
        normalization (cosine) and the `logits_t` division, applied to the vectors, not the logits."""
        sim = self.torch_model.similarity_module
        if sim.distance == Distance.COSINE:
            session, table = sim._get_embeddings_norm(session), sim._get_embeddings_norm(table)
        return session / self.logits_t, table

    def _loss(self, batch: dict[str, torch.Tensor], last_only: bool) -> torch.Tensor:
        table = self.torch_model.item_model.get_all_embeddings()  # [V + n, D], PAD (, MASK) first
        session = self.torch_model.encode_sessions(batch, table)  # [B, T, D]
        if last_only:  # validation: the targets are of the last position ([B, 1])
            session = session[:, -1:, :]
        hidden, table = self._scoring(session, table)
        return batch_loss(hidden, table, batch["y"], batch["yw"], n_special=self.n_special, bias=self.item_bias,
                          **self.options)

    def _calc_custom_loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch, last_only=False)

    def _calc_custom_loss_outputs(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": self._loss(batch, last_only=True)}

    def _recommend_u2i(self, user_ids, recommend_dataloader, sorted_item_ids_to_recommend, k, dataset,
                       filter_viewed, torch_device):
        """RecTools' u2i recommendations, scored with the bias (`u . i / logits_t + b`)."""
        if self.item_bias is None:
            return super()._recommend_u2i(user_ids, recommend_dataloader, sorted_item_ids_to_recommend, k, dataset,
                                          filter_viewed, torch_device)
        ui_csr_for_filter = None
        if filter_viewed:
            ui_csr_for_filter = dataset.get_user_item_matrix(include_weights=False, include_warm_items=True)[user_ids]
        user_embs, item_embs = self._get_user_item_embeddings(recommend_dataloader, torch_device)
        with torch.no_grad():
            users, items = self._scoring(user_embs.to(item_embs.device), item_embs)
            bias = self.item_bias.detach().to(items)
            rows_bias = torch.cat([bias.new_zeros(self.n_special), bias])  # PAD (, MASK): 0, never ranked
            users = torch.cat([users, users.new_ones(users.shape[0], 1)], dim=1)
            items = torch.cat([items, rows_bias[:, None]], dim=1)
        ranker = TorchRanker(distance=Distance.DOT, device=items.device, subjects_factors=users[user_ids],
                             objects_factors=items)
        user_ids_indices, all_reco_ids, all_scores = ranker.rank(
            subject_ids=np.arange(len(user_ids)), k=k, filter_pairs_csr=ui_csr_for_filter,
            sorted_object_whitelist=sorted_item_ids_to_recommend)
        return user_ids[user_ids_indices], all_reco_ids, all_scores
