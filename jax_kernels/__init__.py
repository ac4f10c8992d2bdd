"""JAX implementations of CutBCE: dense reference, blocked pure-JAX loop, Pallas TPU kernels.

Never imports torch. Public names load lazily (PEP 562) so that `jax_kernels.shapes`, which
torch_cutbce uses for its argument checks, does not import jax.
"""

_PUBLIC = {
    "cut_bce": "jax_kernels.api",
    "cut_bce_sharded": "jax_kernels.sharded",
    "dense_cut_bce": "jax_kernels.reference",
    "Focal": "jax_kernels.focal",
    "CutBCEConfig": "jax_kernels.core",
    "cut_bce_forward": "jax_kernels.core",
    "cut_bce_backward": "jax_kernels.core",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jax_kernels' has no attribute {name!r}")
