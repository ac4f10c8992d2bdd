"""The Triton kernels of CutBCE: bodies only (pointers in, nothing validated; `launch.py` sizes and calls them).

Two kernels, each recomputing `[BLOCK_N, BLOCK_V]` logit tiles in registers (`tl.dot` over the
hidden size, float32 accumulation) and never writing one to memory:
- `row_kernel`, one program per `BLOCK_N` positions (and `BLOCK_D` columns of `d_hidden`), walking
  the whole catalog: each row's loss and counts and, given the row gradient `g`, `d_hidden`;
- `item_kernel`, one program per `BLOCK_V` items (and `BLOCK_D` columns of their gradient), walking
  every position: `d_item_weight` and `d_bias`.
Each owns its outputs, so no atomics and the same bits on every run (docs/triton.md says why this
scheme). Sums across tiles are compensated (`tile_math.two_sum`): a row, `d_hidden` and the item
gradients add one tile at a time over up to V / BLOCK_V or N / BLOCK_N tiles.

Labels: `ids [N, L]` hold each row's positive ids once (int32, -1 at padding: `positives.positive_ids`),
compared with the tile's columns, so each logit takes its own branch (`tile_math.labelled_terms`);
`pos_weight` weighs the positives, `class_weight` every item. Past N or V nothing is loaded
(masked loads of 0) and nothing counts (`valid`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_cutbce.triton.tile_math import compensated, labelled_terms, two_sum


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
            BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """`[BLOCK_N, BLOCK_V]` float32 `h[rows] @ w[cols].T` over D in BLOCK_D steps (D > BLOCK_D)."""
    z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, D, BLOCK_D):
        h = _block(h_ptr, N, D, row_start, k, BLOCK_N, BLOCK_D)
        w = _block(w_ptr, V, D, col_start, k, BLOCK_V, BLOCK_D)
        z = tl.dot(h, tl.trans(w), z, input_precision=PRECISION)
    return z


@triton.jit
def _labels(ids_ptr, rows, cols, row_mask, L, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """`[BLOCK_N, BLOCK_V]` bool: whether each column is one of its row's ids (L compares per logit)."""
    y = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.int32) != 0
    for slot in range(0, L):
        ids = tl.load(ids_ptr + rows * L + slot, mask=row_mask, other=-1)
        y = y | (ids[:, None] == cols[None, :])
    return y


@triton.jit
def _weights(cw_ptr, pw_ptr, y, cols, col_mask, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr):
    """`cw[v] * (pw[v] if y else 1)`, broadcastable to the tile (1.0 when neither is given)."""
    weight = tl.full((1, 1), 1.0, tl.float32)
    if HAS_PW:
        weight = tl.where(y, tl.load(pw_ptr + cols, mask=col_mask, other=0.0)[None, :], 1.0)
    if HAS_CW:
        weight = weight * tl.load(cw_ptr + cols, mask=col_mask, other=0.0)[None, :]
    return weight


@triton.jit
def _tile(z, bias_ptr, cw_ptr, pw_ptr, ids_ptr, row_start, col_start, N, V, L, numbers_ptr,
          HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
          FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
          BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The tile of products `z`: its logits (bias added), labels, what counts (`valid`), and each
    element's weighted loss and slope (0 outside `valid`)."""
    rows = row_start + tl.arange(0, BLOCK_N)
    cols = col_start + tl.arange(0, BLOCK_V)
    row_mask, col_mask = rows < N, cols < V
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=col_mask, other=0.0)[None, :]
    y = _labels(ids_ptr, rows, cols, row_mask, L, BLOCK_N, BLOCK_V)
    value, slope = labelled_terms(z, y, numbers_ptr, FOCAL, POWER, FRACTION, SMOOTHING, BALANCED)
    weight = _weights(cw_ptr, pw_ptr, y, cols, col_mask, HAS_CW, HAS_PW)
    valid = row_mask[:, None] & col_mask[None, :]
    return z, y, valid, tl.where(valid, value * weight, 0.0), tl.where(valid, slope * weight, 0.0)


@triton.jit
def row_kernel(h_ptr, w_ptr, bias_ptr, cw_ptr, pw_ptr, ids_ptr, g_ptr, rows_ptr, counts_ptr, dh_ptr,
               N, V, D, L, numbers_ptr,
               HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
               WITH_ROWS: tl.constexpr, WITH_COUNTS: tl.constexpr, WITH_GRAD: tl.constexpr,
               FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
               BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
               ONE_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Rows `[N]` (and counts `[2, N]`: predicted negatives, predicted positives) and, `WITH_GRAD`,
    `d_hidden[:, d block] = sum_v g[n] dz[n, v] w[v]` `[N, D]` float32. Program `(i, j)`: rows
    `i BLOCK_N...`, `d_hidden` columns `j BLOCK_D...` (rows and counts are written by j = 0)."""
    row_start = tl.program_id(0) * BLOCK_N
    rows = row_start + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows = rows.to(tl.int64)
    loss = tl.zeros((BLOCK_N,), dtype=tl.float32)
    loss_error = tl.zeros((BLOCK_N,), dtype=tl.float32)
    predicted = tl.zeros((BLOCK_N,), dtype=tl.int32)
    hits = tl.zeros((BLOCK_N,), dtype=tl.int32)
    dh = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dh_error = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if WITH_GRAD:
        g = tl.load(g_ptr + rows, mask=row_mask, other=0.0)
    if ONE_CHUNK:  # D <= BLOCK_D: the rows' hidden block stays in registers for the whole catalog
        h = _block(h_ptr, N, D, row_start, 0, BLOCK_N, BLOCK_D)
    for start in range(0, V, BLOCK_V):
        if ONE_CHUNK:  # one load of the item block serves both products
            w = _block(w_ptr, V, D, start, 0, BLOCK_V, BLOCK_D)
            z = tl.dot(h, tl.trans(w), input_precision=PRECISION)
        else:
            z = _logits(h_ptr, w_ptr, row_start, start, N, V, D, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
            w = _block(w_ptr, V, D, start, tl.program_id(1) * BLOCK_D, BLOCK_V, BLOCK_D)
        z, y, valid, value, slope = _tile(
            z, bias_ptr, cw_ptr, pw_ptr, ids_ptr, row_start, start, N, V, L, numbers_ptr, HAS_BIAS, HAS_CW, HAS_PW,
            FOCAL, POWER, FRACTION, SMOOTHING, BALANCED, BLOCK_N, BLOCK_V)
        if WITH_ROWS:
            loss, error = two_sum(loss, tl.sum(value, axis=1))
            loss_error += error
        if WITH_COUNTS:
            positive = valid & (z > 0)
            predicted += tl.sum(positive.to(tl.int32), axis=1)
            hits += tl.sum((positive & y).to(tl.int32), axis=1)
        if WITH_GRAD:
            dz = slope * g[:, None]
            dh, error = two_sum(dh, tl.dot(dz.to(w.dtype), w, input_precision=PRECISION))
            dh_error += error
    first = tl.program_id(1) == 0
    if WITH_ROWS:
        tl.store(rows_ptr + rows, compensated(loss, loss_error), mask=row_mask & first)
    if WITH_COUNTS:
        tl.store(counts_ptr + rows, predicted - hits, mask=row_mask & first)
        tl.store(counts_ptr + N + rows, hits, mask=row_mask & first)
    if WITH_GRAD:
        _store_block(dh_ptr, compensated(dh, dh_error), N, D, row_start, tl.program_id(1) * BLOCK_D, BLOCK_N, BLOCK_D)


@triton.jit
def item_kernel(h_ptr, w_ptr, bias_ptr, cw_ptr, pw_ptr, ids_ptr, g_ptr, dw_ptr, db_ptr,
                N, V, D, L, numbers_ptr,
                HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_PW: tl.constexpr,
                WITH_ITEMS: tl.constexpr, WITH_BIAS_GRAD: tl.constexpr,
                FOCAL: tl.constexpr, POWER: tl.constexpr, FRACTION: tl.constexpr, SMOOTHING: tl.constexpr,
                BALANCED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                ONE_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """`d_item_weight[v, d block] = sum_n g[n] dz[n, v] h[n]` `[V, D]` and `d_bias[v] = sum_n g[n]
    dz[n, v]` `[V]`, float32. Program `(i, j)`: items `i BLOCK_V...`, columns `j BLOCK_D...` (d_bias
    is written by j = 0)."""
    col_start = tl.program_id(0) * BLOCK_V
    cols = col_start + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    cols = cols.to(tl.int64)
    dw = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    dw_error = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    db_error = tl.zeros((BLOCK_V,), dtype=tl.float32)
    if ONE_CHUNK:  # D <= BLOCK_D: the items' block stays in registers for every position
        w = _block(w_ptr, V, D, col_start, 0, BLOCK_V, BLOCK_D)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        if ONE_CHUNK:  # one load of the hidden block serves both products
            h = _block(h_ptr, N, D, start, 0, BLOCK_N, BLOCK_D)
            z = tl.dot(h, tl.trans(w), input_precision=PRECISION)
        else:
            z = _logits(h_ptr, w_ptr, start, col_start, N, V, D, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION)
            h = _block(h_ptr, N, D, start, tl.program_id(1) * BLOCK_D, BLOCK_N, BLOCK_D)
        z, y, valid, value, slope = _tile(
            z, bias_ptr, cw_ptr, pw_ptr, ids_ptr, start, col_start, N, V, L, numbers_ptr, HAS_BIAS, HAS_CW, HAS_PW,
            FOCAL, POWER, FRACTION, SMOOTHING, BALANCED, BLOCK_N, BLOCK_V)
        dz = slope * tl.load(g_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if WITH_ITEMS:
            dw, error = two_sum(dw, tl.dot(tl.trans(dz).to(h.dtype), h, input_precision=PRECISION))
            dw_error += error
        if WITH_BIAS_GRAD:
            db, error = two_sum(db, tl.sum(dz, axis=0))
            db_error += error
    if WITH_ITEMS:
        _store_block(dw_ptr, dw + dw_error, V, D, col_start, tl.program_id(1) * BLOCK_D, BLOCK_V, BLOCK_D)
    if WITH_BIAS_GRAD:
        tl.store(db_ptr + cols, db + db_error, mask=col_mask & (tl.program_id(1) == 0))
