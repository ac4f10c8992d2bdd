"""Compiles the CPU tile kernel (`cpu_tile.c`, or its XLA FFI wrapper `cpu_tile_ffi.cc`) once per
machine and loads it; framework-neutral (torch calls the C library through ctypes, JAX the FFI one).

The library is built for the machine it runs on (`-march=native`: AVX-512 where the CPU has it)
and cached under `$TORCH_CUTBCE_CACHE_DIR` (default `~/.cache/torch_cutbce`), keyed by the
sources, the flags, the compiler's version and the CPU's feature flags, so a different machine or
compiler builds its own. The build writes a temporary file and renames it, so processes racing
for the same key are safe. `TORCH_CUTBCE_NO_COMPILE=1` switches it off (as it does torch.compile);
callers then use their portable tiles.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC"]


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded here (no compiler, an unsupported flag...)."""


def disabled() -> bool:
    return os.environ.get("TORCH_CUTBCE_NO_COMPILE", "") not in ("", "0")


def cache_dir() -> Path:
    configured = os.environ.get("TORCH_CUTBCE_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_cutbce"


@functools.cache
def c_library() -> ctypes.CDLL:
    """`cpu_tile.c` as a ctypes library with `cutbce_tile` and `cutbce_counts` typed; BuildError if
    it cannot be built here."""
    lib = _load(_build("cpu_tile.c", _compiler("CC", ("cc", "gcc", "clang")), ["-std=c99"]))
    pointer, size = ctypes.c_void_p, ctypes.c_long
    lib.cutbce_tile.argtypes = [pointer] * 5 + [size, size, ctypes.c_int]
    lib.cutbce_tile.restype = None
    lib.cutbce_counts.argtypes = [pointer, pointer, size, size, ctypes.c_int]
    lib.cutbce_counts.restype = None
    return lib


@functools.cache
def ffi_library(include_dir: str) -> ctypes.CDLL:
    """`cpu_tile_ffi.cc` (the XLA FFI handlers around `cpu_tile.c`) built against jaxlib's headers in
    `include_dir`; BuildError if it cannot be built here."""
    compiler = _compiler("CXX", ("c++", "g++", "clang++"))
    return _load(_build("cpu_tile_ffi.cc", compiler, ["-std=c++17", f"-I{include_dir}", f"-I{_HERE}"],
                        extra_sources=("cpu_tile.c",), key_extra=_headers_digest(include_dir)))


def _compiler(variable: str, candidates: tuple[str, ...]) -> str:
    if disabled():
        raise BuildError("TORCH_CUTBCE_NO_COMPILE is set")
    for name in ([os.environ[variable]] if os.environ.get(variable) else []) + list(candidates):
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(f"no C/C++ compiler found (${variable}, or one of {', '.join(candidates)} on PATH)")


def _build(source: str, compiler: str, flags: list[str], extra_sources=(), key_extra: str = "") -> Path:
    """The cached library built from `source` (and the files it includes, `extra_sources`)."""
    command_flags = _FLAGS + flags
    digest = hashlib.sha256()
    for name in (source, *extra_sources):
        digest.update((_HERE / name).read_bytes())
    for part in (" ".join(command_flags), _version(compiler), _cpu_features(), platform.machine(), key_extra):
        digest.update(part.encode())
    target = cache_dir() / f"{Path(source).stem}-{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so.tmp", delete=False) as scratch:
            temporary = Path(scratch.name)
    except OSError as error:
        raise BuildError(f"cannot write the kernel cache {target.parent} ({error}); "
                         f"set TORCH_CUTBCE_CACHE_DIR to a writable folder") from error
    try:
        result = subprocess.run([compiler, *command_flags, str(_HERE / source), "-o", str(temporary)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise BuildError(f"{Path(compiler).name} failed on {source}:\n{result.stderr[-2000:]}")
        os.replace(temporary, target)  # atomic: a process racing for the same key finds a whole file
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"cannot build {source} with {compiler}: {error}") from error
    finally:
        temporary.unlink(missing_ok=True)
    return target


def _load(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise BuildError(f"cannot load {path}: {error}") from error


@functools.cache
def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"cannot run {compiler}: {error}") from error


@functools.cache
def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), so another CPU builds anew."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _headers_digest(include_dir: str) -> str:
    header = Path(include_dir) / "xla" / "ffi" / "api" / "ffi.h"
    return hashlib.sha256(header.read_bytes()).hexdigest() if header.exists() else include_dir
