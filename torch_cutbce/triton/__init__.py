"""The Triton engine (`backend='triton'`, 'auto' on CUDA for 16-bit inputs): fused CutBCE kernels for
CUDA tensors, and for CPU tensors in Triton's interpreter (`TRITON_INTERPRET=1` before triton is
imported). The design, what was verified and what was not: docs/triton.md. Importing this package
imports nothing.

- `ops.py`: the engine's custom ops (`torch_cutbce/chunked_ops.py` over `passes.py`);
- `passes.py`: its three calls (rows, their gradients, the one-pass loss) around the kernels;
- `launch.py`: launch configurations, grids, the `Loss` as kernel constants;
- `kernels.py`: `row_kernel` and `item_kernel`; `tile_math.py`: each logit's terms;
- `interpreter.py`: the interpreter's switch and a fix for it; `aot.py`: the sm_80 / sm_90 compiles,
  their PTX and instruction class; `cost_model.py`: an H100 step's cost from published peaks (a model).
"""
