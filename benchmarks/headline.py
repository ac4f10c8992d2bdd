"""The headline run: SASRec training steps over a 1,000,000-item catalog on a CPU, CutBCE vs dense BCE.

    .venv/bin/python benchmarks/headline.py                      # B=64, S=200, D=64, V=1,000,000, 3 steps
    .venv/bin/python benchmarks/headline.py --num-items 5000 --batch-size 4 --seq-len 20 --steps 2   # smoke

The model is the examples' SASRec (examples/sasrec.py); each position's targets are its next
`--num-slots` items, scored against all V. CutBCE (the native path) holds one `[N, block_v]` logits
tile; the dense loss needs the `[N, V]` logits, their gradient and the multi-hot target, so it is
attempted in a subprocess under an address-space limit, where failing cannot take the machine
down. Appends a row (seconds per step, peak RSS and its parts, losses, commit, host, command) to
results/headline.csv.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/ is a folder of scripts beside benchmarks/, not installed

from examples.sasrec import RecConfig, SASRec  # noqa: E402
from proc_memory import MIB, limit_address_space, peak_rss_bytes  # noqa: E402
from provenance import append_rows, command, git_sha, machine  # noqa: E402
from torch_cutbce import cut_bce_with_logits  # noqa: E402
from torch_cutbce.native import fused_tile  # noqa: E402

GIB = 1 << 30


def make_model(args) -> SASRec:
    """The example's SASRec at the headline's size: one block, two heads, a 2x MLP, no item bias."""
    return SASRec(RecConfig(args.num_items, max_len=args.seq_len, dim=args.hidden_size, num_layers=1, num_heads=2,
                            mlp_ratio=2, dropout=0.1, item_bias=False))


def synthetic_batch(batch_size, seq_len, num_items, num_slots, seed):
    """Sequences of Zipf-popular items, left-padded; targets = the next `num_slots` items (-1 past the end).

    Returns `(seq [B, S], targets [B, S, L], mask [B, S])`: `seq` holds SASRec's item ids (catalog id
    + 1, 0 = padding), `targets` catalog ids 0..V-1, `mask` 1.0 at real positions.
    """
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_items + 1, dtype=torch.float64)
    popularity = ranks.pow(-1.05)  # heavy head, long tail, as in real catalogs
    full = torch.multinomial(popularity / popularity.sum(), batch_size * (seq_len + num_slots), replacement=True,
                             generator=g).view(batch_size, seq_len + num_slots)
    seq, future = full[:, :seq_len], full[:, 1:]
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch_size,), generator=g)
    pad = torch.arange(seq_len) < (seq_len - lengths)[:, None]  # left padding
    targets = torch.stack([future[:, k: k + seq_len] for k in range(num_slots)], dim=-1)  # [B, S, L]
    targets[pad] = -1
    seq = torch.where(pad, 0, seq + 1)  # SASRec's ids: item id = catalog id + 1, 0 = padding
    return seq, targets, (~pad).to(torch.float32)


def dense_need_gib(num_positions, num_items) -> float:
    """Logits + their gradient + the multi-hot target, float32, before any temporary."""
    return 3 * num_positions * num_items * 4 / GIB


def masked_loss(loss_fn, hidden, table, targets, mask, num_items):
    # The per-position mean the recommender wants: sum_n mask[n] row[n] / V / sum_n mask[n].
    return loss_fn(hidden, table, targets, mask) / (num_items * mask.sum().clamp_min(1))


def cut_bce_loss(hidden, table, targets, mask):
    return cut_bce_with_logits(hidden, table, targets, weight=mask, reduction="sum")


def dense_loss(hidden, table, targets, mask):
    logits = hidden @ table.T  # [B, S, V]
    valid = targets >= 0
    multi_hot = torch.zeros_like(logits).scatter_(-1, torch.where(valid, targets, 0), valid.to(logits.dtype))
    return (F.binary_cross_entropy_with_logits(logits, multi_hot, reduction="none").sum(-1) * mask).sum()


def train(args, loss_fn, steps):
    torch.manual_seed(0)
    model = make_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    seq, targets, mask = synthetic_batch(args.batch_size, args.seq_len, args.num_items, args.num_slots, seed=1)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = masked_loss(loss_fn, model(seq), model.item_weight, targets, mask, args.num_items)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        peak_mib = peak_rss_bytes() / MIB
        print(f"  step {len(losses)}: loss {losses[-1]:.6f}  {seconds[-1]:.1f} s  peak RSS {peak_mib:.0f} MiB", flush=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(losses=losses, seconds=seconds, params_mib=params / MIB)


def dense_worker(args):
    """One dense training step under RLIMIT_AS; prints a JSON line with the outcome."""
    limit_address_space(int(args.dense_limit_gib * GIB))
    try:
        result = train(args, dense_loss, steps=1)
        out = dict(status="ok", seconds=result["seconds"][0], loss=result["losses"][0])
    except (RuntimeError, MemoryError) as error:
        out = dict(status="failed", error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    out["peak_rss_mib"] = peak_rss_bytes() / MIB
    print(json.dumps(out), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-items", type=int, default=1_000_000, help="catalog size V")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step B")
    parser.add_argument("--seq-len", type=int, default=200, help="sequence length S (N = B S positions)")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size D")
    parser.add_argument("--num-slots", type=int, default=3, help="targets per position: the next L items")
    parser.add_argument("--steps", type=int, default=3, help="timed CutBCE steps after the first")
    parser.add_argument("--dense-limit-gib", type=float, default=16.0,
                        help="address space the dense attempt may add (its RLIMIT_AS)")
    parser.add_argument("--skip-dense", action="store_true", help="do not attempt the dense step")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "headline.csv",
                        help="CSV file the summary row is appended to")
    parser.add_argument("--dense-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dense_worker:
        dense_worker(args)
        return 0
    n = args.batch_size * args.seq_len
    print(f"SASRec (examples/sasrec.py): B={args.batch_size} S={args.seq_len} (N={n}) D={args.hidden_size} V={args.num_items:,} "
          f"L={args.num_slots}, float32, {torch.get_num_threads()} torch threads", flush=True)
    print(f"dense [N, V] float32 logits: {n * args.num_items * 4 / GIB:.1f} GiB each; the dense step needs "
          f">= {dense_need_gib(n, args.num_items):.1f} GiB (logits, their gradient, the multi-hot target)")

    dense = dict(status="skipped")
    if not args.skip_dense:
        print(f"dense attempt (subprocess, RLIMIT_AS = start + {args.dense_limit_gib:g} GiB):", flush=True)
        worker = [sys.executable, __file__, "--dense-worker", "--num-items", str(args.num_items), "--batch-size",
                  str(args.batch_size), "--seq-len", str(args.seq_len), "--hidden-size", str(args.hidden_size),
                  "--num-slots", str(args.num_slots), "--dense-limit-gib", str(args.dense_limit_gib)]
        done = subprocess.run(worker, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        dense = json.loads(lines[-1]) if lines else dict(status="failed", error=(done.stderr.strip().splitlines() or ["?"])[-1])
        print(f"  dense: {dense}", flush=True)

    print("CutBCE (native path):", flush=True)
    result = train(args, cut_bce_loss, steps=1 + args.steps)
    timed = result["seconds"][1:] or result["seconds"]
    seconds_per_step = statistics.median(timed)
    compile_s = sum(fused_tile.compile_seconds().values())
    params_mib = result["params_mib"]
    peak = peak_rss_bytes() / MIB
    summary = dict(
        timestamp=datetime.datetime.now().isoformat(timespec="seconds"), num_positions=n, num_items=args.num_items,
        hidden_size=args.hidden_size, num_slots=args.num_slots, threads=torch.get_num_threads(),
        first_step_s=round(result["seconds"][0], 2), compile_s=round(compile_s, 2),
        step_seconds=" ".join(f"{x:.1f}" for x in timed), seconds_per_step=round(seconds_per_step, 2),
        steps_per_s=round(1 / seconds_per_step, 5), peak_rss_mib=round(peak), params_mib=round(params_mib),
        state_mib=round(4 * params_mib), loss_first=result["losses"][0], loss_last=result["losses"][-1],
        dense_need_gib=round(dense_need_gib(n, args.num_items), 1), dense_status=dense.get("status"),
        dense_error=dense.get("error", ""), dense_loss_first=dense.get("loss"),
        git_sha=git_sha(), machine=machine(), command=command(),
    )
    print(f"\nCutBCE: median {seconds_per_step:.1f} s/step ({1 / seconds_per_step:.4f} steps/s) over {len(timed)} steps "
          f"after the first; first step {result['seconds'][0]:.1f} s, of which {compile_s:.1f} s in the tile "
          f"functions' first calls (compile, or a load from inductor's disk cache)")
    print(f"peak RSS {peak:.0f} MiB; of it parameters {params_mib:.0f} MiB, + gradients and Adam's two moments "
          f"{3 * params_mib:.0f} MiB; losses {result['losses'][0]:.6f} -> {result['losses'][-1]:.6f}")
    print(f"dense: needs >= {summary['dense_need_gib']} GiB; attempt: {dense.get('status')} {dense.get('error', '')}")
    if dense.get("status") == "ok":  # small shapes: the same first loss both ways (same seed, same batch)
        print(f"first-step loss: dense {dense['loss']:.6f}, CutBCE {result['losses'][0]:.6f}")
    with append_rows(args.out, list(summary)) as write:
        write(summary)
    print(f"appended to {args.out}")
    return 0 if all(math.isfinite(x) for x in result["losses"]) else 1


if __name__ == "__main__":
    sys.exit(main())
