"""CutBCE on a device mesh: the item table sharded along V, the positions along a data axis.

Each device runs the single-device kernels (`core.cut_bce_forward` / `cut_bce_backward`, blocked or
Pallas) on its own block of positions against its own slice of the table, inside `jax.shard_map`.
The math needs no other change, because the loss is a sum over items: shard s owns items
`[offset, offset + V_local)` with `offset = s * V_local`, and

    row[n] = sum_s sum_{v in shard s} l[n, v]

Each shard works on local ids `targets - offset`; `positives.positive_ids` drops ids outside
`[0, V_local)`, so each positive is a positive on exactly one shard. Likewise the counts (TP and
FN from the tiles' positives, FP and TN from the local count of z > 0) add up over shards.

Collectives, all outside the tile loop (a constant number per call, whatever V / block_v is):
- forward: one psum over the vocab axis of the rows and the counts, stacked into one array;
- backward: one psum of `d_hidden` over the vocab axis (every shard holds a partial sum over its
  items) and one psum of `(d_item_weight, d_bias)` over the data axis (the table is replicated
  over it, so each replica holds the gradient of its own positions only). `d_item_weight` stays
  sharded along V: no gather of the table, ever;
- the reduction of the loss over positions (outside shard_map; XLA adds one all-reduce when the
  rows are sharded over the data axis).

The scalar reductions ('mean', 'sum') know each row's gradient before the forward, so their
gradient runs `core.cut_bce_value_and_grad` on every shard, one pass over the local tiles fewer
(`sharded_weighted_sum`, the mesh twin of `core.cut_bce_weighted_sum`), with the same three psums
in one shard_map; the backward rule only scales the saved gradients.

Uneven sizes are padded here and the padding is made inert: items up to a multiple of the vocab
shard count (zero rows, zero bias and class weight 0: a padded item has z = 0 and would otherwise add
softplus(0) = log 2 (focal: 0.5^gamma log 2) to every row and a TN to the counts, so its class
weight is 0 and the TN count is corrected), positions up to a multiple of the data shard count
(their rows are sliced off, so their upstream gradient is 0 and they add nothing to any gradient). 'mean' divides by the global N x V.
For the best step time choose V divisible by the vocab shard count (pad the table at model set-up):
then no copy of the table is made.

`sharded_forward` / `sharded_backward` / `sharded_value_and_grad` are module-level twins of
`core.cut_bce_forward` / `cut_bce_backward` / `cut_bce_value_and_grad` (same arguments plus a
static `layout`), used by the custom_vjps here and fit for
torch_xla's `call_jax`: under torch_xla SPMD the shard_map lowers to manual-sharding annotations that
the torch_xla graph's SPMD partitioner honours, and an `AbstractMesh` is enough to lower it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kernels.arguments import prepare
from jax_kernels.core import (
    CutBCEConfig,
    cut_bce_backward,
    cut_bce_forward,
    cut_bce_value_and_grad,
    weighted_sum_and_residuals,
    weighted_sum_cotangents,
)
from jax_kernels.focal import check_focal
from jax_kernels.reduction import reduce_rows, scalar_row_weight
from jax_kernels.shapes import choose_impl, default_block_v

AxisName = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """Static description of one sharded call (hashable: a custom_vjp `nondiff_argnums` and a `call_jax` key).

    Attributes:
      mesh: a `jax.sharding.Mesh`, or an `AbstractMesh` (enough to lower: the torch_xla bridge
        passes one built from the torch_xla mesh's shape and axis names, no JAX devices needed).
      vocab_axis: mesh axis (or tuple of axes) the item table is split along V, or None.
      data_axis: mesh axis (or tuple of axes) the positions are split along, or None.
      config: the per-shard kernel options (`block_v` is the local tile width).
      num_items: the catalog size V when the table carries padding rows after it (a table held
        sharded in JAX must divide evenly); None: every row of the table is an item.
    """

    mesh: object
    vocab_axis: AxisName
    data_axis: AxisName
    config: CutBCEConfig
    num_items: int | None = None

    def __post_init__(self):
        _check_axes(self.mesh, self.vocab_axis, self.data_axis)

    @property
    def vocab_shards(self) -> int:
        return axis_size(self.mesh, self.vocab_axis)

    @property
    def data_shards(self) -> int:
        return axis_size(self.mesh, self.data_axis)


def _names(axis: AxisName) -> tuple[str, ...]:
    if axis is None:
        return ()
    return (axis,) if isinstance(axis, str) else tuple(axis)


def axis_size(mesh, axis: AxisName) -> int:
    """Number of shards along `axis` (a name, a tuple of names, or None -> 1)."""
    return math.prod(mesh.shape[name] for name in _names(axis))


def _check_axes(mesh, vocab_axis: AxisName, data_axis: AxisName) -> None:
    for label, axis in (("vocab_axis", vocab_axis), ("data_axis", data_axis)):
        for name in _names(axis):
            if name not in mesh.axis_names:
                raise ValueError(
                    f"{label}={axis!r} is not an axis of the mesh (axes {tuple(mesh.axis_names)}); "
                    f"pass {label}=None if nothing is sharded that way"
                )
    shared = set(_names(vocab_axis)) & set(_names(data_axis))
    if shared:
        # The backward psums d_hidden over the vocab axis and d_item_weight over the data axis; one
        # axis cannot be both (a position block and an item slice would be split the same way).
        raise ValueError(f"vocab_axis={vocab_axis!r} and data_axis={data_axis!r} share mesh axes {sorted(shared)}")


def abstract_layout(mesh_shape, axis_names, vocab_axis: AxisName, data_axis: AxisName, config: CutBCEConfig):
    """A layout over an `AbstractMesh` (shape and axis names only): what the torch_xla bridge builds.

    Lowering a shard_map needs no JAX devices when its mesh is abstract; torch_xla's SPMD partitioner
    then places the shards on its own devices `0 .. prod(mesh_shape) - 1` in row-major order (the
    order of `torch_xla.distributed.spmd.Mesh(np.arange(n), mesh_shape, axis_names)`).
    """
    mesh = jax.sharding.AbstractMesh(tuple(int(s) for s in mesh_shape), tuple(axis_names))
    return ShardedLayout(mesh, vocab_axis, data_axis, config)


def infer_mesh(*arrays):
    """The mesh the inputs live on, for calls that pass no `mesh`.

    Looked up in order: a concrete `jax.Array` with a `NamedSharding` (outside `jit`); a traced
    array's abstract sharding (inside `jit`, in Auto mode JAX reports the mesh but an all-None
    spec, so only the mesh is inferred, never the axes); the mesh set with `jax.set_mesh`.
    Returns None when none of them names a non-empty mesh.
    """
    for x in arrays:
        if x is None:
            continue
        if isinstance(x, jax.core.Tracer):
            sharding = getattr(jax.typeof(x), "sharding", None)
        else:
            sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
            return sharding.mesh
    context = jax.sharding.get_abstract_mesh()
    return None if context.empty else context


def _pad_rows(x, size, value=0):
    if x is None or x.shape[0] == size:
        return x
    pad = [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=value)


def _catalog_size(layout, item_weight) -> int:
    return item_weight.shape[0] if layout.num_items is None else layout.num_items


def _padded(layout, hidden, item_weight, targets, bias, class_weight, pos_weight):
    """Pads N to a multiple of the data shards and V to a multiple of the vocab shards, inertly.

    Every row from the catalog size on (the caller's padding rows, then ours) gets class weight 0.
    """
    num_items, table_rows, n = _catalog_size(layout, item_weight), item_weight.shape[0], hidden.shape[0]
    padded_items = -(-table_rows // layout.vocab_shards) * layout.vocab_shards
    padded_n = -(-n // layout.data_shards) * layout.data_shards
    if padded_items != num_items:
        # Ids >= V (possible only under jit) are padding, as on one device; without this they could
        # land on a padded item and count as positives there.
        targets = jnp.where(targets < num_items, targets, -1)
        if class_weight is None:
            class_weight = jnp.ones((table_rows,), item_weight.dtype)
        class_weight = _pad_rows(class_weight, padded_items)
        if num_items < table_rows:
            class_weight = class_weight.at[num_items:].set(0)
    if num_items < table_rows and layout.config.compute_metrics:
        # The loss ignores the caller's padding rows whatever they hold (class weight 0), but the
        # counts see z > 0 of every row: zero them so that they count as our zero padding does.
        real = jnp.arange(table_rows) < num_items
        item_weight = jnp.where(real[:, None], item_weight, 0)
        bias = None if bias is None else jnp.where(real, bias, 0)
    return (
        _pad_rows(hidden, padded_n),
        _pad_rows(item_weight, padded_items),
        _pad_rows(targets, padded_n, value=-1),
        _pad_rows(bias, padded_items),
        class_weight,
        _pad_rows(pos_weight, padded_items, value=1),
    )


def _local_targets(layout: ShardedLayout, targets, num_local_items: int):
    """Global ids -> this shard's ids; ids of other shards fall outside [0, V_local) and are masked."""
    if layout.vocab_shards == 1:
        return targets
    offset = lax.axis_index(layout.vocab_axis) * num_local_items
    # Padding ids are negative and stay negative after the shift.
    return targets - offset.astype(targets.dtype)


def _summed_rows(layout, rows, counts):
    """The rows and counts summed over the vocab shards, stacked `[1 + 4 or 1, N_local]`: one array,
    one all-reduce (counts are integers below 2**24, exact in float32 and float64)."""
    stacked = jnp.concatenate([rows[None], counts.astype(rows.dtype)])
    if layout.vocab_shards > 1:
        stacked = lax.psum(stacked, layout.vocab_axis)
    return stacked


def _summed_grads(layout, d_hidden, d_items, d_bias):
    """`(d_hidden, d_item_weight, d_bias?)` summed where they are partial: two all-reduces."""
    # d_hidden[n] = sum_v dz[n, v] item_weight[v]: each vocab shard holds the sum over its items.
    if layout.vocab_shards > 1:
        d_hidden = lax.psum(d_hidden, layout.vocab_axis)
    # d_item_weight[v] = sum_n dz[n, v] hidden[n]: each data replica holds the sum over its positions.
    table_grads = (d_items,) if d_bias is None else (d_items, d_bias)
    if layout.data_shards > 1:
        table_grads = lax.psum(table_grads, layout.data_axis)
    return (d_hidden, *table_grads)


def _forward_body(layout, hidden, item_weight, targets, bias, class_weight, pos_weight):
    local = _local_targets(layout, targets, item_weight.shape[0])
    rows, counts = cut_bce_forward(hidden, item_weight, local, bias, class_weight, pos_weight, config=layout.config)
    return _summed_rows(layout, rows, counts)


def _backward_body(layout, hidden, item_weight, targets, bias, class_weight, pos_weight, g):
    local = _local_targets(layout, targets, item_weight.shape[0])
    grads = cut_bce_backward(hidden, item_weight, local, bias, class_weight, pos_weight, g, config=layout.config)
    return _summed_grads(layout, *grads)


def _value_and_grad_body(layout, hidden, item_weight, targets, bias, class_weight, pos_weight, g):
    local = _local_targets(layout, targets, item_weight.shape[0])
    (rows, counts), grads = cut_bce_value_and_grad(
        hidden, item_weight, local, bias, class_weight, pos_weight, g, config=layout.config
    )
    return (_summed_rows(layout, rows, counts), *_summed_grads(layout, *grads))


def _specs(layout):
    """PartitionSpecs of `(positions [N, ...], items [V, ...], item vectors [V], rows [N])`."""
    return P(layout.data_axis, None), P(layout.vocab_axis, None), P(layout.vocab_axis), P(layout.data_axis)


def _shard_map(layout, body, out_specs, with_g):
    pos, items, vec, row = _specs(layout)
    in_specs = (pos, items, pos, vec, vec, vec) + ((row,) if with_g else ())
    # check_vma=False: the kernels' loop carries start replicated and become device-varying, which
    # the varying-manual-axes checker would reject; out_specs are what the bodies guarantee.
    return jax.shard_map(
        functools.partial(body, layout), mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs,
        check_vma=False,
    )


def sharded_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, *, layout: ShardedLayout):
    """`core.cut_bce_forward` on a mesh: same arguments (global, unpadded shapes), same outputs.

    Module-level on purpose: the torch_xla bridge can hand it to `call_jax` (keyed by id). Returns
    `rows [N]` and counts `[4 or 0, N]`, each summed over the vocab shards, sharded over the data axis.
    """
    args = _padded(layout, hidden, item_weight, targets, bias, class_weight, pos_weight)
    stacked = _shard_map(layout, _forward_body, P(None, layout.data_axis), with_g=False)(*args)
    return _rows_and_counts(layout, stacked, hidden.shape[0], _catalog_size(layout, item_weight), args[1].shape[0])


def _rows_and_counts(layout, stacked, n, num_items, padded_items):
    """`(rows [N], counts [4 or 0, N])` from the shard_map's stacked `[1 + 4 or 1, padded N]`."""
    rows, counts = stacked[0, :n], stacked[1:, :n].astype(jnp.float32)
    if layout.config.compute_metrics and padded_items != num_items:
        # Padding rows are zero (ours by construction, the caller's zeroed in _padded), so z = 0:
        # never a predicted positive, never a target. TN = rows - positives - FP therefore counted
        # each of them as a true negative of every position.
        counts = counts.at[3].add(-float(padded_items - num_items))
    return rows, counts


def sharded_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, layout: ShardedLayout):
    """`core.cut_bce_backward` on a mesh: `(d_hidden, d_item_weight, d_bias or None)`, global shapes.

    `d_item_weight` and `d_bias` keep the table's sharding along V (no gather).
    """
    n, table_rows = hidden.shape[0], item_weight.shape[0]
    args = _padded(layout, hidden, item_weight, targets, bias, class_weight, pos_weight)
    # Padded positions get g = 0, so they add nothing to the table's gradient.
    g = _pad_rows(g, args[0].shape[0])
    pos, items, vec, _ = _specs(layout)
    has_bias = bias is not None
    out_specs = (pos, items, vec) if has_bias else (pos, items)
    grads = _shard_map(layout, _backward_body, out_specs, with_g=True)(*args, g)
    d_hidden, d_items = grads[0][:n], grads[1][:table_rows]
    return d_hidden, d_items, grads[2][:table_rows] if has_bias else None


def sharded_value_and_grad(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *,
                           layout: ShardedLayout):
    """`core.cut_bce_value_and_grad` on a mesh: `((rows, counts), (d_hidden, d_item_weight, d_bias
    or None))`, global shapes, with one pass over each shard's tiles fewer than forward + backward.

    One shard_map, the same psums as `sharded_forward` and `sharded_backward` together: the stacked
    rows and counts and `d_hidden` over the vocab axis, the table's gradients over the data axis.
    """
    n, table_rows = hidden.shape[0], item_weight.shape[0]
    args = _padded(layout, hidden, item_weight, targets, bias, class_weight, pos_weight)
    # Padded positions get g = 0, so they add nothing to the table's gradient.
    g = _pad_rows(g, args[0].shape[0])
    pos, items, vec, _ = _specs(layout)
    has_bias = bias is not None
    out_specs = (P(None, layout.data_axis), pos, items) + ((vec,) if has_bias else ())
    stacked, *grads = _shard_map(layout, _value_and_grad_body, out_specs, with_g=True)(*args, g)
    rows_and_counts = _rows_and_counts(layout, stacked, n, _catalog_size(layout, item_weight), args[1].shape[0])
    return rows_and_counts, (grads[0][:n], grads[1][:table_rows], grads[2][:table_rows] if has_bias else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sharded_rows(layout, hidden, item_weight, targets, bias, class_weight, pos_weight):
    """Differentiable `sharded_forward` (the mesh twin of `core.cut_bce_rows`)."""
    return sharded_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, layout=layout)


def _rows_fwd(layout, hidden, item_weight, targets, bias, class_weight, pos_weight):
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight)
    return sharded_forward(*args, layout=layout), args


def _rows_bwd(layout, residuals, cotangents):
    g_rows, _ = cotangents  # counts are not differentiable
    d_hidden, d_items, d_bias = sharded_backward(*residuals, g_rows, layout=layout)
    return d_hidden, d_items, None, d_bias, None, None


sharded_rows.defvjp(_rows_fwd, _rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sharded_weighted_sum(layout, hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight):
    """`sum_n row_weight[n] rows[n]` and the counts on a mesh (the twin of `core.cut_bce_weighted_sum`):
    differentiated, the forward rule is `sharded_value_and_grad`; otherwise the plain forward."""
    rows, counts = sharded_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, layout=layout)
    return (rows * row_weight.astype(rows.dtype)).sum(), counts


def _weighted_sum_fwd(layout, hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight):
    value_and_grad = sharded_value_and_grad(
        hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, layout=layout
    )
    return weighted_sum_and_residuals(value_and_grad, (hidden, item_weight, bias), row_weight)


def _weighted_sum_bwd(layout, residuals, cotangents):
    d_hidden, d_items, d_bias, d_row_weight = weighted_sum_cotangents(residuals, cotangents)
    return d_hidden, d_items, None, d_bias, None, None, d_row_weight


sharded_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


def cut_bce_sharded(
    hidden,
    item_weight,
    targets,
    bias=None,
    *,
    mesh=None,
    vocab_axis: AxisName = "model",
    data_axis: AxisName = "data",
    weight=None,
    class_weight=None,
    pos_weight=None,
    reduction: str = "mean",
    return_metrics: bool = False,
    block_v: int | None = None,
    impl: str = "auto",
    block_sizes=None,
    num_items: int | None = None,
    focal=None,
):
    """`jax_kernels.cut_bce` with the item table split along V and the positions split over a mesh.

    Same loss, gradients and metrics as the single-device `jax_kernels.cut_bce` (the formula is in
    `jax_kernels/reference.py`); each device loops only over its own `V / vocab_shards` items, and
    the collectives are a constant few per call (module docstring). Works eagerly and under `jit`.

    Args:
      hidden, item_weight, targets, bias, weight, class_weight, pos_weight, reduction,
        return_metrics, impl, block_sizes, focal: as in `jax_kernels.cut_bce`.
      mesh: the `jax.sharding.Mesh`. None: inferred (`infer_mesh`) from a concrete input's
        `NamedSharding`, from a traced input's abstract mesh, or from `jax.set_mesh`. Axis names are
        never inferred (under `jit` JAX does not report the spec): they come from the two below.
      vocab_axis: mesh axis name (or tuple of names) that splits the item table along V; None
        keeps the table whole on every device (pure data parallelism).
      data_axis: mesh axis name (or tuple) that splits the N positions; None replicates them.
        Must not share an axis with vocab_axis. Mesh axes named by neither see replicated work.
      block_v: vocabulary tile of each device's local loop (default: a 16 MiB float32 tile of the
        local shapes, at most V / vocab_shards).
      num_items: the catalog size V when `item_weight` has padding rows after it. A table held
        sharded in JAX must have a row count divisible by the vocab shards (`NamedSharding` requires
        it), so a catalog of 876,939 items on 4 shards is held as 876,940 rows with num_items=876939:
        the extra rows are ignored (no loss, zero gradient, not counted), 'mean' divides by N x
        num_items, and ids >= num_items are errors. None: every row is an item. A table passed
        whole (not sharded) may have any V; it is padded inside.

    Returns:
      The loss, or `(loss, (tp, fp, fn, tn))`, as `jax_kernels.cut_bce`. Gradients of item_weight and
      bias keep the table's sharding along V.
    """
    focal = check_focal(focal)
    size, a = prepare(hidden, item_weight, targets, bias, weight, class_weight, pos_weight,
                      reduction=reduction, block_v=block_v, num_items=num_items)
    hidden, item_weight, targets, bias = a["hidden"], a["item_weight"], a["targets"], a["bias"]
    weight, class_weight, pos_weight = a["weight"], a["class_weight"], a["pos_weight"]
    block_v = size.block_v
    catalog = size.num_items if num_items is None else num_items
    if mesh is None:
        mesh = infer_mesh(item_weight, hidden)
        if mesh is None:
            raise ValueError(
                "no mesh: pass mesh=, put the inputs on a NamedSharding, or call inside jax.set_mesh(mesh)"
            )
    _check_axes(mesh, vocab_axis, data_axis)
    n = size.num_positions
    local_n = -(-n // axis_size(mesh, data_axis))
    local_items = -(-size.num_items // axis_size(mesh, vocab_axis))
    config = CutBCEConfig(
        block_v=min(block_v or default_block_v(local_n, local_items), local_items),
        compute_metrics=return_metrics,
        impl=choose_impl(impl, jnp.dtype(hidden.dtype).name, jax.default_backend() == "tpu"),
        block_sizes=block_sizes,
        focal=focal,
    )
    layout = ShardedLayout(mesh, vocab_axis, data_axis, config, None if catalog == size.num_items else catalog)
    operands = (
        hidden.reshape(n, size.hidden_size),
        item_weight,
        targets.reshape(n, size.num_slots),
        bias,
        None if class_weight is None else lax.stop_gradient(class_weight),
        None if pos_weight is None else lax.stop_gradient(pos_weight),
    )
    if reduction != "none" and n > 0:
        # A scalar loss: the gradients computed during the forward, on every shard.
        row_weight = scalar_row_weight(weight, reduction, n, catalog, hidden.dtype)
        loss, counts = sharded_weighted_sum(layout, *operands, row_weight)
    else:
        rows, counts = sharded_rows(layout, *operands)
        if weight is not None:
            rows = rows * weight.reshape(n).astype(rows.dtype)
        loss = reduce_rows(rows, reduction, catalog).reshape(size.lead_shape if reduction == "none" else ())
    if weight is not None:
        counts = counts * weight.reshape(1, n).astype(counts.dtype)
    if not return_metrics:
        return loss
    if reduction == "none":
        return loss, tuple(c.reshape(size.lead_shape) for c in counts)
    return loss, tuple(counts.sum(-1))
