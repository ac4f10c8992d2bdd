"""The elementwise work on one `[block_n, block_v]` logits tile, fused and compiled once per process.

Each function is one pass over the tile (the matmuls around them stay in `native.py`):

    rows(z, cw)          -> sum_v cw[v] softplus(z[n, v])
    rows_grad(z, g, cw, out) -> the same, and writes dz = g[n] cw[v] sigmoid(z) into `out`
    grad(z, g, cw, out)      -> writes dz = g[n] cw[v] sigmoid(z) into `out`
    counts(z)            -> #{v : z[n, v] > 0}   (metrics only; a separate pass, see below)

One exponential serves both softplus and sigmoid (e = exp(-|z|) is in (0, 1], never overflows):

    softplus(z) = max(z, 0) + log1p(e)
    sigmoid(z)  = 1 / (1 + e)   if z >= 0,   e / (1 + e)   otherwise

Both are exact to float rounding for any z (no cancellation: 1 + e is in [1, 2]).

log1p is the expensive part (Sleef's vectorized log1p costs about 4x an exp here, as log1p does on
XLA:CPU), so the compiled float32 functions evaluate it on e in (0, 1] as

    log1p(e) = 2 atanh(t) = 2 t P(t^2),   t = e / (2 + e) in (0, 1/3]

with P the degree-4 least-squares fit of atanh(sqrt(s)) / sqrt(s) on s in [0, 1/9]: relative
error 4e-9 everywhere, including e -> 0 (below float32's rounding, 6e-8), for one divide and five
multiply-adds. The eager twins call torch.log1p.

float32 tiles (the accumulation dtype of float32, bfloat16 and float16 inputs) run a
`torch.compile`d version of each function: inductor fuses the exp, log1p, divide, row sums and the
store of dz into one vectorized C++ loop (Triton on CUDA), where eager PyTorch makes about ten
passes over the tile. The tile sizes are dynamic (compiled once, not per shape). Everything else
runs the eager twin, which does the same math with in-place ops:
- float64 tiles (the precision path; compiling it too would double the first-call cost),
- tiles with a side of length 1 (dynamo specializes sizes 0 and 1: that would recompile),
- `TORCH_CUTBCE_NO_COMPILE=1` in the environment (read at call time),
- devices without a compiler (CUDA without triton), and any failure to compile (warned once).

dz goes to a second buffer, not back into z: asked to overwrite its input, inductor 2.9 either
allocated a temporary tile and copied it back (a second pass and a second tile) or, with the counts
in the same function, scheduled the count's read of z after the store (it counted dz > 0). With a
distinct `out` it writes dz in the same loop that reads z. The counts are a separate read-only
pass, taken only when metrics are asked for. tests/test_l1_fast_paths.py checks every compiled
function against its eager twin.

`compile_seconds()` reports what the first call of each compiled function cost in this process
(inductor also caches compiled code on disk, so a second process pays less).
"""

from __future__ import annotations

import functools
import os
import time
import warnings

import torch

_compile_seconds: dict[str, float] = {}
_compile_failed = False


def compile_seconds() -> dict[str, float]:
    """Seconds the first call of each compiled tile function took in this process (compile + one run)."""
    return dict(_compile_seconds)


# -- the compiled functions (float32) --------------------------------------------------------------


def _log1p_unit(e):
    """log1p(e) for e in [0, 1]: 2 t P(t^2) with t = e / (2 + e).

    P(s) ~ atanh(sqrt(s)) / sqrt(s) on [0, 1/9], lowest order first (least squares in float64; see
    the module docstring). The coefficients are literals, not a global tuple: dynamo would lift
    global floats into float64 graph inputs.
    """
    return _log1p_from_t(e / (2 + e))


def _log1p_from_t(t):
    """2 atanh(t) = 2 t P(t^2): log1p(e) given t = e / (2 + e)."""
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2 * t * (1.0000000038619887 + s * p)


def _rows(z, cw):
    # t = e / (2 + e) written as 1 / (2 exp(|z|) + 1), so that the exponential has one user: inductor
    # on CPU writes an exp with several users to memory before a reduction (two loops over the tile),
    # one user keeps one loop, 1.7 -> 1.2 ns per element (NOTES.md). exp(|z|) = inf for |z| > 88
    # gives t = 0, the float32 log1p(e) there is a denormal (< 1e-38): flushed, not an error.
    # rows_grad's dz store shares the reduction's loop, and there everything fuses into one anyway.
    t = 1 / (2 * torch.exp(z.abs()) + 1)
    return ((torch.clamp_min(z, 0) + _log1p_from_t(t)) * cw).sum(-1)


def _rows_grad(z, cw, g, out):
    e = torch.exp(-z.abs())
    softplus = torch.clamp_min(z, 0) + _log1p_unit(e)
    sigmoid = torch.where(z >= 0, 1.0, e) / (1 + e)
    rows = (softplus * cw).sum(-1)
    out.copy_(sigmoid * (g * cw))
    return rows


def _grad(z, cw, g, out):
    e = torch.exp(-z.abs())
    out.copy_(torch.where(z >= 0, 1.0, e) / (1 + e) * (g * cw))


def _counts(z):
    return (z > 0).sum(-1, dtype=torch.float32)


_FUNCTIONS = {"rows": _rows, "rows_grad": _rows_grad, "grad": _grad, "counts": _counts}


# -- eager twins: the same formulas, in place, at most two extra tiles alive ----------------------


def _eager_exp_neg_abs(z):
    return z.abs().neg_().exp_()


def _eager_rows(z, e, cw):
    softplus = torch.log1p(e).add_(z.clamp(min=0))
    return softplus.sum(-1) if cw is None else softplus @ cw[0]


def _eager_rows_only(z, cw):
    return _eager_rows(z, _eager_exp_neg_abs(z), cw)


def _eager_sigmoid_into(out, z, e, g, cw):
    denominator = e + 1
    e.masked_fill_(z >= 0, 1.0)
    torch.div(e, denominator, out=out)
    out.mul_(g)
    if cw is not None:
        out.mul_(cw)


def _eager_rows_grad(z, cw, g, out):
    e = _eager_exp_neg_abs(z)
    rows = _eager_rows(z, e, cw)
    _eager_sigmoid_into(out, z, e, g, cw)
    return rows


def _eager_grad(z, cw, g, out):
    _eager_sigmoid_into(out, z, _eager_exp_neg_abs(z), g, cw)


def _eager_counts(z):
    return (z > 0).sum(-1, dtype=torch.float32)


_EAGER = {"rows": _eager_rows_only, "rows_grad": _eager_rows_grad, "grad": _eager_grad, "counts": _eager_counts}


# -- dispatch -----------------------------------------------------------------------------------------


@functools.cache
def _compiled(name: str, threads: int):
    # dynamic=True: the ragged last tile and every (N, block_v) share one compiled kernel.
    # cpp.threads: inductor bakes the thread count into the C++ (`omp parallel num_threads(2)`, or
    # no OpenMP at all for 1) but leaves it out of its on-disk cache key, so a kernel compiled in a
    # one-thread process would be served, single-threaded, to every later process. Stated
    # explicitly, it is part of the key (and a new thread count compiles anew).
    return torch.compile(_FUNCTIONS[name], dynamic=True, fullgraph=True, options={"cpp.threads": threads})


def _can_compile(z: torch.Tensor) -> bool:
    if _compile_failed or os.environ.get("TORCH_CUTBCE_NO_COMPILE", "") not in ("", "0"):
        return False
    if z.dtype != torch.float32 or min(z.shape) < 2:
        return False
    if z.device.type == "cpu":
        return True
    if z.device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return False


def _run(name: str, z: torch.Tensor, *args):
    """`args` are `(cw, g, out)` or a prefix of it (counts: none)."""
    global _compile_failed
    if not _can_compile(z):
        return _EAGER[name](z, *args)
    compiled_args = args
    if args and args[0] is None:  # one kernel for both: a ones row costs one multiply per element
        compiled_args = (torch.ones((1, z.shape[1]), dtype=z.dtype, device=z.device), *args[1:])
    first = name not in _compile_seconds
    start = time.perf_counter()
    try:
        out = _compiled(name, torch.get_num_threads())(z, *compiled_args)
    except Exception as error:  # a missing compiler, an inductor bug: the eager twin is exact too
        _compile_failed = True
        warnings.warn(f"torch_cutbce: torch.compile of the tile function failed ({error!r}); "
                      f"using eager tiles from now on (set TORCH_CUTBCE_NO_COMPILE=1 to skip the attempt)")
        return _EAGER[name](z, *args)
    if first:
        _compile_seconds[name] = time.perf_counter() - start
    return out


def rows(z: torch.Tensor, cw: torch.Tensor | None) -> torch.Tensor:
    """`sum_v cw[v] softplus(z[n, v])` `[bn]` of a logits tile `z [bn, bv]`; `cw [1, bv]` or None."""
    return _run("rows", z, cw)


def rows_grad(z: torch.Tensor, g: torch.Tensor, cw: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """`rows(z, cw)`, and writes `dz = g cw sigmoid(z)` into `out` (contiguous, like z); `g [bn, 1]`."""
    return _run("rows_grad", z, cw, g, out)


def grad(z: torch.Tensor, g: torch.Tensor, cw: torch.Tensor | None, out: torch.Tensor) -> None:
    """Writes `dz = g cw sigmoid(z)` into `out` (contiguous, like z)."""
    _run("grad", z, cw, g, out)


def counts(z: torch.Tensor) -> torch.Tensor:
    """`#{v : z[n, v] > 0}` `[bn]` float32: the metrics' predicted positives."""
    return _run("counts", z)
