"""Launching the Triton kernels: block sizes, grids, the `Loss` as constexprs, the float32 rule.

`rows_pass` runs `kernels.row_kernel` (rows, counts, `d_hidden`), `items_pass` runs
`kernels.item_kernel` (`d_item_weight`, `d_bias`); both take contiguous `hidden [N, D]` and
`item_weight [V, D]` of one dtype (float32, bfloat16 or float16), `ids [N, L]` int32 (-1 padding)
and float32 `bias`, `class_weight`, `pos_weight` `[V]` and row gradient `g [N]` (None where absent),
and return float32 results.

The block sizes are fixed per pass and dtype (`ROW_BLOCKS`, `ITEM_BLOCKS`, `blocks_for`): no autotuning, since what is verified
without a GPU (the interpreter's parity, the sm_80 / sm_90 compiles and their register and
shared-memory budgets, tests/test_triton_compile.py) must be what runs.

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
from torch_cutbce.triton import interpreter, kernels, tile_math

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The widest hidden block a program holds: wider hidden sizes take several programs per block of
# rows (or items), each recomputing the logits over the whole D (grid axis 1).
MAX_BLOCK_D = 128


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One kernel's fixed launch configuration.

    Attributes:
      block_n, block_v: the logit tile `[block_n, block_v]` (powers of two, >= 16: `tl.dot`'s minimum).
      max_block_d: the widest `BLOCK_D` (power of two, >= 16); a program's is `min(max_block_d,
        next_power_of_2(D))`.
      num_warps, num_stages: Triton's.
    """

    block_n: int = 64
    block_v: int = 64
    max_block_d: int = MAX_BLOCK_D
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_v", "max_block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {name}={value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got num_warps={self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got num_stages={self.num_stages}")

    def block_d(self, hidden_size: int) -> int:
        return min(self.max_block_d, max(16, triton.next_power_of_2(hidden_size)))


# The shipped configurations: pass -> input dtype -> (Blocks for D <= MAX_BLOCK_D, whose hidden block
# stays in registers for the whole walk; Blocks for wider D, whose logits are recomputed per hidden
# block). Each is the largest tile (then the widest hidden block, then the fewest warps) that ptxas
# compiles without spilling for sm_80 and sm_90, for every Loss form and every optional input
# (`aot.py` prints the numbers; tests/test_triton_compile.py checks them).
ROW_PASSES = ("rows", "grad", "rows_grad")  # rows and counts; d_hidden alone; all three in one pass
_B = Blocks
_HALF = (torch.bfloat16, torch.float16)  # the same tiles for both: the same code, 16-bit operands
ROW_BLOCKS = {
    "rows": {torch.float32: (_B(64, 64, 128, 16), _B(32, 64, 128, 8)),
             **dict.fromkeys(_HALF, (_B(64, 32, 128, 4), _B(64, 32, 128, 8)))},
    "grad": {torch.float32: (_B(32, 64, 128, 16), _B(16, 32, 64, 4)),
             **dict.fromkeys(_HALF, (_B(32, 64, 128, 8), _B(32, 64, 64, 8)))},
    "rows_grad": {torch.float32: (_B(32, 16, 128, 4), _B(32, 32, 64, 8)),
                  **dict.fromkeys(_HALF, (_B(32, 16, 128, 8), _B(32, 64, 64, 8)))},
}
ITEM_BLOCKS = {torch.float32: (_B(64, 32, 128, 16), _B(32, 16, 128, 8)),
               **dict.fromkeys(_HALF, (_B(32, 32, 128, 4), _B(64, 32, 64, 8)))}
PASSES = (*ROW_PASSES, "items")


def row_pass(with_rows: bool, with_counts: bool, with_grad: bool) -> str:
    """The `ROW_BLOCKS` entry of a `rows_pass` call (rows or counts alone take the forward's)."""
    if not with_grad:
        return "rows"
    return "rows_grad" if with_rows or with_counts else "grad"


def blocks_for(pass_name: str, dtype: torch.dtype, hidden_size: int) -> Blocks:
    """The shipped `Blocks` of a pass (`PASSES`) for inputs of `dtype` and hidden size D."""
    narrow, wide = (ITEM_BLOCKS if pass_name == "items" else ROW_BLOCKS[pass_name])[dtype]
    return narrow if hidden_size <= narrow.max_block_d else wide


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
                BLOCK_N=blocks.block_n, BLOCK_V=blocks.block_v, BLOCK_D=block_d, ONE_CHUNK=hidden_size <= block_d,
                PRECISION=precision(dtype))


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
    return pointers, sizes, numbers, dict(flags, num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def rows_pass(hidden, item_weight, ids, bias, class_weight, pos_weight, g, loss: Loss, *, with_rows: bool,
              with_counts: bool, blocks: Blocks | None = None):
    """`(rows [N] or None, counts [2, N] int32 or None, d_hidden [N, D] or None)`: `d_hidden` when
    `g` is given. `blocks` defaults to the pass's shipped one (`blocks_for`)."""
    n, d = hidden.shape
    outputs = row_outputs(with_rows, with_counts, g is not None)
    blocks = blocks or blocks_for(row_pass(with_rows, with_counts, g is not None), hidden.dtype, d)
    pointers, sizes, numbers, flags = _common(hidden, item_weight, ids, bias, class_weight, pos_weight, loss, blocks,
                                              outputs)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    rows = torch.empty(n if with_rows else 0, **f32)
    counts = torch.empty((2, n) if with_counts else (0,), dtype=torch.int32, device=hidden.device)
    d_hidden = torch.empty((n, d) if g is not None else (0,), **f32)
    columns = max(1, triton.cdiv(d, flags["BLOCK_D"])) if g is not None else 1  # D = 0: one column
    grid = (triton.cdiv(n, blocks.block_n), columns)
    kernels.row_kernel[grid](*pointers, _or_dummy(g, hidden), rows, counts, d_hidden, *sizes, *numbers, **flags)
    return (rows if with_rows else None, counts if with_counts else None, d_hidden if g is not None else None)


def items_pass(hidden, item_weight, ids, bias, class_weight, pos_weight, g, loss: Loss, *, with_items: bool,
               with_bias: bool, blocks: Blocks | None = None):
    """`(d_item_weight [V, D] or None, d_bias [V] or None)` for the row gradient `g [N]`; `blocks`
    defaults to the shipped one (`blocks_for`)."""
    v, d = item_weight.shape
    blocks = blocks or blocks_for("items", hidden.dtype, d)
    pointers, sizes, numbers, flags = _common(hidden, item_weight, ids, bias, class_weight, pos_weight, loss, blocks,
                                              item_outputs(with_items, with_bias))
    f32 = dict(dtype=torch.float32, device=hidden.device)
    d_items = torch.empty((v, d) if with_items else (0,), **f32)
    d_bias = torch.empty(v if with_bias else 0, **f32)
    grid = (triton.cdiv(v, blocks.block_v), max(1, triton.cdiv(d, flags["BLOCK_D"])) if with_items else 1)
    kernels.item_kernel[grid](*pointers, g, d_items, d_bias, *sizes, *numbers, **flags)
    return d_items if with_items else None, d_bias if with_bias else None
