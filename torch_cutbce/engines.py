"""The torch engine registry: backend name -> engine, each saying what it supports.

`cut_bce_with_logits` checks its arguments, builds one `CutBCEOptions`, looks its engine up here
(`select`) and calls it once: `rows` for reduction='none' (and N = 0), `weighted_sum` for 'sum' /
'mean', whose gradients every engine but the dense one computes during the forward. The entry
applies the position weight to the rows and reduces them (`reduction.reduce_rows`).

    dense           the materializing reference (torch_cutbce.reference), any device
    native          the chunked custom ops (ops.py), CPU / CUDA
    vocab_parallel  native on this rank's slice of the table, summed over torch.distributed ranks
    xla, xla_blocked, xla_pallas
                    the torch_xla bridge (xla_bridge.py, imported on first use): the JAX engine
                    `impl` ('auto': Pallas on a TPU), on one device or under an SPMD mesh
    torch_tpu       the TorchTPU bridge (tpu_bridge.py, imported on first use): the same JAX
                    engines through `torch.tpu.pallas.jax_op`, `tpu` tensors (or `meta`, shapes only)

Every engine takes `flat = (hidden [N, D], item_weight [V, D], targets [N, L], bias, class_weight,
pos_weight)` (the one argument order, the entry's) and the call's `route.Route` (its options, and
this rank's `VocabParallelOptions` for vocab_parallel): `rows(flat, route) -> (rows [N], counts
[4 or 0, N])` and `weighted_sum(flat, weight [N] or None, divisor, route) -> (sum_n weight[n]
rows[n] / divisor, counts [4 or 0] weighted and summed)`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from torch_cutbce import ops
from torch_cutbce.arguments import check_ids_below_vocab
from torch_cutbce.positives import accumulation_dtype
from torch_cutbce.reduction import weighted_count_sums
from torch_cutbce.reference import dense_bce_with_logits


@dataclasses.dataclass(frozen=True)
class Engine:
    """One way to compute the rows and the one-pass loss.

    Attributes:
      name: the `backend=` that selects it ('vocab_parallel': selected by `vocab_parallel=`).
      rows, weighted_sum: the two calls (module docstring).
      on_xla: True: XLA tensors only; False: CPU / CUDA tensors only; None: any device.
      impl: the JAX engine behind the torch_xla bridge ('auto', 'blocked', 'pallas'), else 'auto'.
      takes_mesh: runs under a torch_xla SPMD mesh (`mesh=`).
      drops_padded_positions: eager calls may drop positions of weight 0 without a valid target
        before the tiles (`functional._padded_positions_dropped`).
    """

    name: str
    rows: Callable
    weighted_sum: Callable
    on_xla: bool | None = False
    impl: str = "auto"
    takes_mesh: bool = False
    drops_padded_positions: bool = False


def _native_rows(flat, route):
    return ops.rows(*flat, route.options)


def _native_weighted_sum(flat, weight, divisor, route):
    return ops.loss(*flat, weight, divisor, route.options)


def _vocab_parallel_rows(flat, route):
    from torch_cutbce.vocab_parallel import vocab_parallel_rows

    return vocab_parallel_rows(*flat, route.options, vocab_parallel=route.vocab_parallel)


def _vocab_parallel_weighted_sum(flat, weight, divisor, route):
    from torch_cutbce.vocab_parallel import vocab_parallel_loss

    return vocab_parallel_loss(*flat, weight, divisor, route.options, vocab_parallel=route.vocab_parallel)


def _dense(flat, weight, options, reduction):
    hidden, item_weight, targets, bias, class_weight, pos_weight = flat
    check_ids_below_vocab(targets, item_weight.shape[0])
    return dense_bce_with_logits(hidden, item_weight, targets, bias, weight=weight, class_weight=class_weight,
                                 pos_weight=pos_weight, reduction=reduction, return_metrics=True,
                                 **options.loss.arguments())


def _dense_rows(flat, route):
    options = route.options
    rows, metrics = _dense(flat, None, options, "none")
    counts = torch.stack(tuple(metrics)) if options.compute_metrics else rows.new_zeros((0, rows.shape[0]))
    return rows, counts.float()


def _dense_weighted_sum(flat, weight, divisor, route):
    options = route.options
    loss, metrics = _dense(flat, weight, options, "sum")
    counts = torch.stack(tuple(metrics)) if options.compute_metrics else loss.new_zeros((0,))
    return loss / divisor, counts.float()


def _bridge(module: str):
    """The JAX bridge `module`, imported on first use: the only modules that import jax (and
    torch_xla / torch_tpu). Import statements, not importlib: dynamo traces them (fullgraph)."""
    if module == "xla_bridge":
        from torch_cutbce import xla_bridge as bridge
    else:
        from torch_cutbce import tpu_bridge as bridge
    return bridge


def _bridge_engine(name: str, module: str, impl: str, on_xla: bool | None, takes_mesh: bool) -> Engine:
    """An engine of the JAX bridge `torch_cutbce.<module>` (xla_bridge or tpu_bridge)."""

    def rows(flat, route):
        return _bridge(module).cut_bce_rows(*flat, route.options)

    def weighted_sum(flat, weight, divisor, route):
        hidden = flat[0]
        n, acc = hidden.shape[0], accumulation_dtype(hidden.dtype)
        w = torch.ones(n, dtype=acc, device=hidden.device) if weight is None else weight.to(acc)
        loss, counts = _bridge(module).cut_bce_weighted_sum(*flat, w / divisor, route.options)
        return loss, weighted_count_sums(counts, weight)

    return Engine(name, rows, weighted_sum, on_xla=on_xla, impl=impl, takes_mesh=takes_mesh)


ENGINES = {
    "dense": Engine("dense", _dense_rows, _dense_weighted_sum, on_xla=None),
    "native": Engine("native", _native_rows, _native_weighted_sum, drops_padded_positions=True),
    "vocab_parallel": Engine("vocab_parallel", _vocab_parallel_rows, _vocab_parallel_weighted_sum),
    **{name: _bridge_engine(name, "xla_bridge", impl, on_xla=True, takes_mesh=True)
       for name, impl in (("xla", "auto"), ("xla_blocked", "blocked"), ("xla_pallas", "pallas"))},
    # on_xla=None: tpu_bridge checks its own devices ('tpu', or 'meta' for shapes only).
    "torch_tpu": _bridge_engine("torch_tpu", "tpu_bridge", "auto", on_xla=None, takes_mesh=False),
}


def select(backend: str, vocab_parallel) -> Engine:
    """The engine of a resolved `backend` (not 'auto': `arguments.resolve_backend`), or the
    vocab-parallel one when `vocab_parallel` is given (`arguments.check_parallel_options` allows it
    with the native backend only)."""
    return ENGINES["vocab_parallel" if vocab_parallel is not None else backend]
