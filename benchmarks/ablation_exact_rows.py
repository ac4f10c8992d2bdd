"""The price of exact rows (issue 11): positives taken out of the tile vs background + sparse correction.

    .venv/bin/python benchmarks/ablation_exact_rows.py            # N=4096 D=64 V=32768 L=8 float32, 11 rounds

One process, interleaved rounds, medians. "before" is the engine code of commit c6712c3, frozen in
benchmarks/frozen/before_exact_rows/ (background + correction: softplus(z) summed, z subtracted
at the positives); "after" is the shipped code (each element's own branch inside the tile, the
tile's positives marked by a scatter). Both run the same Function / custom_vjp entry with the same
inputs (`providers.make_numpy_inputs`: a quarter of the slots padding, duplicates), 'mean'
reduction, fwd+bwd. Bounds from the issue: after <= 1.05 x before, after <= 1.3 x the 3-matmul floor
(each path against its own framework's matmuls: torch's `mm_floor` for native, the same loop jitted
for JAX).
"""

from __future__ import annotations

import argparse
import sys

import providers as P
from ablation import interleave


def native_variants(shape, block_v):
    import torch

    from frozen.before_exact_rows import torch_native as before
    from torch_cutbce import ops as after

    h0, e0, t0 = (torch.tensor(a) for a in P.make_numpy_inputs(shape))
    divisor = float(shape.num_positions * shape.num_items)

    def step_before():
        h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
        loss, _ = before.NativeCutBCELoss.apply(h, e, None, None, None, None, t0, divisor, block_v, False, True)
        loss.backward()

    def step_after():
        h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
        loss, _ = after.loss(h, e, None, None, None, None, t0, divisor=divisor, block_v=block_v, compute_metrics=False)
        loss.backward()

    return {
        "native before (background + correction)": step_before,
        "native after (exact tiles)": step_after,
        "mm_floor (3 blocked matmuls)": P.setup("mm_floor", shape, "fwd+bwd", block_v=block_v).step,
    }


def jax_variants(shape, block_v):
    import jax
    import jax.numpy as jnp

    from frozen.before_exact_rows import jax_core as before
    from jax_kernels import core as after

    h, e, t = P.make_numpy_inputs(shape)
    h, e, t = jnp.asarray(h), jnp.asarray(e), jnp.asarray(t, jnp.int32)
    n, v = shape.num_positions, shape.num_items
    row_weight = jnp.full((n,), 1.0 / (n * v), jnp.float32)

    def one_pass(module):
        config = module.CutBCEConfig(block_v=block_v)

        def loss(h, e):
            return module.cut_bce_weighted_sum(config, h, e, t, None, None, None, row_weight)[0]

        c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, e).compile()
        return lambda: jax.block_until_ready(c(h, e))

    def two_pass(module):
        config = module.CutBCEConfig(block_v=block_v)

        def loss(h, e):
            return module.cut_bce_rows(config, h, e, t, None, None, None)[0].sum() / (n * v)

        c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, e).compile()
        return lambda: jax.block_until_ready(c(h, e))

    def matmul_floor():
        # The JAX twin of mm_floor: the blocked loop's three matmuls per tile (its table-gradient
        # product included, `blocked._table_grad_tile`) in one jitted loop, nothing else. XLA:CPU's
        # matmuls are not MKL's, so the JAX path is held to XLA's own rate.
        from jax_kernels.blocked.loop import _table_grad_tile

        def loop(h, e):
            def tile(k, carry):
                d_h, d_e = carry
                e_t = jax.lax.dynamic_slice_in_dim(e, k * block_v, block_v)
                z = h @ e_t.T
                return d_h + z @ e_t, jax.lax.dynamic_update_slice_in_dim(d_e, _table_grad_tile(h, z), k * block_v, 0)

            return jax.lax.fori_loop(0, v // block_v, tile, (jnp.zeros_like(h), jnp.zeros_like(e)))

        c = jax.jit(loop).lower(h, e).compile()
        return lambda: jax.block_until_ready(c(h, e))

    return {
        "JAX mm_floor (3 blocked matmuls)": matmul_floor(),
        "JAX blocked one-pass before": one_pass(before),
        "JAX blocked one-pass after": one_pass(after),
        "JAX blocked two-pass before": two_pass(before),
        "JAX blocked two-pass after": two_pass(after),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-positions", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-items", type=int, default=32768)
    parser.add_argument("--block-v", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--frameworks", choices=["torch", "jax", "both"], default="both",
                        help="time one framework's variants alone (no other framework's threads in the process)")
    args = parser.parse_args(argv)
    if args.num_items % args.block_v:
        parser.error("--num-items must be a multiple of --block-v (the JAX floor loops over whole tiles)")
    import torch

    shape = P.Shape(args.num_positions, args.hidden_size, args.num_items)
    print(f"torch threads {torch.get_num_threads()}, {shape.label()}, block_v={args.block_v}, fwd+bwd 'mean'")
    variants = {}
    if args.frameworks in ("torch", "both"):
        variants.update(native_variants(shape, args.block_v))
    if args.frameworks in ("jax", "both"):
        P.prepare(["jax_blocked"])
        variants.update(jax_variants(shape, args.block_v))
    medians = interleave(variants, args.rounds)
    for name, m in medians.items():
        print(f"  {name:45s} {m * 1e3:9.1f} ms")
    floor, jax_floor = medians.get("mm_floor (3 blocked matmuls)"), medians.get("JAX mm_floor (3 blocked matmuls)")
    for label, before, after, own_floor in (
        ("native", "native before (background + correction)", "native after (exact tiles)", floor),
        ("JAX one-pass", "JAX blocked one-pass before", "JAX blocked one-pass after", jax_floor),
        ("JAX two-pass", "JAX blocked two-pass before", "JAX blocked two-pass after", jax_floor),
    ):
        if after in medians:
            torch_floor = f"   after / torch mm_floor = {medians[after] / floor:.3f}" if floor else ""
            print(f"  {label:14s} after / before = {medians[after] / medians[before]:.3f}   "
                  f"after / own framework's floor = {medians[after] / own_floor:.3f}{torch_floor}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
