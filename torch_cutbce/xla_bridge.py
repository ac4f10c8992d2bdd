"""The torch_xla bridge: XLA tensors -> `call_jax` -> the JAX CutBCE forward and backward.

This is the only module of torch_cutbce that imports torch_xla or jax, and it is imported lazily
(by `cut_bce_with_logits`, the first time it sees an XLA tensor), torch_xla first: torch_xla must
claim the TPU before JAX does (its `jax_import_guard`).

How the pieces connect:

    nn.Module / cut_bce_with_logits ('none')
      -> torch.ops.cutbce.xla_rows        a torch.library custom op; `register_autograd` makes it an
                                          autograd.Function, `register_fake` lets dynamo see it as
                                          one opaque node (`torch.compile(backend='openxla',
                                          fullgraph=True)` works)
      -> call_jax(_jax_forward, ...)      lowers the JAX function to HLO once per shape and splices
                                          it into torch_xla's lazy graph (same graph as the model)
      -> jax_kernels.cut_bce_forward      the same function the jax.custom_vjp uses
      -> Pallas kernels on TPU, the blocked pure-JAX loop elsewhere (or Pallas in interpret mode)
    backward: torch.ops.cutbce.xla_rows_backward -> call_jax(_jax_backward) -> cut_bce_backward
    'sum' / 'mean': torch.ops.cutbce.xla_weighted_sum -> call_jax(_jax_weighted_sum)
      -> cut_bce_value_and_grad (one device) or sharded_value_and_grad (mesh): the gradients come
      out of the forward; its backward only scales them

Each op takes its tensors plus one `options: str` (`CutBCEOptions.encode()`: tile width, metrics,
focal, the JAX impl, the mesh layout); `_static` decodes it and builds the JAX `CutBCEConfig` (and
the sharded layout) in one place.

With a mesh the same ops lower `jax_kernels.sharded`'s shard_map over an AbstractMesh instead.
Saved for the backward: the inputs only (no `[N, V]` or `[N, block_v]` residual); the one-pass op
saves its rows and gradients.
`call_jax` caches lowerings by `id(fn)`: `_jax_forward`, `_jax_backward` and `_jax_weighted_sum` are
module-level and must stay so (a closure or lambda would retrace and grow the cache on every step).
"""

from __future__ import annotations

import torch
import torch_xla  # noqa: F401  (before jax: torch_xla claims the device first)
import torch_xla.core.xla_builder as xb
import torch_xla.runtime as xr

from torch_xla._internal.jax_workarounds import jax_import_guard

jax_import_guard()

import jax  # noqa: E402
import jax.experimental  # noqa: E402  (enable_x64: the backward runs in the forward's mode)
import jax.numpy as jnp  # noqa: E402

import jax_kernels.core as jax_core  # noqa: E402
from jax_kernels.neutral.options import CutBCEOptions, decode  # noqa: E402
from jax_kernels.neutral.shapes import choose_impl  # noqa: E402
from torch_cutbce.positives import accumulation_dtype  # noqa: E402
import jax_kernels.sharded as jax_sharded  # noqa: E402

_trace_count = 0


def trace_count() -> int:
    """How many times the bridge's JAX functions were traced (i.e. lowered by call_jax) so far."""
    return _trace_count


def _jax_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, *, config, layout):
    global _trace_count
    _trace_count += 1  # runs at trace time only: counts lowerings, not calls
    if layout is None:
        return jax_core.cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, config=config)
    return jax_sharded.sharded_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, layout=layout)


def _jax_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, config, layout):
    global _trace_count
    _trace_count += 1
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, g)
    if layout is None:
        d_hidden, d_items, d_bias = jax_core.cut_bce_backward(*args, config=config)
    else:
        d_hidden, d_items, d_bias = jax_sharded.sharded_backward(*args, layout=layout)
    # torch_xla 2.9's call_jax keeps one output tree per function (its latest trace's) and
    # unflattens every cached lowering with it: (dh, dw, None) after (dh, dw, db) would fail. So
    # the structure never varies; the empty placeholder is dropped on the torch side.
    return d_hidden, d_items, jnp.zeros((0,), d_items.dtype) if d_bias is None else d_bias


def _jax_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, *, config, layout):
    """`sum_n row_weight[n] rows[n]`, the `[4 or 0, N]` counts, the rows, and the gradients for an
    upstream 1, in one pass over the tiles (`cut_bce_value_and_grad`, blocked or Pallas; under a
    mesh its shard_map twin `sharded_value_and_grad`)."""
    global _trace_count
    _trace_count += 1
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight)
    if layout is None:
        (rows, counts), (d_hidden, d_items, d_bias) = jax_core.cut_bce_value_and_grad(*args, config=config)
    else:
        (rows, counts), (d_hidden, d_items, d_bias) = jax_sharded.sharded_value_and_grad(*args, layout=layout)
    loss = (rows * row_weight.astype(rows.dtype)).sum()
    # One output structure whatever the inputs (see _jax_backward); gradients in the accumulation dtype.
    return loss, counts, rows, d_hidden, d_items, jnp.zeros((0,), d_items.dtype) if d_bias is None else d_bias


def resolve_impl(options: CutBCEOptions, dtype: torch.dtype) -> str:
    """The JAX engine `options.impl` names for inputs of `dtype` (`shapes.choose_impl`): 'auto' is
    Pallas on a TPU for float32 / bfloat16. Raises TypeError for impl='pallas' with another dtype."""
    return choose_impl(options.impl, str(dtype).removeprefix("torch."), xr.device_type() == "TPU")


def _static(options: str, hidden: torch.Tensor, item_weight: torch.Tensor) -> dict:
    """The call_jax keyword arguments of an op's `options` string: the config, and the sharded
    layout when the options name a mesh (both hashable: call_jax's cache key)."""
    o = decode(options)
    # cpu_kernel=False: torch_xla runs its own XLA build, where the FFI target of the blocked loop's C
    # kernel is not registered (jax_kernels/blocked/negative_tile.py); the jnp tiles compute the same.
    # call_config sizes a default tile for the whole problem (N x V), as the torch entry once did.
    config = jax_core.call_config(block_v=o.block_v, num_positions=hidden.shape[0], num_items=item_weight.shape[0],
                                  impl=resolve_impl(o, hidden.dtype), compute_metrics=o.compute_metrics,
                                  focal=o.focal, cpu_kernel=False)
    if not o.mesh_shape:
        return {"config": config, "layout": None}
    layout = jax_sharded.abstract_layout(o.mesh_shape, o.mesh_axes, o.vocab_axis, o.data_axis, config)
    return {"config": config, "layout": layout}


def _rows_dtype(hidden: torch.Tensor) -> torch.dtype:
    return accumulation_dtype(hidden.dtype)


@torch.library.custom_op("cutbce::xla_rows", mutates_args=())
def xla_rows(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    pos_weight: torch.Tensor | None,
    options: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[N]` and counts `[4 or 0, N]` of `jax_kernels.cut_bce_forward`, computed through call_jax."""
    static = _static(options, hidden, item_weight)
    rows, counts = xb.call_jax(_jax_forward, (hidden, item_weight, targets, bias, class_weight, pos_weight), static)
    return rows, counts


@xla_rows.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, options):
    n = hidden.shape[0]
    rows = hidden.new_empty((n,), dtype=_rows_dtype(hidden))
    return rows, hidden.new_empty((4 if decode(options).compute_metrics else 0, n), dtype=torch.float32)


@torch.library.custom_op("cutbce::xla_rows_backward", mutates_args=())
def xla_rows_backward(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    pos_weight: torch.Tensor | None,
    g: torch.Tensor,
    options: str,
) -> list[torch.Tensor]:
    """`[d_hidden, d_item_weight]` (+ `d_bias` when bias is given) from `jax_kernels.cut_bce_backward`."""
    d_hidden, d_item_weight, d_bias = xb.call_jax(
        _jax_backward, (hidden, item_weight, targets, bias, class_weight, pos_weight, g),
        _static(options, hidden, item_weight),
    )
    return [d_hidden, d_item_weight] + ([] if bias is None else [d_bias])


@xla_rows_backward.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, g, options):
    grads = [torch.empty_like(hidden), torch.empty_like(item_weight)]
    return grads + ([] if bias is None else [torch.empty_like(bias)])


def _setup_context(ctx, inputs, output):
    hidden, item_weight, targets, bias, class_weight, pos_weight, options = inputs
    ctx.save_for_backward(hidden, item_weight, targets, bias, class_weight, pos_weight)
    ctx.options = options
    ctx.x64 = bool(jax.config.jax_enable_x64)  # the forward's mode, for the backward's own lowering
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g_rows, _g_counts):
    hidden, item_weight, targets, bias, class_weight, pos_weight = ctx.saved_tensors
    # Autograd may run this on another thread, where a `jax.experimental.enable_x64` context of the
    # forward's thread does not hold: lower the backward in the forward's mode (float64 stays float64).
    with jax.experimental.enable_x64(ctx.x64):
        grads = xla_rows_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g_rows,
                                  ctx.options)
    d_bias = grads[2] if bias is not None else None
    return grads[0], grads[1], None, d_bias, None, None, None


xla_rows.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cutbce::xla_weighted_sum", mutates_args=())
def xla_weighted_sum(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    pos_weight: torch.Tensor | None,
    row_weight: torch.Tensor,
    options: str,
) -> list[torch.Tensor]:
    """`[loss, counts, rows, d_hidden, d_item_weight, d_bias or an empty placeholder]` of `_jax_weighted_sum`."""
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight)
    return list(xb.call_jax(_jax_weighted_sum, args, _static(options, hidden, item_weight)))


@xla_weighted_sum.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, options):
    o = decode(options)
    n, acc = hidden.shape[0], _rows_dtype(hidden)
    # The Pallas table gradient comes in the table's dtype (no table-sized float32 buffer on TPU).
    items_dtype = item_weight.dtype if resolve_impl(o, hidden.dtype) == "pallas" else acc
    return [hidden.new_empty((), dtype=acc),
            hidden.new_empty((4 if o.compute_metrics else 0, n), dtype=torch.float32),
            hidden.new_empty((n,), dtype=acc), torch.empty_like(hidden, dtype=acc),
            torch.empty_like(item_weight, dtype=items_dtype),
            hidden.new_empty(bias.shape if bias is not None else (0,), dtype=acc)]


def _weighted_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], *output[3:])
    ctx.dtypes = [None if x is None else x.dtype for x in (inputs[0], inputs[1], inputs[3])]
    ctx.mark_non_differentiable(*output[1:])


def _weighted_sum_backward(ctx, output_grads):
    g_loss = output_grads[0]  # a list-returning op gets its output gradients as one list
    rows, d_hidden, d_items, d_bias = ctx.saved_tensors  # gradients in the accumulation dtype
    need = ctx.needs_input_grad

    acc = rows.dtype

    def scaled(grad, dtype):  # scaled in the accumulation dtype, then rounded to the input's dtype
        return (grad.to(acc) * g_loss.to(acc)).to(dtype)

    d_hidden, d_items = (scaled(d, dtype) if n else None
                         for d, dtype, n in zip((d_hidden, d_items), ctx.dtypes[:2], need[:2]))
    d_bias = scaled(d_bias, ctx.dtypes[2]) if need[3] else None
    d_row_weight = (rows * g_loss.to(rows.dtype)) if need[6] else None
    return d_hidden, d_items, None, d_bias, None, None, d_row_weight, None


xla_weighted_sum.register_autograd(_weighted_sum_backward, setup_context=_weighted_sum_setup)


def _xla_targets(targets: torch.Tensor, num_items: int) -> torch.Tensor:
    """Item ids fit int32 (V < 2**31) and JAX without 64-bit mode reads int32. Ids outside [0, V)
    become -1 BEFORE the narrowing cast (an int64 -2**32 would otherwise wrap to item 0); on XLA
    they cannot be checked without a host sync, so they are ignored like padding (documented)."""
    targets = targets.long()  # int8/uint8/int16 ids would compare with V wrapped to their range
    valid = (targets >= 0) & (targets < num_items)
    return torch.where(valid, targets, torch.full_like(targets, -1)).to(torch.int32)


def _check_x64(hidden: torch.Tensor) -> None:
    if hidden.dtype == torch.float64 and not jax.config.jax_enable_x64:
        raise TypeError(
            "float64 tensors on XLA need JAX's 64-bit mode: jax.config.update('jax_enable_x64', True)"
        )


def _checked_targets(hidden, item_weight, targets, options: CutBCEOptions) -> torch.Tensor:
    """What both entries below check before their op (64-bit mode, the impl for this dtype), and
    their targets as int32 ids."""
    _check_x64(hidden)
    resolve_impl(options, hidden.dtype)  # impl='pallas' with float16 / float64 raises here, not inside
    return _xla_targets(targets, item_weight.shape[0])


def cut_bce_weighted_sum(hidden, item_weight, bias, class_weight, pos_weight, targets, row_weight,
                         options: CutBCEOptions):
    """`(sum_n row_weight[n] rows[n], counts [4 or 0, N])`, gradients computed in the forward: the
    'sum' / 'mean' loss in one pass over the tiles, on one device or under an SPMD mesh (`options`
    as in `cut_bce_rows`; each device's pass covers its own slice of the table and of the positions).

    `row_weight` `[N]` is the position weight over the reduction's divisor; it gets the rows as
    its gradient.
    """
    targets = _checked_targets(hidden, item_weight, targets, options)
    out = xla_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight,
                           options.encode())
    return out[0], out[1]


def cut_bce_rows(hidden, item_weight, bias, class_weight, pos_weight, targets, options: CutBCEOptions):
    """Rows `[N]` and counts `[4 or 0, N]` for `cut_bce_with_logits` (same argument order as the native op).

    `options.mesh_shape` / `mesh_axes` (`torch_cutbce.arguments.mesh_layout` of a
    `torch_xla.distributed.spmd.Mesh` whose device ids are 0..n-1 in order: the JAX side lowers
    over an AbstractMesh of the same shape and axis names, i.e. row-major logical ids) run the call
    sharded under torch_xla SPMD; `()` runs it on one device.
    """
    targets = _checked_targets(hidden, item_weight, targets, options)
    return xla_rows(hidden, item_weight, targets, bias, class_weight, pos_weight, options.encode())
