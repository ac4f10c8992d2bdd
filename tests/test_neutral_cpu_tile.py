"""The CPU tile kernel (`cutbce_common/cpu_tile.c`) through both of its bindings, against float64.

- torch (ctypes, `fused_tile`) and JAX (XLA FFI, `negative_tile`): rows, rows + gradient and
  gradient of random tiles with the special values the engines feed it (positives taken out at -inf,
  +inf, NaN, 0, exp(-|z|) underflowing to subnormals and to 0), with and without a column weight,
  the gradient written over the logits or beside them; hypothesis draws the tiles.
- exp(-|z|) and the division, through the gradient sigmoid(z): as exact as torch's float32
  sigmoid, subnormal results within one subnormal step.
- Where the kernel runs: the jitted one-pass loop calls it on the CPU and copies no tile; a TPU or
  CUDA lowering never does (it would name a target those platforms lack).
- Without it (no compiler): one warning, and the portable tiles give the same results.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cutbce_common import cpu_tile_build
from parity import TOLERANCES, assert_close
from torch_cutbce.native import fused_tile

pytestmark = pytest.mark.skipif(fused_tile._cpu_library() is None, reason="no C compiler: the kernel is not built")
pytestmark = [pytestmark, pytest.mark.rung1]


@pytest.fixture(autouse=True)
def _the_c_kernel(monkeypatch):
    """These tests are about the C kernel, whichever tile this machine's tuning chose."""
    monkeypatch.setenv("TORCH_CUTBCE_TILE", "c_kernel")

SPECIALS = [float("-inf"), float("inf"), float("nan"), 0.0, -0.0, -88.0, -95.0, -103.9, -104.5, -1e4, 1e4]


def _truth(z, g, cw):
    """float64 `(rows [n], dz [n, v])` of a tile of negatives."""
    z64 = torch.as_tensor(z, dtype=torch.float64)
    w = torch.ones(z64.shape[1], dtype=torch.float64) if cw is None else torch.as_tensor(cw, dtype=torch.float64)
    loss = z64.clamp(min=0) + torch.log1p(torch.exp(-z64.abs()))
    return (loss * w).sum(-1).numpy(), (torch.sigmoid(z64) * w * torch.as_tensor(g, dtype=torch.float64)[:, None]).numpy()


def _check(rows, dz, z, g, cw, name):
    truth_rows, truth_dz = _truth(z, g, cw)
    if rows is not None:
        assert_close(rows, truth_rows, dtype="float32", name=f"{name} rows", elementwise=True)
    if dz is not None:
        dz = np.asarray(dz, dtype=np.float64)
        assert_close(dz, truth_dz, dtype="float32", name=f"{name} dz")
        taken_out = np.isneginf(z)
        assert (dz[taken_out] == 0).all(), f"{name}: a positive taken out (-inf) must get gradient 0"


@st.composite
def tiles(draw):
    n, v = draw(st.integers(1, 40)), draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, v)) * draw(st.sampled_from([1.0, 8.0, 40.0]))).astype(np.float32)
    special = rng.random((n, v)) < draw(st.sampled_from([0.0, 0.05, 0.3]))
    z[special] = rng.choice(np.array(SPECIALS, np.float32), size=int(special.sum()))
    g = (rng.random(n) * 2 - 0.5).astype(np.float32)  # non-uniform, negatives and zeros possible
    cw = None if draw(st.booleans()) else (rng.random(v) * 3 * (rng.random(v) > 0.1)).astype(np.float32)
    return z, g, cw


def _torch_kernel(z, g, cw, in_place):
    zt, gt = torch.from_numpy(z.copy()), torch.from_numpy(g).unsqueeze(-1)
    cwt = None if cw is None else torch.from_numpy(cw).unsqueeze(0)
    out = zt if in_place else torch.full_like(zt, float("nan"))
    rows = fused_tile.rows(zt.clone(), cwt)
    rows_grad = fused_tile.rows_grad(zt, cwt, gt, out=out)
    z2 = torch.from_numpy(z.copy())
    fused_tile.grad(z2, cwt, gt, out=z2 if in_place else torch.empty_like(z2))
    if not in_place:
        assert np.array_equal(zt.numpy(), z, equal_nan=True), "the logits must be left alone when out is not z"
    return rows.numpy(), rows_grad.numpy(), out.numpy(), fused_tile.counts(torch.from_numpy(z.copy())).numpy()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tile=tiles(), in_place=st.booleans())
def test_torch_binding_matches_float64(tile, in_place):
    z, g, cw = tile
    rows, rows_grad, dz, counts = _torch_kernel(z, g, cw, in_place)
    _check(rows, None, z, g, cw, "rows")
    _check(rows_grad, dz, z, g, cw, "rows_grad")
    np.testing.assert_array_equal(counts, (z > 0).sum(-1))


def test_sigmoid_is_as_exact_as_torchs_float32_sigmoid_subnormals_included():
    """exp(-|z|) and the division, through dz = sigmoid(z) for z in [-104, 0] (2M points): within
    the float32 error of torch.sigmoid (the dense loss's; about 2.35 ulp at most, 0.38 on average
    here), and where the result is subnormal within one subnormal step (torch flushes those to 0)."""
    z = np.concatenate([-np.linspace(0, 104, 2_000_001), [-np.inf]]).astype(np.float32)[None, :]
    dz = np.empty_like(z)
    fused_tile.grad(torch.from_numpy(z), None, torch.ones(1, 1), out=torch.from_numpy(dz))
    z64 = z.astype(np.float64)
    truth = np.exp(z64) / (1 + np.exp(z64))
    dense = torch.sigmoid(torch.from_numpy(z)).numpy()
    normal = truth >= np.finfo(np.float32).tiny
    ulp = np.spacing(truth.astype(np.float32)).astype(np.float64)
    ulps = {name: (np.abs(x.astype(np.float64) - truth) / ulp)[normal] for name, x in (("kernel", dz), ("dense", dense))}
    assert ulps["kernel"].max() <= max(ulps["dense"].max(), 2.5)
    assert ulps["kernel"].mean() <= ulps["dense"].mean()
    assert np.abs(dz.astype(np.float64) - truth)[~normal].max() <= np.finfo(np.float32).smallest_subnormal
    assert dz[0, -1] == 0.0  # -inf: a positive taken out


# -- JAX: the FFI binding ---------------------------------------------------------------------------------


@pytest.mark.jax
@settings(max_examples=40, deadline=None, derandomize=True)
@given(tile=tiles())
def test_jax_binding_matches_float64(tile):
    import jax
    import jax.numpy as jnp

    from jax_kernels.blocked import negative_tile

    if not negative_tile._ffi_registered():
        pytest.skip("the FFI kernel could not be built here")
    z, g, cw = tile
    w = np.ones(z.shape[1], np.float32) if cw is None else cw
    tile = negative_tile.NegativeTile()
    rows = jax.jit(tile.rows)(jnp.asarray(z), jnp.asarray(w))
    rows_grad, dz = jax.jit(tile.rows_grad)(jnp.asarray(z), jnp.asarray(w), jnp.asarray(g))
    dz_only = jax.jit(tile.grad)(jnp.asarray(z), jnp.asarray(w), jnp.asarray(g))
    _check(np.asarray(rows), None, z, g, w, "jax rows")
    _check(np.asarray(rows_grad), np.asarray(dz), z, g, w, "jax rows_grad")
    _check(None, np.asarray(dz_only), z, g, w, "jax grad")


def _one_pass_loss(impl_kwargs=None):
    import jax.numpy as jnp

    from cutbce_common.options import CutBCEOptions
    from jax_kernels import core

    n, v, d = 64, 700, 16  # two tiles of 512, the second shifted back (overlap weighted 0)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    e = jnp.asarray(rng.standard_normal((v, d)), jnp.float32)
    t = jnp.asarray(rng.integers(-1, v, (n, 4)), jnp.int32)
    place = core.OneDevice(CutBCEOptions(block_v=512, impl="blocked"))

    def loss(h, e):
        return core.cut_bce_weighted_sum(place, h, e, t, None, None, None, jnp.full((n,), 1.0 / n))[0]

    return loss, (h, e)


@pytest.mark.jax
def test_the_jitted_cpu_loop_calls_the_kernel_and_copies_no_tile():
    import jax

    from jax_kernels.blocked import negative_tile

    if not negative_tile._ffi_registered():
        pytest.skip("the FFI kernel could not be built here")
    loss, args = _one_pass_loss()
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    assert "cutbce_rows_grad" in text
    copies = [line for line in text.splitlines() if "f32[64,512]" in line and " copy(" in line]
    assert not copies, "a logits tile is copied each iteration:\n" + "\n".join(copies)


@pytest.mark.jax
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_other_platforms_lower_the_portable_tile(platform):
    import jax
    import jax.export  # noqa: F401  (not imported by `import jax`)

    loss, args = _one_pass_loss()
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), platforms=[platform])(*shapes)
    assert "cutbce_" not in exported.mlir_module()


# -- without the kernel ------------------------------------------------------------------------------------


def test_torch_falls_back_with_one_warning_when_the_kernel_cannot_be_built(monkeypatch):
    def no_compiler(*_):  # c_library(warning)
        raise cpu_tile_build.BuildError("no C compiler found")

    z, g, cw = _fixed_tile()
    expected = _torch_kernel(z, g, cw, in_place=False)
    monkeypatch.setattr(cpu_tile_build, "c_library", no_compiler)
    monkeypatch.setattr(fused_tile, "_compile_failed", False)  # whatever happens here stays here
    fused_tile._cpu_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="CPU tile kernel could not be built"):
            assert not fused_tile.writes_grad_in_place(torch.float32, torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="torch_cutbce: the CPU tile kernel")  # said once
            warnings.simplefilter("ignore", fused_tile.TileCompileWarning)
            fallback = _torch_kernel(z, g, cw, in_place=False)  # torch.compile's tiles
    finally:
        fused_tile._cpu_library.cache_clear()
    for got, want in zip(fallback, expected):
        np.testing.assert_allclose(got, want, rtol=TOLERANCES["float32"], equal_nan=True)


@pytest.mark.jax
def test_jax_falls_back_with_one_warning_when_the_kernel_cannot_be_built(monkeypatch):
    import jax

    from jax_kernels.blocked import negative_tile

    loss, args = _one_pass_loss()
    expected = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)

    def no_compiler(include_dir, *_):  # ffi_library(include_dir, warning)
        raise cpu_tile_build.BuildError("no C++ compiler found")

    monkeypatch.setattr(cpu_tile_build, "ffi_library", no_compiler)
    negative_tile._ffi_registered.cache_clear()
    fresh_loss, _ = _one_pass_loss()  # a new function: jit would reuse the trace of `loss`
    try:
        with pytest.warns(UserWarning, match="CPU tile kernel could not be built"):
            compiled = jax.jit(jax.value_and_grad(fresh_loss, argnums=(0, 1))).lower(*args).compile()
        assert "cutbce_" not in compiled.as_text()
        got = compiled(*args)
    finally:
        negative_tile._ffi_registered.cache_clear()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOLERANCES["float32"], atol=1e-7)


def _fixed_tile():
    rng = np.random.default_rng(5)
    z = (rng.standard_normal((9, 37)) * 10).astype(np.float32)
    z[0, :len(SPECIALS)] = SPECIALS
    return z, rng.random(9).astype(np.float32), rng.random(37).astype(np.float32)


def test_the_library_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_CUTBCE_CACHE_DIR", str(tmp_path))
    compiler = cpu_tile_build._compiler("CC", ("cc", "gcc", "clang"))
    first = cpu_tile_build._build("cpu_tile.c", compiler, ["-std=c99"])
    stamp = first.stat().st_mtime_ns
    assert cpu_tile_build._build("cpu_tile.c", compiler, ["-std=c99"]) == first
    assert first.stat().st_mtime_ns == stamp and first.parent == tmp_path
    # the library and its digest, no temporary left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]


def test_build_failures_are_build_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_CUTBCE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/bin/false")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # issue 39: no build is announced for a compiler that is none
        with pytest.raises(cpu_tile_build.BuildError, match=r"^\$CC='/bin/false' is not a working C compiler: "
                                                           r"`false -O3 -march=\S+ \.\.\. -x c -` .* exited with "
                                                           r"status 1, printing nothing$"):
            cpu_tile_build._build("cpu_tile.c", "/bin/false", [])  # a compiler that exits 1
    assert not any((tmp_path / "cache").iterdir())
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("TORCH_CUTBCE_CACHE_DIR", str(blocked / "cache"))
    with pytest.raises(cpu_tile_build.BuildError, match="TORCH_CUTBCE_CACHE_DIR"):
        cpu_tile_build._build("cpu_tile.c", "/bin/false", [])
    monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")
    with pytest.raises(cpu_tile_build.BuildError, match="TORCH_CUTBCE_NO_COMPILE"):
        cpu_tile_build._compiler("CC", ("cc",))


def test_no_compile_switches_the_kernel_off_call_by_call(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")
    assert not fused_tile.writes_grad_in_place(torch.float32, cpu)
    monkeypatch.delenv("TORCH_CUTBCE_NO_COMPILE")
    assert fused_tile.writes_grad_in_place(torch.float32, cpu)  # not remembered from the call above
