"""RecBole (`recbole` 1.2.1): its SASRec and BERT4Rec with `loss_type="CutBCE"`, beside its CE and BPR.

    from torch_cutbce.integrations.recbole import SASRec        # or BERT4Rec: RecBole's, subclassed
    config = Config(model=SASRec, dataset="ml-100k",
                    config_dict={"loss_type": "CutBCE", "train_neg_sample_args": None})
    init_seed(config["seed"], config["reproducibility"])
    train, valid, test = data_preparation(config, create_dataset(config))
    model = SASRec(config, train.dataset).to(config["device"])
    trainer = Trainer(config, model)                               # RecBole's own Trainer
    trainer.fit(train, valid); trainer.evaluate(test)

RecBole's route for a model it does not ship: the class goes to `Config(model=...)`. These keep
RecBole's names, so `Config` loads RecBole's own defaults for them (`SASRec.yaml`, `BERT4Rec.yaml`),
and with `loss_type` "CE" or "BPR" they are RecBole's models unchanged. With "CutBCE" the loss is
the full-catalog BCE of `torch_cutbce.cut_bce_with_logits`, exactly, without the `[B, V]` logits
RecBole's CE builds: over the positions whose target is an item, the sum over the V items of BCE
with the one-hot of the target, divided by the number of those positions (RecBole's CE is a mean
over the same positions). Importing this module imports RecBole; `import torch_cutbce` never does.

What it takes care of (each one a silent error when done by hand):
- RecBole's item table holds rows that are not items: PAD at id 0 (`n_items` counts it) and, in
  BERT4Rec, MASK last (`mask_token = n_items`, the table is `[n_items + 1, D]`). They are never
  scored, their rows get exactly 0 gradient, and targets that are one of them are no target.
- The bias is indexed by item id, `[n_items]`, its PAD entry unused: BERT4Rec's own `output_bias`
  (no MASK entry), and for SASRec a new parameter `item_bias`. Both start at log(1 / V), the
  log-odds of one positive among V items (RecBole's BERT4Rec starts at 0, a start made for CE).
- BERT4Rec's real positions are those whose target is an item. RecBole's CE takes
  `masked_index > 0`, which also drops a masked first position (0 is its padding value too).
- `full_sort_predict` and `predict` rank with the bias and score PAD -inf (MASK is no column):
  neither is ever recommended, with or without RecBole's Trainer (which also masks PAD).
- Save and load: the bias is a parameter, in RecBole's checkpoints. `Trainer.evaluate` and
  `resume_checkpoint` load those with `torch.load`, which since torch 2.6 refuses them (they pickle
  RecBole's `Config`); set `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` for checkpoints you trust.
  `load_data_and_model` here is RecBole's, building these classes.

Config keys: `loss_type` ("CE", "BPR" or "CutBCE"); `cutbce_options`, a dict of other keywords of
`cut_bce_with_logits` (`block_v`, `backend`, the loss options). CutBCE samples no negatives:
`train_neg_sample_args` must be None, as for CE.
"""

from __future__ import annotations

import inspect
import math

import torch
from recbole.model.sequential_recommender import bert4rec, sasrec

from torch_cutbce.functional import cut_bce_with_logits
from torch_cutbce.special_rows import SpecialRows

LOSS_TYPE = "CutBCE"
LOSS_TYPES = ("CE", "BPR", LOSS_TYPE)
PAD = 0  # RecBole's padding id, first row of every item table
# Set here from RecBole's batch; every other keyword of cut_bce_with_logits may go in cutbce_options.
_SET_HERE = {"hidden", "item_weight", "targets", "bias", "weight", "reduction", "return_metrics", "special_rows"}


def batch_loss(hidden: torch.Tensor, item_weight: torch.Tensor, targets: torch.Tensor,
               bias: torch.Tensor | None = None, *, special: tuple[int, ...], **options) -> torch.Tensor:
    """The loss of one RecBole batch: `hidden` `[*S, D]`, the whole table `item_weight` `[R, D]`
    (`special`: its rows that are not items, e.g. `(0, R - 1)`), `targets` `[*S]` (table rows; a
    special id is no target), `bias` `[V]` (the items in table order) or `[R]` (its special entries unused).

    Over the positions whose target is an item: the sum over the V items of BCE with the one-hot of
    the target, divided by the number of those positions."""
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets: expected one item id per position of hidden, shape "
                         f"{tuple(hidden.shape[:-1])}; got {tuple(targets.shape)}")
    rows = item_weight.shape[0]
    special_ids = torch.tensor(sorted({i % rows for i in special}), device=targets.device)
    real = ~torch.isin(targets, special_ids)
    loss = cut_bce_with_logits(hidden, item_weight, targets[..., None], bias, weight=real.to(hidden.dtype),
                               reduction="sum", special_rows=SpecialRows(special), **options)
    return loss / real.sum().clamp_min(1)


def _options(config) -> dict:
    options = dict(config["cutbce_options"] or {})
    allowed = set(inspect.signature(cut_bce_with_logits).parameters) - _SET_HERE
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"cutbce_options: unknown keywords {unknown}; expected keywords of cut_bce_with_logits: "
                         f"{sorted(allowed)}")
    return options


class _CutBCE:
    """What SASRec and BERT4Rec share under `loss_type="CutBCE"` (mixed in before RecBole's class)."""

    def __init__(self, config, dataset):
        loss_type = config["loss_type"]
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {list(LOSS_TYPES)}, got {loss_type!r}")
        if loss_type != LOSS_TYPE:
            super().__init__(config, dataset)
            return
        negatives = config["train_neg_sample_args"]
        if negatives and negatives.get("distribution", "none") != "none":
            raise ValueError(f"train_neg_sample_args: loss_type='CutBCE' scores every item as a negative and "
                             f"samples none; set it to None (got {negatives})")
        self.cutbce_options = _options(config)
        config["loss_type"] = "CE"  # RecBole's constructors accept CE and BPR only; restored at once
        try:
            super().__init__(config, dataset)
        finally:
            config["loss_type"] = loss_type
        self.loss_type = loss_type

    @property
    def cutbce(self) -> bool:
        return self.loss_type == LOSS_TYPE

    def special_rows(self) -> tuple[int, ...]:
        """The rows of `item_embedding.weight` that are not items."""
        return (PAD,)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor, bias_by_id: torch.Tensor) -> torch.Tensor:
        # bias_by_id[1:] is the items' bias in table order ([V], a view): PAD's entry never enters.
        return batch_loss(hidden, self.item_embedding.weight, targets, bias_by_id[PAD + 1:],
                          special=self.special_rows(), **self.cutbce_options)

    @staticmethod
    def _never_pad(scores: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """PAD scored -inf: its column of a full sort, or wherever `items` (predict's ids) is PAD."""
        if items is None:
            return scores.index_fill(-1, torch.tensor([PAD], device=scores.device), -math.inf)
        return scores.masked_fill(items == PAD, -math.inf)


class SASRec(_CutBCE, sasrec.SASRec):
    """RecBole's SASRec; with `loss_type="CutBCE"` the exact full-catalog BCE and an item bias,
    `item_bias` (`[n_items]` by item id, PAD's entry unused), used by full-sort and predict."""

    def __init__(self, config, dataset):
        super().__init__(config, dataset)
        if self.cutbce:
            start = math.log(1 / (self.n_items - 1))  # n_items counts PAD
            self.item_bias = torch.nn.Parameter(torch.full((self.n_items,), start))

    def calculate_loss(self, interaction):
        if not self.cutbce:
            return super().calculate_loss(interaction)
        hidden = self.forward(interaction[self.ITEM_SEQ], interaction[self.ITEM_SEQ_LEN])  # [B, D]
        return self._loss(hidden, interaction[self.POS_ITEM_ID], self.item_bias)

    def predict(self, interaction):
        scores = super().predict(interaction)
        if not self.cutbce:
            return scores
        items = interaction[self.ITEM_ID]
        return self._never_pad(scores + self.item_bias[items], items)

    def full_sort_predict(self, interaction):
        scores = super().full_sort_predict(interaction)  # [B, n_items]
        return self._never_pad(scores + self.item_bias) if self.cutbce else scores


class BERT4Rec(_CutBCE, bert4rec.BERT4Rec):
    """RecBole's BERT4Rec; with `loss_type="CutBCE"` the exact full-catalog BCE with its own
    `output_bias`, on the masked positions. The table is `[n_items + 1, D]`: PAD first, MASK last."""

    def __init__(self, config, dataset):
        super().__init__(config, dataset)
        if self.cutbce:
            self.output_bias.data.fill_(math.log(1 / (self.n_items - 1)))

    def special_rows(self) -> tuple[int, ...]:
        return (PAD, self.mask_token)

    def calculate_loss(self, interaction):
        if not self.cutbce:
            return super().calculate_loss(interaction)
        output = self.forward(interaction[self.MASK_ITEM_SEQ])  # [B, T, D]
        index = interaction[self.MASK_INDEX]  # [B, M], padded with 0 (its targets with PAD)
        hidden = output.gather(1, index[..., None].expand(-1, -1, output.shape[-1]))  # [B, M, D]
        return self._loss(hidden, interaction[self.POS_ITEMS], self.output_bias)

    def predict(self, interaction):
        scores = super().predict(interaction)  # RecBole's adds output_bias
        return self._never_pad(scores, interaction[self.ITEM_ID]) if self.cutbce else scores

    def full_sort_predict(self, interaction):
        scores = super().full_sort_predict(interaction)  # [B, n_items]: MASK's row left out, bias added
        return self._never_pad(scores) if self.cutbce else scores


MODELS = {"SASRec": SASRec, "BERT4Rec": BERT4Rec}


def load_data_and_model(model_file):
    """RecBole's `recbole.quick_start.load_data_and_model` for a checkpoint of these classes:
    `(config, model, dataset, train_data, valid_data, test_data)`. A RecBole checkpoint pickles its
    `Config`, so it is read with `weights_only=False`: load only files you trust."""
    from logging import getLogger

    from recbole.data import create_dataset, data_preparation
    from recbole.utils import init_logger, init_seed

    checkpoint = torch.load(model_file, weights_only=False)
    config = checkpoint["config"]
    if config["model"] not in MODELS:
        raise ValueError(f"model_file: a checkpoint of {config['model']!r}; this loads {sorted(MODELS)} "
                         "(use recbole.quick_start.load_data_and_model for RecBole's other models)")
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)
    dataset = create_dataset(config)
    getLogger().info(dataset)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    init_seed(config["seed"], config["reproducibility"])
    model = MODELS[config["model"]](config, train_data._dataset).to(config["device"])
    model.load_state_dict(checkpoint["state_dict"])
    model.load_other_parameter(checkpoint.get("other_parameter"))
    return config, model, dataset, train_data, valid_data, test_data
