"""Pallas TPU kernels for the dense background of CutBCE (forward and backward).

The loss is a dense background over all items plus a sparse correction at the positives (DESIGN.md
section 2; the correction lives in `positives.py`). These kernels compute only the background, so
they never see targets. With `z[n, v] = hidden[n] . item_weight[v] + bias[v]`:

    row_bg[n]    = sum_v cw[v] * softplus(z[n, v])
    count_pos[n] = sum_v (z[n, v] > 0)                      (unweighted, float32)
    dz[n, v]     = g[n] * cw[v] * sigmoid(z[n, v])          (g: upstream gradient of row_bg)
    d_hidden     = dz @ item_weight,  d_item_weight = dz^T @ hidden,  d_bias = sum_n dz

Three kernels, each recomputing its `[block_n, block_v]` logits tile in VMEM (README.md has the
grids, bytes moved and VMEM use):
- forward, grid (token tiles "parallel", item tiles "arbitrary"): per-row sums accumulate in an
  output block that stays resident across the item axis;
- d_hidden, same grid: the `[block_n, D]` f32 output block accumulates `(cw * sigmoid(z)) @ W`;
  g is applied afterwards (it is constant along the reduction);
- d_item_weight and d_bias, grid (item tiles "parallel", token tiles "arbitrary"): the `[block_v, D]`
  f32 output block accumulates `dz^T @ hidden`.
No `[v_tiles, N, D]` partial sums reach HBM (the reference backward's flaw).

Ragged shapes: N is zero-padded to a tile multiple in the launcher (hidden rows are cheap to copy;
padded rows get g = 0, so they add nothing). The item table is never copied: the last item tile
reads past V, Pallas fills that part of the block with unspecified values (NaN in interpret mode),
and the kernels mask those columns wherever they are summed over; outputs past V are dropped.
D is never padded: the blocks span the full D.

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
_NT = (((1,), (1,)), ((), ()))  # [bn, D] x [bv, D] -> [bn, bv]: contract both minor dims.
# Logit given to items past V: softplus and sigmoid of it are exactly 0 in f32. Finite, so no
# inf - inf can arise if the tile math changes.
_MASKED_LOGIT = -1e30


# ----------------------------------------------------------------------------------------------
# Shared tile math (called inside kernels on loaded values).


def _precision(dtype):
    # f32 inputs ask for the f32-exact MXU mode (6 bf16 passes): the f32 path exists for accuracy.
    # bf16 inputs are exact products on the MXU already; f32 accumulation comes from
    # preferred_element_type.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _logits(h, w, bias_row):
    """`[bn, D] x [bv, D] -> [bn, bv]` f32 logits plus the `[1, bv]` bias row (or None)."""
    z = lax.dot_general(
        h, w, _NT, precision=_precision(h.dtype), preferred_element_type=jnp.float32
    )
    if bias_row is not None:
        z = z + bias_row  # [1, bv] broadcasts over sublanes.
    return z


def _item_tile(w_ref, b_ref, c_ref, tile_index, *, ragged_v, v_total, block_v):
    """Load the item tile `(w [bv, D], bias_row [1, bv] | None, cw_row [1, bv] | None)`.

    On a ragged V the rows past V hold unspecified data (NaN in interpret mode). Instead of masking
    the `[bn, bv]` logits tile (an iota, compare and select per logit), make those columns exact
    no-ops at the source: zero their item_weight rows, set their bias to a huge negative logit and
    their class weight to 0. Then z = -1e30 there, so softplus(z) = sigmoid(z) = 0 and z > 0 is
    false, exactly. This costs selects on `[bv, D]` and `[1, bv]` only.
    """
    w = w_ref[...]
    bias_row = None if b_ref is None else b_ref[...]
    cw_row = None if c_ref is None else c_ref[...]
    if ragged_v:
        first = tile_index * block_v
        valid_row = lax.broadcasted_iota(jnp.int32, (1, block_v), 1) + first < v_total
        valid_w = lax.broadcasted_iota(jnp.int32, w.shape, 0) + first < v_total
        w = jnp.where(valid_w, w, jnp.zeros_like(w))
        # Typed float32 constants: under jax_enable_x64 two Python floats would make a float64
        # row, and Mosaic has no float64.
        zero, masked = jnp.float32(0.0), jnp.float32(_MASKED_LOGIT)
        bias_row = jnp.where(valid_row, zero if bias_row is None else bias_row, masked)
        if cw_row is not None:
            cw_row = jnp.where(valid_row, cw_row, zero)
    return w, bias_row, cw_row


def _lane_partial_sum(x):
    """`[bn, bv] -> [bn, 128]`: add the 128-lane slices. Pure VPU adds; the cross-lane reduction is
    done once, in XLA, on the `[N, 128]` result instead of once per tile."""
    acc = x[:, :LANES]
    for k in range(1, x.shape[1] // LANES):
        acc = acc + x[:, k * LANES : (k + 1) * LANES]
    return acc


def _softplus(z):
    # max(z, 0) + log1p(exp(-|z|)): no overflow for large |z|, exact at 0 (DESIGN.md section 2).
    return jnp.maximum(z, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(z)))


def _sigmoid(z):
    # Stable for either sign; exp(-|z|) never overflows.
    e = jnp.exp(-jnp.abs(z))
    r = 1.0 / (1.0 + e)
    return jnp.where(z >= 0, r, e * r)


# ----------------------------------------------------------------------------------------------
# Kernels (Refs only; static options bound with functools.partial).


def _forward_kernel(*refs, has_bias, has_cw, compute_counts, **item_tile_options):
    """Grid (i: token tile, j: item tile). Out blocks `[bn, 128]` stay resident across j."""
    refs = list(refs)
    h_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    c_ref = refs.pop(0) if has_cw else None
    loss_ref = refs.pop(0)
    count_ref = refs.pop(0) if compute_counts else None
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        loss_ref[...] = jnp.zeros(loss_ref.shape, jnp.float32)
        if count_ref is not None:
            count_ref[...] = jnp.zeros(count_ref.shape, jnp.float32)

    w, bias_row, cw_row = _item_tile(w_ref, b_ref, c_ref, j, **item_tile_options)
    z = _logits(h_ref[...], w, bias_row)
    loss = _softplus(z)
    if cw_row is not None:
        loss = loss * cw_row
    loss_ref[...] += _lane_partial_sum(loss)
    if count_ref is not None:
        count_ref[...] += _lane_partial_sum((z > 0.0).astype(jnp.float32))


def _d_hidden_kernel(*refs, has_bias, has_cw, **item_tile_options):
    """Grid (i: token tile, j: item tile). Accumulates `(cw * sigmoid(z)) @ W` into `[bn, D]` f32;
    the launcher multiplies by g (dz = g * cw * sigmoid(z) and g is constant along j)."""
    refs = list(refs)
    h_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    c_ref = refs.pop(0) if has_cw else None
    (dh_ref,) = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

    # This kernel contracts over items: past V, s is exactly 0 and the item_weight rows are zeros
    # (0 * NaN would poison the matmul), see _item_tile.
    w, bias_row, cw_row = _item_tile(w_ref, b_ref, c_ref, j, **item_tile_options)
    s = _sigmoid(_logits(h_ref[...], w, bias_row))
    if cw_row is not None:
        s = s * cw_row
    dh_ref[...] += lax.dot_general(
        s.astype(w.dtype),
        w,
        (((1,), (0,)), ((), ())),
        precision=_precision(w.dtype),
        preferred_element_type=jnp.float32,
    )


def _d_item_kernel(*refs, has_bias, has_cw, block_v):
    """Grid (j: item tile, i: token tile). Accumulates `dz^T @ hidden` into `[bv, D]` f32 and
    `sum_n dz` into `[1, bv]` f32, both resident across i. Nothing here is masked: padded rows have
    g = 0 and h = 0 (dz = 0 exactly), and garbage columns past V only reach output rows past V,
    which are never written back."""
    refs = list(refs)
    h_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    c_ref = refs.pop(0) if has_cw else None
    g_ref, dw_ref = refs.pop(0), refs.pop(0)
    db_ref = refs.pop(0) if has_bias else None
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)
        if db_ref is not None:
            db_ref[...] = jnp.zeros(db_ref.shape, jnp.float32)

    h = h_ref[...]
    z = _logits(h, w_ref[...], None if b_ref is None else b_ref[...])
    # g arrives lane-replicated `[bn, 128]` (flash attention's layout for per-row scalars);
    # repeating it along lanes gives the `[bn, bv]` row broadcast.
    dz = _sigmoid(z) * pltpu.repeat(g_ref[...], block_v // LANES, axis=1)
    if c_ref is not None:
        dz = dz * c_ref[...]
    dw_ref[...] += lax.dot(
        dz.T.astype(h.dtype), h, precision=_precision(h.dtype), preferred_element_type=jnp.float32
    )
    if db_ref is not None:
        db_ref[...] += jnp.sum(dz, axis=0, keepdims=True)


# ----------------------------------------------------------------------------------------------
# pallas_call builders: (operands..., interpret) -> outputs. Shapes and options are bound statically.


def _table_specs(has_bias, has_cw, block_v, index_map):
    """BlockSpecs for item_weight's companions: bias and class weight as `[1, V]` rows."""
    specs = []
    if has_bias:
        specs.append(pl.BlockSpec((1, block_v), index_map))
    if has_cw:
        specs.append(pl.BlockSpec((1, block_v), index_map))
    return specs


def _compiler_params(semantics, bs: BlockSizes):
    return pltpu.CompilerParams(
        dimension_semantics=semantics, vmem_limit_bytes=bs.vmem_limit_bytes
    )


def _forward_call(*operands, interpret, n_pad, v, d, bs, has_bias, has_cw, compute_counts):
    bn, bv = bs.block_n, bs.block_v
    grid = (n_pad // bn, pl.cdiv(v, bv))
    in_specs = [
        pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
        pl.BlockSpec((bv, d), lambda i, j: (j, 0)),
        *_table_specs(has_bias, has_cw, bv, lambda i, j: (0, j)),
    ]
    out_spec = pl.BlockSpec((bn, LANES), lambda i, j: (i, 0))
    n_out = 2 if compute_counts else 1
    itemsize = operands[0].dtype.itemsize
    kernel = functools.partial(
        _forward_kernel,
        has_bias=has_bias,
        has_cw=has_cw,
        compute_counts=compute_counts,
        ragged_v=v % bv != 0,
        v_total=v,
        block_v=bv,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[out_spec] * n_out,
        out_shape=[jax.ShapeDtypeStruct((n_pad, LANES), jnp.float32)] * n_out,
        compiler_params=_compiler_params(("parallel", "arbitrary"), bs),
        cost_estimate=pl.CostEstimate(
            flops=2 * n_pad * v * d,
            transcendentals=2 * n_pad * v,
            bytes_accessed=n_pad * d * itemsize + grid[0] * v * d * itemsize,
        ),
        interpret=interpret,
        name="cutbce_background_fwd",
    )(*operands)


def _d_hidden_call(*operands, interpret, n_pad, v, d, bs, has_bias, has_cw):
    bn, bv = bs.block_n, bs.block_v
    grid = (n_pad // bn, pl.cdiv(v, bv))
    in_specs = [
        pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
        pl.BlockSpec((bv, d), lambda i, j: (j, 0)),
        *_table_specs(has_bias, has_cw, bv, lambda i, j: (0, j)),
    ]
    itemsize = operands[0].dtype.itemsize
    kernel = functools.partial(
        _d_hidden_kernel,
        has_bias=has_bias,
        has_cw=has_cw,
        ragged_v=v % bv != 0,
        v_total=v,
        block_v=bv,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n_pad, d), jnp.float32),
        compiler_params=_compiler_params(("parallel", "arbitrary"), bs),
        cost_estimate=pl.CostEstimate(
            flops=4 * n_pad * v * d,
            transcendentals=n_pad * v,
            bytes_accessed=n_pad * d * (itemsize + 4) + grid[0] * v * d * itemsize,
        ),
        interpret=interpret,
        name="cutbce_background_d_hidden",
    )(*operands)


def _d_item_call(*operands, interpret, n_pad, v, d, bs, has_bias, has_cw):
    bn, bv = bs.block_n, bs.block_v
    grid = (pl.cdiv(v, bv), n_pad // bn)
    in_specs = [
        pl.BlockSpec((bn, d), lambda j, i: (i, 0)),
        pl.BlockSpec((bv, d), lambda j, i: (j, 0)),
        *_table_specs(has_bias, has_cw, bv, lambda j, i: (0, j)),
        pl.BlockSpec((bn, LANES), lambda j, i: (i, 0)),
    ]
    out_specs = [pl.BlockSpec((bv, d), lambda j, i: (j, 0))]
    out_shape = [jax.ShapeDtypeStruct((v, d), jnp.float32)]
    if has_bias:
        out_specs.append(pl.BlockSpec((1, bv), lambda j, i: (0, j)))
        out_shape.append(jax.ShapeDtypeStruct((1, v), jnp.float32))
    itemsize = operands[0].dtype.itemsize
    kernel = functools.partial(_d_item_kernel, has_bias=has_bias, has_cw=has_cw, block_v=bv)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(("parallel", "arbitrary"), bs),
        cost_estimate=pl.CostEstimate(
            flops=4 * n_pad * v * d,
            transcendentals=n_pad * v,
            bytes_accessed=v * d * (itemsize + 4) + grid[0] * n_pad * (d * itemsize + 4 * LANES),
        ),
        interpret=interpret,
        name="cutbce_background_d_item",
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


def _check_inputs(hidden, item_weight, bias, class_weight):
    for name, x in (("hidden", hidden), ("item_weight", item_weight)):
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"Pallas background kernels take float32 or bfloat16 {name}, got {x.dtype}: "
                "TPU has no float64 (use the blocked JAX path) and float16 should be cast to "
                "bfloat16"
            )
    if hidden.dtype != item_weight.dtype:
        raise TypeError(f"{hidden.dtype=} and {item_weight.dtype=} must match")
    if hidden.ndim != 2 or item_weight.ndim != 2 or hidden.shape[1] != item_weight.shape[1]:
        raise ValueError(f"expected hidden [N, D] and item_weight [V, D], got "
                         f"{hidden.shape} and {item_weight.shape}")
    v = item_weight.shape[0]
    for name, x in (("bias", bias), ("class_weight", class_weight)):
        if x is not None and x.shape != (v,):
            raise ValueError(f"{name} must have shape [V] = ({v},), got {x.shape}")


def _prepare(hidden, item_weight, bias, class_weight, block_sizes):
    """Pick and clip the tiles, pad hidden rows to a tile multiple, shape the row vectors."""
    _check_inputs(hidden, item_weight, bias, class_weight)
    n, d = hidden.shape
    v = item_weight.shape[0]
    bs = block_sizes or default_block_sizes(n, v, d, hidden.dtype)
    bs = bs.clipped(n, v)
    n_pad = -(-n // bs.block_n) * bs.block_n
    h = jnp.pad(hidden, ((0, n_pad - n), (0, 0))) if n_pad != n else hidden
    rows = [x.astype(jnp.float32).reshape(1, v) for x in (bias, class_weight) if x is not None]
    static = dict(n_pad=n_pad, v=v, d=d, bs=bs, has_bias=bias is not None,
                  has_cw=class_weight is not None)
    return h, rows, static


def pallas_background_forward(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    *,
    compute_counts: bool,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Dense background loss per row, without materializing `[N, V]` logits.

    Args:
        hidden: `[N, D]` float32 or bfloat16.
        item_weight: `[V, D]`, same dtype as hidden.
        bias: `[V]` (cast to float32) or None for 0.
        class_weight: `[V]` (cast to float32) or None for 1.
        compute_counts: also count the items with `z > 0` per row.
        block_sizes: tiles and VMEM limit; None derives them from the chip (`default_block_sizes`).

    Returns:
        `row_bg` `[N]` float32, `sum_v cw[v] * softplus(z[n, v])`, and `count_pos` `[N]` float32
        (unweighted count of `z > 0`) or None when `compute_counts` is False.

    Raises:
        TypeError: for float64 or float16 inputs, or mismatched dtypes.
    """
    n = hidden.shape[0]
    h, rows, static = _prepare(hidden, item_weight, bias, class_weight, block_sizes)
    call = functools.partial(_forward_call, compute_counts=compute_counts, **static)
    outs = _on_platform(call, h, item_weight, *rows)
    row_bg = jnp.sum(outs[0][:n], axis=1)
    count_pos = jnp.sum(outs[1][:n], axis=1) if compute_counts else None
    return row_bg, count_pos


def pallas_background_backward(
    hidden: jax.Array,
    item_weight: jax.Array,
    bias: jax.Array | None,
    class_weight: jax.Array | None,
    g: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Gradients of `sum_n g[n] * row_bg[n]` with respect to hidden, item_weight and bias.

    `dz[n, v] = g[n] * cw[v] * sigmoid(z[n, v])`; two kernels recompute the logits: one reduces over
    items for d_hidden, the other over positions for d_item_weight and d_bias.

    Args:
        hidden: `[N, D]` float32 or bfloat16.
        item_weight: `[V, D]`, same dtype as hidden.
        bias: `[V]` or None.
        class_weight: `[V]` or None.
        g: `[N]` upstream gradient of row_bg (cast to float32).
        block_sizes: tiles and VMEM limit; None derives them from the chip.

    Returns:
        `d_hidden` `[N, D]` float32, `d_item_weight` `[V, D]` float32, and `d_bias` `[V]` float32
        (None when bias is None).

    Raises:
        TypeError: for float64 or float16 inputs, or mismatched dtypes.
    """
    n = hidden.shape[0]
    if g.shape != (n,):
        raise ValueError(f"g must have shape [N] = ({n},), got {g.shape}")
    h, rows, static = _prepare(hidden, item_weight, bias, class_weight, block_sizes)
    g32 = g.astype(jnp.float32)
    acc = _on_platform(functools.partial(_d_hidden_call, **static), h, item_weight, *rows)
    d_hidden = g32[:, None] * acc[:n]
    # Padded rows get g = 0, so their (finite) sigmoids add nothing to d_item_weight or d_bias.
    g_lanes = jnp.broadcast_to(
        jnp.pad(g32, (0, static["n_pad"] - n))[:, None], (static["n_pad"], LANES)
    )
    outs = _on_platform(
        functools.partial(_d_item_call, **static), h, item_weight, *rows, g_lanes
    )
    d_bias = outs[1][0] if bias is not None else None
    return d_hidden, outs[0], d_bias
