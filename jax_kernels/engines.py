"""The JAX engine registry: name -> engine, each saying what it supports.

`core` looks the engine up once per call (`engine_for`); the entries (`api.cut_bce`, the sharded
route, the torch_xla bridge) only name one through the resolved `CutBCEOptions.impl`. Every engine computes the
same three things on `[N, D]` / `[V, D]` operands and deduplicated ids `[N, L]`: the rows (and the
tiles' `[predicted, hits]` counts), the gradients of `sum_n g[n] rows[n]`, and both in one pass.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from cutbce_common.shapes import KERNEL_DTYPES


@dataclasses.dataclass(frozen=True)
class Engine:
    """One way to run the tiles.

    Attributes:
      name: what a resolved `CutBCEOptions.impl` calls it.
      dtypes: the input dtype names it takes (None: every float dtype).
      takes_empty: whether it runs N = 0 or D = 0 (the kernels need a row and a hidden unit to tile;
        the blocked loop gives the same trivial result).
      forward: `(options, hidden, item_weight, ids, bias, class_weight, pos_weight)` ->
        `(rows [N], [predicted, hits] [2, N] or None)`.
      backward: the same operands and `g [N]` -> `(d_hidden, d_item_weight, d_bias or None)`.
      value_and_grad: the same operands and `g` -> `(rows, counts or None, d_hidden, d_item_weight,
        d_bias or None)` in one pass.
    """

    name: str
    dtypes: tuple[str, ...] | None
    takes_empty: bool
    forward: Callable
    backward: Callable
    value_and_grad: Callable

    def supports(self, hidden) -> bool:
        """Whether this engine runs `hidden [N, D]` (its dtype and shape)."""
        if self.dtypes is not None and jnp.dtype(hidden.dtype).name not in self.dtypes:
            return False
        return self.takes_empty or (hidden.shape[0] > 0 and hidden.shape[1] > 0)


def _blocked_forward(options, hidden, item_weight, ids, bias, class_weight, pos_weight):
    from jax_kernels.blocked.loop import blocked_forward

    return blocked_forward(hidden, item_weight, ids, bias, class_weight, pos_weight, block_v=options.block_v,
                           compute_counts=options.compute_metrics, loss=options.loss,
                           cpu_kernel=options.cpu_kernel)


def _blocked_backward(options, hidden, item_weight, ids, bias, class_weight, pos_weight, g):
    from jax_kernels.blocked.loop import blocked_backward

    return blocked_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, g, block_v=options.block_v,
                            loss=options.loss, cpu_kernel=options.cpu_kernel)


def _blocked_value_and_grad(options, hidden, item_weight, ids, bias, class_weight, pos_weight, g):
    from jax_kernels.blocked.loop import blocked_value_and_grad

    return blocked_value_and_grad(hidden, item_weight, ids, bias, class_weight, pos_weight, g,
                                  block_v=options.block_v, compute_counts=options.compute_metrics,
                                  loss=options.loss, cpu_kernel=options.cpu_kernel)


def _counted(options, predicted, hits):
    """The Pallas kernels' two count vectors as the blocked loop's `[2, N]` (or None)."""
    return jnp.stack([predicted, hits]) if options.compute_metrics else None


def _pallas_forward(options, hidden, item_weight, ids, bias, class_weight, pos_weight):
    from jax_kernels.pallas.launch import pallas_forward

    rows, predicted, hits = pallas_forward(hidden, item_weight, ids, bias, class_weight, pos_weight,
                                           compute_counts=options.compute_metrics,
                                           block_sizes=options.block_sizes, loss=options.loss)
    return rows, _counted(options, predicted, hits)


def _pallas_backward(options, hidden, item_weight, ids, bias, class_weight, pos_weight, g):
    from jax_kernels.pallas.launch import pallas_backward

    return pallas_backward(hidden, item_weight, ids, bias, class_weight, pos_weight, g,
                           block_sizes=options.block_sizes, loss=options.loss)


def _pallas_value_and_grad(options, hidden, item_weight, ids, bias, class_weight, pos_weight, g):
    from jax_kernels.pallas.launch import pallas_value_and_grad

    rows, predicted, hits, *grads = pallas_value_and_grad(
        hidden, item_weight, ids, bias, class_weight, pos_weight, g, compute_counts=options.compute_metrics,
        block_sizes=options.block_sizes, loss=options.loss)
    return (rows, _counted(options, predicted, hits), *grads)


# The engines load lazily: the Pallas modules import jax.experimental.pallas, which a blocked-only
# user never needs.
ENGINES = {
    "blocked": Engine("blocked", None, True, _blocked_forward, _blocked_backward, _blocked_value_and_grad),
    "pallas": Engine("pallas", KERNEL_DTYPES, False, _pallas_forward, _pallas_backward, _pallas_value_and_grad),
}
FALLBACK = "blocked"  # takes every dtype and shape


def engine_for(impl: str, hidden) -> Engine:
    """The engine named `impl` if it supports `hidden`, else the blocked loop (the only case the
    entries let through: an empty problem for Pallas; their dtype rule is `shapes.choose_impl`)."""
    engine = ENGINES[impl]
    return engine if engine.supports(hidden) else ENGINES[FALLBACK]
