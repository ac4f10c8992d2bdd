"""The chunked engine's one Triton kernel: each row's loss over a logits chunk, and the chunk
overwritten with its gradient `dz`, in one read of the chunk.

The chunk `z [N, C]` (float32, row-major, contiguous: the logits of 16-bit inputs too, as the
dense loss's, so that no logit is rounded to 16 bits) holds the negatives' logits before the bias
(added here, `bias[v]`); each
row's positives are at -inf (`positives.TilePositives` took them out, their terms are
`positives.positive_terms`'), and add exactly 0 here. Each logit's `(loss, slope)` is the Triton
engine's (`triton/tile_math.labelled_terms`, its label False), times `class_weight[v]`; `dz = g[n]
slope cw` is rounded to the input dtype and stored over `z` (`dz_view`: for 16-bit inputs, the first
half of each float32 row; each element is read before it is written, by the same program). A program owns `BLOCK_N` rows and walks the chunk's columns
`BLOCK_V` at a time in a fixed order: each block's row sums in float32, added to a float64 carry
(so a row is as exact at any chunk width as one block). No atomics: the same bits on every run.

    chunk_pass(z, dz, bias, cw, g, loss, *, with_rows, with_counts)
        -> (rows [N] float64 or None, false positives [N] int32 or None)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cutbce_common.loss import Loss
from torch_cutbce.triton import interpreter, tile_math

# A program's rows and its column step: 4 x 1024 float32 logits (16 KiB) a step, row-contiguous loads
# of 16 bytes a thread at 4 warps. Fixed (no autotuning), so what the interpreter checks runs.
BLOCK_N, BLOCK_V, NUM_WARPS = 4, 1024, 4


@triton.jit
def chunk_kernel(z_ptr, dz_ptr, bias_ptr, cw_ptr, g_ptr, rows_ptr, fp_ptr, numbers_ptr, N, C, DZ_STRIDE,
                 HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, ALIASED: tl.constexpr, WITH_ROWS: tl.constexpr, WITH_COUNTS: tl.constexpr, WITH_GRAD: tl.constexpr,
                 FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
                 BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    offsets = rows.to(tl.int64)[:, None] * C  # int64: N C passes 2**31 at N 32,768 and C 65,536
    dz_offsets = rows.to(tl.int64)[:, None] * DZ_STRIDE
    if WITH_GRAD:
        g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    total = tl.zeros((BLOCK_N,), dtype=tl.float64)
    false_positives = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for start in range(0, C, BLOCK_V):
        columns = start + tl.arange(0, BLOCK_V)
        column_ok = columns < C
        mask = row_ok[:, None] & column_ok[None, :]
        z = tl.load(z_ptr + offsets + columns[None, :], mask=mask, other=float("-inf"))
        if HAS_BIAS:
            z += tl.load(bias_ptr + columns, mask=column_ok, other=0.0)[None, :]
        negative = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.int1)
        # FAST False: the exact float32 math (the logits are float32 here, whatever the inputs' dtype).
        term, slope = tile_math.labelled_terms(z, negative, numbers_ptr, FOCAL, POWER, FRACTION, SMOOTHING,
                                               BALANCED, False)
        if HAS_CW:
            cw = tl.load(cw_ptr + columns, mask=column_ok, other=0.0)[None, :]
            term = term * cw
            slope = slope * cw
        # -inf: a positive taken out, or past the chunk (masked loads): exactly 0, also under
        # smoothing (whose term at z = -inf is +inf) and where cw is infinite (inf x 0)
        kept = z != float("-inf")
        if WITH_ROWS:
            total += tl.sum(tl.where(kept, term, 0.0), 1).to(tl.float64)
        if WITH_COUNTS:
            false_positives += tl.sum((z > 0.0).to(tl.int32), 1)
        if WITH_GRAD:
            dz = tl.where(kept, slope * g[:, None], 0.0)
            if ALIASED:
                # dz's bytes are the first half of this row's float32 logits, some of them read in this
                # step by other threads: every thread's load lands before any store (earlier steps'
                # columns only, never a later step's: prefetching the next block is safe)
                tl.debug_barrier()
            tl.store(dz_ptr + dz_offsets + columns[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
    if WITH_ROWS:
        tl.store(rows_ptr + rows, total, mask=row_ok)
    if WITH_COUNTS:
        tl.store(fp_ptr + rows, false_positives, mask=row_ok)


@functools.lru_cache(maxsize=16)
def _loss_numbers(loss: Loss, device: torch.device) -> torch.Tensor:
    return torch.tensor(tile_math.loss_numbers(loss), dtype=torch.float32, device=device)


def chunk_pass(z, dz, bias, cw, g, loss: Loss, *, with_rows: bool, with_counts: bool):
    """Runs `chunk_kernel` on the contiguous float32 chunk `z [N, C]` (the logits without the bias):
    `dz [N, C]` where the gradient goes (`z` itself, or a 16-bit view of the first half of each of its
    rows: `dz_view`), `bias`, `cw [C]` float32 or None, `g [N]` float32 or None (no gradient: nothing
    is written). Returns `(rows [N] float64, false positives [N] int32)`, None where not asked."""
    if interpreter.interpreting():
        interpreter.make_compatible()
    n, width = z.shape
    device = z.device
    rows = torch.zeros(n if with_rows else 0, dtype=torch.float64, device=device)
    counts = torch.zeros(n if with_counts else 0, dtype=torch.int32, device=device)
    if n and width and (with_rows or with_counts or g is not None):
        dummy = z.new_empty((0,), dtype=torch.float32)
        grid = (triton.cdiv(n, BLOCK_N),)
        chunk_kernel[grid](z, dz, dummy if bias is None else bias, dummy if cw is None else cw,
                           dummy if g is None else g, rows, counts, _loss_numbers(loss, device), n, width,
                           dz.stride(0), HAS_BIAS=bias is not None, HAS_CW=cw is not None,
                           ALIASED=dz.dtype != z.dtype, WITH_ROWS=with_rows,
                           WITH_COUNTS=with_counts, WITH_GRAD=g is not None, **tile_math.loss_constexprs(loss),
                           BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return rows if with_rows else None, counts if with_counts else None


def dz_view(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the chunk's gradient goes, `[N, C]` in `dtype`: `z` itself for float32, else the first
    half of each of `z`'s rows seen as 16-bit numbers (row stride 2 C), a layout every matmul takes."""
    if dtype == torch.float32:
        return z
    n, width = z.shape
    return z.view(dtype).view(n, 2 * width)[:, :width]
