"""BERT4Rec (Sun et al., 2019): a bidirectional Transformer trained to recover masked items.

Same encoder as SASRec (`sasrec.SeqEncoder`) without the causal mask, plus one extra input row, the
[MASK] token (id V + 1), which is never a target and never scored: `item_weight` is still rows
1..V. Training replaces a random subset of the items by [MASK] and scores each masked position
against the full catalog with CutBCE. The targets are multi-label capable: with bert_labels > 1 a masked
position's positives are its own item and the bert_labels - 1 items after it. To recommend, [MASK] is
appended after the history and its hidden state is the query.
"""

from __future__ import annotations

import torch

from examples.sasrec import RecConfig, SeqEncoder


class BERT4Rec(SeqEncoder):
    causal = False
    extra_tokens = 1

    @property
    def mask_id(self) -> int:
        return self.cfg.num_items + 1

    def mask_items(self, items: torch.Tensor, mask_prob: float, generator: torch.Generator) -> torch.Tensor:
        """`[B, T]` bool: which real items to hide. Each item is hidden with `mask_prob`; the last
        real item of a row is also hidden in half of the rows, so training sees the layout the
        recommender is queried with ([MASK] after the full history)."""
        real = items != 0
        masked = (torch.rand(items.shape, generator=generator) < mask_prob) & real
        last_row = torch.rand(items.shape[0], generator=generator) < 0.5
        # Inputs are left-padded, so a row's last real item is its last column.
        masked[:, -1] |= last_row & real[:, -1]
        return masked

    @torch.no_grad()
    def user_state(self, context: torch.Tensor) -> torch.Tensor:
        """`[B, T - 1]` left-padded histories -> `[B, D]`: the hidden state of a [MASK] appended at the end."""
        mask = torch.full_like(context[:, :1], self.mask_id)
        return self(torch.cat([context, mask], dim=1))[:, -1]


__all__ = ["BERT4Rec", "RecConfig"]
