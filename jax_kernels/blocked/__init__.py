"""The blocked JAX engine: a `lax` loop over vocabulary tiles (`loop`), each tile's negatives on the
CPU kernel or in jnp (`negative_tile`). Runs on every backend."""
