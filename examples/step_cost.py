"""What the loss costs in one training step of the example: CPU time per step with each loss and without.

    python examples/step_cost.py --num-threads 1                  # the example's SASRec on ML-100K
    python examples/step_cost.py --num-threads 1 --dim 256 --num-layers 4 --num-heads 4 --max-len 200 \\
        --batch-size 16                                           # a model whose Transformer dominates

A step is what examples/train.py does per batch: the model's forward, the loss, backward and the
optimizer step, on the run's own batches (`--loss` and every other training flag apply). "free" is
the same step with a loss that costs nothing (`hidden.sum() * 0`): the Transformer, backward and
Adam alone, so a loss's share of its step is (step - free) / step. The losses are interleaved step
by step, so that other load on the machine hits them alike, and each is timed by the process's CPU
time (not wall time) over --rounds steps after 2 warm-up steps; the medians are printed.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples` and `torch_cutbce` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from examples import data, train
from examples.config import LOSSES, TrainConfig, build_parser

WARM_UP = 2


def make_step(cfg: TrainConfig, loss: str, ds: data.SeqDataset):
    """step(i) -> the CPU seconds of training step i with `loss` ('free': the model alone)."""
    cfg = dataclasses.replace(cfg, loss="cutbce" if loss == "free" else loss)
    windows = data.train_windows(ds, cfg.holdout, cfg.max_len, cfg.labels)
    users = data.window_users(ds, cfg.holdout, cfg.max_len)
    sampler = data.NegativeSampler(ds, cfg.holdout) if loss == "sampled" else None
    model, optimizer, pos_weight = train.build_model(cfg, ds.num_items, torch.device("cpu"), None)
    model.train()

    def step(i: int) -> float:
        rows = np.arange(i * cfg.batch_size, (i + 1) * cfg.batch_size) % len(windows)
        batch = train.make_batch(windows[rows], cfg, model, i, users[rows], sampler)
        start = time.process_time()
        if loss == "free":
            value = model(batch["inputs"]).sum() * 0
        else:
            value = train.loss_of_batch(model, batch, cfg, pos_weight)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        return time.process_time() - start
    return step


def step_costs(cfg: TrainConfig, losses: list[str], rounds: int) -> dict[str, list[float]]:
    """{loss: [CPU seconds of each timed step]} for 'free' and each of `losses`, interleaved."""
    ds = data.load_dataset(cfg.dataset, cfg.data_path or None, synthetic_items=cfg.synthetic_items,
                           synthetic_users=cfg.synthetic_users)
    ds = data.drop_short_users(ds, 2 * cfg.holdout + 1)
    steps = {loss: make_step(cfg, loss, ds) for loss in ["free", *losses]}
    times = {loss: [] for loss in steps}
    for i in range(WARM_UP + rounds):
        for loss, step in steps.items():
            seconds = step(i)
            if i >= WARM_UP:
                times[loss].append(seconds)
    return times


def main(argv=None) -> int:
    parser = build_parser(__doc__)
    parser.prog = "examples/step_cost.py"
    parser.add_argument("--losses", default="cutbce,ce,sampled",
                        help=f"comma-separated losses to time beside 'free' (of {', '.join(LOSSES)})")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per loss (after 2 warm-up steps)")
    args = vars(parser.parse_args(argv))
    losses, rounds = args.pop("losses").split(","), args.pop("rounds")
    bad = [loss for loss in losses if loss not in LOSSES]
    if bad or rounds < 1:
        parser.error(f"--losses takes names of {', '.join(LOSSES)} (got {', '.join(bad)})" if bad
                     else f"--rounds must be >= 1, got {rounds}")
    try:
        cfg = TrainConfig(**args)
        for loss in losses:  # the flag combination must hold for each loss timed
            dataclasses.replace(cfg, loss=loss)
    except ValueError as error:
        parser.error(str(error))
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    times = step_costs(cfg, losses, rounds)
    free = statistics.median(times["free"])
    print(f"{cfg.model}, D = {cfg.dim}, {cfg.num_layers} layers, T = {cfg.max_len}, batch {cfg.batch_size}, "
          f"{torch.get_num_threads()} thread(s); CPU ms per step, median of {rounds} (quartiles):")
    for loss, seconds in times.items():
        median = statistics.median(seconds)
        low, high = np.percentile(seconds, [25, 75])
        share = "" if loss == "free" else f"  loss {100 * (median - free) / median:.1f}% of the step"
        print(f"  {loss:8} {1e3 * median:8.0f} ({1e3 * low:.0f}-{1e3 * high:.0f}){share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
