"""Two training runs on the same test users: their metrics, and the difference with its uncertainty.

    python examples/compare.py runs/ci-default/cutbce runs/ci-default/sampled

Reads each run's `metrics.json` and `test_users.npz` (every test user's metrics, written by
examples/train.py) and prints both runs beside the popularity baseline, then, per metric, the
difference A minus B of the means with a 95% paired bootstrap interval over the test users. The
two runs rank the same users, so the difference is taken user by user before resampling: what both
models find easy or hard cancels, and the interval is that of the difference, not of each run.

The interval says how far the choice of test users could move the difference between these two
trained models. It does not cover retraining with another seed, which moves both runs as well
(examples/RESULTS.md keeps the seeds behind each claim). An interval that contains 0 is a tie.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

import numpy as np

MODEL_NAMES = {"sasrec": "SASRec", "bert4rec": "BERT4Rec"}
LOSS_NAMES = {"cutbce": "CutBCE", "focal": "focal CutBCE", "dense": "dense BCE", "sampled": "sampled BCE",
              "ce": "full-softmax CE"}
SAME_USERS = ("name", "users", "items", "events")  # metrics.json "data" fields two paired runs share


def paired_bootstrap(a, b, *, resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """The mean of `a - b` and its percentile bootstrap interval, resampling the pairs (users).

    Args:
        a, b: `[U]` one value per user for each of two runs, users in the same order.
        resamples: bootstrap resamples; level: the interval's coverage, in (0, 1); seed: the
            resampling generator's seed (the same inputs and seed give the same interval).

    Returns:
        `(difference, low, high)`. Identical inputs give `(0, 0, 0)`.
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 1 or len(d) == 0 or np.shape(a) != np.shape(b):
        raise ValueError(f"need two non-empty [U] arrays of one length, got shapes {np.shape(a)} and {np.shape(b)}")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"need resamples >= 1 and level in (0, 1), got {resamples=}, {level=}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    rows = max(1, 2**22 // len(d))  # resamples per chunk: a [rows, U] index array of <= 32 MiB
    for lo in range(0, resamples, rows):
        hi = min(lo + rows, resamples)
        means[lo:hi] = d[rng.integers(0, len(d), size=(hi - lo, len(d)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(d.mean()), float(low), float(high)


def verdict(low: float, high: float, a: str, b: str) -> str:
    if low > 0:
        return f"{a} ahead: the interval excludes 0"
    if high < 0:
        return f"{b} ahead: the interval excludes 0"
    return "tie: the interval contains 0"


def label(metrics: dict) -> tuple[str, str]:
    """A run's row name for the table and its loss's short name, from its metrics.json."""
    cfg, loss = metrics["config"], metrics["config"]["loss"]
    detail = {"sampled": f"{cfg['negatives']} negative" + ("s" if cfg["negatives"] > 1 else ""),
              "ce": "full catalog, next item"}.get(loss, f"full catalog, k = {cfg['k']}")
    return f"{MODEL_NAMES[cfg['model']]} + {LOSS_NAMES[loss]} ({detail})", LOSS_NAMES[loss]


def read_run(run_dir: Path, parser: argparse.ArgumentParser) -> tuple[dict, dict[str, np.ndarray]]:
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        with np.load(run_dir / "test_users.npz") as users:
            return metrics, {name: users[name] for name in users.files}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        parser.error(f"{run_dir}: not a finished run of examples/train.py ({type(error).__name__}: {error})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="examples/compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path, help="the --out-dir of run A (differences are A minus B)")
    parser.add_argument("run_b", type=Path, help="the --out-dir of run B, on the same data")
    parser.add_argument("--metrics", nargs="+", default=["HR@10", "NDCG@10"], help="metrics to compare")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap generator's seed")
    args = parser.parse_args(argv)
    (a, users_a), (b, users_b) = read_run(args.run_a, parser), read_run(args.run_b, parser)
    if any(a["data"][key] != b["data"][key] for key in SAME_USERS) or a["config"]["holdout"] != b["config"]["holdout"]:
        parser.error(f"{args.run_a} and {args.run_b} did not test the same users (data {a['data']} vs {b['data']})")
    missing = [name for name in args.metrics if name not in users_a or name not in users_b]
    if missing or args.resamples < 1:
        parser.error(f"--metrics {missing} not in both runs' test_users.npz" if missing else "--resamples must be >= 1")
    (row_a, name_a), (row_b, name_b) = label(a), label(b)
    if row_a == row_b:  # e.g. two seeds of one loss: name them by their folders
        row_a, name_a = f"{row_a} [{args.run_a.name}]", f"{name_a} [{args.run_a.name}]"
        row_b, name_b = f"{row_b} [{args.run_b.name}]", f"{name_b} [{args.run_b.name}]"
    settings = [f"{run['config']['epochs']} epochs, seed {run['config']['seed']}" for run in (a, b)]
    print(f"\ntest split, full ranking of {a['data']['items']} items, "
          + (f"{settings[0]} each:" if settings[0] == settings[1] else f"A {settings[0]}, B {settings[1]}:"))
    print(f"{'':48} " + " ".join(f"{name:>8}" for name in args.metrics) + f" {'wall s':>7} {'CPU s':>6}")
    for row, metrics, run in ((row_a, a["test"], a), (row_b, b["test"], b), ("popularity", a["popularity"]["test"], None)):
        cost = f" {run['wall_s']:7.0f} {run['cpu_s']:6.0f}" if run else ""
        print(f"{row:48} " + " ".join(f"{metrics[name]:8.4f}" for name in args.metrics) + cost)
    print(f"\n{name_a} minus {name_b}, paired over the {len(users_a[args.metrics[0]])} test users "
          f"(bootstrap, {args.resamples:,} resamples, seed {args.seed}; 95% interval):")
    for name in args.metrics:
        diff, low, high = paired_bootstrap(users_a[name], users_b[name], resamples=args.resamples, seed=args.seed)
        print(f"  {name:8} {diff:+.4f}  [{low:+.4f}, {high:+.4f}]  {verdict(low, high, name_a, name_b)}")
    print("The interval covers the choice of test users, not a retrain with another --seed (examples/RESULTS.md).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
