"""The native and blocked-JAX engines as they were before issue 11 (commit c6712c3), frozen for
benchmarks/ablation_exact_rows.py: background + sparse correction, the positives' softplus(z) - z
cancelled in the row sum. Only the blocked JAX path is frozen (impl='pallas' would import today's
kernels). Not used by the library or its tests."""
