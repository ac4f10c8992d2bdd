"""The `pallas_call`s of CutBCE's Pallas kernels: grids, BlockSpecs, scratch, cost estimates.

Each builder takes the launcher's operands (`launch._prepare`) and its static options as keywords,
plus `interpret`; `on_platform` picks `interpret` by the platform the computation is lowered for
(docs/toolchain.md, 'Pallas on a CPU'). The kernel bodies are in `kernels.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_kernels.pallas.block_sizes import LANES
from jax_kernels.pallas.kernels import d_hidden_kernel, d_item_kernel, forward_kernel


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


def _loss_transcendentals(static):
    """Per element, the loss's exps and logs beyond plain BCE's (`Loss.transcendentals`)."""
    return static["loss"].transcendentals()


def _num_row_outputs(compute_counts, flags):
    """The `[N, 128]` lane-partial outputs: the loss, then predicted and (with ids) hits."""
    return 1 + compute_counts * (1 + flags[3])


def forward_call(*operands, interpret, compute_counts, **static):
    """The rows (and counts) as `[n_pad, 128]` f32 lane-partial sums (`forward_kernel`)."""
    n_pad, v, d, bs, flags = (static[k] for k in ("n_pad", "v", "d", "bs", "flags"))
    grid = (n_pad // bs.block_n, pl.cdiv(v, bs.block_v))
    n_out = _num_row_outputs(compute_counts, flags)
    kernel = functools.partial(forward_kernel, flags=flags, compute_counts=compute_counts,
                               loss=static["loss"],
                               ragged_v=v % bs.block_v != 0, v_total=v, block_v=bs.block_v,
                               items_in_lanes=static["items_in_lanes"])
    return _pallas(
        kernel,
        bs=bs,
        scratch_shapes=[pltpu.VMEM((bs.block_n, LANES), jnp.float32)],  # the rows' rounding errors
        cost=_cost(static, operands[0].dtype.itemsize, matmuls=1,
                   transcendentals=2 + _loss_transcendentals(static),
                   table_passes=grid[0], token_passes=1, written=n_out * n_pad * LANES * 4),
        grid=grid,
        in_specs=_input_specs(flags, bs, d, static["num_slots"], static["items_in_lanes"],
                              token_axis=0),
        out_specs=[pl.BlockSpec((bs.block_n, LANES), lambda i, j: (i, 0))] * n_out,
        out_shape=[jax.ShapeDtypeStruct((n_pad, LANES), jnp.float32)] * n_out,
        interpret=interpret,
        name="cutbce_rows_fwd",
    )(*operands)


def d_hidden_call(*operands, interpret, with_rows=False, compute_counts=False, **static):
    """`[n_pad, D]` f32 `(dz / g) @ W` (`d_hidden_kernel`); with `with_rows` a list: it, then the
    forward's lane-partial outputs (rows, and with compute_counts predicted and hits)."""
    n_pad, v, d, bs, flags = (static[k] for k in ("n_pad", "v", "d", "bs", "flags"))
    grid = (n_pad // bs.block_n, pl.cdiv(v, bs.block_v))
    n_rows = _num_row_outputs(compute_counts, flags) if with_rows else 0
    kernel = functools.partial(d_hidden_kernel, flags=flags, with_rows=with_rows,
                               compute_counts=compute_counts, loss=static["loss"],
                               ragged_v=v % bs.block_v != 0,
                               v_total=v, block_v=bs.block_v,
                               items_in_lanes=static["items_in_lanes"])
    out_specs = pl.BlockSpec((bs.block_n, d), lambda i, j: (i, 0))
    out_shape = jax.ShapeDtypeStruct((n_pad, d), jnp.float32)
    if with_rows:
        out_specs = [out_specs, *[pl.BlockSpec((bs.block_n, LANES), lambda i, j: (i, 0))] * n_rows]
        out_shape = [out_shape, *[jax.ShapeDtypeStruct((n_pad, LANES), jnp.float32)] * n_rows]
    # The rounding errors of d_hidden and (with_rows) of the rows.
    errors = [pltpu.VMEM((bs.block_n, d), jnp.float32)] + [pltpu.VMEM((bs.block_n, LANES), jnp.float32)] * with_rows
    return _pallas(
        kernel,
        bs=bs,
        scratch_shapes=errors,
        # With the rows: softplus's log1p on top of the exp that sigmoid and softplus share (a
        # non-plain loss needs the log1p for its gradient too, and its own).
        cost=_cost(static, operands[0].dtype.itemsize, matmuls=2,
                   transcendentals=1 + max(with_rows, not static["loss"].plain)
                   + _loss_transcendentals(static), table_passes=grid[0], token_passes=1,
                   written=n_pad * (d + n_rows * LANES) * 4),
        grid=grid,
        in_specs=_input_specs(flags, bs, d, static["num_slots"], static["items_in_lanes"],
                              token_axis=0),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="cutbce_rows_value_and_d_hidden" if with_rows else "cutbce_rows_d_hidden",
    )(*operands)


def d_item_call(*operands, interpret, **static):
    """d_item_weight `[V, D]` (`[D, V]` when `items_in_lanes`) in the table's dtype, then d_bias
    `[1, V]` f32 when there is a bias (`d_item_kernel`); the last operand is g lane-replicated."""
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
        functools.partial(d_item_kernel, flags=flags, block_v=bv, items_in_lanes=items_in_lanes,
                          loss=static["loss"]),
        bs=bs,
        scratch_shapes=accumulator,
        # The lane-replicated g is read with hidden, once per item tile.
        cost=_cost(static, operands[0].dtype.itemsize, matmuls=2,
                   transcendentals=1 + (not static["loss"].plain) + _loss_transcendentals(static),
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


def on_platform(call, *operands):
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
