"""examples/: the sampled-BCE baseline (--loss sampled): its negatives and its loss.

Resume exactness for it: test_examples_train.py::test_resume_after_kill_equals_uninterrupted_run.
"""


import numpy as np
import pytest
import torch

from examples_extra import require_examples

require_examples()

from examples import data, losses, train  # noqa: E402
from examples.sasrec import RecConfig, SASRec  # noqa: E402

pytestmark = pytest.mark.rung4

NUM_ITEMS, MAX_LEN = 300, 10


@pytest.fixture(scope="module")
def dataset():
    ds = data.synthetic(NUM_ITEMS, 64, seed=0)
    return ds, data.train_windows(ds, 1, MAX_LEN, 3), data.window_users(ds, 1, MAX_LEN)


def seen_sets(ds, windows, users):
    """Each user's training items, read from its windows (an independent route to the same set)."""
    seen = [set() for _ in range(ds.num_users)]
    for row, user in zip(windows, users):
        seen[user].update(int(i) for i in row if i)
    return seen


def test_window_users_follow_the_windows(dataset):
    ds, windows, users = dataset
    assert users.shape == (len(windows),) and (np.diff(users) >= 0).all()
    train_end, _ = data.stage_bounds(ds, 1, "train")
    for user in range(ds.num_users):  # the user's windows hold its training part, nothing else
        items = ds.items[ds.offsets[user]:train_end[user]]
        assert set(windows[users == user].flatten()) - {0} == set(items.tolist())


def test_negatives_are_unseen_and_never_the_positive(tmp_path, dataset):
    ds, windows, users = dataset
    cfg = train.TrainConfig(dataset="synthetic", synthetic_items=NUM_ITEMS, synthetic_users=64, max_len=MAX_LEN,
                            k=3, loss="sampled", negatives=4, batch_size=32, out_dir=str(tmp_path))
    model = SASRec(RecConfig(NUM_ITEMS, MAX_LEN, 16, 1, 2))
    rows = np.arange(27)  # a short batch: 5 padding rows
    batch = train.make_batch(windows[rows], cfg, model, step=3, users=users[rows],
                             sampler=data.NegativeSampler(ds, 1))
    negatives = batch["negatives"]
    assert negatives.shape == (32, MAX_LEN, 4) and negatives.dtype == torch.int64
    assert ((negatives >= 0) & (negatives < NUM_ITEMS)).all()
    seen = seen_sets(ds, windows, users)
    real = batch["weight"] > 0
    for b, t in zip(*np.nonzero(real.numpy())):
        drawn = set((negatives[b, t] + 1).tolist())  # catalog id -> item id
        assert not drawn & seen[users[b]], (b, t)
        assert int(batch["targets"][b, t, 0]) not in set(negatives[b, t].tolist())
    again = train.make_batch(windows[rows], cfg, model, step=3, users=users[rows], sampler=data.NegativeSampler(ds, 1))
    other = train.make_batch(windows[rows], cfg, model, step=4, users=users[rows], sampler=data.NegativeSampler(ds, 1))
    assert torch.equal(again["negatives"], negatives)  # a function of (seed, step): resume draws the same
    assert not torch.equal(other["negatives"], negatives)


def test_negatives_are_uniform_over_the_unseen_items(dataset):
    ds, windows, users = dataset
    sampler = data.NegativeSampler(ds, 1)
    user = int(np.argmax(np.bincount(users)))  # a user with several windows
    draws = sampler.sample(np.array([user]), (200_000,), np.random.default_rng(0))[0]
    counts = np.bincount(draws, minlength=NUM_ITEMS + 1)[1:]
    seen = np.zeros(NUM_ITEMS, bool)
    seen[np.array(sorted(seen_sets(ds, windows, users)[user])) - 1] = True
    assert seen.any() and (counts[seen] == 0).all()
    expected = len(draws) / (~seen).sum()
    # Binomial counts: every unseen item within 5 standard deviations of the uniform expectation.
    assert np.abs(counts[~seen] - expected).max() < 5 * np.sqrt(expected)


def test_sampler_rejects_a_user_who_has_seen_everything():
    ds = data.SeqDataset("tiny", 3, np.array([1, 2, 3, 1, 2]), np.array([0, 5]))  # training part: 1 2 3
    with pytest.raises(ValueError, match="user 0 has seen all 3 items"):
        data.NegativeSampler(ds, 1)


def test_sampled_loss_equals_the_hand_written_one():
    """sum over real positions of -log s(pos) / #real + sum of -log(1 - s(neg)) / (#real K), in float64."""
    gen = torch.Generator().manual_seed(0)
    B, T, D, K, V = 2, 3, 4, 2, 7
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    items = torch.randn(V, D, generator=gen, dtype=torch.float64)
    bias = torch.randn(V, generator=gen, dtype=torch.float64)
    positives = torch.tensor([[1, 4, -1], [0, 6, 2]])
    negatives = torch.randint(0, V, (B, T, K), generator=gen)
    weight = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    got = losses.sampled_bce_loss(hidden, items, bias, positives, negatives, weight)

    pos_sum = neg_sum = 0.0
    real = [(b, t) for b in range(B) for t in range(T) if weight[b, t]]
    for b, t in real:
        score = lambda v: float(hidden[b, t] @ items[v] + bias[v])  # noqa: E731
        pos_sum += -np.log(1 / (1 + np.exp(-score(positives[b, t]))))
        neg_sum += sum(-np.log(1 - 1 / (1 + np.exp(-score(v)))) for v in negatives[b, t].tolist())
    expected = pos_sum / len(real) + neg_sum / (len(real) * K)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)

    # The PyTorch SASRec code it mirrors: two BCEWithLogitsLoss means over the real positions.
    bce, index = torch.nn.BCEWithLogitsLoss(), weight > 0
    pos_logits = (hidden * items[positives.clamp(min=0)]).sum(-1) + bias[positives.clamp(min=0)]
    neg_logits = torch.einsum("btd,btkd->btk", hidden, items[negatives]) + bias[negatives]
    pmixer = bce(pos_logits[index], torch.ones_like(pos_logits[index])) + \
        bce(neg_logits[index], torch.zeros_like(neg_logits[index]))
    torch.testing.assert_close(got, pmixer, rtol=1e-12, atol=0)


def test_sampled_run_trains_and_starts_its_bias_at_log_one_over_k(tmp_path):
    cfg = train.TrainConfig(dataset="synthetic", synthetic_items=NUM_ITEMS, synthetic_users=64, max_len=MAX_LEN,
                            k=3, dim=16, num_layers=1, num_heads=2, batch_size=32, eval_batch_size=32, epochs=1,
                            loss="sampled", negatives=4, out_dir=str(tmp_path))
    model, _, _ = train.build_model(cfg, NUM_ITEMS, torch.device("cpu"), None)
    torch.testing.assert_close(model.item_bias.detach(), torch.full((NUM_ITEMS,), float(np.log(1 / 4))))
    result = train.train(cfg)
    assert result["setup"]["loss"] == "sampled" and result["setup"]["negatives"] == 4
    assert np.isfinite(result["history"][0]["train_loss"]) and 0 <= result["test"]["HR@10"] <= 1
