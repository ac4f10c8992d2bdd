"""The native path's fast pieces: compiled tile functions and gradients computed in the forward.

- Every float32 tile function, from the CPU kernel (tests/test_neutral_cpu_tile.py has its own
  suite), from `torch.compile` (what runs without the kernel) and from the eager twin, on odd tile
  shapes, with and without class weights; the logits tile is left untouched and dz lands in `out`.
- The polynomial log1p against float64 log1p over the whole range it is used on.
- `NativeCutBCELoss` ('sum' / 'mean': gradients computed in the forward, the backward scales them)
  against the float64 dense oracle for every subset of inputs requiring grad, a non-unit upstream
  scalar, no_grad, the eager fallback (TORCH_CUTBCE_NO_COMPILE=1: the same results for plain BCE
  and the loss options' tiles; a failing compiler), a second backward through a retained graph,
  and no recompilation across shapes.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch

from cutbce_common.focal import Focal
from cutbce_common.loss import Loss
from parity import assert_close, make_inputs, make_upstream, run_torch, select
from torch_cutbce import branch_math, cut_bce_with_logits, dense_bce_with_logits, positives
from torch_cutbce.native import fused_tile

pytestmark = pytest.mark.rung1

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
    z[torch.rand(shape, generator=g) < 0.2] = float("-inf")  # positives taken out of the tile
    return z, torch.rand(shape[0], 1, generator=g) + 0.1, torch.rand(1, shape[1], generator=g) * 2


def _eager(monkeypatch):
    monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")


def _without_cpu_kernel(monkeypatch):
    """The float32 CPU tiles as they run where the C kernel cannot be built: torch.compile'd."""
    monkeypatch.setattr(fused_tile, "_cpu_library", lambda: None)


def _softplus64(x):
    return x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))


def _tile_truth(z, g, cw):
    """float64 row losses and gradients of a tile of negatives (-inf: a positive taken out, 0 and 0)."""
    z64, g64 = z.double(), g.double()
    cw64 = torch.ones(1, z.shape[1], dtype=torch.float64) if cw is None else cw.double()
    return (_softplus64(z64) * cw64).sum(-1), torch.sigmoid(z64) * cw64 * g64


@pytest.mark.parametrize("shape", TILE_SHAPES)
@pytest.mark.parametrize("class_weight", [False, True])
def test_every_float32_tile_function_matches_float64(shape, class_weight, monkeypatch):
    z, g, cw = _tile(shape, seed=shape[0])
    cw = cw if class_weight else None
    results = {}
    for mode in ("cpu kernel", "compiled", "eager"):
        if mode == "compiled":
            _without_cpu_kernel(monkeypatch)
        if mode == "eager":
            _eager(monkeypatch)
        zc = z.clone()
        out_rg, out_g = torch.full_like(z, np.nan), torch.full_like(z, np.nan)
        results[mode] = {
            "rows": fused_tile.rows(zc, cw),
            "rows_grad": fused_tile.rows_grad(zc, cw, g, out=out_rg),
            "dz": out_rg,
            "counts": fused_tile.counts(zc),
        }
        fused_tile.grad(zc, cw, g, out=out_g)
        results[mode]["dz_grad"] = out_g
        assert torch.equal(zc, z), "the logits tile must not be modified"
    truth_rows, truth_dz = _tile_truth(z, g, cw)
    truth = {"rows": truth_rows, "rows_grad": truth_rows, "dz": truth_dz, "counts": (z > 0).sum(-1).float(),
             "dz_grad": truth_dz}
    for mode in results:
        assert_close(results[mode], truth, dtype="float32", name=f"{mode} tile")
        assert torch.equal(results[mode]["counts"], truth["counts"])
        assert torch.equal(results[mode]["dz"][z == float("-inf")], torch.zeros(int((z == float("-inf")).sum())))
        assert_close(results[mode]["rows"], truth_rows, dtype="float32", name=f"{mode} tile rows", elementwise=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tile_positives_take_out_and_positive_terms_are_exact(dtype):
    n, v, block_v = 7, 23, 10  # tiles [0, 10), [10, 20), [20, 23)
    g = torch.Generator().manual_seed(5)
    z_full = (torch.randn(n, v, generator=g) * 40).to(dtype)  # confident positives among them
    targets = torch.randint(-3, v + 3, (n, 5), generator=g)
    targets[0] = torch.tensor([4, 4, 22, -1, 10**12])  # a duplicate, the ragged tile, padding, huge
    ids = positives.positive_ids(targets, v)
    taken = positives.TilePositives(ids, block_v, dtype)
    for start in range(0, v, block_v):
        stop = min(start + block_v, v)
        flat = torch.empty(n * (stop - start), dtype=dtype)
        tile = flat.view(n, stop - start)
        tile.copy_(z_full[:, start:stop])
        taken.take_out(flat, start, stop)
        is_positive = torch.zeros(n, v, dtype=torch.bool).scatter_(1, ids.clamp(min=0), ids >= 0)
        expected = torch.where(is_positive[:, start:stop], float("-inf"), z_full[:, start:stop])
        assert torch.equal(tile, expected)
    valid = ids >= 0
    assert torch.equal(taken.logits[valid], z_full.gather(1, ids.clamp(min=0))[valid])
    cw, pw = torch.rand(v, generator=g).to(dtype) + 0.5, torch.rand(v, generator=g).to(dtype) * 3
    row_grad = torch.rand(n, generator=g).to(dtype)
    loss, dz = positives.positive_terms(taken.logits, ids, cw, pw, row_grad)
    z64, w64 = taken.logits.double(), (cw * pw).double()[ids.clamp(min=0)]
    truth_loss = torch.where(valid, w64 * _softplus64(-z64), 0.0)
    truth_dz = torch.where(valid, -w64 * torch.sigmoid(-z64) * row_grad.double().unsqueeze(-1), 0.0)
    # Stricter than the parity table: each term is one softplus / sigmoid of an exact logit, a few ulps.
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    tiny = torch.finfo(dtype).tiny  # subnormal results carry fewer digits
    assert ((loss.double() - truth_loss).abs() <= tol * truth_loss.abs() + tiny).all()
    assert ((dz.double() - truth_dz).abs() <= tol * truth_dz.abs() + tiny).all()
    assert torch.equal(loss[~valid], torch.zeros(int((~valid).sum()), dtype=dtype))


def test_polynomial_log1p_is_float32_exact():
    e = torch.cat([torch.logspace(-45, 0, 20001, dtype=torch.float64), torch.linspace(0, 1, 20001, dtype=torch.float64)])
    approx = branch_math.log1p_unit(e)  # evaluated in float64: the fit's own error, not float32 rounding
    relative = ((approx - torch.log1p(e)).abs() / torch.log1p(e).clamp_min(1e-300)).max()
    assert relative < 1e-8, float(relative)
    # In float32, against log1p of the same float32 inputs, over the normal range (below 1.2e-38 the
    # inputs themselves are subnormal; there the term is < 1e-38 absolute, invisible in any loss).
    e32 = e.float()[e.float() >= torch.finfo(torch.float32).tiny]
    approx32, exact = branch_math.log1p_unit(e32).double(), torch.log1p(e32.double())
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
    torch.testing.assert_close(without, with_grad.detach(), rtol=1e-6, atol=0)  # the same float32 code, not parity


def test_a_second_backward_through_a_retained_graph_raises():
    hidden, items, targets = _leaves()
    loss = native(hidden, items, targets, block_v=BLOCK_V, reduction="sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        loss.backward()


# The compiled tiles per `Loss.form()`: plain BCE (the C kernel where it builds), focal with balancing,
# and label smoothing with it.
FALLBACK_LOSSES = {"plain": Loss(), "focal1.5-balanced": Loss(Focal(1.5, 0.25, True)),
                   "smoothing0.2-focal1.5-balanced": Loss(Focal(1.5, 0.25, True), 0.2)}


@pytest.mark.parametrize("loss_id", FALLBACK_LOSSES)
def test_eager_fallback_gives_the_same_results(monkeypatch, loss_id):
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=33), dtype="float32")
    results = {}
    for mode in ("compiled", "eager"):
        if mode == "eager":
            _eager(monkeypatch)
        for reduction in ("mean", "none"):
            upstream = make_upstream(reduction, LEAD_SHAPE, seed=33)
            results[mode, reduction] = run_torch(native, inputs, dtype="float32", upstream=upstream,
                                                 reduction=reduction, block_v=BLOCK_V,
                                                 **FALLBACK_LOSSES[loss_id].arguments())
    for reduction in ("mean", "none"):
        assert_close(results["compiled", reduction], results["eager", reduction], dtype="float32",
                     name=f"{loss_id} {reduction}")


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken(name, threads):
        raise RuntimeError("no C++ compiler here")

    _without_cpu_kernel(monkeypatch)
    monkeypatch.setattr(fused_tile, "_compiled", broken)
    monkeypatch.setattr(fused_tile, "_compile_failed", False)
    z, _, cw = _tile((9, 20), seed=1)
    with pytest.warns(UserWarning, match="using eager tiles"):
        rows = fused_tile.rows(z, cw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls go straight to eager
        torch.testing.assert_close(fused_tile.rows(z, cw), rows)


def test_new_shapes_do_not_recompile(monkeypatch):
    from torch._dynamo.utils import counters

    _without_cpu_kernel(monkeypatch)
    hidden, items, targets = _leaves()
    native(hidden, items, targets, block_v=BLOCK_V).backward()  # compiled here (or earlier)
    compiled_frames = counters["frames"]["ok"]
    for n, block_v in [(20, 100), (65, 7), (33, 301)]:
        native(hidden[:n], items, targets[:n], block_v=block_v).backward()
        native(hidden[:n], items, targets[:n], block_v=block_v, reduction="none").sum().backward()
    assert counters["frames"]["ok"] == compiled_frames
    assert set(fused_tile.compile_seconds()) >= {"rows_grad"}
