"""The native loss with each float32 CPU tile against its matmul floor and dense eager, at one ISA level.

    taskset -c 0 .venv/bin/python benchmarks/cpu_tile_isa.py --threads 1              # the CPU's own ISA
    taskset -c 0 .venv/bin/python benchmarks/cpu_tile_isa.py --threads 1 --isa avx2   # AVX2 on an AVX-512 CPU

`--isa avx2` builds the C kernel for x86-64-v3 and caps torch, MKL and oneDNN at AVX2 before torch
is imported: the code an AVX2-only CPU runs, on cores that have more. Each run appends its table,
with the host, ISA, threads, commit and command, to `--out` (results/cpu_tile_isa.txt; summed up in
results/cpu_speed.md, 'The tile kernel').
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "cpu_tile_isa.txt"
# TORCHINDUCTOR_CACHE_DIR: inductor's on-disk cache does not tell ATEN_CPU_CAPABILITY apart: a kernel
# generated for AVX-512 (16-float vectors) and then built against AVX2's 8-float Vectorized crashed
# with SIGBUS when an AVX2 run shared the cache with runs at the CPU's own ISA (torch 2.9).
AVX2_ENV = {"TORCH_CUTBCE_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "torchinductor_cutbce_avx2")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    parser.add_argument("--num-items", type=int, default=32768)
    parser.add_argument("--num-positions", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.isa == "avx2":
        os.environ.update(AVX2_ENV)
    sys.path.insert(0, str(HERE))
    import torch

    import providers as P
    from provenance import command, git_sha, isa_of_cpu, machine
    from torch_cutbce.native import fused_tile

    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    shape = P.Shape(num_positions=args.num_positions, hidden_size=64, num_items=args.num_items)
    chosen = fused_tile._plain_cpu_tile()  # measures (or reads) the choice before anything is forced
    lanes = fused_tile._cpu_library().cutbce_lanes() if fused_tile._cpu_library() else 0
    cases = {f"native[{tile}]": (tile, P.setup("native", shape, "fwd+bwd")) for tile in fused_tile.TILES}
    cases["native[as chosen]"] = ("auto", P.setup("native", shape, "fwd+bwd"))
    cases["mm_floor"] = (None, P.setup("mm_floor", shape, "fwd+bwd"))
    cases["dense_eager"] = (None, P.setup("dense_eager", shape, "fwd+bwd"))
    times = {name: [] for name in cases}
    for round_ in range(args.rounds + 1):  # round 0 warms up (compiles)
        for name, (tile, case) in cases.items():
            if tile is not None:
                os.environ["TORCH_CUTBCE_TILE"] = tile
            start = time.perf_counter()
            case.step()
            if round_:
                times[name].append(time.perf_counter() - start)
            case.clear()
    medians = {name: statistics.median(t) for name, t in times.items()}
    floor, dense = medians["mm_floor"], medians["dense_eager"]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "all"
    isa = isa_of_cpu() if args.isa == "native" else f"AVX2 (capped by environment on an {isa_of_cpu()} CPU)"
    lines = [
        f"## {time.strftime('%Y-%m-%d')} {shape.label()} fwd+bwd, {args.threads} thread(s), medians of {args.rounds}",
        f"machine: {machine()}; ISA run: {isa}; C kernel lanes {lanes} ({os.environ.get('TORCH_CUTBCE_MARCH', 'native')}); "
        f"torch {torch.__version__}; commit {git_sha()}",
        f"command: {command()} on CPUs {cpus}; "
        f"the default or tuned choice is '{chosen}'",
        f"{'variant':<20} {'median s':>9} {'x floor':>8} {'dense / it':>11}",
    ]
    for name, median in medians.items():
        lines.append(f"{name:<20} {median:>9.3f} {median / floor:>8.2f} {dense / median:>11.2f}")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:
        out.write(text + "\n\n")


if __name__ == "__main__":
    main()
