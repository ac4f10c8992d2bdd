"""The Triton engine as torch custom ops `torch_cutbce::triton_rows`, `triton_rows_backward` and
`triton_loss` (`torch_cutbce/chunked_ops.py` over `passes.py`): one opaque node each under
`torch.compile(fullgraph=True)`, as the native engine's. Not `torch.library.triton_op`: its body is
traced, and the id check reads the targets (a raise on CPU tensors in the interpreter), which a trace
cannot; the kernels are fused already, so inductor has nothing to fuse around them.

Imports triton: the registry imports this module on first use (`engines.py`).
"""

from __future__ import annotations

from torch_cutbce.chunked_ops import ChunkedOps
from torch_cutbce.triton import passes

OPS = ChunkedOps("triton_", passes)
rows = OPS.rows
loss = OPS.loss
