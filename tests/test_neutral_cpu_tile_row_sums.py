"""Row sums as exact at any V, on every CPU tile; infinities; vmap and gradcheck through the kernels.

- Wide rows of equal logits (the worst case of a running float32 sum: every addition rounds the
  same way): N 2, D 1, V up to 2**22, in one tile and in 1024 tiles, with and without a class
  weight, for torch's C kernel, compiled and eager tiles (`TORCH_CUTBCE_TILE`) and JAX's FFI
  kernel and jnp tiles: `reduction='none'` rows and 'sum' within the float32 tolerance of float64.
  hypothesis draws the logit, V and the tile count.
- `d_hidden` over 2**22 equal terms, in one tile (torch, JAX's blocked loop) and over 1024 tiles (the
  Pallas kernels), against its closed form.
- Infinite inputs, as docs/precision.md's table says: an infinite logit gives its limit (a negative at
  -inf or a positive at +inf adds 0 with gradient 0; a negative at +inf or a positive at -inf adds
  +inf), where BCEWithLogitsLoss gives NaN; an infinite position weight gives torch's infinities.
- `jax.vmap` over `cut_bce` through the FFI kernel; `torch.autograd.gradcheck` with its default
  `check_undefined_grad=True` on reduction='none'.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import TOLERANCES
from torch_cutbce import cut_bce_with_logits
from torch_cutbce.native import fused_tile
from torch_cutbce.reference import dense_bce_with_logits

pytestmark = pytest.mark.rung1

WIDE = 2**22
LOGITS = (-8.0, -2.0, 0.3)


def _exact_row(z: float, num_items: int, class_weight: float) -> float:
    return num_items * class_weight * (max(z, 0.0) + math.log1p(math.exp(-abs(z))))


def _relative(got, want):
    return abs(float(got) - want) / want


def _torch_rows(tile, z, num_items, block_v, class_weight, monkeypatch):
    monkeypatch.setenv("TORCH_CUTBCE_TILE", tile)
    hidden, items = torch.full((2, 1), z), torch.ones(num_items, 1)
    targets = torch.full((2, 1), -1)
    cw = None if class_weight == 1.0 else torch.full((num_items,), class_weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fused_tile.TileCompileWarning)
        rows = cut_bce_with_logits(hidden, items, targets, class_weight=cw, reduction="none", block_v=block_v)
        total = cut_bce_with_logits(hidden, items, targets, class_weight=cw, reduction="sum", block_v=block_v)
    return rows, total


@pytest.mark.parametrize("tile", fused_tile.TILES)
@pytest.mark.parametrize("z", LOGITS)
def test_torch_rows_of_2_22_equal_logits_are_exact(tile, z, monkeypatch):
    if tile == "c_kernel" and fused_tile._cpu_library() is None:
        pytest.skip("no C compiler")
    for class_weight in (1.0, 0.7):
        rows, total = _torch_rows(tile, z, WIDE, None, class_weight, monkeypatch)
        want = _exact_row(z, WIDE, class_weight)
        assert fused_tile._plain_cpu_tile() == tile
        assert max(_relative(r, want) for r in rows) <= TOLERANCES["float32"], (tile, z, class_weight, rows, want)
        assert _relative(total, 2 * want) <= TOLERANCES["float32"], (tile, z, class_weight, total, 2 * want)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(tile=st.sampled_from(fused_tile.TILES), z=st.floats(-20, 20), log_v=st.integers(12, 22),
       num_tiles=st.sampled_from([1, 3, 1024]), class_weight=st.sampled_from([1.0, 0.3]))
def test_torch_wide_rows_property(tile, z, log_v, num_tiles, class_weight):
    if tile == "c_kernel" and fused_tile._cpu_library() is None:
        return
    num_items = 2**log_v
    with pytest.MonkeyPatch.context() as monkeypatch:
        rows, total = _torch_rows(tile, z, num_items, -(-num_items // num_tiles), class_weight, monkeypatch)
    want = _exact_row(float(np.float32(z)), num_items, class_weight)
    assert max(_relative(r, want) for r in rows) <= TOLERANCES["float32"]
    assert _relative(total, 2 * want) <= TOLERANCES["float32"]


@pytest.mark.jax
@pytest.mark.parametrize("tile", ["c_kernel", "xla"])
@pytest.mark.parametrize("z", LOGITS)
@pytest.mark.parametrize("block_v", [None, WIDE // 1024])
def test_jax_rows_of_2_22_equal_logits_are_exact(tile, z, block_v, monkeypatch):
    import jax
    import jax.numpy as jnp

    from jax_kernels import cut_bce
    from jax_kernels.blocked import negative_tile

    if tile == "c_kernel" and not negative_tile._ffi_registered():
        pytest.skip("the FFI kernel could not be built here")
    monkeypatch.setenv("TORCH_CUTBCE_TILE", tile)
    jax.clear_caches()  # the kernel-or-jnp choice is made at trace time
    hidden, items = jnp.full((2, 1), z, jnp.float32), jnp.ones((WIDE, 1), jnp.float32)
    targets = jnp.full((2, 1), -1, jnp.int32)
    for class_weight in (1.0, 0.7):
        cw = None if class_weight == 1.0 else jnp.full((WIDE,), class_weight, jnp.float32)
        rows = cut_bce(hidden, items, targets, class_weight=cw, reduction="none", block_v=block_v)
        total = cut_bce(hidden, items, targets, class_weight=cw, reduction="sum", block_v=block_v)
        text = jax.jit(lambda h: cut_bce(h, items, targets, class_weight=cw, reduction="sum",
                                         block_v=block_v)).lower(hidden).as_text()
        assert ("cutbce_rows" in text) == (tile == "c_kernel")
        want = _exact_row(z, WIDE, class_weight)
        assert max(_relative(r, want) for r in np.asarray(rows)) <= TOLERANCES["float32"], (tile, z, rows, want)
        assert _relative(total, 2 * want) <= TOLERANCES["float32"], (tile, z, total, 2 * want)
    jax.clear_caches()


# -- d_hidden over wide tiles: a sum over V in each tile's product (issue 39) -------------------------
# Equal logits z and item rows of 1 make `dz @ items` a sum of V equal terms, with the closed form
# d_hidden[n] = g[n] V sigmoid(z[n]). XLA:CPU's dot summed 2**22 of them to 1.3e-3 on an AVX-512 Xeon
# (the products are now at most shapes.MAX_CONTRACTION long, carried compensated or in float64).
HIDDEN_Z, UPSTREAM = (-2.0, 0.3), (0.75, 1.25)


def _exact_d_hidden(num_items):
    return np.array([[g * num_items / (1 + math.exp(-z))] for z, g in zip(HIDDEN_Z, UPSTREAM)])


def _assert_d_hidden_exact(d_hidden, num_items, name):
    want = _exact_d_hidden(num_items)
    err = float(np.max(np.abs(np.asarray(d_hidden, np.float64) - want) / want))
    assert err <= TOLERANCES["float32"], f"{name}: d_hidden {np.asarray(d_hidden).ravel()} vs {want.ravel()}: {err:.2e}"


@pytest.mark.parametrize("block_v", [None, WIDE])
def test_torch_d_hidden_over_2_22_equal_terms_is_exact(block_v):
    hidden = torch.tensor([[z] for z in HIDDEN_Z], requires_grad=True)
    rows = cut_bce_with_logits(hidden, torch.ones(1, 1).expand(WIDE, 1), torch.full((2, 1), -1),
                               reduction="none", block_v=block_v)
    rows.backward(torch.tensor(UPSTREAM))
    _assert_d_hidden_exact(hidden.grad, WIDE, f"torch native block_v={block_v}")


@pytest.mark.jax
@pytest.mark.parametrize("impl,num_items", [("blocked", WIDE), ("pallas", 2**19)])
@pytest.mark.parametrize("jit", [False, True])
def test_jax_d_hidden_over_2_22_equal_terms_is_exact(impl, num_items, jit):
    """The blocked loop in one tile of 2**22 (the default at N = 2); the Pallas kernels (interpreted:
    2**22 takes minutes) over 4096 tiles of 128, which 2**22 takes in tiles of 1024: their rows and
    d_hidden, resident across the item tiles, drifted by 4e-5 and 3e-5 summed in order."""
    import jax
    import jax.numpy as jnp

    from jax_kernels import cut_bce
    from jax_kernels.pallas.block_sizes import BlockSizes

    options = {"block_sizes": BlockSizes(block_n=128, block_v=128)} if impl == "pallas" else {}
    items, targets = jnp.ones((1, 1), jnp.float32).repeat(num_items, 0), jnp.full((2, 1), -1, jnp.int32)
    rows_fn = lambda h: cut_bce(h, items, targets, reduction="none", impl=impl, **options)
    rows, vjp = jax.vjp(jax.jit(rows_fn) if jit else rows_fn, jnp.asarray([[z] for z in HIDDEN_Z], jnp.float32))
    _assert_d_hidden_exact(vjp(jnp.asarray(UPSTREAM, jnp.float32))[0], num_items, f"jax {impl} jit={jit}")
    want = [_exact_row(z, num_items, 1.0) for z in HIDDEN_Z]
    assert max(_relative(r, w) for r, w in zip(np.asarray(rows), want)) <= TOLERANCES["float32"], (impl, rows, want)


# -- infinities ---------------------------------------------------------------------------------------


def _with_infinite_logits(reduction):
    """Items 0 and 1 get bias +inf and -inf (every row's logit there is infinite); row 0 has item 0 as
    a positive, row 1 item 1. Returns the loss and the gradients of hidden and bias."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 4, generator=g, requires_grad=True)
    items = torch.randn(9, 4, generator=g)
    bias = torch.randn(9, generator=g)
    bias[0], bias[1] = math.inf, -math.inf
    bias.requires_grad_(True)
    targets = torch.tensor([[0, 4], [1, -1], [5, 5]])
    loss = cut_bce_with_logits(hidden, items, targets, bias, reduction=reduction)
    upstream = torch.tensor([0.5, 2.0, 1.5]) if reduction == "none" else torch.tensor(1.0)
    (loss * upstream).sum().backward()
    return loss.detach(), hidden.grad, bias.grad, upstream


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_an_infinite_logit_gives_its_limit(reduction):
    loss, d_hidden, d_bias, upstream = _with_infinite_logits(reduction)
    if reduction == "none":
        # row 0: item 0 (+inf) is its positive (adds 0), item 1 (-inf) a negative (adds 0): finite
        # row 1: item 0 (+inf) is a negative: +inf; row 2: item 0 a negative: +inf
        assert torch.isfinite(loss[0]) and loss[1] == math.inf and loss[2] == math.inf
    else:
        assert loss == math.inf
    assert torch.isfinite(d_hidden).all()  # the infinite logits' slopes are 0 or g cw, times finite items
    g_rows = upstream.expand(3)
    # d_bias[0]: the negatives at +inf get sigmoid = 1 (rows 1, 2), the positive at +inf 0 (row 0)
    torch.testing.assert_close(d_bias[0], g_rows[1] + g_rows[2], rtol=0, atol=0)
    # d_bias[1]: row 1's positive at -inf gets -1, the negatives at -inf 0
    torch.testing.assert_close(d_bias[1], -g_rows[1], rtol=0, atol=0)
    dense = dense_bce_with_logits(torch.randn(1, 4), torch.randn(2, 4), torch.tensor([[0]]),
                                  torch.tensor([math.inf, -math.inf]), reduction="none")
    assert torch.isnan(dense).all(), "BCEWithLogitsLoss's NaN here is the documented difference"


@pytest.mark.jax
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_jax_infinite_logits_give_their_limits(reduction, jit):
    """Issue 31: the blocked loop's TwoSum across tiles computed inf - inf, so a row with a +inf
    logit at a negative came out NaN; docs/precision.md's infinities table says +inf (block_v = 2: the
    infinite tile is not the last)."""
    import jax
    import jax.numpy as jnp

    from jax_kernels import cut_bce

    g = np.random.default_rng(5)
    hidden, items, bias = (jnp.asarray(g.normal(size=s), jnp.float32) for s in ((3, 4), (9, 4), (9,)))
    bias = bias.at[0].set(jnp.inf).at[1].set(-jnp.inf)
    targets = jnp.asarray([[0, 4], [1, -1], [5, 5]])
    upstream = jnp.asarray([0.5, 2.0, 1.5]) if reduction == "none" else jnp.asarray(1.0)

    def loss_fn(hidden, bias):
        return (cut_bce(hidden, items, targets, bias, reduction=reduction, impl="blocked", block_v=2) * upstream).sum()

    value_and_grad = jax.value_and_grad(loss_fn, argnums=(0, 1))
    loss, (d_hidden, d_bias) = (jax.jit(value_and_grad) if jit else value_and_grad)(hidden, bias)
    rows = cut_bce(hidden, items, targets, bias, reduction="none", impl="blocked", block_v=2)
    assert np.isfinite(rows[0]) and rows[1] == np.inf and rows[2] == np.inf, rows
    assert loss == np.inf and np.isfinite(d_hidden).all(), (loss, d_hidden)
    g_rows = np.broadcast_to(np.asarray(upstream), (3,))
    assert d_bias[0] == g_rows[1] + g_rows[2] and d_bias[1] == -g_rows[1], d_bias


@pytest.mark.parametrize("where", ["hidden", "item_weight"])
def test_an_infinite_input_entry_gives_torchs_gradients_or_nan_for_its_infinities(where):
    """docs/precision.md's rule for an infinite `hidden` / `item_weight` entry: each gradient entry equals
    torch's where torch's is finite or NaN; where torch's is +-inf, ours is the same infinity or
    NaN (a positive taken out of its tile with slope 0 meets the infinity: 0 x inf)."""
    g = torch.Generator().manual_seed(6)
    inputs = dict(hidden=torch.randn(3, 4, generator=g), item_weight=torch.randn(9, 4, generator=g))
    inputs[where][(1, 2) if where == "hidden" else (4, 1)] = math.inf  # row 1 / item 4 (a positive of row 0)
    targets = torch.tensor([[0, 4], [1, -1], [5, 5]])
    grads = []
    for loss_fn in (cut_bce_with_logits, dense_bce_with_logits):
        leaves = {k: x.clone().requires_grad_(True) for k, x in inputs.items()}
        loss_fn(leaves["hidden"], leaves["item_weight"], targets, reduction="sum").backward()
        grads.append({k: x.grad for k, x in leaves.items()})
    ours, torchs = grads
    for name in inputs:
        a, b = ours[name], torchs[name]
        finite = torch.isfinite(b)
        assert torch.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-6), name
        assert torch.equal(torch.isnan(a) & torch.isnan(b), torch.isnan(b)), name  # torch's NaN: ours too
        infinite = torch.isinf(b)
        assert ((a[infinite] == b[infinite]) | torch.isnan(a[infinite])).all(), name


@pytest.mark.parametrize("infinity", [math.inf, -math.inf])
def test_an_infinite_position_weight_gives_torchs_infinities(infinity):
    g = torch.Generator().manual_seed(4)
    hidden, items, bias = torch.randn(3, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(9, generator=g)
    weight = torch.tensor([infinity, 0.5, 1.0])
    targets = torch.tensor([[0, 4], [1, -1], [5, 5]])
    grads = []
    for loss_fn in (cut_bce_with_logits, dense_bce_with_logits):
        leaves = [x.clone().requires_grad_(True) for x in (hidden, items, bias)]
        loss_fn(*leaves[:2], targets, leaves[2], weight=weight, reduction="mean").backward()
        grads.append([x.grad for x in leaves])
    for ours, torchs in zip(*grads):
        for kind in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(kind(ours), kind(torchs))


# -- vmap and gradcheck -----------------------------------------------------------------------------------


@pytest.mark.jax
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_jax_vmap_runs_through_the_ffi_kernel(reduction, monkeypatch):
    import jax
    import jax.numpy as jnp

    from jax_kernels import cut_bce, dense_cut_bce
    from jax_kernels.blocked import negative_tile

    monkeypatch.setenv("TORCH_CUTBCE_TILE", "c_kernel")  # whichever tile this machine's tuning chose
    jax.clear_caches()

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((3, 6, 5)), jnp.float32)
    items = jnp.asarray(rng.standard_normal((700, 5)), jnp.float32)
    targets = jnp.asarray(rng.integers(-1, 700, (3, 6, 2)), jnp.int32)
    upstream = jnp.asarray(rng.random((6,)) + 0.5, jnp.float32)

    def batched(loss):
        def one(h, t):
            return (loss(h, items, t, reduction=reduction) * (upstream if reduction == "none" else 1)).sum()
        return jax.vmap(jax.value_and_grad(one))(hidden, targets)

    fast = jax.jit(lambda: batched(lambda *a, **k: cut_bce(*a, block_v=256, **k)))
    if negative_tile._ffi_registered():
        assert ("cutbce_rows_grad" if reduction == "mean" else "cutbce_rows") in fast.lower().as_text()
    (value, grad), (want_value, want_grad) = fast(), batched(dense_cut_bce)
    np.testing.assert_allclose(value, want_value, rtol=TOLERANCES["float32"])
    np.testing.assert_allclose(grad, want_grad, rtol=TOLERANCES["float32"], atol=1e-7)


def test_gradcheck_with_undefined_gradients_on_rows():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    items = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(-1, 11, (7, 3), generator=g)
    assert torch.autograd.gradcheck(lambda h, e, b: cut_bce_with_logits(h, e, targets, b, reduction="none"),
                                    (hidden, items, bias), check_undefined_grad=True)
