"""Rung L2: the Pallas kernels (interpret mode on CPU) against a float64 dense oracle.

The kernels compute every element's exact loss in its tile (formulas: the docstring of
jax_kernels/pallas/launch.py, docs/design.md 'The math'): with y[n, v] = (v in ids[n]),
    rows[n] = sum_v cw[v] (pw[v] softplus(-z) if y else softplus(z)),
    predicted[n] = sum_v (z > 0),  hits[n] = sum_v y (z > 0),
    dz = g[n] cw[v] (-pw[v] sigmoid(-z) if y else sigmoid(z)) -> d_hidden, d_item_weight, d_bias.
The oracle evaluates them in float64 numpy on the same (already rounded) inputs. Shapes are
deliberately odd: N, V and D are multiples of no block, N can be smaller than one block, and the
last item tile is ragged, so the masking of items past V and the padding of rows are both
exercised (in interpret mode Pallas fills out-of-bounds block rows with NaN, so a missing mask
shows up as NaN here). Ids are random sets with -1 slots and rows without any positive.
The launchers' input checks and the torch_xla call_jax run: test_jax_pallas_launch.py; the tile
sizes: test_jax_pallas_block_sizes.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="needs jax: pip install 'torch-cutbce[jax]'")  # every test here runs JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_kernels.pallas.block_sizes import BlockSizes  # noqa: E402
from jax_kernels.pallas.launch import (  # noqa: E402
    pallas_backward,
    pallas_forward,
    pallas_value_and_grad,
)

from parity import assert_close, jax_x64  # noqa: E402

pytestmark = pytest.mark.rung2

# The parity rule (tests/parity.py, one tolerance table): float32 rows within the float32 tolerance
# of the float64 truth, each row on its own (`elementwise`); gradients relative to the tensor's
# largest entry; bfloat16 no worse than a dense bfloat16 computation plus the bfloat16 tolerance.
GRADS = ("d_hidden", "d_item_weight", "d_bias")


def assert_rows(name, rows, truth):
    """float32 rows: each within the float32 tolerance of its float64 truth, and never below zero."""
    assert rows.dtype == jnp.float32, name
    rows = np.asarray(rows, np.float64)
    assert (rows >= 0).all(), f"{name}: negative rows at {np.flatnonzero(rows < 0)[:5]}"
    assert_close(rows, truth, dtype="float32", name=name, elementwise=True)


def oracle(hidden, item_weight, ids, bias, class_weight, pos_weight, g):
    """Float64 dense truth: a dict of rows, predicted, hits, the gradients, |z| and y."""
    h = np.asarray(hidden, np.float64)
    w = np.asarray(item_weight, np.float64)
    z = h @ w.T
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    y = np.zeros(z.shape, bool)
    rows_of, slots = np.nonzero(np.asarray(ids) >= 0)
    y[rows_of, np.asarray(ids)[rows_of, slots]] = True
    cw = 1.0 if class_weight is None else np.asarray(class_weight, np.float64)
    pw = 1.0 if pos_weight is None else np.asarray(pos_weight, np.float64)
    wgt = cw * np.where(y, pw, 1.0)
    zs = np.where(y, -z, z)
    # exp(-|zs|): no overflow at |z| ~ 100, and no 1 - (1 - tiny) (a tanh form loses 3e-3 of
    # sigmoid(-31) that way).
    e = np.exp(-np.abs(zs))
    sig = np.where(zs >= 0, 1.0, e) / (1.0 + e)
    dz = np.asarray(g, np.float64)[:, None] * wgt * np.where(y, -sig, sig)
    return dict(
        rows=(wgt * np.logaddexp(0.0, zs)).sum(axis=1),
        predicted=(z > 0).sum(axis=1).astype(np.float64),
        hits=(y & (z > 0)).sum(axis=1).astype(np.float64),
        d_hidden=dz @ w, d_item_weight=dz.T @ h, d_bias=dz.sum(axis=0), abs_z=np.abs(z), y=y,
    )


def random_ids(rng, n, v, num_slots):
    """`[N, L]` int32 sets: each row holds 0..L distinct ids in shuffled slots, the rest -1."""
    ids = np.full((n, num_slots), -1, np.int32)
    for row in range(n):
        k = int(rng.integers(0, min(num_slots, v) + 1))
        ids[row, rng.permutation(num_slots)[:k]] = rng.choice(v, size=k, replace=False)
    return ids


def make_inputs(seed, n, v, d, num_slots, *, dtype=np.float32, bias=True, class_weight=True,
                pos_weight=True, logit_scale=4.0):
    """Random inputs whose logits have standard deviation about `logit_scale`, and a random,
    non-uniform upstream gradient with a few exact zeros (padded positions)."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(n, d)) * (logit_scale / np.sqrt(d))
    item_weight = rng.normal(size=(v, d))
    b = rng.normal(size=v).astype(np.float32) if bias else None
    cw = rng.uniform(0.25, 2.0, size=v).astype(np.float32) if class_weight else None
    pw = rng.uniform(0.5, 3.0, size=v).astype(np.float32) if pos_weight else None
    g = rng.normal(size=n).astype(np.float32)
    g[rng.random(n) < 0.1] = 0.0
    cast = (lambda x: jnp.asarray(x, jnp.bfloat16)) if dtype == jnp.bfloat16 else (
        lambda x: np.asarray(x, np.float32))
    ids = random_ids(rng, n, v, num_slots)
    return cast(hidden), cast(item_weight), ids, b, cw, pw, g


def make_confident_inputs(seed, n, v, extra_d, num_slots):
    """Rows of confident predictions whose float32 logits are exact.

    item_weight[v] = c[v] * e_perm(v) (c a power of two, perm a permutation of the first V
    columns) plus `extra_d` random columns that these rows' hidden vectors leave at 0, so every
    product but one is an exact 0; the logits are multiples of 1/64 and the bias of 1/4, so
    `z = hidden . item_weight + bias` is exact in float32. The even rows have 1..L positives at z
    in +20..+100 and their negatives in -50..hi, hi one of -10, -25, -40; at hi = -40 the
    negatives add under 1e-15, so a positive's softplus(-z) (2e-9 at z = 20) can carry the row.
    The odd rows are ordinary random rows (z ~ N(0, 16)) for contrast.
    """
    rng = np.random.default_rng(seed)
    d = v + extra_d
    perm = rng.permutation(v)
    scale = rng.choice([0.5, 1.0, 2.0], size=v)
    item_weight = np.zeros((v, d))
    item_weight[np.arange(v), perm] = scale
    item_weight[:, v:] = rng.normal(size=(v, extra_d))
    bias = rng.integers(-8, 9, size=v) / 4.0
    ids = np.full((n, num_slots), -1, np.int32)
    hidden = rng.normal(size=(n, d)) * (4.0 / np.sqrt(d))
    for row in range(0, n, 2):
        k = int(rng.integers(1, num_slots + 1))
        pos = rng.choice(v, size=k, replace=False)
        ids[row, rng.permutation(num_slots)[:k]] = pos
        hi = (-10.0, -25.0, -40.0)[(row // 2) % 3]
        z = rng.uniform(-50.0, hi, size=v)
        z[pos] = rng.uniform(20.0, 100.0, size=k)
        z = np.round(z * 64) / 64
        hidden[row] = 0.0
        hidden[row, perm] = (z - bias) / scale
    cw = rng.uniform(0.25, 2.0, size=v).astype(np.float32)
    pw = rng.uniform(0.5, 3.0, size=v).astype(np.float32)
    g = rng.normal(size=n).astype(np.float32)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return f32(hidden), f32(item_weight), ids, f32(bias), cw, pw, g


# Both ways to the six outputs: forward then backward (three kernels), and the one-pass gradient of
# the scalar reductions (`pallas_value_and_grad`: the d_hidden kernel sums the rows too).
ENGINES = ("two_pass", "one_pass")


def run_kernels(inputs, block_sizes, engine="two_pass"):
    """`(rows, predicted, hits, d_hidden, d_item_weight, d_bias)` from the jitted launchers."""
    if engine == "one_pass":
        fused = jax.jit(pallas_value_and_grad,
                        static_argnames=("compute_counts", "block_sizes"))
        return fused(*inputs, compute_counts=True, block_sizes=block_sizes)
    fwd = jax.jit(pallas_forward, static_argnames=("compute_counts", "block_sizes"))
    bwd = jax.jit(pallas_backward, static_argnames=("block_sizes",))
    return (*fwd(*inputs[:6], compute_counts=True, block_sizes=block_sizes),
            *bwd(*inputs, block_sizes=block_sizes))


def check_counts(name, fast, truth, band):
    """Counts of z > 0 are exact except for logits within `band` of 0, where float32 rounding
    may flip the sign; allow one miscount per such item (for hits, per such positive)."""
    ambiguous = truth["abs_z"] < band
    for key, allowed in (("predicted", ambiguous), ("hits", ambiguous & truth["y"])):
        count = np.asarray(fast[key], np.float64)
        bad = np.abs(count - truth[key]) > allowed.sum(axis=1)
        assert not bad.any(), (
            f"{name}/{key} off at rows {np.flatnonzero(bad)[:5]}: fast={count[bad][:5]} "
            f"truth={truth[key][bad][:5]}"
        )


def check_float32(name, inputs, block_sizes, band, engine):
    rows, predicted, hits, *grads = run_kernels(inputs, block_sizes, engine)
    truth = oracle(*inputs)
    assert_rows(f"{name}/rows", rows, truth["rows"])
    check_counts(name, dict(predicted=predicted, hits=hits), truth, band)
    for key, got in zip(GRADS, grads):
        if key == "d_bias" and inputs[3] is None:
            assert got is None
            continue
        assert got.dtype == jnp.float32, key
        assert_close(got, truth[key], dtype="float32", name=f"{name}/{key}")
    return truth


# (n, v, d, L, bias, class_weight, pos_weight, logit_scale, block_n, block_v): grids stay small
# (<= 3 x 4) for interpret-mode speed.
F32_CASES = {
    "ragged_n_v_d": (300, 1000, 72, 4, True, True, True, 4.0, 128, 256),
    "n_below_block_no_bias_no_cw_no_pw": (37, 700, 40, 3, False, False, False, 4.0, 128, 512),
    "v_multiple_of_block_cw_only": (256, 512, 128, 2, False, True, False, 4.0, 128, 256),
    "bias_pw_single_tile_no_slots": (90, 333, 33, 0, True, False, True, 4.0, 128, 384),
    "logits_near_50_pw_only": (200, 600, 24, 9, True, False, True, 50.0, 128, 256),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(F32_CASES))
def test_float32_matches_float64_oracle(case, engine):
    n, v, d, num_slots, bias, cw, pw, scale, block_n, block_v = F32_CASES[case]
    inputs = make_inputs(sorted(F32_CASES).index(case), n, v, d, num_slots, bias=bias,
                         class_weight=cw, pos_weight=pw, logit_scale=scale)
    truth = check_float32(case, inputs, BlockSizes(block_n=block_n, block_v=block_v),
                          band=1e-4 * scale, engine=engine)
    if scale > 10:  # really exercise |z| ~ 50, positives included
        assert truth["abs_z"].max() > 40.0 and truth["y"].any()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pos_weight", [True, False], ids=["pw", "no_pw"])
def test_confident_positives_exact_per_row(pos_weight, engine):
    """Positives at z = +20..+100 among negatives at -10..-50: no row loses its positives'
    softplus(-z) to the rounding of a row sum that went through softplus(z) - z."""
    inputs = list(make_confident_inputs(11, 150, 200, 9, 5))
    if not pos_weight:
        inputs[5] = None
    truth = check_float32("confident", inputs, BlockSizes(block_n=128, block_v=128), band=1e-4,
                          engine=engine)
    confident = truth["rows"][::2]
    assert confident.min() < 1e-16 and truth["abs_z"][::2].min() >= 10.0


@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
@pytest.mark.parametrize("engine", ENGINES)
def test_single_item_confident_positive(engine, x64):
    """V = 1: the item is a positive at z = 31 (row loss softplus(-31) = 3.4e-14), a negative at
    z = -31, and a positive predicted wrong at z = -5; exact f32 logits (30 + bias 1). The session
    runs with x64 off (as users do); x64_on checks the kernels keep float32 / int32 under x64 too
    (typed constants: Python floats and ints would widen)."""
    with jax_x64("float64" if x64 else "float32"):
        _check_single_item(engine)


def _check_single_item(engine):
    hidden = np.zeros((3, 8), np.float32)
    hidden[:, 0] = [30.0, -32.0, -6.0]
    item_weight = np.zeros((1, 8), np.float32)
    item_weight[0, 0] = 1.0
    bias = np.ones(1, np.float32)
    ids = np.array([[0, -1], [-1, -1], [-1, 0]], np.int32)
    g = np.array([0.7, -1.3, 0.4], np.float32)
    for pw in (None, np.full(1, 2.5, np.float32)):
        inputs = (hidden, item_weight, ids, bias, np.full(1, 0.75, np.float32), pw, g)
        rows, predicted, hits, *grads = run_kernels(inputs, None, engine)
        truth = oracle(*inputs)
        wgt = 0.75 * (1.0 if pw is None else 2.5)
        assert 3.4e-14 < truth["rows"][0] / wgt < 3.5e-14  # softplus(-31)
        assert_rows("single/rows", rows, truth["rows"])
        np.testing.assert_array_equal(predicted, [1, 0, 0])
        np.testing.assert_array_equal(hits, [1, 0, 0])
        for key, got in zip(GRADS, grads):  # element by element: the gradients span 1e-14..1
            nonzero = truth[key] != 0
            assert_close(np.asarray(got)[nonzero], truth[key][nonzero], dtype="float32", name=f"single/{key}",
                         elementwise=True)


def dense_bf16(hidden, item_weight, ids, bias, class_weight, pos_weight, g):
    """The same math run densely in bfloat16: the yardstick of the bf16 rule."""
    bf = jnp.bfloat16
    y = jnp.asarray(oracle(hidden, item_weight, ids, None, None, None, g)["y"])
    z = hidden @ item_weight.T + jnp.asarray(bias, bf)
    wgt = jnp.asarray(class_weight, bf) * jnp.where(y, jnp.asarray(pos_weight, bf), bf(1))
    zs = jnp.where(y, -z, z)
    sig = jax.nn.sigmoid(zs)
    dz = jnp.asarray(g, bf)[:, None] * wgt * jnp.where(y, -sig, sig)
    rows = (jax.nn.softplus(zs) * wgt).sum(axis=1)
    return rows, dz @ item_weight, dz.T @ hidden, dz.sum(axis=0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("d", [72, 128])  # the table as [D, V] (D % 128 != 0) and as [V, D]
def test_bfloat16_no_worse_than_dense_bfloat16(d, engine):
    """d_item_weight comes back in the table's dtype (accumulated in float32, rounded once, like
    the dense bf16 product); rows, d_hidden and d_bias in float32."""
    inputs = make_inputs(7, 300, 1000, d, 6, dtype=jnp.bfloat16)
    rows, predicted, hits, *grads = run_kernels(inputs, BlockSizes(block_n=128, block_v=256), engine)
    truth = oracle(*inputs)
    dense = dense_bf16(*inputs)
    for key, got, ref in zip(("rows", *GRADS), (rows, *grads), dense):
        assert got.dtype == (jnp.bfloat16 if key == "d_item_weight" else jnp.float32), key
        assert_close(got, ref, truth[key], dtype="bfloat16", name=f"bf16/{key}")
    check_counts("bf16", dict(predicted=predicted, hits=hits), truth, band=1e-3)


def test_default_block_sizes_and_eager_call():
    """block_sizes=None derives tiles (portable chip on CPU); outside jit, platform_dependent
    resolves to the interpreter eagerly. compute_counts=False returns no counts; with L = 0,
    hits are 0."""
    hidden, item_weight, ids, bias, cw, pw, g = make_inputs(3, 70, 300, 16, 2)
    rows, predicted, hits = pallas_forward(hidden, item_weight, ids, bias, cw, pw,
                                                      compute_counts=False)
    assert predicted is None and hits is None
    assert_rows("default/rows", rows, oracle(hidden, item_weight, ids, bias, cw, pw, g)["rows"])
    d_hidden, d_item_weight, d_bias = pallas_backward(hidden, item_weight, ids, None, cw,
                                                                 pw, g)
    assert d_bias is None
    truth = oracle(hidden, item_weight, ids, None, cw, pw, g)
    assert_close(d_hidden, truth["d_hidden"], dtype="float32", name="default/d_hidden")
    assert_close(d_item_weight, truth["d_item_weight"], dtype="float32", name="default/d_item_weight")
    no_slots = np.zeros((70, 0), np.int32)
    _, predicted, hits = pallas_forward(hidden, item_weight, no_slots, bias, cw, pw,
                                                   compute_counts=True)
    np.testing.assert_array_equal(hits, np.zeros(70))
    assert predicted.shape == (70,)
    # The one-pass launcher eagerly, without counts, bias or ids.
    truth = oracle(hidden, item_weight, no_slots, None, cw, pw, g)
    rows, predicted, hits, d_hidden, _, d_bias = pallas_value_and_grad(
        hidden, item_weight, no_slots, None, cw, pw, g, compute_counts=False)
    assert predicted is None and hits is None and d_bias is None
    assert_rows("default/one_pass/rows", rows, truth["rows"])
    assert_close(d_hidden, truth["d_hidden"], dtype="float32", name="default/one_pass/d_hidden")
