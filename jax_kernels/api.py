"""`jax_kernels.cut_bce`: the public JAX entry point (validation, flattening, weight, reduction)."""

from __future__ import annotations

import dataclasses
import functools

from jax_kernels.arguments import engine_operands, prepare, resolve_impl
from jax_kernels.core import OneDevice, cut_bce_rows, cut_bce_weighted_sum
from cutbce_common.loss import Loss
from cutbce_common.options import CutBCEOptions
from jax_kernels.reduction import finish
from jax_kernels.sharded import sharded_loss

def cut_bce(
    hidden,
    item_weight,
    targets,
    bias=None,
    *,
    weight=None,
    class_weight=None,
    pos_weight=None,
    reduction: str = "mean",
    return_metrics: bool = False,
    block_v: int | None = None,
    impl: str = "auto",
    block_sizes=None,
    mesh=None,
    vocab_axis="model",
    data_axis="data",
    num_items: int | None = None,
    focal=None,
    label_smoothing: float = 0.0,
):
    """Binary cross-entropy of `hidden @ item_weight.T + bias` against multi-hot targets, without the logits.

    Computes exactly `jax_kernels.reference.dense_cut_bce` (the formula is stated there) in
    vocabulary tiles; works under `jax.jit` (all options are static Python values). The choices
    shared with the torch entry (reductions, weights, ids >= V, dtypes): docs/design.md, 'The API'.

    Every array argument may be any array-like (`jax.Array`, numpy array, nested list): it is
    converted with `jnp.asarray`, except that concrete `targets` are checked first (below).

    Args:
      hidden: `[*S, D]` float32 / bfloat16 / float16 / float64. N = prod(S) = 0 and D = 0 work.
      item_weight: `[V, D]`, same dtype as hidden.
      targets: `[*S, L]` integer positive ids (int8/16/32/64 or uint8); negative ids of any
        magnitude are padding, duplicates count once. Ids >= V raise a ValueError on concrete
        arrays; under `jit` they cannot be checked without a host sync and are ignored like
        padding. Concrete numpy int64 ids are checked before JAX narrows them to int32 (x64 off),
        so no id wraps into a real item. Under `jit` with x64 off JAX has already narrowed int64
        ids at the jit boundary (wrapping), before this function sees them: pass int32 ids there.
      bias: `[V]` or None. bias, weight, class_weight and pos_weight may have any float dtype;
        they are cast to the compute dtype (float32, or float64 for float64 inputs).
      weight: `[*S]` per-position weight (e.g. a padding mask), or None. Differentiable.
      class_weight: `[V]` per-item weight, or None. Treated as a constant (zero gradient).
      pos_weight: `[V]` weight of the positive term, as in BCEWithLogitsLoss. A constant.
      reduction: 'mean' (divides by N x V, as BCEWithLogitsLoss), 'sum', or 'none' (shape S, each
        position's loss summed over items); N = 0 and the rest: docs/design.md, 'Reductions'.
      return_metrics: also return `(tp, fp, fn, tn)` float32 counts (z > 0 is a positive
        prediction), times `weight`, summed over positions unless reduction is 'none'.
      block_v: vocabulary tile of the blocked implementation, a positive int (numpy integers
        too, bool not; default: a 16 MiB float32 tile).
      impl: 'auto' (Pallas on TPU, blocked elsewhere), 'blocked', or 'pallas' (Mosaic kernels on
        TPU; the same kernels in interpret mode when lowered for another platform).
      block_sizes: Pallas tile sizes (a `BlockSizes`, from `jax_kernels.pallas.block_sizes` or
        `cutbce_common.shapes`), None = derived.
      mesh: a `jax.sharding.Mesh` to run sharded: each device loops over its slice of the item
        table (split along V on `vocab_axis`) and of the positions (split on `data_axis`); the
        table is never gathered. 'infer': the mesh of the inputs' `NamedSharding`, of a traced
        input, or of `jax.set_mesh`. None (default): one device. Works eagerly and under `jit`.
      vocab_axis: the mesh axis name (or a tuple of names) the table is split on; None keeps the
        table whole. Padding and collectives: docs/distributed.md.
      data_axis: the mesh axis name (or names) the positions are split on; None replicates them.
        It must not share an axis with `vocab_axis`.
      num_items: the catalog size V when `item_weight` has padding rows after it (a table sharded
        along V needs a row count the shards divide: 876,939 items on 4 shards are 876,940 rows):
        the extra rows get no loss and a zero gradient, 'mean' divides by N x num_items, and ids
        >= num_items are errors. None: every row is an item.
      focal: a `jax_kernels.Focal(gamma, alpha, apply_class_balancing)`: the focal loss (Keras'
        `BinaryFocalCrossentropy`; the formula is in `jax_kernels.reference`), exact on every
        path; None (default): plain BCE. `Focal(gamma=0)` without balancing is plain BCE, bit for
        bit. Anything else raises a TypeError naming focal.
      label_smoothing: eps in [0, 1]: each element's target becomes `y (1 - eps) + eps / 2`
        (Keras' `label_smoothing`, also with focal); `pos_weight` scales a positive's whole term.

    Returns:
      The loss (float32, or float64 for float64 inputs), or `(loss, (tp, fp, fn, tn))`.
    """
    loss = Loss(focal, label_smoothing)  # the per-element math, checked (its errors name the argument)
    size, a = prepare(hidden, item_weight, targets, bias, weight, class_weight, pos_weight,
                      reduction=reduction, block_v=block_v, num_items=num_items)
    hidden, item_weight, targets, bias = a["hidden"], a["item_weight"], a["targets"], a["bias"]
    weight, class_weight, pos_weight = a["weight"], a["class_weight"], a["pos_weight"]
    # The call's options, the engine chosen here (its errors name impl); the tile is sized below
    # (`resolved`) for the rows and items a device sees.
    options = CutBCEOptions(block_v=size.block_v, compute_metrics=bool(return_metrics), loss=loss,
                            impl=resolve_impl(impl, hidden.dtype), block_sizes=block_sizes)
    if mesh is not None and size.num_positions and size.hidden_size:  # an empty problem needs no mesh
        return sharded_loss(size, a, options, mesh=mesh, vocab_axis=vocab_axis, data_axis=data_axis,
                            reduction=reduction, num_items=num_items)
    if num_items is not None and num_items < size.num_items:  # one device: the padding rows go
        num_items = int(num_items)
        item_weight, bias, class_weight, pos_weight = (
            None if x is None else x[:num_items] for x in (item_weight, bias, class_weight, pos_weight))
        size = dataclasses.replace(size, num_items=num_items)
    place = OneDevice(options.resolved(num_positions=size.num_positions, num_items=size.num_items,
                                       impl=options.impl))
    operands = engine_operands(size, hidden, item_weight, targets, bias, class_weight, pos_weight)
    # 'sum' / 'mean' take core.cut_bce_weighted_sum: the gradients computed during the forward.
    return finish(functools.partial(cut_bce_rows, place), functools.partial(cut_bce_weighted_sum, place),
                  operands, weight, reduction, size.lead_shape, size.num_items, return_metrics)

