"""RecTools' SASRec on MovieLens-100K: its softmax, BCE and gBCE against CutBCE, paired per user.

    python examples/rectools_ml100k.py --seeds 0 1 2                 # 40 epochs each, every loss
    python examples/rectools_ml100k.py --seeds 0 --epochs 10 --losses cutbce softmax

Needs `rectools[torch]==0.19.0` (ci/rectools.sh builds `.venv-rectools`; run from the repository
root with `PYTHONPATH=.`). The same SASRec (RecTools' defaults but the sizes below) is trained with
each loss: RecTools' own `softmax` (full catalog), `BCE` and `gBCE` (sampled negatives, RecTools'
`n_negatives` and `gbce_t`), and `cutbce` (`torch_cutbce.integrations.rectools.CutBCEModule`, the
full-catalog BCE with an item bias). Split: leave-last-out, each user's last interaction is the
test item, training sees the rest; every item RecTools knows is ranked, seen items filtered
(RecBole's full-sort convention). Per user NDCG@10 and HR@10, averaged over the seeds; then CutBCE
minus each other loss with a 95% paired bootstrap interval over the users
(`examples.compare.paired_bootstrap`). MovieLens-100K is read by `examples.data.load_movielens_100k`
(RecBole 1.2.1's wheel, downloaded once into a cache folder).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pandas as pd
import torch

from examples.compare import paired_bootstrap, verdict
from examples.data import SeqDataset, load_movielens_100k

LOSSES = ("cutbce", "softmax", "bce", "gbce")
NAMES = {"cutbce": "CutBCE", "softmax": "RecTools softmax", "bce": "RecTools BCE", "gbce": "RecTools gBCE"}
K = 10


def split(ds: SeqDataset) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Leave-last-out: (training interactions, users [U], their last items [U]), ids as in `ds`."""
    from rectools import Columns

    users = np.repeat(np.arange(ds.num_users), ds.lengths)
    position = np.arange(len(ds.items)) - np.repeat(ds.offsets[:-1], ds.lengths)
    last = position == np.repeat(ds.lengths - 1, ds.lengths)
    train = pd.DataFrame({Columns.User: users[~last], Columns.Item: ds.items[~last], Columns.Weight: 1.0,
                          Columns.Datetime: position[~last]})
    return train, users[last], ds.items[last]


def build(loss: str, args):
    from rectools.models import SASRecModel

    from torch_cutbce.integrations.rectools import CutBCEModule

    config = dict(n_factors=args.factors, n_blocks=args.blocks, n_heads=args.heads, session_max_len=args.max_len,
                  dropout_rate=args.dropout, batch_size=args.batch_size, lr=args.lr, epochs=args.epochs,
                  recommend_torch_device="cpu")
    if loss == "cutbce":
        config |= dict(loss="cutbce", lightning_module_type=CutBCEModule, lightning_module_kwargs={"item_bias": True})
    elif loss == "softmax":
        config |= dict(loss="softmax")
    else:
        config |= dict(loss={"bce": "BCE", "gbce": "gBCE"}[loss], n_negatives=args.negatives, gbce_t=args.gbce_t)
    if args.cpu_trainer:
        config |= dict(get_trainer_func=cpu_trainer, get_trainer_func_kwargs={"epochs": args.epochs})
    return SASRecModel(**config)


def cpu_trainer(epochs: int):
    """RecTools' default Trainer, on the CPU (its default takes a GPU where one is present)."""
    from pytorch_lightning import Trainer

    return Trainer(max_epochs=epochs, min_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def per_user_metrics(model, dataset, users: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """NDCG@K and HR@K of each user's held-out item in the model's top K (seen items filtered)."""
    from rectools import Columns

    reco = model.recommend(users=users, dataset=dataset, k=K, filter_viewed=True)
    target_of = dict(zip(users.tolist(), targets.tolist()))
    hit = reco[reco[Columns.Item].to_numpy() == reco[Columns.User].map(target_of).to_numpy()]
    rank = dict(zip(hit[Columns.User].tolist(), hit[Columns.Rank].tolist()))  # 1-based
    ranks = np.array([rank.get(u, 0) for u in users.tolist()], dtype=np.float64)
    found = ranks > 0
    ndcg = np.where(found, 1.0 / np.log2(np.where(found, ranks, 1) + 1), 0.0)
    return {f"NDCG@{K}": ndcg, f"HR@{K}": found.astype(np.float64)}


def run(loss: str, seed: int, args, train: pd.DataFrame, users: np.ndarray, targets: np.ndarray) -> dict:
    from pytorch_lightning import seed_everything
    from rectools.dataset import Dataset

    seed_everything(seed, verbose=False)
    dataset = Dataset.construct(train)
    model = build(loss, args)
    start = time.perf_counter()
    model.fit(dataset)
    seconds = time.perf_counter() - start
    metrics = per_user_metrics(model, dataset, users, targets)
    known = len(model.data_preparator.get_known_item_ids())
    return {"metrics": metrics, "s_per_epoch": seconds / max(args.epochs, 1), "items_ranked": known}


def table(results: dict[str, list[dict]], resamples: int) -> list[str]:
    """The Markdown table: each loss's mean NDCG@K (over seeds and users), CutBCE minus it per user
    (averaged over the seeds) with its paired interval, seconds per epoch."""
    metric = f"NDCG@{K}"
    mean_over_seeds = {loss: np.mean([r["metrics"][metric] for r in runs], axis=0) for loss, runs in results.items()}
    lines = [f"| loss | {metric} | HR@{K} | CutBCE minus it, 95% interval | s / epoch |", "|---|---|---|---|---|"]
    for loss, runs in results.items():
        hr = np.mean([r["metrics"][f"HR@{K}"] for r in runs])
        seconds = np.mean([r["s_per_epoch"] for r in runs])
        cell = ""
        if loss != "cutbce" and "cutbce" in results:
            d, low, high = paired_bootstrap(mean_over_seeds["cutbce"], mean_over_seeds[loss], resamples=resamples)
            cell = f"{d:+.4f} [{low:+.4f}, {high:+.4f}]: {verdict(low, high, 'CutBCE', NAMES[loss])}"
        lines.append(f"| {NAMES[loss]} | {mean_over_seeds[loss].mean():.4f} | {hr:.4f} | {cell} | {seconds:.2f} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--losses", nargs="+", choices=LOSSES, default=list(LOSSES))
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--factors", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=50)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--negatives", type=int, default=1, help="BCE and gBCE: sampled negatives per position")
    parser.add_argument("--gbce-t", type=float, default=0.2, help="gBCE's calibration t (RecTools' default)")
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--cpu-trainer", action="store_true", help="train on the CPU even where a GPU is present")
    parser.add_argument("--data-path", default=None, help="ml-100k.inter or the RecBole wheel (else downloaded)")
    parser.add_argument("--out", default=None, help="write the table and every run's summary here as JSON")
    args = parser.parse_args(argv)
    if args.epochs < 1 or min(args.seeds) < 0:
        parser.error(f"--epochs must be >= 1 and --seeds >= 0, got {args.epochs} and {args.seeds}")
    if "cutbce" not in args.losses:
        parser.error("--losses must include cutbce: the table is CutBCE minus each other loss")
    ds = load_movielens_100k(args.data_path)
    train, users, targets = split(ds)
    print(f"{ds.name}: {ds.num_users} users, {ds.num_items} items, {len(ds.items)} interactions; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    results: dict[str, list[dict]] = {loss: [] for loss in args.losses}
    for seed in args.seeds:
        for loss in args.losses:
            r = run(loss, seed, args, train, users, targets)
            results[loss].append(r)
            print(f"seed {seed} {NAMES[loss]}: NDCG@{K} {r['metrics'][f'NDCG@{K}'].mean():.4f} "
                  f"HR@{K} {r['metrics'][f'HR@{K}'].mean():.4f}, {r['s_per_epoch']:.2f} s/epoch, "
                  f"{r['items_ranked']} items ranked", flush=True)
    lines = table(results, args.resamples)
    print(f"\n{args.epochs} epochs, seeds {args.seeds}, {len(users)} users; per-user metrics averaged over "
          f"the seeds, paired bootstrap over the users\n" + "\n".join(lines))
    if args.out:
        summary = {loss: [{"NDCG@10": float(r["metrics"][f"NDCG@{K}"].mean()),
                           "HR@10": float(r["metrics"][f"HR@{K}"].mean()), "s_per_epoch": r["s_per_epoch"],
                           "items_ranked": r["items_ranked"]} for r in runs] for loss, runs in results.items()}
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": summary, "table": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
