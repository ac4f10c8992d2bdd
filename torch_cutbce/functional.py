"""`cut_bce_with_logits`: validation, dispatch to a backend, position weight, reduction, metrics."""

from __future__ import annotations

import torch

from jax_kernels.neutral.focal import Focal, check_focal
from jax_kernels.neutral.shapes import reduction_divisor, tile_width
from torch_cutbce import arguments, ops
from torch_cutbce.arguments import BACKENDS  # noqa: F401  (re-exported by torch_cutbce)
from torch_cutbce.metrics import CutBCEMetrics
from torch_cutbce.positives import accumulation_dtype
from torch_cutbce.reduction import reduce_rows, weighted_count_sums
from torch_cutbce.reference import dense_bce_with_logits
from torch_cutbce.vocab_parallel import VocabParallelOptions, vocab_parallel_loss, vocab_parallel_rows

def _padded_positions_dropped(hidden, targets, weight, num_items):
    """Indices of the positions to compute, or None for all of them.

    A position whose weight is 0 and that has no valid target id contributes exactly 0 to the loss
    and to every gradient, so the eager native path drops it before the tiles (padded positions,
    often most of a batch of short sequences). Not when weight itself needs a gradient (its gradient
    is the row's loss), nor under torch.compile (a data-dependent shape). On CUDA the selection
    reads one count back to the host.
    """
    if weight is None or (weight.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return None
    keep = (weight != 0) | ((targets >= 0) & (targets < num_items)).any(-1)
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(-1)


def _native(flat, weight, *, reduction, n, num_items, block_v, return_metrics, focal):
    """The native engine on `[N, D]` / `[N, L]` inputs: the loss (and counts), padded positions dropped.
    `block_v`: the user's tile width, or None for the default."""
    hidden, item_weight, bias, class_weight, pos_weight, targets = flat
    w = None if weight is None else weight.reshape(n)
    kept = _padded_positions_dropped(hidden, targets, w, num_items)
    if kept is not None:
        hidden, targets = hidden.index_select(0, kept), targets.index_select(0, kept)
        w = w.index_select(0, kept)
    # The default tile is sized for the rows that reach the tiles (fewer rows: wider tiles).
    block_v = tile_width(block_v, hidden.shape[0], num_items)
    if reduction != "none" and n > 0:
        # Gradients computed during the forward (native.loss_and_grads); weight and reduction inside.
        loss, counts = ops.loss(hidden, item_weight, bias, w, class_weight, pos_weight, targets,
                                divisor=reduction_divisor(reduction, n, num_items), block_v=block_v,
                                compute_metrics=return_metrics, focal=focal)
        return loss, (CutBCEMetrics(*counts) if return_metrics else None)
    # Also N = 0 with 'sum'/'mean': reduce_rows gives 0 / 0 = nan for 'mean' (as torch) and the
    # rows' backward zero gradients.
    rows, counts = ops.rows(hidden, item_weight, bias, class_weight, pos_weight, targets, block_v=block_v,
                            compute_metrics=return_metrics, focal=focal)
    if kept is not None:  # dropped positions: rows and counts 0
        rows = rows.new_zeros(n).index_copy(0, kept, rows)
        counts = counts.new_zeros((counts.shape[0], n)).index_copy(1, kept, counts)
    return rows, counts


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
      backend: 'auto' (the torch_xla bridge for XLA tensors, native otherwise), 'native' (chunked
        PyTorch, CPU/CUDA), 'dense' (materializing reference), 'xla' (bridge; Pallas on TPU, the
        blocked JAX loop elsewhere), 'xla_blocked', 'xla_pallas' (Pallas kernels; in interpret
        mode when the XLA device is not a TPU).

      mesh: a `torch_xla.distributed.spmd.Mesh` (device ids 0..n-1 in order) to run sharded under
        torch_xla SPMD: each device loops over its slice of the item table (split along V on
        `vocab_axis`) and its positions (split on `data_axis`); mark the tensors with
        `xs.mark_sharding` to match.
      vocab_parallel: a `VocabParallelOptions` to split the item table over the ranks of a
        torch.distributed group (CPU/CUDA tensors, the native backend): `item_weight`, `bias`,
        `class_weight` and `pos_weight` are this rank's slices, `hidden`, `targets` and `weight` the
        same on every rank, and every rank gets the same loss and `d_hidden` ('mean' divides by
        N x the global V). See `torch_cutbce.vocab_parallel`.
      focal: a `Focal(gamma=2.0, alpha=0.25, apply_class_balancing=False)` for the focal loss
        (Keras `BinaryFocalCrossentropy` semantics; formulas: `jax_kernels/neutral/focal.py`), or None.
        gamma = 0 without balancing is plain BCE. Exact like the plain loss, on every backend.

    Returns:
      The loss (float32, also for float16 / bfloat16 inputs; float64 for float64 inputs), or
      `(loss, CutBCEMetrics)`. Gradients come back in each input's dtype. The native backend's
      gradients are not differentiable again (double backward raises a RuntimeError).
    """
    size = arguments.check(hidden, item_weight, targets, bias, weight, class_weight, pos_weight,
                              reduction=reduction, block_v=block_v)
    backend = arguments.resolve_backend(backend, hidden)
    focal = check_focal(focal)
    arguments.check_parallel_options(backend, mesh, vocab_parallel)  # on the resolved backend
    arguments.check_devices(
        dict(hidden=hidden, item_weight=item_weight, targets=targets, bias=bias, weight=weight,
             class_weight=class_weight, pos_weight=pos_weight),
        backend,
    )
    arguments.check_constant("class_weight", class_weight)
    arguments.check_constant("pos_weight", pos_weight)
    hidden, item_weight, bias = arguments.matmul_dtype_inputs(hidden, item_weight, bias)
    if backend == "dense":
        arguments.check_ids_below_vocab(targets, size.num_items)
        return dense_bce_with_logits(
            hidden, item_weight, targets, bias, weight=weight, class_weight=class_weight,
            pos_weight=pos_weight, reduction=reduction, return_metrics=return_metrics, focal=focal,
        )
    n = size.num_positions
    flat = (hidden.reshape(n, size.hidden_size), item_weight, bias, class_weight, pos_weight,
            targets.reshape(n, size.num_slots))
    if vocab_parallel is not None:
        block_v = tile_width(size.block_v, n, size.num_items)
        if reduction != "none" and n > 0:  # one pass: each rank's gradients computed in its forward
            hidden_2d, item_weight, bias, class_weight, pos_weight, targets_2d = flat
            loss, counts = vocab_parallel_loss(
                hidden_2d, item_weight, bias, None if weight is None else weight.reshape(n), class_weight,
                pos_weight, targets_2d, options=vocab_parallel, compute_metrics=return_metrics, focal=focal,
                divisor=reduction_divisor(reduction, n, vocab_parallel.num_items), block_v=block_v)
            return (loss, CutBCEMetrics(*counts)) if return_metrics else loss
        rows, counts = vocab_parallel_rows(*flat, options=vocab_parallel, compute_metrics=return_metrics,
                                           focal=focal, block_v=block_v)
        return reduce_rows(rows, counts, weight, reduction, size.lead_shape, vocab_parallel.num_items,
                           return_metrics)
    if backend == "native":
        out, counts = _native(flat, weight, reduction=reduction, n=n, num_items=size.num_items, focal=focal,
                              block_v=size.block_v, return_metrics=return_metrics)
        if reduction != "none" and n > 0:
            return (out, counts) if return_metrics else out
        rows = out
    else:
        from torch_cutbce import xla_bridge  # the one module that imports torch_xla and jax

        block_v = tile_width(size.block_v, n, size.num_items)
        if reduction != "none" and n > 0:
            return _xla_one_pass(flat, weight, reduction=reduction, n=n, num_items=size.num_items,
                                 block_v=block_v, return_metrics=return_metrics, backend=backend, focal=focal,
                                 mesh=mesh, vocab_axis=vocab_axis, data_axis=data_axis)
        rows, counts = xla_bridge.cut_bce_rows(
            *flat, block_v=block_v, compute_metrics=return_metrics, backend=backend,
            mesh=mesh, vocab_axis=vocab_axis, data_axis=data_axis, focal=focal,
        )
    return reduce_rows(rows, counts, weight, reduction, size.lead_shape, size.num_items, return_metrics)


def _xla_one_pass(flat, weight, *, reduction, n, num_items, block_v, return_metrics, backend, focal,
                  mesh, vocab_axis, data_axis):
    """'sum' / 'mean' through the bridge with the gradients computed in the forward (one pass), on
    one device or under an SPMD mesh."""
    from torch_cutbce import xla_bridge

    hidden = flat[0]
    acc = accumulation_dtype(hidden.dtype)
    w = torch.ones(n, dtype=acc, device=hidden.device) if weight is None else weight.reshape(n).to(acc)
    row_weight = w / reduction_divisor(reduction, n, num_items)
    loss, counts = xla_bridge.cut_bce_weighted_sum(
        *flat, row_weight, block_v=block_v, compute_metrics=return_metrics, backend=backend,
        mesh=mesh, vocab_axis=vocab_axis, data_axis=data_axis, focal=focal)
    if not return_metrics:
        return loss
    return loss, CutBCEMetrics(*weighted_count_sums(counts, weight))
