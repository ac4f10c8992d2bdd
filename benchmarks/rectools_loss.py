"""RecTools' full softmax against `torch_cutbce.integrations.rectools`'s CutBCE: the loss step alone.

Forward + backward of each loss on one RecTools-shaped SASRec batch: session vectors `[B, T, D]`
and the item table `[V + 1, D]` (PAD first) that need gradients, next-item targets `y` `[B, T]`
left padded with 0, weights `yw` of 1, D = 64, float32. RecTools' softmax is its own code: its
similarity module's `[B, T, V + 1]` logits and `TransformerLightningModule._calc_softmax_loss`;
CutBCE is the integration's `batch_loss` (what `CutBCEModule` calls), with an item bias. Times are
medians of interleaved rounds in this one process (RecTools', then ours, each round, after one
warm-up call of each); the peak is the resident set's rise during one call (VmHWM, reset before it).
Where the softmax would not fit in the memory this machine has free, its size is computed from its
bytes per position-item element measured at the smaller V, and it is not run.

Run in the RecTools environment (ci/rectools.sh builds it):
  PYTHONPATH=. .venv-rectools/bin/python benchmarks/rectools_loss.py            # V = 2e4, 2e5, 1e6
  PYTHONPATH=. .venv-rectools/bin/python benchmarks/rectools_loss.py --num-items 20000 --rounds 3
Appends to benchmarks/results/rectools_loss.txt (or --out) with the host, the commit and the command.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from benchmarks import proc_memory, provenance

MIB = 1 << 20
B, T, D = 128, 50, 64
RESULTS = provenance.ROOT / "benchmarks" / "results" / "rectools_loss.txt"
SOFTMAX_BYTES = 16.0  # per position-item element, before one is measured (a first V too large is then skipped)


def batch_for(num_items: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    real = torch.arange(T).unsqueeze(0) >= (T - lengths).unsqueeze(1)  # left padded
    y = torch.randint(1, num_items + 1, (B, T), generator=g).masked_fill(~real, 0)  # table rows; 0 = PAD
    return {"hidden": torch.randn(B, T, D, generator=g).requires_grad_(),
            "table": torch.nn.Parameter(torch.randn(num_items + 1, D, generator=g) / D**0.5),
            "bias": torch.nn.Parameter(torch.full((num_items,), -9.0)), "y": y, "yw": real.float()}


def rectools_softmax(batch):
    from rectools.models.nn.transformers.lightning import TransformerLightningModule
    from rectools.models.nn.transformers.similarity import DistanceSimilarityModule

    logits = DistanceSimilarityModule("dot")(batch["hidden"], batch["table"])  # [B, T, V + 1]
    return TransformerLightningModule._calc_softmax_loss(logits, batch["y"], batch["yw"])


def cutbce(batch):
    from torch_cutbce.integrations.rectools import batch_loss

    return batch_loss(batch["hidden"], batch["table"], batch["y"], batch["yw"], n_special=1, bias=batch["bias"])


def one_call(loss_fn, batch) -> tuple[float, int]:
    """Seconds and resident-set rise (bytes) of one forward + backward; gradients dropped after."""
    seconds, peak = proc_memory.timed_call(lambda: loss_fn(batch).backward())
    for name in ("hidden", "table", "bias"):
        batch[name].grad = None
    return seconds, peak


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-items", type=int, nargs="+", default=[20_000, 200_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-cutbce-above", type=int, default=None,
                        help="compute nothing for CutBCE above this V either (a quick run); default: run it at every V")
    parser.add_argument("--softmax-bytes", type=float, default=SOFTMAX_BYTES,
                        help="the softmax's bytes per position-item element until one V is measured (a run of one large V)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.num_items) < 1:
        parser.error(f"--rounds and --num-items must be >= 1, got {args.rounds} and {args.num_items}")
    torch.manual_seed(0)
    lines = [provenance.stamp() + f"; torch {torch.__version__}, {torch.get_num_threads()} threads",
             f"B x T = {B} x {T}, D = {D}, float32, next-item targets, PAD row first; forward + backward of the "
             f"loss alone; median of {args.rounds} interleaved rounds; peak: resident set rise during one call; "
             f"load average at the start {os.getloadavg()[0]:.1f}",
             "| V | M | RecTools softmax | CutBCE | softmax / CutBCE time |", "|---|---|---|---|---|"]
    per_element = None
    for num_items in args.num_items:
        batch = batch_for(num_items)
        m = int((batch["y"] > 0).sum())
        runs = {"softmax": rectools_softmax, "cutbce": cutbce}
        predicted = (per_element or args.softmax_bytes) * B * T * (num_items + 1)
        if predicted > 0.8 * proc_memory.available_bytes():
            del runs["softmax"]
        if args.skip_cutbce_above is not None and num_items > args.skip_cutbce_above:
            del runs["cutbce"]
        times = {name: [] for name in runs}
        peaks = dict.fromkeys(runs, 0)
        for fn in runs.values():
            one_call(fn, batch)  # warm-up
        for _ in range(args.rounds):
            for name, fn in runs.items():
                seconds, peak = one_call(fn, batch)
                times[name].append(seconds)
                peaks[name] = max(peaks[name], peak)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        cells = {name: f"{ms[name]:,.0f} ms / {peaks[name] / MIB:,.0f} MiB" for name in runs}
        if "softmax" in runs:
            per_element = peaks["softmax"] / (B * T * (num_items + 1))
        else:
            source = "measured at the last V" if per_element else "--softmax-bytes"
            cells["softmax"] = (f"not run: would need about {predicted / (1 << 30):.0f} GiB "
                                f"({per_element or args.softmax_bytes:.1f} B per position-item, {source})")
        ratio = f"{ms['softmax'] / ms['cutbce']:.1f}x" if len(ms) == 2 else ""
        line = f"| {num_items:,} | {m:,} | {cells['softmax']} | {cells.get('cutbce', 'not run (--skip-cutbce-above)')} | {ratio} |"
        print(line, flush=True)
        lines.append(line)
        del batch, runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as out:
        out.write(provenance.scrub("\n".join(lines)) + "\n\n")
    print("\n".join(lines[:2]))


if __name__ == "__main__":
    main()
