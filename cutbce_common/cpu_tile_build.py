"""Builds the CPU tile kernel (`cpu_tile.c`, or its XLA FFI wrapper `cpu_tile_ffi.cc`) once per machine.

Framework-neutral: torch loads the C library through ctypes, JAX the FFI one. Each library is built
for the CPU it runs on and cached, keyed by sources, flags, compiler and CPU; a cached one is loaded
only if it matches its recorded SHA-256 and has its symbols, since a damaged library can kill the
process inside dlopen. Before a build the compiler must build a one-line library with the build's
flags (`unusable`), so a compiler that is missing, is no compiler (`CC=/bin/false`) or lacks a flag
(OpenMP) is one BuildError naming it and the cause, before anything is said of a build. A build says
so before it starts, as the caller's `warning` (once per machine; a cached library loads without a
word). Any failure is a BuildError, which the callers turn into one warning and their portable tiles. Every warning of the CPU tiles goes through
`warn_at_caller`, so it names the user's line, not one inside the library or the frameworks. Compiler,
flags, cache and switches: docs/toolchain.md, 'The CPU tile kernel's build'.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
C_FLAGS = ["-std=c99"]


def flags(march: str | None = None) -> list[str]:
    """The compiler flags of every build. `-march` is `march`, else `$TORCH_CUTBCE_MARCH`, else
    native: another level builds a library for other machines (x86-64-v3 for any AVX2 CPU), and
    lets the tests and benchmarks build and time one ISA level on a CPU that has more."""
    march = march or os.environ.get("TORCH_CUTBCE_MARCH") or "native"
    return ["-O3", f"-march={march}", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC"]


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded here (no compiler, an unsupported flag...)."""


# The folders whose frames a warning skips: this library's two packages, and the frameworks that
# call into them (torch's autograd and custom ops, jax's tracing). Found without importing them.
# The library's three packages, as the interpreter names their files (unresolved: a frame's
# co_filename keeps a symlinked prefix) and resolved.
_LIBRARY_FOLDERS = tuple(sorted({str(folder / package) + os.sep
                                 for folder in (Path(os.path.dirname(os.path.abspath(__file__))).parent, _HERE.parent)
                                 for package in ("cutbce_common", "torch_cutbce", "jax_kernels")}))
_FRAMEWORKS = ("torch", "jax", "jaxlib", "torch_xla", "torch_tpu")


def _inside(filename: str) -> bool:
    """Whether a frame of `filename` belongs to this library or to a framework it is called through."""
    folders = list(_LIBRARY_FOLDERS)
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            folders.append(os.path.dirname(module.__file__) + os.sep)
    return filename.startswith(tuple(folders))


def _importlib_frame(frame) -> bool:
    """The frames `warnings.warn` itself steps over when it counts `stacklevel` (CPython's rule)."""
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


def caller_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` made by the function calling this one that names the
    first frame outside this library and its frameworks: the user's line that called the loss (or
    its backward, or the jitted function being traced). Counted as `warnings.warn` counts (it skips
    importlib's frames); the outermost frame where every frame is the library's."""
    frame, level = sys._getframe(1), 1  # the function that will call warnings.warn: stacklevel 1
    while _inside(frame.f_code.co_filename):
        outer = frame.f_back
        while outer is not None and _importlib_frame(outer):
            outer = outer.f_back
        if outer is None:
            break
        frame, level = outer, level + 1
    return level


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)` attributed to the caller's line (`caller_stacklevel`)."""
    warnings.warn(message, category, stacklevel=caller_stacklevel())


def disabled() -> bool:
    return os.environ.get("TORCH_CUTBCE_NO_COMPILE", "") not in ("", "0")


def cache_dir() -> Path:
    configured = os.environ.get("TORCH_CUTBCE_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_cutbce"


C_SYMBOLS = ("cutbce_tile", "cutbce_counts", "cutbce_lanes")
FFI_SYMBOLS = ("cutbce_rows", "cutbce_rows_grad", "cutbce_grad")


@functools.cache
def c_library(warning: type[Warning] = UserWarning) -> ctypes.CDLL:
    """`cpu_tile.c` as a ctypes library with `cutbce_tile` and `cutbce_counts` typed (torch's); a
    build says so first as `warning`; BuildError if it cannot be built here. `library_path(lib)` is
    its file in the cache."""
    build = _Build("torch_cutbce", "the CPU tile kernel", "under a second", warning)
    lib = _load(_build("cpu_tile.c", c_compiler(), C_FLAGS, announce=build), C_SYMBOLS)
    pointer, size = ctypes.c_void_p, ctypes.c_long
    lib.cutbce_tile.argtypes = [pointer] * 5 + [size, size, ctypes.c_int]
    lib.cutbce_tile.restype = None
    lib.cutbce_counts.argtypes = [pointer, pointer, size, size, ctypes.c_int]
    lib.cutbce_counts.restype = None
    lib.cutbce_lanes.argtypes = []
    lib.cutbce_lanes.restype = ctypes.c_int
    return lib


def library_path(lib: ctypes.CDLL) -> Path:
    """The cached file `lib` was loaded from (what its build was keyed by is in the name)."""
    return Path(lib._name)


@functools.cache
def ffi_library(include_dir: str, warning: type[Warning] = UserWarning) -> ctypes.CDLL:
    """`cpu_tile_ffi.cc` (the XLA FFI handlers around `cpu_tile.c`, JAX's) built against jaxlib's
    headers in `include_dir`; a build says so first as `warning`; BuildError if it cannot be built here."""
    compiler = _compiler("CXX", ("c++", "g++", "clang++"))
    build = _Build("jax_kernels", "the CPU tile kernel's XLA FFI wrapper", "5-15 s", warning)
    return _load(_build("cpu_tile_ffi.cc", compiler, ["-std=c++17", f"-I{include_dir}", f"-I{_HERE}"],
                        extra_sources=("cpu_tile.c",), key_extra=_headers_digest(include_dir), announce=build),
                 FFI_SYMBOLS)


def c_compiler() -> str:
    return _compiler("CC", ("cc", "gcc", "clang"))


def _compiler(variable: str, candidates: tuple[str, ...]) -> str:
    """`$variable` if it is set (a set one that is not an executable is an error, not skipped: the
    user asked for that compiler), else the first of `candidates` on PATH."""
    if disabled():
        raise BuildError("TORCH_CUTBCE_NO_COMPILE is set")
    configured = os.environ.get(variable)
    if configured:
        path = shutil.which(configured)
        if not path:
            raise BuildError(f"${variable}={configured!r} is not an executable compiler (unset it to use "
                             f"one of {', '.join(candidates)} from PATH)")
        return path
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(f"no C/C++ compiler found (${variable}, or one of {', '.join(candidates)} on PATH)")


@dataclass(frozen=True)
class _Build:
    """What a build tells the user before it starts: who builds `what`, how long it takes (`cost`,
    measured on a 2-core x86-64 host), and as which warning category."""

    prefix: str
    what: str
    cost: str
    warning: type[Warning]

    def announce(self, compiler: str, folder: Path, damaged: Path | None) -> None:
        command = f"{Path(compiler).name} {' '.join(flags()[:2])} ..."
        if damaged is not None:
            why = (f"{self.what} cached at {damaged} does not match the digest recorded when it was built "
                   f"(damaged or replaced); building it again ({command}, {self.cost})")
        else:
            why = (f"building {self.what} for this machine ({command}, {self.cost}), once per machine, "
                   f"into {folder} (TORCH_CUTBCE_CACHE_DIR); TORCH_CUTBCE_NO_COMPILE=1 skips every build "
                   f"and compile (slower tiles)")
        warn_at_caller(f"{self.prefix}: {why}", self.warning)


def _build(source: str, compiler: str, extra_flags: list[str], extra_sources=(), key_extra: str = "",
           announce: _Build | None = None) -> Path:
    """The cached library built from `source` (and the files it includes, `extra_sources`); a
    build, or a rebuild of a damaged one, is said first through `announce`."""
    command_flags = flags() + extra_flags
    digest = hashlib.sha256()
    for name in (source, *extra_sources):
        digest.update((_HERE / name).read_bytes())
    for part in (" ".join(command_flags), _version(compiler), _cpu_features(), platform.machine(), key_extra):
        digest.update(part.encode())
    target = cache_dir() / f"{Path(source).stem}-{digest.hexdigest()[:20]}.so"
    damaged = None
    if target.exists():
        if _intact(target):
            return target
        damaged = target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so.tmp", delete=False) as scratch:
            temporary = Path(scratch.name)
    except OSError as error:
        raise BuildError(f"cannot write the kernel cache {target.parent} ({error}); "
                         f"set TORCH_CUTBCE_CACHE_DIR to a writable folder") from error
    language, variable = _LANGUAGES[Path(source).suffix]
    announce = announce or _Build("torch_cutbce", source, "a few seconds", UserWarning)
    try:
        problem = unusable(variable, compiler, language, tuple(command_flags))
        if problem:  # said instead of a build that cannot start
            raise BuildError(problem)
        announce.announce(compiler, target.parent, damaged)
        result = subprocess.run([compiler, *command_flags, str(_HERE / source), "-o", str(temporary)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise BuildError(f"{Path(compiler).name} failed on {source}:\n{result.stderr[-2000:]}")
        # The digest first, then the library, each renamed into place: a process racing for the
        # same key finds either no library or a whole one whose digest is already there.
        write_atomically(_digest_path(target), _file_digest(temporary), target.parent)
        os.replace(temporary, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"cannot build {source} with {compiler}: {error}") from error
    finally:
        temporary.unlink(missing_ok=True)
    return target


_LANGUAGES = {".c": ("C", "CC"), ".cc": ("C++", "CXX")}  # a source's language, and the variable naming its compiler
_PROBE_SOURCE = "int cutbce_probe(void) { return 0; }\n"


def unusable(variable: str, compiler: str, language: str, probe_flags: tuple[str, ...] = ()) -> str | None:
    """None where `compiler` builds a one-line `language` ('C' or 'C++') shared library with
    `probe_flags` (plus `-shared -fPIC`), else why not, in one line naming it as the user did
    (`$variable` where that is set): "$CC='/bin/false' is not a working C compiler: ...". One
    compiler run of a few tens of ms: the callers run it before a build or a compile, never where a
    cached library loads."""
    configured = os.environ.get(variable)
    who = f"${variable}={configured!r}" if configured else Path(compiler).name
    shown = " ".join([Path(compiler).name, *probe_flags[:2], *["..."][:len(probe_flags) > 2], "-x",
                      language.lower(), "-"])
    try:
        folder = tempfile.mkdtemp(prefix="cutbce-probe-")
    except OSError:
        return None  # nowhere to try it: the build itself will say what fails
    library = Path(folder) / "probe.so"
    try:
        result = subprocess.run([compiler, *probe_flags, "-shared", "-fPIC", "-x", language.lower(), "-",
                                 "-o", str(library)], input=_PROBE_SOURCE, capture_output=True, text=True,
                                timeout=120)
        wrote = library.exists() and library.stat().st_size > 0
    except (OSError, subprocess.SubprocessError) as error:
        return f"{who} is not a working {language} compiler: cannot run it ({error})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if result.returncode != 0:
        said = _first_error(result.stderr + result.stdout)
        return (f"{who} is not a working {language} compiler: `{shown}` on a one-line source exited with "
                f"status {result.returncode}{', saying ' + repr(said) if said else ', printing nothing'}")
    if not wrote:
        return f"{who} is not a working {language} compiler: `{shown}` on a one-line source wrote no library"
    return None


def _first_error(text: str) -> str:
    """The line of a compiler's output that says what is wrong (the first naming an error, else
    the last), shortened: the cause in a one-line warning."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    line = next((line for line in lines if "error" in line.lower()), lines[-1])
    return line if len(line) <= 300 else line[:297] + "..."


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_atomically(path: Path, text: str, folder: Path) -> None:
    """`text` into `path` through a temporary file in `folder` renamed into place (racing writers are safe)."""
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as scratch:
        scratch.write(text)
    os.replace(scratch.name, path)


def _intact(library: Path) -> bool:
    """Whether `library` is the file its build wrote (its recorded SHA-256 matches): a truncated,
    overwritten or foreign file is not, and is built again rather than loaded."""
    try:
        return _digest_path(library).read_text().strip() == _file_digest(library)
    except OSError:
        return False


def _load(path: Path, symbols: tuple[str, ...]) -> ctypes.CDLL:
    """The library at `path` (checked by `_intact` just before), with every one of `symbols`."""
    if not _intact(path):
        raise BuildError(f"{path} does not match the digest recorded when it was built")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise BuildError(f"cannot load {path}: {error}") from error
    missing = [name for name in symbols if not hasattr(lib, name)]
    if missing:
        raise BuildError(f"{path} lacks the kernel's symbols {missing}; delete it to rebuild")
    return lib


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
