"""The chunked engine as torch custom ops `torch_cutbce::chunked_rows`, `chunked_rows_backward` and
`chunked_loss` (`torch_cutbce/chunked_ops.py` over `passes.py`): one opaque node each under
`torch.compile(fullgraph=True)`, as the other chunked engines'.

Imports triton: the registry imports this module on first use (`engines.py`).
"""

from __future__ import annotations

from torch_cutbce.chunked import passes
from torch_cutbce.chunked_ops import ChunkedOps

OPS = ChunkedOps("chunked_", passes)
rows = OPS.rows
loss = OPS.loss
