"""The PyTorch toolchain around the native path: mixed dtypes, autocast, torch.compile, padded positions.

- Mixed dtypes: hidden, item_weight and bias of different floating dtypes compute in the promoted
  dtype and get their gradients back in their own dtypes (native and dense).
- `torch.autocast` (CPU bfloat16): the loss follows a linear layer's rule (the matmul's inputs cast
  to bfloat16, the loss in float32), checked against the float64 oracle of those cast inputs and
  against the dense code under the same autocast.
- `torch.compile(fullgraph=True)`: one graph, no break, for every reduction, with the same loss and
  gradients as eager, also with dynamic shapes (`_dynamic_compile.py`); ids >= V still raise (inside the op).
- Padded positions (weight 0, no valid target) are dropped before the tiles: same loss and
  gradients, exactly zero gradients at those positions, fewer rows reach the engine.
- The first tile compile of a process says so, once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import _dynamic_compile
from parity import assert_close
from torch_cutbce import Focal, cut_bce_with_logits, dense_bce_with_logits
from torch_cutbce.native import fused_tile, ops

pytestmark = pytest.mark.rung1

N_SEQ, LENGTH, V, D, L = 4, 9, 301, 16, 3
BLOCK_V = 128


def _inputs(seed=0, padded_fraction=0.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_SEQ, LENGTH, D, generator=g)
    items = torch.randn(V, D, generator=g) * 0.5
    bias = torch.randn(V, generator=g)
    targets = torch.randint(-1, V, (N_SEQ, LENGTH, L), generator=g)
    mask = (torch.rand(N_SEQ, LENGTH, generator=g) >= padded_fraction).float()
    targets[mask == 0] = -1  # padded positions have no target
    return hidden, items, bias, targets, mask


def _loss_and_grads(fn, hidden, items, bias, targets, **kwargs):
    leaves = [x.detach().clone().requires_grad_(True) for x in (hidden, items, bias)]
    loss = fn(*leaves[:2], targets, leaves[2], **kwargs)
    scalar = loss if loss.dim() == 0 else (loss * torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)).sum()
    scalar.backward()
    return loss.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("backend", ["native", "dense"])
def test_mixed_dtypes_compute_in_the_promoted_dtype_and_return_each_inputs_dtype(backend):
    hidden, items, bias, targets, _ = _inputs(seed=1)
    hidden32, items16, bias_h = hidden, items.to(torch.bfloat16), bias.to(torch.float16)
    loss, grads = _loss_and_grads(cut_bce_with_logits, hidden32, items16, bias_h, targets, backend=backend,
                                  block_v=BLOCK_V, reduction="sum")
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.float16]
    truth, truth_grads = _loss_and_grads(dense_bce_with_logits, hidden32.double(), items16.double(),
                                         bias_h.double(), targets, reduction="sum")
    assert_close(loss, truth, dtype="float32", name=f"{backend} mixed dtypes:loss")
    for name, grad, want in zip(("hidden", "item_weight", "bias"), grads, truth_grads):
        # bfloat16 / float16 gradients: CCE's rule, the same-dtype reference being the truth rounded
        # to that dtype (the best it can hold).
        dtype = str(grad.dtype).removeprefix("torch.")
        assert_close(grad, want.to(grad.dtype), want, dtype=dtype, name=f"{backend} mixed dtypes:d_{name}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_follows_a_linear_layer_then_bce(reduction):
    hidden, items, bias, targets, _ = _inputs(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(cut_bce_with_logits, hidden, items, bias, targets, backend="native",
                                      block_v=BLOCK_V, reduction=reduction)
        dense_loss, dense_grads = _loss_and_grads(cut_bce_with_logits, hidden, items, bias, targets,
                                                  backend="dense", reduction=reduction)
    assert loss.dtype == dense_loss.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads + dense_grads)  # each input's own dtype
    # The truth of autocast's rule: float64 BCE of the bfloat16-rounded matmul inputs.
    rounded = [x.to(torch.bfloat16).double() for x in (hidden, items, bias)]
    truth, truth_grads = _loss_and_grads(dense_bce_with_logits, *rounded, targets, reduction=reduction)
    assert_close(loss, truth, dtype="float32", name="autocast loss")  # native keeps the logits in float32
    # A sanity check of the dense yardstick, not parity: it rounds the logits to bfloat16 first.
    assert float((dense_loss.double() - truth).abs().max() / truth.abs().max()) < 1e-2
    for i, (grad, dense_grad, want) in enumerate(zip(grads, dense_grads, truth_grads)):
        # The gradient matmuls run in bfloat16 under autocast: CCE's rule against the dense code.
        assert_close(grad, dense_grad, want, dtype="bfloat16", name=f"autocast gradient {i}")


def _explain(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_count, explained.graph_break_count, explained.break_reasons


@pytest.mark.parametrize("reduction,metrics", [("mean", False), ("sum", True), ("none", True)])
def test_compile_fullgraph_is_one_graph_with_eager_results(reduction, metrics):
    hidden, items, bias, targets, mask = _inputs(seed=3, padded_fraction=0.5)

    def step(hidden, items, bias, targets, mask):
        out = cut_bce_with_logits(hidden, items, targets, bias, weight=mask, reduction=reduction,
                                  block_v=BLOCK_V, return_metrics=metrics)
        loss = out[0] if metrics else out
        return loss if loss.dim() == 0 else loss.sum()

    torch._dynamo.reset()
    assert _explain(step, hidden, items, bias, targets, mask)[:2] == (1, 0)
    compiled = torch.compile(step, fullgraph=True)
    results = {}
    for name, fn in (("eager", step), ("compiled", compiled)):
        leaves = [x.clone().requires_grad_(True) for x in (hidden, items, bias)]
        loss = fn(*leaves[:2], leaves[2], targets, mask)
        loss.backward()
        results[name] = [loss.detach()] + [x.grad for x in leaves]
    for got, want in zip(results["compiled"], results["eager"]):
        # Not oracle parity: compiled and eager run the same float32 code, so they agree far more
        # closely than the float32 tolerance against the oracle.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["dynamic", "mark_dynamic"])
@pytest.mark.parametrize("kind", _dynamic_compile.STEPS)
def test_compile_with_dynamic_shapes_is_one_graph_with_eager_results(kind, mode):
    """dynamic=True failed at the loss options' checks (a symbolic float); mark_dynamic worked."""
    _dynamic_compile.check_one_graph_with_eager_values("native", kind, mode)


def test_compiled_loss_still_rejects_ids_beyond_the_catalog():
    hidden, items, bias, targets, _ = _inputs(seed=4)
    targets[0, 0, 0] = V

    def step(hidden, items, targets):
        return cut_bce_with_logits(hidden, items, targets, block_v=BLOCK_V)

    torch._dynamo.reset()
    with pytest.raises(ValueError, match=f"item id {V}, but item_weight has only V={V}"):
        torch.compile(step, fullgraph=True)(hidden, items, targets)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_padded_positions_are_dropped_before_the_tiles(reduction, monkeypatch):
    hidden, items, bias, targets, mask = _inputs(seed=5, padded_fraction=0.85)
    seen_rows = []
    for name in ("loss", "rows"):
        engine = getattr(ops, name)

        def spy(hidden, *args, _engine=engine, **kwargs):
            seen_rows.append(hidden.shape[0])
            return _engine(hidden, *args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    loss, grads = _loss_and_grads(cut_bce_with_logits, hidden, items, bias, targets, weight=mask,
                                  reduction=reduction, block_v=BLOCK_V, return_metrics=False)
    assert seen_rows == [int(mask.sum())] and int(mask.sum()) < mask.numel()
    assert torch.equal(grads[0][mask == 0], torch.zeros_like(grads[0][mask == 0]))
    truth, truth_grads = _loss_and_grads(dense_bce_with_logits, hidden.double(), items.double(), bias.double(),
                                         targets, weight=mask.double(), reduction=reduction)
    assert_close(loss, truth, dtype="float32", name=f"padded {reduction}:loss")
    for i, (grad, want) in enumerate(zip(grads, truth_grads)):
        assert_close(grad, want, dtype="float32", name=f"padded {reduction}:gradient {i}")


def test_padded_positions_are_kept_when_weight_needs_its_gradient(monkeypatch):
    hidden, items, bias, targets, mask = _inputs(seed=6, padded_fraction=0.5)
    seen_rows = []
    engine = ops.loss
    monkeypatch.setattr(ops, "loss", lambda hidden, *a, **k: seen_rows.append(hidden.shape[0]) or engine(hidden, *a, **k))
    weight = mask.clone().requires_grad_(True)
    cut_bce_with_logits(hidden, items, targets, bias, weight=weight, block_v=BLOCK_V).backward()
    assert seen_rows == [mask.numel()]
    assert weight.grad[mask == 0].abs().min() > 0  # the row losses of padded positions


def test_the_first_tile_compile_is_announced_once(monkeypatch):
    hidden, items, bias, targets, _ = _inputs(seed=7)
    monkeypatch.setattr(fused_tile, "_compile_seconds", {})  # as in a fresh process
    monkeypatch.setattr(fused_tile, "_cpu_library", lambda: None)  # torch.compile's tiles (no C kernel)
    with pytest.warns(fused_tile.TileCompileWarning, match="TORCH_CUTBCE_NO_COMPILE=1"):
        cut_bce_with_logits(hidden, items, targets, bias, block_v=BLOCK_V)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_tile.TileCompileWarning)
        cut_bce_with_logits(hidden, items, targets, bias, block_v=BLOCK_V, reduction="none")


def test_each_loss_form_announces_its_own_first_compile(monkeypatch):
    """Another `Loss` form is another torch.compile (`Loss.form()` is what the tile specialises on), so
    its first compile is said too; a form already compiled is not. (The functions run uncompiled here:
    what is tested is what is said, not inductor.)"""
    hidden, items, bias, targets, _ = _inputs(seed=8)
    hidden = hidden.clone().requires_grad_()
    monkeypatch.setattr(fused_tile, "_compile_seconds", {})
    monkeypatch.setattr(fused_tile, "_compiled", lambda name, threads, form=None: fused_tile._tile_function(name, form))
    smoothed, focal = dict(label_smoothing=0.1), dict(focal=Focal(gamma=2.0))
    for options in (smoothed, focal):
        with pytest.warns(fused_tile.TileCompileWarning, match="loss-option") as said:
            cut_bce_with_logits(hidden, items, targets, bias, block_v=BLOCK_V, **options).backward()
        assert len(said) == 1, [str(w.message) for w in said]
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_tile.TileCompileWarning)
        cut_bce_with_logits(hidden, items, targets, bias, block_v=BLOCK_V, reduction="none", **smoothed)
    forms = {fused_tile._form_of(key) for key in fused_tile.compile_seconds()}
    assert len(forms) == 2 and "" not in forms, forms


# -- torch.func ---------------------------------------------------------------------------------------

_FUNC_INPUTS = dict(hidden=torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
                    items=torch.randn(20, 4, generator=torch.Generator().manual_seed(1)),
                    targets=torch.tensor([[1, -1], [2, 5], [-1, -1]]))


def _func_loss(hidden):
    return cut_bce_with_logits(hidden, _FUNC_INPUTS["items"], _FUNC_INPUTS["targets"], reduction="sum")


TRANSFORMS = {
    "grad": lambda h: torch.func.grad(_func_loss)(h),
    "vjp": lambda h: torch.func.vjp(_func_loss, h),
    "jacrev": lambda h: torch.func.jacrev(_func_loss)(h),
    "jvp": lambda h: torch.func.jvp(_func_loss, (h,), (h,)),
    "vmap-of-grad": lambda h: torch.func.vmap(torch.func.grad(_func_loss))(h.expand(2, 3, 4)),
    "grad-of-vmap": lambda h: torch.func.grad(lambda x: torch.func.vmap(_func_loss)(x).sum())(h.expand(2, 3, 4)),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_torch_func_gradient_transforms_are_refused_by_name(transform):
    """Issue 31: torch.func's gradient transforms failed with torch's internal message about
    `setup_context`; now a clear error naming the argument and what works instead."""
    with pytest.raises(RuntimeError, match=r"hidden is differentiated by a torch.func transform .* Use torch.autograd"):
        TRANSFORMS[transform](_FUNC_INPUTS["hidden"][None])


def test_torch_func_vmap_and_functional_call_work():
    """What the refusal points to: plain vmap over positions' batches, and autograd through
    functional_call, both equal to the direct computation."""
    hidden = _FUNC_INPUTS["hidden"]
    batched = torch.func.vmap(_func_loss)(torch.stack([hidden, 2 * hidden]))
    assert torch.allclose(batched, torch.stack([_func_loss(hidden), _func_loss(2 * hidden)]))
    linear = torch.nn.Linear(4, 4)
    params = {k: v.detach().requires_grad_(True) for k, v in linear.named_parameters()}
    loss = _func_loss(torch.func.functional_call(linear, params, (hidden,)))
    grads = torch.autograd.grad(loss, list(params.values()))
    expected = torch.autograd.grad(_func_loss(linear(hidden)), list(linear.parameters()))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, expected))
