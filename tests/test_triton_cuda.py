"""backend='triton' on a CUDA device: parity with the float64 dense oracle, determinism, the float32
rule under TF32, 'auto', torch.compile, autocast, the ids >= V assert, and top-k on CUDA.

Skipped without a CUDA device (the interpreter runs the same kernels on CPU tensors:
test_conformance_triton.py; their sm_80 / sm_90 compiles: test_triton_compile.py). `bash ci/gpu.sh`
runs this file on a GPU machine. Shapes are deliberately odd (N 300, V 5003, D 72: one hidden block;
D 200: two), with bias, per-position weight, class_weight, pos_weight, padding and duplicate ids
(`parity.make_inputs`). float32: rows within 1e-5 of float64 each (`elementwise`), the rest within
1e-5 normwise, gradients no worse than dense float32's own error + 1e-5; bfloat16 / float16: the
16-bit contract (docs/precision.md, `parity.assert_16bit_contract`; the yardstick of
test_conformance_triton.py, `conformance_engines.same_dtype_dense`, JAX's dense loss).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import torch_cutbce
from conformance_engines import LOSSES, same_dtype_dense
from parity import OPTIONAL, TOLERANCES, assert_close, float64_truth, make_inputs, make_upstream, relative_error, \
    run_torch, select

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash ci/gpu.sh)")

N, V, L = 300, 5003, 6
LOSS_NAMES = ("plain", "focal2", "focal0.5-balanced", "smoothing0.1", "smoothing0.2-focal1.5-balanced")
HEAVY = "smoothing0.2-focal1.5-balanced"
GRADS = ("hidden", "item_weight", "bias", "weight")
triton_loss = functools.partial(torch_cutbce.cut_bce_with_logits, backend="triton")
dense_loss = functools.partial(torch_cutbce.cut_bce_with_logits, backend="dense")


@functools.cache
def _inputs(hidden_size: int, dtype: str):
    """`make_inputs` at N 300, V 5003, every option present, values rounded to `dtype`."""
    inputs = make_inputs((N,), V, hidden_size, L, seed=hidden_size)
    if dtype != "float16":
        return select(inputs, OPTIONAL, dtype)
    chosen = select(inputs, OPTIONAL, "float64")
    return {k: v if k == "targets" else v.astype(np.float16).astype(np.float64) for k, v in chosen.items()}


def _run(fn, inputs, dtype, reduction, loss_name, upstream, device="cuda"):
    return run_torch(fn, inputs, dtype=dtype, upstream=upstream, device=device, reduction=reduction,
                     return_metrics=False, **LOSSES[loss_name].arguments())


def _assert_not_worse(fast, same_dtype, truth, *, tol, name):
    """CCE's rule for one result: error vs truth <= the same-dtype dense reference's + tol."""
    err, index = relative_error(fast, truth)
    ref_err, _ = relative_error(same_dtype, truth)
    assert err <= ref_err + tol, (f"{name}: error vs float64 {err:.3e} > dense's {ref_err:.3e} + {tol:g} at {index}: "
                                  f"fast={fast[index]!r}, dense={same_dtype[index]!r}, truth={truth[index]!r}")


@pytest.mark.parametrize("hidden_size", [72, 200])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_float32_against_the_float64_oracle(loss_name, reduction, hidden_size):
    inputs = _inputs(hidden_size, "float32")
    upstream = make_upstream(reduction, (N,), seed=hidden_size, dtype="float32")
    fast = _run(triton_loss, inputs, "float32", reduction, loss_name, upstream)
    dense = _run(dense_loss, inputs, "float32", reduction, loss_name, upstream)
    truth = float64_truth(inputs, upstream=upstream, reduction=reduction, return_metrics=False,
                          **LOSSES[loss_name].arguments())
    name = f"triton {loss_name} {reduction} D={hidden_size}"
    assert_close(fast["loss"], truth["loss"], dtype="float32", name=f"{name}: loss", elementwise=reduction == "none")
    for key in (f"d_{g}" for g in GRADS):
        _assert_not_worse(fast[key], dense[key], truth[key], tol=TOLERANCES["float32"], name=f"{name}: {key}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("loss_name", ["plain", HEAVY])
def test_half_dtypes_no_worse_than_dense_in_that_dtype(loss_name, reduction, dtype):
    inputs = _inputs(72, dtype)
    upstream = make_upstream(reduction, (N,), seed=1, dtype="bfloat16")  # representable in both half dtypes
    fast = _run(triton_loss, inputs, dtype, reduction, loss_name, upstream)
    pytest.importorskip("jax", reason="the yardstick is the dense loss computed in the half dtype (JAX's)")
    same_dtype = same_dtype_dense("torch-triton", inputs, dtype=dtype, upstream=upstream, loss=LOSSES[loss_name],
                                  reduction=reduction, return_metrics=False)
    truth = float64_truth(inputs, upstream=upstream, reduction=reduction, return_metrics=False,
                          **LOSSES[loss_name].arguments())
    assert_close(fast, same_dtype, truth, dtype=dtype, name=f"triton {loss_name} {reduction} {dtype}")


def test_metrics_agree_with_dense():
    h, w, t = _tensors("float32")
    _, fast = torch_cutbce.cut_bce_with_logits(h, w, t, backend="triton", reduction="none", return_metrics=True)
    _, dense = torch_cutbce.cut_bce_with_logits(h, w, t, backend="dense", reduction="none", return_metrics=True)
    for name, a, b in zip(("tp", "fp", "fn", "tn"), fast, dense):
        # A logit within rounding of 0 may count on either side: at most a few per row.
        assert (a - b).abs().max().item() <= 2, name


def _tensors(dtype: str, hidden_size: int = 72):
    inputs = _inputs(hidden_size, dtype)
    as_tensor = lambda k: torch.tensor(inputs[k], device="cuda", dtype=getattr(torch, dtype))  # noqa: E731
    return as_tensor("hidden"), as_tensor("item_weight"), torch.tensor(inputs["targets"], device="cuda")


def _step(hidden, item_weight, targets, bias=None, *, loss_name=HEAVY, backend="triton", reduction="mean"):
    """loss and the gradients of hidden, item_weight and bias (random non-uniform upstream for 'none')."""
    h, w = hidden.detach().requires_grad_(), item_weight.detach().requires_grad_()
    b = None if bias is None else bias.detach().requires_grad_()
    loss = torch_cutbce.cut_bce_with_logits(h, w, targets, b, backend=backend, reduction=reduction,
                                            **LOSSES[loss_name].arguments())
    upstream = torch.linspace(-1.0, 2.0, loss.numel(), device=loss.device).reshape(loss.shape)
    wrt = [x for x in (h, w, b) if x is not None]
    return (loss.detach(), *torch.autograd.grad(loss, wrt, grad_outputs=upstream))


def _assert_identical(first, second, what):
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"{what}: result {i} differs, max |diff| {(a.double() - b.double()).abs().max()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_bitwise_identical_across_runs_and_under_deterministic_algorithms(dtype, reduction):
    h, w, t = _tensors(dtype, 200)
    bias = torch.linspace(-1, 1, V, device="cuda")
    first = _step(h, w, t, bias, reduction=reduction)
    _assert_identical(first, _step(h, w, t, bias, reduction=reduction), "a second run")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _assert_identical(first, _step(h, w, t, bias, reduction=reduction), "use_deterministic_algorithms(True)")
    finally:
        torch.use_deterministic_algorithms(was)


def test_allow_tf32_changes_nothing():
    """The kernels multiply float32 as IEEE float32 (`input_precision='ieee'`), whatever torch's flag."""
    h, w, t = _tensors("float32", 200)
    was = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        ieee = _step(h, w, t, reduction="none")
        torch.backends.cuda.matmul.allow_tf32 = True
        _assert_identical(ieee, _step(h, w, t, reduction="none"), "allow_tf32=True")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def test_auto_resolves_to_triton_on_cuda_for_16_bit_inputs():
    """The cost model's choice (triton/cost_model.py): Triton for 16-bit inputs, native for float32."""
    for dtype in (torch.bfloat16, torch.float16):
        hidden = torch.zeros(2, 8, device="cuda", dtype=dtype)
        assert torch_cutbce.resolved_backend(hidden) == "triton", dtype
    for dtype in (torch.float32, torch.float64):
        assert torch_cutbce.resolved_backend(torch.zeros(2, 8, device="cuda", dtype=dtype)) == "native", dtype
    h, w, t = _tensors("bfloat16")
    _assert_identical(_step(h, w, t, backend="auto"), _step(h, w, t, backend="triton"), "backend='auto'")


def test_compiled_step_matches_eager():
    h, w, t = _tensors("float32", 200)
    bias = torch.linspace(-1, 1, V, device="cuda")
    weight = torch.rand(N, device="cuda")

    def step(hidden, item_weight, targets, b, position_weight):
        loss = torch_cutbce.cut_bce_with_logits(hidden, item_weight, targets, b, weight=position_weight,
                                                reduction="sum", **LOSSES[HEAVY].arguments())
        return loss / position_weight.sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.detach().requires_grad_() for x in (h, w, bias, weight)]
        loss = fn(leaves[0], leaves[1], t, leaves[2], leaves[3])
        results.append((loss.detach(), *torch.autograd.grad(loss, leaves)))
    for i, (eager, compiled) in enumerate(zip(*results)):
        err, index = relative_error(compiled, eager)
        assert err <= 1e-6, f"result {i}: compiled vs eager {err:.3e} at {index}"


def test_autocast_bfloat16_runs_the_bfloat16_kernels():
    h, w, t = _tensors("float32")
    leaves = [x.detach().requires_grad_() for x in (h, w)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch_cutbce.cut_bce_with_logits(*leaves, t)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    grads = torch.autograd.grad(loss, leaves)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
    halves = [x.detach().bfloat16().requires_grad_() for x in (h, w)]
    explicit = torch_cutbce.cut_bce_with_logits(*halves, t)  # what autocast hands the kernels
    assert torch.equal(loss.detach(), explicit.detach())
    for got, want in zip(grads, torch.autograd.grad(explicit, halves)):
        assert torch.equal(got, want.float())


def test_an_id_of_v_or_more_fails_the_device_assert():
    """A device-side assert poisons the CUDA context: it runs in a process of its own."""
    code = textwrap.dedent("""
        import torch, torch_cutbce
        h = torch.randn(8, 16, device="cuda", requires_grad=True)
        w = torch.randn(100, 16, device="cuda")
        t = torch.tensor([[1, 100]] * 8, device="cuda")
        loss = torch_cutbce.cut_bce_with_logits(h, w, t, backend="triton")
        loss.backward()
        torch.cuda.synchronize()
        print("no assert")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode != 0 and "no assert" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert "item id >= V" in done.stderr or "device-side assert" in done.stderr, done.stderr[-2000:]


def test_full_catalog_topk_on_cuda():
    h, w, _ = _tensors("float32", 200)
    bias = torch.linspace(-1, 1, V, device="cuda")
    exclude = torch.tensor([[0, 5, -1]] * N, device="cuda")
    scores, ids = torch_cutbce.full_catalog_topk(h, w, 10, bias, block_v=1000, exclude=exclude)
    dense = (h.double() @ w.double().T + bias.double())
    dense[:, [0, 5]] = -float("inf")
    want_scores, _ = dense.topk(10, dim=-1)
    assert ids.device.type == "cuda" and not torch.isin(ids, torch.tensor([0, 5], device="cuda")).any()
    err, index = relative_error(scores, want_scores)
    assert err <= 1e-5, f"top-k scores vs float64 {err:.3e} at {index}"
    picked = dense.gather(1, ids)  # the returned ids score what was returned
    assert relative_error(scores, picked)[0] <= 1e-5
