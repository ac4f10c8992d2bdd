"""The Triton kernels in Triton's interpreter, beyond the conformance suite (test_conformance_triton.py,
the same process): the paths its small shapes do not reach and the entry's promises on this engine.

- hidden sizes above a program's block (`launch.MAX_BLOCK_D`: several column programs, the logits
  summed over D in blocks), D = 0, N = 0, one item;
- sums over 1,024 tiles of equal terms (a running float32 sum's worst case) and over 2**22 items
  against their closed form;
- `torch.compile(step, fullgraph=True)`, also with dynamic shapes (`dynamic=True`, `mark_dynamic`):
  one graph (the custom ops), the eager numbers; the ops'
  fakes against their outputs (`torch.library.opcheck`);
- the same bits on every run, and under `torch.use_deterministic_algorithms(True)`;
- `torch.autocast`, and `vocab_parallel=` (this rank's slice of the table, ids outside it padding).

Runs only with `TRITON_INTERPRET=1` set before triton is imported (ci/test.sh's own process).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from cutbce_common.loss import Loss
from cutbce_common.options import CutBCEOptions
import _dynamic_compile
from parity import TOLERANCES
from torch_cutbce import Focal, cut_bce_with_logits, dense_bce_with_logits
from torch_cutbce.route import VocabParallelOptions

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter: run with TRITON_INTERPRET=1 (ci/test.sh does)", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = pytest.mark.rung2
LOSS = dict(focal=Focal(1.5, 0.3, True), label_smoothing=0.2)


def _inputs(n, v, d, *, seed=0, dtype=torch.float32, num_targets=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    items = (torch.randn(v, d, generator=g) / max(d, 1) ** 0.5).to(dtype)
    bias = torch.randn(v, generator=g)
    targets = torch.randint(-1, v, (n, num_targets), generator=g)
    if n > 0 and num_targets > 1:
        targets[0, 1] = targets[0, 0]  # a duplicate counts once
    return hidden, items, targets, bias


def _rows_and_grads(backend, hidden, items, targets, bias, upstream, dtype=None, **options):
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (hidden, items, bias)]
    rows = cut_bce_with_logits(*leaves[:2], targets, leaves[2], reduction="none", backend=backend, **options)
    (rows * upstream.to(rows.dtype)).sum().backward()
    return [rows.detach()] + [x.grad for x in leaves]


def _assert_relative(got, want, tol, name):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if want.numel() == 0:
        return
    scale = want.abs().max().clamp_min(1e-30)
    error = ((got.double() - want.double()).abs().max() / scale).item()
    assert error <= tol, f"{name}: {error:.2e} relative, bound {tol:.0e}"


@pytest.mark.parametrize("hidden_size", [200, 0, 1])
def test_any_hidden_size_matches_the_float64_oracle(hidden_size):
    """D = 200: two column programs per block of rows (`launch.MAX_BLOCK_D` gradient columns each),
    each summing the logits over D in `block_k` steps."""
    inputs = _inputs(37, 301, hidden_size, seed=hidden_size)
    upstream = torch.linspace(-1.0, 2.0, 37)
    got = _rows_and_grads("triton", *inputs, upstream, **LOSS)
    want = _rows_and_grads("dense", *inputs, upstream, dtype=torch.float64, **LOSS)
    for name, g, w in zip(("rows", "d_hidden", "d_item_weight", "d_bias"), got, want):
        _assert_relative(g, w, TOLERANCES["float32"], f"D={hidden_size} {name}")


def test_no_positions_and_one_item():
    hidden, items, targets, bias = _inputs(0, 5, 16)
    assert cut_bce_with_logits(hidden, items, targets, bias, reduction="none", backend="triton").shape == (0,)
    assert math.isnan(cut_bce_with_logits(hidden, items, targets, bias, backend="triton").item())
    inputs = _inputs(9, 1, 16)
    got = cut_bce_with_logits(*inputs[:2], inputs[2], inputs[3], reduction="none", backend="triton")
    want = dense_bce_with_logits(*(x.double() for x in inputs[:2]), inputs[2], inputs[3].double(), reduction="none")
    _assert_relative(got, want, TOLERANCES["float32"], "V=1 rows")


def test_sums_over_thousands_of_tiles_keep_their_closed_form():
    """V = 2**15 equal logits (1,024 tiles of 32): each row `V softplus(z)` and `d_hidden = V sigmoid(z) w`
    within 2e-6 of their closed form; a running float32 sum adding the tiles' equal parts drifts by up
    to 1,024 roundings (6e-5)."""
    num_items, z = 2**15, -0.7
    hidden = torch.ones(2, 1)
    items = torch.full((num_items, 1), z)
    targets = torch.full((2, 1), -1)
    leaf = hidden.clone().requires_grad_()
    rows = cut_bce_with_logits(leaf, items, targets, reduction="none", backend="triton")
    rows.sum().backward()
    softplus, sigmoid = math.log1p(math.exp(z)), 1 / (1 + math.exp(-z))
    _assert_relative(rows, torch.full((2,), num_items * softplus, dtype=torch.float64), 2e-6, "rows")
    _assert_relative(leaf.grad, torch.full((2, 1), num_items * sigmoid * z, dtype=torch.float64), 2e-6, "d_hidden")


def test_a_catalog_of_2_22_items_keeps_its_closed_form(monkeypatch):
    """V = 2**22 equal logits (2,048 chunks of `shapes.MAX_CONTRACTION` items, each summed in float32,
    carried in float64): each row within 2e-6 of its closed form. Tiles of 2,048 items (one per
    chunk): the shipped ones would take the interpreter an hour; the forward only (a minute of CPU),
    `d_hidden`'s carry over 16 chunks is the test above."""
    from torch_cutbce.triton import launch

    monkeypatch.setattr(launch, "blocks_for", lambda *_: launch.Blocks(16, 2048, 128, 4))
    num_items, z = 2**22, 0.3
    rows = cut_bce_with_logits(torch.ones(2, 1), torch.full((num_items, 1), z), torch.full((2, 1), -1),
                               reduction="none", backend="triton")
    expected = num_items * math.log1p(math.exp(z))
    _assert_relative(rows, torch.full((2,), expected, dtype=torch.float64), 2e-6, "rows")


def test_torch_compile_fullgraph_is_one_graph_with_the_eager_numbers():
    inputs = _inputs(21, 203, 16)
    weight = torch.rand(21)

    def step(hidden, items, bias):
        return cut_bce_with_logits(hidden, items, inputs[2], bias, weight=weight, backend="triton", **LOSS)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (inputs[0], inputs[1], inputs[3])]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [x.grad for x in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # inductor would compile for a GPU
    for got, want in zip(run(compiled), run(step)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["dynamic", "mark_dynamic"])
@pytest.mark.parametrize("kind", _dynamic_compile.STEPS)
def test_torch_compile_with_dynamic_shapes_is_one_graph_with_the_eager_numbers(kind, mode):
    """dynamic=True failed at the loss options' checks (a symbolic float); mark_dynamic worked."""
    _dynamic_compile.check_one_graph_with_eager_values("triton", kind, mode)


@pytest.mark.parametrize("options", [CutBCEOptions(compute_metrics=True, loss=Loss(**LOSS)), CutBCEOptions()])
def test_opcheck_triton_ops(options):
    """Schemas, fakes (the saved ids are int64, as the fakes say) and autograd of the three ops."""
    from test_neutral_options import _native_inputs, opcheck_chunked_ops
    from torch_cutbce.triton import ops

    t = {name: x.detach().float().requires_grad_(x.requires_grad) if x.is_floating_point() else x
         for name, x in _native_inputs(d=16).items()}
    opcheck_chunked_ops(ops.OPS, t, options.encode(), torch.float32)


@pytest.mark.parametrize("wants", ["everything", "hidden only", "table only", "no gradient"])
def test_reduction_none_makes_four_products_and_the_oracles_gradients(monkeypatch, wants):
    """'none': the forward's row pass makes `d_hidden` for a row gradient of 1 beside the rows (logits,
    d_hidden) when hidden requires grad; the backward scales it and runs the item pass only for the
    table (logits, d_item_weight): 4 logit-sized products, the row pass never twice."""
    from torch_cutbce.triton import launch

    calls = []
    for name in ("rows_pass", "items_pass"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _real=real, _name=name, **k: calls.append(
            (_name, a[6] is not None)) or _real(*a, **k))
    hidden, items, targets, bias = _inputs(37, 150, 24, seed=11)
    upstream = torch.rand(37) * 3 - 1
    grad_hidden, grad_table = wants in ("everything", "hidden only"), wants in ("everything", "table only")
    leaves = [hidden.clone().requires_grad_(grad_hidden), items.clone().requires_grad_(grad_table),
              bias.clone().requires_grad_(grad_table)]
    rows = cut_bce_with_logits(*leaves[:2], targets, leaves[2], reduction="none", backend="triton", **LOSS)
    forward = list(calls)
    assert forward == [("rows_pass", grad_hidden)], forward  # d_hidden only when hidden requires grad
    if wants == "no gradient":
        return
    (rows * upstream).sum().backward()
    assert calls[1:] == ([("items_pass", True)] if grad_table else []), calls
    want = _rows_and_grads("dense", hidden, items, targets, bias, upstream, dtype=torch.float64, **LOSS)
    got = [rows.detach()] + [x.grad for x in leaves]
    for name, g, w, required in zip(("rows", "d_hidden", "d_item_weight", "d_bias"), got, want,
                                    (True, grad_hidden, grad_table, grad_table)):
        if required:
            _assert_relative(g, w, TOLERANCES["float32"], f"'none' {wants}: {name}")


def test_the_same_bits_every_run_and_under_deterministic_algorithms():
    inputs = _inputs(33, 150, 24, seed=5)
    upstream = torch.rand(33)
    first = _rows_and_grads("triton", *inputs, upstream, **LOSS)
    torch.use_deterministic_algorithms(True)
    try:
        again = _rows_and_grads("triton", *inputs, upstream, **LOSS)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_autocast_runs_the_bfloat16_kernels():
    inputs = _inputs(20, 130, 32, seed=2)
    upstream = torch.rand(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _rows_and_grads("triton", *inputs, upstream)
    want = _rows_and_grads("dense", *inputs, upstream, dtype=torch.float64)
    assert got[1].dtype == torch.float32  # each gradient in its input's dtype
    for name, g, w in zip(("rows", "d_hidden", "d_item_weight", "d_bias"), got, want):
        _assert_relative(g, w, 2e-2, f"autocast {name}")  # the bfloat16 products' rounding


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_vocab_parallel_takes_this_ranks_slice(one_rank_group, reduction):
    """The rank holds items [60, 203): ids below 60 are padding, the rows those of the slice's items."""
    hidden, items, targets, bias = _inputs(21, 203, 16, seed=9)
    start, num_items = 60, 203
    options = VocabParallelOptions(start, num_items, num_items)
    got = cut_bce_with_logits(hidden, items[start:], targets, bias[start:], reduction=reduction, backend="triton",
                              vocab_parallel=options)
    local = torch.where(targets >= start, targets - start, -1)
    want = dense_bce_with_logits(hidden.double(), items[start:].double(), local, bias[start:].double(),
                                 reduction=reduction)
    _assert_relative(got, want, TOLERANCES["float32"], f"vocab_parallel {reduction}")  # 'sum': the one-pass path


def test_the_interpreter_rounds_float32_to_bfloat16_to_nearest_even():
    """`interpreter.make_compatible`'s cast: what a GPU's cvt.rn.bf16.f32 gives (triton 3.5's
    interpreter truncated 1.005859375 to 1.0), ties to even, carries, infinities, NaN."""
    import triton
    import triton.language as tl

    from torch_cutbce.triton import interpreter

    interpreter.make_compatible()

    @triton.jit
    def cast(x_ptr, y_ptr, SIZE: tl.constexpr):
        offsets = tl.arange(0, SIZE)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(tl.bfloat16))

    x = torch.tensor([1.005859375, -1.005859375, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 2 - 2**-9, 3.4e38, -math.inf,
                      math.nan, 1e-40, 0.0, 1.0, 1.0 + 2**-9] + [0.0] * 4)
    y = torch.empty(16, dtype=torch.bfloat16)
    cast[(1,)](x, y, SIZE=16)
    torch.testing.assert_close(y, x.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
