"""Runs one example of the property-based tests through a torch or a JAX entry: numpy in, numpy out.

`torch_results` and `jax_results` return {loss, tp, fp, fn, tn (with metrics), d_<name>} as float64
numpy arrays, the gradients taken for the example's random upstream gradient (never ones). The
arguments are the example's, or `inputs` / `options` (a bad argument, bad ids) when given. torch
and jax are imported lazily: the JAX mesh worker never imports torch.
"""

from __future__ import annotations

import numpy as np

from _properties_examples import AsDtype, AsList, Example
from parity import GRADS, METRIC_NAMES


def _results(loss, metrics, grads) -> dict:
    out = {"loss": loss, **grads}
    if metrics is not None:
        out.update(zip(METRIC_NAMES, metrics))
    return {k: _numpy(x) for k, x in out.items()}


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        import torch

        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


# -- torch -----------------------------------------------------------------------------------------


def _torch_layout(t, layout: str):
    """The same values in another memory layout: a transposed or strided view, or an expand()."""
    import torch

    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout in ("strided", "transposed") and t.dim() >= 1:
        base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        base[..., ::2] = t
        return base[..., ::2]
    if layout == "expanded" and t.dim() >= 1 and t.shape[0] >= 1:
        return t[:1].expand(t.shape)  # build() made the values constant along dim 0
    return t


def _torch_argument(value, dtype: str, layout: str, device: str, grad: bool):
    import torch

    if isinstance(value, AsList):
        return value.value
    if isinstance(value, AsDtype):
        t = torch.tensor(np.asarray(value.value, np.float64)).to(getattr(torch, value.dtype))
    elif np.asarray(value).dtype.kind == "f":
        t = torch.tensor(np.asarray(value, np.float64)).to(getattr(torch, dtype))
    else:
        t = torch.from_numpy(np.array(value))
    t = _torch_layout(t, layout).to(device)
    if grad and t.is_floating_point():
        t = t.detach().requires_grad_(True)
    return t


def torch_results(example: Example, fn, *, device: str = "cpu", inputs=None, options=None) -> dict:
    """Calls `fn(hidden, item_weight, targets, bias, *, weight, class_weight, pos_weight, reduction,
    return_metrics, block_v)` (e.g. `cut_bce_with_logits` with a backend) and its autograd backward."""
    import torch

    inputs = example.inputs if inputs is None else inputs
    options = example.call_options if options is None else options
    layouts = dict(example.spec.layouts) if device == "cpu" else {}
    args = {k: _torch_argument(v, example.spec.dtype, layouts.get(k, "contiguous"), device, k in GRADS)
            for k, v in inputs.items()}
    out = fn(args["hidden"], args["item_weight"], args["targets"], args.get("bias"), weight=args.get("weight"),
             class_weight=args.get("class_weight"), pos_weight=args.get("pos_weight"), **options)
    loss, metrics = out if options["return_metrics"] else (out, None)
    leaves = {k: t for k, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    upstream = torch.tensor(example.upstream, dtype=torch.float64).to(device=loss.device, dtype=loss.dtype)
    grads = torch.autograd.grad(loss, list(leaves.values()), grad_outputs=upstream, allow_unused=True,
                                materialize_grads=True)
    return _results(loss, metrics, {f"d_{k}": g for k, g in zip(leaves, grads)})


def bridge_results(example: Example, fn, **kwargs) -> dict:
    """`torch_results` on XLA tensors (the torch_xla bridge) in the users' JAX configuration: x64 on,
    thread-locally, only for float64 (the backward, which autograd runs on its own thread, is lowered
    in the forward's mode)."""
    import torch_xla

    from parity import jax_x64

    with jax_x64(example.spec.dtype):
        return torch_results(example, fn, device=torch_xla.device(), **kwargs)


# -- JAX -------------------------------------------------------------------------------------------


def _jax_argument(value, dtype: str):
    import jax.numpy as jnp

    if isinstance(value, AsList):
        return value.value
    if isinstance(value, AsDtype):
        return jnp.asarray(np.asarray(value.value, np.float64).astype(jnp.dtype(value.dtype)))
    if np.asarray(value).dtype.kind == "f":
        return jnp.asarray(value, dtype=jnp.dtype(dtype))
    return jnp.asarray(value)


def jax_results(example: Example, *, jit: bool, inputs=None, options=None, variants=None, **kwargs):
    """`jax_kernels.cut_bce(..., **options, **kwargs)` and its vjp, jitted or eager, in the users' JAX
    configuration: x64 off, except for float64 examples. Eagerly the targets stay the numpy array
    they are (int64 ids too: what a user passes); under jit they are an argument of the jitted step.
    `variants`: a list of targets arrays to run through the same (jitted) step; returns a list."""
    import jax

    import jax_kernels
    from parity import enable_x64

    inputs = example.inputs if inputs is None else inputs
    options = example.call_options if options is None else options
    with enable_x64(example.spec.dtype == "float64"):
        args = {k: v if k == "targets" else _jax_argument(v, example.spec.dtype) for k, v in inputs.items()}
        floating = lambda x: hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
        diff = {k: args.pop(k) for k in GRADS if floating(args.get(k))}
        ids = args.pop("targets")

        def step(diff, ids, upstream):
            def loss_fn(diff):
                a = {**args, **diff}
                out = jax_kernels.cut_bce(a["hidden"], a["item_weight"], ids, a.get("bias"), weight=a.get("weight"),
                                          class_weight=a.get("class_weight"), pos_weight=a.get("pos_weight"),
                                          **options, **kwargs)
                return out if options["return_metrics"] else (out, None)

            loss, vjp, metrics = jax.vjp(loss_fn, diff, has_aux=True)
            (cotangents,) = vjp(upstream.astype(loss.dtype))
            return loss, metrics, cotangents

        step = jax.jit(step) if jit else step
        runs = []
        for variant in [ids] if variants is None else variants:
            if jit or isinstance(variant, (AsDtype, AsList)):
                variant = _jax_argument(variant, example.spec.dtype)
            loss, metrics, grads = step(diff, variant, jax.numpy.asarray(example.upstream))
            runs.append(_results(loss, metrics, {f"d_{k}": g for k, g in grads.items()}))
        return runs[0] if variants is None else runs
