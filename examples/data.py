"""Interaction data for the examples: loaders, a synthetic generator, the leave-out split, batches.

Every data set becomes a `SeqDataset`: each user's items in time order, stored flat (CSR-style) so
that a 1e7-item catalog or 50M events cost memory in proportion to the events only.

Item ids: 1..num_items, with 0 reserved for padding in the model's input sequences. The loss and
the evaluation score the catalog rows 1..num_items of the item table, i.e. catalog id = item id - 1
(see `to_catalog_ids`); the padding row is never a target and never recommended.

Sources
- MovieLens-100K (default): RecBole 1.2.1's wheel ships `ml-100k.inter`. It is fetched from the
  package index with `pip download` into a cache folder and read from the zip; never committed.
- Yambda (the paper's data): parquet, one event per row, columns `uid`, `item_id`, `timestamp`.
- Synthetic: Zipf item popularity plus a hidden "successor" item per item, so a sequence model has
  something to learn that popularity cannot; fast and memory-light up to 1e7 items.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RECBOLE_WHEEL = "recbole-1.2.1-py3-none-any.whl"
ML100K_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
DATASETS = ("ml-100k", "yambda", "synthetic")


@dataclass
class SeqDataset:
    """Users' item sequences in time order.

    `items[offsets[u]:offsets[u + 1]]` is user u's sequence; ids are in 1..num_items.
    """

    name: str
    num_items: int
    items: np.ndarray  # [E] int64
    offsets: np.ndarray  # [U + 1] int64

    def __post_init__(self):
        if self.num_items < 1:
            raise ValueError(f"{self.name}: the catalog is empty (num_items={self.num_items})")
        if len(self.offsets) < 2:
            raise ValueError(f"{self.name}: no user sequences (the data holds no events)")
        lengths = np.diff(self.offsets)
        if (lengths <= 0).any():
            user = int(np.argmax(lengths <= 0))
            raise ValueError(f"{self.name}: user {user} has an empty sequence; every user needs >= 1 item")
        if self.items.min() < 1 or self.items.max() > self.num_items:
            raise ValueError(f"{self.name}: item ids must lie in 1..num_items={self.num_items}")

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def has_repeats(self) -> bool:
        """True if some user interacts with the same item twice (repeat consumption, as in Yambda)."""
        users = np.repeat(np.arange(self.num_users), self.lengths)
        pairs = users.astype(np.int64) * (self.num_items + 1) + self.items
        return len(np.unique(pairs)) < len(pairs)


def from_events(name: str, users: np.ndarray, items: np.ndarray, timestamps: np.ndarray) -> SeqDataset:
    """Events (one row each) -> a `SeqDataset`: sort by (user, time), map ids onto 1..n.

    Ties in time keep the file order (a stable sort), so the split is reproducible. Item ids are
    remapped in sorted order of the raw ids (string order for RecBole's token ids), users likewise.
    """
    if len(users) == 0:
        raise ValueError(f"{name}: the data holds no events")
    _, user_idx = np.unique(users, return_inverse=True)
    raw_items, item_idx = np.unique(items, return_inverse=True)
    order = np.lexsort((np.asarray(timestamps), user_idx))  # last key is the primary one
    counts = np.bincount(user_idx)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return SeqDataset(name, len(raw_items), item_idx[order].astype(np.int64) + 1, offsets)


# ----------------------------------------------------------------------------- MovieLens-100K


def default_cache_dir() -> Path:
    return Path(os.environ.get("CUTBCE_DATA_DIR", Path.home() / ".cache" / "torch-cutbce"))


def _fetch_recbole_wheel(cache_dir: Path) -> Path:
    wheel = cache_dir / RECBOLE_WHEEL
    if wheel.exists():
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"downloading {RECBOLE_WHEEL} (2 MB, for MovieLens-100K) into {cache_dir}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "recbole==1.2.1", "--no-deps", "-q",
               "--disable-pip-version-check", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / RECBOLE_WHEEL
        if done.returncode != 0 or not got.exists():
            raise RuntimeError(
                "could not download MovieLens-100K (the recbole==1.2.1 wheel) from the package index:\n"
                f"  {' '.join(cmd)}\n  -> {done.stderr.strip()[-500:]}\n"
                "Point the loader at a local copy instead: --data-path /path/to/ml-100k.inter (RecBole "
                f"atomic format) or --data-path /path/to/{RECBOLE_WHEEL}, or put the wheel in "
                f"{cache_dir} (set CUTBCE_DATA_DIR to use another folder)."
            )
        os.replace(got, wheel)  # atomic: a half-downloaded wheel is never seen as cached
    return wheel


def parse_inter(text: str, name: str = "ml-100k") -> SeqDataset:
    """Reads a RecBole atomic `.inter` file: a TSV whose header names `user_id:token`, `item_id:token`,
    `timestamp:float` (other columns, such as the rating, are ignored: every rating is an interaction)."""
    lines = text.splitlines()
    if not lines:
        raise ValueError(f"{name}: the .inter file is empty")
    header = [field.split(":")[0] for field in lines[0].split("\t")]
    missing = {"user_id", "item_id", "timestamp"} - set(header)
    if missing:
        raise ValueError(f"{name}: the .inter header {lines[0]!r} lacks columns {sorted(missing)}")
    cols = [header.index(c) for c in ("user_id", "item_id", "timestamp")]
    rows = [line.split("\t") for line in lines[1:] if line.strip()]
    users = np.array([r[cols[0]] for r in rows])
    items = np.array([r[cols[1]] for r in rows])
    times = np.array([float(r[cols[2]]) for r in rows])
    return from_events(name, users, items, times)


def load_movielens_100k(data_path: str | None = None, cache_dir: str | Path | None = None) -> SeqDataset:
    """MovieLens-100K from `data_path` (an `.inter` file or the RecBole wheel) or the download cache."""
    path = Path(data_path) if data_path else _fetch_recbole_wheel(Path(cache_dir or default_cache_dir()))
    if not path.exists():
        raise FileNotFoundError(f"ml-100k: --data-path {path} does not exist")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            if ML100K_MEMBER not in wheel.namelist():
                raise ValueError(f"ml-100k: {path} is a zip file without {ML100K_MEMBER}")
            text = wheel.read(ML100K_MEMBER).decode()
    else:
        text = path.read_text()
    return parse_inter(text, "ml-100k")


# ----------------------------------------------------------------------------- Yambda


def load_yambda(path: str) -> SeqDataset:
    """Yambda layout: parquet (a file or a folder of files), one event per row: uid, item_id, timestamp."""
    import pyarrow.parquet as pq  # only this loader needs pyarrow

    if not path:
        raise ValueError("yambda: pass --data-path to a parquet file or folder (e.g. yambda 50m listens.parquet)")
    if not Path(path).exists():
        raise FileNotFoundError(f"yambda: {path} does not exist")
    names = pq.read_schema(path).names if Path(path).is_file() else pq.ParquetDataset(path).schema.names
    missing = {"uid", "item_id", "timestamp"} - set(names)
    if missing:
        raise ValueError(f"yambda: {path} lacks columns {sorted(missing)} (has {names})")
    table = pq.read_table(path, columns=["uid", "item_id", "timestamp"])
    return from_events(
        "yambda",
        table.column("uid").to_numpy(),
        table.column("item_id").to_numpy(),
        table.column("timestamp").to_numpy(),
    )


# ----------------------------------------------------------------------------- synthetic


def _zipf_ranks(rng: np.random.Generator, size: int, num_items: int, exponent: float) -> np.ndarray:
    """Ranks 0..V-1 with P(rank r) ~ (r + 1)^-exponent, by inverting the continuous power law's CDF
    (no [V] probability table, so 1e7 items cost nothing)."""
    u = rng.random(size)
    top = float(num_items + 1)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * np.log(top))
    else:
        x = ((top ** (1 - exponent) - 1) * u + 1) ** (1 / (1 - exponent))
    return np.minimum(x.astype(np.int64) - 1, num_items - 1)


def _successor(ranks: np.ndarray, num_items: int) -> np.ndarray:
    """The item that tends to follow each item: a fixed pseudo-random permutation of the catalog."""
    multiplier = 2_654_435_761 % num_items or 1
    while np.gcd(multiplier, num_items) != 1:
        multiplier += 1
    return (ranks * multiplier + 12_345) % num_items


def synthetic(num_items: int = 100_000, num_users: int = 10_000, mean_len: int = 30, zipf_exponent: float = 1.1,
              follow_prob: float = 0.6, seed: int = 0) -> SeqDataset:
    """Sequences in which each next item is the previous item's successor with `follow_prob`, else a
    fresh Zipf draw. Popularity alone cannot predict successors; a sequence model can.

    Users are generated in chunks, so memory is O(events), not O(users x longest sequence).
    """
    if num_items < 2 or num_users < 1 or mean_len < 1:
        raise ValueError(f"synthetic: need num_items >= 2, num_users >= 1, mean_len >= 1, got "
                         f"{num_items=}, {num_users=}, {mean_len=}")
    rng = np.random.default_rng(seed)
    # At least 5 items each: 3 for a leave-one-out split, plus some history to train on.
    lengths = np.maximum(rng.poisson(mean_len, num_users), 5)
    items = np.empty(int(lengths.sum()), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    chunk = 65_536
    for lo in range(0, num_users, chunk):
        hi = min(lo + chunk, num_users)
        steps = int(lengths[lo:hi].max())
        block = np.empty((hi - lo, steps), dtype=np.int64)
        current = _zipf_ranks(rng, hi - lo, num_items, zipf_exponent)
        for t in range(steps):
            block[:, t] = current
            follow = rng.random(hi - lo) < follow_prob
            current = np.where(follow, _successor(current, num_items),
                               _zipf_ranks(rng, hi - lo, num_items, zipf_exponent))
        keep = np.arange(steps)[None, :] < lengths[lo:hi, None]
        items[offsets[lo]:offsets[hi]] = block[keep] + 1  # row-major: user by user, in time order
    return SeqDataset(f"synthetic-{num_items}", num_items, items, offsets)


# ----------------------------------------------------------------------------- split and arrays


def drop_short_users(ds: SeqDataset, min_len: int) -> SeqDataset:
    """Keeps users with at least `min_len` items (a leave-h-out split needs 2h + 1)."""
    keep = ds.lengths >= min_len
    if not keep.any():
        raise ValueError(f"{ds.name}: no user has >= {min_len} items, too few for the leave-out split")
    if keep.all():
        return ds
    starts, lengths = ds.offsets[:-1][keep], ds.lengths[keep]
    index = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return SeqDataset(ds.name, ds.num_items, ds.items[index], offsets)


def stage_bounds(ds: SeqDataset, holdout: int, stage: str) -> tuple[np.ndarray, np.ndarray]:
    """Chronological leave-h-out split (h = 1: leave-one-out): for each user, the last h items are the
    test items and the h before them the validation items; training sees only what comes before.

    Returns `(context_end, target_end)` per user (absolute indices into `ds.items`): stage 'train'
    trains on `[start, context_end)`; 'val' and 'test' predict `[context_end, target_end)` from the
    history `[start, context_end)`.
    """
    ends = ds.offsets[1:]
    shift = {"train": 2 * holdout, "val": 2 * holdout, "test": holdout}[stage]
    target_end = ends - (holdout if stage == "val" else 0)
    return ends - shift, target_end


def window_users(ds: SeqDataset, holdout: int, max_len: int) -> np.ndarray:
    """`[M]`: the user of each row of `train_windows(ds, holdout, max_len, k)` (any k)."""
    train_end, _ = stage_bounds(ds, holdout, "train")
    n = train_end - ds.offsets[:-1]  # >= 1 after drop_short_users(2h + 1)
    return np.repeat(np.arange(ds.num_users), -(-n // max_len))


def train_windows(ds: SeqDataset, holdout: int, max_len: int, k: int) -> np.ndarray:
    """Training rows `[M, max_len + k]`: max_len input items plus the k items that follow.

    Each user's training part is cut into windows of max_len items, counted back from its end (so
    long histories give several rows); short windows are left-padded with 0. The k extra columns
    hold the items after the window (0 where the training part ends), so the next-k targets of
    every position come from one row. Validation and test items never appear.
    """
    starts = ds.offsets[:-1]
    train_end, _ = stage_bounds(ds, holdout, "train")
    user = window_users(ds, holdout, max_len)
    per_user = np.bincount(user, minlength=ds.num_users)
    back = np.arange(per_user.sum()) - np.repeat(np.cumsum(per_user) - per_user, per_user)
    last = train_end[user] - 1 - back * max_len  # index of each window's last input item
    pos = last[:, None] - max_len + 1 + np.arange(max_len + k)[None, :]
    valid = (pos >= starts[user][:, None]) & (pos < train_end[user][:, None])
    return np.where(valid, ds.items[np.clip(pos, 0, len(ds.items) - 1)], 0)


def eval_arrays(ds: SeqDataset, holdout: int, stage: str, context_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For 'val' or 'test': `(context [U, context_len], targets [U, h], history [U, X])`.

    context: each user's most recent history items, left-padded with 0; targets: the h held-out
    items; history: every item seen before the targets, padded with 0 (for excluding seen items).
    """
    starts = ds.offsets[:-1]
    context_end, _ = stage_bounds(ds, holdout, stage)
    pos = context_end[:, None] - context_len + np.arange(context_len)[None, :]
    context = np.where(pos >= starts[:, None], ds.items[np.clip(pos, 0, None)], 0)
    targets = ds.items[context_end[:, None] + np.arange(holdout)[None, :]]
    width = int((context_end - starts).max())
    hpos = starts[:, None] + np.arange(width)[None, :]
    history = np.where(hpos < context_end[:, None], ds.items[np.clip(hpos, 0, len(ds.items) - 1)], 0)
    return context, targets, history


def item_counts(ds: SeqDataset, holdout: int, stage: str) -> np.ndarray:
    """Interactions per item `[num_items + 1]` over every user's history before `stage`'s targets
    (the popularity baseline's scores; index 0 is padding)."""
    starts = ds.offsets[:-1]
    context_end, _ = stage_bounds(ds, holdout, stage)
    lengths = context_end - starts
    index = np.repeat(starts, lengths) + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.bincount(ds.items[index], minlength=ds.num_items + 1)


class NegativeSampler:
    """Negatives for the sampled-BCE baseline: items drawn uniformly from those a user has not seen.

    "Seen" is the user's training part (what `train_windows` holds), as in PyTorch SASRec code,
    which excludes the user's training items; a position's positive (its next item) is one of them,
    so it is never drawn. Membership is a binary search in the sorted keys user * (V + 1) + item,
    so a draw costs O(draws log E) and no `[U, V]` table exists at any catalog size.
    """

    def __init__(self, ds: SeqDataset, holdout: int):
        starts = ds.offsets[:-1]
        train_end, _ = stage_bounds(ds, holdout, "train")
        lengths = train_end - starts
        users = np.repeat(np.arange(ds.num_users), lengths)
        index = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        self.num_items = ds.num_items
        self.keys = np.unique(users * (ds.num_items + 1) + ds.items[index])  # sorted
        seen = np.bincount(self.keys // (ds.num_items + 1), minlength=ds.num_users)
        if (seen >= ds.num_items).any():
            user = int(np.argmax(seen >= ds.num_items))
            raise ValueError(f"{ds.name}: user {user} has seen all {ds.num_items} items in training; "
                             "no negative can be sampled for it")

    def seen(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Whether each (user, item) pair is in the training data (same-shape bool)."""
        keys = users * (self.num_items + 1) + items
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return self.keys[at] == keys

    def sample(self, users: np.ndarray, per_user: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        """Item ids (1..V) `[len(users), *per_user]`, each uniform over its user's unseen items.

        Rejected draws are redrawn until none is left (a user has seen at most V - 1 items, so this
        ends; each round keeps a fraction seen / V). A user of -1 (a padding row) has seen nothing.
        """
        users = np.broadcast_to(np.asarray(users, dtype=np.int64).reshape(-1, *[1] * len(per_user)),
                                (len(users), *per_user))
        items = rng.integers(1, self.num_items + 1, size=users.shape)
        redraw = self.seen(users, items)
        while redraw.any():
            items[redraw] = rng.integers(1, self.num_items + 1, size=int(redraw.sum()))
            redraw[redraw] = self.seen(users[redraw], items[redraw])
        return items


def to_catalog_ids(item_ids):
    """Item ids (1..V, 0 = padding) -> catalog ids (0..V-1, -1 = padding): the rows of
    `item_embedding.weight[1:]`, the table the loss and the top-k scorer see."""
    return item_ids - 1


def load_dataset(name: str, data_path: str | None = None, *, synthetic_items: int = 100_000,
                 synthetic_users: int = 10_000, seed: int = 0) -> SeqDataset:
    if name == "ml-100k":
        return load_movielens_100k(data_path)
    if name == "yambda":
        return load_yambda(data_path)
    if name == "synthetic":
        return synthetic(synthetic_items, synthetic_users, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
