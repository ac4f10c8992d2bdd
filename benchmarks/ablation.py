"""Before / after for each speed change of the native and JAX blocked paths (benchmarks/results/cpu_speed.md).

    .venv/bin/python benchmarks/ablation.py                  # N=4096 D=64 V=32768 float32, 5 rounds
    .venv/bin/python benchmarks/ablation.py --parts jax --threads 1 --rounds 3

Each part interleaves its variants in one process (medians, ratios to the part's first row): the
tile functions, the native loss, the JAX blocked loop, tile widths. The "before" rows import
commit 9e6b519's engines (the last commit before the speed work) through `at_commit`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import at_commit
import provenance
import providers as P

BEFORE = "9e6b519"  # the last commit before the speed work: the "before" rows import its engines


def interleave(variants: dict, rounds: int) -> dict:
    for fn in variants.values():
        fn()  # first call: compiles
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


_where_said = False


def report(title, medians, unit="ms", scale=1e3, per=1.0):
    global _where_said
    if not _where_said:  # every result says where it holds: CPU model, ISA, commit, command
        print(provenance.stamp())
        _where_said = True
    print(f"\n{title}")
    first = next(iter(medians.values()))
    for k, m in medians.items():
        print(f"  {k:58s} {m * scale / per:9.2f} {unit}   x{first / m:5.2f} vs first row")


def tile_part(shape, block_v, rounds):
    import torch

    from torch_cutbce import branch_math
    from torch_cutbce.native import fused_tile

    def log1p_rows_grad(z, cw, g, out):
        e = torch.exp(-z.abs())
        rows = ((torch.clamp_min(z, 0) + torch.log1p(e)) * cw).sum(-1)
        out.copy_(torch.where(z >= 0, 1.0, e) / (1 + e) * (g * cw))
        return rows

    def in_place_rows_grad(z, cw, g):
        e = torch.exp(-z.abs())
        rows = ((torch.clamp_min(z, 0) + branch_math.log1p_unit(e)) * cw).sum(-1)
        z.copy_(torch.where(z >= 0, 1.0, e) / (1 + e) * (g * cw))
        return rows

    n = shape.num_positions
    z = torch.randn(n, block_v) * 3
    g, cw, out = torch.rand(n, 1), torch.ones(1, block_v), torch.empty(n, block_v)
    options = {"cpp.threads": torch.get_num_threads()}
    with_log1p = torch.compile(log1p_rows_grad, dynamic=True, fullgraph=True, options=options)
    in_place = torch.compile(in_place_rows_grad, dynamic=True, fullgraph=True, options=options)
    shipped = fused_tile._compiled("rows_grad", torch.get_num_threads())
    z_scratch = z.clone()
    variants = {
        "eager twin (torch.log1p, in-place ops)": lambda: fused_tile._EAGER["rows_grad"](z.clone(), None, g, out),
        "compiled, torch.log1p (Sleef)": lambda: with_log1p(z, cw, g, out),
        "compiled, polynomial log1p, dz written back into z": lambda: in_place(z_scratch.copy_(z), cw, g),
        "compiled, polynomial log1p, dz into a second buffer (shipped)": lambda: shipped(z, cw, g, out),
    }
    report(f"1a. rows_grad tile [{n}, {block_v}] float32, ns per element (rows 1 and 3 include a copy of z)",
           interleave(variants, rounds), unit="ns/elem", scale=1e9, per=z.numel())
    def two_loop_rows(z, cw):
        e = torch.exp(-z.abs())  # three users: inductor stores e, then reduces in a second loop
        return ((torch.clamp_min(z, 0) + branch_math.log1p_unit(e)) * cw).sum(-1)

    two_loops = torch.compile(two_loop_rows, dynamic=True, fullgraph=True, options=options)
    rows = fused_tile._compiled("rows", torch.get_num_threads())
    variants = {
        "eager twin (torch.log1p, in-place ops)": lambda: fused_tile._EAGER["rows"](z.clone(), None),
        "compiled, polynomial log1p of e = exp(-|z|): two loops": lambda: two_loops(z, cw),
        "compiled, t = 1 / (2 exp(|z|) + 1): one loop (shipped)": lambda: rows(z, cw),
    }
    report(f"1b. rows tile (forward only) [{n}, {block_v}] float32, ns per element",
           interleave(variants, rounds), unit="ns/elem", scale=1e9, per=z.numel())


def native_part(shape, block_v, rounds):
    import torch

    from torch_cutbce import cut_bce_with_logits

    before = at_commit.load(BEFORE).module("torch_cutbce.native")
    h0, e0, t0 = (torch.tensor(a) for a in P.make_numpy_inputs(shape))
    n, v = shape.num_positions, shape.num_items

    def step(loss_fn):
        def run():
            h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
            loss_fn(h, e).backward()
        return run

    def eager(h, e):
        os.environ["TORCH_CUTBCE_NO_COMPILE"] = "1"
        try:
            return cut_bce_with_logits(h, e, t0, block_v=block_v)
        finally:
            del os.environ["TORCH_CUTBCE_NO_COMPILE"]

    variants = {"dense_eager": P.setup("dense_eager", shape, "fwd+bwd").step}
    variants[f"before ({BEFORE}): recompute in backward, eager tiles"] = step(
        lambda h, e: before.NativeCutBCERows.apply(h, e, None, None, None, t0, block_v, False)[0].sum() / (n * v))
    variants["recompute in backward, compiled tiles"] = step(
        lambda h, e: cut_bce_with_logits(h, e, t0, block_v=block_v, reduction="none").sum() / (n * v))
    variants["gradients in forward, eager tiles"] = step(eager)
    variants["gradients in forward, compiled tiles (shipped)"] = step(
        lambda h, e: cut_bce_with_logits(h, e, t0, block_v=block_v))
    variants["mm_floor (3 blocked matmuls)"] = P.setup("mm_floor", shape, "fwd+bwd", block_v=block_v).step
    report(f"2. native loss, fwd+bwd, {shape.label()}, block_v={block_v}", interleave(variants, rounds))


def block_part(shape, rounds, block_vs=(256, 512, 1024, 2048, 4096)):
    """The native loss and mm_floor at several tile widths (tile = [N, block_v] float32, two buffers)."""
    import torch

    from torch_cutbce import cut_bce_with_logits

    h0, e0, t0 = (torch.tensor(a) for a in P.make_numpy_inputs(shape))

    def native(block_v):
        def run():
            h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
            cut_bce_with_logits(h, e, t0, block_v=block_v).backward()
        return run

    variants = {}
    for block_v in block_vs:
        mib = shape.num_positions * block_v * 4 / (1 << 20)
        variants[f"native, block_v={block_v} ({mib:.0f} MiB tile)"] = native(block_v)
        variants[f"mm_floor, block_v={block_v}"] = P.setup("mm_floor", shape, "fwd+bwd", block_v=block_v).step
    report(f"4. tile width, fwd+bwd, {shape.label()}", interleave(variants, rounds))


def jax_part(shape, block_v, rounds):
    import jax
    import jax.numpy as jnp

    from jax_kernels.blocked import loop as blocked

    before = at_commit.load(BEFORE).module("jax_kernels.blocked")
    h, e, _ = (jnp.asarray(a) for a in P.make_numpy_inputs(shape))
    n, v = shape.num_positions, shape.num_items

    # The loops since issue 11 take the positives (exact tiles) and pos_weight; the before code did not.
    ids = jnp.asarray(P.make_numpy_inputs(shape)[2], jnp.int32)

    def forward(module, h, e):
        if module is blocked:
            return blocked.blocked_forward(h, e, ids, None, None, None, block_v=block_v, compute_counts=False)[0]
        return module.blocked_background_forward(h, e, None, None, block_v=block_v, compute_counts=False)[0]

    def backward(module, h, e, g):
        if module is blocked:
            return blocked.blocked_backward(h, e, ids, None, None, None, g, block_v=block_v)
        return module.blocked_background_backward(h, e, None, None, g, block_v=block_v)

    def compiled(module, mode):
        @jax.custom_vjp
        def rows(h, e):
            return forward(module, h, e)

        def rows_fwd(h, e):
            return rows(h, e), (h, e)

        def rows_bwd(res, g):
            d_h, d_e, _ = backward(module, *res, g)
            return d_h, d_e

        rows.defvjp(rows_fwd, rows_bwd)

        def loss(h, e):
            return rows(h, e).sum() / (n * v)

        fn = jax.jit(loss) if mode == "fwd" else jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        c = fn.lower(h, e).compile()
        return lambda: jax.block_until_ready(c(h, e))

    def fused():
        """The background of the scalar reductions: gradients computed in the forward, scaled in the backward."""
        @jax.custom_vjp
        def loss(h, e):
            return forward(blocked, h, e).sum() / (n * v)

        def loss_fwd(h, e):
            g = jnp.full((n,), 1 / (n * v), h.dtype)
            rows, _, d_h, d_e, _ = blocked.blocked_value_and_grad(h, e, ids, None, None, None, g, block_v=block_v,
                                                                  compute_counts=False)
            return rows.sum() / (n * v), (d_h, d_e)

        loss.defvjp(loss_fwd, lambda res, ct: (res[0] * ct, res[1] * ct))
        c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, e).compile()
        return lambda: jax.block_until_ready(c(h, e))

    variants = {}
    for mode in ("fwd", "fwd+bwd"):
        variants[f"{mode}: before ({BEFORE}), log1p, masked sum"] = compiled(before, mode)
        variants[f"{mode}: polynomial log1p, row sum as a dot{' (shipped)' if mode == 'fwd' else ''}"] = compiled(blocked, mode)
    variants["fwd+bwd: + gradients in the forward, one exp (shipped for mean/sum)"] = fused()
    report(f"3. JAX blocked background (jit), {shape.label()}, block_v={block_v}", interleave(variants, rounds))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-positions", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-items", type=int, default=32768)
    parser.add_argument("--block-v", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--parts", nargs="+", default=["tile", "native", "jax", "blocks"],
                        choices=["tile", "native", "jax", "blocks"])
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = P.Shape(args.num_positions, args.hidden_size, args.num_items)
    print(f"torch threads {torch.get_num_threads()}, {shape.label()}")
    if "tile" in args.parts:
        tile_part(shape, args.block_v, args.rounds)
    if "native" in args.parts:
        native_part(shape, args.block_v, args.rounds)
    if "jax" in args.parts:
        P.prepare(["jax_blocked"])
        jax_part(shape, args.block_v, args.rounds)
    if "blocks" in args.parts:
        block_part(shape, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
