"""Compile CutBCE's training step for TPU chips over a shape matrix, on a host without a TPU.

    .venv/bin/python benchmarks/tpu_compile_matrix.py --timeout-s 120                        # every cell
    .venv/bin/python benchmarks/tpu_compile_matrix.py --chips v5e --dtypes bfloat16 --n 8192 --d 64

Each cell compiles `jax.value_and_grad` of `jax_kernels.cut_bce(impl='pallas')` with libtpu's
compile-only client in a fresh subprocess, so a hung compile is cut off by `--timeout-s` and this
process never loads libtpu, and appends one CSV row: status, seconds, XLA's memory analysis,
commit, command, host (benchmarks/README.md reads them; docs/toolchain.md, 'Compiling for TPU
without a TPU').
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: `benchmarks.*` and the packages from the root
    sys.path.insert(0, str(ROOT))

from benchmarks import tpu_compile  # noqa: E402
from benchmarks.provenance import append_rows, command, git_sha, machine  # noqa: E402

CHIPS = tuple(tpu_compile.TOPOLOGIES)  # tpu7x only with the newer libtpu (.venv-jax): see --chips
DTYPES = ("float32", "bfloat16")
NS = (1000, 8192, 16384)
VS = (1000, 100_000, 876_939, 10_000_000)
DS = (64, 96, 256)
NUM_SLOTS = 8
FIELDS = ("chip", "dtype", "N", "V", "D", "L", "status", "error", "seconds", "temp_bytes",
          "argument_bytes", "output_bytes", "code_bytes", "git_sha", "command", "host")


def compile_one(chip, dtype, n, v, d, num_slots):
    """Child side: one compile, printed as a JSON line (`CompileResult` fields)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import jax_kernels

    tpu_compile.pin_mosaic_version()

    def step(hidden, item_weight, targets):
        loss = lambda h, w: jax_kernels.cut_bce(h, w, targets, impl="pallas")
        return jax.value_and_grad(loss, argnums=(0, 1))(hidden, item_weight)

    result = tpu_compile.compile_for(chip, step, ((n, d), jnp.dtype(dtype)), ((v, d), jnp.dtype(dtype)),
                                     ((n, num_slots), jnp.int32))
    tpu_compile.print_result(dataclasses.asdict(result))


def run_cell(chip, dtype, n, v, d, num_slots, timeout_s):
    cmd = [sys.executable, __file__, "--one", chip, dtype, str(n), str(v), str(d), str(num_slots)]
    row = dict(chip=chip, dtype=dtype, N=n, V=v, D=d, L=num_slots)
    r, error = tpu_compile.run_child(cmd, tpu_compile.child_env(), timeout_s, stderr_tail=500)
    if error is not None:
        if error.startswith(tpu_compile.TIMEOUT_PREFIX):
            return dict(row, status="timeout", error=error, seconds=timeout_s)
        return dict(row, status="error", error=error)
    return dict(row, status="ok" if r["error"] is None else "error", error=(r["error"] or "")[:500],
                seconds=round(r["seconds"], 2), temp_bytes=r["temp_bytes"],
                argument_bytes=r["argument_bytes"], output_bytes=r["output_bytes"],
                code_bytes=r["code_bytes"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chips", nargs="+", default=None, choices=CHIPS,
                   help="default: every chip the environment's libtpu knows (tpu7x needs libtpu >= 0.0.50)")
    p.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    p.add_argument("--n", nargs="+", type=int, default=NS)
    p.add_argument("--v", nargs="+", type=int, default=VS)
    p.add_argument("--d", nargs="+", type=int, default=DS)
    p.add_argument("--num-slots", type=int, default=NUM_SLOTS)
    p.add_argument("--limit", type=int, default=None, help="compile at most this many cells, smallest first")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per compile")
    p.add_argument("--out", type=Path, default=HERE / "results" / "tpu_compile_matrix.csv")
    p.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        chip, dtype, *sizes = args.one
        return compile_one(chip, dtype, *map(int, sizes))
    tpu_compile.require_overlay()
    chips = args.chips or tpu_compile.supported_chips()
    cells = sorted(itertools.product(chips, args.dtypes, args.n, args.v, args.d),
                   key=lambda c: (c[2] * c[4] + c[3] * c[4], c))  # smallest (N + V) D first
    cells = cells[: args.limit] if args.limit is not None else cells
    sha, where, host = git_sha(), command(), machine()
    with append_rows(args.out, FIELDS) as write:
        for cell in cells:
            row = dict(run_cell(*cell, args.num_slots, args.timeout_s), git_sha=sha, command=where, host=host)
            write(row)
            mib = f"{row['temp_bytes'] / 2**20:.1f} MiB temp" if row.get("temp_bytes") is not None else ""
            print(f"{row['chip']} {row['dtype']} N {row['N']} V {row['V']} D {row['D']}: {row['status']} "
                  f"{row.get('seconds', '')} s {mib} {row['error'][:200]}", flush=True)


if __name__ == "__main__":
    main()
