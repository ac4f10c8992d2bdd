"""The entry points of the bad-input tests (test_all_bad_input*.py) and how to call each one.

An entry is `cut_bce_with_logits` (backend 'native' or 'dense'), `CutBCEWithLogitsLoss`,
`jax_kernels.cut_bce` (impl 'blocked') or `jax_kernels.dense_cut_bce`; `call` / `run` take numpy
arguments and convert them to the entry's framework. `good_arguments` is the valid input each test
changes one piece of.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from parity import to_numpy
from torch_cutbce import CutBCEWithLogitsLoss, cut_bce_with_logits

# The JAX entries need the [jax] extra. Without jax they carry the `jax` mark and skip (conftest.py)
# while the torch entries run; with jax, any import error below still fails the module.
HAVE_JAX = importlib.util.find_spec("jax") is not None
if HAVE_JAX:
    import jax
    import jax.numpy as jnp

    import jax_kernels

ENTRY_NAMES = ("torch-native", "torch-dense", "torch-module", "jax-blocked", "jax-dense")
TORCH_ENTRIES = ENTRY_NAMES[:3]


def entries(names=ENTRY_NAMES):
    """pytest params for `names`, the JAX ones marked `jax`."""
    return [pytest.param(name, marks=pytest.mark.jax) if name.startswith("jax") else name for name in names]


ENTRIES = entries()
POSITIONAL = ("hidden", "item_weight", "targets", "bias")
MODULE_OPTIONS = ("reduction", "pos_weight", "class_weight", "block_v", "backend", "return_metrics")
FUNCTIONS = {
    "torch-native": (cut_bce_with_logits, {"backend": "native"}),
    "torch-dense": (cut_bce_with_logits, {"backend": "dense"}),
}
if HAVE_JAX:
    FUNCTIONS["jax-blocked"] = (jax_kernels.cut_bce, {"impl": "blocked"})
    FUNCTIONS["jax-dense"] = (jax_kernels.dense_cut_bce, {})


# 64-bit dtypes: JAX arrays have them only with x64 on (the session runs with it off, as users do).
WIDE_DTYPES = ("int64", "uint64", "float64", "complex128")


@dataclasses.dataclass(frozen=True)
class Zeros:
    """An array each framework builds itself (numpy has no float8 or bfloat16 that torch takes)."""

    shape: tuple[int, ...]
    dtype: str


def convert(entry, value, dtype=None):
    """numpy -> the entry's framework (JAX entries take numpy as is: they convert it themselves)."""
    torch_side = entry.startswith("torch")
    if isinstance(value, Zeros):
        if torch_side:
            return torch.zeros(value.shape, dtype=getattr(torch, value.dtype))
        if value.dtype in WIDE_DTYPES and not jax.config.jax_enable_x64:
            return np.zeros(value.shape, value.dtype)  # a JAX array cannot hold it with x64 off: numpy can
        return jnp.zeros(value.shape, getattr(jnp, value.dtype))
    if not isinstance(value, np.ndarray):
        return value
    is_float = value.dtype.kind == "f"
    if torch_side:
        t = torch.as_tensor(value)
        return t.to(getattr(torch, dtype)) if dtype and is_float else t
    return jnp.asarray(value, getattr(jnp, dtype)) if dtype and is_float else value


def call(entry, arguments, dtype=None):
    a = {k: convert(entry, v, dtype) for k, v in arguments.items()}
    positional = [a.pop(k, None) for k in POSITIONAL]
    if entry == "torch-module":
        options = {k: a.pop(k) for k in MODULE_OPTIONS if k in a}
        return CutBCEWithLogitsLoss(**options)(*positional, **a)
    fn, defaults = FUNCTIONS[entry]
    return fn(*positional, **{**defaults, **a})


def run(entry, arguments, *, grads=("hidden", "item_weight", "bias"), upstream=None, dtype=None):
    """`(values, dtypes)`: the loss and the gradients `d_<name>` of the arguments in `grads`.

    Values are float64 numpy, dtypes the names of the dtypes the entry returned them in.
    `upstream` is the cotangent of the loss (a scalar or an array of shape S); default 1.5.
    """
    names = [k for k in grads if arguments.get(k) is not None]
    if entry.startswith("torch"):
        diff = {k: convert(entry, arguments[k], dtype).requires_grad_() for k in names}
        loss = call(entry, {**arguments, **diff}, dtype)
        g = torch.as_tensor(1.5 if upstream is None else upstream, dtype=loss.dtype)
        values = torch.autograd.grad(loss, list(diff.values()), grad_outputs=g, allow_unused=True)
    else:
        diff = {k: jnp.asarray(convert(entry, arguments[k], dtype)) for k in names}
        loss, vjp = jax.vjp(lambda d: call(entry, {**arguments, **d}, dtype), diff)
        (cotangents,) = vjp(jnp.asarray(1.5 if upstream is None else upstream, loss.dtype))
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
