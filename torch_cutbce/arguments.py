"""The torch entry's argument rules: validation, the backend choice, devices, dtypes.

Shape and dtype rules are framework-neutral and live in `cutbce_common.shapes.check_arguments`
(shared with `jax_kernels.cut_bce`); this module describes torch tensors to it and adds what only
torch has (devices, requires_grad, autocast).
"""

from __future__ import annotations

import numpy as np
import torch

from cutbce_common.shapes import AxisName, ArraySpec, check_arguments, check_largest_id, check_mesh_axes
from torch_cutbce.route import VocabParallelOptions

BACKENDS = ("auto", "native", "dense", "xla", "xla_blocked", "xla_pallas", "torch_tpu")


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


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_parallel_options(backend: str, mesh, vocab_parallel, vocab_axis: AxisName = None,
                           data_axis: AxisName = None) -> None:
    """`mesh=` needs the torch_xla bridge and a mesh whose axes `vocab_axis` / `data_axis` name,
    `vocab_parallel=` a `VocabParallelOptions` and the native engine, and they exclude each other;
    'auto' passes (the tensors decide). The module checks this when built, the function on the
    resolved backend: one rule, one message."""
    if vocab_parallel is not None:
        if not isinstance(vocab_parallel, VocabParallelOptions):
            raise TypeError(
                f"vocab_parallel must be a VocabParallelOptions or None, got {type(vocab_parallel).__name__}")
    if mesh is not None and vocab_parallel is not None:
        raise ValueError("mesh= (torch_xla SPMD) and vocab_parallel= (torch.distributed ranks) exclude each other")
    if mesh is not None and backend not in ("auto", "xla", "xla_blocked", "xla_pallas"):
        raise ValueError(
            f"mesh= runs under torch_xla SPMD and needs XLA tensors, got backend={backend!r}; "
            f"for CPU/CUDA tensors split over processes use vocab_parallel="
        )
    if vocab_parallel is not None and backend not in ("auto", "native"):
        raise ValueError(f"vocab_parallel= runs the native engine on CPU/CUDA tensors, got backend={backend!r}")
    if mesh is not None:
        if not hasattr(mesh, "axis_names"):
            raise TypeError(f"mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
        check_mesh_axes(mesh.axis_names, vocab_axis, data_axis)


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


def resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    check_backend(backend)
    if backend == "auto":
        return {"xla": "xla", "tpu": "torch_tpu"}.get(hidden.device.type, "native")
    return backend


def check_devices(tensors: dict[str, torch.Tensor | None], backend: str, on_xla: bool | None) -> None:
    """One device for every tensor, and the one the engine runs on (`engines.Engine.on_xla`:
    True XLA tensors only, False CPU/CUDA only, None any)."""
    device = tensors["hidden"].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but hidden is on {device}: all tensors must be on one device "
                f"(move them with .to(hidden.device))"
            )
    is_xla = device.type == "xla"
    if on_xla is True and not is_xla:
        raise ValueError(f"backend={backend!r} needs tensors on an XLA device (torch_xla), got {device}")
    if on_xla is False and is_xla:
        raise ValueError(f"backend={backend!r} runs on CPU/CUDA tensors; XLA tensors use backend='auto' or 'xla'")


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
