"""Rung L2: the Pallas background kernels (interpret mode on CPU) against a float64 dense oracle.

The kernels compute only the dense background of CutBCE (no targets):
    row_bg[n] = sum_v cw[v] softplus(z[n, v]),  count_pos[n] = sum_v (z[n, v] > 0),
    dz = g[n] cw[v] sigmoid(z[n, v]) -> d_hidden, d_item_weight, d_bias,
with z = hidden @ item_weight.T + bias. The oracle below evaluates those formulas in float64 numpy
on the same (already rounded) inputs. Shapes are deliberately odd: N, V and D are multiples of no
block, N can be smaller than one block, and the last item tile is ragged, so the masking of items
past V and the padding of rows are both exercised (in interpret mode Pallas fills out-of-bounds
block rows with NaN, so a missing mask shows up as NaN here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kernels.block_sizes import (
    CHIPS,
    PORTABLE_CHIP,
    BlockSizes,
    default_block_sizes,
    vmem_estimate_bytes,
)
from jax_kernels.pallas_background import pallas_background_backward, pallas_background_forward

# Relative error = max |fast - truth| / max |truth|. float32 must match the float64 truth to 1e-5;
# bfloat16 must be no worse than a dense bfloat16 computation plus this margin (DESIGN.md sec. 2).
F32_RTOL = 1e-5
BF16_MARGIN = 1e-3
OUTPUTS = ("row_bg", "d_hidden", "d_item_weight", "d_bias")


def assert_close(name, fast, truth, rtol, reference=None):
    """Fail with the max error, where it is, and the fast / reference / truth values there."""
    fast = np.asarray(fast, np.float64)
    truth = np.asarray(truth, np.float64)
    assert fast.shape == truth.shape, f"{name}: shape {fast.shape} != {truth.shape}"
    err = np.abs(fast - truth)
    where = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err))), err.shape)
    rel = float(np.max(np.where(np.isnan(err), np.inf, err)) / max(np.max(np.abs(truth)), 1e-30))
    ref_txt = "" if reference is None else f" reference={np.asarray(reference, np.float64)[where]!r}"
    assert rel <= rtol, (
        f"{name}: relative max error {rel:.3e} > {rtol:.1e} at {where}: fast={fast[where]!r}"
        f"{ref_txt} truth={truth[where]!r}"
    )


def oracle(hidden, item_weight, bias, class_weight, g):
    """Float64 dense truth: (row_bg, count_pos, d_hidden, d_item_weight, d_bias, |z|)."""
    h = np.asarray(hidden, np.float64)
    w = np.asarray(item_weight, np.float64)
    z = h @ w.T
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    cw = 1.0 if class_weight is None else np.asarray(class_weight, np.float64)
    row_bg = (np.logaddexp(0.0, z) * cw).sum(axis=1)
    count = (z > 0).sum(axis=1).astype(np.float64)
    # sigmoid via tanh: no overflow warning at |z| ~ 50.
    dz = np.asarray(g, np.float64)[:, None] * cw * (0.5 * (1.0 + np.tanh(0.5 * z)))
    return row_bg, count, dz @ w, dz.T @ h, dz.sum(axis=0), np.abs(z)


def make_inputs(seed, n, v, d, *, dtype=np.float32, bias=True, class_weight=True, logit_scale=4.0):
    """Random inputs whose logits have standard deviation about `logit_scale`, and a random,
    non-uniform upstream gradient with a few exact zeros (padded positions)."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(n, d)) * (logit_scale / np.sqrt(d))
    item_weight = rng.normal(size=(v, d))
    b = rng.normal(size=v).astype(np.float32) if bias else None
    cw = rng.uniform(0.25, 2.0, size=v).astype(np.float32) if class_weight else None
    g = rng.normal(size=n).astype(np.float32)
    g[rng.random(n) < 0.1] = 0.0
    cast = (lambda x: jnp.asarray(x, jnp.bfloat16)) if dtype == jnp.bfloat16 else (
        lambda x: np.asarray(x, np.float32))
    return cast(hidden), cast(item_weight), b, cw, g


def run_kernels(hidden, item_weight, bias, class_weight, g, block_sizes):
    fwd = jax.jit(pallas_background_forward, static_argnames=("compute_counts", "block_sizes"))
    bwd = jax.jit(pallas_background_backward, static_argnames=("block_sizes",))
    row_bg, count = fwd(hidden, item_weight, bias, class_weight, compute_counts=True,
                        block_sizes=block_sizes)
    d_hidden, d_item_weight, d_bias = bwd(hidden, item_weight, bias, class_weight, g,
                                          block_sizes=block_sizes)
    return row_bg, count, d_hidden, d_item_weight, d_bias


def check_counts(count, truth_count, abs_z, band):
    """Counts of z > 0 are exact except for logits within `band` of 0, where float32 rounding
    may flip the sign; allow one miscount per such item."""
    count = np.asarray(count, np.float64)
    ambiguous = (abs_z < band).sum(axis=1)
    bad = np.abs(count - truth_count) > ambiguous
    assert not bad.any(), (
        f"count_pos off at rows {np.flatnonzero(bad)[:5]}: fast={count[bad][:5]} "
        f"truth={truth_count[bad][:5]} ambiguous={ambiguous[bad][:5]}"
    )


# (n, v, d, bias, class_weight, logit_scale, block_n, block_v): grids stay small (<= 3 x 4) for
# interpret-mode speed.
F32_CASES = {
    "ragged_n_v_d": (300, 1000, 72, True, True, 4.0, 128, 256),
    "n_below_block_no_bias_no_cw": (37, 700, 40, False, False, 4.0, 128, 512),
    "v_multiple_of_block_cw_only": (256, 512, 128, False, True, 4.0, 128, 256),
    "bias_only_single_tile": (90, 333, 33, True, False, 4.0, 128, 384),
    "logits_near_50": (200, 600, 24, True, True, 50.0, 128, 256),
}


@pytest.mark.parametrize("case", sorted(F32_CASES))
def test_float32_matches_float64_oracle(case):
    n, v, d, bias, cw, scale, block_n, block_v = F32_CASES[case]
    inputs = make_inputs(sorted(F32_CASES).index(case), n, v, d, bias=bias, class_weight=cw, logit_scale=scale)
    fast = run_kernels(*inputs, BlockSizes(block_n=block_n, block_v=block_v))
    truth = oracle(*inputs)
    if scale > 10:  # really exercise |z| ~ 50
        assert truth[5].max() > 40.0
    for name, got, want in zip(OUTPUTS, (fast[0], *fast[2:]), (truth[0], *truth[2:4], truth[4])):
        if name == "d_bias" and not bias:
            assert got is None
            continue
        assert got.dtype == jnp.float32, name
        assert_close(f"{case}/{name}", got, want, F32_RTOL)
    check_counts(fast[1], truth[1], truth[5], band=1e-4 * scale)


def dense_bf16(hidden, item_weight, bias, class_weight, g):
    """The same math run densely in bfloat16: the yardstick of the bf16 rule."""
    bf = jnp.bfloat16
    z = hidden @ item_weight.T + jnp.asarray(bias, bf)
    cw = jnp.asarray(class_weight, bf)
    row_bg = (jax.nn.softplus(z) * cw).sum(axis=1)
    dz = jnp.asarray(g, bf)[:, None] * cw * jax.nn.sigmoid(z)
    return row_bg, dz @ item_weight, dz.T @ hidden, dz.sum(axis=0)


def test_bfloat16_no_worse_than_dense_bfloat16():
    inputs = make_inputs(7, 300, 1000, 72, dtype=jnp.bfloat16)
    fast = run_kernels(*inputs, BlockSizes(block_n=128, block_v=256))
    truth = oracle(*inputs)
    dense = jax.jit(dense_bf16)(*inputs)
    for name, got, ref, want in zip(
        OUTPUTS, (fast[0], *fast[2:]), dense, (truth[0], truth[2], truth[3], truth[4])
    ):
        assert got.dtype == jnp.float32, name
        ref_err = np.abs(np.asarray(ref, np.float64) - want).max() / np.abs(want).max()
        assert_close(f"bf16/{name}", got, want, ref_err + BF16_MARGIN, reference=ref)
    check_counts(fast[1], truth[1], truth[5], band=1e-3)


def test_default_block_sizes_and_eager_call():
    """block_sizes=None derives tiles (portable chip on CPU); outside jit, platform_dependent
    resolves to the interpreter eagerly."""
    hidden, item_weight, bias, cw, g = make_inputs(3, 70, 300, 16)
    row_bg, count = pallas_background_forward(hidden, item_weight, bias, cw, compute_counts=False)
    assert count is None
    d_hidden, d_item_weight, d_bias = pallas_background_backward(hidden, item_weight, None, cw, g)
    assert d_bias is None
    truth = oracle(hidden, item_weight, bias, cw, g)
    assert_close("default/row_bg", row_bg, truth[0], F32_RTOL)
    truth_nb = oracle(hidden, item_weight, None, cw, g)
    assert_close("default/d_hidden", d_hidden, truth_nb[2], F32_RTOL)
    assert_close("default/d_item_weight", d_item_weight, truth_nb[3], F32_RTOL)


def test_unsupported_dtypes_raise_type_error():
    h64, w64 = np.zeros((4, 8)), np.zeros((16, 8))  # numpy float64: no jax x64 needed
    with pytest.raises(TypeError, match="float64"):
        pallas_background_forward(h64, w64, None, None, compute_counts=False)
    with pytest.raises(TypeError, match="float64"):
        pallas_background_backward(h64, w64, None, None, np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="float16"):
        pallas_background_forward(h64.astype(np.float16), w64.astype(np.float16), None, None,
                                  compute_counts=False)
    with pytest.raises(TypeError, match="must match"):
        pallas_background_forward(h64.astype(np.float32), jnp.zeros((16, 8), jnp.bfloat16), None,
                                  None, compute_counts=False)
    with pytest.raises(ValueError, match="bias"):
        pallas_background_forward(h64.astype(np.float32), w64.astype(np.float32),
                                  np.zeros(15, np.float32), None, compute_counts=False)


def test_block_sizes_validate_and_hash():
    with pytest.raises(ValueError, match="block_v=100"):
        BlockSizes(block_n=128, block_v=100)
    with pytest.raises(ValueError, match="block_n=8"):
        BlockSizes(block_n=8, block_v=128)
    with pytest.raises(ValueError, match="vmem_limit_bytes"):
        BlockSizes(block_n=128, block_v=128, vmem_limit_bytes=10)
    with pytest.raises(TypeError, match="block_n"):
        BlockSizes(block_n=128.0, block_v=128)
    a, b = BlockSizes(256, 512, 32 << 20), BlockSizes(256, 512, 32 << 20)
    assert a == b and hash(a) == hash(b)
    assert a.clipped(n=10, v=300) == BlockSizes(128, 384, 32 << 20)
    with pytest.raises(ValueError, match="chip"):
        default_block_sizes(100, 100, 64, jnp.float32, chip="v9")


@pytest.mark.parametrize("chip", sorted(CHIPS))
def test_default_block_sizes_fit_the_chip(chip):
    spec = CHIPS[chip]
    for n, v, d, dtype in [(8192, 876939, 256, jnp.float32), (1000, 100000, 64, jnp.bfloat16),
                           (1100, 1000, 96, jnp.bfloat16), (1, 50, 512, jnp.float32)]:
        bs = default_block_sizes(n, v, d, dtype, chip=chip)
        assert bs.vmem_limit_bytes == spec.vmem_limit_bytes < spec.vmem_bytes
        assert vmem_estimate_bytes(bs.block_n, bs.block_v, d, dtype) <= bs.vmem_limit_bytes
        assert bs.block_n % 128 == 0 and bs.block_v % 128 == 0
        if bs.block_v >= spec.mxu_width:
            assert bs.block_v % spec.mxu_width == 0, bs
        # balanced and clipped: never more than one tile's alignment of padding
        assert bs.block_n < n + 128 and bs.block_v < v + max(spec.mxu_width, 128)
    # N = 1100: two balanced tiles of 640 rows, not 2 x 1024.
    if spec.vmem_bytes >= 64 << 20 and spec.cores_per_device == 1:
        assert default_block_sizes(1100, 10**6, 128, jnp.bfloat16, chip=chip).block_n == 640
    assert default_block_sizes(10, 10, 8, jnp.float32, chip=PORTABLE_CHIP).block_n == 128


CALL_JAX_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch  # torch and torch_xla before jax
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import numpy as np
    from jax_kernels.block_sizes import BlockSizes
    from jax_kernels.pallas_background import (
        pallas_background_backward, pallas_background_forward)

    BS = BlockSizes(block_n=128, block_v=256)

    def forward(h, w, b, c):  # module level: call_jax caches by id(fn)
        return pallas_background_forward(h, w, b, c, compute_counts=True, block_sizes=BS)

    def backward(h, w, b, c, g):
        return pallas_background_backward(h, w, b, c, g, block_sizes=BS)

    rng = np.random.default_rng(0)
    n, v, d = 200, 600, 40
    h = (rng.normal(size=(n, d)) * 0.5).astype(np.float32)
    w = rng.normal(size=(v, d)).astype(np.float32)
    b = rng.normal(size=v).astype(np.float32)
    c = rng.uniform(0.5, 2, size=v).astype(np.float32)
    g = rng.normal(size=n).astype(np.float32)
    dev = torch_xla.device()
    t = lambda x: torch.from_numpy(x).to(dev)
    row_bg, count = xb.call_jax(forward, (t(h), t(w), t(b), t(c)))
    grads = xb.call_jax(backward, (t(h), t(w), t(b), t(c), t(g)))
    torch_xla.sync()
    z = h.astype(np.float64) @ w.T.astype(np.float64) + b
    dz = g[:, None] * c / (1 + np.exp(-z))
    pairs = [(row_bg, (np.logaddexp(0, z) * c).sum(1)), (count, (z > 0).sum(1)),
             (grads[0], dz @ w), (grads[1], dz.T @ h), (grads[2], dz.sum(0))]
    for got, want in pairs:
        got = got.cpu().numpy().astype(np.float64)
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-5, rel
    print("CALL_JAX_OK")
    """
)


@pytest.mark.xla
def test_kernels_through_torch_xla_call_jax():
    """The same kernels lowered by torch_xla's call_jax on PJRT_DEVICE=CPU pick the interpreter
    (platform_dependent sees the CPU lowering platform). A subprocess, because torch_xla must be
    imported before jax and call_jax changes global JAX config."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", CALL_JAX_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "CALL_JAX_OK" in proc.stdout, proc.stderr[-4000:]
