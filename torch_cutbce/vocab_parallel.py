"""Vocabulary-parallel CutBCE over torch.distributed: each rank holds the item rows `[start, stop)`.

For CPU/CUDA tensors and any backend (gloo, NCCL), in the manner of Apple CCE's
`VocabParallelOptions`: `cut_bce_with_logits(..., vocab_parallel=options)`. Every rank of the group holds the same hidden states and the same global
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

from torch_cutbce import ops


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


def vocab_parallel_rows(hidden, item_weight, bias, class_weight, pos_weight, targets, *, options: VocabParallelOptions,
                        block_v: int, compute_metrics: bool, focal=None):
    """Rows `[N]` and counts `[4 or 0, N]` over the whole catalog, this rank holding `options`' slice.

    Called by `cut_bce_with_logits(..., vocab_parallel=options)` with `[N, D]` / `[N, L]` inputs;
    the same rows, counts and `d_hidden` on every rank (module docstring).
    """
    local_items = options.stop - options.start
    if item_weight.shape[0] != local_items:
        raise ValueError(f"item_weight holds {item_weight.shape[0]} rows but options give "
                         f"[{options.start}, {options.stop})")
    hidden = _CopyToRanks.apply(hidden, options.group)
    # Global ids: the op keeps those in [start, stop) as local ids, the others are another rank's;
    # ids >= the global V raise (CPU) or assert (CUDA) inside the op, as on one device.
    rows, counts = ops.rows(hidden, item_weight, bias, class_weight, pos_weight, targets, block_v=block_v,
                            compute_metrics=compute_metrics, offset=options.start, id_limit=options.num_items,
                            focal=focal)
    # One all_reduce: counts are integers below 2**24, exact in float32 and float64.
    stacked = _SumOverRanks.apply(torch.cat([rows[None], counts.to(rows.dtype)]), options.group)
    return stacked[0], stacked[1:].detach().float()
