"""Peak memory and wall time of one forward + backward through the native CutBCE path (CPU).

    .venv/bin/python benchmarks/memory_check.py                     # N=8192, V=1,048,576, D=64 float32
    .venv/bin/python benchmarks/memory_check.py -V 16384 131072 --reduction mean none --json

"extra" is the peak RSS beyond the inputs and their gradients (`proc_memory`; one process measures
several shapes where Linux lets it reset the peak). The native path keeps it O(N x block_v) whatever
V is, where the dense float32 logits alone take 4 N V bytes. Exits with status 1 when a peak exceeds
--limit-mib (4 GiB, issue 2's bound at the default shape); tests/test_torch_native_memory.py runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import ctypes
import ctypes.util
import gc
import itertools
import json
import sys
import time

import torch

from proc_memory import MIB, peak_rss_bytes, reset_peak_rss, rss_bytes
from provenance import stamp
from torch_cutbce import Focal, cut_bce_with_logits



def release_free_memory() -> None:
    """Returns the allocator's free pages to the OS, so that the baseline holds only live memory.

    Without it, memory freed by an earlier measurement stays resident inside malloc, the next one
    reuses it without a page fault, and its peak (and "extra") would read too low.
    """
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def make_inputs(num_positions, num_items, hidden_size, num_slots, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_positions, hidden_size, generator=generator, dtype=dtype)
    item_weight = torch.randn(num_items, hidden_size, generator=generator, dtype=dtype) / hidden_size**0.5
    targets = torch.randint(-1, num_items, (num_positions, num_slots), generator=generator)  # -1 = padding
    return hidden.requires_grad_(), item_weight.requires_grad_(), targets


def forward_backward(hidden, item_weight, targets, reduction, block_v, focal=None):
    loss = cut_bce_with_logits(hidden, item_weight, targets, reduction=reduction, block_v=block_v, backend="native",
                               focal=focal)
    if reduction == "none":
        upstream = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1), dtype=loss.dtype)
        loss.backward(upstream)
    else:
        loss.backward()
    return loss


def measure(num_positions, num_items, hidden_size, num_slots, dtype, reduction, block_v, focal=None) -> dict:
    hidden, item_weight, targets = make_inputs(num_positions, num_items, hidden_size, num_slots, getattr(torch, dtype))
    release_free_memory()
    reset = reset_peak_rss()
    baseline_mib = rss_bytes() / MIB
    grads_mib = (hidden.nbytes + item_weight.nbytes) / MIB
    start = time.perf_counter()
    loss = forward_backward(hidden, item_weight, targets, reduction, block_v, focal)
    wall_s = time.perf_counter() - start
    peak_mib = peak_rss_bytes() / MIB
    assert hidden.grad is not None and item_weight.grad is not None
    return {
        "num_positions": num_positions, "num_items": num_items, "hidden_size": hidden_size,
        "num_slots": num_slots, "dtype": dtype, "reduction": reduction, "threads": torch.get_num_threads(),
        "peak_mib": round(peak_mib, 1), "inputs_and_grads_mib": round(baseline_mib + grads_mib, 1),
        "extra_mib": round(peak_mib - baseline_mib - grads_mib, 1),
        "dense_logits_mib": round(num_positions * num_items * 4 / MIB, 1),
        "wall_s": round(wall_s, 2), "finite": bool(torch.isfinite(loss).all()), "peak_was_reset": reset,
        "focal": None if focal is None else dataclasses.asdict(focal),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-positions", "-N", type=int, default=8192)
    parser.add_argument("--num-items", "-V", type=int, nargs="+", default=[1_048_576], help="one or more V")
    parser.add_argument("--hidden-size", "-D", type=int, default=64)
    parser.add_argument("--num-slots", "-L", type=int, default=8, help="target ids per position")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    parser.add_argument("--reduction", choices=["mean", "sum", "none"], nargs="+", default=["mean"])
    parser.add_argument("--block-v", type=int, default=None, help="vocabulary tile (default: the library's)")
    parser.add_argument("--limit-mib", type=float, default=4096.0, help="fail when a peak RSS exceeds this")
    parser.add_argument("--json", action="store_true", help="print one JSON object per measurement")
    parser.add_argument("--focal-gamma", type=float, default=None,
                        help="measure the focal loss with this gamma (class balancing on, alpha 0.25)")
    args = parser.parse_args(argv)
    focal = None if args.focal_gamma is None else Focal(args.focal_gamma, 0.25, apply_class_balancing=True)
    if not args.json:
        print(stamp())

    # Warm up kernels, compiled tile functions and thread pools on a tiny problem first.
    for reduction in args.reduction:
        forward_backward(*make_inputs(64, 256, args.hidden_size, args.num_slots, getattr(torch, args.dtype)),
                         reduction, None, focal)
    status = 0
    for num_items, reduction in itertools.product(args.num_items, args.reduction):
        result = measure(args.num_positions, num_items, args.hidden_size, args.num_slots, args.dtype,
                         reduction, args.block_v, focal)
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(f"native forward+backward N={args.num_positions} V={num_items} D={args.hidden_size} "
                  f"L={args.num_slots} {args.dtype} reduction={reduction} threads={result['threads']}")
            print(f"  peak RSS {result['peak_mib']:.1f} MiB = process with inputs and gradients "
                  f"{result['inputs_and_grads_mib']:.1f} MiB + extra {result['extra_mib']:.1f} MiB "
                  f"(the dense [N, V] float32 logits alone: {result['dense_logits_mib']:.0f} MiB)")
            print(f"  wall time {result['wall_s']:.2f} s", flush=True)
        if not result["peak_was_reset"] and len(args.num_items) * len(args.reduction) > 1:
            print("cannot reset the peak RSS here (no /proc/self/clear_refs): measure one shape per process",
                  file=sys.stderr)
            return 2
        if result["peak_mib"] > args.limit_mib:
            print(f"FAIL: peak RSS {result['peak_mib']:.1f} MiB exceeds --limit-mib {args.limit_mib:g}",
                  file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
