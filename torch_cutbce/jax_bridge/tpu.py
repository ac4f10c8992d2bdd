"""The TorchTPU registrar of the JAX bridge: `tpu` tensors -> `torch.tpu.pallas.jax_op` -> the
shared op table (`jax_bridge/ops.py`; the torch_xla registrar is jax_bridge/xla.py).

Imported lazily (by `cut_bce_with_logits` with backend='torch_tpu', or 'auto' on a `tpu` tensor).
`jax_op` registers a JAX function as a torch custom op from its annotations: the tensors are
`jax.Array` (`jax.Array | None` becomes `Tensor?`), `options: str` is a static jit argument, and
the op runs the function's `jax.export` for TPU (`platforms=['tpu']`) inside TorchTPU's graph:

    cutbce_tpu::rows            -> jax_half.jax_forward       (rows, counts)
    cutbce_tpu::rows_backward   -> jax_half.jax_backward      (d_hidden, d_items, d_bias or [0])
    cutbce_tpu::weighted_sum    -> jax_half.jax_weighted_sum  (loss, counts, rows, gradients)

The fakes are the table's shape rules, not `jax_op`'s default (which exports per call and refuses
symbolic shapes), so `torch.compile` with dynamic N works; the tests check they agree with the
export. The impl is decided for a TPU ('auto': Pallas for float32 / bfloat16), whatever the host.
No mesh: `jax_op` fixes a mesh at registration and TorchTPU builds one only with torch.distributed
initialised on TPU devices (`get_pallas_mesh`, whole-world only), so `mesh=` stays the torch_xla
bridge's. Several chips go through torch.distributed instead: with DTensor arguments (an FSDP2
table) `torch_cutbce/distributed.py` runs these per-chip ops on each chip's rows and positions, the
collectives on TorchTPU's `tpu_dist` (docs/distributed.md; traced off a TPU by
tests/test_torch_tpu_dtensor.py).
"""

from __future__ import annotations

import torch
import torch_tpu  # noqa: F401  (provides torch.tpu; autoloaded on a TPU VM, imported here elsewhere)
import jax

import jax_kernels.bridge as jax_half
from torch_cutbce.jax_bridge import ops
from cutbce_common.options import CutBCEOptions

DEVICES = ("tpu", "meta")  # meta: shapes and dtypes only (the fakes), e.g. to trace a model off a TPU


def _static(options: str, hidden, item_weight) -> dict:
    return jax_half.jax_static(options, hidden.shape[0], item_weight.shape[0], hidden.dtype.name, True)


def _rows(hidden: jax.Array, item_weight: jax.Array, targets: jax.Array, bias: jax.Array | None,
          class_weight: jax.Array | None, pos_weight: jax.Array | None,
          options: str) -> tuple[jax.Array, jax.Array]:
    return jax_half.jax_forward(hidden, item_weight, targets, bias, class_weight, pos_weight,
                                  **_static(options, hidden, item_weight))


def _rows_backward(hidden: jax.Array, item_weight: jax.Array, targets: jax.Array, bias: jax.Array | None,
                   class_weight: jax.Array | None, pos_weight: jax.Array | None, g: jax.Array,
                   options: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    return jax_half.jax_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g,
                                   **_static(options, hidden, item_weight))


def _weighted_sum(hidden: jax.Array, item_weight: jax.Array, targets: jax.Array, bias: jax.Array | None,
                  class_weight: jax.Array | None, pos_weight: jax.Array | None, row_weight: jax.Array,
                  options: str) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    return jax_half.jax_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight,
                                       **_static(options, hidden, item_weight))


rows = torch.tpu.pallas.jax_op("cutbce_tpu::rows", _rows)
rows_backward = torch.tpu.pallas.jax_op("cutbce_tpu::rows_backward", _rows_backward)
weighted_sum = torch.tpu.pallas.jax_op("cutbce_tpu::weighted_sum", _weighted_sum)
JAX_FUNCTIONS = {"rows": _rows, "rows_backward": _rows_backward, "weighted_sum": _weighted_sum}

rows.register_fake(ops.rows_fake)


@rows_backward.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, g, options):
    return tuple(ops.backward_fake(hidden, item_weight, bias, placeholder=True))


@weighted_sum.register_fake
def _(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, options):
    return tuple(ops.weighted_sum_fake(hidden, item_weight, bias, options, on_tpu=True))


_rows_grad, _rows_setup = ops.rows_autograd(rows_backward)
rows.register_autograd(_rows_grad, setup_context=_rows_setup)
weighted_sum.register_autograd(ops.weighted_sum_backward, setup_context=ops.weighted_sum_setup)

OPS = ops.Registered(rows=rows, weighted_sum=weighted_sum, on_tpu=lambda: True)


def _check_device(hidden: torch.Tensor) -> None:
    if hidden.device.type not in DEVICES:
        raise ValueError(f"backend='torch_tpu' needs tensors on a TorchTPU device ('tpu', or 'meta' for shapes "
                         f"only), got hidden on {hidden.device}")


def cut_bce_rows(hidden, item_weight, targets, bias, class_weight, pos_weight, options: CutBCEOptions):
    """Rows `[N]` and counts `[4 or 0, N]` for `cut_bce_with_logits` (the one argument order)."""
    _check_device(hidden)
    return ops.cut_bce_rows(OPS, hidden, item_weight, targets, bias, class_weight, pos_weight, options)


def cut_bce_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight,
                         options: CutBCEOptions):
    """`(sum_n row_weight[n] rows[n], counts [4 or 0, N])` in one pass, gradients computed in the
    forward (`row_weight` `[N]`: the position weight over the reduction's divisor)."""
    _check_device(hidden)
    return ops.cut_bce_weighted_sum(OPS, hidden, item_weight, targets, bias, class_weight, pos_weight,
                                    row_weight, options)
