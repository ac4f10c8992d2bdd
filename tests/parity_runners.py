"""The parity ladder's framework runners and its float64 oracle; import them from `parity`.

`run_torch` / `run_jax` turn numpy inputs (`parity.make_inputs`, `parity.select`) into tensors,
run a loss function with a random upstream gradient, and hand back numpy results keyed by name
(loss, d_<input>, tp, fp, fn, tn). `float64_truth` is the oracle's results: torch's dense loss, or
JAX's where torch is not installed (the JAX-only environment of ci/jax_newest.sh).
`check_against_oracle` holds a path to the parity rule against it. torch and jax are imported
lazily, inside the runners.
"""

from __future__ import annotations

import functools

from parity import (
    GRADS,
    HAVE_TORCH,
    METRIC_NAMES,
    _torch,
    assert_close,
    jax_dtype,
    jax_x64,
    make_upstream,
    to_numpy,
    torch_dtype,
)


def _collect(loss, metrics, grads):
    results = {"loss": loss, **grads}
    if metrics is not None:
        results.update(zip(METRIC_NAMES, metrics))
    return {k: to_numpy(x) for k, x in results.items()}


def check_against_oracle(run, fn, same_dtype_reference, inputs, lead_shape, *, dtype, reduction, name, seed=0,
                         grad_names=GRADS, **kwargs):
    """The parity rule of `dtype` for the loss, gradients and metrics of `fn` vs the float64 dense oracle.

    `run` is `run_torch` or `run_jax` (the fast path's framework); the upstream gradient is random
    and non-uniform. For bfloat16 the rule is CCE's: `fn`'s error against the float64 truth may
    exceed `same_dtype_reference`'s (the dense loss run in bfloat16 by `run`) by the tolerance.
    Returns `fn`'s results.
    """
    upstream = make_upstream(reduction, lead_shape, seed=seed, dtype=dtype)
    common = dict(upstream=upstream, grad_names=grad_names, reduction=reduction)
    fast = run(fn, inputs, dtype=dtype, **common, **kwargs)
    truth = float64_truth(inputs, **common)
    if dtype == "bfloat16":
        same_dtype = run(same_dtype_reference, inputs, dtype="bfloat16", **common)
        assert_close(fast, same_dtype, truth, dtype=dtype, name=name)
    else:
        assert_close(fast, truth, dtype=dtype, name=name)
    return fast


def float64_truth(inputs, *, upstream, grad_names=GRADS, reduction, **kwargs):
    """The float64 oracle's loss, gradients and metrics: torch's `dense_bce_with_logits`, or without
    torch `jax_kernels.dense_cut_bce` (x64 on), the same loss (test_reference.py checks the two)."""
    common = dict(dtype="float64", upstream=upstream, grad_names=grad_names, reduction=reduction, **kwargs)
    if HAVE_TORCH:
        from torch_cutbce import dense_bce_with_logits

        return run_torch(dense_bce_with_logits, inputs, **common)
    return run_jax(_jitted_dense_cut_bce(), inputs, **common)


@functools.cache
def _jitted_dense_cut_bce():
    """`jax_kernels.dense_cut_bce` under one `jit` (eagerly, each of its ops would compile apart)."""
    import jax

    from jax_kernels import dense_cut_bce

    return jax.jit(dense_cut_bce, static_argnames=("reduction", "return_metrics"))


def run_torch(fn, inputs, *, dtype, upstream, grad_names=GRADS,
              device="cpu", return_metrics=True, **kwargs):
    """Runs `fn(hidden, item_weight, targets, bias, *, weight, class_weight, pos_weight, **kwargs)`.

    Float inputs become `dtype` tensors on `device`; those in `grad_names` require grad and get
    `d_<name>` from `torch.autograd.grad(loss, ..., grad_outputs=upstream)`.
    """
    torch = _torch()
    tensors = {}
    for key, value in inputs.items():
        if key == "targets":
            tensors[key] = torch.tensor(value, device=device)
        else:
            t = torch.tensor(value, dtype=torch.float64).to(device=device, dtype=torch_dtype(dtype))
            tensors[key] = t.requires_grad_(key in grad_names)
    out = fn(tensors["hidden"], tensors["item_weight"], tensors["targets"], tensors.get("bias"),
             weight=tensors.get("weight"), class_weight=tensors.get("class_weight"),
             pos_weight=tensors.get("pos_weight"), return_metrics=return_metrics, **kwargs)
    loss, metrics = out if return_metrics else (out, None)
    wrt = [k for k in tensors if tensors[k].requires_grad]
    grads = {}
    if wrt:
        g = torch.tensor(upstream, dtype=torch.float64).to(device=device, dtype=loss.dtype)
        values = torch.autograd.grad(loss, [tensors[k] for k in wrt], grad_outputs=g)
        grads = {f"d_{k}": value for k, value in zip(wrt, values)}
    return _collect(loss, metrics, grads)


def run_jax(fn, inputs, *, dtype, upstream, grad_names=GRADS,
            return_metrics=True, **kwargs):
    """The JAX twin of `run_torch`: gradients from `jax.vjp` with `upstream` as the cotangent.

    Runs eagerly (pass a `jax.jit`-ed `fn` to test under jit): for the small shapes of the tests,
    eager dispatch compiles less on CPU than one `jit` of the loss and its vjp. x64 is on for
    float64 only (`jax_x64`); other dtypes run in the caller's setting (off, unless it switched it on).
    """
    import jax
    import jax.numpy as jnp

    with jax_x64(dtype):
        arrays = {k: jnp.asarray(v) if k == "targets" else jnp.asarray(v, dtype=jax_dtype(dtype))
                  for k, v in inputs.items()}
        diff = {k: arrays.pop(k) for k in grad_names if k in arrays}

        def loss_fn(diff_arrays):
            a = {**arrays, **diff_arrays}
            out = fn(a["hidden"], a["item_weight"], a["targets"], a.get("bias"), weight=a.get("weight"),
                     class_weight=a.get("class_weight"), pos_weight=a.get("pos_weight"),
                     return_metrics=return_metrics, **kwargs)
            return out if return_metrics else (out, None)

        loss, vjp, metrics = jax.vjp(loss_fn, diff, has_aux=True)
        (cotangents,) = vjp(jnp.asarray(upstream, dtype=loss.dtype))
        return _collect(loss, metrics, {f"d_{k}": value for k, value in cotangents.items()})
