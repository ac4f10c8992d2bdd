"""The Triton engine: fused CutBCE kernels for CUDA tensors (and CPU tensors in Triton's interpreter)."""
