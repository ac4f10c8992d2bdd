"""The framework-neutral foundation of torch_cutbce and jax_kernels: imports neither torch nor jax.

What a call computes (`loss`: `Loss`, `focal`: `Focal`), the call's options as one value, the one
config type of the torch custom ops and the JAX engines (`options`), the argument rules and tile
sizes (`shapes`), and the float32 CPU tile kernel with its build and its per-machine choice
(`cpu_tile.c`, `cpu_tile_ffi.cc`, `cpu_tile_build`, `tile_choice`): whoever works on the CPU kernel
works here, whichever framework calls it.
tests/test_repo_layout.py holds the rule that nothing here imports a framework.
"""
