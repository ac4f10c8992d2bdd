"""JAX implementations of CutBCE: dense reference, blocked pure-JAX loop, Pallas TPU kernels.

Never imports torch. Public names load lazily (PEP 562) so that `cutbce_common.shapes`, which
torch_cutbce uses for its argument checks, does not import jax.
"""

# One entry (`cut_bce`, the mesh an option of it), its oracle and its option type. The engines
# (`core`, `blocked`, `pallas_*`, `sharded`) are modules of their own, for the torch_xla bridge
# and the tests, not entries.
_PUBLIC = {
    "cut_bce": "jax_kernels.api",
    "dense_cut_bce": "jax_kernels.reference",
    "Focal": "cutbce_common.focal",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jax_kernels' has no attribute {name!r}")
