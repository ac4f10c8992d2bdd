"""--fsdp: data-parallel training with the item table sharded by FSDP2, read by CutBCE without gathering.

    torchrun --standalone --nproc-per-node 2 examples/train.py --fsdp --dataset synthetic --synthetic-items 1000000

One process per rank (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), gloo on
the CPU, NCCL on `cuda:LOCAL_RANK` where CUDA is available. The model's tied item embedding and the
item bias form one module, sharded `Shard(0)` by `fully_shard` (rows `[r ceil(R/P), ...)` on rank
r); then `fully_shard(model)` takes the rest. After the forward the loss reads the sharded table and
bias as DTensors (`torch_cutbce.distributed`): the table is never gathered for the loss.

What is the same as one process (same seed, same --batch-size, the global batch):

- The batch: every rank builds the global batch of the step exactly as one process does
  (`train.make_batch`, BERT4Rec's masks included) and keeps its contiguous block of rows
  (`local_rows`; `torch.tensor_split`, so any batch size >= the number of ranks works).
- The loss: rank r's loss is `world * S_r / denominator`, S_r its summed BCE and the denominator the
  one process's, from counts summed over the ranks (`bce_loss`). The mean over the ranks, whose
  gradient FSDP2 (other parameters) and CutBCE (the table, the bias) take, is then the one-process
  loss: sum_r S_r / denominator.
- The table: the embedding has R = V + 1 (+1: BERT4Rec's [MASK]) rows, the loss scores catalog item
  v on row v + 1; a class weight 0 on row 0 (padding) and the [MASK] row removes their terms
  exactly. The bias is stored the same way, R rows, 0 on those rows (they never get a gradient).
- Evaluation: every rank ranks all users against the whole table, gathered under no_grad
  (`item_table`); rank 0's metrics are broadcast, so every rank takes the same decisions.
- Checkpoints: rank 0 writes the one-process format (`model_state`, `optimizer_state`: the model's
  own parameter names, `item_bias` `[V]`), atomically, so best.pt loads into a plain SASRec/BERT4Rec;
  ckpt.pt adds `world` and `rank_rng` (every rank's RNG states), and --resume needs as many ranks.

The loss never gathers the table; evaluation, the parameter statistics and checkpoints do (the whole
`[R, D]` table on every rank while it evaluates, on rank 0's CPU for a checkpoint).

What is not: dropout masks. Rank 0 continues the one-process RNG stream, rank r > 0 is seeded
[seed, r], and each draws masks for its own rows only; with --dropout 0 a run equals one process up to
float summation order (about 1e-7 relative), with dropout it is the same training statistically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torch_cutbce import Focal, cut_bce_with_logits

# StateDictOptions of every checkpoint read and write: whole tensors, on the CPU of rank 0.
_SAVE = dict(full_state_dict=True, cpu_offload=True)
_LOAD = dict(full_state_dict=True, broadcast_from_rank0=True)


@dataclass
class Ranks:
    """The process group of an --fsdp run."""

    rank: int
    world: int
    mesh: object  # a 1-D DeviceMesh over every rank
    device: torch.device
    names: tuple = ()  # the model's parameter names before sharding (the checkpoints' order)

    @property
    def main(self) -> bool:
        return self.rank == 0


def start() -> Ranks:
    """Initialises the process group from torchrun's environment (unless it is already) and a 1-D
    device mesh over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    return Ranks(dist.get_rank(), world, init_device_mesh(device.type, (world,)), device)


def stop(barrier: bool = True) -> None:
    """Ends the process group, if any (after a barrier: no rank tears it down while another still
    talks to it)."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def is_main() -> bool:
    """Rank 0, or a process without a process group: the one that prints and writes files."""
    return not dist.is_initialized() or dist.get_rank() == 0


def is_sharded(model) -> bool:
    return getattr(model, "fsdp_ranks", None) is not None


def whole(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (a collective: every rank must call it), or `x` itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def table_rows(model) -> int:
    """R: the rows of the tied item embedding (padding, the V items, BERT4Rec's [MASK])."""
    return model.cfg.num_items + 1 + model.extra_tokens


def shard_model(model, ranks: Ranks) -> None:
    """Moves the item bias into the item embedding module, then fully_shard(item_emb), fully_shard(model).

    The loss needs the bias as a DTensor with the table's placements: FSDP2 shards every parameter of
    a module along dim 0 alike, so a bias of the table's R rows (item v on row v + 1, 0 elsewhere)
    registered on the embedding module gets the table's layout.
    """
    from torch.distributed.fsdp import fully_shard

    ranks.names = tuple(name for name, _ in model.named_parameters())
    model.fsdp_ranks = ranks
    if model.item_bias is not None:
        bias = model.item_bias.detach()
        del model.item_bias  # from here on the bias is model.item_emb.bias (see `item_table`)
        padded = torch.zeros(table_rows(model), dtype=bias.dtype, device=bias.device)
        padded[1: model.cfg.num_items + 1] = bias
        model.item_emb.register_parameter("bias", nn.Parameter(padded))
    fully_shard(model.item_emb, mesh=ranks.mesh)
    fully_shard(model, mesh=ranks.mesh)
    if ranks.rank:  # dropout: rank 0 continues the one-process stream, the others get their own
        torch.manual_seed(int(np.random.SeedSequence([torch.initial_seed(), ranks.rank]).generate_state(1)[0]))


def local_rows(batch: dict[str, torch.Tensor], ranks: Ranks) -> dict[str, torch.Tensor]:
    """This rank's contiguous block of the global batch's rows."""
    return {name: torch.tensor_split(t, ranks.world)[ranks.rank] for name, t in batch.items()}


def bce_loss(hidden, model, targets, weight, pos_weight, cfg, ranks: Ranks) -> torch.Tensor:
    """This rank's share of the one-process loss (examples/losses.py bce_loss), from the sharded table.

    One process divides the summed BCE S of the global batch by its real positions (positions), by
    them x V (items) or by B T V (mean). Dividing each rank's S_r by its own count would weigh the
    ranks' positions unequally whenever they hold different numbers of real positions, so the counts
    are summed over the ranks first (one all_reduce of 2 numbers) and rank r returns
    `world * S_r / global_denominator`: the mean over the ranks, which the gradients of every
    parameter are of, is `sum_r S_r / global_denominator`, the one-process loss.
    """
    num_items = model.cfg.num_items
    counts = torch.stack([weight.sum(), torch.tensor(float(weight.numel()), device=weight.device)]).double()
    dist.all_reduce(counts)
    real, size = counts[0].clamp(min=1), counts[1]
    denominator = {"positions": real, "items": real * num_items, "mean": size * num_items}[cfg.normalization]
    rows = table_rows(model)
    class_weight = torch.zeros(rows, device=hidden.device)
    class_weight[1: num_items + 1] = 1  # no terms for the padding row and [MASK]
    if pos_weight is not None:
        pos_weight = torch.nn.functional.pad(pos_weight, (1, rows - 1 - num_items), value=1.0)
    focal = Focal(cfg.focal_gamma, cfg.focal_alpha, cfg.focal_balancing) if cfg.loss == "focal" else None
    # After the forward FSDP2 has resharded item_emb: weight and bias are Shard(0) DTensors (with
    # reshard_after_forward=False they would be the gathered tensors, which CutBCE takes as well).
    total = cut_bce_with_logits(hidden, model.item_emb.weight, torch.where(targets >= 0, targets + 1, -1),
                                getattr(model.item_emb, "bias", None), weight=weight, class_weight=class_weight,
                                pos_weight=pos_weight, reduction="sum", block_v=cfg.block_v or None, focal=focal)
    return total * (ranks.world / denominator).to(total.dtype)


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar over the ranks (the one-process loss, from the ranks' `bce_loss`)."""
    value = value.detach().double().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


@torch.no_grad()
def item_table(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole `[V, D]` item vectors and `[V]` bias (or None), gathered: every rank must call it."""
    items = slice(1, model.cfg.num_items + 1)
    weight = whole(model.item_emb.weight)[items]
    bias = getattr(model.item_emb, "bias", None)
    return weight.detach(), None if bias is None else whole(bias)[items].detach()


def query(model):
    """`evaluate.model_query` for a sharded model: the table gathered once per evaluation."""
    weight, bias = item_table(model)

    def run(context):
        return model.user_state(context), weight, bias
    return run


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- checkpoints
# Sharded model -> one-process format: the model's own names, item_emb.bias [R] as item_bias [V].

SHARDED_NAMES = {"item_bias": "item_emb.bias"}  # one-process name -> sharded name, where they differ
PLAIN_NAMES = {v: k for k, v in SHARDED_NAMES.items()}


def _to_plain(name: str, tensor: torch.Tensor, model) -> torch.Tensor:
    """A sharded parameter's (or its optimizer state's) whole tensor in the one-process shape."""
    return tensor[1: model.cfg.num_items + 1] if name == "item_emb.bias" and tensor.dim() else tensor


def _to_sharded(name: str, tensor: torch.Tensor, model) -> torch.Tensor:
    """`_to_plain`'s inverse (the padding and [MASK] rows of the bias and its state are 0 throughout)."""
    if name != "item_bias" or not tensor.dim():
        return tensor
    padded = tensor.new_zeros(table_rows(model))
    padded[1: model.cfg.num_items + 1] = tensor
    return padded


def model_state(model, ranks: Ranks) -> dict:
    """The model's state dict in the one-process format on rank 0 ({} elsewhere); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(**_SAVE))
    if not ranks.main:
        return {}
    return {name: _to_plain(SHARDED_NAMES.get(name, name), state[SHARDED_NAMES.get(name, name)], model)
            for name in ranks.names}


def load_model_state(model, state: dict, ranks: Ranks) -> None:
    """Loads rank 0's one-process `state` (the other ranks' argument is ignored) into the sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {SHARDED_NAMES.get(n, n): _to_sharded(n, t, model) for n, t in state.items()} if ranks.main else {}
    set_model_state_dict(model, state, options=StateDictOptions(**_LOAD))


def optimizer_state(model, optimizer, ranks: Ranks) -> dict:
    """The optimizer's state dict in the one-process format (parameters by their index in
    `ranks.names`, as `optimizer.state_dict()` numbers them) on rank 0 ({} elsewhere); every rank
    calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(**_SAVE))
    if not ranks.main:
        return {}
    index = {SHARDED_NAMES.get(name, name): i for i, name in enumerate(ranks.names)}
    per_param = {index[name]: {k: _to_plain(name, v, model) for k, v in values.items()}
                 for name, values in state["state"].items()}
    groups = [dict(group, params=sorted(index[name] for name in group["params"])) for group in state["param_groups"]]
    return dict(state=dict(sorted(per_param.items())), param_groups=groups)


def load_optimizer_state(model, optimizer, state: dict, ranks: Ranks) -> None:
    """Loads rank 0's one-process optimizer `state` (the other ranks' argument is ignored)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    full = {}
    if ranks.main:
        plain = ranks.names
        sharded = [SHARDED_NAMES.get(name, name) for name in plain]
        full = dict(state={sharded[i]: {k: _to_sharded(plain[i], v, model) for k, v in values.items()}
                           for i, values in state["state"].items()},
                    param_groups=[dict(group, params=[sharded[i] for i in group["params"]])
                                  for group in state["param_groups"]])
    tuples = [{k for k, v in group.items() if isinstance(v, tuple)} for group in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(**_LOAD))
    for group, names in zip(optimizer.param_groups, tuples):  # it hands Adam's betas back as a list
        group.update({k: tuple(group[k]) for k in names})
