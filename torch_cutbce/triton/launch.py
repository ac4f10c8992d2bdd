"""Launching the Triton kernels: block sizes, grids, the `Loss` as constexprs, the float32 rule.

`rows_pass` runs `kernels.row_kernel` (rows, counts, `d_hidden`), `items_pass` runs
`kernels.item_kernel` (`d_item_weight`, `d_bias`); both take contiguous `hidden [N, D]` and
`item_weight [V, D]` of one dtype (float32, bfloat16 or float16), `ids [N, L]` int32 (-1 padding)
and float32 `bias`, `class_weight`, `pos_weight` `[V]` and row gradient `g [N]` (None where absent),
and return float32 results.

The block sizes are fixed per pass, dtype and target (`SHIPPED`, `blocks_for`): no autotuning, since
what is verified without a GPU (the interpreter's parity, the sm_80 / sm_90 compiles, their register
and shared-memory budgets and instruction class, tests/test_triton_compile.py) must be what runs.

float32 products use `input_precision="ieee"`: Triton's default for float32 `tl.dot` is TF32 (10
mantissa bits), which would miss the float32 bound on every row, and
`torch.backends.cuda.matmul.allow_tf32` does not reach a Triton kernel. bfloat16 / float16 tiles
multiply on tensor cores with float32 accumulation; `dz` is rounded to the input dtype for its
product, as the dense loss in that dtype rounds its logits' gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from cutbce_common.loss import Loss
from cutbce_common.shapes import MAX_CONTRACTION
from torch_cutbce.triton import interpreter, kernels, tile_math

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The widest block of gradient columns a program holds: wider hidden sizes take several programs per
# block of rows (or items), each recomputing the logits over the whole D (grid axis 1).
MAX_BLOCK_D = 128


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One kernel's fixed launch configuration.

    Attributes:
      block_n, block_v: the logit tile `[block_n, block_v]`, item-major in the item pass (powers of
        two, >= 16: `tl.dot`'s minimum).
      max_block_d: the widest `BLOCK_D` (power of two, >= 16); a program's is `min(max_block_d,
        next_power_of_2(D))`.
      num_warps, num_stages: Triton's.
      block_k: the logits' step over D, streamed through shared memory (power of two, >= 16; at most
        the program's `BLOCK_D`).
      max_registers: the registers a thread may take (`maxnreg`, the PTX's `.maxnreg`). Left to
        itself, ptxas holds some of these kernels to 128 (two blocks of 8 warps per SM) and spills
        the rest; 255 lets it take what the tile needs, spill-free (one block per SM).
    """

    block_n: int = 64
    block_v: int = 64
    max_block_d: int = MAX_BLOCK_D
    num_warps: int = 8
    num_stages: int = 2
    block_k: int = 64
    max_registers: int = 255

    def __post_init__(self):
        for name in ("block_n", "block_v", "max_block_d", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {name}={value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got num_warps={self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got num_stages={self.num_stages}")
        if not 24 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in [24, 255], got max_registers={self.max_registers}")

    def block_d(self, hidden_size: int) -> int:
        return min(self.max_block_d, max(16, triton.next_power_of_2(hidden_size)))


# The shipped configurations, one per pass, input dtype and target (no hidden size: the kernels stream
# both operands over D in `block_k` steps, so one tile serves D 64, 128 and 256). Each compiles without
# spilling for its target, for every Loss form, with every optional input and with none, specialized
# as a launch is (`aot.launch_attributes`), and puts 16-bit products on the target's fast instruction
# (`aot.py` prints the numbers; tests/test_triton_compile.py checks them). On sm_90 a 16-bit
# product's M side (the rows of the row pass, the items of the item pass, whose tiles are item-major)
# is 64, a warpgroup's MMA; narrower, Triton emits Ampere's mma.sync. The tiles are small beside
# CCE's 128 x 128: the loss's exact math lives in registers beside the tile and the gradient block
# (docs/triton.md says why, and what a tile of twice the area would take). ptxas's allocation is
# not monotone in the tile, the form or D, so each entry is the largest spill-free one a search over
# every form and D found, not a rule. (block_n, block_v, max_block_d, num_warps, num_stages, block_k)
ROW_PASSES = ("rows", "grad", "rows_grad")  # rows and counts; d_hidden alone; all three in one pass
PASSES = (*ROW_PASSES, "items")
_B = Blocks
_HALF_SM_90 = {"rows": _B(64, 32), "grad": _B(64, 32, block_k=32), "rows_grad": _B(64, 16, block_k=16),
               "items": _B(16, 64)}
_HALF_SM_80 = {"rows": _B(64, 32), "grad": _B(64, 32, block_k=32), "rows_grad": _B(64, 32, num_stages=1, block_k=32),
               "items": _B(32, 32)}
_FLOAT_SM_90 = {"rows": _B(32, 32, num_stages=1), "grad": _B(32, 32, num_warps=4, num_stages=1),
                "rows_grad": _B(32, 32, num_warps=4, num_stages=1), "items": _B(32, 16, num_stages=1)}
_FLOAT_SM_80 = {"rows": _B(32, 32, num_stages=1), "grad": _B(32, 32, num_warps=4, num_stages=1),
                "rows_grad": _B(16, 16, num_warps=4, num_stages=1), "items": _B(32, 16, num_stages=1, block_k=32)}
SHIPPED = {(torch.float32, 80): _FLOAT_SM_80, (torch.float32, 90): _FLOAT_SM_90,
           **{(dtype, capability): tiles for dtype in (torch.bfloat16, torch.float16)
              for capability, tiles in ((80, _HALF_SM_80), (90, _HALF_SM_90))}}


def row_pass(with_rows: bool, with_counts: bool, with_grad: bool) -> str:
    """The pass (`SHIPPED`'s key) of a `rows_pass` call (rows or counts alone take the forward's)."""
    if not with_grad:
        return "rows"
    return "rows_grad" if with_rows or with_counts else "grad"


def blocks_for(pass_name: str, dtype: torch.dtype, capability: int = 90) -> Blocks:
    """The shipped `Blocks` of a pass (`PASSES`) for inputs of `dtype` on a target of compute
    `capability` (80: Ampere's tiles, also for 8.6 / 8.9; 90 and above: Hopper's)."""
    return SHIPPED[dtype, 90 if capability >= 90 else 80][pass_name]


def capability(device: torch.device) -> int:
    """The compute capability the tiles are chosen for: the CUDA device's (86 for 8.6), 90 elsewhere
    (Triton's interpreter, on CPU tensors)."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision: exact float32 products for float32 (module docstring)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=16)
def _loss_numbers(loss: Loss, device: torch.device) -> torch.Tensor:
    """`tile_math.loss_numbers` as the kernels' `numbers_ptr` (one small copy per Loss and device)."""
    return torch.tensor(tile_math.loss_numbers(loss), dtype=torch.float32, device=device)


def _or_dummy(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A pointer the kernel never reads (its HAS_* flag is False)."""
    return like.new_empty((0,), dtype=torch.float32) if x is None else x


def kernel_constexprs(dtype: torch.dtype, loss: Loss, blocks: Blocks, hidden_size: int, *, has_bias: bool,
                      has_class_weight: bool, has_pos_weight: bool, outputs: dict[str, bool]) -> dict:
    """Every constexpr of one kernel launch: which optional inputs are read, which outputs are written
    (`outputs`: `row_outputs` / `item_outputs`), the `Loss`'s form, the tiles and the product precision.
    The launchers and the ahead-of-time compiles (`aot.py`) both build their flags here."""
    form = tile_math.loss_constexprs(loss)
    block_d = blocks.block_d(hidden_size)
    return dict(HAS_BIAS=has_bias, HAS_CW=has_class_weight, HAS_PW=has_pos_weight, **outputs, **form,
                BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v, BLOCK_D=block_d, BLOCK_K=min(blocks.block_k, block_d),
                CHUNK=chunk(blocks), PRECISION=precision(dtype))


def chunk(blocks: Blocks) -> int:
    """The items (row pass) or positions (item pass) one float32 product sums before its float64 carry:
    `shapes.MAX_CONTRACTION`, a multiple of both tile sides (powers of two up to it)."""
    return max(MAX_CONTRACTION, blocks.block_n, blocks.block_v)


def row_outputs(with_rows: bool, with_counts: bool, with_grad: bool) -> dict[str, bool]:
    return dict(WITH_ROWS=with_rows, WITH_COUNTS=with_counts, WITH_GRAD=with_grad)


def item_outputs(with_items: bool, with_bias: bool) -> dict[str, bool]:
    return dict(WITH_ITEMS=with_items, WITH_BIAS_GRAD=with_bias)


def _common(hidden, item_weight, ids, bias, class_weight, pos_weight, loss, blocks, outputs):
    if interpreter.interpreting():
        interpreter.make_compatible()
    numbers = (_loss_numbers(loss, hidden.device),)
    dummy = lambda x: _or_dummy(x, hidden)  # noqa: E731
    pointers = (hidden, item_weight, dummy(bias), dummy(class_weight), dummy(pos_weight), ids)
    sizes = (hidden.shape[0], item_weight.shape[0], hidden.shape[1], ids.shape[1])
    flags = kernel_constexprs(hidden.dtype, loss, blocks, hidden.shape[1], has_bias=bias is not None,
                              has_class_weight=class_weight is not None, has_pos_weight=pos_weight is not None,
                              outputs=outputs)
    return pointers, sizes, numbers, dict(flags, **compile_options(blocks))


def compile_options(blocks: Blocks) -> dict:
    """Triton's compile options of a launch (and of `aot.compile_case`): warps, stages, registers."""
    return dict(num_warps=blocks.num_warps, num_stages=blocks.num_stages, maxnreg=blocks.max_registers)


def rows_pass(hidden, item_weight, ids, bias, class_weight, pos_weight, g, loss: Loss, *, with_rows: bool,
              with_counts: bool, blocks: Blocks | None = None):
    """`(rows [N] or None, counts [2, N] int32 or None, d_hidden [N, D] or None)`: `d_hidden` when
    `g` is given. `blocks` defaults to the pass's shipped one (`blocks_for`)."""
    n, d = hidden.shape
    outputs = row_outputs(with_rows, with_counts, g is not None)
    blocks = blocks or blocks_for(row_pass(with_rows, with_counts, g is not None), hidden.dtype,
                                  capability(hidden.device))
    pointers, sizes, numbers, flags = _common(hidden, item_weight, ids, bias, class_weight, pos_weight, loss, blocks,
                                              outputs)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    rows = torch.empty(n if with_rows else 0, **f32)
    counts = torch.empty((2, n) if with_counts else (0,), dtype=torch.int32, device=hidden.device)
    # d_hidden's float64 carry across chunks (module docstring), rounded to float32 once at the end
    d_hidden = torch.zeros((n, d) if g is not None else (0,), dtype=torch.float64, device=hidden.device)
    columns = max(1, triton.cdiv(d, flags["BLOCK_D"])) if g is not None else 1  # D = 0: one column
    grid = (triton.cdiv(n, blocks.block_n), columns)
    kernels.row_kernel[grid](*pointers, _or_dummy(g, hidden), rows, counts, d_hidden, *sizes, *numbers, **flags)
    return (rows if with_rows else None, counts if with_counts else None,
            d_hidden.to(torch.float32) if g is not None else None)


def items_pass(hidden, item_weight, ids, bias, class_weight, pos_weight, g, loss: Loss, *, with_items: bool,
               with_bias: bool, blocks: Blocks | None = None):
    """`(d_item_weight [V, D] or None, d_bias [V] or None)` for the row gradient `g [N]`; `blocks`
    defaults to the shipped one (`blocks_for`)."""
    v, d = item_weight.shape
    blocks = blocks or blocks_for("items", hidden.dtype, capability(hidden.device))
    pointers, sizes, numbers, flags = _common(hidden, item_weight, ids, bias, class_weight, pos_weight, loss, blocks,
                                              item_outputs(with_items, with_bias))
    f32 = dict(dtype=torch.float32, device=hidden.device)
    d_items = torch.empty((v, d) if with_items else (0,), **f32)
    d_bias = torch.empty(v if with_bias else 0, **f32)
    grid = (triton.cdiv(v, blocks.block_v), max(1, triton.cdiv(d, flags["BLOCK_D"])) if with_items else 1)
    kernels.item_kernel[grid](*pointers, g, d_items, d_bias, *sizes, *numbers, **flags)
    return d_items if with_items else None, d_bias if with_bias else None
