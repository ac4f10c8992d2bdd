"""Padded positions before / after (issue 14): a batch of short sequences, most positions padding.

    .venv/bin/python benchmarks/padded_positions.py       # batch 128 x 50, 88% padding, V 23,715, D 50

The shape of a popular PyTorch SASRec on Amazon Video Games, the next item as the target, 'sum'
with `weight=mask` as such code writes it. Interleaved rounds, medians of forward + backward: every
position computed (before), the shipped entry that drops padded positions, and the real rows
selected by hand, the lower bound (benchmarks/results/cpu_speed.md, 'Padded positions, the first call, threads').
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

from ablation import interleave, report


def make_batch(batch, length, num_items, hidden_size, padded_fraction, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = (torch.rand(batch, generator=g) * 2 * (1 - padded_fraction) * length).long().clamp(1, length)
    mask = (torch.arange(length).flip(0) < lengths.unsqueeze(-1)).float()  # left padding, as SASRec
    targets = torch.randint(0, num_items, (batch, length, 1), generator=g)
    targets[mask == 0] = -1
    hidden = torch.randn(batch, length, hidden_size, generator=g)
    items = torch.randn(num_items, hidden_size, generator=g) * 0.1
    return hidden, items, targets, mask


def variants(hidden, items, targets, mask):
    from torch_cutbce import cut_bce_with_logits, functional

    real = mask.reshape(-1) > 0

    def step(drop=True, rows_by_hand=False):
        h, e = hidden.clone().requires_grad_(), items.clone().requires_grad_()
        if rows_by_hand:
            loss = cut_bce_with_logits(h.reshape(-1, h.shape[-1])[real], e, targets.reshape(-1, 1)[real],
                                       reduction="sum")
        elif drop:
            loss = cut_bce_with_logits(h, e, targets, weight=mask, reduction="sum")
        else:
            with mock.patch.object(functional, "_padded_positions_dropped", lambda *a: None):
                loss = cut_bce_with_logits(h, e, targets, weight=mask, reduction="sum")
        loss.backward()
        return loss

    losses = [float(step(drop=d, rows_by_hand=r)) for d, r in ((False, False), (True, False), (True, True))]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses  # the same loss three ways
    return {
        "all positions (before)": lambda: step(drop=False),
        "padding dropped (shipped)": lambda: step(drop=True),
        "real rows only (by hand)": lambda: step(rows_by_hand=True),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=50)
    parser.add_argument("--num-items", type=int, default=23_715)
    parser.add_argument("--hidden-size", type=int, default=50)
    parser.add_argument("--padded-fraction", type=float, default=0.88)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import torch

    hidden, items, targets, mask = make_batch(args.batch, args.length, args.num_items, args.hidden_size,
                                              args.padded_fraction)
    medians = interleave(variants(hidden, items, targets, mask), args.rounds)  # the first: all positions
    report(f"torch threads {torch.get_num_threads()}; batch {args.batch} x {args.length}, "
           f"{1 - float(mask.mean()):.0%} padding, V {args.num_items}, D {args.hidden_size}, L 1, 'sum', fwd+bwd",
           medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
