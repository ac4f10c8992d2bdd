"""The chunked CUDA engine (`backend='chunked'`): library matmuls (cuBLAS on CUDA) around one fused
Triton elementwise kernel per chunk of items, which writes each row's loss and overwrites the logits
chunk with its gradient. CPU tensors run too (torch's matmuls, the kernel in Triton's interpreter).
The design and its budget: docs/triton.md, 'The chunked path'. Importing this package imports nothing.

- `ops.py`: the engine's custom ops (`torch_cutbce/chunked_ops.py` over `passes.py`);
- `passes.py`: its three calls, the chunk loop and its memory budget (`chunk_width`);
- `elementwise.py`: the Triton kernel and its launch.
"""
