"""How the bad-input checks (conformance_bad_input.py) call an entry: `call` / `run` take numpy
arguments and give them to the entry in its framework; `good_arguments` is the valid input each
check changes one piece of.

An entry is named as its engine in `conformance_engines.ENGINES`: 'torch-native' / 'torch-dense'
(`cut_bce_with_logits`, backend 'native' / 'dense'), 'torch-module' (`CutBCEWithLogitsLoss`),
'jax-blocked' / 'jax-pallas' (`jax_kernels.cut_bce`, impl 'blocked' / 'pallas') and 'jax-dense'
(`jax_kernels.dense_cut_bce`). Unlike `conformance_engines.run`, the arguments reach the entry as
they are (wrong shapes, dtypes, types, options): its own checks are the subject. torch and jax are
imported at the first call, so an install without one of them still imports this module.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from parity import to_numpy

POSITIONAL = ("hidden", "item_weight", "targets", "bias")
MODULE_OPTIONS = ("reduction", "pos_weight", "class_weight", "block_v", "backend", "return_metrics",
                  "special_rows")
# 64-bit dtypes: JAX arrays have them only with x64 on (the session runs with it off, as users do).
WIDE_DTYPES = ("int64", "uint64", "float64", "complex128")


@dataclasses.dataclass(frozen=True)
class Zeros:
    """An array each framework builds itself (numpy has no float8 or bfloat16 that torch takes)."""

    shape: tuple[int, ...]
    dtype: str


def is_torch(entry: str) -> bool:
    return entry.startswith("torch")


def convert(entry, value, dtype=None):
    """numpy -> the entry's framework (JAX entries take numpy as is: they convert it themselves);
    anything else (a list, a tensor, an option) goes as is."""
    if isinstance(value, Zeros):
        return _zeros(entry, value)
    if not isinstance(value, np.ndarray):
        return value
    is_float = value.dtype.kind == "f"
    if is_torch(entry):
        import torch

        t = torch.as_tensor(value)
        return t.to(getattr(torch, dtype)) if dtype and is_float else t
    import jax.numpy as jnp

    return jnp.asarray(value, getattr(jnp, dtype)) if dtype and is_float else value


def _zeros(entry, value: Zeros):
    if is_torch(entry):
        import torch

        return torch.zeros(value.shape, dtype=getattr(torch, value.dtype))
    import jax
    import jax.numpy as jnp

    if value.dtype in WIDE_DTYPES and not jax.config.jax_enable_x64:
        return np.zeros(value.shape, value.dtype)  # a JAX array cannot hold it with x64 off: numpy can
    return jnp.zeros(value.shape, getattr(jnp, value.dtype))


def _function(entry):
    """The entry's function and the options that select its engine."""
    if is_torch(entry):
        from torch_cutbce import cut_bce_with_logits

        return cut_bce_with_logits, {"backend": entry.removeprefix("torch-")}
    import jax_kernels

    if entry == "jax-dense":
        return jax_kernels.dense_cut_bce, {}
    return jax_kernels.cut_bce, {"impl": entry.removeprefix("jax-")}


def call(entry, arguments, dtype=None):
    """The entry called on `arguments` (numpy, converted; float ones to `dtype` if given)."""
    a = {k: convert(entry, v, dtype) for k, v in arguments.items()}
    positional = [a.pop(k, None) for k in POSITIONAL]
    if entry == "torch-module":
        from torch_cutbce import CutBCEWithLogitsLoss

        options = {k: a.pop(k) for k in MODULE_OPTIONS if k in a}
        return CutBCEWithLogitsLoss(**options)(*positional, **a)
    fn, defaults = _function(entry)
    return fn(*positional, **{**defaults, **a})


def run(entry, arguments, *, grads=("hidden", "item_weight", "bias"), upstream=None, dtype=None):
    """`(values, dtypes)`: the loss and the gradients `d_<name>` of the arguments in `grads`.

    Values are float64 numpy, dtypes the names of the dtypes the entry returned them in.
    `upstream` is the cotangent of the loss (a scalar or an array of shape S); default 1.5.
    """
    names = [k for k in grads if arguments.get(k) is not None]
    cotangent = 1.5 if upstream is None else upstream
    if is_torch(entry):
        import torch

        diff = {k: convert(entry, arguments[k], dtype).requires_grad_() for k in names}
        loss = call(entry, {**arguments, **diff}, dtype)
        g = torch.as_tensor(cotangent, dtype=loss.dtype)
        values = torch.autograd.grad(loss, list(diff.values()), grad_outputs=g, allow_unused=True)
    else:
        import jax
        import jax.numpy as jnp

        diff = {k: jnp.asarray(convert(entry, arguments[k], dtype)) for k in names}
        loss, vjp = jax.vjp(lambda d: call(entry, {**arguments, **d}, dtype), diff)
        (cotangents,) = vjp(jnp.asarray(cotangent, loss.dtype))
        values = [cotangents[k] for k in names]
    out = {"loss": loss, **{f"d_{k}": v for k, v in zip(names, values)}}
    return {k: to_numpy(v) for k, v in out.items()}, {k: str(v.dtype).removeprefix("torch.") for k, v in out.items()}


def good_arguments():
    """S = (2, 3), D = 4, V = 7, L = 2, float32."""
    rng = np.random.default_rng(0)
    return {
        "hidden": rng.normal(size=(2, 3, 4)).astype(np.float32),
        "item_weight": rng.normal(size=(7, 4)).astype(np.float32),
        "targets": rng.integers(-1, 7, size=(2, 3, 2)),
    }


f32 = np.float32
T = (2, 3, 2)  # the shape of targets
