"""CutBCE on a device mesh: the item table split along V, the positions along a data axis.

Inside `jax.shard_map` each device runs the single-device engines on its positions and its slice
of the table, ids shifted into the slice, so each positive is taken out on exactly one shard
(docs/design.md, 'How each engine stays exact'). Rows, counts and `d_hidden` are psummed over the
vocab axis, the table's gradients over the data axis: a few collectives per call, none in the tile
loop, and the table is never gathered. Uneven sizes are padded and made inert. The shard_map runs
over Auto axes; a mesh with Explicit axes (jax >= 0.8.1's default) runs it inside `auto_axes`
(`run_on_auto_axes`). A `ShardedLayout` is a place for `core`'s one custom_vjp pair (its
`forward` / `backward` / `value_and_grad`: `sharded_forward` / ..., which mirror `core`'s
functions, also for torch_xla's `call_jax` over an `AbstractMesh`). Usage: docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kernels.arguments import engine_operands
from jax_kernels.core import (
    cut_bce_backward,
    cut_bce_forward,
    cut_bce_rows,
    cut_bce_value_and_grad,
    cut_bce_weighted_sum,
)
from jax_kernels.reduction import finish
from cutbce_common.options import CutBCEOptions
from cutbce_common.shapes import AxisName, check_mesh_axes, mesh_axis_names


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """Static description of one sharded call (hashable: a custom_vjp `nondiff_argnums` and a `call_jax` key).

    Attributes:
      mesh: a `jax.sharding.Mesh`, or an `AbstractMesh` (enough to lower: the torch_xla bridge
        passes one built from the torch_xla mesh's shape and axis names, no JAX devices needed).
      options: the call's resolved options (`CutBCEOptions.resolved`: `block_v` is the local tile
        width), whose `mesh_shape` / `mesh_axes` are the mesh's and whose `vocab_axis` (the axis or
        axes the item table is split along V) and `data_axis` (the positions') the layout reads.
      num_items: the catalog size V when the table carries padding rows after it (a table held
        sharded in JAX must divide evenly); None: every row of the table is an item.
    """

    mesh: object
    options: CutBCEOptions
    num_items: int | None = None

    def __post_init__(self):
        ours = mesh_fields(self.mesh)
        if (self.options.mesh_shape, self.options.mesh_axes) != (ours["mesh_shape"], ours["mesh_axes"]):
            raise ValueError(
                f"options mesh_shape={self.options.mesh_shape} / mesh_axes={self.options.mesh_axes} are not "
                f"the layout's mesh {ours['mesh_shape']} / {ours['mesh_axes']}"
            )

    @property
    def vocab_axis(self) -> AxisName:
        return self.options.vocab_axis

    @property
    def data_axis(self) -> AxisName:
        return self.options.data_axis

    # A place to run for `core`'s custom_vjp pair (as `core.OneDevice` is for one device): the
    # layout wraps the one pair, it does not rewrite it.
    def forward(self, *operands):
        return sharded_forward(*operands, layout=self)

    def backward(self, *operands_and_g):
        return sharded_backward(*operands_and_g, layout=self)

    def value_and_grad(self, *operands_and_g):
        return sharded_value_and_grad(*operands_and_g, layout=self)

    @property
    def vocab_shards(self) -> int:
        return axis_size(self.mesh, self.vocab_axis)

    @property
    def data_shards(self) -> int:
        return axis_size(self.mesh, self.data_axis)


def mesh_fields(mesh) -> dict:
    """`mesh` as the `CutBCEOptions` fields that describe it (`mesh_shape`, `mesh_axes`)."""
    return {"mesh_shape": tuple(mesh.shape[name] for name in mesh.axis_names), "mesh_axes": tuple(mesh.axis_names)}


def axis_size(mesh, axis: AxisName) -> int:
    """Number of shards along `axis` (a name, a tuple of names, or None -> 1)."""
    return math.prod(mesh.shape[name] for name in mesh_axis_names(axis))


def abstract_layout(options: CutBCEOptions) -> ShardedLayout:
    """A layout over an `AbstractMesh` of `options.mesh_shape` / `mesh_axes` (resolved options):
    what the torch_xla bridge builds.

    Lowering a shard_map needs no JAX devices when its mesh is abstract; torch_xla's SPMD partitioner
    then places the shards on its own devices `0 .. prod(mesh_shape) - 1` in row-major order (the
    order of `torch_xla.distributed.spmd.Mesh(np.arange(n), mesh_shape, axis_names)`).
    """
    # Auto axes said outright: since jax 0.8.1 an AbstractMesh's axes default to Explicit.
    auto = (AxisType.Auto,) * len(options.mesh_axes)
    mesh = jax.sharding.AbstractMesh(options.mesh_shape, options.mesh_axes, axis_types=auto)
    return ShardedLayout(mesh, options)


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


def _axes_of_type(mesh, axis_type) -> tuple[str, ...]:
    types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
    return tuple(name for name, t in zip(mesh.axis_names, types) if t == axis_type)


def auto_mesh(mesh):
    """`mesh` with every axis Auto: the same devices, or for an `AbstractMesh` the same shape and
    device kind (shard_map checks it against the context's under `auto_axes`)."""
    if not _axes_of_type(mesh, AxisType.Explicit):
        return mesh
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return mesh.update_axis_types({name: AxisType.Auto for name in mesh.axis_names})
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _abstract(mesh):
    return mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh


def _lead_spec(x, mesh, lead_rank: int):
    """The spec of `x`'s first `lead_rank` dims when its type is sharded on `mesh`, else replicated."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or _abstract(sharding.mesh) != _abstract(mesh):
        return P()
    return P(*(tuple(sharding.spec) + (None,) * x.ndim)[:lead_rank])


def run_on_auto_axes(mesh, fn, *args, lead_shape, reduction: str, return_metrics: bool):
    """`fn(*args)` (the loss and its metrics) with `mesh`'s Explicit axes made Auto for its duration.

    The sharded path places its operands with shard_map in_specs and pads and slices arrays whose
    sizes the shards need not divide, which Explicit sharding types would each have to state; under
    `auto_axes` it runs as on an Auto mesh. Its operands keep their placement; the results come back
    with explicit types: a scalar replicated, per-position results (reduction='none') sharded as
    `hidden`'s leading dims. The gradients come back with their inputs' types (auto_axes' transpose).
    """
    if _axes_of_type(mesh, AxisType.Manual):
        raise ValueError(
            f"cut_bce(mesh=) runs its own shard_map and cannot run over the Manual axes "
            f"{_axes_of_type(mesh, AxisType.Manual)} of mesh {mesh}: call it outside jax.shard_map"
        )
    explicit = _axes_of_type(mesh, AxisType.Explicit)
    if not explicit:
        return fn(*args)
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context != _abstract(mesh):
        raise ValueError(
            f"cut_bce(mesh=) got mesh {mesh} inside jax.set_mesh of another mesh {context}: its Explicit "
            f"axes {explicit} can only be made Auto under their own mesh; pass that mesh or leave the context"
        )
    rows_spec = _lead_spec(args[0], mesh, len(lead_shape)) if reduction == "none" else P()
    # On the abstract mesh: jax 0.7's auto_axes compares the meshes of several shardings abstractly.
    loss_sharding = NamedSharding(_abstract(mesh), rows_spec)
    out_sharding = (loss_sharding, (loss_sharding,) * 4) if return_metrics else loss_sharding
    return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_sharding)(*args)


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
    if num_items < table_rows and layout.options.compute_metrics:
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
    rows, counts = cut_bce_forward(hidden, item_weight, local, bias, class_weight, pos_weight, options=layout.options)
    return _summed_rows(layout, rows, counts)


def _backward_body(layout, hidden, item_weight, targets, bias, class_weight, pos_weight, g):
    local = _local_targets(layout, targets, item_weight.shape[0])
    grads = cut_bce_backward(hidden, item_weight, local, bias, class_weight, pos_weight, g, options=layout.options)
    return _summed_grads(layout, *grads)


def _value_and_grad_body(layout, hidden, item_weight, targets, bias, class_weight, pos_weight, g):
    local = _local_targets(layout, targets, item_weight.shape[0])
    (rows, counts), grads = cut_bce_value_and_grad(
        hidden, item_weight, local, bias, class_weight, pos_weight, g, options=layout.options
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
    if layout.options.compute_metrics and padded_items != num_items:
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


def sharded_loss(size, a, options: CutBCEOptions, *, mesh, vocab_axis: AxisName, data_axis: AxisName,
                 reduction: str, num_items: int | None):
    """The loss of `jax_kernels.cut_bce(..., mesh=)` on arguments its `prepare` has checked, with
    the call's `options` (one device's: no mesh yet, the engine chosen, the tile not yet sized).

    Each device loops over its own `V / vocab_shards` items and `N / data_shards` positions; the
    collectives are a constant few per call. `mesh='infer'`: from a concrete input's
    `NamedSharding`, a traced input's abstract mesh, or `jax.set_mesh` (`infer_mesh`); axis names
    are never inferred. `num_items`: the catalog when the table has padding rows after it
    (a table sharded along V needs a row count the shards divide). Rules: docs/design.md, 'The API'.
    """
    hidden, item_weight, targets, bias = a["hidden"], a["item_weight"], a["targets"], a["bias"]
    weight, class_weight, pos_weight = a["weight"], a["class_weight"], a["pos_weight"]
    return_metrics = options.compute_metrics
    catalog = size.num_items if num_items is None else num_items
    if isinstance(mesh, str):
        mesh = infer_mesh(item_weight, hidden)
        if mesh is None:
            raise ValueError(
                "mesh='infer' found no mesh: put the inputs on a NamedSharding, call inside "
                "jax.set_mesh(mesh), or pass mesh="
            )
    check_mesh_axes(mesh.axis_names, vocab_axis, data_axis)
    user_mesh, mesh = mesh, auto_mesh(mesh)
    n = size.num_positions
    local_n = -(-n // axis_size(mesh, data_axis))
    local_items = -(-size.num_items // axis_size(mesh, vocab_axis))
    on_mesh = dataclasses.replace(options, **mesh_fields(mesh), vocab_axis=vocab_axis, data_axis=data_axis)
    resolved = on_mesh.resolved(num_positions=local_n, num_items=local_items, impl=options.impl)
    layout = ShardedLayout(mesh, resolved, None if catalog == size.num_items else catalog)

    def loss(hidden, item_weight, targets, bias, class_weight, pos_weight, weight):
        operands = engine_operands(size, hidden, item_weight, targets, bias, class_weight, pos_weight)
        return finish(functools.partial(cut_bce_rows, layout), functools.partial(cut_bce_weighted_sum, layout),
                      operands, weight, reduction, size.lead_shape, catalog, return_metrics)

    return run_on_auto_axes(user_mesh, loss, hidden, item_weight, targets, bias, class_weight, pos_weight, weight,
                            lead_shape=size.lead_shape, reduction=reduction, return_metrics=return_metrics)
