"""The torch half both JAX bridges share: each custom op's fake, its autograd rule, and the
argument preparation around it. What each op computes is the JAX half, `jax_kernels/bridge.py`
(`jax_forward`, `jax_backward`, `jax_weighted_sum`, `jax_static`). Only the registrar differs (how
a torch tensor reaches JAX): torch_xla's `call_jax` (jax_bridge/xla.py) or TorchTPU's
`torch.tpu.pallas.jax_op` (jax_bridge/tpu.py).

Imported only by a registrar, after it has imported its framework (torch_xla must claim the device
before jax is imported): the JAX half imports jax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from jax_kernels.bridge import enable_x64, jax_static, resolve_impl, x64_enabled  # noqa: F401  (the registrars')
from cutbce_common.options import CutBCEOptions, decode
from torch_cutbce.positives import accumulation_dtype

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

