"""Which float32 CPU tile runs: the candidate measured fastest, cached per machine, forced by
`TORCH_CUTBCE_TILE`; with injected timings, so nothing here depends on the machine's speed.

Every candidate computes the same tile to the same tolerance (tests/test_neutral_cpu_tile.py and the
wide-row checks of tests/test_neutral_cpu_tile_row_sums.py), so the choice only moves time.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from jax_kernels.neutral import tile_choice
from torch_cutbce import fused_tile

pytestmark = pytest.mark.rung1


def _fake(ms, calls, name):
    def measure():
        calls.append(name)
        return ms

    return measure


@pytest.mark.parametrize("dtype, no_compile", [(torch.float64, "0"), (torch.float32, "1"), (torch.bfloat16, "0")])
def test_a_bad_tile_value_is_an_error_on_every_path(monkeypatch, dtype, no_compile):
    """Issue 31: a bad TORCH_CUTBCE_TILE was silently ignored for float64 inputs and under
    TORCH_CUTBCE_NO_COMPILE=1 (the paths that never read it)."""
    from torch_cutbce import cut_bce_with_logits

    monkeypatch.setenv(tile_choice.ENV, "fastest")
    monkeypatch.setenv("TORCH_CUTBCE_NO_COMPILE", no_compile)
    hidden, items = torch.randn(3, 4, dtype=dtype), torch.randn(7, 4, dtype=dtype)
    with pytest.raises(ValueError, match=r"TORCH_CUTBCE_TILE='fastest': expected 'auto' or one of"):
        cut_bce_with_logits(hidden, items, torch.tensor([[1], [2], [-1]]), backend="native")


@pytest.mark.parametrize("timings, want", [
    ({"c_kernel": 2.0, "compiled": 1.0, "eager": 3.0}, "compiled"),
    ({"c_kernel": 0.5, "compiled": 1.0, "eager": 3.0}, "c_kernel"),
    ({"c_kernel": 9.0, "compiled": 8.0, "eager": 3.0}, "eager"),
    ({"c_kernel": 1.0, "compiled": 1.0}, "c_kernel"),  # a tie keeps the first listed
    ({"c_kernel": 1.0, "compiled": 0.95, "eager": 3.0}, "c_kernel"),  # so does a near tie (within MARGIN)
    ({"c_kernel": 1.0, "compiled": 0.85, "eager": 0.8}, "compiled"),  # eager: not 10% faster than compiled
])
def test_the_measured_fastest_candidate_is_chosen_and_cached(timings, want, tmp_path):
    calls = []
    path = tmp_path / "choice.json"
    choice = tile_choice.cached_choice(path, {name: _fake(ms, calls, name) for name, ms in timings.items()})
    assert choice.name == want and choice.measured_now and sorted(calls) == sorted(timings)
    assert json.loads(path.read_text()) == {"choice": want, "timings_ms": timings}
    again = tile_choice.cached_choice(path, {name: _fake(ms, calls, name) for name, ms in timings.items()})
    assert again.name == want and not again.measured_now and len(calls) == len(timings)  # not measured again


def test_measuring_is_said_before_it_starts_and_only_when_it_happens(tmp_path):
    order = []
    candidates = {"c_kernel": lambda: order.append("measured") or 1.0}
    for _ in range(2):  # the second finds the choice cached: neither measured nor said
        tile_choice.cached_choice(tmp_path / "c.json", candidates, lambda: order.append("said"))
    assert order == ["said", "measured"]


def test_a_candidate_that_fails_to_run_drops_out(tmp_path):
    def broken():
        raise RuntimeError("no compiler")

    choice = tile_choice.cached_choice(tmp_path / "c.json", {"compiled": broken, "eager": lambda: 5.0})
    assert choice.name == "eager"


@pytest.mark.parametrize("content", ["not json", '{"choice": "gone", "timings_ms": {}}', "[]"])
def test_an_unreadable_or_stale_cache_is_measured_again(content, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(content)
    choice = tile_choice.cached_choice(path, {"c_kernel": lambda: 2.0, "eager": lambda: 1.0})
    assert choice.name == "eager" and choice.measured_now


def test_an_unwritable_cache_keeps_the_choice_for_the_process(tmp_path):
    choice = tile_choice.cached_choice(tmp_path / "missing" / "c.json", {"c_kernel": lambda: 1.0, "eager": lambda: 2.0})
    assert choice.name == "c_kernel"


def test_the_environment_forces_a_candidate(monkeypatch):
    monkeypatch.setenv(tile_choice.ENV, "eager")
    assert tile_choice.forced(fused_tile.TILES) == "eager"
    monkeypatch.setenv(tile_choice.ENV, "auto")
    assert tile_choice.forced(fused_tile.TILES) is None
    monkeypatch.setenv(tile_choice.ENV, "fastest")
    with pytest.raises(ValueError, match=r"TORCH_CUTBCE_TILE='fastest': expected 'auto' or one of"):
        tile_choice.forced(fused_tile.TILES)


@pytest.mark.parametrize("timings, want", [
    ({"c_kernel": 3.0, "compiled": 1.0, "eager": 2.0}, "compiled"),
    ({"c_kernel": 1.0, "compiled": 3.0, "eager": 2.0}, "c_kernel"),
    ({"c_kernel": 3.0, "compiled": 2.0, "eager": 1.0}, "eager"),
])
def test_torch_runs_the_candidate_measured_fastest(timings, want, tmp_path, monkeypatch):
    """fused_tile's own timing of a candidate replaced by injected timings: the engines then run that tile
    (and write the gradient over the logits only with the C kernel); the timing is said before it
    starts, the choice after."""
    if fused_tile._cpu_library() is None:
        pytest.skip("no C compiler: only torch.compile's and the eager tile are candidates")
    monkeypatch.delenv(tile_choice.ENV, raising=False)
    monkeypatch.setattr(fused_tile, "_time_candidate", lambda tile: timings[tile])
    monkeypatch.setattr(fused_tile.cpu_tile_build, "library_path", lambda lib: tmp_path / "cpu_tile-x.so")
    ran = []
    monkeypatch.setattr(fused_tile, "_run_cpu_kernel", _recording(fused_tile._run_cpu_kernel, "c_kernel", ran))
    monkeypatch.setattr(fused_tile, "_run_compiled", _recording(fused_tile._run_compiled, "compiled", ran))
    monkeypatch.setitem(fused_tile._EAGER, "rows_grad", _recording(fused_tile._EAGER["rows_grad"], "eager", ran))
    fused_tile._measured_cpu_tile.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fused_tile._plain_cpu_tile() == want
        said = [str(w.message) for w in caught if w.category is fused_tile.TileCompileWarning]
        assert len(said) == 2, said  # before timing (it compiles), then the result
        assert "timing the float32 CPU tiles (c_kernel, compiled, eager)" in said[0], said
        assert f"float32 CPU tiles use '{want}': measured now" in said[1], said
        assert fused_tile.writes_grad_in_place(torch.float32, torch.device("cpu")) == (want == "c_kernel")
        ran.clear()
        z = torch.randn(8, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fused_tile.TileCompileWarning)
            fused_tile.rows_grad(z, None, torch.ones(8, 1), out=torch.empty_like(z))
        assert ran == [want]
    finally:
        fused_tile._measured_cpu_tile.cache_clear()  # the next test measures (or reads) the real choice


def _recording(function, name, ran):
    def run(*args, **kwargs):
        ran.append(name)
        return function(*args, **kwargs)

    return run


@pytest.mark.jax
@pytest.mark.parametrize("timings, want", [({"c_kernel": 1.0, "xla": 2.0}, "c_kernel"),
                                           ({"c_kernel": 2.0, "xla": 1.0}, "xla")])
def test_jax_runs_the_candidate_measured_fastest(timings, want, tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    from jax_kernels import cut_bce
    from jax_kernels.blocked import negative_tile

    if not negative_tile._ffi_registered():
        pytest.skip("the FFI kernel could not be built here")
    monkeypatch.delenv(tile_choice.ENV, raising=False)
    monkeypatch.setattr(negative_tile, "_time_candidate", lambda tile: timings[tile])
    monkeypatch.setattr(negative_tile.cpu_tile_build, "library_path", lambda lib: tmp_path / "cpu_tile_ffi-x.so")
    negative_tile._measured_tile.cache_clear()
    hidden, items = jnp.ones((8, 4), jnp.float32), jnp.ones((300, 4), jnp.float32)
    targets = jnp.zeros((8, 2), jnp.int32)
    try:
        with pytest.warns(tile_choice.TileChoiceWarning, match=f"use '{want}': measured now"):
            text = jax.jit(jax.grad(lambda h: cut_bce(h, items, targets, block_v=128))).lower(hidden).as_text()
        assert ("cutbce_rows_grad" in text) == (want == "c_kernel")
    finally:
        negative_tile._measured_tile.cache_clear()
