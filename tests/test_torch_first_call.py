"""What the first call says (docs/install.md, 'What the first call says'): each slow step before it starts,
once per machine or once per process as documented, and nothing where nothing slow happens.

Each case runs fresh processes on empty cache folders (the kernel's and inductor's): the first
process says exactly the documented messages, in order; the next says what is once per process
only. torch.compile is stubbed out (`stub`) where a test is about the message, not the compile;
one test (`slow`) compiles for real: the choice's comparison with torch.compile's tile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.rung1

ROOT = Path(__file__).resolve().parent.parent

# argv: the calls to make ('plain', 'focal', 'float64'), and 'stub' to run the tile functions
# uncompiled where torch.compile would compile them. Prints every torch_cutbce warning, in order.
_SCRIPT = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    from torch_cutbce import Focal, cut_bce_with_logits, fused_tile
    if "stub" in sys.argv:
        fused_tile._compiled = lambda name, threads, form=None: (
            fused_tile._FUNCTIONS[name] if form is None else fused_tile._loss_functions(form)[name])
    g = torch.Generator().manual_seed(0)
    for call in sys.argv[1:]:
        if call == "stub":
            continue
        dtype = torch.float64 if call == "float64" else torch.float32
        h = torch.randn(16, 8, generator=g, dtype=dtype).requires_grad_()
        e = torch.randn(300, 8, generator=g, dtype=dtype).requires_grad_()
        t = torch.randint(-1, 300, (16, 2), generator=g)
        for _ in range(2):
            cut_bce_with_logits(h, e, t, focal=Focal(gamma=2.0) if call == "focal" else None).backward()
print(json.dumps([[w.category.__name__, str(w.message)] for w in caught if str(w.message).startswith("torch_cutbce")]))
"""

BUILD = r"building the CPU tile kernel for this machine \(\S+ -O3 -march=\S+ \.\.\., under a second\), once per machine"
TIMING = r"timing the float32 CPU tiles \(c_kernel, compiled, eager\) .* once per machine \(this compiles torch.compile"
CHOSEN = r"float32 CPU tiles use '\w+': measured now \(c_kernel .* ms, compiled .* ms, eager .* ms\)"
COMPILE = r"compiling the float32 tile functions for the CPU with torch.compile, once per process"
COMPILE_FOCAL = r"compiling the float32 focal tile functions for the CPU with torch.compile, once per process"
NO_COMPILER = (r"the CPU tile kernel could not be built \(no C/C\+\+ compiler found .*\), and torch.compile has no "
               r"C\+\+ compiler here .* run eager")


def _said(calls: list[str], cache: Path, **env: str) -> list[str]:
    """The torch_cutbce warnings of one fresh process making `calls`, all TileCompileWarnings."""
    environment = {**os.environ, "TORCH_CUTBCE_CACHE_DIR": str(cache / "kernel"),
                   "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), **env}
    for name in ("TORCH_CUTBCE_TILE", "TORCH_CUTBCE_NO_COMPILE", "CC", "CXX"):
        if name not in env:
            environment.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *calls], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the process failed (rc {done.returncode}):\n{done.stderr[-3000:]}"
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(category == "TileCompileWarning" for category, _ in said), said
    return [message for _, message in said]


def _match(said: list[str], expected: list[str]) -> None:
    assert len(said) == len(expected) and all(re.match(f"torch_cutbce: {pattern}", message)
                                              for message, pattern in zip(said, expected)), said


def _kernel_built(cache: Path) -> bool:
    return any((cache / "kernel").glob("cpu_tile-*.so"))


def _needs_compilers() -> None:
    from jax_kernels.neutral import cpu_tile_build

    try:
        cpu_tile_build.c_compiler()
    except cpu_tile_build.BuildError as error:
        pytest.skip(f"no C compiler: {error}")


def test_the_kernels_build_is_said_once_per_machine(tmp_path):
    _needs_compilers()
    _match(_said(["plain"], tmp_path, TORCH_CUTBCE_TILE="c_kernel"), [BUILD])
    _match(_said(["plain"], tmp_path, TORCH_CUTBCE_TILE="c_kernel"), [])


@pytest.mark.slow
def test_the_tile_choice_is_said_before_and_after_once_per_machine(tmp_path):
    """The one real torch.compile here (10-40 s on a 2-core CPU): the comparison of the candidates."""
    _needs_compilers()
    first = _said(["plain"], tmp_path)
    _match(first, [BUILD, TIMING, CHOSEN])  # the timing's compile is this process's compile: said once
    compiled = "use 'compiled'" in first[-1]  # a near tie on a loaded machine can pick it
    _match(_said(["plain"], tmp_path), [COMPILE] if compiled else [])  # torch.compile's tile compiles per process


def test_each_compiled_family_is_said_once_in_every_process(tmp_path):
    for _ in range(2):  # the same in the second process: torch.compile's work is per process
        _match(_said(["plain", "focal", "plain", "focal", "stub"], tmp_path, TORCH_CUTBCE_TILE="compiled"),
               [COMPILE, COMPILE_FOCAL])
    assert not _kernel_built(tmp_path)  # a forced tile builds nothing it does not run


def test_without_a_compiler_one_message_and_no_compile_attempt(tmp_path):
    (tmp_path / "bin").mkdir()
    _match(_said(["plain", "focal"], tmp_path, PATH=str(tmp_path / "bin")), [NO_COMPILER])


@pytest.mark.parametrize("calls, env", [(["plain", "focal"], {"TORCH_CUTBCE_NO_COMPILE": "1"}),
                                        (["float64"], {}),
                                        (["plain"], {"TORCH_CUTBCE_TILE": "eager"})])
def test_nothing_is_said_where_nothing_is_compiled(calls, env, tmp_path):
    _match(_said(calls, tmp_path, **env), [])
    assert not _kernel_built(tmp_path)
