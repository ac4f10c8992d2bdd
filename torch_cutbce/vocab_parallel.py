"""Vocabulary-parallel CutBCE over torch.distributed: each rank holds the item rows `[start, stop)`.

For CPU/CUDA tensors and any backend (gloo, NCCL), in the manner of Apple CCE's
`VocabParallelOptions`. Every rank of the group holds the same hidden states and the same global
target ids, and its own slice of the item table (and of bias / class_weight / pos_weight). The loss
is a sum over items, so each rank runs the native engine (`ops.rows`) on its
slice, keeping only the ids in `[start, stop)` as its positives (`positives.positive_ids` with an
offset: each positive falls in exactly one rank's tiles), and the partial rows are summed:

    forward:  rows = all_reduce_sum(rows_local)            one all_reduce (rows and counts stacked)
    backward: d_hidden = all_reduce_sum(d_hidden_local)    one all_reduce
              d_item_weight, d_bias: local slices, no collective

That is Megatron's pair of conjugate regions: "copy" (identity forward, all_reduce backward) where the
hidden states enter, "reduce" (all_reduce forward, identity backward) where the rows leave. So every
rank ends with the same loss, metrics and full `d_hidden`, and gradients only for its own item rows.
The item-table slices are distinct parameters: do not average them with DDP over this group.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from jax_kernels.shapes import default_block_v
from torch_cutbce import ops
from torch_cutbce.functional import _check, _check_constant, reduce_rows


@dataclasses.dataclass(frozen=True)
class VocabParallelOptions:
    """This rank's share of the item table.

    Attributes:
      start, stop: the global item ids `[start, stop)` whose rows this rank holds.
      num_items: the global V (for 'mean', which divides by N x V, and the id check).
      group: the process group the table is split over (None: the default group).
    """

    start: int
    stop: int
    num_items: int
    group: object = None

    def __post_init__(self):
        if not 0 <= self.start < self.stop <= self.num_items:
            raise ValueError(f"need 0 <= start < stop <= num_items, got {self.start=}, {self.stop=}, {self.num_items=}")

    @classmethod
    def even(cls, num_items: int, group=None) -> "VocabParallelOptions":
        """Contiguous slices of ceil(V / world) rows, the last one shorter (rank r gets slice r)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        chunk = -(-num_items // world)
        if chunk * (world - 1) >= num_items:
            raise ValueError(f"V={num_items} items cannot give each of {world} ranks a non-empty slice of {chunk}")
        return cls(rank * chunk, min((rank + 1) * chunk, num_items), num_items, group)


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; the backward sums the ranks' partial gradients (each saw only its items)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """all_reduce forward; identity backward (every rank holds the same upstream gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_cut_bce(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    options: VocabParallelOptions,
    weight: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    reduction: str = "mean",
    return_metrics: bool = False,
    block_v: int | None = None,
):
    """`cut_bce_with_logits` with the item table split over the ranks of `options.group`.

    Same loss, metrics and `d_hidden` on every rank as `cut_bce_with_logits` on the whole table
    (formula: `jax_kernels/reference.py`); two all_reduce calls per step (module docstring).

    Args:
      hidden: `[*S, D]`, the same on every rank of the group.
      item_weight: `[stop - start, D]`: this rank's rows of the table.
      targets: `[*S, L]` global item ids (negative = padding), the same on every rank.
      bias, class_weight, pos_weight: this rank's slices `[stop - start]`, or None.
      options: this rank's `VocabParallelOptions`.
      weight, reduction, return_metrics, block_v: as in `cut_bce_with_logits` ('mean' divides by
        N x `options.num_items`, the global V; block_v is the local tile width).

    Returns:
      The loss, or `(loss, CutBCEMetrics)`, identical on every rank.
    """
    local_items = options.stop - options.start
    size = _check(hidden, item_weight, targets, bias, weight, class_weight, pos_weight,
                  reduction=reduction, block_v=block_v)
    if size.num_items != local_items:
        raise ValueError(f"item_weight holds {size.num_items} rows but options give [{options.start}, {options.stop})")
    _check_constant("class_weight", class_weight)
    _check_constant("pos_weight", pos_weight)
    n = size.num_positions
    block_v = min(size.block_v or default_block_v(n, local_items), local_items)
    hidden = _CopyToRanks.apply(hidden.reshape(n, size.hidden_size), options.group)
    # Global ids: the Function keeps those in [start, stop) as local ids, the others are another rank's.
    # ids >= the global V raise (CPU) or assert (CUDA) inside the op, as in cut_bce_with_logits.
    rows, counts = ops.rows(
        hidden, item_weight, bias, class_weight, pos_weight, targets.reshape(n, size.num_slots),
        block_v=block_v, compute_metrics=return_metrics, offset=options.start, id_limit=options.num_items,
    )
    # One all_reduce: counts are integers below 2**24, exact in float32 and float64.
    stacked = _SumOverRanks.apply(torch.cat([rows[None], counts.to(rows.dtype)]), options.group)
    rows, counts = stacked[0], stacked[1:].detach().float()
    return reduce_rows(rows, counts, weight, reduction, size.lead_shape, options.num_items, return_metrics)
