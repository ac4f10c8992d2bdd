"""The CPU tile kernel's cache and build are safe: what is wrong with them is a warning, never a crash.

- A cached library that is truncated, has its middle zeroed, or was replaced by another library is
  caught before dlopen (its digest), rebuilt with one warning, and the loss is right, for the
  ctypes library (torch) and the FFI one (JAX), in a fresh process each (dlopen of a damaged file
  killed the process with SIGBUS / SIGSEGV).
- A loadable library without the kernel's symbols is a BuildError (one warning, the fallback tiles).
- A `$CC` that does not exist is a BuildError naming it, not a silent switch to another compiler;
  one that is no compiler (`CC=/bin/false CXX=/bin/false`) is one line naming it, whatever paths of
  a process need it (the kernel's build, torch.compile's tiles), and the fallback is exact.
- A build says so once, before it starts, at the caller's line (docs/install.md, 'What the first call
  says'), and is all a first call says: no tile is timed, JAX runs the FFI kernel by default
  (torch's first call: tests/test_torch_first_call.py; the tuned choice: tests/test_neutral_tile_choice.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cutbce_common import cpu_tile_build

pytestmark = pytest.mark.rung1

ROOT = Path(__file__).resolve().parent.parent

# A fresh process: builds (or loads) the kernel from the cache given, runs the loss through it and
# prints what it warned, which tile ran and the relative error of the loss against float64.
_TORCH_RUN = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch
    from torch_cutbce import cut_bce_with_logits
    from torch_cutbce.native import fused_tile
    from torch_cutbce.reference import dense_bce_with_logits
    g = torch.Generator().manual_seed(0)
    h, e = torch.randn(33, 8, generator=g), torch.randn(301, 8, generator=g)
    t = torch.randint(-1, 301, (33, 4), generator=g)
    loss = cut_bce_with_logits(h, e, t, reduction="sum")
    truth = dense_bce_with_logits(h.double(), e.double(), t, reduction="sum")
print(json.dumps({"warnings": [str(w.message) for w in caught if "torch_cutbce" in str(w.message)],
                  "where": [w.filename for w in caught if "torch_cutbce" in str(w.message)],
                  "tile": fused_tile._plain_cpu_tile(), "error": abs(float(loss) - float(truth)) / float(truth)}))
"""

_JAX_RUN = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import jax, jax.numpy as jnp, numpy as np
    from jax_kernels import cut_bce
    from jax_kernels.blocked import negative_tile
    from jax_kernels.reference import dense_cut_bce
    rng = np.random.default_rng(0)
    h, e = jnp.asarray(rng.standard_normal((33, 8)), jnp.float32), jnp.asarray(rng.standard_normal((301, 8)), jnp.float32)
    t = jnp.asarray(rng.integers(-1, 301, (33, 4)), jnp.int32)
    loss = float(cut_bce(h, e, t, reduction="sum"))
    jax.config.update("jax_enable_x64", True)
    truth = float(dense_cut_bce(jnp.asarray(h, jnp.float64), jnp.asarray(e, jnp.float64), t, reduction="sum"))
print(json.dumps({"warnings": [str(w.message) for w in caught if str(w.message).startswith("jax_kernels")],
                  "where": [w.filename for w in caught if str(w.message).startswith("jax_kernels")],
                  "tile": "c_kernel" if negative_tile._kernel_chosen() else "xla", "error": abs(loss - truth) / truth}))
"""


def _run(script: str, cache: Path, **variables: str) -> dict:
    """One fresh process with the kernel cache `cache`, the default tile (nothing forced) and `variables`."""
    env = {**os.environ, "TORCH_CUTBCE_CACHE_DIR": str(cache), **variables}
    for name in ("TORCH_CUTBCE_NO_COMPILE", "TORCH_CUTBCE_TILE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"the process died (rc {done.returncode}):\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["where"]) <= {"<string>"}, result  # issue 32: the script's line, not the library's
    return result


def _compiler() -> str:
    try:
        return cpu_tile_build.c_compiler()
    except cpu_tile_build.BuildError as error:
        pytest.skip(f"no C compiler: {error}")


def _foreign_library(path: Path) -> None:
    """A loadable shared library at `path` without any of the kernel's symbols."""
    source = path.with_suffix(".c")
    source.write_text("int something_else(void) { return 1; }\n")
    subprocess.run([_compiler(), "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()


def _damage(library: Path, how: str) -> None:
    if how == "foreign":
        _foreign_library(library)
        return
    data = bytearray(library.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:  # middle zeroed
        quarter = len(data) // 4
        data[quarter: 3 * quarter] = bytes(2 * quarter)
    library.write_bytes(data)


def _check_damage_is_survived(script: str, prefix: str, how: str, cache: Path) -> None:
    first = _run(script, cache)
    assert first["tile"] == "c_kernel" and len(first["warnings"]) == 1, first
    assert re.match(r"\w+: building the CPU tile kernel.* for this machine .* once per machine", first["warnings"][0])
    (library,) = cache.glob(f"{prefix}-*.so")
    _damage(library, how)
    second = _run(script, cache)
    assert second["tile"] == "c_kernel", second  # rebuilt, not given up
    assert len(second["warnings"]) == 1 and "does not match the digest" in second["warnings"][0], second
    assert "the cached the" not in second["warnings"][0], second  # issue 31: the warning read so
    assert "building it again" in second["warnings"][0], second  # said instead of the first build's message
    assert second["error"] <= 1e-5, second
    assert cpu_tile_build._intact(library)  # rebuilt whole: the next process loads it without a word


@pytest.mark.parametrize("how", ["truncated", "middle zeroed", "foreign"])
def test_a_damaged_cached_c_library_is_rebuilt_with_one_warning(how, tmp_path):
    _check_damage_is_survived(_TORCH_RUN, "cpu_tile", how, tmp_path)


@pytest.mark.jax
@pytest.mark.parametrize("how", ["truncated", "foreign"])
def test_a_damaged_cached_ffi_library_is_rebuilt_with_one_warning(how, tmp_path):
    _check_damage_is_survived(_JAX_RUN, "cpu_tile_ffi", how, tmp_path)


@pytest.mark.jax
def test_jax_says_the_build_once_per_machine_and_times_nothing(tmp_path):
    _compiler()
    first = _run(_JAX_RUN, tmp_path)
    assert len(first["warnings"]) == 1 and first["tile"] == "c_kernel", first  # the build: no choice measured
    assert first["warnings"][0].startswith("jax_kernels: building the CPU tile kernel's XLA FFI wrapper"), first
    assert not list(tmp_path.glob("*.json")), sorted(tmp_path.iterdir())  # nothing was timed or written
    second = _run(_JAX_RUN, tmp_path)
    assert second["warnings"] == [] and second["tile"] == "c_kernel", second


def test_a_library_without_the_kernels_symbols_is_a_build_error(tmp_path):
    foreign = tmp_path / "foreign.so"
    _foreign_library(foreign)
    # Whole, with its digest recorded (as if built here): only the symbol check can tell.
    cpu_tile_build.write_atomically(cpu_tile_build._digest_path(foreign), cpu_tile_build._file_digest(foreign),
                                     tmp_path)
    with pytest.raises(cpu_tile_build.BuildError, match="lacks the kernel's symbols.*cutbce_tile"):
        cpu_tile_build._load(foreign, cpu_tile_build.C_SYMBOLS)
    # A copy, truncated: the loaded file must stay whole (truncating a mapped library is a SIGBUS
    # at the next touch of its pages, at exit at the latest).
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(foreign.read_bytes()[:100])
    cpu_tile_build.write_atomically(cpu_tile_build._digest_path(truncated), cpu_tile_build._file_digest(foreign),
                                     tmp_path)
    with pytest.raises(cpu_tile_build.BuildError, match="does not match the digest"):
        cpu_tile_build._load(truncated, cpu_tile_build.C_SYMBOLS)


@pytest.mark.parametrize("variable, finder", [("CC", cpu_tile_build.c_compiler),
                                              ("CXX", lambda: cpu_tile_build._compiler("CXX", ("c++",)))])
def test_a_compiler_variable_that_names_no_compiler_is_an_error(variable, finder, monkeypatch):
    monkeypatch.delenv("TORCH_CUTBCE_NO_COMPILE", raising=False)
    monkeypatch.setenv(variable, "/nonexistent/cc")
    with pytest.raises(cpu_tile_build.BuildError, match=rf"\${variable}='/nonexistent/cc' is not an executable"):
        finder()


def test_the_build_records_the_librarys_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_CUTBCE_CACHE_DIR", str(tmp_path))
    library = cpu_tile_build._build("cpu_tile.c", _compiler(), cpu_tile_build.C_FLAGS)
    recorded = cpu_tile_build._digest_path(library).read_text().strip()
    assert recorded == cpu_tile_build._file_digest(library) and cpu_tile_build._intact(library)
    library.write_bytes(library.read_bytes() + b"\0")
    assert not cpu_tile_build._intact(library)


# What a user sees: the warnings as Python prints them on stderr, then the loss ('mean', backward)
# against the dense reference in float64.
_MEAN_BACKWARD_RUN = """
import torch
from torch_cutbce import cut_bce_with_logits
from torch_cutbce.reference import dense_bce_with_logits
g = torch.Generator().manual_seed(0)
h, e = torch.randn(33, 8, generator=g).requires_grad_(), torch.randn(301, 8, generator=g).requires_grad_()
t = torch.randint(-1, 301, (33, 4), generator=g)
cut_bce_with_logits(h, e, t, reduction="mean").backward()
hd, ed = h.detach().double().requires_grad_(), e.detach().double().requires_grad_()
dense_bce_with_logits(hd, ed, t, reduction="mean").backward()
print(max(((h.grad - hd.grad).abs().max() / hd.grad.abs().max()).item(),
          ((e.grad - ed.grad).abs().max() / ed.grad.abs().max()).item()))
"""


def test_a_compiler_that_is_not_one_is_said_once_and_the_fallback_is_exact(tmp_path):
    """Issue 39: `CC=/bin/false CXX=/bin/false` (executables, not compilers) said four warnings: the
    kernel's build announced, its failure with an empty compiler output, torch.compile's compile
    announced, and inductor's error text. Now one line names the cause and what runs instead.
    CXX too: it is torch.compile's compiler on the CPU, the fallback the kernel's failure reaches
    (with a working one that path compiles for 10-60 s; the kernel's side alone:
    test_neutral_cpu_tile.py, test_build_failures_are_build_errors)."""
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false", "TORCH_CUTBCE_CACHE_DIR": str(tmp_path / "kernel"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # an empty cache: nothing built before is loaded
    for name in ("TORCH_CUTBCE_NO_COMPILE", "TORCH_CUTBCE_TILE", "PYTHONWARNINGS"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _MEAN_BACKWARD_RUN], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "compiler" in line or "torch_cutbce" in line]
    assert len(said) == 1, done.stderr
    assert re.search(r"TileCompileWarning: torch_cutbce: the CPU tile kernel could not be built \(\$CC='/bin/false' "
                     r"is not a working C compiler: .*\), and torch.compile cannot compile here \(\$CXX='/bin/false' "
                     r"is not a working C\+\+ compiler: .*\), so CPU tiles run eager", said[0]), said[0]
    assert float(done.stdout.split()[-1]) <= 1e-5, done.stdout


@pytest.mark.jax
def test_jax_says_a_cxx_that_is_not_a_compiler_once(tmp_path):
    result = _run(_JAX_RUN, tmp_path, CXX="/bin/false")
    assert len(result["warnings"]) == 1 and result["tile"] == "xla", result
    assert re.match(r"jax_kernels: the CPU tile kernel could not be built \(\$CXX='/bin/false' is not a working "
                    r"C\+\+ compiler: .*\); using jnp tiles", result["warnings"][0]), result
    assert result["error"] <= 1e-5, result
