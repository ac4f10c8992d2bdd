"""`cut_bce_with_logits`: validation, the options and the engine (decided once), position weight,
reduction, metrics."""

from __future__ import annotations

import torch

from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from cutbce_common.options import CutBCEOptions
from cutbce_common.shapes import reduction_divisor
from torch_cutbce import arguments, distributed, engines
from torch_cutbce.engines import BACKENDS  # noqa: F401  (re-exported by torch_cutbce)
from torch_cutbce.metrics import CutBCEMetrics
from torch_cutbce.reduction import reduce_rows
from torch_cutbce.route import Route, VocabParallelOptions
from torch_cutbce.special_rows import SpecialRows, catalog_of, runs_of_items


def _padded_positions_dropped(hidden, targets, weight, num_items):
    """Indices of the positions to compute, or None for all of them.

    A position whose weight is 0 and that has no valid target id contributes exactly 0 to the loss
    and to every gradient, so an engine that declares it (`Engine.drops_padded_positions`: native)
    has it dropped before the tiles (padded positions, often most of a batch of short sequences).
    Not when weight itself needs a gradient (its gradient is the row's loss), nor under
    torch.compile (a data-dependent shape). On CUDA the selection reads one count back to the host.
    """
    if weight is None or (weight.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return None
    keep = (weight != 0) | ((targets >= 0) & (targets < num_items)).any(-1)
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(-1)


def cut_bce_with_logits(
    hidden: torch.Tensor,
    item_weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    reduction: str = "mean",
    return_metrics: bool = False,
    block_v: int | None = None,
    backend: str = "auto",
    mesh=None,
    vocab_axis: str | tuple[str, ...] | None = "model",
    data_axis: str | tuple[str, ...] | None = "data",
    vocab_parallel: VocabParallelOptions | None = None,
    focal: Focal | None = None,
    label_smoothing: float = 0.0,
    special_rows: SpecialRows | None = None,
):
    """`BCEWithLogitsLoss(hidden @ item_weight.T + bias, multi_hot(targets))` without building the logits.

    The loss and its gradients are exact (formula: `jax_kernels/reference.py`, docs/design.md, 'The math');
    extra memory is O(N x block_v), not O(N x V).

    Args:
      hidden: `[*S, D]` float16 / bfloat16 / float32 / float64 (N = prod(S) positions; N = 0
        and D = 0 work).
      item_weight: `[V, D]`, same dtype and device as hidden (often the tied item embedding).
      targets: `[*S, L]` integer positive ids (int8/16/32/64 or uint8; cast uint16/32/64 to
        int64), padded with negative ids; duplicates count once.
        Ids >= V raise on CPU and trigger a device assert on CUDA; on XLA devices they cannot be
        checked without a host sync and are ignored like padding.
      bias: `[V]` or None. bias, weight, class_weight and pos_weight may have any float dtype;
        they are cast to the compute dtype (float32, or float64 for float64 inputs).
      weight: `[*S]` per-position weight (a padding mask, say), or None. Gets a gradient.
      class_weight: `[V]` per-item weight, or None. A constant (must not require grad).
      pos_weight: `[V]` weight of the positive term as in BCEWithLogitsLoss. A constant.
      reduction: 'mean' (sum over all N x V elements / (N V), as BCEWithLogitsLoss; padded
        positions count), 'sum', or 'none' (shape S: each position's loss summed over items; the
        `[*S, V]` tensor BCEWithLogitsLoss would return is exactly what this function avoids).
        'mean' of N = 0 positions is nan with zero gradients, as BCEWithLogitsLoss on `[0, V]`.
      return_metrics: also return `CutBCEMetrics(tp, fp, fn, tn)` from the same logit tiles.
      block_v: vocabulary tile width, a positive int (numpy integers too, bool not; default: a
        16 MiB float32 `[N, block_v]` tile).
      backend: 'auto' (by the tensors' device type: the torch_xla bridge for XLA tensors, TorchTPU's
        for `tpu` tensors, the Triton kernels for bfloat16 / float16 CUDA tensors, native otherwise;
        `torch_cutbce.resolved_backend` says which), 'native' (chunked PyTorch, CPU/CUDA), 'dense'
        (materializing reference), 'triton' (fused kernels: CUDA, or CPU tensors in Triton's
        interpreter; float32 / bfloat16 / float16), 'xla' (bridge; Pallas on TPU, the blocked JAX
        loop elsewhere), 'xla_blocked', 'xla_pallas' (Pallas kernels; in interpret mode when the XLA
        device is not a TPU), 'torch_tpu' (`torch_cutbce.BACKENDS` lists them).

      mesh: a `torch_xla.distributed.spmd.Mesh` (device ids 0..n-1 in order) to run sharded under
        torch_xla SPMD: each device loops over its slice of the item table (split along V on
        `vocab_axis`) and its positions (split on `data_axis`); mark the tensors with
        `xs.mark_sharding` to match.
      vocab_parallel: a `VocabParallelOptions` to split the item table over the ranks of a
        torch.distributed group (CPU/CUDA tensors, an engine that takes it: native): `item_weight`, `bias`,
        `class_weight` and `pos_weight` are this rank's slices, `hidden`, `targets` and `weight` the
        same on every rank, and every rank gets the same loss and `d_hidden` ('mean' divides by
        N x the global V). See `torch_cutbce.vocab_parallel`.
      focal: a `Focal(gamma=2.0, alpha=0.25, apply_class_balancing=False)` for the focal loss
        (Keras `BinaryFocalCrossentropy` semantics; formulas: `cutbce_common/focal.py`), or None.
        gamma = 0 without balancing is plain BCE. Exact like the plain loss, on every backend.
      label_smoothing: eps in [0, 1]: each element's target becomes `y (1 - eps) + eps / 2`
        (Keras' `label_smoothing`; with focal, `BinaryFocalCrossentropy`'s). `pos_weight` scales a
        positive's whole term, as under focal. Exact on every backend.
      special_rows: a `SpecialRows` naming the rows of `item_weight` that are not items (PAD, MASK,
        ...), or None (every row is an item). They are never scored and get exactly 0 gradient;
        `targets` are then rows of the whole table (special rows' ids are no target), `bias`,
        `class_weight` and `pos_weight` are `[V]` (the items) or `[R]` (the table's rows), and 'mean'
        divides by N x V, the real items. No copy of the table (`torch_cutbce.without_special_rows`);
        not with `vocab_parallel=` (give each rank its slice of the items).

    Returns:
      The loss (float32, also for float16 / bfloat16 inputs; float64 for float64 inputs), or
      `(loss, CutBCEMetrics)`. Gradients come back in each input's dtype. The native backend's
      gradients are not differentiable again (double backward raises a RuntimeError).
    """
    if special_rows is None:
        return _loss(hidden, item_weight, targets, bias, weight, class_weight, pos_weight, reduction, return_metrics,
                     block_v, backend, mesh, vocab_axis, data_axis, vocab_parallel, focal, label_smoothing)
    if vocab_parallel is not None:
        raise ValueError("special_rows= with vocab_parallel=: each rank's table is a slice of the items, so "
                         "leave the special rows out of the slices (torch_cutbce.without_special_rows on the "
                         "whole table gives the items) and drop special_rows=")
    runs = runs_of_items(item_weight, targets, special_rows, bias, class_weight=class_weight, pos_weight=pos_weight)
    if runs is not None:  # one call per run of items: no engine reads a special row (special_rows.py)
        outs = [_loss(hidden, c.item_weight, c.targets, c.bias, weight, c.class_weight, c.pos_weight, reduction,
                      return_metrics, block_v, backend, mesh, vocab_axis, data_axis, None, focal, label_smoothing,
                      mean_items=c.num_items) for c in runs]
        if not return_metrics:
            return sum(outs[1:], outs[0])
        return sum((o[0] for o in outs[1:]), outs[0][0]), CutBCEMetrics(
            *(sum(parts[1:], parts[0]) for parts in zip(*(o[1] for o in outs))))
    catalog, excluded = catalog_of(item_weight, targets, special_rows, bias, class_weight=class_weight,
                                   pos_weight=pos_weight, metrics=return_metrics)
    out = _loss(hidden, catalog.item_weight, catalog.targets, catalog.bias, weight, catalog.class_weight,
                catalog.pos_weight, reduction, return_metrics, block_v, backend, mesh, vocab_axis, data_axis, None,
                focal, label_smoothing, mean_items=catalog.num_items)
    if not return_metrics or excluded is None:
        return out
    loss, metrics = out  # the excluded rows' logits were counted (fp or tn) like any column's
    return loss, excluded.remove_from(metrics, hidden, weight, reduction)


def _loss(hidden, item_weight, targets, bias, weight, class_weight, pos_weight, reduction, return_metrics,
          block_v, backend, mesh, vocab_axis, data_axis, vocab_parallel, focal, label_smoothing, mean_items=None):
    """`cut_bce_with_logits` over every row of `item_weight`; 'mean' divides by N x `mean_items`
    (default: the rows)."""
    arguments.check_not_under_torch_func(dict(hidden=hidden, item_weight=item_weight, bias=bias, weight=weight))
    # DTensors: their placements first (the clearest message), then the rules on their global
    # shapes; each rank computes with its local parts (`torch_cutbce.distributed`).
    layout = distributed.layout_of(hidden, item_weight, targets, bias, weight, class_weight, pos_weight)
    # Where the ranks' positions are gathered, every rank's checks decide for all (none is left waiting).
    size, layout = distributed.check_arguments_on_every_rank(
        layout, hidden, item_weight, targets, bias, weight, class_weight, pos_weight, reduction=reduction,
        block_v=block_v)
    if layout is not None:
        arguments.check_no_parallel_options(mesh, vocab_parallel)
        hidden, item_weight, targets, bias, weight, class_weight, pos_weight = distributed.localize(
            layout, hidden, item_weight, targets, bias, weight, class_weight, pos_weight)
    # The dtypes the logits' matmul sees (autocast's, or promoted) decide the engine and its dtype check.
    hidden, item_weight, bias = arguments.matmul_dtype_inputs(hidden, item_weight, bias)
    backend = engines.resolve_backend(backend, hidden)
    loss = Loss(focal, label_smoothing)  # the per-element math, checked (its errors name the argument)
    engines.check_parallel_options(backend, mesh, vocab_parallel, vocab_axis, data_axis)  # on the resolved backend
    engine = engines.select(backend, vocab_parallel)
    engines.check_devices(
        dict(hidden=hidden, item_weight=item_weight, targets=targets, bias=bias, weight=weight,
             class_weight=class_weight, pos_weight=pos_weight),
        backend, engine,
    )
    arguments.check_constant("class_weight", class_weight)
    arguments.check_constant("pos_weight", pos_weight)
    lead_shape = hidden.shape[:-1]  # this rank's positions under a layout
    n = lead_shape.numel()
    num_items = size.num_items if vocab_parallel is None else vocab_parallel.num_items  # the global V
    num_items = num_items if mean_items is None else mean_items  # excluded rows are no items
    hidden, targets = hidden.reshape(n, size.hidden_size), targets.reshape(n, targets.shape[-1])
    w = None if weight is None else weight.reshape(n)
    kept = None
    if engine.drops_padded_positions and layout is None:
        kept = _padded_positions_dropped(hidden, targets, w, size.num_items)
    if kept is not None:
        hidden, targets, w = (x.index_select(0, kept) for x in (hidden, targets, w))
    # Static choices only (the engines size the tile for the rows they see, `shapes.tile_width`):
    # the same options for every N, so torch.compile with dynamic shapes does not recompile per N.
    options = CutBCEOptions(
        block_v=size.block_v,
        compute_metrics=return_metrics,
        loss=loss,
        impl=engine.impl,
        **(arguments.mesh_layout(mesh, vocab_axis, data_axis) if engine.takes_mesh else {}),
        **({} if vocab_parallel is None else dict(offset=vocab_parallel.start, id_limit=vocab_parallel.num_items)),
    )
    flat, route = (hidden, item_weight, targets, bias, class_weight, pos_weight), Route(options, vocab_parallel)
    if layout is not None:  # each rank its positions' rows over the whole catalog, reduced here
        rows, counts = distributed.layout_rows(layout, engine, flat, route)
        return reduce_rows(rows, counts, weight, reduction, lead_shape, num_items, return_metrics)
    if reduction != "none" and n > 0:  # one pass: the gradients computed in the forward
        divisor = reduction_divisor(reduction, n, num_items)
        loss, counts = engine.weighted_sum(flat, w, divisor, route)
        return (loss, CutBCEMetrics(*counts)) if return_metrics else loss
    # Also N = 0 with 'sum'/'mean': reduce_rows gives 0 / 0 = nan for 'mean' (as torch) and the
    # rows' backward zero gradients.
    rows, counts = engine.rows(flat, route)
    if kept is not None:  # dropped positions: rows and counts 0
        rows = rows.new_zeros(n).index_copy(0, kept, rows)
        counts = counts.new_zeros((counts.shape[0], n)).index_copy(1, kept, counts)
    return reduce_rows(rows, counts, weight, reduction, lead_shape, num_items, return_metrics)
