"""Vocabulary-parallel CutBCE over torch.distributed: each rank holds the item rows `[start, stop)`.

`cut_bce_with_logits(..., vocab_parallel=VocabParallelOptions(...))`, for CPU/CUDA tensors and
any torch.distributed backend (gloo, NCCL), as Apple CCE's `VocabParallelOptions`. A layout over an
engine, not an engine: `engines.select` wraps the engine chosen for the tensors (one that
`takes_vocab_parallel`: native, triton) with `engines.over_ranks`, which calls the functions here. Each
rank runs that engine on its slice (`options.offset` / `id_limit` set by the entry), keeping the
ids in its slice as positives and the others as padding, and the rows are summed over the ranks:
Megatron's conjugate regions, "copy" where the hidden states enter (all_reduce of `d_hidden` in
the backward), "reduce" where the rows leave (one all_reduce of rows and counts in the forward).
Every rank gets the same loss, metrics and `d_hidden`, and gradients for its own rows only.
Usage and caveats: docs/distributed.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_cutbce.route import VocabParallelOptions  # noqa: F401  (its home once: re-exported here)


class CopyToRanks(torch.autograd.Function):
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


class SumOverRanks(torch.autograd.Function):
    """all_reduce forward; identity backward (every rank holds the same upstream gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _check_slice(item_weight, vocab_parallel: VocabParallelOptions) -> None:
    if item_weight.shape[0] != vocab_parallel.stop - vocab_parallel.start:
        raise ValueError(f"item_weight holds {item_weight.shape[0]} rows but vocab_parallel gives "
                         f"[{vocab_parallel.start}, {vocab_parallel.stop})")


def vocab_parallel_rows(engine, flat, route):
    """Rows `[N]` and counts `[4 or 0, N]` over the whole catalog, this rank holding `route.vocab_parallel`'s slice.

    `engine.rows` on this rank's slice: `flat` is the entry's `(hidden [N, D], item_weight [V_rank, D],
    targets [N, L], bias, class_weight, pos_weight)` and `route.options` has `offset` / `id_limit`
    (the slice's start and the global V); the same rows, counts and `d_hidden` on every rank
    (module docstring).
    """
    hidden, item_weight = flat[:2]
    vocab_parallel = route.vocab_parallel
    _check_slice(item_weight, vocab_parallel)
    hidden = CopyToRanks.apply(hidden, vocab_parallel.group)
    # Global ids: the engine keeps those in [start, stop) as local ids, the others are another rank's;
    # ids >= the global V raise (CPU) or assert (CUDA) inside it, as on one device.
    rows, counts = engine.rows((hidden, *flat[1:]), route)
    return sum_rows_over_ranks(rows, counts, vocab_parallel.group)


def sum_rows_over_ranks(rows, counts, group):
    """`(rows [N], counts [C, N])` summed over the ranks of `group` in one all_reduce (counts are
    integers below 2**24, exact in float32 and float64); the rows' gradient passes through."""
    stacked = SumOverRanks.apply(torch.cat([rows[None], counts.to(rows.dtype)]), group)
    return stacked[0], stacked[1:].detach().float()


def vocab_parallel_loss(engine, flat, weight, divisor, route):
    """'sum' / 'mean' in one pass: `(loss [], counts [4 or 0])`, weighted and summed over positions.

    Each rank's `engine.weighted_sum` (native: `torch_cutbce::loss`) computes its items' share of
    the loss, counts and gradients in the forward (`divisor` is the global one); one all_reduce sums
    the shares. hidden and weight enter through `CopyToRanks`, so their gradients (each rank's
    partial) are summed over the ranks.
    """
    hidden, item_weight = flat[:2]
    vocab_parallel = route.vocab_parallel
    _check_slice(item_weight, vocab_parallel)
    hidden = CopyToRanks.apply(hidden, vocab_parallel.group)
    if weight is not None and weight.requires_grad:
        weight = CopyToRanks.apply(weight, vocab_parallel.group)
    loss, counts = engine.weighted_sum((hidden, *flat[1:]), weight, divisor, route)
    stacked = SumOverRanks.apply(torch.cat([loss[None], counts.to(loss.dtype)]), vocab_parallel.group)
    return stacked[0], stacked[1:].detach().float()
