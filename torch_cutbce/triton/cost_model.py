"""A cost model of one training step on an H100, from published peaks: a model, not a measurement.

`python -m torch_cutbce.triton.aot --model` prints it. Nothing here has run on a GPU; docs/triton.md
says how far to trust it. The step is the 'mean' loss with the gradients of hidden, the table and
the bias (what benchmarks/cuda_loss.py times), at N 32,768, D 128, V 2**17 and 2**20.

Per pass of the Triton engine (`launch.blocks_for`'s tiles, the instruction class from the sm_90
compile, `aot.py`):
- FLOPs: `2 N V D` per logit-sized product (the logits, recomputed once per hidden block of columns,
  and the pass's gradient product);
- bytes each program loads per FLOP: what one tile step reads (the streamed operand block, the ids,
  the per-item or per-position vectors) over the FLOPs of that step (the tiles' reuse, not HBM
  traffic: most of it hits L2);
- time = the products at the instruction class's rate + the tile's other instructions (the loss
  math, the labels, the slope's conversion: counted per logit in the compiled SASS,
  `aot.instructions_per_logit`) at one per lane per clock, added (no overlap assumed: an upper
  estimate where the two would overlap).

The native engine beside it: three float32 products per tile on cuBLAS (it computes 16-bit inputs in
float32) and its `[N, block_v]` tiles through HBM. The floor: three matmuls in the input dtype at the
tensor cores' peak.
"""

from __future__ import annotations

import dataclasses

import torch

# NVIDIA H100 SXM5 (datasheet; 132 SMs at 1,980 MHz): dense tensor peaks, without sparsity.
TENSOR_PEAK = {torch.bfloat16: 989.4e12, torch.float16: 989.4e12}  # FLOP/s, warpgroup MMA
FP32_PEAK = 66.9e12  # FLOP/s of the FP32 pipe (an FMA is 2): float32 products with input_precision="ieee"
FP32_INSTRUCTIONS = FP32_PEAK / 2  # instructions/s: one per lane per clock
HBM_BYTES = 3.35e12  # bytes/s
# Assumptions, not measurements (each would be replaced by a GPU's number):
MMA_SYNC_ON_SM_90 = 0.6  # Ampere's mma.sync on Hopper, a fraction of the warpgroup MMA's rate
LABEL_SLOT_INSTRUCTIONS = 2  # per logit and label slot past the first (a compare and an or)
NATIVE_BYTES_PER_LOGIT = 20  # float32 z written and read, dz written and read by two products and the bias sum
N, D, L = 32_768, 128, 8
VOCAB = (2**17, 2**20)
DTYPES = (torch.bfloat16, torch.float32)
STEP_PASSES = ("rows_grad", "items")  # 'mean' with gradients: the one-pass row kernel, then the item kernel
# SASS instructions per logit of each step pass, plain loss, one label slot: counted in the sm_90
# bfloat16 compile by `aot.instructions_per_logit` (tests/test_triton_compile.py holds these within
# 10% of it; `--model` uses the count it makes). 16-bit inputs run the fast math (tile_math.FAST).
INSTRUCTIONS_PER_LOGIT = {"rows_grad": 28, "items": 68}


@dataclasses.dataclass(frozen=True)
class PassCost:
    name: str
    products: int  # logit-sized products (2 N V D FLOPs each)
    flops: float
    bytes_per_flop: float
    instruction_class: str
    time_s: float


def product_rate(dtype: torch.dtype, instruction_class: str) -> float:
    """FLOP/s of a pass's products on an H100 for its compiled instruction class."""
    if instruction_class == "fma":
        return FP32_PEAK
    peak = TENSOR_PEAK[dtype]
    return peak if instruction_class == "wgmma" else peak * MMA_SYNC_ON_SM_90


def pass_cost(name: str, dtype: torch.dtype, num_items: int, instruction_class: str,
              per_logit: float | None = None) -> PassCost:
    """One pass of the Triton engine at `N`, `D`, `num_items` (V); `per_logit`: its SASS instructions
    per logit for one label slot (default `INSTRUCTIONS_PER_LOGIT`)."""
    from torch_cutbce.triton import launch

    blocks = launch.blocks_for(name, dtype, 90)
    column_blocks = -(-D // blocks.block_d(D))
    products = column_blocks + 1  # the logits per column block, then the pass's gradient product
    flops = 2.0 * N * num_items * D * products
    size = torch.finfo(dtype).bits // 8
    per_tile = 2.0 * blocks.block_n * blocks.block_v * D * products / column_blocks
    if name == "items":  # an item program streams the hidden rows, their ids and row gradient
        loaded = blocks.block_n * (D * size + L * 4 + 4)
    else:  # a row program streams the table's rows, their bias, class_weight and pos_weight, and the ids
        loaded = blocks.block_v * (D * size + 3 * 4) + blocks.block_n * L * 4
    per_logit = (INSTRUCTIONS_PER_LOGIT[name] if per_logit is None else per_logit) + LABEL_SLOT_INSTRUCTIONS * (L - 1)
    time_s = flops / product_rate(dtype, instruction_class) + N * num_items * per_logit / FP32_INSTRUCTIONS
    return PassCost(name, products, flops, loaded / per_tile, instruction_class, time_s)


def floor_s(dtype: torch.dtype, num_items: int) -> float:
    """Three `[N, D] x [D, V]` matmuls in the input dtype at the H100's peak for it."""
    return 3 * 2.0 * N * num_items * D / TENSOR_PEAK.get(dtype, FP32_PEAK)


def native_s(num_items: int) -> float:
    """The native engine's step: three float32 cuBLAS products per tile, its tiles through HBM."""
    return 3 * 2.0 * N * num_items * D / FP32_PEAK + N * num_items * NATIVE_BYTES_PER_LOGIT / HBM_BYTES


def report(classes: dict, per_logit: dict | None = None) -> str:
    """The model's table; `classes`: `(pass, dtype) -> instruction class` of the shipped configurations
    on sm_90 (`aot.step_instruction_classes()`, read from their compiled code); `per_logit`: pass ->
    SASS instructions per logit (`aot.instructions_per_logit`; default `INSTRUCTIONS_PER_LOGIT`)."""
    per_logit = per_logit or INSTRUCTIONS_PER_LOGIT
    counted = ", ".join(f"{name} {per_logit[name]:.0f}" for name in STEP_PASSES)
    lines = [f"A MODEL, not a measurement: H100 SXM peaks, N {N}, D {D}, L {L}, 'mean' with every gradient.",
             f"Counted in the sm_90 SASS: instructions per logit besides the products ({counted}), issued at "
             f"one per lane per clock.",
             f"Assumed: mma.sync on sm_90 at {MMA_SYNC_ON_SM_90} of wgmma's rate, {LABEL_SLOT_INSTRUCTIONS} "
             f"instructions per logit per further label slot, native {NATIVE_BYTES_PER_LOGIT} HBM bytes per logit.",
             f"{'V':>8} {'dtype':<6}{'pass':<11}{'products':>9}{'TFLOP':>8}{'bytes/FLOP':>11}  {'class':<9}"
             f"{'est. ms':>9}{'/ floor':>9}"]
    for num_items in VOCAB:
        for dtype in DTYPES:
            floor = floor_s(dtype, num_items)
            name = "fp32" if dtype == torch.float32 else "bf16"
            costs = [pass_cost(p, dtype, num_items, classes[p, dtype], per_logit[p]) for p in STEP_PASSES]
            for c in costs:
                lines.append(f"{num_items:>8} {name:<6}{c.name:<11}{c.products:>9}{c.flops / 1e12:>8.1f}"
                             f"{c.bytes_per_flop:>11.4f}  {c.instruction_class:<9}{c.time_s * 1e3:>9.1f}"
                             f"{c.time_s / floor:>9.2f}")
            total = sum(c.time_s for c in costs)
            lines.append(f"{num_items:>8} {name:<6}{'step':<11}{sum(c.products for c in costs):>9}"
                         f"{sum(c.flops for c in costs) / 1e12:>8.1f}{'':>11}  {'':<9}{total * 1e3:>9.1f}"
                         f"{total / floor:>9.2f}")
            lines.append(f"{num_items:>8} {name:<6}{'native':<11}{3:>9}{3 * 2.0 * N * num_items * D / 1e12:>8.1f}"
                         f"{'':>11}  {'cuBLAS':<9}{native_s(num_items) * 1e3:>9.1f}"
                         f"{native_s(num_items) / floor:>9.2f}")
            lines.append(f"{num_items:>8} {name:<6}{'floor':<11}{3:>9}{3 * 2.0 * N * num_items * D / 1e12:>8.1f}"
                         f"{'':>11}  {'':<9}{floor * 1e3:>9.1f}{1.0:>9.2f}")
    return "\n".join(lines)


def faster_engine(dtype: torch.dtype, num_items: int = 2**20, classes: dict | None = None) -> str:
    """'triton' or 'native': the engine the model predicts faster for a step in `dtype`."""
    classes = classes or {(p, dtype): ("fma" if dtype == torch.float32 else "mma.sync") for p in STEP_PASSES}
    triton_s = sum(pass_cost(p, dtype, num_items, classes[p, dtype]).time_s for p in STEP_PASSES)
    return "triton" if triton_s < native_s(num_items) else "native"
