"""examples/compare.py: the paired bootstrap behind the README's comparison, and the per-user test
metrics (test_users.npz) that examples/train.py keeps for it."""

import json
import re

import numpy as np
import pytest

from examples_extra import require_examples

require_examples()

from examples import compare, train  # noqa: E402

pytestmark = pytest.mark.rung4


def test_identical_runs_differ_by_exactly_zero():
    hits = np.random.default_rng(0).random(943) < 0.17
    assert compare.paired_bootstrap(hits, hits) == (0.0, 0.0, 0.0)


def test_a_known_difference_is_inside_the_interval_and_pairing_narrows_it():
    """Users differ far more than the two runs do (sd 1 against 0.05): paired, the interval is
    about 2 x 1.96 x 0.05 / sqrt(U) wide around the true +0.02 and excludes 0; resampling each run
    on its own (not paired) would give one about 20 times wider, with 0 inside."""
    rng = np.random.default_rng(1)
    users = 2000
    b = rng.normal(0.0, 1.0, users)
    a = b + 0.02 + rng.normal(0.0, 0.05, users)
    diff, low, high = compare.paired_bootstrap(a, b)
    assert diff == pytest.approx(np.mean(a - b)) and low < 0.02 < high and low > 0
    expected_width = 2 * 1.96 * np.std(a - b) / np.sqrt(users)
    assert high - low == pytest.approx(expected_width, rel=0.1)


def test_no_difference_gives_an_interval_around_zero():
    rng = np.random.default_rng(2)
    a = (rng.random(943) < 0.17).astype(float)  # HR@10-like 0/1 values of two equally good runs
    independent = (rng.random(943) < 0.17).astype(float)
    for b in (independent, rng.permutation(a)):  # the second: the same hits at other users (difference 0)
        diff, low, high = compare.paired_bootstrap(a, b)
        assert low < 0 < high and low <= diff <= high
    assert compare.verdict(low, high, "A", "B") == "tie: the interval contains 0"
    assert compare.verdict(0.01, 0.02, "A", "B").startswith("A ahead")
    assert compare.verdict(-0.02, -0.01, "A", "B").startswith("B ahead")


def test_the_seed_makes_the_interval_reproducible():
    rng = np.random.default_rng(3)
    a, b = rng.random(500), rng.random(500)
    assert compare.paired_bootstrap(a, b, seed=7) == compare.paired_bootstrap(a, b, seed=7)
    assert compare.paired_bootstrap(a, b, seed=7) != compare.paired_bootstrap(a, b, seed=8)
    # chunked resampling: a chunk size that does not divide the resamples gives every one of them
    assert compare.paired_bootstrap(rng.random(5_000), rng.random(5_000), resamples=1_001)[1] < 0.5


@pytest.mark.parametrize("a, b, kwargs", [([], [], {}), ([1.0, 2.0], [1.0], {}), ([[1.0]], [[1.0]], {}),
                                          ([1.0], [1.0], dict(level=1.0)), ([1.0], [1.0], dict(resamples=0))])
def test_bad_inputs_are_refused(a, b, kwargs):
    with pytest.raises(ValueError, match="need"):
        compare.paired_bootstrap(a, b, **kwargs)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Tiny runs on the same synthetic users, as bash ci/main.sh trains them: CutBCE and sampled BCE on
    the next item, and CutBCE on the next 3 (the multi-label run of --multi-label)."""
    tmp = tmp_path_factory.mktemp("compare")
    settings = dict(dataset="synthetic", synthetic_items=300, synthetic_users=64, max_len=10, dim=16,
                    num_layers=1, num_heads=2, batch_size=32, epochs=1, eval_batch_size=32)
    for name, loss, k in (("cutbce", "cutbce", 1), ("sampled", "sampled", 1), ("cutbce-k3", "cutbce", 3)):
        train.train(train.TrainConfig(**settings, loss=loss, k=k, out_dir=str(tmp / name)))
    return tmp


def test_the_per_user_metrics_are_the_reported_means(two_runs):
    saved = json.loads((two_runs / "cutbce" / "metrics.json").read_text())
    with np.load(two_runs / "cutbce" / "test_users.npz") as users:
        assert set(users.files) == set(saved["test"])
        for name in users.files:
            assert users[name].shape == (64,) and users[name].mean() == pytest.approx(saved["test"][name], abs=1e-12)
        assert set(np.unique(users["HR@10"])) <= {0.0, 1.0}


def test_compare_prints_both_runs_and_the_interval(two_runs, capsys):
    assert compare.main([str(two_runs / "cutbce"), str(two_runs / "sampled"), "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    assert "SASRec + CutBCE (full catalog, next item)" in out and "SASRec + sampled BCE (next item, 1 negative)" in out
    assert "A and B trained on the same target, the next item: like with like." in out
    assert "popularity" in out and "CutBCE minus sampled BCE, paired over the 64 test users" in out
    assert "multi-label" not in out
    intervals = [line for line in out.splitlines() if line.startswith(("  HR@10 ", "  NDCG@10 "))]
    assert len(intervals) == 2 and all(re.search(r"\[[+-]\d\.\d{4}, [+-]\d\.\d{4}\]", line) for line in intervals)
    compare.main([str(two_runs / "cutbce"), str(two_runs / "cutbce")])
    out = capsys.readouterr().out
    assert "+0.0000  [+0.0000, +0.0000]  tie: the interval contains 0" in out


def test_the_multi_label_run_is_its_own_row_and_says_what_it_is_for(two_runs, capsys):
    """--also: the run trained on the next 3 items is a row of its own, named multi-label with its
    purpose, and compared with run A (CutBCE on the next item), not with the sampled baseline."""
    runs = [str(two_runs / name) for name in ("cutbce", "sampled")]
    assert compare.main([*runs, "--also", str(two_runs / "cutbce-k3"), "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    assert "SASRec + CutBCE (full catalog, next 3 items: multi-label)" in out
    assert "multi-label: trained on the next k items as positives, for tasks whose answer is a set" in out
    assert "CutBCE (the next 3 items) minus CutBCE (the next item), paired over the 64 test users" in out
    assert len([line for line in out.splitlines() if line.startswith("  HR@10 ")]) == 2


def test_runs_on_different_targets_are_called_so(two_runs, capsys):
    assert compare.main([str(two_runs / "cutbce-k3"), str(two_runs / "sampled"), "--resamples", "200"]) == 0
    assert "NOT like with like: A trained on the next 3 items, B on the next item." in capsys.readouterr().out


def test_compare_refuses_runs_it_cannot_pair(two_runs, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    saved = json.loads((two_runs / "sampled" / "metrics.json").read_text())
    saved["data"]["users"] = 65
    (other / "metrics.json").write_text(json.dumps(saved))
    (other / "test_users.npz").write_bytes((two_runs / "sampled" / "test_users.npz").read_bytes())
    for argv, message in (([two_runs / "cutbce", other], "did not test the same users"),
                          ([two_runs / "cutbce", tmp_path / "none"], "not a finished run of examples/train.py"),
                          ([two_runs / "cutbce", two_runs / "sampled", "--metrics", "MRR"], "--metrics ['MRR']")):
        with pytest.raises(SystemExit) as exit_info:
            compare.main([str(arg) for arg in argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err, err
