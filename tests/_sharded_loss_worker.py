"""Subprocess side of test_jax_sharded.py's loss-option check: a 2 x 2 mesh of CPU devices.

As `_sharded_worker.py` (whose layouts run plain BCE on 8 devices): JAX fixes its device count when
its CPU backend starts, so this runs as `python tests/_sharded_loss_worker.py OUT.json` in a fresh
interpreter and writes, per case, the relative error of each result (loss, metrics, gradients)
of `cut_bce(..., mesh=)` against the single device. Importing this module only defines the cases.
"""

from __future__ import annotations

import json
import os
import sys

LEAD, V, D, L = (3, 7), 203, 16, 4  # N 21, V 203: divisible by neither mesh axis, so both are padded
BLOCK_V = 32
# (reduction, impl, loss options): blocked shards 'none' (forward, then the recomputing backward)
# with focal, and with smoothing and focal; Pallas shards 'mean' (one pass) with both.
CASES = (
    ("none", "blocked", "focal"),
    ("none", "blocked", "smoothed"),
    ("mean", "pallas", "smoothed"),
)


def main(out_path: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    import jax_kernels
    from jax_kernels import Focal
    from parity import make_inputs, make_upstream, relative_error, run_jax, select

    losses = {"focal": dict(focal=Focal(2.0, 0.25, True)),
              "smoothed": dict(focal=Focal(1.5, 0.25, True), label_smoothing=0.1)}
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    inputs = select(make_inputs(LEAD, V, D, L, seed=9), dtype="float32")
    errors = {}
    for reduction, impl, loss in CASES:
        upstream = make_upstream(reduction, LEAD, seed=9, dtype="float32")
        kwargs = dict(dtype="float32", upstream=upstream, reduction=reduction, block_v=BLOCK_V, **losses[loss])
        sharded = run_jax(jax_kernels.cut_bce, inputs, mesh=mesh, impl=impl, **kwargs)
        single = run_jax(jax_kernels.cut_bce, inputs, impl="blocked", **kwargs)
        errors[f"{reduction}-{impl}-{loss}"] = {k: relative_error(sharded[k], single[k])[0] for k in single}
    with open(out_path, "w") as out:
        json.dump(errors, out)


if __name__ == "__main__":
    main(sys.argv[1])
