"""The elementwise work on one `[block_n, block_v]` logits tile of negatives, compiled once per process.

The tile holds every item's logit except the row's positives, which `positives.TilePositives` has
set to -inf (their loss and gradient are 0 here; `positives.positive_terms` gives them their own
branch). Each element's loss is `cw softplus(z)` and its gradient `g cw sigmoid(z)` (another
`Loss`: its `term` and slope), both from one `e = exp(-|z|)`, exact to rounding for any z: the
math is `branch_math.py`'s, here only weighted, masked and summed.

    rows(z, cw, loss)                -> sum_v cw softplus(z)
    rows_grad(z, cw, g, out, loss)   -> the same, and writes dz = g cw sigmoid(z) into `out`
    grad(z, cw, g, out, loss)        -> writes dz into `out`
    counts(z)                  -> #{v : z > 0} per row (metrics)

Plain float32 tiles on the CPU run one of three candidates (`TILES`): by default the C kernel
`cutbce_common/cpu_tile.c` (built once per machine, under a second; one pass that may write dz
over z: `writes_grad_in_place`), with nothing timed and nothing compiled by torch.compile in the
process. The `torch.compile`d version or the eager twin runs instead where `TORCH_CUTBCE_TILE` says
so, where `python -m torch_cutbce.native.tune_tiles` measured it faster over the whole forward + backward
(`_tuned_cpu_tile`, `cutbce_common/tile_choice.py`), or where the kernel cannot be built
(torch.compile's tile with a C++ compiler, else eager). Other float32 tiles (CUDA, any other `Loss`)
run the `torch.compile`d version (one vectorized loop per function) with log1p as a polynomial
(`branch_math.log1p_tail`, 4e-9 relative: Sleef's log1p costs about 4 exps); everything else runs the
eager twin (float64, a side of length 1, `TORCH_CUTBCE_NO_COMPILE=1`, no compiler). Rows are summed
exactly at any width (`_row_sum`, `_eager_weighted_sum`). Why each choice, with timings:
benchmarks/NOTES.md sections 1, 7 and 12, docs/performance.md ('First call and tile choice').
Each slow first-call step says so before it starts, as a `TileCompileWarning` naming the caller's line
(docs/install.md, 'What the first call says').
"""

from __future__ import annotations

import functools
import os
import shutil
import time
import types
from typing import Callable

import torch

from cutbce_common import cpu_tile_build, tile_choice  # framework-neutral: no jax import
from cutbce_common.loss import PLAIN, Form, Loss, Numbers
from torch_cutbce import branch_math

_compile_seconds: dict[str, float] = {}
_compile_failed = False
_no_cxx_said = False


def compile_seconds() -> dict[str, float]:
    """Seconds the first call of each compiled tile function took in this process (compile + one run),
    by name: a `Loss` tile function's name is followed by its form (`Loss.form()`), one compile each."""
    return dict(_compile_seconds)


# -- the compiled functions (float32); each element's math is branch_math.py's ---------------------


def _row_sum(x):
    """Each row's sum, in float64 on the CPU: inductor's C++ adds a row in float32 lanes (cascading
    only every 2**20 elements), which drifts by 1e-3 over a row of 2**21 equal terms. About 18% on
    the compiled rows_grad. (CUDA's Triton reduction stays float32: not measured here, no GPU.)"""
    return x.sum(-1, dtype=torch.float64 if x.device.type == "cpu" else None)


def _rows(z, cw):
    return _row_sum(branch_math.softplus_one_exp(z) * cw)


def _taken_out_to_zero(z, dz):
    """dz with exactly 0 at the positives taken out (z = -inf), also where g cw is infinite (inf * 0)."""
    return torch.where(z == float("-inf"), 0.0, dz)


def _rows_grad(z, cw, g, out):
    e = branch_math.exp_neg_abs(z)
    rows = _row_sum(branch_math.softplus(z, e) * cw)
    out.copy_(_taken_out_to_zero(z, branch_math.sigmoid(z, e) * (g * cw)))
    return rows


def _grad(z, cw, g, out):
    out.copy_(_taken_out_to_zero(z, branch_math.sigmoid(z, branch_math.exp_neg_abs(z)) * (g * cw)))


def _counts(z):
    return (z > 0).sum(-1, dtype=torch.float32)


# Tiles of any other `Loss` (`cutbce_common/loss.py`): its `form()` is a constant of the
# compiled kernel (focal's integer power unrolled: the exact form of the factor,
# `branch_math.focal_factor`), its `numbers()` the tensor `params` (every Loss of one form shares
# a kernel). At z = -inf (a positive taken out) the branch math adds 0; the gradient is masked here.


def _loss_functions(form) -> dict:
    """The three tile functions of a `Loss` of this `form`, taking `params` = its numbers as a
    tensor; each form's with code objects of their own (`_own_code`), so each form is compiled once
    per thread count, however many forms a process uses."""

    def terms(z, params):
        return branch_math.form_terms(z, False, form, Numbers(*params.unbind()))

    def loss_rows(z, cw, params):
        return _row_sum(terms(z, params)[0] * cw)

    def loss_rows_grad(z, cw, params, g, out):
        term, slope = terms(z, params)
        out.copy_(_taken_out_to_zero(z, slope * (g * cw)))
        return _row_sum(term * cw)

    def loss_grad(z, cw, params, g, out):
        out.copy_(_taken_out_to_zero(z, terms(z, params)[1] * (g * cw)))

    functions = {"loss_rows": loss_rows, "loss_rows_grad": loss_rows_grad, "loss_grad": loss_grad}
    return {name: _own_code(function, form) for name, function in functions.items()}


def _own_code(function, form):
    """`function` with a code object of its own for this form: dynamo keeps one cache, and one
    recompile limit (8), per code object, so closures of one code object for several forms would
    share it, and past 8 forms in a process torch.compile fails (fullgraph) and every tile runs eager."""
    tag = "_".join(str(int(value)) for value in form)
    code = function.__code__.replace(co_name=f"{function.__name__}_{tag}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)


@functools.lru_cache(maxsize=8)
def _loss_params(loss, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`loss.numbers()` as the compiled tile functions' `params` tensor."""
    return torch.tensor(loss.numbers(), dtype=dtype, device=device)


_FUNCTIONS = {"rows": _rows, "rows_grad": _rows_grad, "grad": _grad, "counts": _counts}


# -- eager twins: the same math, weighted and masked in place ---------------------------------------


def _eager_weighted_sum(loss, cw):
    """`sum_v cw loss`; consumes loss. torch's sum cascades (exact to a few roundings at any
    width); `loss @ cw` would not (BLAS's float32 lanes drift over a wide row)."""
    return (loss if cw is None else loss.mul_(cw)).sum(-1)


def _eager_dz_into(out, z, cw, g, slope=None):
    """`out = slope g cw` (`slope` None: `out` holds it), 0 at the positives taken out (as
    _taken_out_to_zero)."""
    torch.mul(out if slope is None else slope, g, out=out)
    if cw is not None:
        out.mul_(cw)
    out.masked_fill_(z == float("-inf"), 0.0)  # out is never z here


def _eager_softplus_sum(z, e, cw):
    """`sum_v cw softplus(z)`; consumes e (its log1p is written over it)."""
    return _eager_weighted_sum(branch_math.softplus(z, e, branch_math.log1p_tail(e, over_e=True)), cw)


def _eager_rows(z, cw):
    return _eager_softplus_sum(z, branch_math.exp_neg_abs(z), cw)


def _eager_rows_grad(z, cw, g, out):
    e = branch_math.exp_neg_abs(z)
    _eager_dz_into(branch_math.sigmoid(z, e, out=out), z, cw, g)
    return _eager_softplus_sum(z, e, cw)


def _eager_grad(z, cw, g, out):
    _eager_dz_into(branch_math.sigmoid(z, branch_math.exp_neg_abs(z), out=out), z, cw, g)


def _eager_loss_rows(z, cw, loss):
    return _eager_weighted_sum(branch_math.branch_terms(z, False, loss)[0], cw)


def _eager_loss_rows_grad(z, cw, loss, g, out):
    term, slope = branch_math.branch_terms(z, False, loss)
    _eager_dz_into(out, z, cw, g, slope)
    return _eager_weighted_sum(term, cw)


def _eager_loss_grad(z, cw, loss, g, out):
    _eager_dz_into(out, z, cw, g, branch_math.branch_terms(z, False, loss)[1])


_EAGER = {"rows": _eager_rows, "rows_grad": _eager_rows_grad, "grad": _eager_grad, "counts": _counts,
          "loss_rows": _eager_loss_rows, "loss_rows_grad": _eager_loss_rows_grad,
          "loss_grad": _eager_loss_grad}


# -- the CPU kernel (float32, plain BCE) -----------------------------------------------------------------


@functools.cache
def _cpu_library():
    """The ctypes library of `cpu_tile.c` (its build said first), or None (said once, with what
    runs instead) where it cannot be built."""
    global _no_cxx_said
    try:
        return cpu_tile_build.c_library(TileCompileWarning)
    except cpu_tile_build.BuildError as error:
        if _cpu_compiling_allowed():
            instead = "; float32 CPU tiles use torch.compile's tiles instead (compiled once per process)"
        elif _cxx_problem() is None:
            instead = "; float32 CPU tiles run eager instead, about 2x slower"
        else:  # one line for both compilers: the tiles' first compile would not say it again
            _no_cxx_said = True
            instead = f", and {_cxx_problem()}"
        _warn(f"torch_cutbce: the CPU tile kernel could not be built ({error}){instead}")
        return None


_NO_CXX = ("torch.compile has no C++ compiler here ($CXX, else g++), so CPU tiles run eager, about 2x slower; "
           "install gcc and g++ for the fast tiles")


@functools.cache
def _cxx_problem() -> str | None:
    """None where inductor's CPU code has a working C++ compiler (`$CXX`, else g++: it builds a
    one-line library, `cpu_tile_build.unusable`), else what to say, with the cause. Without one CPU
    torch.compile fails after a trace of about 10 s (inductor's own error, pages long), so it is not
    tried. Probed once per process, only where a CPU tile would compile."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        return _NO_CXX
    problem = cpu_tile_build.unusable("CXX", compiler, "C++")
    return problem and f"torch.compile cannot compile here ({problem}), so CPU tiles run eager, about 2x slower"


def _cpu_compiling_allowed() -> bool:
    return _compiling_allowed() and _cxx_problem() is None


_CPU_KERNEL_FUNCTIONS = ("rows", "rows_grad", "grad", "counts")


def writes_grad_in_place(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the plain tile functions take `out=z` at no cost (the CPU kernel reads each element
    before writing it); torch.compile's kernels read an aliased tile twice, so they get a buffer."""
    return dtype == torch.float32 and device.type == "cpu" and _plain_cpu_tile() == "c_kernel"


def _run_cpu_kernel(name: str, z: torch.Tensor, cw=None, g=None, out=None):
    """`cpu_tile.c` on the tensors of the functions below (`out` may be `z` itself)."""
    lib, (n, v), threads = _cpu_library(), z.shape, torch.get_num_threads()
    if name == "counts":
        counts = torch.empty(n, dtype=torch.float32)
        lib.cutbce_counts(_address(z), _address(counts), n, v, threads)
        return counts
    rows = None if name == "grad" else torch.empty(n, dtype=torch.float32)
    cw, g = (None if x is None else x.contiguous() for x in (cw, g))  # a strided class weight's slice
    lib.cutbce_tile(_address(z), _address(cw), _address(g), _address(out), _address(rows), n, v, threads)
    return rows


def _address(x: torch.Tensor | None):
    """The data address the kernel reads or writes (None stays NULL); it indexes densely, in float32."""
    if x is None:
        return None
    if not (x.is_contiguous() and x.dtype == torch.float32 and x.device.type == "cpu"):
        raise ValueError(f"the CPU tile kernel takes contiguous float32 CPU tensors, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()} on {x.device}")
    return x.data_ptr()


# -- which tile runs ------------------------------------------------------------------------------------

TILES = ("c_kernel", "compiled", "eager")  # the candidates for plain float32 CPU tiles, the default first


def _compiling_allowed() -> bool:
    return not _compile_failed and not cpu_tile_build.disabled()


def _plain_cpu_tile() -> str:
    """The tile for plain float32 CPU tiles: `TORCH_CUTBCE_TILE` if it names one that is available;
    else, where the C kernel builds, the tile the tuning command chose (`_tuned_cpu_tile`) or the C
    kernel; else torch.compile's tile, or the eager one without a C++ compiler. Nothing is timed here.
    Env read (and a bad value refused) per call, also when builds are off."""
    forced = tile_choice.forced(TILES)
    if cpu_tile_build.disabled():
        return "eager"
    if forced == "eager" or (forced == "compiled" and _cpu_compiling_allowed()):
        return forced  # without building the C kernel
    if _cpu_library() is None:
        return "compiled" if _cpu_compiling_allowed() else "eager"
    tuned = None if forced else _tuned_cpu_tile()  # forced: the C kernel, or 'compiled' where it cannot compile
    if tuned is not None and (tuned.name != "compiled" or _cpu_compiling_allowed()):
        return tuned.name
    return tile_choice.DEFAULT


@functools.cache
def _tuned_cpu_tile() -> tile_choice.Choice | None:
    """The choice `python -m torch_cutbce.native.tune_tiles` cached for this kernel build and torch version
    (read once per process), or None: the C kernel."""
    return tile_choice.cached(tuned_path(), TILES)


def tuned_path():
    """Where the tuned choice of this machine's kernel build and torch version is kept (the kernel
    built first, said as its build)."""
    return tile_choice.cache_path(cpu_tile_build.library_path(_cpu_library()), "torch", torch.__version__)


def available_tiles() -> tuple[str, ...]:
    """The candidates that can run here: the C kernel where it builds, torch.compile's tile where it
    can compile, the eager one always."""
    if cpu_tile_build.disabled():
        return ("eager",)
    return tuple(tile for tile in TILES if (tile != "c_kernel" or _cpu_library() is not None)
                 and (tile != "compiled" or _cpu_compiling_allowed()))


def _tile_for(name: str, z: torch.Tensor) -> str:
    if name in _CPU_KERNEL_FUNCTIONS and z.dtype == torch.float32 and z.device.type == "cpu":
        tile = _plain_cpu_tile()
        return "eager" if tile == "compiled" and min(z.shape) < 2 else tile  # as _can_compile
    tile_choice.forced(TILES)  # not used on these paths, but a bad TORCH_CUTBCE_TILE is an error on every one
    return "compiled" if _can_compile(z) else "eager"  # another Loss, CUDA, float64, bfloat16


def _tile_function(name: str, form: Form | None = None) -> Callable:
    """The uncompiled tile function `name`: the plain one, or a `Loss` form's (`_loss_functions`)."""
    return _FUNCTIONS[name] if form is None else _loss_functions(form)[name]


@functools.cache
def _compiled(name: str, threads: int, form: Form | None = None):
    # dynamic=True: the ragged last tile and every (N, block_v) share one compiled kernel.
    # cpp.threads: inductor bakes the thread count into the C++ (`omp parallel num_threads(2)`, or
    # no OpenMP at all for 1) but leaves it out of its on-disk cache key, so a kernel compiled in a
    # one-thread process would be served, single-threaded, to every later process. Stated
    # explicitly, it is part of the key (and a new thread count compiles anew).
    # fp-contract: the C++ compiler fuses the polynomials' multiply-adds into FMAs (one rounding
    # instead of two, so no less exact): about 10% off the tile function (benchmarks/NOTES.md section 7).
    options = {"cpp.threads": threads, "cpp.enable_floating_point_contract_flag": "fast"}
    return torch.compile(_tile_function(name, form), dynamic=True, fullgraph=True, options=options)


class TileCompileWarning(UserWarning):
    """torch_cutbce's first-call messages, each naming the caller's line: before the CPU kernel is
    built (once per machine), and before the plain tile functions, or another `Loss` form's, are
    first compiled by torch.compile in a process (once per process and form; plain float32 CPU tiles only
    where `TORCH_CUTBCE_TILE` or the tuning command chose torch.compile's tile, or the kernel cannot
    be built)."""


def _warn(message: str) -> None:
    """`message` as a TileCompileWarning at the user's line (the first frame outside torch_cutbce,
    jax_kernels and torch: the call of the loss, or of its backward)."""
    cpu_tile_build.warn_at_caller(message, TileCompileWarning)


def _form_of(compile_key: str) -> str:
    """The `Loss` form a `_compile_seconds` key names ('' for the plain tile functions)."""
    return compile_key.partition(" ")[2]


def _announce_compile(form: Form | None, z: torch.Tensor) -> None:
    what, once = ("", "once per process") if form is None else (
        "loss-option ", f"once per process and Loss form (this one: {form})")
    where = "CUDA (Triton)" if z.device.type == "cuda" else "the CPU"
    _warn(f"torch_cutbce: compiling the float32 {what}tile functions for {where} with torch.compile, {once}: "
          f"10-60 s the first time on a machine, 5-20 s once inductor's on-disk cache holds them; "
          f"TORCH_CUTBCE_NO_COMPILE=1 skips this (eager tiles, about 2x slower)")


@functools.lru_cache(maxsize=8)
def _ones_row(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The class weight of a tile without one (read only; cached: one allocation per tile width)."""
    return torch.ones((1, width), dtype=dtype, device=device)


def _can_compile(z: torch.Tensor) -> bool:
    global _no_cxx_said
    if not _compiling_allowed() or z.dtype != torch.float32 or min(z.shape) < 2:
        return False
    if z.device.type == "cpu":
        if _cxx_problem() is not None and not _no_cxx_said:
            _no_cxx_said = True
            _warn(f"torch_cutbce: {_cxx_problem()}")
        return _cxx_problem() is None
    if z.device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return False


def _run(name: str, z: torch.Tensor, *args):
    """`args` are `(cw, g, out)`, `(cw,)` or none (counts); the `loss_*` functions take the `Loss`
    after cw."""
    tile = _tile_for(name, z)
    if tile == "c_kernel":
        return _run_cpu_kernel(name, z, *args)
    if tile == "compiled":
        return _run_compiled(name, z, *args)
    return _EAGER[name](z, *args)


def _run_compiled(name: str, z: torch.Tensor, *args):
    """`name`'s compiled function; the first compile in the process of the plain functions, and of
    each `Loss` form's, is said first."""
    global _compile_failed
    # One kernel per function, compiled once: dynamo guards on aliasing and on whether a small input
    # is a view, so a missing class weight becomes its own ones row (one multiply per element) and
    # the `[1, bv]` / `[bn, 1]` inputs are passed as tensors of their own (a copy of a few KiB).
    # A Loss becomes its `_loss_params` tensor and the kernel's form.
    form, tensors = None, args
    if name.startswith("loss"):
        form, tensors = args[1].form(), (args[0], _loss_params(args[1], z.dtype, z.device), *args[2:])
    compiled_args = [
        _ones_row(z.shape[1], z.dtype, z.device) if a is None and k == 0
        else (a.clone() if a is not None and k < 2 and a._base is not None else a)
        for k, a in enumerate(tensors)
    ]
    key = name if form is None else f"{name} {form}"  # each Loss form is a compile of its own
    first = key not in _compile_seconds
    if first and not any(_form_of(other) == _form_of(key) for other in _compile_seconds):
        _announce_compile(form, z)
    start = time.perf_counter()
    try:
        with torch.no_grad():  # as inside the autograd Functions: one grad mode, one compiled kernel
            out = _compiled(name, torch.get_num_threads(), form)(z, *compiled_args)
    except Exception as error:  # a missing compiler, an inductor bug: the eager twin is exact too
        _compile_failed = True
        _warn(f"torch_cutbce: torch.compile of the tile function failed ({_first_line(error)}); "
              f"using eager tiles from now on (set TORCH_CUTBCE_NO_COMPILE=1 to skip the attempt)")
        return _EAGER[name](z, *args)
    if first:
        _compile_seconds[key] = time.perf_counter() - start
    return out


def _first_line(error: Exception) -> str:
    """`error` in one line: its type and first line (inductor's errors run on for pages)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else repr(error)


# Shapes: z and out `[bn, bv]` (contiguous), cw `[1, bv]` or None, g `[bn, 1]`.


def rows(z: torch.Tensor, cw: torch.Tensor | None, loss: Loss = PLAIN) -> torch.Tensor:
    """`sum_v cw[v] term(z[n, v])` `[bn]`: each row's loss over the tile's negatives (`loss`: a
    `cutbce_common.loss.Loss`; plain: `term = softplus`)."""
    return _run("rows", z, cw) if loss.plain else _run("loss_rows", z, cw, loss)


def rows_grad(z: torch.Tensor, cw: torch.Tensor | None, g: torch.Tensor, out: torch.Tensor,
              loss: Loss = PLAIN) -> torch.Tensor:
    """`rows(z, cw, loss)`, and writes `dz = g cw term'(z)` for the row gradient `g` into `out`."""
    return _run("rows_grad", z, cw, g, out) if loss.plain else _run("loss_rows_grad", z, cw, loss, g, out)


def grad(z: torch.Tensor, cw: torch.Tensor | None, g: torch.Tensor, out: torch.Tensor, loss: Loss = PLAIN) -> None:
    """Writes `dz = g cw term'(z)` for the row gradient `g` into `out`."""
    if loss.plain:
        _run("grad", z, cw, g, out)
    else:
        _run("loss_grad", z, cw, loss, g, out)


def counts(z: torch.Tensor) -> torch.Tensor:
    """`[bn]` float32: the predicted positives `#{v : z > 0}` of each row."""
    return _run("counts", z)
