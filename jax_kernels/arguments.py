"""Argument preparation of the JAX entry points (`cut_bce`, `dense_cut_bce`).

Array-likes are converted with `jnp.asarray`, except target ids: without x64, JAX narrows int64 to
int32 by wrapping (padding -2**32 would become item 0). So concrete ids are checked on the host in
their own dtype first (ids >= V raise), negative ids become -1, and only then are they narrowed.
Traced ids are left alone: under `jit` without x64 no int64 array exists, and with x64 the engines
compare int64 ids with V in int64.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from cutbce_common.shapes import ArraySpec, ProblemSize, check_arguments, check_block_v, check_largest_id, choose_impl

FLOAT_ARGUMENTS = ("hidden", "item_weight", "bias", "weight", "class_weight", "pos_weight")


def as_array(name: str, x):
    """None, a `jax.Array` (a tracer too), or anything `jnp.asarray` converts (then converted)."""
    if x is None or isinstance(x, jax.Array):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name} must be an array (jax.Array, numpy array or nested list of numbers), "
            f"got {type(x).__name__}: {error}"
        ) from None


def host_ids(targets):
    """Target ids kept in their own dtype for the check: a `jax.Array` as is, anything else as numpy."""
    if isinstance(targets, jax.Array):
        return targets
    try:
        return np.asarray(targets)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"targets must be an integer array (jax.Array, numpy array or nested list of ints), "
            f"got {type(targets).__name__}: {error}"
        ) from None


def spec(x) -> ArraySpec | None:
    return None if x is None else ArraySpec(tuple(x.shape), np.dtype(x.dtype).name)


def check_ids_below_vocab(targets, num_items: int) -> None:
    """ids >= V raise on concrete arrays; under jit the check would need a host sync (they are masked)."""
    if isinstance(targets, jax.core.Tracer) or targets.size == 0:
        return
    check_largest_id(int(np.max(np.asarray(targets))), num_items)


def checked_ids(targets, num_items: int):
    """`host_ids` output -> a JAX array of ids: ids >= V raise, none wraps, at least 32 bits wide.

    Host (numpy) ids that JAX would narrow are rewritten first, in their own dtype: every negative
    id becomes -1. Ids narrower than 32 bits (int8, uint8, int16) are widened to int32, traced ones
    too: the engines compare ids with V and with tile bounds, which need not fit in 8 or 16 bits.
    """
    check_ids_below_vocab(targets, num_items)
    if not isinstance(targets, jax.Array):
        narrow = jax.dtypes.canonicalize_dtype(targets.dtype)
        if narrow != targets.dtype and targets.size:
            # ids are < V here, so only the negative ones can wrap: make all padding -1.
            targets = np.where(targets < 0, -1, targets).astype(narrow)
        targets = jnp.asarray(targets)
    return targets.astype(jnp.int32) if targets.dtype.itemsize < 4 else targets


def prepare(hidden, item_weight, targets, bias, weight, class_weight, pos_weight, *, reduction, block_v,
            num_items=None) -> tuple[ProblemSize, dict]:
    """Everything the entry (`cut_bce`, on one device or a mesh) checks before any engine runs.

    Returns the sizes (`size.block_v` a Python int or None) and the arguments by name, converted to
    JAX arrays, targets checked against the catalog size (`num_items`, default: the table's rows).
    """
    block_v = check_block_v(block_v)
    arrays = dict(zip(FLOAT_ARGUMENTS, (as_array(name, x) for name, x in zip(
        FLOAT_ARGUMENTS, (hidden, item_weight, bias, weight, class_weight, pos_weight)))))
    targets = host_ids(targets)
    size = check_arguments(*(spec(arrays[k]) for k in ("hidden", "item_weight")), spec(targets),
                           *(spec(arrays[k]) for k in ("bias", "weight", "class_weight", "pos_weight")),
                           reduction=reduction, block_v=block_v)
    if num_items is not None and (isinstance(num_items, bool) or not isinstance(num_items, numbers.Integral)):
        raise TypeError(f"num_items must be an int or None, got {num_items!r} of type {type(num_items).__name__}")
    catalog = size.num_items if num_items is None else int(num_items)
    if not 1 <= catalog <= size.num_items:
        raise ValueError(f"num_items must be in [1, {size.num_items}] (the table's rows), got {num_items}")
    arrays["targets"] = checked_ids(targets, catalog)
    # Mixed dtypes compute in the promoted one (bfloat16 x float32 -> float32); the casts are
    # differentiable, so each input's gradient comes back in its own dtype.
    common = jnp.promote_types(arrays["hidden"].dtype, arrays["item_weight"].dtype)
    for name in ("hidden", "item_weight"):
        arrays[name] = arrays[name].astype(common)
    return size, arrays


def resolve_impl(impl: str, dtype) -> str:
    """`shapes.choose_impl` for JAX: 'auto' is Pallas on a TPU backend (float32 / bfloat16)."""
    return choose_impl(impl, jnp.dtype(dtype).name, jax.default_backend() == "tpu")


def engine_operands(size: ProblemSize, hidden, item_weight, targets, bias, class_weight, pos_weight) -> tuple:
    """The engines' operands, on one device or a mesh: `hidden [N, D]` and `targets [N, L]`
    flattened from `[*S, ...]`, and the per-item weights as constants (no gradient flows into them)."""
    n = size.num_positions
    return (
        hidden.reshape(n, size.hidden_size),
        item_weight,
        targets.reshape(n, size.num_slots),
        bias,
        None if class_weight is None else jax.lax.stop_gradient(class_weight),
        None if pos_weight is None else jax.lax.stop_gradient(pos_weight),
    )
