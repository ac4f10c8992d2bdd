"""DTensor inputs: the torch.distributed layout around any engine (FSDP2, DTensor, DDP; gloo, NCCL, tpu_dist).

Distributed is a layout, not an engine: every engine computes rows over a slice of the catalog
(ids outside it are padding there), and this module decides which positions meet which rows and
which collectives join them. The table is never gathered; every collective is O(N D) bytes.

The item table (`item_weight`, with `bias`, `class_weight`, `pos_weight` beside it) is one of:

    sharded     `Shard(0)` over one mesh dimension, `Replicate()` over the others (FSDP2; HSDP on a
                2-D mesh), even or uneven (torch.chunk's rows per rank, as FSDP2 and
                `distribute_tensor` lay them out)
    replicated  `Replicate()` over every mesh dimension
    plain       a torch.Tensor: the whole table on every rank (DDP's; nothing to do here)

and the positions (`hidden`, `targets`, `weight`) are:

    local       plain tensors, or DTensors `Shard(0)` over every mesh dimension: each rank its own
                batch (data parallel)
    replicated  DTensors `Replicate()` over every mesh dimension: one batch seen by every rank
                (tensor parallel, as `vocab_parallel=`)

Gradient semantics are data-parallel training's: with local positions, each rank's loss is its own
positions' loss with the meaning it has on one device, `d_hidden` is that loss's gradient, and the
table's gradient is the gradient of the mean of the ranks' losses (what DDP and FSDP2 give with the
table gathered), so k optimizer steps equal one process training on the mean loss. With
replicated positions every rank holds the one loss and every rank's upstream gradient must be the
same (Megatron's rule): the table's gradient is that loss's.

Collectives (P ranks in the table's shard group, n_max the most positions a rank has):

    local x sharded     forward: all_gather of each rank's sizes and checks (P x 6 ints, one per
                        mesh dimension), hidden (P n_max D) and targets (P n_max L);
                        reduce_scatter of rows and counts (P n_max x 5).
                        backward: all_gather of the rows' gradient (P n_max), reduce_scatter of
                        d_hidden (P n_max D, in float32); HSDP: all_reduce of the table's
                        gradient shard over the replicas (V / P x D, what FSDP2's HSDP does too)
    local x replicated  backward: all_reduce of the table's gradient (V D, what DDP does)
    replicated x sharded
                        forward: all_reduce of rows and counts (n x 5); backward: all_reduce of
                        d_hidden (n D)

Every rank takes part in every collective, whatever it holds: a rank without rows (V < P, or the
last ranks of an uneven split) scores nothing, but its rows still depend on hidden and on its empty
table shard, so its backward runs the same collectives and its table (and bias) get gradients of
local shape `(0, D)` (`(0,)`) with the table's placements, ready for the next collective over
gradients (`clip_grad_norm_`, an optimizer). Where positions are gathered (local x sharded), a bad
batch on one rank would leave the others waiting in the all_gather: each rank's argument checks and
sizes are gathered first (`check_arguments_on_every_rank`), and every rank raises.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_cutbce import arguments
from torch_cutbce.arguments import check_ids_below_vocab
from torch_cutbce.positives import accumulation_dtype
from torch_cutbce.vocab_parallel import CopyToRanks, sum_rows_over_ranks

# At import (about 60 ms): a cached lazy import would be a call dynamo warns about under torch.compile.
if dist.is_available():
    from torch.distributed.tensor import DTensor
else:  # torch built without torch.distributed: no DTensor can reach the loss
    DTensor = None


def is_dtensor(x) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def _describe(x) -> str:
    return f"a DTensor with placements {tuple(x.placements)} on a mesh of shape {tuple(x.device_mesh.shape)}"


def _placement_kinds(x):
    """('shard', 'replicate') names for each mesh dimension of `x`, or None for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    kinds = []
    for p in x.placements:
        if isinstance(p, Replicate):
            kinds.append("replicate")
        elif isinstance(p, Shard) and p.dim == 0:
            kinds.append("shard")
        else:
            return None
    return kinds


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one call's tensors lie over the ranks (module docstring).

    Attributes:
      positions: 'local' or 'replicated'.
      table: 'sharded', 'replicated' or 'plain'.
      mesh: the DeviceMesh of the DTensor arguments.
      shard_dim: the mesh dimension the table is sharded over (None unless 'sharded').
      start, stop: this rank's global item ids `[start, stop)`.
      num_items: the global V.
      batch_max: (n_max, L_max), the most positions and target slots a rank has, where positions are
        gathered (set by `check_arguments_on_every_rank`); None elsewhere.
    """

    positions: str
    table: str
    mesh: object
    shard_dim: int | None
    start: int
    stop: int
    num_items: int
    batch_max: tuple[int, int] | None = None

    @property
    def gathers_positions(self) -> bool:
        """Whether the forward all-gathers the ranks' positions (local positions, a sharded table)."""
        return self.positions == "local" and self.table == "sharded"

    @property
    def shard_group(self):
        return self.mesh.get_group(self.shard_dim)

    def table_grad_groups(self):
        """The mesh groups the table's gradient is summed over (local positions): every dimension
        the table is replicated over."""
        return [self.mesh.get_group(d) for d in range(self.mesh.ndim) if d != self.shard_dim]


def _check_table(item_weight, others: dict, mesh):
    """The table's kind and shard dimension; `others` (bias, class_weight, pos_weight) must lie as
    it does (class_weight and pos_weight may also be plain `[V]` tensors, sliced here)."""
    if not is_dtensor(item_weight):
        for name, x in others.items():
            if is_dtensor(x):
                raise ValueError(f"{name} is {_describe(x)} but item_weight is a plain tensor: give the table's "
                                 f"arguments one layout (all DTensors with item_weight's placements, or none)")
        return "plain", None
    kinds = _placement_kinds(item_weight)
    shards = [d for d, k in enumerate(kinds or ()) if k == "shard"]
    if kinds is None or len(shards) > 1:
        raise ValueError(
            f"item_weight is {_describe(item_weight)}; CutBCE takes an item table sharded Shard(0) over one "
            f"mesh dimension and Replicate() over the others (FSDP2, HSDP), or Replicate() everywhere "
            f"(Shard(1), Partial and a table sharded over two mesh dimensions are not supported)")
    if item_weight.device_mesh != mesh:
        raise ValueError(f"item_weight is {_describe(item_weight)} but the positions lie on another mesh "
                         f"{tuple(mesh.shape)}: use one DeviceMesh for every DTensor argument")
    for name, x in others.items():
        if x is None:
            continue
        if is_dtensor(x):
            if x.device_mesh != item_weight.device_mesh or tuple(x.placements) != tuple(item_weight.placements):
                raise ValueError(f"{name} is {_describe(x)} but item_weight is {_describe(item_weight)}: "
                                 f"{name} must have item_weight's mesh and placements")
        elif name == "bias":
            raise ValueError(f"bias is a plain tensor but item_weight is {_describe(item_weight)}: make bias a "
                             f"DTensor with item_weight's placements (shard it with the table), so its gradient "
                             f"lies as the table's does")
    return ("sharded", shards[0]) if shards else ("replicated", None)


def _check_positions(hidden, targets, weight):
    """The positions' kind and mesh (None for plain tensors)."""
    tensors = dict(hidden=hidden, targets=targets, weight=weight)
    dtensors = {k: x for k, x in tensors.items() if is_dtensor(x)}
    if not dtensors:
        return "local", None
    first, x0 = next(iter(dtensors.items()))
    for name, x in tensors.items():
        if x is not None and not is_dtensor(x):
            raise ValueError(f"{name} is a plain tensor but {first} is {_describe(x0)}: hidden, targets and "
                             f"weight must all be DTensors with one layout, or all plain tensors")
        if x is not None and (x.device_mesh != x0.device_mesh or tuple(x.placements) != tuple(x0.placements)):
            raise ValueError(f"{name} is {_describe(x)} but {first} is {_describe(x0)}: hidden, targets and "
                             f"weight must share one mesh and placements")
    kinds = _placement_kinds(x0)
    if kinds is not None and all(k == "shard" for k in kinds):
        return "local", x0.device_mesh
    if kinds is not None and all(k == "replicate" for k in kinds):
        return "replicated", x0.device_mesh
    raise ValueError(
        f"{first} is {_describe(x0)}; CutBCE takes positions Shard(0) over every mesh dimension (each rank its "
        f"own batch) or Replicate() over every one (one batch on every rank)")


def _table_slice(item_weight, shard_dim: int | None) -> tuple[int, int]:
    """This rank's global ids `[start, stop)`: torch.chunk's rows per rank, checked against the shard."""
    num_items = item_weight.shape[0]
    if shard_dim is None:
        return 0, num_items
    mesh = item_weight.device_mesh
    ranks = mesh.size(shard_dim)
    rank = mesh.get_local_rank(shard_dim)
    chunk = -(-num_items // ranks)
    start, stop = min(rank * chunk, num_items), min((rank + 1) * chunk, num_items)
    rows = item_weight.to_local().shape[0]
    if rows != stop - start:
        raise ValueError(
            f"item_weight's local shard on mesh rank {rank} has {rows} rows, but Shard(0) of V={num_items} over "
            f"{ranks} ranks gives it {stop - start} (torch.chunk's layout, as FSDP2 and distribute_tensor make it)")
    return start, stop


def layout_of(hidden, item_weight, targets, bias, weight, class_weight, pos_weight) -> Layout | None:
    """The layout of a call, or None when no argument is a DTensor; raises ValueError for a placement
    CutBCE does not take, naming the argument, its placement and what is supported."""
    tensors = (hidden, item_weight, targets, bias, weight, class_weight, pos_weight)
    if not any(is_dtensor(x) for x in tensors):
        return None
    positions, mesh = _check_positions(hidden, targets, weight)
    if mesh is None:
        mesh = item_weight.device_mesh if is_dtensor(item_weight) else None
    table, shard_dim = _check_table(item_weight, dict(bias=bias, class_weight=class_weight, pos_weight=pos_weight),
                                    mesh)
    start, stop = _table_slice(item_weight, shard_dim)
    return Layout(positions, table, mesh, shard_dim, start, stop, item_weight.shape[0])


# What each rank tells the others before positions are gathered: one int64 row per rank.
_RANK, _REFUSED, _POSITIONS, _SLOTS, _HIDDEN_SIZE, _LARGEST_ID = range(6)


def check_arguments_on_every_rank(layout: Layout | None, hidden, item_weight, targets, bias, weight, class_weight,
                                  pos_weight, *, reduction, block_v):
    """`arguments.check` on this rank's arguments, a verdict every rank shares where positions are
    gathered: `(its ProblemSize, the layout with batch_max set)`.

    Elsewhere this is `arguments.check`. Where positions are gathered (`Layout.gathers_positions`)
    a rank that raised alone would leave the others waiting in the forward's all_gather, so each
    rank runs the checks, then one all_gather per mesh dimension tells every rank each rank's
    verdict, sizes and largest id, and if any rank's batch is bad every rank raises: the same
    ValueError, naming the rank, for a hidden size other than item_weight's D and for an id >= V
    (read on CPU and CUDA, where `check_ids_below_vocab` reads them too; elsewhere ignored like
    padding); the refusing rank's own error, and on the others one naming that rank, for anything
    else. The gathered ints are read on the host, as the largest sizes always were (the collectives'
    shapes depend on them). On `meta` tensors (shape tracing) there are no values to read: every
    rank is taken to have this rank's sizes.
    """
    def check():
        return arguments.check(hidden, item_weight, targets, bias, weight, class_weight, pos_weight,
                               reduction=reduction, block_v=block_v)

    if layout is None or not layout.gathers_positions:
        return check(), layout
    try:
        size, refused = check(), None
    except (TypeError, ValueError) as error:
        size, refused = None, error
    hidden, targets, device = _local(hidden), _local(targets), item_weight.device
    row = _rank_row(refused, hidden, targets)
    if device.type == "meta":
        if refused is not None:
            raise refused
        return size, dataclasses.replace(layout, batch_max=(row[_POSITIONS], row[_SLOTS]))
    facts = torch.tensor([row], dtype=torch.int64, device=device)
    if refused is None and targets.numel() > 0 and device.type in ("cpu", "cuda"):
        # On the device: read with the gathered rows, no sync of its own.
        facts[0, _LARGEST_ID] = targets.max().to(device=device, dtype=torch.int64)
    for dim in range(layout.mesh.ndim):  # every rank of the mesh, HSDP's replicas too
        facts = _gather_no_grad(facts, layout.mesh.get_group(dim))
    gathered = facts.tolist()
    _raise_for_any_rank(gathered, refused, tuple(item_weight.shape))
    batch_max = (max(f[_POSITIONS] for f in gathered), max(f[_SLOTS] for f in gathered))
    return size, dataclasses.replace(layout, batch_max=batch_max)


def _rank_row(refused, hidden, targets) -> list[int]:
    """This rank's row of `check_arguments_on_every_rank` (the `_RANK`... columns), the largest id
    left -1; sizes read from whatever was passed (refused arguments too)."""
    shape = lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else ()  # noqa: E731
    hidden_shape, targets_shape = shape(hidden), shape(targets)
    return [dist.get_rank(), int(refused is not None), math.prod(hidden_shape[:-1]),
            targets_shape[-1] if targets_shape else 0, hidden_shape[-1] if hidden_shape else -1, -1]


def _raise_for_any_rank(gathered: list, refused, table_shape: tuple[int, ...]) -> None:
    """Raise on every rank if any rank's row says its batch is bad (`check_arguments_on_every_rank`)."""
    num_items, hidden_size = table_shape[0], table_shape[-1]  # a table not [V, D] is every rank's refusal
    stop = "every rank stops here: the ranks' positions are gathered, so none may go on alone"
    for f in gathered:
        if len(table_shape) == 2 and f[_HIDDEN_SIZE] >= 0 and f[_HIDDEN_SIZE] != hidden_size:
            raise ValueError(f"hidden on rank {f[_RANK]} has hidden size D={f[_HIDDEN_SIZE]}, but item_weight is "
                             f"{list(table_shape)} (every rank's hidden must be [*S, {hidden_size}]); {stop}") from refused
    if refused is not None:
        raise refused
    for f in gathered:
        if f[_REFUSED]:
            raise ValueError(f"rank {f[_RANK]} refused its arguments to the loss (its own error says why); {stop}")
    for f in gathered:
        if f[_LARGEST_ID] >= num_items:
            raise ValueError(f"targets on rank {f[_RANK]} holds item id {f[_LARGEST_ID]}, but item_weight has only "
                             f"V={num_items} items (ids must be < V); {stop}")


def _local(x):
    """A DTensor's local part (differentiable: its gradient comes back as a DTensor with its
    placements); a plain tensor or None as it is."""
    return x.to_local() if is_dtensor(x) else x


def localize(layout: Layout, hidden, item_weight, targets, bias, weight, class_weight, pos_weight):
    """The arguments as this rank's plain tensors, the table's wrapped for the gradient semantics."""
    table = item_weight
    hidden, targets, weight = (_local(x) for x in (hidden, targets, weight))
    item_weight, bias = (_local(x) for x in (item_weight, bias))
    class_weight, pos_weight = (_local_constant(x, layout) for x in (class_weight, pos_weight))
    if layout.positions == "local" and layout.table != "plain":
        # The mean over the data-parallel ranks (module docstring): sum over the mesh dimensions the
        # table is replicated over (its shard group's sum happens in the rows' backward), / world,
        # or / the divide factor FSDP2 was given for this table.
        groups, divisor = layout.table_grad_groups(), gradient_divide_factor(table, layout.mesh.size())
        item_weight = _TableGradMean.apply(item_weight, groups, divisor)
        if bias is not None:
            bias = _TableGradMean.apply(bias, groups, divisor)
    return hidden, item_weight, targets, bias, weight, class_weight, pos_weight


def gradient_divide_factor(param, world: int) -> float:
    """What FSDP2 divides the gradients of `param`'s module by: the factor set with
    `FSDPModule.set_gradient_divide_factor`, else the data-parallel world (FSDP2's default, and what
    a DTensor table outside FSDP2 gets).

    FSDP2 keeps the factor on the module's parameter group, which a tensor does not point to; it is
    found through the registry of FSDP2's module states (private to torch: where its layout
    differs, the default is used).
    """
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return float(world)
    for state_ref in list(_module_state_mapping.values()):
        group = getattr(state_ref(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if getattr(fsdp_param, "sharded_param", None) is param:
                factor = getattr(group, "gradient_divide_factor", None)
                return float(world) if factor is None else float(factor)
    return float(world)


def _local_constant(x, layout: Layout):
    """class_weight / pos_weight: a DTensor's local part, or a plain `[V]` tensor's slice of this
    rank's rows."""
    if x is None or is_dtensor(x):
        return _local(x)
    return x[layout.start:layout.stop] if layout.table == "sharded" else x


class _TableGradMean(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over `groups` and divides by `divisor`."""

    @staticmethod
    def forward(ctx, x, groups, divisor):
        ctx.groups, ctx.divisor = groups, divisor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Dense: a DTensor parameter's AccumulateGrad would otherwise re-lay a strided gradient
        # out as Replicate, gathering it.
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, group=group)
        return grad.div_(ctx.divisor), None, None


class _GatherPositions(torch.autograd.Function):
    """all_gather along dim 0 over `group` (`[n_max, ...]` -> `[P n_max, ...]`); the backward
    reduce-scatters the gradient in float32 (each rank's share summed over the ranks' partials)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_no_grad(x, group)

    @staticmethod
    def backward(ctx, grad):
        acc = accumulation_dtype(grad.dtype)
        grad = grad.to(acc).contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class _ScatterRows(torch.autograd.Function):
    """One reduce_scatter along the positions over `group` of the rows `[P n_max]` and counts
    `[P n_max, C]` (summed over the ranks' slices) -> `[n_max]`, `[n_max, C]`; the backward
    all-gathers the rows' gradient (the counts have none)."""

    @staticmethod
    def forward(ctx, rows, counts, group):
        ctx.group = group
        stacked = torch.cat([rows[:, None], counts.to(rows.dtype)], dim=1)
        out = stacked.new_empty((stacked.shape[0] // dist.get_world_size(group), stacked.shape[1]))
        dist.reduce_scatter_tensor(out, stacked, group=group)
        own_counts = out[:, 1:].float()
        ctx.mark_non_differentiable(own_counts)
        return out[:, 0].contiguous(), own_counts

    @staticmethod
    def backward(ctx, grad, _grad_counts):
        if grad is None:
            return None, None, None
        return _gather_no_grad(grad, ctx.group), None, None


def _gather_no_grad(x, group):
    """all_gather along dim 0 over `group`: `[n, ...]` -> `[P n, ...]`."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _slice_ids(targets, layout: Layout):
    """Global ids -> this rank's rows (`id - start`); ids of other ranks' rows become padding (-1)."""
    inside = (targets >= layout.start) & (targets < layout.stop)
    return torch.where(inside, targets - layout.start, torch.full_like(targets, -1))


def _slice_rows(engine, flat, route, layout: Layout):
    """`engine.rows` on this rank's slice of the table; a rank without rows (uneven shards) gives zero
    rows that still depend on hidden, so every rank's backward runs the same collectives."""
    hidden, item_weight, targets, bias, class_weight, pos_weight = flat
    if layout.stop > layout.start:
        return engine.rows((hidden, item_weight, _slice_ids(targets, layout), bias, class_weight, pos_weight),
                           route)
    n = hidden.shape[0]
    rows = _OnEmptyShard.apply(hidden[:, :0].sum(-1).to(accumulation_dtype(hidden.dtype)), item_weight, bias)
    return rows, rows.new_zeros((4 if route.options.compute_metrics else 0, n), dtype=torch.float32)


class _OnEmptyShard(torch.autograd.Function):
    """Identity on `rows`, which thereby depend on this rank's empty `item_weight` `(0, D)` and
    `bias` `(0,)`: their gradients are zeros of those shapes (module docstring), not None.
    class_weight and pos_weight are constants. Contiguous zeros, not the strided expand a `.sum()`
    would give: a DTensor parameter's AccumulateGrad re-lays a gradient whose strides differ from
    its own out as Replicate, an all_gather on this rank alone."""

    @staticmethod
    def forward(ctx, rows, item_weight, bias):
        ctx.shapes = [None if x is None else (x.shape, x.dtype) for x in (item_weight, bias)]
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(None if s is None else grad.new_zeros(s[0], dtype=s[1]) for s in ctx.shapes)


def layout_rows(layout: Layout, engine, flat, route):
    """`(rows [n], counts [4 or 0, n])` of this rank's positions over the whole catalog.

    `flat = (hidden [n, D], item_weight [V_local, D], targets [n, L], bias, class_weight, pos_weight)`
    as `localize` made them; `route` without an offset (ids are sliced here, for any engine).
    """
    hidden, item_weight, targets, bias, class_weight, pos_weight = flat
    if layout.table != "sharded":  # the whole table: the engine checks the ids itself
        return engine.rows(flat, route)
    group = layout.shard_group
    if layout.positions == "replicated":  # the vocab-parallel conjugates: same positions everywhere
        check_ids_below_vocab(targets, layout.num_items)  # before slicing: the global V (every rank the same ids)
        rows, counts = _slice_rows(engine, (CopyToRanks.apply(hidden, group), *flat[1:]), route, layout)
        return sum_rows_over_ranks(rows, counts, group)
    # Local positions: every rank's ids were checked against the global V before any rank gathered
    # (`check_arguments_on_every_rank`), which also found the largest sizes.
    n, slots = targets.shape
    n_max, slots_max = layout.batch_max
    hidden_all = _GatherPositions.apply(F.pad(hidden, (0, 0, 0, n_max - n)), group)
    targets_all = _gather_no_grad(F.pad(targets, (0, slots_max - slots, 0, n_max - n), value=-1), group)
    rows, counts = _slice_rows(engine, (hidden_all, item_weight, targets_all, bias, class_weight, pos_weight),
                               route, layout)
    # One reduce_scatter: counts are integers below 2**24, exact in float32 and float64.
    own_rows, own_counts = _ScatterRows.apply(rows, counts.T, group)
    return own_rows[:n], own_counts[:n].T
