"""The training example's settings: one dataclass whose fields are also its command-line flags.

Each `TrainConfig` field carries its default, its help text and, where the set is closed, its
choices; `build_parser` makes one flag per field (`--max-len` for `max_len`) and `parse_args` turns a
bad value into a usage error that names the flag. `examples/train.py --help` lists them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from examples import data
from examples.evaluate import KS, ranked_items
from torch_cutbce import Focal

MODEL_NAMES = ("sasrec", "bert4rec")
LOSSES = ("cutbce", "focal", "dense", "sampled", "ce")
NORMALIZATIONS = ("items", "positions", "mean")
OPTIMIZERS = ("adam", "adamw")
# AdamW's weight decay when --weight-decay is not given: torch's own default.
ADAMW_WEIGHT_DECAY = 0.01


def option(default, help: str, **argparse_kwargs):
    """A TrainConfig field that is also a command-line flag: its default, help and argparse extras."""
    return field(default=default, metadata=dict(help=help, **argparse_kwargs))


@dataclass
class TrainConfig:
    """Every setting of a run; each field is the flag `--field-name` (see `build_parser`)."""

    # the run
    model: str = option("sasrec", "the sequence model", choices=MODEL_NAMES)
    dataset: str = option("ml-100k", "the data set (synthetic: Zipf-popular items, for any catalog size)",
                          choices=data.DATASETS)
    data_path: str = option("", "ml-100k: a local ml-100k.inter or the recbole wheel (empty: download the wheel "
                                "into ~/.cache/torch-cutbce); yambda: the parquet file or folder (required)")
    synthetic_items: int = option(100_000, f"--dataset synthetic: catalog size V; at least the top max({max(KS)}, "
                                           "--k) items the metrics rank (a smaller catalog is refused, not "
                                           "scored on fewer)")
    synthetic_users: int = option(10_000, "--dataset synthetic: number of users")
    loss: str = option("cutbce", "cutbce; focal: focal CutBCE (--focal-gamma, --focal-alpha, "
                                 "--focal-balancing); dense: the materialized BCEWithLogitsLoss it replaces (the A/B); "
                                 "sampled (sasrec only): the next item against --negatives uniformly sampled items the "
                                 "user has not seen, the BCE of common PyTorch SASRec code (the baseline); ce: "
                                 "full-softmax cross-entropy over all items on one target per position (SASRec: the "
                                 "next item; BERT4Rec: the masked item), the other full-catalog baseline",
                       choices=LOSSES)
    negatives: int = option(1, "--loss sampled: sampled negatives per position")
    normalization: str = option("positions", "what the summed BCE of cutbce/focal/dense is divided by: positions = "
                                             "real positions (the per-position sum over all items); items = real "
                                             "positions x V; mean = reduction='mean', B x T x V, padded positions "
                                             "included. items and mean make gradients ~V times smaller, below "
                                             "Adam's eps from V ~ 2e4 on (benchmarks/results/ml100k.md). --loss sampled: "
                                             "always its own mean over real positions; --loss ce: the mean over "
                                             "real positions, i.e. positions only",
                                choices=NORMALIZATIONS)
    focal_gamma: float = option(2.0, "--loss focal: the focusing exponent gamma >= 0")
    focal_alpha: float = option(0.25, "--loss focal with --focal-balancing: the positives' weight alpha in [0, 1]")
    focal_balancing: bool = option(False, "--loss focal: weigh positives by alpha and negatives by 1 - alpha")
    device: str = option("cpu", "cpu, or xla: torch_xla (a TPU, or PJRT_DEVICE=CPU)", choices=("cpu", "xla"))
    mesh: str = option("", "with --device xla: DATAxMODEL devices for torch_xla SPMD, e.g. 2x2 (the item table "
                           "split along V over MODEL); empty: one device")
    fsdp: bool = option(False, "data parallel over torchrun's processes with the item table sharded by FSDP2 and "
                               "read by the loss without gathering (torchrun --nproc-per-node P examples/train.py "
                               "--fsdp; gloo on the CPU, NCCL on cuda:LOCAL_RANK where CUDA is available; "
                               "--batch-size stays the global batch; examples/fsdp.py)")
    out_dir: str = option("", "where checkpoints, metrics.json and curves.png go (empty: "
                              "runs/<model>-<dataset>-<loss>-seed<seed>)")
    resume: bool = option(False, "continue from <out-dir>/ckpt.pt if it exists (exactly: same result as no kill)")
    seed: int = option(0, "initialization, data order, dropout and masks (the data split does not depend on it)")
    # data
    holdout: int = option(1, "leave-h-out: the last h items of each user are its test items, the h before "
                             "them its validation items")
    k: int = option(8, "SASRec's positives per position (the next k items); also the k of the Hit@k metric")
    bert_labels: int = option(1, "BERT4Rec's positives per masked position: its item and the bert-labels - 1 "
                                 "items after it")
    max_len: int = option(50, "sequence length T the model sees")
    mask_prob: float = option(0.2, "BERT4Rec: probability that an item is replaced by [MASK], in (0, 1]")
    # model
    dim: int = option(64, "hidden size D")
    num_layers: int = option(2, "Transformer blocks")
    num_heads: int = option(1, "attention heads (must divide --dim)")
    dropout: float = option(0.2, "dropout probability, in [0, 1)")
    item_bias: bool = option(True, "a learned score offset per item (--no-item-bias: item vectors only)")
    # optimization
    epochs: int = option(20, "passes over the training windows")
    batch_size: int = option(64, "sequences per step")
    optimizer: str = option("adam", "adam: torch.optim.Adam (weight decay as an L2 term in the gradient); "
                                     "adamw: torch.optim.AdamW (decoupled weight decay, on every parameter)",
                            choices=OPTIMIZERS)
    lr: float = option(3e-3, "learning rate")
    adam_eps: float = option(1e-8, "the optimizer's eps (Adam and AdamW): it is added to sqrt(v), so gradients "
                                   "much smaller than eps get steps much smaller than lr")
    weight_decay: float = option(None, "weight decay (not given: 0 with adam, 0.01 with adamw, torch's AdamW default)",
                                 type=float)
    pos_weight: float = option(1.0, "BCE weight of the positive term (negatives outnumber positives V / k to 1)")
    block_v: int = option(0, "CutBCE vocabulary tile width (0: the library's default)")
    # evaluation and checkpoints
    eval_batch_size: int = option(256, "users per evaluation batch")
    exclude_seen: str = option("auto", "drop already-seen items from rankings (auto: yes unless the data has "
                                       "repeat consumption)", choices=("auto", "yes", "no"))
    patience: int = option(0, "stop after this many epochs without a better validation NDCG@10 (0: never)")
    ckpt_every: int = option(0, "also checkpoint every this many steps (0: at the end of each epoch only)")
    max_steps: int = option(0, "stop after this many optimizer steps in all (0: no limit)")
    num_threads: int = option(0, "torch CPU threads (0: torch's default)")

    @property
    def labels(self) -> int:
        """Width of the positive-id lists `[B, T, labels]` the loss gets."""
        return self.k if self.model == "sasrec" else self.bert_labels

    def __post_init__(self):
        """Checks every value, so a bad one fails here with its flag's name, not deep inside the run.

        Raises:
            ValueError: a value out of its range or set.
        """
        for name, allowed in (("model", MODEL_NAMES), ("dataset", data.DATASETS), ("loss", LOSSES),
                              ("device", ("cpu", "xla"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown --{name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        for name, allowed in (("normalization", NORMALIZATIONS), ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown --{name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if self.weight_decay is None:
            self.weight_decay = ADAMW_WEIGHT_DECAY if self.optimizer == "adamw" else 0.0
        if self.loss == "sampled" and self.model != "sasrec":
            raise ValueError(f"--loss sampled trains SASRec only (the next item against sampled ones), "
                             f"got --model {self.model}")
        if self.loss == "sampled" and self.mesh:
            raise ValueError(f"--loss sampled runs on one device, got --mesh {self.mesh}")
        if self.loss == "ce":
            self._check_ce()
        if self.exclude_seen not in ("auto", "yes", "no"):
            raise ValueError(f"--exclude-seen must be auto, yes or no, got {self.exclude_seen!r}")
        if self.mesh and (self.device != "xla" or not re.fullmatch(r"[1-9]\d*x[1-9]\d*", self.mesh)):
            raise ValueError(f"--mesh takes DATAxMODEL device counts (e.g. 2x2) with --device xla, got {self.mesh!r}")
        if self.fsdp:
            self._check_fsdp()
        if self.dataset == "yambda" and not self.data_path:
            raise ValueError("--dataset yambda needs --data-path (the parquet file or folder)")
        if self.data_path and not Path(self.data_path).exists():
            raise ValueError(f"--data-path {self.data_path!r} does not exist")
        at_least = {name: 1 for name in ("k", "bert_labels", "holdout", "max_len", "batch_size", "eval_batch_size",
                                         "epochs", "synthetic_users", "dim", "num_heads",
                                         "negatives")}
        # A catalog smaller than the top items the metrics rank would train a whole epoch, then fail.
        at_least["synthetic_items"] = ranked_items(self.k)
        at_least.update({name: 0 for name in ("num_layers", "block_v", "patience", "ckpt_every", "max_steps",
                                              "num_threads")})
        for name, low in at_least.items():
            if getattr(self, name) < low:
                why = f" (the top items the metrics rank: max({max(KS)}, --k))" if name == "synthetic_items" else ""
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}{why}, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(f"--dim {self.dim} must be divisible by --num-heads {self.num_heads}")
        if self.model == "bert4rec" and self.max_len < 2:
            raise ValueError("bert4rec needs --max-len >= 2 (the history plus the appended [MASK])")
        for f in dataclasses.fields(self):  # inf and nan pass every comparison below or train to NaN
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        for name, ok, rule in (("mask_prob", 0 < self.mask_prob <= 1, "in (0, 1]"), ("lr", self.lr > 0, "> 0"),
                               ("pos_weight", self.pos_weight > 0, "> 0"),
                               ("dropout", 0 <= self.dropout < 1, "in [0, 1)"),
                               ("weight_decay", self.weight_decay >= 0, ">= 0"),
                               ("adam_eps", self.adam_eps > 0, "> 0"),
                               ("focal_gamma", self.focal_gamma >= 0, ">= 0"),
                               ("focal_alpha", 0 <= self.focal_alpha <= 1, "in [0, 1]")):
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")
        if self.loss == "focal":  # the library's own bounds on gamma, with its message
            try:
                Focal(self.focal_gamma, self.focal_alpha, self.focal_balancing)
            except ValueError as error:
                raise ValueError(f"--focal-gamma / --focal-alpha: {error}") from None
        if not self.out_dir:
            self.out_dir = f"runs/{self.model}-{self.dataset}-{self.loss}-seed{self.seed}"

    def _check_ce(self):
        """--loss ce: a softmax over the catalog has no positive weight and one normalisation (per real
        position), and runs on one device (the SPMD and FSDP routes shard CutBCE's table reads)."""
        if self.pos_weight != 1.0:
            raise ValueError(f"--loss ce has no positive weight (a softmax has one class per position), "
                             f"got --pos-weight {self.pos_weight}")
        if self.normalization != "positions":
            raise ValueError(f"--loss ce is the mean over real positions (--normalization positions), "
                             f"got --normalization {self.normalization}")
        if self.mesh:
            raise ValueError(f"--loss ce runs on one device, got --mesh {self.mesh}")

    def _check_fsdp(self):
        if self.device == "xla" or self.mesh:
            raise ValueError("--fsdp shards the item table over torch.distributed processes (CPU or CUDA); it does "
                             "not combine with --device xla or --mesh (torch_xla SPMD shards the table itself)")
        if self.loss not in ("cutbce", "focal"):
            raise ValueError(f"--fsdp: the loss reads the sharded item table directly, which --loss cutbce and "
                             f"focal do; got --loss {self.loss}")
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ValueError(f"--fsdp runs under torchrun (its environment lacks {', '.join(missing)}): "
                             f"torchrun --nproc-per-node P examples/train.py --fsdp ...")
        world = int(os.environ["WORLD_SIZE"])
        if self.batch_size < world:
            raise ValueError(f"--fsdp: --batch-size {self.batch_size} (the global batch) gives each of the "
                             f"{world} ranks at least one row only if it is >= {world}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except empty ones (their help says what empty means); keeps the
    module docstring's line breaks."""

    def _get_help_string(self, action):
        return action.help if action.default in ("", None) else super()._get_help_string(action)


# Flag groups of --help, by the first field of each.
GROUPS = {"model": "run", "holdout": "data", "dim": "model", "epochs": "optimization",
          "eval_batch_size": "evaluation, checkpoints and threads"}


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """One flag per TrainConfig field, with its help, default and choices."""
    parser = argparse.ArgumentParser(prog="examples/train.py", description=description, formatter_class=HelpFormatter)
    group = parser
    for f in dataclasses.fields(TrainConfig):
        if f.name in GROUPS:
            group = parser.add_argument_group(GROUPS[f.name])
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=f.metadata["help"])
        else:
            group.add_argument(flag, **{"type": type(f.default), "default": f.default, **f.metadata})
    return parser


def parse_args(argv=None, description: str = "") -> TrainConfig:
    """Command line -> TrainConfig; a bad value exits with a usage message naming the flag (status 2)."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))
