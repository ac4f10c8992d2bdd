"""Worker of tests/test_sharded_exact_rows.py: the sharded paths on the exact-rows cases, results as JSON.

- "jax sharded 2x2": `jax_kernels.cut_bce(..., mesh=)` on a 2x2 ('data', 'model') mesh of 4 CPU
  devices (the device count must be set before JAX starts, hence a subprocess);
- "vocab-parallel 2 ranks": `cut_bce_with_logits(vocab_parallel=...)` over 2 gloo ranks, each holding half the
  table (the V = 1 case cannot be split over two ranks and is left out).

Each case reports float32 rows ('none') and the gradients for the case's upstream gradient g.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import numpy as np  # noqa: E402

import exact_rows_cases as cases  # noqa: E402

WORLD = 2


def run_jax_sharded() -> dict:
    import jax
    import jax.numpy as jnp

    import jax_kernels

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    out = {}
    for name, case in cases.cases().items():
        a = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        pos_weight = None if case["pos_weight"] is None else a(case["pos_weight"])
        targets = jnp.asarray(case["targets"], jnp.int32)

        def rows_fn(hidden, items, targets=targets, pos_weight=pos_weight):
            return jax_kernels.cut_bce(hidden, items, targets, pos_weight=pos_weight, reduction="none", mesh=mesh,
                                       block_v=16)

        rows, vjp = jax.vjp(jax.jit(rows_fn), a(case["hidden"]), a(case["item_weight"]))
        d_hidden, d_items = vjp(a(case["g"]))
        out[name] = {"rows": np.asarray(rows, np.float64).tolist(), "d_hidden": np.asarray(d_hidden).tolist(),
                     "d_item_weight": np.asarray(d_items).tolist()}
    return out


def _rank_main(rank, init_file, out_dir):
    import torch
    import torch.distributed as dist

    from torch_cutbce import cut_bce_with_logits
    from torch_cutbce.vocab_parallel import VocabParallelOptions

    # Eager tiles (exact too): two ranks compiling the same tile functions at once can abort
    # (seen once with torch 2.13 in the core-only check: SIGABRT in a rank).
    os.environ["TORCH_CUTBCE_NO_COMPILE"] = "1"
    torch.set_num_threads(1)  # two ranks on a 2-core host, as tests/test_torch_sharded.py does
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {}
    for name, case in cases.cases().items():
        num_items = case["item_weight"].shape[0]
        if num_items < WORLD:
            continue
        options = VocabParallelOptions.even(num_items)
        f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        hidden = f(case["hidden"]).requires_grad_()
        items = f(case["item_weight"][options.start : options.stop]).requires_grad_()
        pos_weight = None if case["pos_weight"] is None else f(case["pos_weight"][options.start : options.stop])
        rows = cut_bce_with_logits(hidden, items, torch.tensor(case["targets"]), vocab_parallel=options,
                                      pos_weight=pos_weight, reduction="none", block_v=16)
        (rows * f(case["g"])).sum().backward()
        results[name] = {"rows": rows.detach().double().tolist(), "d_hidden": hidden.grad.tolist(),
                         "d_item_weight": items.grad.tolist()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f_out:
        json.dump(results, f_out)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown, where torch 2.13 ranks have aborted (test_torch_sharded)


def run_vocab_parallel() -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
    out = {}
    for name, first in ranks[0].items():
        # Every rank has the same rows and d_hidden; the table gradient is split by rows.
        out[name] = {"rows": first["rows"], "d_hidden": first["d_hidden"],
                     "d_item_weight": sum((r[name]["d_item_weight"] for r in ranks), [])}
    return out


def main(out_path: str) -> None:
    results = {"vocab-parallel 2 ranks": run_vocab_parallel()}
    if importlib.util.find_spec("jax") is not None:  # without the [jax] extra, test_sharded_exact_rows skips that path
        results["jax sharded 2x2"] = run_jax_sharded()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
