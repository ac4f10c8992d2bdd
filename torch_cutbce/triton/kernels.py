"""The Triton kernels of CutBCE: bodies only (pointers in, nothing validated; `launch.py` sizes and calls them).

Two kernels, each recomputing `[BLOCK_N, BLOCK_V]` logit tiles in registers (`tl.dot` over the
hidden size, float32 accumulation) and never writing one to memory:
- `row_kernel`, one program per `BLOCK_N` positions (and `BLOCK_D` columns of `d_hidden`), walking
  the whole catalog: each row's loss and counts and, given the row gradient `g`, `d_hidden`;
- `item_kernel`, one program per `BLOCK_V` items (and `BLOCK_D` columns of their gradient), walking
  every position: `d_item_weight` and `d_bias`.
Each owns its outputs, so no atomics and the same bits on every run (docs/triton.md says why this
scheme). Precision: a sum over V (a row's loss, `d_hidden`) or over N (the item gradients) adds at
most `CHUNK` items (or positions) in float32, `d_hidden`'s and `d_item_weight`'s in the tensor cores'
accumulator (`tl.dot(a, b, acc)`); each chunk's sum is then added to a float64 carry, as the other
engines sum their chunks of `shapes.MAX_CONTRACTION`. The carries are registers, but `d_hidden`'s:
the float64 `d_hidden` itself, which its program alone reads and writes once per chunk (registers
are what bound the tile). A per-element compensated sum (TwoSum) cost two float32 registers and six
additions per element and tile.

Labels: `ids [N, L]` hold each row's positive ids once (int32, -1 at padding: `positives.positive_ids`),
compared with the tile's columns, so each logit takes its own branch (`tile_math.labelled_terms`);
`pos_weight` weighs the positives, `class_weight` every item. Past N or V nothing is loaded
(masked loads of 0) and nothing counts (`valid`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_cutbce.triton.tile_math import labelled_terms


@triton.jit
def _block(ptr, size, D, start, k, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The `[BLOCK, BLOCK_D]` block at `(start, k)` of a row-major `[size, D]` matrix, 0 past its edges.
    A block pointer, not a tensor of BLOCK x BLOCK_D 64-bit addresses (those cost 2 registers a
    element and spilled every configuration)."""
    block = tl.make_block_ptr(ptr, shape=(size, D), strides=(D, 1), offsets=(start, k),
                              block_shape=(BLOCK, BLOCK_D), order=(1, 0))
    return tl.load(block, boundary_check=(0, 1), padding_option="zero")


@triton.jit
def _store_block(ptr, value, size, D, start, k, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store `value` as `_block` reads it, nothing past the matrix's edges."""
    block = tl.make_block_ptr(ptr, shape=(size, D), strides=(D, 1), offsets=(start, k),
                              block_shape=(BLOCK, BLOCK_D), order=(1, 0))
    tl.store(block, value, boundary_check=(0, 1))


@triton.jit
def _logits(h_ptr, w_ptr, row_start, col_start, N, V, D, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
            BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """`[BLOCK_N, BLOCK_V]` float32 `h[rows] @ w[cols].T` over D in BLOCK_K steps (D > BLOCK_D): the
    operands stream through shared memory a block at a time (pipelined), none held for the walk."""
    z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        h = _block(h_ptr, N, D, row_start, k, BLOCK_N, BLOCK_K)
        w = _block(w_ptr, V, D, col_start, k, BLOCK_V, BLOCK_K)
        z = tl.dot(h, tl.trans(w), z, input_precision=PRECISION)
    return z


@triton.jit
def _per_row(x, ITEM_MAJOR: tl.constexpr):
    """A per-position vector broadcast along the tile's position axis (axis 0, or 1 when item-major)."""
    if ITEM_MAJOR:
        x = x[None, :]
    else:
        x = x[:, None]
    return x


@triton.jit
def _per_item(x, ITEM_MAJOR: tl.constexpr):
    """A per-item vector broadcast along the tile's item axis (axis 1, or 0 when item-major)."""
    if ITEM_MAJOR:
        x = x[:, None]
    else:
        x = x[None, :]
    return x


@triton.jit
def _labels(ids_ptr, rows, cols, row_mask, L, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
            ITEM_MAJOR: tl.constexpr):
    """The tile's labels (bool): whether each item is one of its position's ids (L compares per logit)."""
    if ITEM_MAJOR:
        y = tl.zeros((BLOCK_V, BLOCK_N), dtype=tl.int32) != 0
    else:
        y = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.int32) != 0
    for slot in range(0, L):
        ids = tl.load(ids_ptr + rows * L + slot, mask=row_mask, other=-1)
        y = y | (_per_row(ids, ITEM_MAJOR) == _per_item(cols, ITEM_MAJOR))
    return y


@triton.jit
def _weights(cw_ptr, pw_ptr, y, cols, col_mask, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
             ITEM_MAJOR: tl.constexpr):
    """`cw[v] * (pw[v] if y else 1)`, broadcastable to the tile (1.0 when neither is given)."""
    weight = tl.full((1, 1), 1.0, tl.float32)
    if HAS_PW:
        weight = tl.where(y, _per_item(tl.load(pw_ptr + cols, mask=col_mask, other=0.0), ITEM_MAJOR), 1.0)
    if HAS_CW:
        weight = weight * _per_item(tl.load(cw_ptr + cols, mask=col_mask, other=0.0), ITEM_MAJOR)
    return weight


@triton.jit
def _tile(z, bias_ptr, cw_ptr, pw_ptr, ids_ptr, row_start, col_start, N, V, L, numbers_ptr,
          HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
          FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
          BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, ITEM_MAJOR: tl.constexpr,
          FAST: tl.constexpr):
    """The tile of products `z` (`[BLOCK_N, BLOCK_V]`, or `[BLOCK_V, BLOCK_N]` when `ITEM_MAJOR`): its
    logits (bias added), labels, what counts (`valid`), and each element's weighted loss and slope (0
    outside `valid`)."""
    rows = row_start + tl.arange(0, BLOCK_N)
    cols = col_start + tl.arange(0, BLOCK_V)
    row_mask, col_mask = rows < N, cols < V
    if HAS_BIAS:
        z += _per_item(tl.load(bias_ptr + cols, mask=col_mask, other=0.0), ITEM_MAJOR)
    y = _labels(ids_ptr, rows, cols, row_mask, L, BLOCK_N, BLOCK_V, ITEM_MAJOR)
    value, slope = labelled_terms(z, y, numbers_ptr, FOCAL, POWER, FRACTION, SMOOTHING, BALANCED, FAST)
    weight = _weights(cw_ptr, pw_ptr, y, cols, col_mask, HAS_CW, HAS_PW, ITEM_MAJOR)
    valid = _per_row(row_mask, ITEM_MAJOR) & _per_item(col_mask, ITEM_MAJOR)
    return z, y, valid, tl.where(valid, value * weight, 0.0), tl.where(valid, slope * weight, 0.0)


@triton.jit
def row_kernel(h_ptr, w_ptr, bias_ptr, cw_ptr, pw_ptr, ids_ptr, g_ptr, rows_ptr, counts_ptr, dh_ptr,
               N, V, D, L, numbers_ptr,
               HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
               WITH_ROWS: tl.constexpr, WITH_COUNTS: tl.constexpr, WITH_GRAD: tl.constexpr,
               FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
               BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Rows `[N]` (and counts `[2, N]`: predicted negatives, predicted positives) and, `WITH_GRAD`,
    `d_hidden[:, d block] = sum_v g[n] dz[n, v] w[v]` `[N, D]`, float64 (zeros on entry: the chunks'
    carry, read and written by this program alone). Program `(i, j)`: rows `i BLOCK_N...`, `d_hidden`
    columns `j BLOCK_D...` (rows and counts are written by j = 0). Tiles `[BLOCK_N, BLOCK_V]`."""
    row_start = tl.program_id(0) * BLOCK_N
    column = tl.program_id(1) * BLOCK_D
    rows = row_start + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows = rows.to(tl.int64)
    loss = tl.zeros((BLOCK_N,), dtype=tl.float64)
    predicted = tl.zeros((BLOCK_N,), dtype=tl.int32)
    hits = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if WITH_GRAD:
        g = tl.load(g_ptr + rows, mask=row_mask, other=0.0)
    for chunk in range(0, V, CHUNK):
        part = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)  # this chunk's d_hidden, float32
        chunk_loss = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(chunk, tl.minimum(chunk + CHUNK, V), BLOCK_V):
            z = _logits(h_ptr, w_ptr, row_start, start, N, V, D, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION)
            z, y, valid, value, slope = _tile(
                z, bias_ptr, cw_ptr, pw_ptr, ids_ptr, row_start, start, N, V, L, numbers_ptr, HAS_BIAS, HAS_CW,
                HAS_PW, FOCAL, POWER, FRACTION, SMOOTHING, BALANCED, BLOCK_N, BLOCK_V, False, PRECISION != "ieee")
            if WITH_ROWS:
                chunk_loss += tl.sum(value, axis=1)
            if WITH_COUNTS:
                positive = valid & (z > 0)
                predicted += tl.sum(positive.to(tl.int32), axis=1)
                hits += tl.sum((positive & y).to(tl.int32), axis=1)
            if WITH_GRAD:
                w = _block(w_ptr, V, D, start, column, BLOCK_V, BLOCK_D)
                part = tl.dot((slope * g[:, None]).to(w.dtype), w, part, input_precision=PRECISION)
        loss += chunk_loss.to(tl.float64)
        if WITH_GRAD:  # the carry lives in d_hidden itself (float64), not in registers
            carry = _block(dh_ptr, N, D, row_start, column, BLOCK_N, BLOCK_D)
            _store_block(dh_ptr, carry + part.to(tl.float64), N, D, row_start, column, BLOCK_N, BLOCK_D)
    first = tl.program_id(1) == 0
    if WITH_ROWS:
        tl.store(rows_ptr + rows, loss.to(tl.float32), mask=row_mask & first)
    if WITH_COUNTS:
        tl.store(counts_ptr + rows, predicted - hits, mask=row_mask & first)
        tl.store(counts_ptr + N + rows, hits, mask=row_mask & first)


@triton.jit
def item_kernel(h_ptr, w_ptr, bias_ptr, cw_ptr, pw_ptr, ids_ptr, g_ptr, dw_ptr, db_ptr,
                N, V, D, L, numbers_ptr,
                HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
                WITH_ITEMS: tl.constexpr, WITH_BIAS_GRAD: tl.constexpr,
                FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
                BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """`d_item_weight[v, d block] = sum_n g[n] dz[n, v] h[n]` `[V, D]` and `d_bias[v] = sum_n g[n]
    dz[n, v]` `[V]`, float32. Program `(i, j)`: items `i BLOCK_V...`, columns `j BLOCK_D...` (d_bias
    is written by j = 0). Tiles item-major, `[BLOCK_V, BLOCK_N]`: the items are the rows of both
    products (the tensor cores' M side, which must be 64 or more for a warpgroup MMA) and `dz.T` is
    formed in registers, never transposed through shared memory."""
    col_start = tl.program_id(0) * BLOCK_V
    column = tl.program_id(1) * BLOCK_D
    cols = col_start + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    cols = cols.to(tl.int64)
    dw = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float64)
    db = tl.zeros((BLOCK_V,), dtype=tl.float64)
    for chunk in range(0, N, CHUNK):
        part = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)  # this chunk's d_item_weight, float32
        chunk_bias = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for start in range(chunk, tl.minimum(chunk + CHUNK, N), BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            row_mask = rows < N
            z = _logits(w_ptr, h_ptr, col_start, start, V, N, D, BLOCK_V, BLOCK_N, BLOCK_K, PRECISION)
            z, y, valid, value, slope = _tile(
                z, bias_ptr, cw_ptr, pw_ptr, ids_ptr, start, col_start, N, V, L, numbers_ptr, HAS_BIAS, HAS_CW,
                HAS_PW, FOCAL, POWER, FRACTION, SMOOTHING, BALANCED, BLOCK_N, BLOCK_V, True, PRECISION != "ieee")
            dz = slope * tl.load(g_ptr + rows, mask=row_mask, other=0.0)[None, :]
            if WITH_ITEMS:
                h = _block(h_ptr, N, D, start, column, BLOCK_N, BLOCK_D)
                part = tl.dot(dz.to(h.dtype), h, part, input_precision=PRECISION)
            if WITH_BIAS_GRAD:
                chunk_bias += tl.sum(dz, axis=1)
        db += chunk_bias.to(tl.float64)
        if WITH_ITEMS:
            dw += part.to(tl.float64)
    if WITH_ITEMS:
        _store_block(dw_ptr, dw.to(tl.float32), V, D, col_start, column, BLOCK_V, BLOCK_D)
    if WITH_BIAS_GRAD:
        tl.store(db_ptr + cols, db.to(tl.float32), mask=col_mask & (tl.program_id(1) == 0))
