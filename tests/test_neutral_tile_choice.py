"""Which float32 CPU tile runs: the C kernel by default, with nothing timed on a call; another tile
only where `TORCH_CUTBCE_TILE` forces it or the tuning command (`python -m torch_cutbce.tune_tiles`)
measured it faster over the whole forward + backward and cached it per machine. Timings are injected
(or counted, not compared), so nothing here depends on the machine's speed.

Every candidate computes the same tile to the same tolerance (tests/test_neutral_cpu_tile.py and the
wide-row checks of tests/test_neutral_cpu_tile_row_sums.py), so the choice only moves time.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from cutbce_common import tile_choice
from torch_cutbce import tune_tiles
from torch_cutbce.native import fused_tile

pytestmark = pytest.mark.rung1

ROOT = Path(__file__).resolve().parent.parent


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


def test_the_environment_forces_a_candidate(monkeypatch):
    monkeypatch.setenv(tile_choice.ENV, "eager")
    assert tile_choice.forced(fused_tile.TILES) == "eager"
    monkeypatch.setenv(tile_choice.ENV, "auto")
    assert tile_choice.forced(fused_tile.TILES) is None
    monkeypatch.setenv(tile_choice.ENV, "fastest")
    with pytest.raises(ValueError, match=r"TORCH_CUTBCE_TILE='fastest': expected 'auto' or one of"):
        tile_choice.forced(fused_tile.TILES)


# -- the tuning: interleaved rounds, medians, the fastest with a margin, the cache ------------------------


@pytest.mark.parametrize("timings, want", [
    ({"c_kernel": 2.0, "compiled": 1.0, "eager": 3.0}, "compiled"),
    ({"c_kernel": 0.5, "compiled": 1.0, "eager": 3.0}, "c_kernel"),
    ({"c_kernel": 9.0, "compiled": 8.0, "eager": 3.0}, "eager"),
    ({"c_kernel": 1.0, "compiled": 1.0}, "c_kernel"),  # a tie keeps the first listed
    ({"c_kernel": 1.0, "compiled": 0.95, "eager": 3.0}, "c_kernel"),  # so does a near tie (within MARGIN)
    ({"c_kernel": 1.0, "compiled": 0.85, "eager": 0.8}, "compiled"),  # eager: not 10% faster than compiled
])
def test_the_fastest_keeps_the_first_listed_within_the_margin(timings, want):
    assert tile_choice.fastest(timings) == want


def _clocked(durations: dict[str, list[float]], order: list[str]):
    """Runs that advance a fake clock by their next duration (s) and record the order they ran in."""
    now = [0.0]
    left = {name: list(times) for name, times in durations.items()}

    def run(name):
        order.append(name)
        now[0] += left[name].pop(0)

    return {name: (lambda name=name: run(name)) for name in durations}, lambda: now[0]


def test_rounds_interleave_after_one_untimed_run_each_and_medians_are_kept():
    order = []
    # The first run of each (its compile) is slow and untimed; one round under load (8 s) is outvoted.
    runs, clock = _clocked({"c_kernel": [60, 1, 8, 1, 1, 1], "compiled": [90, 2, 2, 2, 8, 2]}, order)
    timings = tile_choice.interleaved_medians(runs, rounds=5, clock=clock)
    assert order == ["c_kernel", "compiled"] + ["c_kernel", "compiled"] * 5
    assert timings == {"c_kernel": 1000.0, "compiled": 2000.0}


def test_a_candidate_that_fails_drops_out():
    calls = []

    def broken():
        calls.append("compiled")
        raise RuntimeError("no compiler")

    def flaky():  # runs once, then fails in the rounds
        calls.append("eager")
        if calls.count("eager") > 1:
            raise RuntimeError("gone")

    timings = tile_choice.interleaved_medians({"c_kernel": lambda: None, "compiled": broken, "eager": flaky}, rounds=3)
    assert list(timings) == ["c_kernel"] and calls == ["compiled", "eager", "eager"]


def test_tune_writes_the_choice_the_library_reads(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "cpu_tile-x.so.torch-9.tuned.json"
    runs, clock = _clocked({"c_kernel": [0, 3, 3, 3], "eager": [0, 1, 1, 1]}, [])
    monkeypatch.setattr(tile_choice, "interleaved_medians", functools.partial(tile_choice.interleaved_medians, clock=clock))
    record = tile_choice.tune(path, runs, rounds=3, threads=2)
    assert record["choice"] == "eager" and record["method"] == tile_choice.METHOD
    assert record["timings_ms"] == {"c_kernel": 3000.0, "eager": 1000.0}
    assert json.loads(path.read_text()) == record and record["threads"] == 2 and record["rounds"] == 3
    choice = tile_choice.cached(path, fused_tile.TILES)
    assert choice is not None and choice.name == "eager" and str(path) in choice.why
    assert tile_choice.cached(path, ("c_kernel", "compiled")) is None  # a candidate that is gone


def test_tune_refuses_when_no_candidate_runs(tmp_path):
    def broken():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no tile candidate ran"):
        tile_choice.tune(tmp_path / "c.json", {"compiled": broken})
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("content", [
    None,  # no file: the default
    "not json",
    "[]",
    '{"choice": "gone", "method": "forward+backward, interleaved rounds, medians", "timings_ms": {}}',
    # the cache of the earlier timing on the first call (one [1024, 1024] tile, one sample): never read
    '{"choice": "compiled", "timings_ms": {"c_kernel": 2.0, "compiled": 1.0}}',
])
def test_no_usable_cache_means_no_choice(content, tmp_path):
    path = tmp_path / "c.tuned.json"
    if content is not None:
        path.write_text(content)
    assert tile_choice.cached(path, fused_tile.TILES) is None


def test_the_cache_sits_beside_the_build_under_a_name_the_first_call_timing_never_wrote(tmp_path):
    path = tile_choice.cache_path(tmp_path / "cpu_tile-abc.so", "torch", "2.9.0")
    assert path == tmp_path / "cpu_tile-abc.so.torch-2.9.0.tuned.json"


# -- torch: what runs --------------------------------------------------------------------------------------


def _needs_the_c_kernel():
    if fused_tile._cpu_library() is None:
        pytest.skip("no C compiler: only torch.compile's and the eager tile can run")


def _write_choice(path: Path, choice: str) -> None:
    path.write_text(json.dumps({"choice": choice, "method": tile_choice.METHOD,
                                "timings_ms": {"c_kernel": 2.0, choice: 1.0}}))


@pytest.fixture
def torch_cache(tmp_path, monkeypatch):
    """fused_tile's tuned choice read from `tmp_path` (the real one is left alone), nothing forced,
    and nothing ever timed in the process."""
    _needs_the_c_kernel()
    monkeypatch.delenv(tile_choice.ENV, raising=False)
    monkeypatch.setattr(fused_tile.cpu_tile_build, "library_path", lambda lib: tmp_path / "cpu_tile-x.so")
    monkeypatch.setattr(tune_tiles, "tuning_runs", _never("tuning_runs"))
    monkeypatch.setattr(tile_choice, "interleaved_medians", _never("interleaved_medians"))
    fused_tile._tuned_cpu_tile.cache_clear()
    yield fused_tile.tuned_path()
    fused_tile._tuned_cpu_tile.cache_clear()  # the next test reads the real choice


def _never(name):
    def called(*_, **__):
        raise AssertionError(f"{name} was called outside the tuning command")

    return called


def _ran_tiles(monkeypatch) -> list[str]:
    """The tile each plain float32 rows_grad ran, once fused_tile's runners are wrapped."""
    ran = []
    monkeypatch.setattr(fused_tile, "_run_cpu_kernel", _recording(fused_tile._run_cpu_kernel, "c_kernel", ran))
    monkeypatch.setattr(fused_tile, "_run_compiled", _recording(fused_tile._run_compiled, "compiled", ran))
    monkeypatch.setitem(fused_tile._EAGER, "rows_grad", _recording(fused_tile._EAGER["rows_grad"], "eager", ran))
    z = torch.randn(8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fused_tile.TileCompileWarning)
        fused_tile.rows_grad(z, None, torch.ones(8, 1), out=torch.empty_like(z))
    return ran


def _recording(function, name, ran):
    def run(*args, **kwargs):
        ran.append(name)
        return function(*args, **kwargs)

    return run


def test_torch_runs_the_c_kernel_by_default_without_timing_anything(torch_cache, monkeypatch):
    assert not torch_cache.exists()
    assert fused_tile._plain_cpu_tile() == "c_kernel"
    assert fused_tile.writes_grad_in_place(torch.float32, torch.device("cpu"))
    assert _ran_tiles(monkeypatch) == ["c_kernel"]


@pytest.mark.parametrize("tuned", ["compiled", "eager", "c_kernel"])
def test_torch_runs_the_tuned_choice(tuned, torch_cache, monkeypatch):
    _write_choice(torch_cache, tuned)
    monkeypatch.setattr(fused_tile, "_compiled", lambda name, threads, form=None: fused_tile._FUNCTIONS[name])
    assert fused_tile._plain_cpu_tile() == tuned
    assert fused_tile.writes_grad_in_place(torch.float32, torch.device("cpu")) == (tuned == "c_kernel")
    assert _ran_tiles(monkeypatch) == [tuned]


def test_the_environment_overrides_the_tuned_choice(torch_cache, monkeypatch):
    _write_choice(torch_cache, "eager")
    monkeypatch.setenv(tile_choice.ENV, "c_kernel")
    assert fused_tile._plain_cpu_tile() == "c_kernel"
    monkeypatch.setenv(tile_choice.ENV, "auto")
    assert fused_tile._plain_cpu_tile() == "eager"


def test_a_tuned_compiled_tile_that_cannot_compile_falls_back_to_the_c_kernel(torch_cache, monkeypatch):
    _write_choice(torch_cache, "compiled")
    monkeypatch.setattr(fused_tile, "_compile_failed", True)  # as after a failed torch.compile
    assert fused_tile._plain_cpu_tile() == "c_kernel"


def test_the_tuning_runs_time_the_whole_forward_and_backward_with_each_tile(monkeypatch):
    """`tuning_runs` (what the command times) runs the loss's forward and backward with each tile
    forced for the call only."""
    _needs_the_c_kernel()
    monkeypatch.delenv(tile_choice.ENV, raising=False)
    from torch_cutbce import tune_tiles
    from torch_cutbce.native import loop

    calls, ran = [], []
    monkeypatch.setattr(loop, "loss_and_grads", _recording(loop.loss_and_grads, "loss and grads", calls))
    monkeypatch.setattr(fused_tile, "_run_cpu_kernel", _recording(fused_tile._run_cpu_kernel, "c_kernel", ran))
    for name in ("rows", "rows_grad", "grad"):
        monkeypatch.setitem(fused_tile._EAGER, name, _recording(fused_tile._EAGER[name], "eager", ran))
    runs = tune_tiles.tuning_runs(16, 300, 8, 2, tiles=("c_kernel", "eager"))
    assert list(runs) == ["c_kernel", "eager"]
    for tile, run in runs.items():
        calls.clear(), ran.clear()
        run()
        assert calls == ["loss and grads"] and ran and set(ran) == {tile}, (tile, ran)
        assert os.environ.get(tile_choice.ENV) is None  # forced for the call only
    broken = tune_tiles.tuning_runs(16, 300, 8, 2, tiles=("compiled",))
    monkeypatch.setattr(fused_tile, "_compile_failed", True)  # 'compiled' cannot run: the run says so
    with pytest.raises(RuntimeError, match="'compiled' tile did not run"):
        broken["compiled"]()


def test_the_tuning_command_writes_a_choice_the_next_process_reads(tmp_path):
    """`python -m torch_cutbce.tune_tiles` end to end at a tiny shape (two candidates: no torch.compile
    here), then a fresh process that reads its choice; `--forget` goes back to the C kernel."""
    _needs_the_c_kernel()
    env = {**os.environ, "TORCH_CUTBCE_CACHE_DIR": str(tmp_path)}
    env.pop(tile_choice.ENV, None)
    env.pop("TORCH_CUTBCE_NO_COMPILE", None)
    command = [sys.executable, "-m", "torch_cutbce.tune_tiles", "--num-positions", "32", "--num-items", "300",
               "--hidden-size", "8", "--num-targets", "2", "--rounds", "2", "--tiles", "c_kernel", "eager"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (cache,) = tmp_path.glob("cpu_tile-*.so.torch-*.tuned.json")
    record = json.loads(cache.read_text())
    assert set(record["timings_ms"]) == {"c_kernel", "eager"} and record["method"] == tile_choice.METHOD
    assert f"choice: {record['choice']}; written to {cache}" in done.stdout, done.stdout
    record["choice"] = "eager"  # whichever won here, the next process runs what the file says
    cache.write_text(json.dumps(record))
    read = [sys.executable, "-c", "from torch_cutbce.native import fused_tile; print(fused_tile._plain_cpu_tile())"]
    assert subprocess.run(read, cwd=ROOT, env=env, capture_output=True, text=True).stdout.split()[-1] == "eager"
    done = subprocess.run(command[:3] + ["--forget"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not cache.exists(), done.stdout + done.stderr[-3000:]
    assert subprocess.run(read, cwd=ROOT, env=env, capture_output=True, text=True).stdout.split()[-1] == "c_kernel"


def _usage_errors(flag, value, capsys, monkeypatch) -> list[str]:
    """The tuning command's error lines for `flag value`, which must exit 2 before any tuning runs."""
    from torch_cutbce import tune_tiles

    def tune(*_):
        raise AssertionError(f"the tuning ran: {flag} {value} was not refused")

    monkeypatch.setattr(tune_tiles, "_tune", tune)
    with pytest.raises(SystemExit) as exited:
        tune_tiles.main([flag, value])
    assert exited.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if "error:" in line]


@pytest.mark.parametrize("flag, value", [("--num-items", "0"), ("--num-items", "-3"), ("--num-positions", "-1"),
                                         ("--num-targets", "-2"), ("--hidden-size", "-1"), ("--threads", "-3"),
                                         ("--rounds", "0"), ("--rounds", "2.5")])
def test_the_tuning_command_refuses_a_bad_number_before_it_runs(flag, value, capsys, monkeypatch):
    """Issue 39: a number out of range was a torch traceback from inside the tuning run (exit 1);
    now every numeric flag is a usage error at parse time (exit 2) naming the flag and the value."""
    errors = _usage_errors(flag, value, capsys, monkeypatch)
    assert errors == [f"python -m torch_cutbce.tune_tiles: error: argument {flag}: expected a positive integer, "
                      f"got '{value}'"], errors


@pytest.mark.parametrize("flag, value", [("--num-items", str(10**12)), ("--num-positions", str(10**13)),
                                         ("--num-items", str(2**70)), ("--hidden-size", str(10**12)),
                                         ("--num-targets", str(10**13))])  # round 7: D blamed --num-items
def test_the_tuning_command_refuses_sizes_too_large_to_allocate(flag, value, capsys, monkeypatch):
    """Issue 46: sizes past the machine's memory were a torch traceback from the first allocation;
    now a usage error (exit 2) naming the flag, its value and the memory, before anything runs."""
    errors = _usage_errors(flag, value, capsys, monkeypatch)
    assert len(errors) == 1 and f"error: argument {flag}: {value} is too large" in errors[0], errors
    assert "GiB, more than this machine's" in errors[0], errors


def test_the_tuning_command_says_a_bad_number_without_a_traceback(tmp_path):
    """The same as the user sees it: exit 2, usage and one error line, no traceback."""
    env = {**os.environ, "TORCH_CUTBCE_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "torch_cutbce.tune_tiles", "--dry-run", "--num-items", "0"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].endswith("argument --num-items: expected a positive integer, got '0'")
    assert done.stdout == "" and not any(tmp_path.iterdir())  # nothing built, nothing measured


# -- JAX ----------------------------------------------------------------------------------------------------


@pytest.mark.jax
@pytest.mark.parametrize("tuned", [None, "c_kernel", "xla"])
def test_jax_runs_the_c_kernel_unless_the_tuning_chose_the_jnp_tile(tuned, tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    from jax_kernels import cut_bce
    from jax_kernels.blocked import negative_tile

    if not negative_tile._ffi_registered():
        pytest.skip("the FFI kernel could not be built here")
    monkeypatch.delenv(tile_choice.ENV, raising=False)
    monkeypatch.setattr(negative_tile.cpu_tile_build, "library_path", lambda lib: tmp_path / "cpu_tile_ffi-x.so")
    monkeypatch.setattr(tile_choice, "interleaved_medians", _never("interleaved_medians"))
    if tuned is not None:
        _write_choice(negative_tile.tuned_path(), tuned)
    negative_tile._tuned_tile.cache_clear()
    hidden, items = jnp.ones((8, 4), jnp.float32), jnp.ones((300, 4), jnp.float32)
    targets = jnp.zeros((8, 2), jnp.int32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tile_choice.TileChoiceWarning)  # nothing is said: nothing is slow
            text = jax.jit(jax.grad(lambda h: cut_bce(h, items, targets, block_v=128))).lower(hidden).as_text()
        assert ("cutbce_rows_grad" in text) == (tuned != "xla")
    finally:
        negative_tile._tuned_tile.cache_clear()


@pytest.mark.jax
def test_jax_tuning_runs_compile_each_tile(monkeypatch):
    from jax_kernels.blocked import negative_tile

    if not negative_tile._ffi_registered():
        pytest.skip("the FFI kernel could not be built here")
    monkeypatch.delenv(tile_choice.ENV, raising=False)
    runs = tune_tiles.jax_tuning_runs(16, 300, 8, 2)
    assert list(runs) == ["c_kernel", "xla"] and os.environ.get(tile_choice.ENV) is None
    timings = tile_choice.interleaved_medians(runs, rounds=1)
    assert set(timings) == {"c_kernel", "xla"}
