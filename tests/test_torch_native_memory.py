"""The native torch path's memory does not grow with V (issue 2: O(N x block_v) extra, not O(N x V)).

A subprocess (a clean allocator, its own peak RSS) runs `benchmarks/memory_check.py`, the same
script the README cites for the N = 8192, V = 1,048,576 check: forward + backward at N = 4096,
D = 64, float32, for V = 16,384 and V = 131,072 (where the dense logits would be 2 GiB), through
both native Functions (reduction='mean' and 'none'). "extra" is the peak RSS beyond the inputs and
their gradients (the `[V, D]` gradient itself grows with V, as it must).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "memory_check.py"
NUM_POSITIONS, SMALL_V, LARGE_V = 4096, 16_384, 131_072
REDUCTIONS = ("mean", "none")
# Below this, "extra" is allocator noise; one default [4096, 1024] float32 tile is 16 MiB.
NOISE_FLOOR_MIB = 16.0


def run_memory_check(num_items, reductions):
    command = [sys.executable, str(SCRIPT), "--num-positions", str(NUM_POSITIONS), "--hidden-size", "64",
               "--json", "--num-items", *map(str, num_items), "--reduction", *reductions]
    # A fixed mmap threshold: glibc otherwise raises it after the first large free, and later tile
    # buffers then come from the heap, whose high-water mark (RSS) depends on the allocation order.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode == 2:  # no /proc/self/clear_refs: the peak cannot be reset, one shape per process
        return [r for v in num_items for red in reductions for r in run_memory_check([v], [red])]
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def measurements():
    results = run_memory_check([SMALL_V, LARGE_V], REDUCTIONS)
    return {(r["num_items"], r["reduction"]): r for r in results}


@pytest.mark.slow
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_extra_memory_does_not_grow_with_vocabulary(measurements, reduction):
    small, large = measurements[SMALL_V, reduction], measurements[LARGE_V, reduction]
    report = f"V={SMALL_V}: {small}\nV={LARGE_V}: {large}"
    assert small["finite"] and large["finite"], report
    # 8x the items, about the same extra memory (a tile and its temporaries)...
    assert large["extra_mib"] <= 1.5 * max(small["extra_mib"], NOISE_FLOOR_MIB), report
    # ...and far below what the dense [N, V] logits alone would take.
    assert large["extra_mib"] < large["dense_logits_mib"] / 16, report
