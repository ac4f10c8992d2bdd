"""The native engine as torch custom ops `torch_cutbce::rows`, `rows_backward` and `loss`: the shared
scaffolding of `torch_cutbce/chunked_ops.py` over the tile loop (`loop.py`), which keeps the
positives' logits for the backward.

    rows(...)  -> (rows [N], counts [4, N] or [0, N])       reduction='none'; vocab-parallel ranks
    loss(...)  -> (loss [], counts [4] or [0])              'sum' / 'mean', gradients in the forward
"""

from __future__ import annotations

from torch_cutbce.chunked_ops import ChunkedOps
from torch_cutbce.native import loop

OPS = ChunkedOps("", loop)
rows = OPS.rows
loss = OPS.loss
