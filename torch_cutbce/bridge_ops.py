"""The op table both JAX bridges share: what each custom op computes, its fake, its autograd rule,
and the argument preparation around it. Only the registrar differs (how a torch tensor reaches
JAX): torch_xla's `call_jax` (xla_bridge.py) or TorchTPU's `torch.tpu.pallas.jax_op` (tpu_bridge.py).

    rows            jax_forward       (rows [N], counts [4 or 0, N])     cut_bce_forward
    rows_backward   jax_backward      (d_hidden, d_items, d_bias)        cut_bce_backward
    weighted_sum    jax_weighted_sum  (loss, counts, rows, grads...)     cut_bce_value_and_grad

Each op takes its tensors plus one `options: str` (`CutBCEOptions.encode()`); `jax_static`
decodes it into the JAX `CutBCEConfig` (`core.call_config`) and, with a mesh, the sharded layout.
Output structures never vary with the options (a missing d_bias is an empty placeholder):
torch_xla 2.9's `call_jax` keeps one output tree per function, and a `jax_op`'s schema is its
return annotation. The JAX functions are module-level: `call_jax` caches lowerings by `id(fn)`.

Imported only by a registrar, after it has imported its framework (torch_xla must claim the device
before jax is imported): this module imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import torch

import jax_kernels.core as jax_core
import jax_kernels.sharded as jax_sharded
from jax_kernels.neutral.options import CutBCEOptions, decode
from jax_kernels.neutral.shapes import choose_impl
from torch_cutbce.positives import accumulation_dtype

_trace_count = 0


def trace_count() -> int:
    """How many times the table's JAX functions were traced (i.e. lowered by a registrar) so far."""
    return _trace_count


def _traced():
    global _trace_count
    _trace_count += 1  # runs at trace time only: counts lowerings, not calls


def _placeholder(d_bias, d_items):
    return jnp.zeros((0,), d_items.dtype) if d_bias is None else d_bias


def jax_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, *, config, layout):
    """Rows `[N]` and counts `[4 or 0, N]` (`cut_bce_forward`, or its shard_map twin under a mesh)."""
    _traced()
    if layout is None:
        return jax_core.cut_bce_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, config=config)
    return jax_sharded.sharded_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, layout=layout)


def jax_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, config, layout):
    """`(d_hidden, d_item_weight, d_bias or an empty placeholder)` for the rows' upstream `g` `[N]`."""
    _traced()
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, g)
    if layout is None:
        d_hidden, d_items, d_bias = jax_core.cut_bce_backward(*args, config=config)
    else:
        d_hidden, d_items, d_bias = jax_sharded.sharded_backward(*args, layout=layout)
    return d_hidden, d_items, _placeholder(d_bias, d_items)


def jax_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, *, config, layout):
    """`sum_n row_weight[n] rows[n]`, the `[4 or 0, N]` counts, the rows, and the gradients for an
    upstream 1 (accumulation dtype; Pallas's table gradient in the table's dtype), in one pass over
    the tiles (`cut_bce_value_and_grad`; under a mesh `sharded_value_and_grad`)."""
    _traced()
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight)
    if layout is None:
        (rows, counts), (d_hidden, d_items, d_bias) = jax_core.cut_bce_value_and_grad(*args, config=config)
    else:
        (rows, counts), (d_hidden, d_items, d_bias) = jax_sharded.sharded_value_and_grad(*args, layout=layout)
    loss = (rows * row_weight.astype(rows.dtype)).sum()
    # The placeholder in the accumulation dtype (d_hidden's), not the table gradient's: Pallas gives
    # that one in the table's dtype, and the fake says float32.
    return loss, counts, rows, d_hidden, d_items, _placeholder(d_bias, d_hidden)


def resolve_impl(options: CutBCEOptions, dtype_name: str, on_tpu: bool) -> str:
    """The JAX engine `options.impl` names for inputs of `dtype_name` ('float32', ...): 'auto' is
    Pallas on a TPU for float32 / bfloat16 (`shapes.choose_impl`). Raises TypeError for
    impl='pallas' with another dtype."""
    return choose_impl(options.impl, dtype_name, on_tpu)


def jax_static(options: str, num_positions: int, num_items: int, dtype_name: str, on_tpu: bool) -> dict:
    """The JAX functions' keyword arguments for an op's `options` string: the config and the sharded
    layout (None without a mesh); both hashable (`call_jax`'s cache key)."""
    o = decode(options)
    # cpu_kernel=False: neither bridge's runtime registers the blocked loop's C kernel (an XLA FFI
    # target of jax's own CPU client); the jnp tiles compute the same. call_config sizes a default
    # tile for the whole problem (N x V), as the torch entry once did.
    config = jax_core.call_config(block_v=o.block_v, num_positions=num_positions, num_items=num_items,
                                  impl=resolve_impl(o, dtype_name, on_tpu), compute_metrics=o.compute_metrics,
                                  loss=o.loss, cpu_kernel=False)
    if not o.mesh_shape:
        return {"config": config, "layout": None}
    layout = jax_sharded.abstract_layout(o.mesh_shape, o.mesh_axes, o.vocab_axis, o.data_axis, config)
    return {"config": config, "layout": layout}


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# Fakes: output shapes and dtypes only, so symbolic N works under torch.compile.

def rows_fake(hidden, item_weight, targets, bias, class_weight, pos_weight, options):
    n = hidden.shape[0]
    rows = hidden.new_empty((n,), dtype=accumulation_dtype(hidden.dtype))
    return rows, hidden.new_empty((4 if decode(options).compute_metrics else 0, n), dtype=torch.float32)


def backward_fake(hidden, item_weight, bias, *, placeholder: bool) -> list[torch.Tensor]:
    """`[d_hidden, d_item_weight]` + `[d_bias]` (or, with `placeholder`, an empty one without bias)."""
    grads = [torch.empty_like(hidden), torch.empty_like(item_weight)]
    if bias is not None:
        return grads + [torch.empty_like(bias)]
    return grads + ([item_weight.new_empty((0,))] if placeholder else [])


def weighted_sum_fake(hidden, item_weight, bias, options, *, on_tpu: bool) -> list[torch.Tensor]:
    o = decode(options)
    n, acc = hidden.shape[0], accumulation_dtype(hidden.dtype)
    # The Pallas table gradient comes in the table's dtype (no table-sized float32 buffer on TPU).
    items_dtype = item_weight.dtype if resolve_impl(o, dtype_name(hidden), on_tpu) == "pallas" else acc
    return [hidden.new_empty((), dtype=acc),
            hidden.new_empty((4 if o.compute_metrics else 0, n), dtype=torch.float32),
            hidden.new_empty((n,), dtype=acc), torch.empty_like(hidden, dtype=acc),
            torch.empty_like(item_weight, dtype=items_dtype),
            hidden.new_empty(bias.shape if bias is not None else (0,), dtype=acc)]


# Autograd rules.

def enable_x64(on: bool):
    """JAX's thread-local 64-bit mode switch (`jax.enable_x64` from jax 0.8, before it
    `jax.experimental.enable_x64`)."""
    switch = getattr(jax, "enable_x64", None)
    if switch is None:
        import jax.experimental as jax_experimental  # binds no local `jax`

        switch = jax_experimental.enable_x64
    return switch(on)


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def rows_autograd(backward_op: Callable) -> tuple[Callable, Callable]:
    """`(backward, setup_context)` of a rows op whose backward is `backward_op` (the same inputs
    plus the rows' upstream gradient): saves the inputs only, no `[N, V]` residual."""

    def setup_context(ctx, inputs, output):
        hidden, item_weight, targets, bias, class_weight, pos_weight, options = inputs
        ctx.save_for_backward(hidden, item_weight, targets, bias, class_weight, pos_weight)
        ctx.options = options
        ctx.x64 = x64_enabled()  # the forward's mode, for the backward's own lowering
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, g_rows, _g_counts):
        hidden, item_weight, targets, bias, class_weight, pos_weight = ctx.saved_tensors
        # Autograd may run this on another thread, where the forward thread's x64 context does not
        # hold: lower the backward in the forward's mode (float64 stays float64).
        with enable_x64(ctx.x64):
            grads = backward_op(hidden, item_weight, targets, bias, class_weight, pos_weight, g_rows, ctx.options)
        d_bias = grads[2] if bias is not None else None
        return grads[0], grads[1], None, d_bias, None, None, None

    return backward, setup_context


def weighted_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2], *output[3:])
    ctx.dtypes = [None if x is None else x.dtype for x in (inputs[0], inputs[1], inputs[3])]
    ctx.mark_non_differentiable(*output[1:])


def weighted_sum_backward(ctx, *output_grads):
    """The one-pass op's gradients: those of its forward scaled by the loss's upstream gradient."""
    # A list-returning op (torch_xla's) gets its output gradients as one list, a tuple-returning
    # one (TorchTPU's) as one argument each.
    g_loss = output_grads[0][0] if isinstance(output_grads[0], (list, tuple)) else output_grads[0]
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


# Argument preparation and the two entries every registrar exposes.

def int32_targets(targets: torch.Tensor, num_items: int) -> torch.Tensor:
    """Item ids fit int32 (V < 2**31) and JAX without 64-bit mode reads int32. Ids outside [0, V)
    become -1 BEFORE the narrowing cast (an int64 -2**32 would otherwise wrap to item 0); on a
    device they cannot be checked without a host sync, so they are ignored like padding (documented)."""
    targets = targets.long()  # int8/uint8/int16 ids would compare with V wrapped to their range
    valid = (targets >= 0) & (targets < num_items)
    return torch.where(valid, targets, torch.full_like(targets, -1)).to(torch.int32)


def check_x64(hidden: torch.Tensor) -> None:
    if hidden.dtype == torch.float64 and not x64_enabled():
        raise TypeError(
            "float64 tensors through the JAX bridge need JAX's 64-bit mode: "
            "jax.config.update('jax_enable_x64', True)"
        )


@dataclasses.dataclass(frozen=True)
class Registered:
    """One registrar's ops: `rows(hidden, item_weight, targets, bias, class_weight, pos_weight,
    options)` and `weighted_sum(..., row_weight, options)`, and whether its device is a TPU."""

    rows: Callable
    weighted_sum: Callable
    on_tpu: Callable[[], bool]


def _checked_targets(ops: Registered, hidden, item_weight, targets, options: CutBCEOptions) -> torch.Tensor:
    """What both entries check before their op (64-bit mode, the impl for this dtype), and their
    targets as int32 ids."""
    check_x64(hidden)
    resolve_impl(options, dtype_name(hidden), ops.on_tpu())  # impl='pallas' with float16 raises here
    return int32_targets(targets, item_weight.shape[0])


def cut_bce_rows(ops: Registered, hidden, item_weight, targets, bias, class_weight, pos_weight,
                 options: CutBCEOptions):
    """Rows `[N]` and counts `[4 or 0, N]` through `ops.rows` (the one argument order)."""
    targets = _checked_targets(ops, hidden, item_weight, targets, options)
    return ops.rows(hidden, item_weight, targets, bias, class_weight, pos_weight, options.encode())


def cut_bce_weighted_sum(ops: Registered, hidden, item_weight, targets, bias, class_weight, pos_weight,
                         row_weight, options: CutBCEOptions):
    """`(sum_n row_weight[n] rows[n], counts [4 or 0, N])` through `ops.weighted_sum`, gradients
    computed in the forward; `row_weight` `[N]` gets the rows as its gradient."""
    targets = _checked_targets(ops, hidden, item_weight, targets, options)
    out = ops.weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight,
                           options.encode())
    return out[0], out[1]

