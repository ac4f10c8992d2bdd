"""The blocked loop's negatives: each tile's loss rows and gradient with its positives taken out.

`z [N, bv]` holds every logit of the tile with the row's positives at -inf (their loss and
gradient are 0 here; loop.py gives them their own branch). Every other element is a negative:
loss `w softplus(z)`, gradient `g w sigmoid(z)` (or the `Loss`'s terms; the math: `branch_math.py`),
with `w [bv]` the tile's column weight. `NegativeTile(loss, cpu_kernel)` has

    rows(z, w)          -> sum_v w loss                   [N]
    rows_grad(z, w, g)  -> (rows, dz)                     dz may reuse z's buffer
    grad(z, w, g)       -> dz

On the CPU, float32 plain BCE runs the C kernel `cpu_tile.c` through XLA's FFI: one pass over the
tile that writes dz over z, where XLA:CPU's own fusions read the tile several times and make the
row sums a slow reduction (benchmarks/results/cpu_speed.md, 'The tile kernel'). Nothing is timed on the first call: the
kernel runs wherever its FFI wrapper builds, unless `python -m torch_cutbce.tune_tiles --framework jax` measured
the jnp tile faster over the whole forward + backward on this machine (`_tuned_tile`; the command,
which runs the entry above this module, is `torch_cutbce/tune_tiles.py`). Everywhere else
(GPU, TPU lowering, float64, another `Loss`, the torch_xla bridge, no C++ compiler,
TORCH_CUTBCE_NO_COMPILE=1, TORCH_CUTBCE_TILE=xla, or that tuned choice) the same math runs as jnp. Both sum a row of any width to a few roundings (the kernel through a
double, jnp pairwise on the CPU: `_halving_row_sum`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from cutbce_common import cpu_tile_build, tile_choice
from jax_kernels.branch_math import branch_terms
from jax_kernels.compensated import pairwise_sum

@functools.cache
def _ffi_registered() -> bool:
    """Builds (said first, once per machine) and registers the FFI handlers once; False (said once)
    where they cannot be built."""
    try:
        lib = _ffi_library()
    except cpu_tile_build.BuildError as error:
        cpu_tile_build.warn_at_caller(f"jax_kernels: the CPU tile kernel could not be built ({error}); "
                                      f"using jnp tiles", tile_choice.TileChoiceWarning)
        return False
    for name in cpu_tile_build.FFI_SYMBOLS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return True


TILES = ("c_kernel", "xla")  # TORCH_CUTBCE_TILE's values here; torch's 'compiled' / 'eager' mean 'xla'


def _kernel_chosen() -> bool:
    """Whether float32 CPU tiles run the C kernel: as TORCH_CUTBCE_TILE says (read at trace time),
    else wherever the FFI wrapper builds, unless the tuning command chose the jnp tile here."""
    forced = tile_choice.forced(TILES + ("compiled", "eager"))
    if forced is not None:
        return forced == "c_kernel" and _ffi_registered()
    return _ffi_registered() and _tuned_tile() == "c_kernel"


def _ffi_library():
    return cpu_tile_build.ffi_library(jax.ffi.include_dir(), tile_choice.TileChoiceWarning)


def tuned_path():
    """Where the tuned choice of this machine's FFI build and jax version is kept."""
    return tile_choice.cache_path(cpu_tile_build.library_path(_ffi_library()), "jax", jax.__version__)


@functools.cache
def _tuned_tile() -> str:
    """The tile `python -m torch_cutbce.tune_tiles --framework jax` cached for this build and jax version (read
    once per process), else the C kernel."""
    choice = tile_choice.cached(tuned_path(), TILES)
    return tile_choice.DEFAULT if choice is None else choice.name


def _threads() -> np.int32:
    return np.int32(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _on_cpu(kernel, portable, *args):
    """`kernel` where the computation is lowered for the CPU, `portable` on any other platform."""
    return jax.lax.platform_dependent(*args, cpu=kernel, default=portable)


# -- the FFI calls (CPU, float32) ----------------------------------------------------------------------


# vmap_method: under jax.vmap the batch runs as a loop of calls (the handlers take one [n, v] tile).


def _kernel_rows(z, w):
    out = jax.ShapeDtypeStruct(z.shape[:1], jnp.float32)
    return jax.ffi.ffi_call("cutbce_rows", out, vmap_method="sequential")(z, w, threads=_threads())


def _kernel_rows_grad(z, w, g):
    out = (jax.ShapeDtypeStruct(z.shape, jnp.float32), jax.ShapeDtypeStruct(z.shape[:1], jnp.float32))
    call = jax.ffi.ffi_call("cutbce_rows_grad", out, input_output_aliases={0: 0}, vmap_method="sequential")
    dz, rows = call(z, w, g, threads=_threads())
    return rows, dz


def _kernel_grad(z, w, g):
    out = jax.ShapeDtypeStruct(z.shape, jnp.float32)
    call = jax.ffi.ffi_call("cutbce_grad", out, input_output_aliases={0: 0}, vmap_method="sequential")
    return call(z, w, g, threads=_threads())


# -- the same in jnp ----------------------------------------------------------------------------------


def _halving_row_sum(x):
    """`x.sum(-1)` as a pairwise sum: the first half of the columns added to the second until 256
    are left. XLA:CPU adds a row in a few float32 lanes, so a row of 2**21 equal terms drifts by
    1e-3; halving keeps it to about log2(width) roundings, for about one more pass over the tile."""
    return pairwise_sum(x, axis=-1, leaves=256)


def _weighted_row_sum(loss, w):
    """`loss @ w`, pairwise where it is lowered for the CPU (GPU and TPU reduce as trees already)."""
    return jax.lax.platform_dependent(loss, w, cpu=lambda x, w: _halving_row_sum(x * w), default=jnp.matmul)


def _portable_rows(z, w, loss=None):
    return _weighted_row_sum(branch_terms(z, False, loss)[0], w)


def _tile_grad(z, slope, w, g):
    """`g w slope`, exactly 0 at the positives taken out (z = -inf) also for an infinite g w."""
    return jnp.where(z == -jnp.inf, 0, g[:, None] * slope * w)


def _portable_rows_grad(z, w, g, loss=None):
    value, slope = branch_terms(z, False, loss)
    return _weighted_row_sum(value, w), _tile_grad(z, slope, w, g)


def _portable_grad(z, w, g, loss=None):
    return _tile_grad(z, branch_terms(z, False, loss)[1], w, g)


# -- what loop.py calls -------------------------------------------------------------------------------


class NegativeTile:
    """The three tile functions for one call: of its `Loss` (None: plain), kernel allowed or not
    (`cpu_kernel`: `CutBCEOptions.cpu_kernel`; the kernel runs only for plain float32 tiles lowered for
    the CPU)."""

    def __init__(self, loss=None, cpu_kernel: bool = True):
        self.loss, self.cpu_kernel = loss, cpu_kernel

    def _kernel(self, z) -> bool:
        # A TPU or GPU host does not build the kernel (its computations lower for the accelerator).
        return (self.cpu_kernel and (self.loss is None or self.loss.plain) and z.dtype == jnp.float32
                and jax.default_backend() == "cpu" and not cpu_tile_build.disabled() and _kernel_chosen())

    def rows(self, z, w):
        if self._kernel(z):
            return _on_cpu(_kernel_rows, _portable_rows, z, w)
        return _portable_rows(z, w, self.loss)

    def rows_grad(self, z, w, g):
        if self._kernel(z):
            return _on_cpu(_kernel_rows_grad, _portable_rows_grad, z, w, g)
        return _portable_rows_grad(z, w, g, self.loss)

    def grad(self, z, w, g):
        if self._kernel(z):
            return _on_cpu(_kernel_grad, _portable_grad, z, w, g)
        return _portable_grad(z, w, g, self.loss)
