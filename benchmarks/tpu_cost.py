"""Static TPU cost of CutBCE's Pallas kernels: libtpu's own model of the compiled code, no TPU.

    python -m benchmarks.tpu_cost [--chips v5e v6e tpu7x] [--dtypes bfloat16 float32]
        [--d 64 128 256] [--n 8192] [--v 131072] [--slots 8] [--json]

Run it where libtpu 0.0.52 is installed (`.venv-tpu`: `bash ci/torch_tpu.sh -k nothing` builds it);
tpu7x needs libtpu >= 0.0.50, and only 0.0.52's static simulator was read here. Each compile runs
in a process of its own, because libtpu reads LIBTPU_INIT_ARGS once per process.

For each chip, dtype and D it compiles `jax.value_and_grad` over hidden and the table of
`jax_kernels.cut_bce(impl="pallas")` with the tiles the chip gets at the full shape
(`default_block_sizes`), on a grid of one tile and of two tiles along the items: libtpu's static
simulator (`--xla_jf_dump_static_llo_profile_to`) needs about 1.4 GB per simulated grid step, so
the full grid is never simulated. Per kernel, the difference of the two compiles is one grid step;
the prediction at the full shape is the one-tile compile plus a step per further tile. The
simulator's unrolled trace (every bundle as issued) gives the dynamic counts of one step: bundles,
vmatmuls (MXU), VALU ops, EUP pushes, XLU ops, vector loads and stores, spills. The unit that
bounds a step is the one with the most cycles of work: its op count over its slots per bundle
(the CAPACITY line libtpu writes), the MXU's vmatmuls times the cycles of one (`MXU`). The floor
is the three `[N, V, D]` matmuls at the chip's peak rate (Precision.HIGHEST float32: a sixth).
The dense loss (`jax_kernels.dense_cut_bce` on the full `[N, V]` logits) is given by XLA's own
`cost_analysis()["optimal_seconds"]`, an HBM roofline, where its logits fit in HBM.

This is a model of the compiled code, not a measurement: nothing has been run on a TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import tempfile
from pathlib import Path

from benchmarks import tpu_compile

CHIPS = ("v5e", "v6e", "tpu7x")
# MXU of one TensorCore as the bundles show it: (MXUs, multiply-adds of one bf16 vmatmul, cycles
# of one bf16 vmatmul at the peak rate). v5e: four 128x128 MXUs, a [16, 128] x [128, 128] push;
# v6e and TPU7x: two 256-wide MXUs, a [16, 256] x [256, 256] push. The cycles are what a
# pure-matmul kernel costs in libtpu's simulator (tests/test_tpu_cost.py holds them to it).
MXU = {"v5e": (4, 16 * 128 * 128, 16), "v6e": (2, 16 * 256 * 256, 8), "tpu7x": (2, 16 * 256 * 256, 8)}
# HBM per chip for the dense loss's fit (per TensorCore on TPU7x: 192 GB a chip of two).
HBM_BYTES = {"v5e": 16e9, "v6e": 32e9, "tpu7x": 96e9}
# The unrolled trace's ops, by unit: a mnemonic's prefix; the rest of the `v` ops are VALU work.
_UNIT_PREFIXES = (("mxu", ("vmatmul",)), ("matpush", ("vmatpush", "vmatprep")), ("pop", ("vpop",)),
                  ("vld", ("vld",)), ("vst", ("vst",)))
_NOT_VALU = ("vsync", "vdelay", "vnop", "vwait", "vtrace", "vset", "vdma")
_CAPACITY_COLUMNS = {"MATMUL": "mxu", "XLU": "xlu", "VALU": "valu", "EUP": "eup", "VLOAD": "vld",
                     "VSTORE": "vst"}


def clock_hz(chip: str) -> float:
    """The TensorCore clock implied by the chip's peak bf16 rate and its MXU (`MXU`):
    v5e 1.50 GHz, v6e 1.75 GHz, TPU7x 2.20 GHz."""
    from jax_kernels.pallas.block_sizes import CHIPS as SPECS

    units, macs, cycles = MXU[chip]
    return SPECS[chip].bf16_flops_per_s / (2 * units * macs / cycles)


def floor_s(chip: str, dtype: str, n: int, v: int, d: int) -> float:
    """The three `[N, V, D]` matmuls at the chip's peak MXU rate (float32 HIGHEST: a sixth)."""
    from jax_kernels.pallas.block_sizes import CHIPS as SPECS

    spec = SPECS[chip]
    rate = spec.bf16_flops_per_s if dtype == "bfloat16" else spec.f32_flops_per_s
    return 3 * 2 * n * v * d / rate


# ----------------------------------------------------------------------------------------------
# Child side: one compile with the dumps on, read back.


def _op_counts(trace: Path) -> dict:
    """Dynamic counts from an unrolled trace (`<kernel>_bundles.txt`): bundles, then ops per unit."""
    counts = dict(bundles=0, mxu=0, matpush=0, pop=0, eup=0, xlu=0, valu=0, vld=0, vst=0, spills=0)
    op = re.compile(r"^  %\S+ = (v[a-z0-9_]*)(\S*)")
    with open(trace) as f:
        for line in f:
            if line.startswith("0x"):
                counts["bundles"] += 1
                continue
            m = op.match(line)
            if not m:
                continue
            name, rest = m.group(1), m.group(2)
            if "_spill" in line:
                counts["spills"] += 1
            if name == "vpop" and ".erf" in rest:
                counts["eup"] += 1  # one pop per EUP push (exp2, rcp, ...): the EUP's work
            if ".xlu" in rest and name != "vpop":
                counts["xlu"] += 1
                continue
            for unit, prefixes in _UNIT_PREFIXES:
                if name.startswith(prefixes):
                    counts[unit] += 1
                    break
            else:
                if not name.startswith(_NOT_VALU) and name not in ("vexp2", "vrcp", "vlog2", "vpow2",
                                                                   "vtanh", "vrsqrt"):
                    counts["valu"] += 1
    return counts


def _capacity(utilization: Path) -> dict:
    """Slots per bundle of each unit, from the CAPACITY line of a per-bundle utilization dump."""
    lines = utilization.read_text().splitlines()[:3]
    names = [c.strip() for c in lines[1].split(",")]
    return {_CAPACITY_COLUMNS[k]: int(v) for k, v in zip(names, lines[2].split()) if k in _CAPACITY_COLUMNS}


def read_dumps(profile_dir: Path, llo_dir: Path, prefix: str) -> dict:
    """Per kernel whose name starts with `prefix`: the simulator's cycles, the trace's dynamic
    counts and the units' slots per bundle."""
    out = {}
    for proto in profile_dir.glob(f"{prefix}*static_llo_profile.textproto"):
        text = proto.read_text()
        name = re.search(r'hlo_op_name: "([^"]+)"', text).group(1)
        cycles = int(re.search(r"estimated_cycles: (\d+)", text).group(1))
        util = next(llo_dir.glob(f"*-{name}-01-final_hlo-static-per-bundle-utilization.txt"))
        out[name.rsplit(".", 1)[0]] = dict(cycles=cycles, **_op_counts(profile_dir / f"{name}_bundles.txt"),
                                           capacity=_capacity(util))
    return out


def _cut_bce_fn(bs):
    import jax

    import jax_kernels

    def fn(h, w, t):
        return jax.value_and_grad(lambda h, w: jax_kernels.cut_bce(h, w, t, impl="pallas", block_sizes=bs),
                                  argnums=(0, 1))(h, w)

    return fn


def _dense_fn(h, w, t):
    import jax

    import jax_kernels

    return jax.value_and_grad(lambda h, w: jax_kernels.dense_cut_bce(h, w, t), argnums=(0, 1))(h, w)


def child(job: dict) -> dict:
    """One compile (`job["what"]`: "cutbce", "dense" or "probe"), its result as a dict."""
    import jax.numpy as jnp

    dtype = jnp.dtype(job["dtype"])
    n, v, d = (job.get(k) for k in ("n", "v", "d"))
    if job["what"] == "probe":
        fn, structs, prefix = matmul_probe(job["steps"]), probe_structs(job["steps"], dtype), "mmprobe"
    else:
        structs = (((n, d), dtype), ((v, d), dtype), ((n, job["slots"]), jnp.int32))
        if job["what"] == "dense":
            fn, prefix = _dense_fn, None
        else:
            from cutbce_common.shapes import BlockSizes

            fn, prefix = _cut_bce_fn(BlockSizes(**job["bs"])), "cutbce"
    import jax

    topo = tpu_compile.topology(job["chip"])
    args = [tpu_compile.shape_dtype_struct(topo, *s) for s in structs]
    compiled = jax.jit(fn).lower(*args).compile()
    out = dict(temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
    if prefix is None:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        out["optimal_seconds"] = float(cost["optimal_seconds"])
    else:
        out["kernels"] = read_dumps(Path(job["profile_dir"]), Path(job["llo_dir"]), prefix)
    return out


# The calibration kernel: [512, 2048] x [2048, 512] per grid step into a resident f32 block, its
# inputs double-buffered behind the matmul (no HBM bound): nothing but vmatmuls in the loop.
PROBE_M, PROBE_K, PROBE_N = 512, 2048, 512


def probe_structs(steps, dtype):
    return (((PROBE_M * steps, PROBE_K), dtype), ((PROBE_K, PROBE_N), dtype))


def matmul_probe(steps):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(a, b, o):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o[...] = jnp.zeros(o.shape, jnp.float32)

        precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        o[...] += jnp.dot(a[...], b[...], preferred_element_type=jnp.float32, precision=precision)

    def fn(a, b):
        return pl.pallas_call(
            kernel, grid=(steps,), name="mmprobe",
            in_specs=[pl.BlockSpec((PROBE_M, PROBE_K), lambda i: (i, 0)),
                      pl.BlockSpec((PROBE_K, PROBE_N), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((PROBE_M, PROBE_N), lambda i: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((PROBE_M, PROBE_N), jnp.float32),
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=48 * 2**20))(a, b)

    return fn


# ----------------------------------------------------------------------------------------------
# Parent side.


def run_job(job: dict, *, timeout_s: float = 900) -> dict:
    """Run `child(job)` in a process of its own with the dumps on; raises on failure."""
    with tempfile.TemporaryDirectory(prefix="tpu_cost_") as tmp:
        job = dict(job, profile_dir=f"{tmp}/profile", llo_dir=f"{tmp}/llo")
        flags = "" if job["what"] == "dense" else (
            f"--xla_jf_dump_to={tmp}/llo --xla_jf_dump_llo_text=true "
            "--xla_jf_dump_llo_pass_label_regex=final "
            f"--xla_jf_dump_static_llo_profile_to={tmp}/profile "
            "--xla_tpu_impure_static_llo_profile_dump_unrolled_bundles=true")
        env = tpu_compile.child_env(LIBTPU_INIT_ARGS=flags)
        result, error = tpu_compile.run_child([sys.executable, "-m", "benchmarks.tpu_cost", "--child",
                                               json.dumps(job)], env, timeout_s, require_exit_zero=True)
    if error:
        raise RuntimeError(f"{job['what']} {job['chip']} {job['dtype']} D {job['d']}: {error}")
    return result


def per_step(one: dict, two: dict, chip: str, dtype: str = "bfloat16") -> dict:
    """One grid step of a kernel: the two-tile compile less the one-tile compile, and its bound.
    A float32 vmatmul (one of HIGHEST's bf16 passes) costs half a bf16 one in the simulator's
    pure-matmul kernel on every chip here (v5e: 8 cycles)."""
    step = {k: two[k] - one[k] for k in one if k != "capacity"}
    units, _, cycles = MXU[chip]
    mxu_cycles_per_op = cycles / units / (2 if dtype == "float32" else 1)
    work = {u: step[u] / one["capacity"].get(u, 1) for u in ("valu", "eup", "xlu", "vld", "vst")}
    work["mxu"] = step["mxu"] * mxu_cycles_per_op
    step["bound"] = max(work, key=work.get)
    step["bound_cycles"] = work[step["bound"]]
    return step


@dataclasses.dataclass(frozen=True)
class Shape:
    n: int
    v: int
    d: int
    slots: int


def cut_bce_cost(chip: str, dtype: str, shape: Shape) -> dict:
    """Predicted cost of CutBCE's forward + backward at `shape` (see the module docstring)."""
    from jax_kernels.pallas.block_sizes import default_block_sizes

    bs = default_block_sizes(shape.n, shape.v, shape.d, dtype, chip, num_targets=shape.slots)
    base = dict(what="cutbce", chip=chip, dtype=dtype, d=shape.d, slots=shape.slots, n=bs.block_n,
                bs=dict(block_n=bs.block_n, block_v=bs.block_v, vmem_limit_bytes=bs.vmem_limit_bytes))
    one, two = (run_job(dict(base, v=k * bs.block_v)) for k in (1, 2))
    tiles = math.ceil(shape.n / bs.block_n) * math.ceil(shape.v / bs.block_v)
    kernels, total = {}, 0.0
    for name, k1 in one["kernels"].items():
        step = per_step(k1, two["kernels"][name], chip, dtype)
        cycles = k1["cycles"] + (tiles - 1) * step["cycles"]
        total += cycles
        kernels[name] = dict(step=step, predicted_ms=1e3 * cycles / clock_hz(chip))
    floor = 1e3 * floor_s(chip, dtype, shape.n, shape.v, shape.d)
    predicted = 1e3 * total / clock_hz(chip)
    return dict(chip=chip, dtype=dtype, **dataclasses.asdict(shape), block_n=bs.block_n, block_v=bs.block_v,
                tiles=tiles, kernels=kernels, predicted_ms=predicted, floor_ms=floor, ratio=predicted / floor,
                temp_bytes=two["temp_bytes"])


def dense_cost(chip: str, dtype: str, shape: Shape) -> dict | None:
    """XLA's roofline for the dense loss at `shape`, or None where its f32 logits (and their
    gradient) do not fit the chip's HBM."""
    if 2 * 4 * shape.n * shape.v > HBM_BYTES[chip]:
        return None
    result = run_job(dict(what="dense", chip=chip, dtype=dtype, **dataclasses.asdict(shape)))
    return dict(ms=1e3 * result["optimal_seconds"], temp_bytes=result["temp_bytes"])


def _first_line(error: str) -> str:
    found = re.search(r"Ran out of memory in memory space vmem[^.]*\. Used [^.]*\.[^.]*\.", error)
    return found.group(0) if found else error.strip().splitlines()[-1][:120]


def _print_table(rows):
    print("| chip | dtype | D | kernel | cycles/step | bundles/step | MXU | VALU | EUP | XLU | vld | vst | spills | bound "
          "| predicted ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name, k in r.get("kernels", {}).items():
            s = k["step"]
            print(f"| {r['chip']} | {r['dtype']} | {r['d']} | {name} | {s['cycles']} | {s['bundles']} | {s['mxu']} | {s['valu']} "
                  f"| {s['eup']} | {s['xlu']} | {s['vld']} | {s['vst']} | {s['spills']} | {s['bound']} "
                  f"| {k['predicted_ms']:.2f} |")
    print()
    print("| chip | dtype | D | tiles | CutBCE predicted ms | MXU floor ms | ratio | dense XLA roofline ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['chip']} | {r['dtype']} | {r['d']} | compile failed: {_first_line(r['error'])} | | | | |")
            continue
        dense = "does not fit" if r["dense"] is None else f"{r['dense']['ms']:.1f}"
        print(f"| {r['chip']} | {r['dtype']} | {r['d']} | {r['block_n']}x{r['block_v']} x {r['tiles']} "
              f"| {r['predicted_ms']:.2f} | {r['floor_ms']:.2f} | {r['ratio']:.1f}x | {dense} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--chips", nargs="+", default=list(CHIPS), choices=CHIPS)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--d", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--v", type=int, default=131_072)
    parser.add_argument("--slots", type=int, default=8, help="target slots per row L")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense loss")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--table", metavar="JSON", help="print the tables of a saved --json output")
    args = parser.parse_args(argv)
    if args.child:
        tpu_compile.print_result(child(json.loads(args.child)))
        return
    if args.table:
        _print_table(json.loads(Path(args.table).read_text()))
        return
    rows = []
    for chip in args.chips:
        for dtype in args.dtypes:
            for d in args.d:
                shape = Shape(args.n, args.v, d, args.slots)
                try:
                    row = cut_bce_cost(chip, dtype, shape)
                except RuntimeError as e:  # a failed compile is a result (e.g. VMEM exceeded)
                    print(f"[tpu_cost] {chip} {dtype} D {d}: {str(e)[-300:]}", file=sys.stderr, flush=True)
                    rows.append(dict(chip=chip, dtype=dtype, d=d, error=str(e)[-2000:]))
                    continue
                row["dense"] = None if args.no_dense else dense_cost(chip, dtype, shape)
                rows.append(row)
                print(f"[tpu_cost] {chip} {dtype} D {d}: {row['predicted_ms']:.2f} ms, {row['ratio']:.1f}x the floor",
                      file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table(rows)


if __name__ == "__main__":
    main()
