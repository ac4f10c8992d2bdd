"""RePlay's full-catalog `BCE` against `torch_cutbce.integrations.replay.CutBCE`: the loss alone.

Forward + backward of each loss on the same RePlay `SasRec` (its item table `[V + 1, D]`, padding
last) and the same batch: `[B, T, D]` hidden states that need a gradient, next-item labels, left
padded sequences with about M = 3,000 real positions of B x T = 64 x 50, D = 64, float32. Times are
medians of interleaved rounds in this one process (RePlay's, then ours, each round, after one
warm-up call of each); the peak is the resident set's rise during one call (VmHWM, reset before
it). Where RePlay's loss would not fit in the memory this machine has free, its size is computed
from its bytes per position-item element measured at the smaller V, and it is not run.

Run in the RePlay environment (ci/replay.sh builds it):
  PYTHONPATH=. .venv-replay/bin/python benchmarks/replay_loss.py            # V = 2e4, 2e5, 1e6
  PYTHONPATH=. .venv-replay/bin/python benchmarks/replay_loss.py --num-items 20000 --rounds 3
Appends to benchmarks/results/replay_loss.txt with the host, the commit and the command.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import proc_memory, provenance
from torch_cutbce.integrations.replay import CutBCE

MIB = 1 << 20
B, T, D = 64, 50, 64
RESULTS = provenance.ROOT / "benchmarks" / "results" / "replay_loss.txt"


def model_for(num_items: int):
    """RePlay's SasRec with its own BCE (a one-block body: only the item table matters here)."""
    from replay.data import FeatureHint, FeatureSource, FeatureType
    from replay.data.nn import TensorFeatureInfo, TensorFeatureSource, TensorSchema
    from replay.nn.loss import BCE
    from replay.nn.sequential import SasRec

    schema = TensorSchema([TensorFeatureInfo(
        "item_id", is_seq=True, feature_type=FeatureType.CATEGORICAL, embedding_dim=D, padding_value=num_items,
        cardinality=num_items, feature_hint=FeatureHint.ITEM_ID,
        feature_sources=[TensorFeatureSource(FeatureSource.INTERACTIONS, "item_id")])])
    model = SasRec.from_params(schema, embedding_dim=D, num_heads=1, num_blocks=1, max_sequence_length=T)
    model.loss = BCE()
    model.loss.logits_callback = model.get_logits
    return model


def batch_for(num_items: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T - 8, T + 1, (B,), generator=g)  # ~3,000 real positions in all
    real = torch.arange(T).unsqueeze(0) >= (T - lengths).unsqueeze(1)  # left padded
    labels = torch.randint(0, num_items, (B, T, 1), generator=g).masked_fill(~real.unsqueeze(-1), num_items)
    hidden = torch.randn(B, T, D, generator=g).requires_grad_()
    return dict(model_embeddings=hidden, feature_tensors={}, positive_labels=labels, negative_labels=None,
                padding_mask=real, target_padding_mask=real.unsqueeze(-1))


def one_call(loss_fn, model, batch) -> tuple[float, int]:
    """Seconds and resident-set rise (bytes) of one forward + backward; gradients dropped after."""
    args = dict(batch, target_padding_mask=batch["target_padding_mask"].clone())  # RePlay squeezes it in place
    seconds, peak = proc_memory.timed_call(lambda: loss_fn(**args).backward())
    batch["model_embeddings"].grad = None
    model.zero_grad(set_to_none=True)
    return seconds, peak


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-items", type=int, nargs="+", default=[20_000, 200_000, 1_000_000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lines = [provenance.stamp() + f"; torch {torch.__version__}, {torch.get_num_threads()} threads",
             f"B x T = {B} x {T}, D = {D}, float32, next-item labels; forward + backward of the loss alone; "
             f"median of {args.rounds} interleaved rounds; peak: resident set rise during one call",
             "| V | M | RePlay BCE | CutBCE | RePlay / CutBCE time |", "|---|---|---|---|---|"]
    bytes_per_element = None
    for num_items in args.num_items:
        model = model_for(num_items)
        ours = CutBCE()
        ours.logits_callback = model.get_logits
        batch = batch_for(num_items)
        m = int(batch["target_padding_mask"].sum())
        runs = {"replay": model.loss, "ours": ours}
        # Before any V is measured here, RePlay's 16.1 bytes per position-item element measured on
        # this host (a first V too large to run would otherwise be killed for memory, silently).
        predicted = (bytes_per_element or 16.1) * m * num_items
        if predicted > 0.8 * proc_memory.available_bytes():
            del runs["replay"]
        times = {name: [] for name in runs}
        peaks = dict.fromkeys(runs, 0)
        for fn in runs.values():
            one_call(fn, model, batch)  # warm-up: the first call's builds, the allocator's first pages
        for _ in range(args.rounds):
            for name, fn in runs.items():
                seconds, peak = one_call(fn, model, batch)
                times[name].append(seconds)
                peaks[name] = max(peaks[name], peak)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        if "replay" in runs:
            bytes_per_element = peaks["replay"] / (m * num_items)
            replay_cell = f"{ms['replay']:,.0f} ms / {peaks['replay'] / MIB:,.0f} MiB"
            ratio = f"{ms['replay'] / ms['ours']:.1f}x"
        else:
            replay_cell = (f"not run: would need about {predicted / (1 << 30):.0f} GiB "
                           f"({bytes_per_element or 16.1:.1f} B per position-item, measured at the last V)")
            ratio = ""
        line = f"| {num_items:,} | {m:,} | {replay_cell} | {ms['ours']:,.0f} ms / {peaks['ours'] / MIB:,.0f} MiB | {ratio} |"
        print(line, flush=True)
        lines.append(line)
        del model, ours, batch, runs
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as out:
        out.write(provenance.scrub("\n".join(lines)) + "\n\n")
    print("\n".join(lines[:2]))


if __name__ == "__main__":
    main()
