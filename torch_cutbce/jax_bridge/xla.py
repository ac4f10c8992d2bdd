"""The torch_xla registrar of the JAX bridge: XLA tensors -> `call_jax` -> the shared op table.

Imported lazily (by `cut_bce_with_logits`, the first time it sees an XLA tensor), torch_xla
first: torch_xla must claim the TPU before JAX does (its `jax_import_guard`). What each op
computes, its fake, its autograd rule and the argument preparation are `jax_bridge/ops.py`'s (shared
with TorchTPU's registrar, jax_bridge/tpu.py); this module only registers them:

    nn.Module / cut_bce_with_logits ('none')
      -> torch.ops.cutbce.xla_rows        a torch.library custom op; `register_autograd` makes it an
                                          autograd.Function, `register_fake` lets dynamo see it as
                                          one opaque node (`torch.compile(backend='openxla',
                                          fullgraph=True)` works)
      -> call_jax(jax_half.jax_forward) lowers the JAX function to HLO once per shape and splices
                                          it into torch_xla's lazy graph (same graph as the model)
      -> Pallas kernels on TPU, the blocked pure-JAX loop elsewhere (or Pallas in interpret mode)
    backward: cutbce::xla_rows_backward -> call_jax(jax_half.jax_backward)
    'sum' / 'mean': cutbce::xla_weighted_sum -> call_jax(jax_half.jax_weighted_sum): the
      gradients come out of the forward; its backward only scales them

With a mesh (`options.mesh_shape`) the same ops lower `jax_kernels.sharded`'s shard_map over an
AbstractMesh instead. `call_jax` caches lowerings by `id(fn)`: the table's functions are
module-level and must stay so.
"""

from __future__ import annotations

import torch
import torch_xla  # noqa: F401  (before jax: torch_xla claims the device first)
import torch_xla.core.xla_builder as xb
import torch_xla.runtime as xr

from torch_xla._internal.jax_workarounds import jax_import_guard

jax_import_guard()

import jax_kernels.bridge as jax_half  # noqa: E402  (imports jax)
from jax_kernels.bridge import trace_count  # noqa: E402,F401  (the tests count lowerings)
from torch_cutbce.jax_bridge import ops  # noqa: E402

from cutbce_common.options import CutBCEOptions  # noqa: E402


def _on_tpu() -> bool:
    return xr.device_type() == "TPU"


def _static(options: str, hidden: torch.Tensor, item_weight: torch.Tensor) -> dict:
    return jax_half.jax_static(options, hidden.shape[0], item_weight.shape[0], ops.dtype_name(hidden),
                                 _on_tpu())


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
    """Rows `[N]` and counts `[4 or 0, N]` of `jax_half.jax_forward`, computed through call_jax."""
    static = _static(options, hidden, item_weight)
    rows, counts = xb.call_jax(jax_half.jax_forward, (hidden, item_weight, targets, bias, class_weight,
                                                        pos_weight), static)
    return rows, counts


xla_rows.register_fake(ops.rows_fake)


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
    """`[d_hidden, d_item_weight]` (+ `d_bias` when bias is given) from `jax_half.jax_backward`."""
    d_hidden, d_item_weight, d_bias = xb.call_jax(
        jax_half.jax_backward, (hidden, item_weight, targets, bias, class_weight, pos_weight, g),
        _static(options, hidden, item_weight),
    )
    return [d_hidden, d_item_weight] + ([] if bias is None else [d_bias])


@xla_rows_backward.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, g, options):
    return ops.backward_fake(hidden, item_weight, bias, placeholder=False)


_rows_grad, _rows_setup = ops.rows_autograd(xla_rows_backward)
xla_rows.register_autograd(_rows_grad, setup_context=_rows_setup)


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
    """`[loss, counts, rows, d_hidden, d_item_weight, d_bias or an empty placeholder]` of
    `jax_half.jax_weighted_sum`."""
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight)
    return list(xb.call_jax(jax_half.jax_weighted_sum, args, _static(options, hidden, item_weight)))


@xla_weighted_sum.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, options):
    return ops.weighted_sum_fake(hidden, item_weight, bias, options, on_tpu=_on_tpu())


xla_weighted_sum.register_autograd(ops.weighted_sum_backward, setup_context=ops.weighted_sum_setup)

OPS = ops.Registered(rows=xla_rows, weighted_sum=xla_weighted_sum, on_tpu=_on_tpu)


def resolve_impl(options: CutBCEOptions, dtype: torch.dtype) -> str:
    """The JAX engine `options.impl` names for XLA inputs of `dtype` ('auto': Pallas on a TPU for
    float32 / bfloat16). Raises TypeError for impl='pallas' with another dtype."""
    return ops.resolve_impl(options, str(dtype).removeprefix("torch."), _on_tpu())


def cut_bce_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight,
                         options: CutBCEOptions):
    """`(sum_n row_weight[n] rows[n], counts [4 or 0, N])`, gradients computed in the forward: the
    'sum' / 'mean' loss in one pass over the tiles, on one device or under an SPMD mesh (`options`
    as in `cut_bce_rows`; each device's pass covers its own slice of the table and of the positions).

    `row_weight` `[N]` is the position weight over the reduction's divisor; it gets the rows as
    its gradient.
    """
    return ops.cut_bce_weighted_sum(OPS, hidden, item_weight, targets, bias, class_weight, pos_weight,
                                    row_weight, options)


def cut_bce_rows(hidden, item_weight, targets, bias, class_weight, pos_weight, options: CutBCEOptions):
    """Rows `[N]` and counts `[4 or 0, N]` for `cut_bce_with_logits` (the one argument order).

    `options.mesh_shape` / `mesh_axes` (`torch_cutbce.arguments.mesh_layout` of a
    `torch_xla.distributed.spmd.Mesh` whose device ids are 0..n-1 in order: the JAX side lowers
    over an AbstractMesh of the same shape and axis names, i.e. row-major logical ids) run the call
    sharded under torch_xla SPMD; `()` runs it on one device.
    """
    return ops.cut_bce_rows(OPS, hidden, item_weight, targets, bias, class_weight, pos_weight, options)
