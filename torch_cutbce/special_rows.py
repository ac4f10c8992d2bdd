"""Special rows: the rows of an item table that are not items (PAD, MASK, CLS, UNK, an OOV bucket).

The rule (docs/converting.md, 'Special rows'): the loss scores every row of the table it computes
over as an item. A row that is not an item must never be scored (not as a negative of every
position, not as a target), and its gradient (and its bias's) must stay exactly 0. Which rows those
are is said once, as a `SpecialRows` value, and every public path takes that one value: the entry
and the module (`special_rows=`), `full_catalog_topk`, the integrations, and
`without_special_rows`, which turns it into the loss's plain arguments. The ids stay the model's
own (rows of the whole table) everywhere.

How the rows are left out, without copying the table (`resolve`):

- the entry (`runs_of_items`): each run of item rows between the special rows is a view of the
  table (`weight[a:b]`, ids shifted down by `a`) and one engine call; the calls' sums, rows,
  metrics and gradients add up. No engine reads a special row, so whatever it holds (inf, NaN, a
  +inf bias) never reaches the loss or a gradient. Past `MAX_RUNS` runs (rows scattered through
  the table) the per-call cost would dominate, and the layout below is used;
- `without_special_rows` (plain arguments for one call): the rows at the two ends leave by a view,
  the rows inside stay with a `class_weight` of 0 (never scored, exactly 0 gradient, as long as
  they hold finite values: 0 x inf is NaN);
- a sharded table (a DTensor): slicing one gathers it, so every special row is excluded in place,
  as inside rows above (finite values needed), and the table stays as it lies.

In every layout, ids of special rows become -1 (no target); per-item tensors may be `[V]` (the items,
in table order without the special rows) or `[R]` (one per table row, the special rows' entries
ignored), any other length is refused (`check_per_item`); 'mean' divides by N x V, the real items.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import torch

from cutbce_common.shapes import ArraySpec, check_id_dtype
from torch_cutbce.distributed import is_dtensor
from torch_cutbce.positives import accumulation_dtype


class CatalogArguments(NamedTuple):
    """What `cut_bce_with_logits` takes for the catalog: `(hidden, item_weight, targets, bias,
    class_weight=class_weight, pos_weight=pos_weight)`; `num_items` is V, the real items ('mean'
    divides by N x V, and `item_weight` may hold excluded rows beside them)."""

    item_weight: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    class_weight: torch.Tensor | None
    pos_weight: torch.Tensor | None
    num_items: int | None = None


def _row(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected int rows of the table, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SpecialRows:
    """Which rows of an item table are not items.

    Give them by index (`SpecialRows([0, 1])`; a negative index counts from the end, as in Python),
    by a count at either end (`SpecialRows.first(2)`, `SpecialRows.last(1)`), or by a boolean mask
    over the table's rows (`SpecialRows.from_mask(mask)`, True = not an item); join them with `+`
    (or `|`, the same union): `SpecialRows.first(1) + SpecialRows.last(1)` is PAD first and MASK
    last. The value holds ints only, so it can be built once, before training, and passed to every
    call. Each framework's layout in one line: docs/converting.md, 'Special rows'.

    Example:
      >>> special = SpecialRows.first(1) + SpecialRows.last(1)   # RecBole: PAD 0, MASK = n_items (last)
      >>> loss = cut_bce_with_logits(hidden, emb.weight, ids, special_rows=special)
    """

    indices: tuple[int, ...] = ()
    table_rows: int | None = None  # set by from_mask: the table must have this many rows

    def __post_init__(self):
        if isinstance(self.indices, torch.Tensor):
            object.__setattr__(self, "indices", tuple(self.indices.tolist()))
        if isinstance(self.indices, (str, bytes)) or not hasattr(self.indices, "__iter__"):
            raise TypeError(f"SpecialRows: indices: expected a sequence of int rows, got {self.indices!r}")
        object.__setattr__(self, "indices", tuple(_row(i, "SpecialRows: indices") for i in self.indices))

    def __add__(self, other: SpecialRows) -> SpecialRows:
        """The rows of both (a union; a row named twice is one row)."""
        if not isinstance(other, SpecialRows):
            return NotImplemented
        sizes = {n for n in (self.table_rows, other.table_rows) if n is not None}
        if len(sizes) > 1:
            raise ValueError(f"SpecialRows: joining masks of {sorted(sizes)} rows: one table has one row count")
        extra = tuple(i for i in other.indices if i not in self.indices)
        return SpecialRows(self.indices + extra, table_rows=next(iter(sizes), None))

    __or__ = __add__

    @classmethod
    def first(cls, count: int) -> SpecialRows:
        """The first `count` rows (PAD at 0; RecTools' MASK at 1; RecBole's MASK is last: `last(1)`)."""
        count = _row(count, "SpecialRows.first: count")
        if count < 0:
            raise ValueError(f"SpecialRows.first: count: expected >= 0, got {count}")
        return cls(tuple(range(count)))

    @classmethod
    def last(cls, count: int) -> SpecialRows:
        """The last `count` rows (RePlay's padding row, an out-of-vocabulary bucket)."""
        count = _row(count, "SpecialRows.last: count")
        if count < 0:
            raise ValueError(f"SpecialRows.last: count: expected >= 0, got {count}")
        return cls(tuple(range(-count, 0)))

    @classmethod
    def from_mask(cls, mask) -> SpecialRows:
        """A boolean `[R]` mask over the table's rows, True where a row is not an item (a torch.Tensor,
        a numpy array or a list of bools)."""
        if isinstance(mask, (str, bytes)) or not (isinstance(mask, torch.Tensor) or hasattr(mask, "__len__")):
            raise TypeError(f"SpecialRows.from_mask: mask: expected a bool [R] mask (a torch.Tensor, numpy array "
                            f"or list of bools), got {type(mask).__name__} {mask!r:.60}")
        try:
            mask = torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"SpecialRows.from_mask: mask: expected a bool [R] mask, got {mask!r:.60}") from error
        if mask.dtype != torch.bool or mask.dim() != 1:
            raise TypeError(f"SpecialRows.from_mask: mask: expected a bool [R] mask, got {mask.dtype} "
                            f"{tuple(mask.shape)}")
        return cls(tuple(mask.nonzero().flatten().tolist()), table_rows=mask.numel())

    def resolve(self, rows: int) -> Plan:
        """The layout for a table of `rows` rows (checks every index against it)."""
        if self.table_rows is not None and self.table_rows != rows:
            raise ValueError(f"special_rows: the mask has {self.table_rows} entries but the table has {rows} rows")
        bad = [i for i in self.indices if not -rows <= i < rows]
        if bad:
            raise ValueError(f"special_rows: rows {bad} are outside a table of {rows} rows "
                             f"(expected -{rows} <= index < {rows})")
        special = sorted({i % rows for i in self.indices})
        if len(special) >= rows:
            raise ValueError(f"special_rows: all {rows} rows of the table are special; at least one must be an item")
        lead = 0
        while lead < len(special) and special[lead] == lead:
            lead += 1
        trail = 0
        while trail < len(special) - lead and special[-1 - trail] == rows - 1 - trail:
            trail += 1
        return Plan(rows, tuple(special), lead, trail)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A `SpecialRows` resolved for one table: `lead` rows at the start and `trail` at the end leave
    by a view, the rest of `special` (the inside ones) by a zero class weight."""

    rows: int
    special: tuple[int, ...]
    lead: int
    trail: int

    @property
    def num_items(self) -> int:
        return self.rows - len(self.special)

    def as_exclusion(self) -> Plan:
        """Every special row excluded in place (no view): for a table that must not be sliced."""
        return dataclasses.replace(self, lead=0, trail=0)

    @property
    def view(self) -> slice:
        return slice(self.lead, self.rows - self.trail)

    @property
    def inside(self) -> tuple[int, ...]:
        """The excluded rows, as rows of the view."""
        return tuple(r - self.lead for r in self.special if self.lead <= r < self.rows - self.trail)


def as_ids(targets, name: str = "targets") -> torch.Tensor:
    """Integer ids as int64, so that -1 and shifts are exact (a uint8 -1 is 255); the entry's id
    dtypes (`shapes.ID_DTYPES`): uint16/32/64 are refused as the entry refuses them (a uint64 id
    >= 2**63 would wrap to a negative id, padding)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{name}: expected integer item ids (rows of item_weight), got {type(targets).__name__}")
    check_id_dtype(ArraySpec(tuple(targets.shape), str(targets.dtype).removeprefix("torch.")))
    return targets if targets.dtype == torch.int64 else targets.to(torch.int64)


def map_ids(targets: torch.Tensor, plan: Plan, *, check: bool = True) -> torch.Tensor:
    """Table-row ids -> ids of the view: special rows and negative ids -1, the rest shifted by `lead`.
    Ids >= R are kept >= V: with `check`, raised here on CPU; else the entry raises (on every rank
    of a sharded table together, `distributed.check_arguments_on_every_rank`), or asserts on CUDA.
    A DTensor keeps its placements: the map is elementwise, so each rank maps its local ids."""
    ids = as_ids(targets)
    if is_dtensor(ids):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(_map_local_ids(ids.to_local(), plan, check), ids.device_mesh, ids.placements,
                                  shape=ids.shape, stride=ids.stride())
    return _map_local_ids(ids, plan, check)


def _map_local_ids(ids: torch.Tensor, plan: Plan, check: bool) -> torch.Tensor:
    if check and ids.device.type == "cpu" and ids.numel() and not torch.compiler.is_compiling():
        largest = int(ids.max())
        if largest >= plan.rows:
            raise ValueError(f"targets: holds id {largest}, but item_weight has {plan.rows} rows "
                             f"(ids are rows of the whole table, < {plan.rows})")
    if not plan.special:
        return ids.clamp(min=-1)
    special = torch.zeros(plan.rows, dtype=torch.bool, device=ids.device)
    special[list(plan.special)] = True
    is_special = special[ids.clamp(0, plan.rows - 1)] & (ids < plan.rows)
    return torch.where((ids < 0) | is_special, -1, ids - plan.lead)


def check_per_item(name: str, value, plan: Plan) -> None:
    """A per-item tensor (`bias`, `class_weight`, `pos_weight`) must be `[V]` or `[R]`.

    Lengths: V and R (R > V whenever a row is special) are taken and mean one thing each. Any other
    length is refused, naming both; two are named for what they likely are: V + 1 (below R, so two
    or more special rows) fits [V] of a layout with one special row fewer: the tensor has an entry
    for one special row (BERT4Rec's `output_bias` `[n_items]` holds PAD and the items, no MASK: its
    items are `output_bias[1:]`), or `special_rows` names an item; V - 1 fits a layout with one
    special row more: likely one forgotten in `special_rows`. What lengths cannot tell: with one
    special row named, a table with a second one forgotten (MASK) has the forgotten layout's V = R - 1,
    and such a tensor is taken as `[V]`; the layouts of docs/converting.md and its step 9 catch that.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor [V] = [{plan.num_items}] (the items) or "
                        f"[R] = [{plan.rows}] (the table's rows), got {type(value).__name__}")
    shape, v, r = tuple(value.shape), plan.num_items, plan.rows
    if shape in ((v,), (r,)):
        return
    message = (f"{name} must have shape [V] = [{v}], got {shape}" if v == r else
               f"{name} must have shape [V] = [{v}] (one per item, in table order without the special rows "
               f"{list(plan.special)}) or [R] = [{r}] (one per table row), got {shape}")
    if shape == (v + 1,):
        message += (f"; {v + 1} fits [V] of a layout with one special row fewer: likely {name} holds an entry "
                    f"for a special row (BERT4Rec's output_bias [n_items] holds PAD and the items but no MASK: "
                    f"give output_bias[1:], the items), or special_rows names a row that is an item")
    elif shape == (v - 1,):
        message += (f"; {v - 1} fits [V] of a layout with one special row more: likely a special row is "
                    f"forgotten in special_rows (a MASK, a CLS or an OOV row)")
    raise ValueError(message)


def _per_item(name: str, value, plan: Plan, fill: float, table_is_dtensor: bool):
    """A per-item tensor `[V]` or `[R]` -> one entry per row of the table the loss sees."""
    if value is None:
        return None
    check_per_item(name, value, plan)
    if tuple(value.shape) == (plan.rows,):
        return value if (plan.lead, plan.trail) == (0, 0) else value[plan.view]
    if not plan.inside:
        return value
    if is_dtensor(value) or table_is_dtensor:
        raise ValueError(f"{name}: a [V] tensor beside a sharded table would need a gather to leave room for "
                         f"the special rows; give it as [R] = [{plan.rows}], one per table row, with the "
                         f"table's placements")
    # Room for the excluded rows: `fill` inserted before each (O(V), never O(V D)); gradients pass
    # through. The k-th excluded row (of the view) has k excluded rows before it, so r - k items.
    pieces, start = [], 0
    for k, r in enumerate(plan.inside):
        pieces += [value[start:r - k], value.new_full((1,), fill)]
        start = r - k
    pieces.append(value[start:])
    return torch.cat(pieces)


def without_special_rows(
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    special_rows: SpecialRows,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
) -> CatalogArguments:
    """The loss's catalog arguments for a table with special rows; no copy of the table.

    Args:
      item_weight: `[R, D]`, the whole table (an `nn.Embedding`'s `weight`), special rows included;
        a DTensor sharded table stays sharded (its special rows are excluded in place).
      targets: `[*S, L]` ids of any integer dtype, rows of `item_weight`; ids of special rows and
        negative ids are no target.
      special_rows: a `SpecialRows`.
      bias: `[V]` per item (in table order without the special rows) or `[R]` per table row (the
        special rows' entries are ignored), or None.
      class_weight: as `bias`.
      pos_weight: as `bias`.

    Returns:
      `CatalogArguments(item_weight, targets, bias, class_weight, pos_weight, num_items)`: a view of
      the table without the special rows at its ends, the inside ones kept with `class_weight` 0;
      int64 targets in the view's ids; `num_items` = V. Gradients reach the table and the bias
      through them; the special rows' gradients are exactly 0. `cut_bce_with_logits(...,
      special_rows=)` calls this and divides 'mean' by N x V; a direct caller of the loss with
      these arguments should use 'sum' or 'none' when rows are excluded inside.

    Example:
      >>> c = without_special_rows(emb.weight, ids, SpecialRows.first(2), item_bias)  # RecTools: PAD 0, MASK 1
      >>> loss = cut_bce_with_logits(hidden, c.item_weight, c.targets, c.bias, class_weight=c.class_weight,
      ...                            pos_weight=c.pos_weight, weight=mask, reduction="sum") / mask.sum()
    """
    return catalog_of(item_weight, targets, special_rows, bias, class_weight=class_weight,
                      pos_weight=pos_weight)[0]


MAX_RUNS = 16  # runs of items between special rows that the entry computes one call each


def runs_of_items(item_weight, targets, special_rows, bias=None, *, class_weight=None,
                  pos_weight=None) -> list[CatalogArguments] | None:
    """The entry's catalog: one `CatalogArguments` per run of item rows between the special rows,
    each a view of the table (no special row in it), its ids (-1 outside the run; ids >= R kept, so
    the engine still refuses them), its slices of the per-item tensors, and `num_items` = V, all runs'
    items. The runs' losses (each 'mean' over N x V), rows, metrics and gradients add up to the
    loss over the items. None where the rows are excluded in place instead (`catalog_of`): a
    sharded table, or more than `MAX_RUNS` runs."""
    plan = _plan(item_weight, special_rows)
    runs, start = [], 0
    for r in (*plan.special, plan.rows):
        if r > start:
            runs.append((start, r))
        start = r + 1
    if is_dtensor(item_weight) or len(runs) > MAX_RUNS:
        return None
    rows = Plan(plan.rows, plan.special, 0, 0)  # ids stay rows of the table, special ones -1
    ids = map_ids(targets, rows)
    per_item = {}
    for name, value in (("bias", bias), ("class_weight", class_weight), ("pos_weight", pos_weight)):
        if value is not None:
            check_per_item(name, value, plan)
        per_item[name] = value
    out, first_item = [], 0
    for a, b in runs:
        run_ids = torch.where(ids >= plan.rows, ids, torch.where((ids >= a) & (ids < b), ids - a, -1))
        pieces = (None if v is None else v[a:b] if v.shape[0] == plan.rows else v[first_item:first_item + b - a]
                  for v in per_item.values())
        out.append(CatalogArguments(item_weight[a:b], run_ids, *pieces, plan.num_items))
        first_item += b - a
    return out


def _plan(item_weight, special_rows) -> Plan:
    if not isinstance(special_rows, SpecialRows):
        raise TypeError(f"special_rows: expected a torch_cutbce.SpecialRows (SpecialRows([0, 1]), "
                        f"SpecialRows.first(n), SpecialRows.last(n) or SpecialRows.from_mask(mask)), "
                        f"got {type(special_rows).__name__}")
    if not isinstance(item_weight, torch.Tensor) or item_weight.dim() != 2:
        shape = tuple(item_weight.shape) if isinstance(item_weight, torch.Tensor) else type(item_weight).__name__
        raise ValueError(f"item_weight: expected the whole table [R, D], special rows included; got {shape}")
    return special_rows.resolve(item_weight.shape[0])


def catalog_of(item_weight, targets, special_rows, bias=None, *, class_weight=None, pos_weight=None,
               metrics: bool = False) -> tuple[CatalogArguments, ExcludedRows | None]:
    """`without_special_rows`, and the rows it excluded in place where `metrics` asks (else None):
    the entry takes their logits out of the metrics, which count every column's. On a sharded table
    the ids are not read here: the entry checks them on every rank at once."""
    plan = _plan(item_weight, special_rows)
    sharded = is_dtensor(item_weight)
    if sharded:
        plan = plan.as_exclusion()
    try:
        ids = map_ids(targets, plan, check=not sharded)
    except TypeError:
        if not sharded:
            raise
        # One rank's targets of a dtype that is no id: the entry's every-rank check refuses them on
        # every rank together (raising here would leave the other ranks waiting in a collective).
        ids = targets
    bias, class_weight, pos_weight = (
        _per_item(name, value, plan, fill, sharded)
        for name, value, fill in (("bias", bias, 0.0), ("class_weight", class_weight, 0.0),
                                  ("pos_weight", pos_weight, 1.0)))
    if plan.inside:
        keep = torch.ones(plan.rows - plan.lead - plan.trail, dtype=item_weight.dtype,
                          device=_local(item_weight).device)
        keep[list(plan.inside)] = 0
        if is_dtensor(class_weight):  # each rank takes its rows of `keep` (src_data_rank=None: no collective)
            from torch.distributed.tensor import distribute_tensor

            keep = distribute_tensor(keep, class_weight.device_mesh, class_weight.placements, src_data_rank=None)
        class_weight = keep if class_weight is None else class_weight * keep.to(class_weight.dtype)
    table = item_weight if sharded else item_weight[plan.view]
    catalog = CatalogArguments(table, ids, bias, class_weight, pos_weight, plan.num_items)
    if not (metrics and plan.inside):
        return catalog, None
    if sharded:
        raise ValueError("return_metrics=True with special_rows on a sharded item_weight (a DTensor): the "
                         "special rows are excluded in place there, and their logits would need the rows "
                         "gathered to leave the counts; compute the metrics without special_rows on a "
                         "plain table, or leave return_metrics off")
    inside = list(plan.inside)
    return catalog, ExcludedRows(table[inside], None if bias is None else bias[inside])


@dataclasses.dataclass(frozen=True)
class ExcludedRows:
    """Rows left in the table with class weight 0: the loss never sees them, but the metrics count
    each column's logit as a prediction (fp if z > 0, else tn: they are never targets)."""

    item_weight: torch.Tensor  # [X, D], the excluded rows (a gather of X rows, X small)
    bias: torch.Tensor | None  # [X]

    def remove_from(self, metrics, hidden: torch.Tensor, weight: torch.Tensor | None, reduction: str):
        """`metrics` without the excluded columns' fp and tn (z in the engines' accumulation dtype)."""
        from torch_cutbce.metrics import CutBCEMetrics

        if is_dtensor(hidden):
            raise ValueError("return_metrics=True with special_rows inside the table and DTensor positions: "
                             "the excluded rows' counts would be taken per rank; leave return_metrics off here")
        with torch.no_grad():
            acc = accumulation_dtype(torch.promote_types(hidden.dtype, self.item_weight.dtype))
            h = hidden.detach().reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1]).to(acc)
            z = h @ self.item_weight.detach().to(acc).T
            if self.bias is not None:
                z = z + self.bias.detach().to(acc)
            above = (z > 0).sum(-1, dtype=torch.float32)
            below = z.shape[-1] - above
            if weight is not None:
                w = weight.detach().reshape(-1).to(torch.float32)
                above, below = above * w, below * w
            if reduction != "none":
                above, below = above.sum(), below.sum()
            else:
                above, below = above.reshape(metrics.fp.shape), below.reshape(metrics.tn.shape)
        return CutBCEMetrics(metrics.tp, metrics.fp - above, metrics.fn, metrics.tn - below)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if is_dtensor(x) else x


def without_padding_row(
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    padding_idx: int,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
) -> CatalogArguments:
    """`without_special_rows(item_weight, targets, SpecialRows([padding_idx]), bias, ...)`: one padding
    row at `padding_idx` (`nn.Embedding.padding_idx`, RePlay's `padding_value`), `0 <= padding_idx < R`.
    Kept for code written before `SpecialRows`; a table with more rows that are not items (a MASK
    row) needs `SpecialRows` itself."""
    rows = item_weight.shape[0] if isinstance(item_weight, torch.Tensor) else None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise TypeError(f"padding_idx: expected an int row of item_weight, got {padding_idx!r} "
                        f"({type(padding_idx).__name__})")
    if rows is not None and not 0 <= int(padding_idx) < rows:
        raise ValueError(f"padding_idx: expected a row of item_weight, 0 <= padding_idx < {rows} "
                         f"(item_weight is {tuple(item_weight.shape)}; negative rows are not taken), "
                         f"got {padding_idx}")
    return without_special_rows(item_weight, targets, SpecialRows([int(padding_idx)]), bias,
                                class_weight=class_weight, pos_weight=pos_weight)
