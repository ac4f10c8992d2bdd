"""Training runs on the same test users: their metrics, and the difference with its uncertainty.

    python examples/compare.py runs/ci-default/cutbce runs/ci-default/sampled
    python examples/compare.py runs/ci-default/cutbce runs/ci-default/sampled --also runs/ci-default/cutbce-k8

Reads each run's `metrics.json` and `test_users.npz` (every test user's metrics, written by
examples/train.py) and prints the runs beside the popularity baseline and the target each trained
on, then, per metric, the difference A minus B of the means with a 95% paired bootstrap interval
over the test users (and, for each `--also` run, that run minus A). The runs rank the same users,
so the difference is taken user by user before resampling: what both models find easy or hard
cancels, and the interval is that of the difference, not of each run.

The interval says how far the choice of test users could move the difference between these two
trained models. It does not cover retraining with another seed, which moves both runs as well.
An interval that contains 0 is a tie. A and B are compared like with like only when they trained
on the same target; the header says whether they did.
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


def target(cfg: dict) -> str:
    """What a run's loss was trained to score as positive, from its configuration."""
    if cfg["model"] == "bert4rec":
        labels = cfg.get("bert_labels", 1)
        return "the masked item" if labels == 1 else f"the masked item and the {labels - 1} after it"
    if cfg["loss"] in ("sampled", "ce") or cfg["k"] == 1:
        return "the next item"
    return f"the next {cfg['k']} items"


def label(metrics: dict) -> tuple[str, str]:
    """A run's row name for the table and its loss's short name, from its metrics.json."""
    cfg, loss = metrics["config"], metrics["config"]["loss"]
    wide = cfg["model"] == "sasrec" and target(cfg) != "the next item"
    detail = {"sampled": "next item, " + f"{cfg['negatives']} negative" + ("s" if cfg["negatives"] > 1 else "")
              }.get(loss, f"full catalog, next {cfg['k']} items: multi-label" if wide else "full catalog, next item")
    if cfg["model"] == "bert4rec":
        detail = "sampled" if loss == "sampled" else f"full catalog, {target(cfg)}"
    return f"{MODEL_NAMES[cfg['model']]} + {LOSS_NAMES[loss]} ({detail})", LOSS_NAMES[loss]


# What a multi-label row is for, printed under the table when one is shown.
MULTI_LABEL = ("multi-label: trained on the next k items as positives, for tasks whose answer is a set of coming\n"
               "items (a basket, a session); scored here on the next item, as the other rows")


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
    parser.add_argument("--also", type=Path, nargs="+", default=[], metavar="RUN",
                        help="more runs on the same users, each its own row and its difference from run A "
                             "(the multi-label CutBCE run of bash ci/main.sh --multi-label, say)")
    parser.add_argument("--metrics", nargs="+", default=["HR@10", "NDCG@10"], help="metrics to compare")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap generator's seed")
    args = parser.parse_args(argv)
    dirs = [args.run_a, args.run_b, *args.also]
    runs = [read_run(run_dir, parser) for run_dir in dirs]
    a = runs[0][0]
    for run_dir, (other, _) in zip(dirs[1:], runs[1:]):
        if (any(a["data"][key] != other["data"][key] for key in SAME_USERS)
                or a["config"]["holdout"] != other["config"]["holdout"]):
            parser.error(f"{args.run_a} and {run_dir} did not test the same users "
                         f"(data {a['data']} vs {other['data']})")
    missing = [name for name in args.metrics if any(name not in users for _, users in runs)]
    if missing or args.resamples < 1:
        parser.error(f"--metrics {missing} not in every run's test_users.npz" if missing else "--resamples must be >= 1")
    labels = [label(run) for run, _ in runs]
    if len({row for row, _ in labels}) < len(labels):  # e.g. two seeds of one loss: name them by their folders
        labels = [(f"{row} [{run_dir.name}]", f"{name} [{run_dir.name}]") for (row, name), run_dir in zip(labels, dirs)]
    elif len({name for _, name in labels}) < len(labels):  # one loss on two targets: name them by the target
        labels = [(row, f"{name} ({target(run['config'])})") for (row, name), (run, _) in zip(labels, runs)]
    settings = {f"{run['config']['epochs']} epochs, seed {run['config']['seed']}" for run, _ in runs}
    print(f"\ntest split, full ranking of {a['data']['items']} items, "
          + (f"{settings.pop()} each:" if len(settings) == 1 else "settings differ (see each metrics.json):"))
    print(f"{'':56} " + " ".join(f"{name:>8}" for name in args.metrics) + f" {'wall s':>7} {'CPU s':>6}")
    for (row, _), (run, _) in zip(labels, runs):
        print(f"{row:56} " + " ".join(f"{run['test'][name]:8.4f}" for name in args.metrics)
              + f" {run['wall_s']:7.0f} {run['cpu_s']:6.0f}")
    print(f"{'popularity':56} " + " ".join(f"{a['popularity']['test'][name]:8.4f}" for name in args.metrics))
    if any("multi-label" in row for row, _ in labels):
        print(MULTI_LABEL)
    targets = [target(run["config"]) for run, _ in runs[:2]]
    print(f"\nA and B trained on the same target, {targets[0]}: like with like." if targets[0] == targets[1] else
          f"\nNOT like with like: A trained on {targets[0]}, B on {targets[1]}.")
    for first, second in ((0, 1), *((i, 0) for i in range(2, len(runs)))):  # A minus B, each --also minus A
        (_, name_1), (_, name_2) = labels[first], labels[second]
        users_1, users_2 = runs[first][1], runs[second][1]
        print(f"\n{name_1} minus {name_2}, paired over the {len(users_1[args.metrics[0]])} test users "
              f"(bootstrap, {args.resamples:,} resamples, seed {args.seed}; 95% interval):")
        for name in args.metrics:
            diff, low, high = paired_bootstrap(users_1[name], users_2[name], resamples=args.resamples, seed=args.seed)
            print(f"  {name:8} {diff:+.4f}  [{low:+.4f}, {high:+.4f}]  {verdict(low, high, name_1, name_2)}")
    print("The interval covers the choice of test users, not a retrain with another --seed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
