"""The native path's fast pieces: compiled tile functions and gradients computed in the forward.

- Every `torch.compile`d tile function (float32) against its eager twin, on odd tile shapes, with
  and without class weights; the logits tile is left untouched and dz lands in `out`.
- The polynomial log1p against float64 log1p over the whole range it is used on.
- `NativeCutBCELoss` ('sum' / 'mean': gradients computed in the forward, the backward scales them)
  against the float64 dense oracle for every subset of inputs requiring grad, a non-unit upstream
  scalar, no_grad, the eager fallback (TORCH_CUTBCE_NO_COMPILE=1, a failing compiler), a second
  backward through a retained graph, and no recompilation across shapes.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

from parity import assert_close, make_inputs, make_upstream, run_torch, select
from torch_cutbce import cut_bce_with_logits, dense_bce_with_logits, fused_tile

TILE_SHAPES = [(67, 301), (8, 16), (3, 9), (129, 64)]  # ragged vector tails, tiny, a lane-exact width
LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS = (5, 13), 301, 16, 6  # N = 65, V = 301
BLOCK_V = 128  # 301 = 128 + 128 + 45: a ragged last tile


def native(*args, **kwargs):
    return cut_bce_with_logits(*args, backend="native", **kwargs)


def _tile(shape, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g) * 6  # |z| up to ~30: both branches of every where()
    # Exactly 0, exp(-|z|) underflow, a subnormal exp(-|z|), and 2 exp(|z|) = inf (rows' t = 0 path).
    z[0, :4] = torch.tensor([0.0, 88.0, -103.0, -89.5])
    y = torch.rand(shape, generator=g) < 0.2  # positives, confident ones among them
    return z, y, torch.rand(shape[0], 1, generator=g) + 0.1, torch.rand(1, shape[1], generator=g) * 2


def _eager(monkeypatch):
    monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")


def _tile_truth(z, y, g, cw, pw):
    """float64 element losses and gradients of one tile, BCE's two branches written separately."""
    z64, g64 = z.double(), g.double()
    cw64 = torch.ones(1, z.shape[1], dtype=torch.float64) if cw is None else cw.double()
    pw64 = torch.ones(1, z.shape[1], dtype=torch.float64) if pw is None else pw.double()
    softplus = lambda x: x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))  # noqa: E731
    loss = torch.where(y, pw64 * softplus(-z64), softplus(z64)) * cw64
    dz = torch.where(y, -pw64 * torch.sigmoid(-z64), torch.sigmoid(z64)) * cw64 * g64
    return loss.sum(-1), dz


@pytest.mark.parametrize("shape", TILE_SHAPES)
@pytest.mark.parametrize("weights", ["none", "cw", "pw", "both"])
def test_compiled_tile_functions_match_their_eager_twins(shape, weights, monkeypatch):
    z, y, g, cw = _tile(shape, seed=shape[0])
    pw = cw.flip(-1) + 0.5 if weights in ("pw", "both") else None
    cw = cw if weights in ("cw", "both") else None
    results = {}
    for mode in ("compiled", "eager"):
        if mode == "eager":
            _eager(monkeypatch)
        zc = z.clone()
        out_rg, out_g = torch.full_like(z, np.nan), torch.full_like(z, np.nan)
        results[mode] = {
            "rows": fused_tile.rows(zc, y, cw, pw),
            "rows_grad": fused_tile.rows_grad(zc, y, cw, pw, g, out=out_rg),
            "dz": out_rg,
            "counts": fused_tile.counts(zc, y),
        }
        fused_tile.grad(zc, y, cw, pw, g, out=out_g)
        results[mode]["dz_grad"] = out_g
        assert torch.equal(zc, z), "the logits tile must not be modified"
    truth_rows, truth_dz = _tile_truth(z, y, g, cw, pw)
    truth_counts = torch.stack([(z > 0).sum(-1), ((z > 0) & y).sum(-1)]).float()
    truth = {"rows": truth_rows, "rows_grad": truth_rows, "dz": truth_dz, "counts": truth_counts,
             "dz_grad": truth_dz}
    assert_close(results["compiled"], truth, dtype="float32", name="compiled tile")
    assert_close(results["eager"], truth, dtype="float32", name="eager tile")
    assert torch.equal(results["compiled"]["counts"], truth["counts"])
    for mode in ("compiled", "eager"):  # each row on its own, not only the largest (confident positives)
        rel = ((results[mode]["rows"].double() - truth_rows).abs() / truth_rows.abs()).max()
        assert rel <= 1e-5, f"{mode}: a row's relative error is {rel:.2e}"


def test_polynomial_log1p_is_float32_exact():
    e = torch.cat([torch.logspace(-45, 0, 20001, dtype=torch.float64), torch.linspace(0, 1, 20001, dtype=torch.float64)])
    approx = fused_tile._log1p_unit(e)  # evaluated in float64: the fit's own error, not float32 rounding
    relative = ((approx - torch.log1p(e)).abs() / torch.log1p(e).clamp_min(1e-300)).max()
    assert relative < 1e-8, float(relative)
    # In float32, against log1p of the same float32 inputs, over the normal range (below 1.2e-38 the
    # inputs themselves are subnormal; there the term is < 1e-38 absolute, invisible in any loss).
    e32 = e.float()[e.float() >= torch.finfo(torch.float32).tiny]
    approx32, exact = fused_tile._log1p_unit(e32).double(), torch.log1p(e32.double())
    assert ((approx32 - exact).abs() / exact).max() < 4 * torch.finfo(torch.float32).eps


GRAD_SUBSETS = [names for k in range(1, 5) for names in itertools.combinations(("hidden", "item_weight", "bias", "weight"), k)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("grad_names", GRAD_SUBSETS, ids=lambda names: "+".join(names))
def test_gradients_computed_in_the_forward(grad_names, reduction):
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=31)
    inputs = select(raw, ("bias", "weight", "class_weight", "pos_weight"), "float32")
    upstream = make_upstream(reduction, LEAD_SHAPE, seed=31)  # a scalar that is not 1
    fast = run_torch(native, inputs, dtype="float32", upstream=upstream, grad_names=grad_names,
                     reduction=reduction, block_v=BLOCK_V)
    truth = run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, grad_names=grad_names,
                      reduction=reduction)
    assert_close(fast, truth, dtype="float32", name=f"native {reduction}")
    assert {k for k in fast if k.startswith("d_")} == {f"d_{k}" for k in grad_names}


def _leaves(dtype=torch.float32, seed=32):
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=seed)
    hidden = torch.tensor(raw["hidden"], dtype=dtype, requires_grad=True)
    items = torch.tensor(raw["item_weight"], dtype=dtype, requires_grad=True)
    return hidden, items, torch.tensor(raw["targets"])


def test_no_grad_forward_skips_the_gradient_work():
    hidden, items, targets = _leaves()
    with_grad = native(hidden, items, targets, block_v=BLOCK_V)
    with torch.no_grad():
        without = native(hidden, items, targets, block_v=BLOCK_V)
    assert without.grad_fn is None and with_grad.grad_fn is not None
    torch.testing.assert_close(without, with_grad.detach(), rtol=1e-6, atol=0)


def test_a_second_backward_through_a_retained_graph_raises():
    hidden, items, targets = _leaves()
    loss = native(hidden, items, targets, block_v=BLOCK_V, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        loss.backward()


def test_eager_fallback_gives_the_same_results(monkeypatch):
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=33), dtype="float32")
    results = {}
    for mode in ("compiled", "eager"):
        if mode == "eager":
            _eager(monkeypatch)
        for reduction in ("mean", "none"):
            upstream = make_upstream(reduction, LEAD_SHAPE, seed=33)
            results[mode, reduction] = run_torch(native, inputs, dtype="float32", upstream=upstream,
                                                 reduction=reduction, block_v=BLOCK_V)
    for reduction in ("mean", "none"):
        assert_close(results["compiled", reduction], results["eager", reduction], dtype="float32", name=reduction)


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken(name, threads):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(fused_tile, "_compiled", broken)
    monkeypatch.setattr(fused_tile, "_compile_failed", False)
    z, y, _, cw = _tile((9, 20), seed=1)
    with pytest.warns(UserWarning, match="using eager tiles"):
        rows = fused_tile.rows(z, y, cw, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls go straight to eager
        torch.testing.assert_close(fused_tile.rows(z, y, cw, None), rows)


def test_new_shapes_do_not_recompile():
    from torch._dynamo.utils import counters

    hidden, items, targets = _leaves()
    native(hidden, items, targets, block_v=BLOCK_V).backward()  # compiled here (or earlier)
    compiled_frames = counters["frames"]["ok"]
    for n, block_v in [(20, 100), (65, 7), (33, 301)]:
        native(hidden[:n], items, targets[:n], block_v=block_v).backward()
        native(hidden[:n], items, targets[:n], block_v=block_v, reduction="none").sum().backward()
    assert counters["frames"]["ok"] == compiled_frames
    assert set(fused_tile.compile_seconds()) >= {"rows_grad"}
