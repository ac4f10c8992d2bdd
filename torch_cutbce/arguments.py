"""The torch entry's argument rules apart from the engines: validation, dtypes, the ids check.

Shape and dtype rules are framework-neutral and live in `cutbce_common.shapes.check_arguments`
(shared with `jax_kernels.cut_bce`); this module describes torch tensors to it and adds what only
torch has (requires_grad, torch.func, autocast). What depends on the engines (the backend names,
'auto', `mesh=` / `vocab_parallel=` against the backend, the devices an engine takes) is read from
the registry, `engines.py`, which imports this module (the native ops run `check_ids_below_vocab`).
"""

from __future__ import annotations

import numpy as np
import torch

from cutbce_common.shapes import AxisName, ArraySpec, check_arguments, check_largest_id


def spec(x: torch.Tensor | None, name: str = "argument") -> ArraySpec | None:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} (convert it with torch.as_tensor)")
    return ArraySpec(tuple(x.shape), str(x.dtype).removeprefix("torch."))


def check(hidden, item_weight, targets, bias, weight, class_weight, pos_weight, *, reduction, block_v):
    """`check_arguments` on the torch tensors, each named in its error."""
    tensors = dict(hidden=hidden, item_weight=item_weight, targets=targets, bias=bias, weight=weight,
                   class_weight=class_weight, pos_weight=pos_weight)
    specs = {name: spec(t, name) for name, t in tensors.items()}
    return check_arguments(**specs, reduction=reduction, block_v=block_v)


def _differentiated_by_torch_func(x) -> bool:
    """Whether `x` is wrapped by a torch.func gradient transform (grad, vjp, jacrev, jvp, jacfwd), at
    any depth of vmap. Reads torch's functorch wrappers (private: absent, nothing is refused)."""
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is None or not isinstance(x, torch.Tensor) or torch.compiler.is_compiling():
        return False  # under torch.compile dynamo sees plain tensors (and cannot call these)
    while functorch.is_gradtrackingtensor(x) or functorch.is_batchedtensor(x):
        if functorch.is_gradtrackingtensor(x):
            return True
        x = functorch.get_unwrapped(x)
    return False


def check_not_under_torch_func(tensors: dict) -> None:
    """torch.func's gradient transforms cannot run the ops' autograd (a custom op's backward written by
    hand, whose generated autograd.Function has no `setup_context`): refused by name, with what works."""
    for name, x in tensors.items():
        if _differentiated_by_torch_func(x):
            raise RuntimeError(
                f"cut_bce_with_logits: {name} is differentiated by a torch.func transform (grad, vjp, jacrev, "
                f"jvp, jacfwd), which the loss does not support: its backward is a hand-written custom-op "
                f"pass torch.func cannot transform. Use torch.autograd (loss.backward() or "
                f"torch.autograd.grad), with torch.func.functional_call for functional parameters; plain "
                f"torch.func.vmap and functional_call work")


def check_no_parallel_options(mesh, vocab_parallel) -> None:
    """DTensor arguments carry their own layout: `mesh=` and `vocab_parallel=` would be a second one."""
    for name, value in (("mesh", mesh), ("vocab_parallel", vocab_parallel)):
        if value is not None:
            raise ValueError(f"{name}= is for plain tensors; with DTensor arguments the placements say how the "
                             f"table and the positions are split (torch_cutbce.distributed): drop {name}=")


def mesh_layout(mesh, vocab_axis: AxisName, data_axis: AxisName) -> dict:
    """A torch_xla SPMD mesh as `CutBCEOptions` fields (`mesh_shape`, `mesh_axes`, `vocab_axis`,
    `data_axis`); no fields for None. Its device ids must be 0..n-1 in order: the JAX side lowers
    over an AbstractMesh of the same shape and axis names (row-major logical ids)."""
    if mesh is None:
        return {}
    device_ids = np.asarray(mesh.device_ids).ravel()
    if not np.array_equal(device_ids, np.arange(device_ids.size)):
        raise ValueError(f"mesh.device_ids must be 0..n-1 in order, got {mesh.device_ids}")
    return dict(mesh_shape=tuple(int(s) for s in mesh.mesh_shape), mesh_axes=tuple(mesh.axis_names),
                vocab_axis=vocab_axis, data_axis=data_axis)


def check_constant(name: str, t: torch.Tensor | None) -> None:
    if t is not None and t.requires_grad:
        raise ValueError(
            f"{name} requires grad, but CutBCE treats {name} as a constant (no gradient is computed); "
            f"pass {name}.detach()"
        )


def check_ids_below_vocab(targets: torch.Tensor, num_items: int) -> None:
    """The torch side's one ids >= V check (`shapes.check_largest_id`): raise on CPU, a non-blocking
    device assert on CUDA, nothing on XLA (ignored like padding). Runs inside the native ops (no
    host sync, nothing data-dependent for torch.compile) and before the dense reference."""
    if targets.numel() == 0:
        return
    if targets.device.type == "cpu":
        check_largest_id(int(targets.max()), num_items)
    elif targets.device.type == "cuda":
        torch._assert_async(targets.max() < num_items, "targets holds an item id >= V")


def matmul_dtype_inputs(hidden, item_weight, bias):
    """hidden, item_weight and bias as the logits' matmul sees them: a linear layer's rule.

    Under `torch.autocast` the floating inputs (not float64) are cast to the autocast dtype, as
    `F.linear` would; otherwise hidden and item_weight are promoted to a common dtype (torch's type
    promotion; bias is cast to the compute dtype by every engine). The casts are differentiable:
    each input's gradient comes back in its own dtype.
    """
    device_type = hidden.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        cast = lambda x: x if x is None or x.dtype == torch.float64 else x.to(dtype)  # noqa: E731
        return cast(hidden), cast(item_weight), cast(bias)
    common = torch.promote_types(hidden.dtype, item_weight.dtype)
    return hidden.to(common), item_weight.to(common), bias
