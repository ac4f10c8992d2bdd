"""Pallas TPU kernels of CutBCE: every element's exact loss, one logits tile at a time.

Each kernel sees the positive ids of its rows and evaluates every element of the `[N, V]` loss of
DESIGN.md section 2 inside the `[block_n, block_v]` tile where it falls: the positives are taken out
of the background there, and nothing is corrected afterwards. With
`z[n, v] = hidden[n] . item_weight[v] + bias[v]`, `y[n, v] = 1` iff v is in `ids[n, :]`, cw the
class weight and pw the pos weight (each 1 when None):

    zs[n, v]     = -z if y else z             (the logit the element's loss is a softplus of)
    wgt[n, v]    = cw[v] * (pw[v] if y else 1)
    rows[n]      = sum_v wgt * softplus(zs)   (= sum_v cw * (pw softplus(-z) if y else softplus(z)))
    predicted[n] = sum_v (z > 0),  hits[n] = sum_v y * (z > 0)              (unweighted, float32)
    dz[n, v]     = g[n] * wgt * (-sigmoid(zs) if y else sigmoid(zs))        (g: upstream of rows)
    d_hidden     = dz @ item_weight,  d_item_weight = dz^T @ hidden,  d_bias = sum_n dz

Why in the tile: a background `sum_v cw softplus(z)` over all items followed by `-z` at each
positive computes `softplus(-z) = softplus(z) - z` by cancellation. At a confident positive (z = 31)
the row sum holds 31 and loses the true loss, 3.4e-14, in its rounding. Here each element costs one
exp: `e = exp(-|z|)` (= exp(-|zs|)) gives `softplus(zs) = max(zs, 0) + log1p(e)` and
`sigmoid(zs) = (1 if zs >= 0 else e) / (1 + e)`, both free of cancellation for either label.

y of a tile: the rows' ids block `[block_n, L]` (int32; -1 in unused slots and padded rows, so it
never equals a column index) is compared, slot by slot, with the tile's global column indices (an
iota plus the tile's first column) and the L results OR-ed. L = 0 passes no ids at all (y = False).

Three kernels, each recomputing its logits tile with one MXU matmul into a `[block_n, block_v]` f32
VMEM scratch and then walking it in strips of 8 rows for the elementwise work (targets, softplus or
sigmoid, weights), so that the VMEM of the temporaries does not grow with L (README.md has the
grids, bytes moved and VMEM use):
- forward, grid (token tiles "parallel", item tiles "arbitrary"): per-row sums accumulate in output
  blocks that stay resident across the item axis;
- d_hidden, same grid: the `[block_n, D]` f32 output block accumulates `(dz / g) @ W`; g is applied
  afterwards (it is constant along the reduction);
- d_item_weight and d_bias, grid (item tiles "parallel", token tiles "arbitrary"): an f32 block
  resident across the token axis accumulates the tile's `dz^T @ hidden`, written once in the
  table's dtype.
No `[v_tiles, N, D]` partial sums reach HBM (the reference backward's flaw).

The table's layout: where XLA stores a `[V, D]` table with V in lanes (TPU does so when D is no
multiple of 128, to avoid padding D to 128 lanes), the kernels take `item_weight.T` `[D, V]`, a
free bitcast of that storage, and give back d_item_weight as `[D, V]` too; otherwise they take
`[V, D]` as is (`_items_in_lanes`). Either way no table-sized copy and no f32 table-sized
gradient reaches HBM: the compiled training step's HBM temp at V 876,939, D 64, bf16 on v5e went
from 642.6 MiB to 0 (benchmarks/results/tpu_temp_before_after.md).

Ragged shapes: N is zero-padded to a tile multiple in the launcher (hidden rows are cheap to copy;
padded rows get ids -1 and g = 0, so they add nothing). The item table is never copied: the last
item tile reads past V, Pallas fills that part of the block with unspecified values (NaN in
interpret mode), and the kernels mask those columns wherever they are summed over; outputs past V
are dropped. Ids are < V, so y is False in those columns. D is never padded: the blocks span it.

Mode selection: `jax.lax.platform_dependent` picks the Mosaic kernel when the computation is
lowered for TPU and the same kernel under `interpret=True` otherwise, so an export for TPU from a
CPU host contains `tpu_custom_call` and a CPU `jit` runs the interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_kernels.block_sizes import LANES, BlockSizes, default_block_sizes

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_NT = (((1,), (1,)), ((), ()))  # [a, k] x [b, k] -> [a, b]: contract both minor dims.
_NN = (((1,), (0,)), ((), ()))  # [a, k] x [k, b] -> [a, b]: the plain matmul.
_TN = (((0,), (0,)), ((), ()))  # [k, a] x [k, b] -> [a, b]: contract both major dims.
# Logit given to items past V: softplus and sigmoid of it are exactly 0 in f32. Finite, so no
# inf - inf can arise if the tile math changes.
_MASKED_LOGIT = -1e30
# Rows per step of the elementwise loop (`_for_each_strip`): one sublane group of f32 / int32.
_STRIP = 8


# ----------------------------------------------------------------------------------------------
# Shared tile math (called inside kernels on loaded values).


def _precision(dtype):
    # f32 inputs ask for the f32-exact MXU mode (6 bf16 passes): the f32 path exists for accuracy.
    # DEFAULT would be one bf16 pass (XLA's default for f32 dots on TPU, and the seed's): rows
    # 1.4e-4 to 5.6e-4 relative off, 14-56x the README's float32 bound (emulated on CPU). Mosaic
    # offers no 3-pass HIGH (jax 0.7.1: "Unsupported dot precision"), and 3 passes would leave a
    # ~1e-4 logit error, relative error on a confident positive's loss. Cost, compiled for v5e at
    # N 1000, V 100,000, D 256: 3.0 s and 1.95 MiB of code vs 0.8 s and 0.58 MiB for DEFAULT
    # (benchmarks/NOTES.md section 8).
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
               items_in_lanes):
    """Load the item tile `(w, bias_row, cw_row, pw_row)`: w `[D, bv]` when `items_in_lanes`, else
    `[bv, D]`; each row `[1, bv]` or None.

    On a ragged V the items past V hold unspecified data (NaN in interpret mode). Instead of masking
    the `[bn, bv]` logits tile (an iota, compare and select per logit), make those columns exact
    no-ops at the source: zero their item_weight entries, set their bias to a huge negative logit
    and their class and pos weights to 0. Then z = -1e30 there (and y is False: ids are < V), so
    softplus(zs) = sigmoid(zs) = 0 and z > 0 is false, exactly. This costs selects on the
    `D x bv` tile and `[1, bv]` rows only.
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
    if y is None or pw_row is None:
        return cw_row
    wgt = jnp.where(y, pw_row, jnp.float32(1.0))
    return wgt if cw_row is None else wgt * cw_row


def _signed(z, y):
    """`(zs, e)`: the element's softplus argument `zs = -z if y else z`, and `e = exp(-|z|)`.

    One exp per element serves both softplus(zs) and sigmoid(zs) (|zs| = |z|), never overflows,
    and never forms softplus(z) - z.
    """
    e = jnp.exp(-jnp.abs(z))
    return (z if y is None else jnp.where(y, -z, z)), e


def _element_loss(z, y, wgt):
    """`wgt * softplus(zs)`, softplus(zs) = max(zs, 0) + log1p(exp(-|zs|)) (DESIGN.md sec. 2)."""
    zs, e = _signed(z, y)
    loss = jnp.maximum(zs, 0.0) + jnp.log1p(e)
    return loss if wgt is None else loss * wgt


def _dz_over_g(z, y, wgt):
    """`dz / g = wgt * (-sigmoid(zs) if y else sigmoid(zs))`.

    d softplus(zs) / dz = sigmoid(zs) * dzs/dz, and dzs/dz is -1 at a positive: this is
    `cw * pw * (sigmoid(z) - 1)` at a positive and `cw * sigmoid(z)` elsewhere, as BCE gives.
    """
    zs, e = _signed(z, y)
    one = jnp.float32(1.0)
    s = jnp.where(zs >= 0, one, e) / (one + e)
    if y is not None:
        s = jnp.where(y, -s, s)
    return s if wgt is None else s * wgt


def _lane_partial_sum(x):
    """`[bn, bv] -> [bn, 128]`: add the 128-lane slices. Pure VPU adds; the cross-lane reduction is
    done once, in XLA, on the `[N, 128]` result instead of once per tile."""
    acc = x[:, :LANES]
    for k in range(1, x.shape[1] // LANES):
        acc = acc + x[:, k * LANES : (k + 1) * LANES]
    return acc


# ----------------------------------------------------------------------------------------------
# Kernels (Refs only; static options bound with functools.partial).


def _split_refs(refs, has_bias, has_cw, has_pw, has_ids):
    """Split a kernel's Refs into the inputs `(h, w, bias, cw, pw, ids)` (None where absent), the
    remaining inputs, outputs and other scratch in order, and the `[bn, bv]` f32 logits scratch
    (the last scratch: `_pallas` puts it there)."""
    refs = list(refs)
    h_ref, w_ref = refs.pop(0), refs.pop(0)
    optional = [refs.pop(0) if has else None for has in (has_bias, has_cw, has_pw, has_ids)]
    z_ref = refs.pop()
    return (h_ref, w_ref, *optional), refs, z_ref


def _forward_kernel(*refs, flags, compute_counts, **item_tile_options):
    """Grid (i: token tile, j: item tile). Out blocks `[bn, 128]` stay resident across j: the loss,
    then with compute_counts the predicted count and (when there are ids) the hits count."""
    (h_ref, w_ref, b_ref, c_ref, p_ref, ids_ref), out_refs, z_ref = _split_refs(refs, *flags)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        for ref in out_refs:
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    w, bias_row, cw_row, pw_row = _item_tile(w_ref, b_ref, c_ref, p_ref, j, **item_tile_options)
    z_ref[...] = _logits(h_ref[...], w, bias_row, item_tile_options["items_in_lanes"])
    columns = _columns(j, item_tile_options["block_v"])

    def strip(rows):
        z = z_ref[rows, :]
        y = _targets(None if ids_ref is None else ids_ref[rows, :], columns)
        loss = _element_loss(z, y, _weights(y, cw_row, pw_row))
        out_refs[0][rows, :] += _lane_partial_sum(loss)
        if compute_counts:
            positive = z > 0.0
            out_refs[1][rows, :] += _lane_partial_sum(positive.astype(jnp.float32))
            if y is not None:
                out_refs[2][rows, :] += _lane_partial_sum((y & positive).astype(jnp.float32))

    _for_each_strip(z_ref.shape[0], strip)


def _d_hidden_kernel(*refs, flags, **item_tile_options):
    """Grid (i: token tile, j: item tile). Accumulates `(dz / g) @ W` into `[bn, D]` f32; the
    launcher multiplies by g (constant along j)."""
    (h_ref, w_ref, b_ref, c_ref, p_ref, ids_ref), (dh_ref,), z_ref = _split_refs(refs, *flags)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

    # This kernel contracts over items: past V, dz / g is exactly 0 and the item_weight rows are
    # zeros (0 * NaN would poison the matmul), see _item_tile.
    items_in_lanes = item_tile_options["items_in_lanes"]
    w, bias_row, cw_row, pw_row = _item_tile(w_ref, b_ref, c_ref, p_ref, j, **item_tile_options)
    z_ref[...] = _logits(h_ref[...], w, bias_row, items_in_lanes)
    columns = _columns(j, item_tile_options["block_v"])

    def strip(rows):  # z_ref[rows] <- dz / g, in place
        y = _targets(None if ids_ref is None else ids_ref[rows, :], columns)
        z_ref[rows, :] = _dz_over_g(z_ref[rows, :], y, _weights(y, cw_row, pw_row))

    _for_each_strip(z_ref.shape[0], strip)
    # [bn, bv] x (w [D, bv] or [bv, D]) -> [bn, D]: contract the items.
    dh_ref[...] += lax.dot_general(
        z_ref[...].astype(w.dtype),
        w,
        _NT if items_in_lanes else _NN,
        precision=_precision(w.dtype),
        preferred_element_type=jnp.float32,
    )


def _d_item_kernel(*refs, flags, block_v, items_in_lanes):
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
        # repeating it along lanes gives the `[rows, bv]` row broadcast.
        g = pltpu.repeat(g_ref[rows, :], block_v // LANES, axis=1)
        z_ref[rows, :] = _dz_over_g(z_ref[rows, :], y, _weights(y, cw_row, pw_row)) * g

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


# ----------------------------------------------------------------------------------------------
# pallas_call builders: (operands..., interpret) -> outputs. Shapes and options are bound statically.


def _input_specs(flags, bs, d, num_slots, items_in_lanes, *, token_axis):
    """BlockSpecs of `(h, w, bias?, cw?, pw?, ids?)`, w being the table `[D, V]` when
    `items_in_lanes`, else `[V, D]`; the grid axis `token_axis` walks token tiles, the other one
    item tiles."""
    has_bias, has_cw, has_pw, has_ids = flags
    bn, bv = bs.block_n, bs.block_v

    def tokens(*grid_index):
        return grid_index[token_axis]

    def items(*grid_index):
        return grid_index[1 - token_axis]

    specs = [
        pl.BlockSpec((bn, d), lambda *ij: (tokens(*ij), 0)),
        (pl.BlockSpec((d, bv), lambda *ij: (0, items(*ij))) if items_in_lanes
         else pl.BlockSpec((bv, d), lambda *ij: (items(*ij), 0))),
    ]
    # bias, class and pos weight as `[1, V]` f32 rows.
    specs += [pl.BlockSpec((1, bv), lambda *ij: (0, items(*ij)))] * (has_bias + has_cw + has_pw)
    if has_ids:
        # The full L as the last block dim: legal for any L (Mosaic pads it to 128 lanes in VMEM).
        specs.append(pl.BlockSpec((bn, num_slots), lambda *ij: (tokens(*ij), 0)))
    return specs


def _pallas(kernel, *, bs, cost, scratch_shapes=(), **call_options):
    """`pl.pallas_call` with what the three kernels share: the `[bn, bv]` f32 logits scratch that
    they walk strip by strip (after any other `scratch_shapes`), ("parallel", "arbitrary") grid
    semantics and the VMEM limit."""
    return pl.pallas_call(
        kernel,
        scratch_shapes=[*scratch_shapes, pltpu.VMEM((bs.block_n, bs.block_v), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=bs.vmem_limit_bytes
        ),
        cost_estimate=cost,
        **call_options,
    )


def _cost(static, itemsize, *, matmuls, transcendentals, table_passes, token_passes, written):
    """CostEstimate: `matmuls` `N x V x D` passes; HBM reads of hidden and ids `token_passes`
    times and of the item table with its f32 rows `table_passes` times, plus `written` bytes."""
    n_pad, v, d, flags = static["n_pad"], static["v"], static["d"], static["flags"]
    tokens = n_pad * (d * itemsize + 4 * static["num_slots"])
    table = v * (d * itemsize + 4 * sum(flags[:3]))
    return pl.CostEstimate(
        flops=2 * matmuls * n_pad * v * d,
        transcendentals=transcendentals * n_pad * v,
        bytes_accessed=token_passes * tokens + table_passes * table + written,
    )


def _forward_call(*operands, interpret, compute_counts, **static):
    n_pad, v, d, bs, flags = (static[k] for k in ("n_pad", "v", "d", "bs", "flags"))
    grid = (n_pad // bs.block_n, pl.cdiv(v, bs.block_v))
    n_out = 1 + compute_counts * (1 + flags[3])  # loss, then predicted and hits
    kernel = functools.partial(_forward_kernel, flags=flags, compute_counts=compute_counts,
                               ragged_v=v % bs.block_v != 0, v_total=v, block_v=bs.block_v,
                               items_in_lanes=static["items_in_lanes"])
    return _pallas(
        kernel,
        bs=bs,
        cost=_cost(static, operands[0].dtype.itemsize, matmuls=1, transcendentals=2,
                   table_passes=grid[0], token_passes=1, written=n_out * n_pad * LANES * 4),
        grid=grid,
        in_specs=_input_specs(flags, bs, d, static["num_slots"], static["items_in_lanes"],
                              token_axis=0),
        out_specs=[pl.BlockSpec((bs.block_n, LANES), lambda i, j: (i, 0))] * n_out,
        out_shape=[jax.ShapeDtypeStruct((n_pad, LANES), jnp.float32)] * n_out,
        interpret=interpret,
        name="cutbce_rows_fwd",
    )(*operands)


def _d_hidden_call(*operands, interpret, **static):
    n_pad, v, d, bs, flags = (static[k] for k in ("n_pad", "v", "d", "bs", "flags"))
    grid = (n_pad // bs.block_n, pl.cdiv(v, bs.block_v))
    kernel = functools.partial(_d_hidden_kernel, flags=flags, ragged_v=v % bs.block_v != 0,
                               v_total=v, block_v=bs.block_v,
                               items_in_lanes=static["items_in_lanes"])
    return _pallas(
        kernel,
        bs=bs,
        cost=_cost(static, operands[0].dtype.itemsize, matmuls=2, transcendentals=1,
                   table_passes=grid[0], token_passes=1, written=n_pad * d * 4),
        grid=grid,
        in_specs=_input_specs(flags, bs, d, static["num_slots"], static["items_in_lanes"],
                              token_axis=0),
        out_specs=pl.BlockSpec((bs.block_n, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n_pad, d), jnp.float32),
        interpret=interpret,
        name="cutbce_rows_d_hidden",
    )(*operands)


def _d_item_call(*operands, interpret, **static):
    n_pad, v, d, bs, flags = (static[k] for k in ("n_pad", "v", "d", "bs", "flags"))
    items_in_lanes = static["items_in_lanes"]
    bn, bv = bs.block_n, bs.block_v
    grid = (pl.cdiv(v, bv), n_pad // bn)
    table_dtype = operands[1].dtype
    if items_in_lanes:
        out_specs = [pl.BlockSpec((d, bv), lambda j, i: (0, j))]
        out_shape = [jax.ShapeDtypeStruct((d, v), table_dtype)]
    else:
        out_specs = [pl.BlockSpec((bv, d), lambda j, i: (j, 0))]
        out_shape = [jax.ShapeDtypeStruct((v, d), table_dtype)]
    if flags[0]:  # d_bias
        out_specs.append(pl.BlockSpec((1, bv), lambda j, i: (0, j)))
        out_shape.append(jax.ShapeDtypeStruct((1, v), jnp.float32))
    # A float32 table accumulates in its output block; another dtype in an f32 scratch.
    accumulator = ([] if table_dtype == jnp.float32
                   else [pltpu.VMEM(out_specs[0].block_shape, jnp.float32)])
    return _pallas(
        functools.partial(_d_item_kernel, flags=flags, block_v=bv, items_in_lanes=items_in_lanes),
        bs=bs,
        scratch_shapes=accumulator,
        # The lane-replicated g is read with hidden, once per item tile.
        cost=_cost(static, operands[0].dtype.itemsize, matmuls=2, transcendentals=1,
                   table_passes=1, token_passes=grid[0],
                   written=v * d * table_dtype.itemsize + grid[0] * n_pad * LANES * 4),
        grid=grid,
        in_specs=[*_input_specs(flags, bs, d, static["num_slots"], items_in_lanes, token_axis=1),
                  pl.BlockSpec((bn, LANES), lambda j, i: (i, 0))],  # lane-replicated g
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="cutbce_rows_d_item",
    )(*operands)


def _on_platform(call, *operands):
    """Run `call` as a Mosaic kernel when lowering for TPU, else in the Pallas interpreter.

    The choice is made when the computation is lowered, for the platform it is lowered for (not
    the host's devices): `jax.export(..., platforms=['tpu'])` on a CPU host keeps only the Mosaic
    branch, and `jax.jit` on CPU (also inside torch_xla's `call_jax`) keeps only the interpreter.
    The interpreter is the generic `interpret=True` one: TPU interpret mode
    (`pltpu.InterpretParams`) emits host callbacks that torch_xla cannot compile.
    """
    return lax.platform_dependent(
        *operands,
        tpu=functools.partial(call, interpret=False),
        default=functools.partial(call, interpret=True),
    )


# ----------------------------------------------------------------------------------------------
# Public launchers.


def _check_inputs(hidden, item_weight, bias, class_weight, pos_weight, ids):
    for name, x in (("hidden", hidden), ("item_weight", item_weight)):
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"Pallas kernels take float32 or bfloat16 {name}, got {x.dtype}: "
                "TPU has no float64 (use the blocked JAX path) and float16 should be cast to "
                "bfloat16"
            )
    if hidden.dtype != item_weight.dtype:
        raise TypeError(f"{hidden.dtype=} and {item_weight.dtype=} must match")
    if hidden.ndim != 2 or item_weight.ndim != 2 or hidden.shape[1] != item_weight.shape[1]:
        raise ValueError(f"expected hidden [N, D] and item_weight [V, D], got "
                         f"{hidden.shape} and {item_weight.shape}")
    v = item_weight.shape[0]
    for name, x in (("bias", bias), ("class_weight", class_weight), ("pos_weight", pos_weight)):
        if x is not None and x.shape != (v,):
            raise ValueError(f"{name} must have shape [V] = ({v},), got {x.shape}")
    if ids.ndim != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must have shape [N, L] with N = {hidden.shape[0]}, got {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids must be integer, got {ids.dtype}")


def _items_in_lanes(d):
    """Whether the kernels take the item table as `[D, V]` (items along lanes) rather than `[V, D]`.

    XLA's TPU layout assignment stores a `[V, D]` array whose D is no multiple of 128 with V as
    its minor (lane) dimension, layout `{0,1}`: D along lanes would be padded to 128 (D = 64: twice
    the bytes). Measured with libtpu 0.0.20 for v5e and v6e: `{0,1}` for D = 8, 40, 64, 72, 96,
    192 and `{1,0}` for D = 128, 256. A Pallas call takes row-major (`{1,0}`) operands, so a
    `[V, D]` operand cost a lane-padded copy of the table (214 MiB at V 876,939, D 64, bf16) and
    its gradient a copy back; `item_weight.T` of a `{0,1}` array is a free bitcast to a row-major
    `[D, V]`, and so is the `[D, V]` gradient's `.T` into a `{0,1}` output. Off TPU (the
    interpreter) either form is correct, and the same rule keeps both tested.
    """
    return d % LANES != 0


def _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids, block_sizes):
    """Pick and clip the tiles, pad hidden rows (zeros) and ids (-1) to a tile multiple, shape the
    row vectors. Returns `(operands, static)`: the kernels' inputs in order and the options."""
    _check_inputs(hidden, item_weight, bias, class_weight, pos_weight, ids)
    n, d = hidden.shape
    v = item_weight.shape[0]
    num_slots = ids.shape[1]
    bs = block_sizes or default_block_sizes(n, v, d, hidden.dtype, num_targets=num_slots)
    bs = bs.clipped(n, v)
    n_pad = -(-n // bs.block_n) * bs.block_n
    items_in_lanes = _items_in_lanes(d)
    operands = [jnp.pad(hidden, ((0, n_pad - n), (0, 0))) if n_pad != n else hidden,
                item_weight.T if items_in_lanes else item_weight]
    operands += [x.astype(jnp.float32).reshape(1, v)
                 for x in (bias, class_weight, pos_weight) if x is not None]
    if num_slots:
        operands.append(jnp.pad(ids.astype(jnp.int32), ((0, n_pad - n), (0, 0)),
                                constant_values=-1))
    flags = (bias is not None, class_weight is not None, pos_weight is not None, num_slots > 0)
    return operands, dict(n_pad=n_pad, v=v, d=d, num_slots=num_slots, bs=bs, flags=flags,
                          items_in_lanes=items_in_lanes)


def pallas_background_forward(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    ids: jax.Array,
    *,
    compute_counts: bool,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Exact per-row loss, without materializing `[N, V]` logits (formulas: module docstring).

    Args:
        hidden: `[N, D]` float32 or bfloat16.
        item_weight: `[V, D]`, same dtype as hidden.
        bias: `[V]` (cast to float32) or None for 0.
        class_weight: `[V]` (cast to float32) or None for 1.
        pos_weight: `[V]` (cast to float32) or None for 1; scales the positives' terms only.
        ids: `[N, L]` integer, the positive item ids of each row, de-duplicated and in `[0, V)`;
            every other slot holds -1. L may be 0 (no positives).
        compute_counts: also count, per row, the items with `z > 0` and the positives among them.
        block_sizes: tiles and VMEM limit; None derives them from the chip (`default_block_sizes`).

    Returns:
        `rows` `[N]` float32, `sum_v cw * (pw * softplus(-z) if y else softplus(z))`; and, when
        `compute_counts` (else None each), `predicted` `[N]` float32, the count of `z > 0`, and
        `hits` `[N]` float32, the count of positives with `z > 0` (both unweighted).

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    n = hidden.shape[0]
    operands, static = _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids,
                                block_sizes)
    call = functools.partial(_forward_call, compute_counts=compute_counts, **static)
    outs = [jnp.sum(x[:n], axis=1) for x in _on_platform(call, *operands)]
    if not compute_counts:
        return outs[0], None, None
    hits = outs[2] if static["num_slots"] else jnp.zeros((n,), jnp.float32)
    return outs[0], outs[1], hits


def pallas_background_backward(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    pos_weight: jax.Array | None,
    ids: jax.Array,
    g: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `sum_n g[n] * rows[n]` with respect to hidden, item_weight and bias.

    `dz[n, v] = g[n] * cw[v] * (-pw[v] * sigmoid(-z) if y else sigmoid(z))`; two kernels recompute
    the logits: one reduces over items for d_hidden, the other over positions for d_item_weight
    and d_bias.

    Args:
        hidden, item_weight, bias, class_weight, pos_weight, ids: as in `pallas_background_forward`.
        g: `[N]` upstream gradient of rows (cast to float32).
        block_sizes: tiles and VMEM limit; None derives them from the chip.

    Returns:
        `d_hidden` `[N, D]` float32, `d_item_weight` `[V, D]` in item_weight's dtype (accumulated
        in float32 and rounded once), and `d_bias` `[V]` float32 (None when bias is None).

    Raises:
        TypeError: for float64 or float16 inputs, mismatched dtypes, or non-integer ids.
        ValueError: for inconsistent shapes.
    """
    n = hidden.shape[0]
    if g.shape != (n,):
        raise ValueError(f"g must have shape [N] = ({n},), got {g.shape}")
    operands, static = _prepare(hidden, item_weight, bias, class_weight, pos_weight, ids,
                                block_sizes)
    g32 = g.astype(jnp.float32)
    acc = _on_platform(functools.partial(_d_hidden_call, **static), *operands)
    d_hidden = g32[:, None] * acc[:n]
    # Padded rows get g = 0, so their (finite) sigmoids add nothing to d_item_weight or d_bias.
    g_lanes = jnp.broadcast_to(
        jnp.pad(g32, (0, static["n_pad"] - n))[:, None], (static["n_pad"], LANES)
    )
    outs = _on_platform(functools.partial(_d_item_call, **static), *operands, g_lanes)
    d_bias = outs[1][0] if bias is not None else None
    return d_hidden, (outs[0].T if static["items_in_lanes"] else outs[0]), d_bias
