"""One `setup()` per provider, shared by the speed and the memory benchmark (Liger's layout).

A provider is one way of computing `BCEWithLogitsLoss(hidden @ item_weight.T, multi_hot(targets),
reduction='mean')` and its gradients for hidden and item_weight:

    dense_eager    torch: F.binary_cross_entropy_with_logits on the materialized [N, V] logits
    dense_compile  the same function under torch.compile (inductor, C++ on CPU)
    native         torch_cutbce.cut_bce_with_logits on CPU tensors (the chunked native path)
    xla_bridge     torch_cutbce.cut_bce_with_logits on an XLA device (torch_xla -> call_jax -> JAX)
    xla_dense      the dense torch function on the same XLA device
    jax_blocked    jax_kernels.cut_bce under jax.jit (value_and_grad), compiled ahead of time
    mm_floor       not a loss: the three blocked matmul passes of a training step, the roofline

`setup(provider, shape, mode)` returns a `Case` whose `step()` runs one forward or forward +
backward to completion. torch_xla and jax are imported inside setup, so a memory worker loads only
what its provider needs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

PROVIDERS = ("dense_eager", "dense_compile", "native", "xla_bridge", "xla_dense", "jax_blocked", "mm_floor")
DENSE_PROVIDERS = ("dense_eager", "dense_compile", "xla_dense")
MODES = ("fwd", "fwd+bwd")
# About how many float32 [N, V] arrays each dense provider holds at its peak (forward + backward,
# the multi-hot target included): used to skip timings that cannot fit, never as a measurement.
DENSE_ARRAYS = {"dense_eager": 4, "dense_compile": 4, "xla_dense": 7}


@dataclasses.dataclass(frozen=True)
class Shape:
    num_positions: int  # N
    hidden_size: int  # D
    num_items: int  # V
    num_slots: int = 8  # L
    dtype: str = "float32"

    def label(self) -> str:
        return f"N={self.num_positions} D={self.hidden_size} V={self.num_items} L={self.num_slots} {self.dtype}"


@dataclasses.dataclass
class Case:
    """What a benchmark needs from a provider: a step, and the sizes to report around it."""

    step: Callable[[], object]
    grad_bytes: int  # bytes of the gradients one fwd+bwd step allocates (hidden's and item_weight's)
    clear: Callable[[], None] = lambda: None  # drops what a step leaves behind (the .grad tensors)
    block_v: int | None = None
    xla_temp_bytes: int | None = None  # XLA's compiled memory analysis, where there is one
    note: str = ""


def prepare(provider_names) -> None:
    """Imports what the providers need, in the order that works: torch, torch_xla, then jax.

    The XLA device must exist before the first backward of the process: the autograd engine sizes
    its per-device queues on first use, and an XLA device started later fails its backward.
    """
    import torch  # noqa: F401

    if any(p.startswith("xla") for p in provider_names):
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla

        torch_xla.device()  # starts the runtime: the device must exist before the first backward
    if any(p.startswith(("xla", "jax")) for p in provider_names):
        import jax  # noqa: F401


def useful_flops(shape: Shape, mode: str) -> int:
    """Matmul flops a step needs at least: 2NVD per pass, 1 pass forward, 3 forward + backward."""
    passes = 1 if mode == "fwd" else 3
    return passes * 2 * shape.num_positions * shape.num_items * shape.hidden_size


def dense_bytes(provider: str, shape: Shape) -> int:
    return DENSE_ARRAYS.get(provider, 0) * shape.num_positions * shape.num_items * 4


_cache: dict = {}


def _cached(key, build):
    """One shape's inputs at a time, shared by every provider and mode of that shape (saves N x V bytes)."""
    if key not in _cache:
        for old in [k for k in _cache if k[1] != key[1]]:
            del _cache[old]
        _cache[key] = build()
    return _cache[key]


def make_numpy_inputs(shape: Shape, seed: int = 0):
    """hidden [N, D], item_weight [V, D], targets [N, L] int64 with padding and duplicates (numpy).

    Logits come out about N(0, 1). A quarter of the target slots are -1 (padding) and every fourth
    position repeats its first id, as in the reference baseline's workload.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    n, d, v, slots = shape.num_positions, shape.hidden_size, shape.num_items, shape.num_slots
    hidden = rng.standard_normal((n, d), dtype=np.float32)
    item_weight = rng.standard_normal((v, d), dtype=np.float32) / np.float32(d**0.5)
    targets = rng.integers(0, v, size=(n, slots))
    targets[rng.random((n, slots)) < 0.25] = -1
    if slots > 1:
        targets[::4, 1] = targets[::4, 0]
    return hidden, item_weight, targets


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _multi_hot(targets, num_items, device=None):
    import torch

    multi_hot = torch.zeros(targets.shape[0], num_items, dtype=torch.float32, device=device)
    valid = targets >= 0
    multi_hot.scatter_(1, torch.where(valid, targets, 0), valid.to(torch.float32))
    # scatter_ writes 0 for padding at column 0, which may also be a real id of the row: redo it.
    multi_hot[:, 0] = (targets == 0).any(-1).to(torch.float32)
    return multi_hot


def _dense_loss(hidden, item_weight, multi_hot):
    import torch.nn.functional as F

    return F.binary_cross_entropy_with_logits(hidden @ item_weight.T, multi_hot)


def _torch_case(shape, mode, loss_fn, tensors, device, synchronize=lambda: None) -> Case:
    """A step over torch leaves (hidden, item_weight): no_grad loss for 'fwd', loss + backward else."""
    import torch

    hidden, item_weight = tensors[0], tensors[1]

    def step():
        if mode == "fwd":
            with torch.no_grad():
                loss = loss_fn(*tensors)
            synchronize()
            return loss
        hidden.grad = item_weight.grad = None  # same graph every step (no accumulation)
        loss = loss_fn(*tensors)
        loss.backward()
        synchronize()
        return loss

    def clear():
        hidden.grad = item_weight.grad = None

    grad_bytes = 4 * (hidden.numel() + item_weight.numel()) if mode != "fwd" else 0
    return Case(step=step, grad_bytes=grad_bytes, clear=clear)


def _leaves(shape, arrays, device):
    import torch

    hidden, item_weight, targets = arrays
    dtype = _torch_dtype(shape.dtype)
    h = torch.tensor(hidden).to(device=device, dtype=dtype).requires_grad_()
    e = torch.tensor(item_weight).to(device=device, dtype=dtype).requires_grad_()
    return h, e, torch.tensor(targets).to(device)


def setup(provider: str, shape: Shape, mode: str, *, block_v: int | None = None) -> Case:
    """Inputs for `shape` and a `Case` whose step runs `provider` once in `mode`."""
    if provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    from cutbce_common.shapes import default_block_v

    block_v = block_v or default_block_v(shape.num_positions, shape.num_items)
    arrays = _cached(("numpy", shape), lambda: make_numpy_inputs(shape))
    if provider in ("dense_eager", "dense_compile", "native", "mm_floor"):
        case = _setup_cpu(provider, shape, mode, arrays, block_v)
    elif provider in ("xla_bridge", "xla_dense"):
        case = _setup_xla(provider, shape, mode, arrays, block_v)
    else:
        case = _setup_jax(shape, mode, arrays, block_v)
    case.block_v = None if provider in DENSE_PROVIDERS else block_v
    return case


def _setup_cpu(provider, shape, mode, arrays, block_v) -> Case:
    import torch

    from torch_cutbce import cut_bce_with_logits

    h, e, targets = _leaves(shape, arrays, "cpu")
    if provider == "native":
        return _torch_case(shape, mode, lambda a, b, t: cut_bce_with_logits(a, b, t, block_v=block_v), (h, e, targets), "cpu")
    if provider == "mm_floor":
        return _mm_floor_case(shape, mode, h.detach(), e.detach(), block_v)
    multi_hot = _cached(("multi_hot", shape), lambda: _multi_hot(targets, shape.num_items))
    loss_fn = _dense_loss if provider == "dense_eager" else torch.compile(_dense_loss, dynamic=False)
    return _torch_case(shape, mode, loss_fn, (h, e, multi_hot), "cpu")


def _mm_floor_case(shape, mode, h, e, block_v) -> Case:
    """The matmuls of native's tiles and nothing else: `z = h @ E_t.T`; `d_h += z @ E_t`; `d_E_t = z.T @ h`."""
    import torch

    def step():
        n, v = shape.num_positions, shape.num_items
        z_buffer = torch.empty(n * min(block_v, v), dtype=h.dtype)
        d_hidden = torch.zeros_like(h) if mode != "fwd" else None
        d_items = torch.empty_like(e) if mode != "fwd" else None
        for start in range(0, v, block_v):
            stop = min(start + block_v, v)
            items = e[start:stop]
            z = z_buffer[: n * (stop - start)].view(n, stop - start)
            torch.mm(h, items.T, out=z)
            if mode != "fwd":
                d_hidden.addmm_(z, items)
                torch.mm(z.T, h, out=d_items[start:stop])
        return d_hidden

    return Case(step=step, grad_bytes=4 * (h.numel() + e.numel()) if mode != "fwd" else 0)


def _setup_xla(provider, shape, mode, arrays, block_v) -> Case:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla
    import torch_xla.core.xla_model as xm

    from torch_cutbce import cut_bce_with_logits

    device = torch_xla.device()
    h, e, targets = _leaves(shape, arrays, device)

    def synchronize():
        torch_xla.sync()
        xm.wait_device_ops()

    if provider == "xla_bridge":
        loss_fn = lambda a, b, t: cut_bce_with_logits(a, b, t, block_v=block_v)  # noqa: E731
        tensors = (h, e, targets)
    else:
        tensors = (h, e, _multi_hot(targets.cpu(), shape.num_items).to(device))
        loss_fn = _dense_loss
    synchronize()
    return _torch_case(shape, mode, loss_fn, tensors, device, synchronize)


def _setup_jax(shape, mode, arrays, block_v) -> Case:
    import jax
    import jax.numpy as jnp

    import jax_kernels

    hidden, item_weight, targets = (jnp.asarray(a) for a in arrays)
    hidden, item_weight = hidden.astype(shape.dtype), item_weight.astype(shape.dtype)
    targets = targets.astype(jnp.int32)

    def loss(h, e):
        return jax_kernels.cut_bce(h, e, targets, block_v=block_v)

    fn = jax.jit(loss) if mode == "fwd" else jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = fn.lower(hidden, item_weight).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)

    def step():
        return jax.block_until_ready(compiled(hidden, item_weight))

    grad_bytes = 4 * (hidden.size + item_weight.size) if mode != "fwd" else 0
    return Case(step=step, grad_bytes=grad_bytes, xla_temp_bytes=temp)
