"""HBM per chip of the JAX bridge's ops, compiled for TPU without a TPU: TorchTPU beside torch_xla.

For each op of the shared table (rows, rows_backward, weighted_sum) and each chip (v5e, v6e,
tpu7x) it compiles, with libtpu's compile-only client (docs/toolchain.md, 'Compiling for TPU
without a TPU'):

    torch_tpu   the op's StableHLO as TorchTPU runs it: `jax_op`'s `JaxCallable.exported`
    torch_xla   the same JAX function jitted with the config `call_jax` gives it on a TPU (what
                xla_bridge splices into torch_xla's graph, here lowered by this environment's jax)

and appends `memory_analysis()`'s bytes to benchmarks/results/tpu_bridge_hbm.csv. Runs in the
TorchTPU environment (ci/torch_tpu.sh: torch 2.13, torch_tpu, jax 0.10.2, libtpu 0.0.52 in
site-packages); usage: `python benchmarks/tpu_bridge_hbm.py [--n N --v V --d D] [--out CSV]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # before torch: no device init off a TPU
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # a compile-only client guards no chip
os.environ.pop("JAX_PLATFORMS", None)  # the compile-only client needs JAX's TPU plugin

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Smallest slice libtpu 0.0.52 accepts per chip (v5e / v6e hosts hold 2x2).
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
OPS = ("rows", "rows_backward", "weighted_sum")
FIELDS = ("bridge", "op", "chip", "topology", "dtype", "N", "V", "D", "L", "options", "status", "error",
          "seconds", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "code_bytes",
          "xla_peak_bytes", "git_sha", "command")


def _structs(op: str, n: int, v: int, d: int, slots: int, dtype):
    """The op's JAX arguments (the options aside): hidden, table, int32 ids, bias, class and
    position weights (`[V]` each), then the op's own (`g` or `row_weight`, `[N]` float32)."""
    import jax
    import jax.numpy as jnp

    s = jax.ShapeDtypeStruct
    args = [s((n, d), dtype), s((v, d), dtype), s((n, slots), jnp.int32), s((v,), jnp.float32),
            s((v,), jnp.float32), s((v,), jnp.float32)]
    return args + ([] if op == "rows" else [s((n,), jnp.float32)])


def _compile(fn, args, topology_name: str) -> dict:
    """`memory_analysis()` bytes of `jax.jit(fn)` for `args` placed on the topology's first chip."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    topo = topologies.get_topology_desc(topology_name=topology_name, platform="tpu")
    sharding = NamedSharding(Mesh(topo.devices[:1], ("x",)), PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    start = time.perf_counter()
    try:
        stats = jax.jit(fn).lower(*placed).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 (a failed compile is a result to record)
        error = f"{type(e).__name__}: {e}"[:500]
        return dict(status="error", error=error, seconds=round(time.perf_counter() - start, 2))
    return dict(status="ok", error="", seconds=round(time.perf_counter() - start, 2),
                argument_bytes=stats.argument_size_in_bytes, output_bytes=stats.output_size_in_bytes,
                temp_bytes=stats.temp_size_in_bytes, alias_bytes=stats.alias_size_in_bytes,
                code_bytes=stats.generated_code_size_in_bytes, xla_peak_bytes=stats.peak_memory_in_bytes)


def measure(n: int, v: int, d: int, slots: int, dtype_name: str, chips=tuple(TOPOLOGIES)) -> list[dict]:
    """One row per (op, chip, bridge): the compile's status and memory figures."""
    import jax.numpy as jnp

    from cutbce_common.focal import Focal
    from cutbce_common.loss import Loss
    from cutbce_common.options import CutBCEOptions
    import jax_kernels.bridge as jax_bridge
    from torch_cutbce.jax_bridge import tpu as tpu_bridge

    dtype = jnp.dtype(dtype_name)
    options = CutBCEOptions(compute_metrics=True, loss=Loss(Focal(2.0, 0.25, True))).encode()
    jax_functions = {"rows": jax_bridge.jax_forward, "rows_backward": jax_bridge.jax_backward,
                     "weighted_sum": jax_bridge.jax_weighted_sum}
    out = []
    for op in OPS:
        args = _structs(op, n, v, d, slots, dtype)
        exported = getattr(tpu_bridge, op)._init_fn.exported(*args, options)  # jax_op's JaxCallable
        static = jax_bridge.jax_static(options, n, v, dtype_name, on_tpu=True)
        programs = {"torch_tpu": exported.call, "torch_xla": functools.partial(jax_functions[op], **static)}
        for chip in chips:
            for bridge, fn in programs.items():
                row = dict(bridge=bridge, op=op, chip=chip, topology=TOPOLOGIES[chip], dtype=dtype_name, N=n, V=v,
                           D=d, L=slots, options=options)
                row.update(_compile(fn, args, TOPOLOGIES[chip]))
                out.append(row)
                print(f"{bridge:9} {op:13} {chip:6} {row['status']} temp={row.get('temp_bytes')} "
                      f"peak={row.get('xla_peak_bytes')} ({row['seconds']} s)", file=sys.stderr, flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--v", type=int, default=10000)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--chips", nargs="+", default=list(TOPOLOGIES), choices=list(TOPOLOGIES))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tpu_bridge_hbm.csv")
    a = p.parse_args()
    from benchmarks.provenance import append_rows, command, git_sha

    rows = measure(a.n, a.v, a.d, a.slots, a.dtype, tuple(a.chips))
    with append_rows(a.out, FIELDS) as write:
        for row in rows:
            write(dict(row, git_sha=git_sha(), command=command()))
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        print(f"FAILED {r['bridge']} {r['op']} {r['chip']}: {r['error']}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
