"""The native and blocked-JAX engines as they were before the speed work (commit 9e6b519), frozen
for benchmarks/ablation.py's "before" rows: the native Function recomputing each logits tile in
its backward with eager elementwise tiles, and the JAX loop with log1p and a masked row sum. Each
engine with the positives module it imported then (torch_cutbce/positives.py,
jax_kernels/positives.py). Not used by the library or its tests."""
