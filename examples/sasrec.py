"""SASRec (Kang & McAuley, 2018): a causal Transformer over a user's item sequence.

The model returns hidden states `[B, T, D]`, not logits: scoring against the catalog is the loss's
job (CutBCE, never building `[B, T, V]`) and the evaluator's (a tiled top-k). The item table is
tied: the input embedding's rows 1..V are also the output item vectors (`item_weight`); the score
of catalog item v is `hidden . item_weight[v] + item_bias[v]`.

Layout follows RecML's Keras SASRec (SEED_SPEC section 9): N(0, 0.02) init, learned positions,
pre-norm blocks with a GELU MLP, a final LayerNorm. Inputs are left-padded with id 0, so the last
position always holds the most recent item.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RecConfig:
    num_items: int  # V; item ids 1..V, 0 = padding
    max_len: int = 50  # T
    dim: int = 64  # D
    num_layers: int = 2
    num_heads: int = 1
    mlp_ratio: int = 1  # SASRec's point-wise feed-forward is D -> D (RecML makes it configurable)
    dropout: float = 0.2
    item_bias: bool = True  # a learned score offset per item: it absorbs popularity, the vectors model the rest

    def __post_init__(self):
        if self.num_items < 1 or self.max_len < 1 or self.num_layers < 0:
            raise ValueError(f"bad model size: {self}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} must be divisible by num_heads={self.num_heads}")


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: RecConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.attn_dropout = cfg.dropout

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """x `[B, T, D]`; allowed `[B, 1, T, T]` bool: query t may attend to key s."""
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.attn_dropout if self.training else 0.0
        )
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(B, T, D)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


def attention_mask(items: torch.Tensor, causal: bool) -> torch.Tensor:
    """`[B, 1, T, T]`: keys must be real items (not padding), and not in the future when causal.

    Every query may also see itself, so rows of padding positions are never fully masked (which
    would make softmax NaN); their outputs are ignored by the loss anyway.
    """
    T = items.shape[1]
    allowed = (items != 0)[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=items.device).tril()
    return allowed | torch.eye(T, dtype=torch.bool, device=items.device)


class SeqEncoder(nn.Module):
    """Embeddings + positions -> Transformer blocks -> LayerNorm. Shared by SASRec and BERT4Rec."""

    causal = True
    extra_tokens = 0  # rows after the V items in the input table (BERT4Rec's [MASK])

    def __init__(self, cfg: RecConfig):
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items + 1 + self.extra_tokens, cfg.dim, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.item_bias = nn.Parameter(torch.zeros(cfg.num_items)) if cfg.item_bias else None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()

    @property
    def item_weight(self) -> torch.Tensor:
        """`[V, D]` output item vectors: rows 1..V of the input table (tied). Catalog id = item id - 1."""
        return self.item_emb.weight[1 : self.cfg.num_items + 1]

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        """items `[B, T]` int64 (0 = padding, T <= max_len) -> hidden `[B, T, D]`."""
        T = items.shape[1]
        if T > self.cfg.max_len:
            raise ValueError(f"sequence length {T} > max_len={self.cfg.max_len}")
        pos = torch.arange(self.cfg.max_len - T, self.cfg.max_len, device=items.device)
        x = self.drop(self.item_emb(items) + self.pos_emb(pos))
        allowed = attention_mask(items, self.causal)
        for block in self.blocks:
            x = block(x, allowed)
        return self.ln_f(x)


class SASRec(SeqEncoder):
    """Causal: position t sees items 0..t and is trained to score the items that follow it."""

    causal = True

    @torch.no_grad()
    def user_state(self, context: torch.Tensor) -> torch.Tensor:
        """`[B, T]` left-padded histories -> `[B, D]` query vectors for the next item."""
        return self(context)[:, -1]
