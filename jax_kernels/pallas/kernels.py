"""Pallas TPU kernel bodies of CutBCE and the tile math they share (Refs in, nothing validated).

The formulas, the ragged-shape rules and the reasons behind them are in `pallas/launch.py`'s
docstring; the `pallas_call`s that run these bodies (grids, BlockSpecs, cost estimates) are in
`calls.py`. Three kernels, each recomputing its `[block_n, block_v]` logits tile with one MXU
matmul into an f32 VMEM scratch and walking it in strips of 8 rows for the elementwise work:
- `forward_kernel`: the rows (and counts), lane-partial sums resident across the item axis;
- `d_hidden_kernel`: `(dz / g) @ W` into a resident `[block_n, D]` f32 block; with `with_rows`
  also the forward's rows and counts (the one-pass gradient of the scalar reductions);
  the loss partials and `d_hidden` are carried compensated across the item tiles (an error
  scratch beside each, folded in on the last tile): at V = 2**20 a plain running sum drifted by
  2e-5, summing 1,024 tiles;
- `d_item_kernel`: `dz^T @ hidden` and `sum_n dz`, resident across the token axis.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_kernels import branch_math
from jax_kernels.compensated import two_sum
from jax_kernels.pallas.block_sizes import LANES

_NT = (((1,), (1,)), ((), ()))  # [a, k] x [b, k] -> [a, b]: contract both minor dims.
_NN = (((1,), (0,)), ((), ()))  # [a, k] x [k, b] -> [a, b]: the plain matmul.
_TN = (((0,), (0,)), ((), ()))  # [k, a] x [k, b] -> [a, b]: contract both major dims.
# Logit given to items past V: softplus and sigmoid of it are exactly 0 in f32. Finite, so no
# inf - inf can arise if the tile math changes.
_MASKED_LOGIT = -1e30
# Rows per step of the elementwise loop (`_for_each_strip`): one sublane group of f32 / int32.
_STRIP = 8


# ----------------------------------------------------------------------------------------------
# Shared tile math (called inside kernels on loaded values; each element's terms: branch_math.py).


def _precision(dtype):
    # f32 inputs ask for the f32-exact MXU mode (6 bf16 passes): the f32 path exists for accuracy.
    # DEFAULT (one bf16 pass) misses the float32 bound many times over, and Mosaic offers no 3-pass
    # HIGH; the errors and the compile cost of each: benchmarks/results/tpu_temp_before_after.md.
    # bf16 inputs are exact products on the MXU already; f32 accumulation comes from
    # preferred_element_type.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _logits(h, w, bias_row, items_in_lanes):
    """`[bn, bv]` f32 logits of `h [bn, D]` and the item tile (`[D, bv]` when `items_in_lanes`,
    else `[bv, D]`), plus the `[1, bv]` bias row (or None)."""
    z = lax.dot_general(
        h, w, _NN if items_in_lanes else _NT, precision=_precision(h.dtype),
        preferred_element_type=jnp.float32,
    )
    if bias_row is not None:
        z = z + bias_row  # [1, bv] broadcasts over sublanes.
    return z


def _item_tile(w_ref, b_ref, c_ref, p_ref, tile_index, *, ragged_v, v_total, block_v,
               items_in_lanes, weigh_masked=False):
    """Load the item tile `(w, bias_row, cw_row, pw_row)`: w `[D, bv]` when `items_in_lanes`, else
    `[bv, D]`; each row `[1, bv]` or None.

    On a ragged V the items past V hold unspecified data (NaN in interpret mode). Instead of masking
    the `[bn, bv]` logits tile (an iota, compare and select per logit), make those columns exact
    no-ops at the source: zero their item_weight entries, set their bias to a huge negative logit
    and their class and pos weights to 0. Then z = -1e30 there (and y is False: ids are < V), so
    softplus(zs) = sigmoid(zs) = 0 and z > 0 is false, exactly. This costs selects on the
    `D x bv` tile and `[1, bv]` rows only. `weigh_masked`: a loss whose term is not 0 at z = -1e30
    (label smoothing's c |z|) gets a class-weight row of 1, 0 past V, where it had none.
    """
    w = w_ref[...]
    bias_row, cw_row, pw_row = (None if r is None else r[...] for r in (b_ref, c_ref, p_ref))
    if ragged_v:
        first = tile_index * block_v
        valid_row = lax.broadcasted_iota(jnp.int32, (1, block_v), 1) + first < v_total
        item_axis = 1 if items_in_lanes else 0
        valid_w = lax.broadcasted_iota(jnp.int32, w.shape, item_axis) + first < v_total
        w = jnp.where(valid_w, w, jnp.zeros_like(w))
        # Typed float32 constants: under jax_enable_x64 two Python floats would make a float64
        # row, and Mosaic has no float64.
        zero, masked = jnp.float32(0.0), jnp.float32(_MASKED_LOGIT)
        bias_row = jnp.where(valid_row, zero if bias_row is None else bias_row, masked)
        if weigh_masked and cw_row is None:
            cw_row = jnp.ones((1, block_v), jnp.float32)
        cw_row, pw_row = (None if r is None else jnp.where(valid_row, r, zero)
                          for r in (cw_row, pw_row))
    return w, bias_row, cw_row, pw_row


def _columns(tile_index, block_v):
    """`[1, bv]` int32 global column (item) indices of item tile `tile_index`."""
    return lax.broadcasted_iota(jnp.int32, (1, block_v), 1) + tile_index * block_v


def _targets(ids, columns):
    """`[rows, bv]` bool y from the rows' ids `[rows, L]`, or None without ids (L = 0).

    Slot l of every row is compared with the tile's global column indices: a `[rows, 1]` slice
    against the `[1, bv]` iota, broadcast to `[rows, bv]`, OR-ed over the L slots. Unused slots
    hold -1 and match no column.
    """
    if ids is None:
        return None
    y = ids[:, 0:1] == columns
    for slot in range(1, ids.shape[1]):
        y = y | (ids[:, slot : slot + 1] == columns)
    return y


def _for_each_strip(block_n, body):
    """Run `body(rows)` for the `_STRIP`-row slices `rows` of a `[block_n, ...]` tile.

    The elementwise work of a tile (targets, softplus or sigmoid, weights) runs strip by strip on
    the logits held in a VMEM scratch. Unrolled over the whole tile, Mosaic kept many full-tile
    temporaries alive at once (at L = 32 the forward needed 4 more f32 tiles of VMEM than at
    L = 8); per strip they are `[_STRIP, bv]`, whatever L is.
    """

    def step(k, carry):
        body(pl.ds(pl.multiple_of(k * _STRIP, _STRIP), _STRIP))
        return carry

    # int32 bounds: under jax_enable_x64 Python ints would make an int64 index Mosaic rejects.
    lax.fori_loop(jnp.int32(0), jnp.int32(block_n // _STRIP), step, 0)


def _weights(y, cw_row, pw_row):
    """`wgt = cw * (pw if y else 1)`: a `[bn, bv]` tile, a `[1, bv]` row, or None for all ones."""
    wgt = cw_row
    if y is not None and pw_row is not None:
        wgt = jnp.where(y, pw_row, jnp.float32(1.0))
        wgt = wgt if cw_row is None else wgt * cw_row
    return wgt


def _terms(z, y, loss):
    """Each element's `(loss, dz / g)` before the weights, on its own branch (`y`: its label, None:
    all negatives): `branch_math.labelled_terms` of the call's Loss, from one `e = exp(-|z|)` that
    serves softplus and sigmoid (|zs| = |z|), never forming softplus(z) - z. At a positive this is
    `(softplus(-z), sigmoid(z) - 1)` for plain BCE, as BCE gives."""
    return branch_math.labelled_terms(z, y, branch_math.exp_neg_abs(z), loss)


def _weighted(x, wgt):
    return x if wgt is None else x * wgt


def _lane_partial_sum(x):
    """`[bn, bv] -> [bn, 128]`: add the 128-lane slices. Pure VPU adds; the cross-lane reduction is
    done once, in XLA, on the `[N, 128]` result instead of once per tile."""
    acc = x[:, :LANES]
    for k in range(1, x.shape[1] // LANES):
        acc = acc + x[:, k * LANES : (k + 1) * LANES]
    return acc


# ----------------------------------------------------------------------------------------------
# Kernels (Refs only; static options bound with functools.partial by calls.py).


def _split_refs(refs, has_bias, has_cw, has_pw, has_ids):
    """Split a kernel's Refs into the inputs `(h, w, bias, cw, pw, ids)` (None where absent), the
    remaining inputs, outputs and other scratch in order, and the `[bn, bv]` f32 logits scratch
    (the last scratch: `calls._pallas` puts it there)."""
    refs = list(refs)
    h_ref, w_ref = refs.pop(0), refs.pop(0)
    optional = [refs.pop(0) if has else None for has in (has_bias, has_cw, has_pw, has_ids)]
    z_ref = refs.pop()
    return (h_ref, w_ref, *optional), refs, z_ref


def _add_compensated(ref, error_ref, index, x):
    """`ref[index] += x`, its rounding error added to `error_ref[index]` (`compensated.two_sum`)."""
    total, error = two_sum(ref[index], x)
    ref[index] = total
    error_ref[index] += error


def _zero_on_first_tile(refs):
    """Zero the resident accumulators `refs` (outputs and error scratch) on the first item tile."""

    @pl.when(pl.program_id(1) == 0)
    def _init():
        for ref in refs:
            ref[...] = jnp.zeros(ref.shape, jnp.float32)


def _fold_on_last_tile(refs, error_refs):
    """Add each error scratch to its accumulator after the last item tile's sums."""

    @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
    def _fold():
        for ref, error_ref in zip(refs, error_refs):
            ref[...] += error_ref[...]


def _add_rows(row_refs, rows_error_ref, rows, z, y, value, compute_counts):
    """Add one strip's lane-partial sums to the `[bn, 128]` output blocks `row_refs`: the weighted
    loss `value` (compensated, in `rows_error_ref`), then with compute_counts the predicted count
    and (when there are ids) the hits (whole numbers: exact)."""
    _add_compensated(row_refs[0], rows_error_ref, (rows, slice(None)), _lane_partial_sum(value))
    if compute_counts:
        positive = z > 0.0
        row_refs[1][rows, :] += _lane_partial_sum(positive.astype(jnp.float32))
        if y is not None:
            row_refs[2][rows, :] += _lane_partial_sum((y & positive).astype(jnp.float32))


def forward_kernel(*refs, flags, compute_counts, loss, **item_tile_options):
    """Grid (i: token tile, j: item tile). Out blocks `[bn, 128]` stay resident across j: the loss,
    then with compute_counts the predicted count and (when there are ids) the hits count."""
    (h_ref, w_ref, b_ref, c_ref, p_ref, ids_ref), (*out_refs, rows_error_ref), z_ref = _split_refs(refs, *flags)
    j = pl.program_id(1)
    _zero_on_first_tile([*out_refs, rows_error_ref])

    w, bias_row, cw_row, pw_row = _item_tile(w_ref, b_ref, c_ref, p_ref, j, weigh_masked=not loss.plain,
                                             **item_tile_options)
    z_ref[...] = _logits(h_ref[...], w, bias_row, item_tile_options["items_in_lanes"])
    columns = _columns(j, item_tile_options["block_v"])

    def strip(rows):
        z = z_ref[rows, :]
        y = _targets(None if ids_ref is None else ids_ref[rows, :], columns)
        value = _terms(z, y, loss)[0]
        _add_rows(out_refs, rows_error_ref, rows, z, y, _weighted(value, _weights(y, cw_row, pw_row)),
                  compute_counts)

    _for_each_strip(z_ref.shape[0], strip)
    _fold_on_last_tile(out_refs[:1], [rows_error_ref])


def d_hidden_kernel(*refs, flags, with_rows, compute_counts, loss, **item_tile_options):
    """Grid (i: token tile, j: item tile). Accumulates `(dz / g) @ W` into `[bn, D]` f32; the
    launcher multiplies by g (constant along j).

    With `with_rows` (the one-pass gradient of a scalar loss) the same strips also add the rows,
    and with compute_counts the counts, to `[bn, 128]` output blocks as the forward kernel does:
    the logits tile is computed once for the loss and for d_hidden, and `e = exp(-|z|)` serves
    softplus and sigmoid. dz / g does not depend on g, so neither does anything here."""
    (h_ref, w_ref, b_ref, c_ref, p_ref, ids_ref), (dh_ref, *row_refs), z_ref = _split_refs(
        refs, *flags)
    # The error scratch after the outputs: d_hidden's, then the rows' (with_rows).
    row_refs, error_refs = (row_refs[:-2], row_refs[-2:]) if with_rows else (row_refs[:-1], row_refs[-1:])
    j = pl.program_id(1)
    _zero_on_first_tile([dh_ref, *row_refs, *error_refs])

    # This kernel contracts over items: past V, dz / g is exactly 0 and the item_weight rows are
    # zeros (0 * NaN would poison the matmul), see _item_tile.
    items_in_lanes = item_tile_options["items_in_lanes"]
    w, bias_row, cw_row, pw_row = _item_tile(w_ref, b_ref, c_ref, p_ref, j, weigh_masked=not loss.plain,
                                             **item_tile_options)
    z_ref[...] = _logits(h_ref[...], w, bias_row, items_in_lanes)
    columns = _columns(j, item_tile_options["block_v"])

    def strip(rows):  # z_ref[rows] <- dz / g, in place (after the rows read the logits)
        z = z_ref[rows, :]
        y = _targets(None if ids_ref is None else ids_ref[rows, :], columns)
        wgt = _weights(y, cw_row, pw_row)
        value, slope = _terms(z, y, loss)
        if with_rows:
            _add_rows(row_refs, error_refs[1], rows, z, y, _weighted(value, wgt), compute_counts)
        z_ref[rows, :] = _weighted(slope, wgt)

    _for_each_strip(z_ref.shape[0], strip)
    # [bn, bv] x (w [D, bv] or [bv, D]) -> [bn, D]: contract the items.
    product = lax.dot_general(z_ref[...].astype(w.dtype), w, _NT if items_in_lanes else _NN,
                              precision=_precision(w.dtype), preferred_element_type=jnp.float32)
    _add_compensated(dh_ref, error_refs[0], Ellipsis, product)
    _fold_on_last_tile([dh_ref, *row_refs[:1]][:len(error_refs)], error_refs)


def d_item_kernel(*refs, flags, block_v, items_in_lanes, loss):
    """Grid (j: item tile, i: token tile). Accumulates the item tile's gradient in float32,
    resident across i: `hidden^T @ dz` `[D, bv]` when `items_in_lanes`, else `dz^T @ hidden`
    `[bv, D]`; and `sum_n dz` `[1, bv]`.

    The table's gradient is accumulated in an f32 VMEM scratch and written once, in the table's
    dtype, on the last token tile: rounded once, as a float32 output cast afterwards would be,
    but the table-sized HBM buffer is the output itself (bf16: half the bytes), not an f32
    intermediate. For a float32 table the output block is the accumulator (no scratch).
    Nothing here is masked: padded rows have g = 0, h = 0 and ids -1 (dz = 0 exactly), and
    garbage columns past V only reach output columns past V, which are never written back."""
    (h_ref, w_ref, b_ref, c_ref, p_ref, ids_ref), rest, z_ref = _split_refs(refs, *flags)
    g_ref, dw_ref, *rest = rest
    db_ref = rest.pop(0) if flags[0] else None
    acc_ref = rest.pop(0) if rest else dw_ref  # the f32 scratch, when the table is not float32
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        for ref in (acc_ref, db_ref):
            if ref is not None:
                ref[...] = jnp.zeros(ref.shape, jnp.float32)

    h = h_ref[...]
    z_ref[...] = _logits(h, w_ref[...], None if b_ref is None else b_ref[...], items_in_lanes)
    columns = _columns(j, block_v)
    cw_row, pw_row = (None if r is None else r[...] for r in (c_ref, p_ref))

    def strip(rows):  # z_ref[rows] <- dz, in place
        y = _targets(None if ids_ref is None else ids_ref[rows, :], columns)
        # g arrives lane-replicated `[bn, 128]` (flash attention's layout for per-row scalars);
        # tiling it along lanes gives the `[rows, bv]` row broadcast (what `pltpu.repeat` did
        # before jax 0.10 removed it).
        g = jnp.tile(g_ref[rows, :], (1, block_v // LANES))
        z_ref[rows, :] = _weighted(_terms(z_ref[rows, :], y, loss)[1], _weights(y, cw_row, pw_row)) * g

    _for_each_strip(z_ref.shape[0], strip)
    dz = z_ref[...]
    if items_in_lanes:  # [bn, D] x [bn, bv] -> [D, bv]: contract the tokens.
        acc_ref[...] += lax.dot_general(h, dz.astype(h.dtype), _TN,
                                        precision=_precision(h.dtype),
                                        preferred_element_type=jnp.float32)
    else:
        acc_ref[...] += lax.dot(dz.T.astype(h.dtype), h, precision=_precision(h.dtype),
                                preferred_element_type=jnp.float32)
    if db_ref is not None:
        db_ref[...] += jnp.sum(dz, axis=0, keepdims=True)
    if acc_ref is not dw_ref:

        @pl.when(i == pl.num_programs(1) - 1)
        def _write():
            dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)
