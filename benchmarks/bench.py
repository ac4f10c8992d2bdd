"""CutBCE against BCEWithLogitsLoss on materialized logits: speed and peak memory, side by side.

    .venv/bin/python benchmarks/bench.py                 # the full run (docs/performance.md's table and plots)
    .venv/bin/python benchmarks/bench.py --quick         # tiny shapes, every code path, seconds (CI)
    .venv/bin/python benchmarks/bench.py --time-v 32768 --memory-v 16384 1048576 --providers native dense_eager

Speed: the providers of a shape take turns in one process, so other load hits them alike (medians,
ratios to dense_eager, rates as a fraction of mm_floor's). Memory: each (provider, V) in a fresh
subprocess under an address-space limit. Rows go to <out-dir>/results.csv with the commit, host and
command, plots beside it; how each figure is measured: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import providers as P
from proc_memory import limit_address_space, peak_rss_bytes, reset_peak_rss, rss_bytes
from provenance import append_rows, command, git_sha, isa_of_cpu, machine  # noqa: F401 (isa_of_cpu: re-exported)

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20
CSV_FIELDS = ("timestamp", "git_sha", "machine", "command", "device", "provider", "mode", "num_positions",
              "hidden_size", "num_items", "num_slots", "dtype", "block_v", "median_ms", "min_ms", "first_ms", "repeats",
              "gflops", "floor_fraction", "peak_mib", "xla_temp_mib", "status", "note")


# -- environment ------------------------------------------------------------------------------------


# -- speed -----------------------------------------------------------------------------------------


def time_shape(shape, provider_names, modes, repeats, budget_bytes):
    """Rows of median/min/first-call times for every (provider, mode) on one shape, interleaved."""
    cases, rows = {}, {}
    for name in provider_names:
        for mode in modes:
            key = (name, mode)
            if name in P.DENSE_PROVIDERS and P.dense_bytes(name, shape) > budget_bytes:
                need = P.dense_bytes(name, shape) / (1 << 30)
                rows[key] = dict(status="skipped", note=f"needs ~{need:.1f} GiB > --memory-budget-gib")
                continue
            try:
                case = P.setup(name, shape, mode)
                start = time.perf_counter()
                case.step()
                first = time.perf_counter() - start
            except (RuntimeError, MemoryError) as error:  # e.g. an allocation failure
                rows[key] = dict(status="error", note=f"{type(error).__name__}: {str(error)[:120]}")
                gc.collect()
                continue
            cases[key] = case
            rows[key] = dict(first_ms=1e3 * first, block_v=case.block_v, times=[], status="ok")
            print(f"  {shape.label()} {name:14s} {mode:8s} first call {1e3 * first:9.0f} ms", flush=True)
    for _ in range(repeats):
        for key, case in cases.items():
            start = time.perf_counter()
            case.step()
            rows[key]["times"].append(time.perf_counter() - start)
    floor = {m: statistics.median(rows[("mm_floor", m)]["times"]) for m in modes if ("mm_floor", m) in cases}
    for (_name, mode), row in rows.items():
        times = row.pop("times", None)
        if not times:
            continue
        median = statistics.median(times)
        row.update(median_ms=1e3 * median, min_ms=1e3 * min(times), repeats=len(times),
                   gflops=P.useful_flops(shape, mode) / median / 1e9)
        if mode in floor:
            row["floor_fraction"] = floor[mode] / median
    del cases
    gc.collect()
    return rows


# -- memory ----------------------------------------------------------------------------------------


def memory_worker(provider, shape, mode, budget_bytes) -> dict:
    """Runs in a fresh process: peak RSS of one step beyond inputs and gradients (see module doc)."""
    P.prepare([provider])  # imports map gigabytes of address space: before measuring it
    limit_address_space(budget_bytes)
    out = dict(provider=provider, mode=mode, num_items=shape.num_items)
    try:
        case = P.setup(provider, shape, mode)
        case.step()  # warm-up: compiles, first-touch of pools
        case.clear()  # the warm-up's gradients: the measured step allocates its own
        gc.collect()
        base = rss_bytes()
        if not reset_peak_rss():
            out.update(status="error", note="cannot reset the peak RSS (/proc/self/clear_refs)")
            return out
        result = case.step()
        peak = peak_rss_bytes()
        del result
    except (RuntimeError, MemoryError, ValueError) as error:
        message = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        oom = isinstance(error, MemoryError) or any(
            s in str(error).lower() for s in ("alloc", "memory", "resource_exhausted", "oom"))
        out.update(status="oom" if oom else "error", note=f"{type(error).__name__}: {message}")
        return out
    out.update(status="ok", peak_mib=(peak - base - case.grad_bytes) / MIB, block_v=case.block_v,
               note=f"step peak {(peak - base) / MIB:.0f} MiB incl. {case.grad_bytes / MIB:.0f} MiB of gradients")
    if case.xla_temp_bytes is not None:
        out["xla_temp_mib"] = case.xla_temp_bytes / MIB
    return out


def run_memory_worker(provider, shape, mode, budget_gib, timeout_s) -> dict:
    # Big blocks from mmap (freed memory leaves the RSS at once); few malloc arenas (each one
    # reserves 64 MiB of address space, which RLIMIT_AS counts).
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"),
               MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", MALLOC_ARENA_MAX="2")
    worker = [sys.executable, str(HERE / "bench.py"), "--memory-worker", provider, mode,
              "--shape", json.dumps(vars(shape)), "--memory-budget-gib", str(budget_gib)]
    try:
        done = subprocess.run(worker, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(status="timeout", note=f"memory worker ran past {timeout_s} s")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    text = (done.stderr or done.stdout).strip()
    tail = text.splitlines()[-1:] or ["no output"]
    oom = done.returncode in (-9, 137) or any(s in text.lower() for s in ("memory", "bad_alloc", "resource_exhausted"))
    status = "oom" if oom else "error"
    return dict(status=status, note=f"worker exit {done.returncode}: {tail[0][:160]}")


# -- output ----------------------------------------------------------------------------------------


def _fmt(value, spec):
    return "" if value is None or value == "" else format(value, spec)


def print_table(records):
    header = f"{'V':>8} {'provider':14} {'mode':8} {'median ms':>10} {'vs dense':>9} {'first ms':>9} " \
             f"{'GFLOP/s':>8} {'of floor':>8} {'peak MiB':>9} {'vs dense':>9}  status"
    print(header)
    print("-" * len(header))
    by_key = {(r["num_items"], r["provider"], r["mode"]): r for r in records}
    for r in records:
        dense = by_key.get((r["num_items"], "dense_eager", r["mode"]), {})
        speedup = dense.get("median_ms") / r["median_ms"] if dense.get("median_ms") and r.get("median_ms") else None
        dense_peak = by_key.get((r["num_items"], "dense_eager", "fwd+bwd"), {}).get("peak_mib")
        smaller = dense_peak / r["peak_mib"] if dense_peak and r.get("peak_mib") and r["peak_mib"] > 0 else None
        print(f"{r['num_items']:>8} {r['provider']:14} {r['mode']:8} {_fmt(r.get('median_ms'), '10.1f'):>10} "
              f"{_fmt(speedup, '8.2f') + ('x' if speedup else ''):>9} {_fmt(r.get('first_ms'), '9.0f'):>9} "
              f"{_fmt(r.get('gflops'), '8.1f'):>8} {_fmt(r.get('floor_fraction'), '8.2f'):>8} "
              f"{_fmt(r.get('peak_mib'), '9.1f'):>9} {_fmt(smaller, '8.1f') + ('x' if smaller else ''):>9}  "
              f"{r.get('status', '')} {r.get('note', '')}")


def append_csv(path: pathlib.Path, records):
    with append_rows(path, CSV_FIELDS) as write:
        for r in records:
            write({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})


# -- driver ----------------------------------------------------------------------------------------

FULL = dict(time_v=[16384, 32768, 65536, 131072], memory_v=[16384, 32768, 65536, 131072, 262144, 1048576],
            num_positions=4096, hidden_size=64, repeats=5)
QUICK = dict(time_v=[1024, 4096], memory_v=[4096], num_positions=256, hidden_size=16, repeats=2,
             providers=["dense_eager", "native", "jax_blocked", "xla_bridge", "xla_dense", "mm_floor"],
             memory_providers=["dense_eager", "native"])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few providers' memory: seconds (CI)")
    parser.add_argument("--providers", nargs="+", choices=P.PROVIDERS, help="providers to time (default: all)")
    parser.add_argument("--memory-providers", nargs="+", choices=P.PROVIDERS,
                        help="providers to measure memory for (default: the timed ones but mm_floor)")
    parser.add_argument("--modes", nargs="+", choices=P.MODES, default=list(P.MODES))
    parser.add_argument("--time-v", nargs="*", type=int, help="V values to time")
    parser.add_argument("--memory-v", nargs="*", type=int, help="V values to measure peak memory at (fwd+bwd)")
    parser.add_argument("--num-positions", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-slots", type=int, default=8)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--memory-budget-gib", type=float, default=12.0,
                        help="address-space budget of a memory worker beyond its start-up (default 12)")
    parser.add_argument("--worker-timeout-s", type=int, default=1800)
    parser.add_argument("--out-dir", type=pathlib.Path, default=HERE / "results")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--memory-worker", nargs=2, metavar=("PROVIDER", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.providers = args.providers or list(P.PROVIDERS)
    if args.memory_providers is None:
        args.memory_providers = [p for p in args.providers if p != "mm_floor"]
    return args


def main(argv=None):
    args = parse_args(argv)
    budget = int(args.memory_budget_gib * (1 << 30))
    if args.memory_worker:
        provider, mode = args.memory_worker
        print(json.dumps(memory_worker(provider, P.Shape(**json.loads(args.shape)), mode, budget)), flush=True)
        return 0
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    P.prepare(args.providers)
    stamp = dict(timestamp=datetime.datetime.now().isoformat(timespec="seconds"), git_sha=git_sha(),
                 machine=machine(), command=command(), device=f"cpu ({torch.get_num_threads()} torch threads)")
    print(f"{stamp['machine']} | torch {torch.__version__} | git {stamp['git_sha']}", flush=True)
    records = {}

    def record(shape, provider, mode, values):
        key = (shape.num_items, provider, mode)
        row = records.setdefault(key, dict(stamp, provider=provider, mode=mode, **vars(shape)))
        row.update({k: v for k, v in values.items() if v is not None})

    for v in args.time_v:
        shape = P.Shape(args.num_positions, args.hidden_size, v, args.num_slots)
        print(f"timing {shape.label()}", flush=True)
        for (provider, mode), values in time_shape(shape, args.providers, args.modes, args.repeats, budget).items():
            record(shape, provider, mode, values)
    for v in args.memory_v:
        shape = P.Shape(args.num_positions, args.hidden_size, v, args.num_slots)
        for provider in args.memory_providers:
            result = run_memory_worker(provider, shape, "fwd+bwd", args.memory_budget_gib, args.worker_timeout_s)
            print(f"  memory {shape.label()} {provider:14s} {result.get('status')} "
                  f"{_fmt(result.get('peak_mib'), '.1f')} MiB {result.get('note', '')}", flush=True)
            previous = records.get((v, provider, "fwd+bwd"), {})
            if previous.get("status") == "ok" and result.get("status") != "ok":
                result = dict(result, status="ok", note=f"memory: {result.get('status')} {result.get('note', '')}")
            record(shape, provider, "fwd+bwd", {k: result.get(k) for k in ("peak_mib", "xla_temp_mib", "status", "note", "block_v")})
    rows = [records[k] for k in sorted(records, key=lambda k: (k[0], P.PROVIDERS.index(k[1]), k[2]))]
    print()
    print_table(rows)
    append_csv(args.out_dir / "results.csv", rows)
    print(f"\nappended {len(rows)} rows to {args.out_dir / 'results.csv'}")
    if not args.no_plots:
        import plots

        for path in plots.plot(rows, args.out_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
