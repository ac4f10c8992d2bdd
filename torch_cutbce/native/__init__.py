"""The native engine, chunked PyTorch on CPU and CUDA tensors: `ops` registers the custom ops
(`torch_cutbce::rows`, `rows_backward`, `loss`), `loop` runs the tile loop inside them, `fused_tile`
does the elementwise work on each tile of negatives (the C kernel, torch.compile's tile or the eager
twin); the positives' own terms are `torch_cutbce/positives.py`. The command that chooses this
machine's float32 CPU tile runs the entry, so it sits above it (`python -m torch_cutbce.tune_tiles`).

Importing the package imports nothing else: the registry (`torch_cutbce/engines.py`) imports `ops`.
"""
