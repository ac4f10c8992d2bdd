"""The price of exact rows (issue 11): positives taken out of the tile vs background + sparse correction.

    .venv/bin/python benchmarks/ablation_exact_rows.py        # N=4096 D=64 V=32768 L=8 float32, 11 rounds
    .venv/bin/python benchmarks/ablation_exact_rows.py --frameworks torch

"Before" is commit c6712c3's engines (softplus(z) summed over every item, z subtracted at the
positives), imported through `at_commit`; "after" is the working tree's public entries. Interleaved
rounds, medians, 'mean' forward + backward, each path also against its own framework's three-matmul
floor (benchmarks/results/cpu_speed.md, 'Exact rows').
"""

from __future__ import annotations

import argparse
import sys

import at_commit
import provenance
import providers as P
from ablation import interleave

BEFORE = "c6712c3"  # the last commit before issue 11: background + sparse correction


def native_variants(shape, block_v):
    import torch

    from torch_cutbce import cut_bce_with_logits

    before = at_commit.load(BEFORE).module("torch_cutbce.native")

    h0, e0, t0 = (torch.tensor(a) for a in P.make_numpy_inputs(shape))
    divisor = float(shape.num_positions * shape.num_items)  # 'mean', as the "after" entry divides

    def step_before():
        h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
        loss, _ = before.NativeCutBCELoss.apply(h, e, None, None, None, None, t0, divisor, block_v, False, True)
        loss.backward()

    def step_after():
        h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
        cut_bce_with_logits(h, e, t0, block_v=block_v).backward()  # 'mean': divides by N V too

    return {
        "native before (background + correction)": step_before,
        "native after (exact tiles)": step_after,
        "mm_floor (3 blocked matmuls)": P.setup("mm_floor", shape, "fwd+bwd", block_v=block_v).step,
    }


def jax_variants(shape, block_v):
    import jax
    import jax.numpy as jnp

    import jax_kernels

    before = at_commit.load(BEFORE).module("jax_kernels.core")

    h, e, t = P.make_numpy_inputs(shape)
    h, e, t = jnp.asarray(h), jnp.asarray(e), jnp.asarray(t, jnp.int32)
    n, v = shape.num_positions, shape.num_items
    row_weight = jnp.full((n,), 1.0 / (n * v), jnp.float32)

    def compiled(loss):
        c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, e).compile()
        return lambda: jax.block_until_ready(c(h, e))

    config = before.CutBCEConfig(block_v=block_v)

    def before_one_pass(h, e):
        return before.cut_bce_weighted_sum(config, h, e, t, None, None, None, row_weight)[0]

    def before_two_pass(h, e):
        return before.cut_bce_rows(config, h, e, t, None, None, None)[0].sum() / (n * v)

    def after_one_pass(h, e):  # 'mean' takes the one-pass custom_vjp
        return jax_kernels.cut_bce(h, e, t, block_v=block_v, impl="blocked")

    def after_two_pass(h, e):  # 'none' takes rows, then a backward that recomputes every tile
        return jax_kernels.cut_bce(h, e, t, reduction="none", block_v=block_v, impl="blocked").sum() / (n * v)

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
        "JAX blocked one-pass before": compiled(before_one_pass),
        "JAX blocked one-pass after": compiled(after_one_pass),
        "JAX blocked two-pass before": compiled(before_two_pass),
        "JAX blocked two-pass after": compiled(after_two_pass),
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
    print(f"{provenance.stamp()}; before = commit {at_commit.resolve(BEFORE)[:7]}")
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
