"""examples/data.py: loaders on generated files, the synthetic generator, the leave-out split, windows."""

import zipfile

import numpy as np
import pytest

from examples_extra import require_examples

require_examples(extra=False)

from examples import data  # noqa: E402

# Three users; user "u2" has a timestamp tie (kept in file order) and raw ids that are not contiguous.
INTER = """user_id:token\titem_id:token\trating:float\ttimestamp:float
u1\t50\t3\t30
u2\t7\t4\t5
u1\t10\t5\t10
u2\t50\t1\t5
u1\t7\t2\t20
u3\t99\t2\t1
u2\t10\t3\t1
u1\t99\t4\t40
"""
# RecBole ids are tokens (strings): "10" "50" "7" "99" -> 1 2 3 4 in sorted order. By time:
# u1 = 10 7 50 99, u2 = 10 7 50 (7 and 50 tie at t=5: file order), u3 = 99.
EXPECTED = [[1, 3, 2, 4], [1, 3, 2], [4]]


def sequences(ds):
    return [ds.items[a:b].tolist() for a, b in zip(ds.offsets[:-1], ds.offsets[1:])]


def test_inter_file_and_wheel(tmp_path):
    path = tmp_path / "ml-100k.inter"
    path.write_text(INTER)
    ds = data.load_movielens_100k(str(path))
    assert (ds.num_items, ds.num_users) == (4, 3) and sequences(ds) == EXPECTED
    wheel = tmp_path / data.RECBOLE_WHEEL  # the same file inside a zip at the wheel's member path
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(data.ML100K_MEMBER, INTER)
    assert sequences(data.load_movielens_100k(str(wheel))) == EXPECTED
    # the cache: a wheel already in the cache folder is used without downloading
    cached = data.load_movielens_100k(cache_dir=tmp_path)
    assert sequences(cached) == EXPECTED


def test_inter_errors(tmp_path):
    with pytest.raises(ValueError, match="lacks columns"):
        data.parse_inter("user_id:token\trating:float\n1\t2\n")
    with pytest.raises(ValueError, match="no events"):
        data.parse_inter(INTER.splitlines()[0] + "\n")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_movielens_100k(str(tmp_path / "missing.inter"))
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("x.txt", "")
    with pytest.raises(ValueError, match="without"):
        data.load_movielens_100k(str(tmp_path / "other.zip"))


def test_download_failure_says_how_to_use_a_local_copy(tmp_path, monkeypatch):
    """No network in tests: a failing `pip download` must end in an error that names --data-path."""
    class Failed:
        returncode, stderr = 1, "ERROR: Could not find a version that satisfies the requirement"

    monkeypatch.setattr(data.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match="--data-path"):
        data.load_movielens_100k(cache_dir=tmp_path / "cache")


def test_yambda_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({
        "uid": np.array([5, 5, 9, 5, 9], dtype=np.uint32),
        "timestamp": np.array([30, 10, 7, 20, 3], dtype=np.uint32),
        "item_id": np.array([1000, 2000, 1000, 3000, 3000], dtype=np.uint32),
        "is_organic": np.array([1, 0, 1, 1, 0], dtype=np.uint8),  # extra columns are ignored
    })
    pq.write_table(table, tmp_path / "listens.parquet")
    ds = data.load_yambda(str(tmp_path / "listens.parquet"))
    assert ds.num_items == 3 and sequences(ds) == [[2, 3, 1], [3, 1]]
    assert data.load_dataset("yambda", str(tmp_path)).num_users == 2  # a folder of parquet files
    pq.write_table(pa.table({"uid": [1], "item_id": [2]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="lacks columns"):
        data.load_yambda(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match="--data-path"):
        data.load_yambda("")


def test_empty_sequences_and_unknown_dataset():
    with pytest.raises(ValueError, match="user 1 has an empty sequence"):
        data.SeqDataset("x", 5, np.array([1, 2, 3, 4]), np.array([0, 2, 2, 4]))
    with pytest.raises(ValueError, match="no user sequences"):
        data.SeqDataset("x", 5, np.array([], dtype=np.int64), np.array([0]))
    with pytest.raises(ValueError, match="no events"):
        data.from_events("x", np.array([]), np.array([]), np.array([]))
    with pytest.raises(ValueError, match="too few for the leave-out split"):
        data.drop_short_users(data.SeqDataset("x", 5, np.array([1, 2]), np.array([0, 2])), 3)
    with pytest.raises(ValueError, match="unknown dataset 'ml-1m'"):
        data.load_dataset("ml-1m")


def test_leave_one_out_split_and_windows():
    # user 0: items 1..7; user 1: 8..10 (the minimum for leave-one-out); user 2: 2 items (dropped)
    ds = data.SeqDataset("t", 12, np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]), np.array([0, 7, 10, 12]))
    ds = data.drop_short_users(ds, 3)
    assert sequences(ds) == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    context, targets, history = data.eval_arrays(ds, 1, "val", context_len=4)
    assert context.tolist() == [[2, 3, 4, 5], [0, 0, 0, 8]] and targets.tolist() == [[6], [9]]
    assert history.tolist() == [[1, 2, 3, 4, 5], [8, 0, 0, 0, 0]]
    context, targets, _ = data.eval_arrays(ds, 1, "test", context_len=4)
    assert context.tolist() == [[3, 4, 5, 6], [0, 0, 8, 9]] and targets.tolist() == [[7], [10]]
    # training windows: train parts 1..5 and 8, windows of 3 counted from the end, +2 future columns
    windows = data.train_windows(ds, 1, max_len=3, k=2)
    assert windows.tolist() == [[3, 4, 5, 0, 0], [0, 1, 2, 3, 4], [0, 0, 8, 0, 0]]
    # validation/test items never appear in training rows
    assert not np.isin(windows, [6, 7, 9, 10]).any()
    counts = data.item_counts(ds, 1, "test")  # everything before the test items
    assert counts.tolist() == [0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0]


def test_leave_h_out():
    ds = data.SeqDataset("t", 9, np.arange(1, 10), np.array([0, 9]))
    _, val_targets, _ = data.eval_arrays(ds, 2, "val", context_len=3)
    context, test_targets, _ = data.eval_arrays(ds, 2, "test", context_len=3)
    assert val_targets.tolist() == [[6, 7]] and test_targets.tolist() == [[8, 9]] and context.tolist() == [[5, 6, 7]]
    assert data.train_windows(ds, 2, max_len=5, k=1).tolist() == [[1, 2, 3, 4, 5, 0]]


def test_synthetic_is_fast_learnable_and_reproducible():
    ds = data.synthetic(num_items=10_000_000, num_users=2_000, mean_len=20, seed=3)
    assert ds.num_items == 10_000_000 and ds.lengths.min() >= 5
    assert 1 <= ds.items.min() and ds.items.max() <= ds.num_items
    assert sequences(ds)[:3] == sequences(data.synthetic(10_000_000, 2_000, 20, seed=3))[:3]
    counts = np.bincount(ds.items)
    assert counts[1] > 50 * np.median(counts[counts > 0])  # Zipf: the head is far above the typical item
    # sequential structure: the successor of the previous item follows about follow_prob of the time
    prev, nxt = ds.items[:-1], ds.items[1:]
    same_user = np.ones(len(prev), bool)
    same_user[ds.offsets[1:-1] - 1] = False
    follows = data._successor(prev - 1, ds.num_items) + 1 == nxt
    assert 0.5 < follows[same_user].mean() < 0.7
    with pytest.raises(ValueError, match="num_items >= 2"):
        data.synthetic(num_items=1)
