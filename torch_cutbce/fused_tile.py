"""The elementwise work on one `[block_n, block_v]` logits tile, fused and compiled once per process.

Each element is a negative or a positive of its row (`y`, a boolean tile from
`positives.TileTargets`), and its loss is chosen element by element (DESIGN.md section 2):

    l  = cw pw softplus(-z)        if y      (a positive)
         cw softplus(z)             otherwise
    dz = -g cw pw sigmoid(-z)       if y
         g cw sigmoid(z)            otherwise

Written with `zs = where(y, -z, z)` (the logit seen from the element's own label) this is
`weight * softplus(zs)` and `+-g weight sigmoid(zs)`, `weight = cw * where(y, pw, 1)`: no
`softplus(z) - z`, so a confident positive's tiny loss is never lost in a sum. One exponential
e = exp(-|z|) in (0, 1] serves both: softplus(zs) = max(zs, 0) + log1p(e) and
sigmoid(zs) = where(zs >= 0, 1, e) / (1 + e), exact to rounding for any z.

    rows(z, y, cw, pw)                -> sum_v l[n, v]
    rows_grad(z, y, cw, pw, g, out)   -> the same, and writes dz into `out`
    grad(z, y, cw, pw, g, out)        -> writes dz into `out`
    counts(z, y)                      -> [2, bn]: #{v : z > 0} and #{v : y and z > 0} (metrics)

float32 tiles run a `torch.compile`d version (one vectorized loop per function, where eager
PyTorch makes about ten passes), with log1p as a polynomial (`_log1p_unit`, relative error 4e-9:
Sleef's log1p costs about 4 exps). Everything else runs the eager twin: float64 tiles, tiles with
a side of length 1 (dynamo would specialize and recompile), `TORCH_CUTBCE_NO_COMPILE=1`, devices
without a compiler, and any failure to compile (warned once). dz goes to a distinct buffer
`out`: asked to overwrite z, inductor 2.9 made a second pass. Measurements: benchmarks/NOTES.md;
tests/test_fast_paths.py checks every compiled function against its eager twin.
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
    """log1p(e) for e in [0, 1]: 2 atanh(t) = 2 t P(t^2) with t = e / (2 + e) in [0, 1/3].

    P(s) ~ atanh(sqrt(s)) / sqrt(s) on [0, 1/9] (a degree-4 least-squares fit in float64), relative
    error 4e-9 for every e, e -> 0 included. The coefficients are literals, not a global tuple:
    dynamo would lift global floats into float64 graph inputs.
    """
    return _log1p_from_t(e / (2 + e))


def _log1p_from_t(t):
    """2 atanh(t) = 2 t P(t^2): log1p(e) given t = e / (2 + e)."""
    s = t * t
    p = 0.33333160203203005 + s * (0.20012325666897016 + s * (0.13982172352698377 + s * 0.1408072687843689))
    return 2 * t * (1.0000000038619887 + s * p)


def _rows(z, y, cw, pw):
    # t = e / (2 + e) written as 1 / (2 exp(|z|) + 1), so the exponential has one user: inductor on
    # CPU writes an exp with several users to memory before a reduction (two loops over the tile).
    # exp(|z|) = inf for |z| > 88 gives t = 0: log1p(e) is then below float32's smallest normal.
    zs = torch.where(y, -z, z)
    t = 1 / (2 * torch.exp(z.abs()) + 1)
    return ((torch.clamp_min(zs, 0) + _log1p_from_t(t)) * (cw * torch.where(y, pw, 1.0))).sum(-1)


def _rows_grad(z, y, cw, pw, g, out):
    e = torch.exp(-z.abs())
    zs = torch.where(y, -z, z)
    weight = cw * torch.where(y, pw, 1.0)
    rows = ((torch.clamp_min(zs, 0) + _log1p_unit(e)) * weight).sum(-1)
    sigmoid = torch.where(zs >= 0, 1.0, e) / (1 + e)
    out.copy_(torch.where(y, -sigmoid, sigmoid) * (g * weight))
    return rows


def _grad(z, y, cw, pw, g, out):
    e = torch.exp(-z.abs())
    zs = torch.where(y, -z, z)
    sigmoid = torch.where(zs >= 0, 1.0, e) / (1 + e)
    out.copy_(torch.where(y, -sigmoid, sigmoid) * (g * (cw * torch.where(y, pw, 1.0))))


def _counts(z, y):
    positive = z > 0
    return torch.stack([positive.sum(-1, dtype=torch.float32), (positive & y).sum(-1, dtype=torch.float32)])


_FUNCTIONS = {"rows": _rows, "rows_grad": _rows_grad, "grad": _grad, "counts": _counts}


# -- eager twins: the same formulas, in place where they can be ----------------------------------


def _eager_weight(y, cw, pw):
    """`cw * where(y, pw, 1)`: None (all ones), a `[1, bv]` row, or a `[bn, bv]` tile."""
    if pw is None:
        return cw
    return torch.where(y, pw if cw is None else pw * cw, 1.0 if cw is None else cw)


def _eager_signed(z, y):
    """`(zs, e)`: the logit seen from each element's label, and exp(-|z|)."""
    return torch.where(y, z.neg(), z), z.abs().neg_().exp_()


def _eager_rows(zs, e, weight):
    loss = e.log1p_().add_(zs.clamp_(min=0))  # consumes zs and e
    if weight is None:
        return loss.sum(-1)
    return loss @ weight[0] if weight.shape[0] == 1 else loss.mul_(weight).sum(-1)


def _eager_grad_into(out, zs, y, e, weight, g):
    torch.div(torch.where(zs >= 0, 1.0, e), e + 1, out=out)
    torch.where(y, out.neg(), out, out=out)
    out.mul_(g)
    if weight is not None:
        out.mul_(weight)


def _eager_rows_only(z, y, cw, pw):
    return _eager_rows(*_eager_signed(z, y), _eager_weight(y, cw, pw))


def _eager_rows_grad(z, y, cw, pw, g, out):
    zs, e = _eager_signed(z, y)
    weight = _eager_weight(y, cw, pw)
    _eager_grad_into(out, zs, y, e, weight, g)
    return _eager_rows(zs, e, weight)


def _eager_grad(z, y, cw, pw, g, out):
    zs, e = _eager_signed(z, y)
    _eager_grad_into(out, zs, y, e, _eager_weight(y, cw, pw), g)


_EAGER = {"rows": _eager_rows_only, "rows_grad": _eager_rows_grad, "grad": _eager_grad, "counts": _counts}


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


def _run(name: str, z: torch.Tensor, y: torch.Tensor, *args):
    """`args` are `(cw, pw, g, out)`, `(cw, pw)` or none (counts)."""
    global _compile_failed
    if not _can_compile(z):
        return _EAGER[name](z, y, *args)
    # One kernel per function, compiled once: dynamo guards on aliasing and on whether a small input
    # is a view, so a missing weight becomes its own ones row (one multiply per element) and the
    # `[1, bv]` / `[bn, 1]` inputs are passed as tensors of their own (a copy of a few KiB).
    compiled_args = [
        torch.ones((1, z.shape[1]), dtype=z.dtype, device=z.device) if a is None and k < 2
        else (a.clone() if a is not None and k < 3 and a._base is not None else a)
        for k, a in enumerate(args)
    ]
    first = name not in _compile_seconds
    start = time.perf_counter()
    try:
        with torch.no_grad():  # as inside the autograd Functions: one grad mode, one compiled kernel
            out = _compiled(name, torch.get_num_threads())(z, y, *compiled_args)
    except Exception as error:  # a missing compiler, an inductor bug: the eager twin is exact too
        _compile_failed = True
        warnings.warn(f"torch_cutbce: torch.compile of the tile function failed ({error!r}); "
                      f"using eager tiles from now on (set TORCH_CUTBCE_NO_COMPILE=1 to skip the attempt)")
        return _EAGER[name](z, y, *args)
    if first:
        _compile_seconds[name] = time.perf_counter() - start
    return out


# Shapes: z and out `[bn, bv]` (contiguous), y `[bn, bv]` bool, cw and pw `[1, bv]` or None, g `[bn, 1]`.


def rows(z: torch.Tensor, y: torch.Tensor, cw: torch.Tensor | None, pw: torch.Tensor | None) -> torch.Tensor:
    """`sum_v l[n, v]` `[bn]`: each row's loss over the tile (module docstring)."""
    return _run("rows", z, y, cw, pw)


def rows_grad(z, y, cw, pw, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`rows(z, y, cw, pw)`, and writes `dz` for the row gradient `g` into `out`."""
    return _run("rows_grad", z, y, cw, pw, g, out)


def grad(z, y, cw, pw, g: torch.Tensor, out: torch.Tensor) -> None:
    """Writes `dz` for the row gradient `g` into `out`."""
    _run("grad", z, y, cw, pw, g, out)


def counts(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`[2, bn]` float32: predicted positives `#{v : z > 0}` and hits `#{v : y and z > 0}` (the TP)."""
    return _run("counts", z, y)
