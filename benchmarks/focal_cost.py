"""Focal CutBCE beside plain CutBCE (issue 15): forward + backward time in one process.

    .venv/bin/python benchmarks/focal_cost.py        # N 4096, V 32,768, D 64, L 8, float32, 'mean'

Interleaved rounds, medians, on the native path and the jitted JAX blocked loop: plain, focal
gamma 2 (Keras' default), gamma 2 with class balancing, gamma 0.5 (benchmarks/results/cpu_speed.md, 'Focal'). Memory
flat in V: `benchmarks/memory_check.py --focal-gamma 2`.
"""

from __future__ import annotations

import argparse
import sys

import provenance
import providers as P
from ablation import interleave

VARIANTS = {"plain": None, "focal gamma 2": (2.0, False), "focal gamma 2 balanced": (2.0, True),
            "focal gamma 0.5": (0.5, False)}


def native_steps(shape, block_v):
    import torch

    from torch_cutbce import Focal, cut_bce_with_logits

    h0, e0, t0 = (torch.tensor(a) for a in P.make_numpy_inputs(shape))

    def step(option):
        focal = None if option is None else Focal(option[0], 0.25, option[1])

        def run():
            h, e = h0.clone().requires_grad_(), e0.clone().requires_grad_()
            cut_bce_with_logits(h, e, t0, block_v=block_v, focal=focal).backward()
        return run

    return {f"native {name}": step(option) for name, option in VARIANTS.items()}


def jax_steps(shape, block_v):
    import jax
    import jax.numpy as jnp

    import jax_kernels

    h, e, t = (jnp.asarray(a) for a in P.make_numpy_inputs(shape))
    t = t.astype(jnp.int32)

    def step(option):
        focal = None if option is None else jax_kernels.Focal(option[0], 0.25, option[1])

        def loss(h, e):
            return jax_kernels.cut_bce(h, e, t, block_v=block_v, impl="blocked", focal=focal)

        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, e).compile()
        return lambda: jax.block_until_ready(compiled(h, e))

    return {f"JAX blocked {name}": step(option) for name, option in VARIANTS.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-positions", type=int, default=4096)
    parser.add_argument("--num-items", type=int, default=32768)
    parser.add_argument("--block-v", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    shape = P.Shape(args.num_positions, 64, args.num_items)
    print(provenance.stamp())
    print(f"torch threads {torch.get_num_threads()}, {shape.label()}, block_v={args.block_v}, fwd+bwd 'mean'")
    P.prepare(["jax_blocked"])
    medians = interleave({**native_steps(shape, args.block_v), **jax_steps(shape, args.block_v)}, args.rounds)
    for engine in ("native", "JAX blocked"):
        plain = medians[f"{engine} plain"]
        for name in VARIANTS:
            m = medians[f"{engine} {name}"]
            print(f"  {engine:12s} {name:24s} {m * 1e3:8.1f} ms   x{m / plain:5.2f} of plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
