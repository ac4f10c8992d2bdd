"""The first native forward + backward of a new process on an empty cache: seconds until the loss and
its gradients are back.

    nice .venv/bin/python benchmarks/first_call.py                 # 3 new processes, each on empty caches
    .venv/bin/python benchmarks/first_call.py --runs 5 --tile eager
    .venv/bin/python benchmarks/first_call.py --path jax           # jax_kernels.cut_bce, jitted grad
    .venv/bin/python benchmarks/first_call.py --path xla           # the torch_xla bridge on XLA:CPU

Each run is a new Python process with `TORCH_CUTBCE_CACHE_DIR` and `TORCHINDUCTOR_CACHE_DIR` pointing
at new empty folders, so the C kernel is built in it (where a compiler is present): N 64, V 500,
D 32, L 4, float32, reduction 'mean', forward + backward. Printed per process: the import, the first
call (its inputs made, the kernel's build included), the second call, the whole process, and what
torch.compile compiled (nothing by default), with the host CPU (lscpu's model name, and whether
/proc/cpuinfo lists avx512f); appended to results/first_call.txt. The target (issue 32): the first
call under 5 s with a compiler present (docs/performance.md, 'First call and tile choice').

The older measurement, torch.compile's tile at N 4096, V 32,768, D 64, L 8 (benchmarks/results/cpu_speed.md, 'Padded positions, the first call, threads'),
is the `cold` / `warm` mode; it forces `TORCH_CUTBCE_TILE=compiled` unless the variable is set (the
default tile compiles nothing):

    export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
    .venv/bin/python benchmarks/first_call.py cold      # an empty inductor cache: the tiles compile
    .venv/bin/python benchmarks/first_call.py warm      # the same cache: loaded from disk, dynamo traces
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "first_call.txt"

# One new process: the seconds of each step, as JSON on its last line.
_JAX_CHILD = """
import json, time, warnings
start = time.perf_counter()
warnings.simplefilter("ignore")
import jax, numpy as np
import jax_kernels
imported = time.perf_counter()
rng = np.random.default_rng(0)
hidden = rng.standard_normal((64, 32), np.float32); items = rng.standard_normal((500, 32), np.float32)
targets = rng.integers(0, 500, (64, 4)).astype(np.int32)
step = jax.jit(jax.grad(lambda h, w: jax_kernels.cut_bce(h, w, targets), argnums=(0, 1)))
jax.block_until_ready(step(hidden, items))
first = time.perf_counter()
jax.block_until_ready(step(hidden, items))
second = time.perf_counter()
print(json.dumps({"import": imported - start, "first": first - imported, "second": second - first}))
"""

_XLA_CHILD = """
import json, time, warnings
start = time.perf_counter()
warnings.simplefilter("ignore")
import torch, torch_xla
import torch_cutbce
imported = time.perf_counter()
device = torch_xla.device()
g = torch.Generator().manual_seed(0)
hidden = torch.randn(64, 32, generator=g).to(device).requires_grad_()
items = torch.randn(500, 32, generator=g).to(device).requires_grad_()
targets = torch.randint(0, 500, (64, 4), generator=g).to(device)
times = []
for _ in range(2):
    torch_cutbce.cut_bce_with_logits(hidden, items, targets, reduction="mean").backward()
    torch_xla.sync(); hidden.grad.cpu(); times.append(time.perf_counter())
print(json.dumps({"import": imported - start, "first": times[0] - imported, "second": times[1] - times[0]}))
"""

_CHILD = """
import json, sys, time, warnings
start = time.perf_counter()
warnings.simplefilter("ignore")
import torch
import torch_cutbce
from torch_cutbce.native import fused_tile
imported = time.perf_counter()
g = torch.Generator().manual_seed(0)
hidden = torch.randn(64, 32, generator=g).requires_grad_()
items = torch.randn(500, 32, generator=g).requires_grad_()
targets = torch.randint(0, 500, (64, 4), generator=g)
torch_cutbce.cut_bce_with_logits(hidden, items, targets, reduction="mean").backward()
first = time.perf_counter()
torch_cutbce.cut_bce_with_logits(hidden, items, targets, reduction="mean").backward()
second = time.perf_counter()
print(json.dumps({"import": imported - start, "first": first - imported, "second": second - first,
                  "tile": fused_tile._plain_cpu_tile(), "compiled": sorted(fused_tile.compile_seconds()),
                  "kernel": fused_tile._cpu_library() is not None}))
"""


def host_cpu() -> str:
    """lscpu's model name, and whether the CPU has AVX-512 (avx512f in /proc/cpuinfo's flags)."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=60).stdout.splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")
    except (OSError, subprocess.SubprocessError):
        model = "unknown (no lscpu)"
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return f"{model}; avx512f {'yes' if 'avx512f' in flags else 'no'}; {os.cpu_count()} CPUs"


def fresh_process(tile: str | None, path: str = "torch") -> dict:
    """One new process on empty kernel and inductor caches; its timings, and its own wall time."""
    with tempfile.TemporaryDirectory(prefix="cutbce_first_call_") as folder:
        env = {**os.environ, "TORCH_CUTBCE_CACHE_DIR": str(Path(folder) / "kernel"),
               "TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "inductor")}
        env.pop("TORCH_CUTBCE_TILE", None)
        if tile:
            env["TORCH_CUTBCE_TILE"] = tile
        start = time.perf_counter()
        child = {"torch": _CHILD, "jax": _JAX_CHILD, "xla": _XLA_CHILD}[path]
        env.setdefault("PJRT_DEVICE", "CPU")
        done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the process failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process": wall}


def empty_cache_runs(args) -> None:
    sys.path.insert(0, str(HERE))
    from provenance import stamp

    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')} first call ({args.path}), new process, empty caches: N 64, V 500, "
             f"D 32, L 4, float32, 'mean', forward + backward; TORCH_CUTBCE_TILE={args.tile or 'unset'}",
             stamp(), f"host CPU: {host_cpu()}; load average {os.getloadavg()[0]:.1f} at the start"]
    print("\n".join(lines), flush=True)
    runs = []
    for run in range(1, args.runs + 1):
        r = fresh_process(args.tile, args.path)
        runs.append(r)
        what = ("kernel build and jit included" if args.path == "jax" else "XLA's compile included"
                if args.path == "xla" else f"kernel build included; tile '{r['tile']}', C kernel "
                f"{'built' if r['kernel'] else 'not built'}, torch.compile compiled {', '.join(r['compiled']) or 'nothing'}")
        line = (f"run {run}: first call {r['first']:.2f} s ({what}); import {r['import']:.2f} s; second call "
                f"{r['second'] * 1e3:.1f} ms; whole process {r['process']:.2f} s")
        print(line, flush=True)
        lines.append(line)
    firsts = [r["first"] for r in runs]
    summary = (f"first call: median {statistics.median(firsts):.2f} s, max {max(firsts):.2f} s over {len(runs)} "
               f"processes (target: under 5 s); whole process median {statistics.median(r['process'] for r in runs):.2f} s")
    print(summary)
    lines.append(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:
        out.write("\n".join(lines) + "\n\n")


def compiled_tile_first_call(label: str) -> None:
    """The older mode: torch.compile's tile at N 4096, V 32,768 in this process (benchmarks/results/cpu_speed.md, 'Padded positions, the first call, threads')."""
    os.environ.setdefault("TORCH_CUTBCE_TILE", "compiled")
    sys.path.insert(0, str(HERE))
    start = time.perf_counter()
    import torch

    import torch_cutbce
    from provenance import stamp
    from torch_cutbce.native import fused_tile

    hidden = torch.randn(4096, 64, requires_grad=True)
    items = torch.randn(32768, 64, requires_grad=True)
    targets = torch.randint(0, 32768, (4096, 8))
    imported = time.perf_counter()
    torch_cutbce.cut_bce_with_logits(hidden, items, targets).backward()
    first = time.perf_counter()
    torch_cutbce.cut_bce_with_logits(hidden, items, targets).backward()
    second = time.perf_counter()
    print(stamp())
    print(f"{label}: import {imported - start:.1f} s, first call {first - imported:.1f} s "
          f"(compile {sum(fused_tile.compile_seconds().values()):.1f} s), second call {second - first:.2f} s")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("cold", "warm"):
        compiled_tile_first_call(sys.argv[1])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--path", choices=("torch", "jax", "xla"), default="torch",
                        help="torch: the native engine; jax: jax_kernels.cut_bce (jitted grad); xla: the torch_xla bridge")
    parser.add_argument("--tile", choices=("c_kernel", "compiled", "eager"),
                        help="TORCH_CUTBCE_TILE in the new processes (default: unset, the library's default)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    empty_cache_runs(parser.parse_args())


if __name__ == "__main__":
    main()
