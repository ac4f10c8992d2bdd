"""The JAX half of the torch bridges: what each bridge op computes, for torch_xla's `call_jax` and
TorchTPU's `jax_op` (the torch half, fakes and autograd rules: `torch_cutbce/jax_bridge/ops.py`).

    rows            jax_forward       (rows [N], counts [4 or 0, N])     place.forward
    rows_backward   jax_backward      (d_hidden, d_items, d_bias)        place.backward
    weighted_sum    jax_weighted_sum  (loss, counts, rows, grads...)     place.value_and_grad

Each op's `options: str` (`CutBCEOptions.encode()`) becomes `place` (`jax_static`): the decoded
options, resolved, in a `core.OneDevice` for one device or a `sharded.ShardedLayout` under a mesh;
both run the same engines. Output structures never vary with the options (a missing d_bias is an empty
placeholder): torch_xla 2.9's `call_jax` keeps one output tree per function, and a `jax_op`'s
schema is its return annotation. The functions are module-level: `call_jax` caches lowerings by
`id(fn)`. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import jax_kernels.core as jax_core
import jax_kernels.sharded as jax_sharded
from cutbce_common.options import CutBCEOptions, decode
from cutbce_common.shapes import choose_impl

_trace_count = 0


def trace_count() -> int:
    """How many times the table's JAX functions were traced (i.e. lowered by a registrar) so far."""
    return _trace_count


def _traced():
    global _trace_count
    _trace_count += 1  # runs at trace time only: counts lowerings, not calls


def _placeholder(d_bias, d_items):
    return jnp.zeros((0,), d_items.dtype) if d_bias is None else d_bias


def jax_forward(hidden, item_weight, targets, bias, class_weight, pos_weight, *, place):
    """Rows `[N]` and counts `[4 or 0, N]` at `place` (`jax_static`: one device or a mesh)."""
    _traced()
    return place.forward(hidden, item_weight, targets, bias, class_weight, pos_weight)


def jax_backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g, *, place):
    """`(d_hidden, d_item_weight, d_bias or an empty placeholder)` for the rows' upstream `g` `[N]`."""
    _traced()
    d_hidden, d_items, d_bias = place.backward(hidden, item_weight, targets, bias, class_weight, pos_weight, g)
    return d_hidden, d_items, _placeholder(d_bias, d_items)


def jax_weighted_sum(hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight, *, place):
    """`sum_n row_weight[n] rows[n]`, the `[4 or 0, N]` counts, the rows, and the gradients for an
    upstream 1 (accumulation dtype; Pallas's table gradient in the table's dtype), in one pass over
    the tiles (`place.value_and_grad`)."""
    _traced()
    args = (hidden, item_weight, targets, bias, class_weight, pos_weight, row_weight)
    (rows, counts), (d_hidden, d_items, d_bias) = place.value_and_grad(*args)
    loss = (rows * row_weight.astype(rows.dtype)).sum()
    # The placeholder in the accumulation dtype (d_hidden's), not the table gradient's: Pallas gives
    # that one in the table's dtype, and the fake says float32.
    return loss, counts, rows, d_hidden, d_items, _placeholder(d_bias, d_hidden)


def resolve_impl(options: CutBCEOptions, dtype_name: str, on_tpu: bool) -> str:
    """The JAX engine `options.impl` names for inputs of `dtype_name` ('float32', ...): 'auto' is
    Pallas on a TPU for float32 / bfloat16 (`shapes.choose_impl`). Raises TypeError for
    impl='pallas' with another dtype."""
    return choose_impl(options.impl, dtype_name, on_tpu)


def jax_static(options: str, num_positions: int, num_items: int, dtype_name: str, on_tpu: bool) -> dict:
    """The JAX functions' keyword arguments for an op's `options` string: `place`, the resolved
    options on one device (`core.OneDevice`) or on the mesh they name (`sharded.abstract_layout`);
    hashable (`call_jax`'s cache key)."""
    return {"place": _place(options, num_positions, num_items, dtype_name, on_tpu)}


@functools.lru_cache(maxsize=256)  # the ops build it on every call: resolving checks every field again
def _place(options: str, num_positions: int, num_items: int, dtype_name: str, on_tpu: bool):
    o = decode(options)
    # cpu_kernel=False: neither bridge's runtime registers the blocked loop's C kernel (an XLA FFI
    # target of jax's own CPU client); the jnp tiles compute the same. A default tile is sized for
    # the whole problem (N x V), also under a mesh, as the torch entry once did.
    resolved = dataclasses.replace(o, cpu_kernel=False).resolved(
        num_positions=num_positions, num_items=num_items, impl=resolve_impl(o, dtype_name, on_tpu))
    return jax_sharded.abstract_layout(resolved) if resolved.mesh_shape else jax_core.OneDevice(resolved)


def enable_x64(on: bool):
    """JAX's thread-local 64-bit mode switch (`jax.enable_x64` from jax 0.8, before it
    `jax.experimental.enable_x64`)."""
    switch = getattr(jax, "enable_x64", None)
    if switch is None:
        import jax.experimental as jax_experimental  # binds no local `jax`

        switch = jax_experimental.enable_x64
    return switch(on)


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)
