"""Framework-neutral parts shared by torch_cutbce and jax_kernels: imports neither torch nor jax.

The argument rules (`shapes`), the options (`focal`; `options`, every static choice of a call as one
value for the torch custom ops), and the CPU tile kernel with its build and its per-machine choice (`cpu_tile.c`, `cpu_tile_ffi.cc`, `cpu_tile_build`, `tile_choice`).
tests/test_repo_layout.py holds the rule that nothing here imports a framework.
"""
