"""examples/: the full-softmax cross-entropy baseline (--loss ce): its loss, its step, its flags.

Resume exactness for it: test_examples_train.py::test_resume_after_kill_equals_uninterrupted_run.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from examples_extra import require_examples

require_examples()

from examples import data, losses, train  # noqa: E402
from examples.bert4rec import BERT4Rec  # noqa: E402
from examples.sasrec import RecConfig, SASRec  # noqa: E402

pytestmark = pytest.mark.rung4

NUM_ITEMS, MAX_LEN = 300, 10


def tiny_config(tmp_path, **overrides) -> train.TrainConfig:
    settings = dict(dataset="synthetic", synthetic_items=NUM_ITEMS, synthetic_users=64, max_len=MAX_LEN, k=3, dim=16,
                    num_layers=1, num_heads=2, batch_size=32, epochs=1, eval_batch_size=32, loss="ce",
                    out_dir=str(tmp_path / "run"))
    settings.update(overrides)
    return train.TrainConfig(**settings)


def random_case(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T, D, V, k = 3, 4, 5, 11, 3
    hidden = torch.randn(B, T, D, generator=gen, dtype=dtype)
    items = torch.randn(V, D, generator=gen, dtype=dtype)
    bias = torch.randn(V, generator=gen, dtype=dtype)
    targets = torch.randint(0, V, (B, T, k), generator=gen)
    targets[0, 0] = -1  # a padded position
    targets[1, 2, 1:] = -1  # fewer positives than k
    weight = (targets[..., 0] >= 0).to(dtype)
    return hidden, items, bias, targets, weight


def test_ce_equals_the_hand_written_softmax():
    """mean over real positions of -log softmax(h . w + b)[first target], in float64."""
    hidden, items, bias, targets, weight = random_case()
    got = losses.softmax_ce_loss(hidden, items, bias, targets, weight)
    total, real = 0.0, 0
    for b, t in zip(*np.nonzero(weight.numpy())):
        scores = (hidden[b, t] @ items.T + bias).numpy()
        log_z = np.log(np.exp(scores - scores.max()).sum()) + scores.max()
        total += log_z - scores[int(targets[b, t, 0])]
        real += 1
    torch.testing.assert_close(got, torch.tensor(total / real, dtype=torch.float64), rtol=1e-12, atol=0)
    # The later positives of a position play no part: a softmax has one class per position.
    other = targets.clone()
    other[..., 1:] = torch.randint(0, items.shape[0], other[..., 1:].shape)
    assert torch.equal(losses.softmax_ce_loss(hidden, items, bias, other, weight), got)
    assert torch.isfinite(losses.softmax_ce_loss(hidden, items, None, targets, weight))


def test_ce_in_chunks_equals_the_whole_computation():
    """More positions than a chunk: the checkpointed chunks give the value and every gradient of one block."""
    hidden, items, bias, targets, weight = random_case(torch.float64, seed=1)
    results = []
    for chunk in (10_000, 5, 1):
        leaves = [x.clone().requires_grad_() for x in (hidden, items, bias)]
        loss = losses.softmax_ce_loss(*leaves, targets, weight, chunk_positions=chunk)
        loss.backward()
        results.append((loss.detach(), [x.grad for x in leaves]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-12, atol=0)
        for grad, whole in zip(grads, results[0][1]):
            torch.testing.assert_close(grad, whole, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("model", ["sasrec", "bert4rec"])
def test_the_examples_ce_step_is_cross_entropy_on_the_first_target(tmp_path, model):
    """loss_of_batch with --loss ce = F.cross_entropy over the model's catalog logits at the batch's
    first target (SASRec: the next item; BERT4Rec: the masked item), mean over real positions."""
    cfg = tiny_config(tmp_path, model=model, bert_labels=2, dropout=0.0)
    ds = data.synthetic(NUM_ITEMS, 64, seed=0)
    windows = data.train_windows(ds, cfg.holdout, MAX_LEN, cfg.labels)
    net = {"sasrec": SASRec, "bert4rec": BERT4Rec}[model](RecConfig(NUM_ITEMS, MAX_LEN, 16, 1, 2, dropout=0.0))
    with torch.no_grad():
        net.item_bias.normal_()
    batch = train.make_batch(windows[:27], cfg, net, step=0)
    loss = train.loss_of_batch(net, batch, cfg)
    if model == "sasrec":  # the first target is the next input item
        real = batch["weight"][:, :-1] > 0
        assert torch.equal(batch["targets"][:, :-1, 0][real], batch["inputs"][:, 1:][real] - 1)
    logits = net(batch["inputs"]) @ net.item_weight.T + net.item_bias
    real = batch["weight"] > 0
    expected = F.cross_entropy(logits[real], batch["targets"][..., 0][real])
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert int(real.sum()) < real.numel()  # the padding rows were in the batch and left out


def test_ce_run_trains_with_its_bias_started_at_zero(tmp_path):
    cfg = tiny_config(tmp_path)
    model, _, _ = train.build_model(cfg, NUM_ITEMS, torch.device("cpu"), None)
    assert torch.equal(model.item_bias.detach(), torch.zeros(NUM_ITEMS))  # a softmax is shift-invariant
    result = train.train(cfg)
    assert result["setup"]["loss"] == "ce" and result["setup"]["normalization"] is None
    first = result["history"][0]["train_loss"]
    assert np.isfinite(first) and first < np.log(NUM_ITEMS) + 0.1  # below the uniform softmax's loss
    assert 0 <= result["test"]["HR@10"] <= 1 and "NDCG@10" in result["test"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--loss", "ce", "--pos-weight", "2"], r"--loss ce has no positive weight .*got --pos-weight 2.0"),
        (["--loss", "ce", "--normalization", "items"], r"--loss ce is the mean over real positions .*items"),
        (["--loss", "ce", "--device", "xla", "--mesh", "2x2"], "--loss ce runs on one device, got --mesh 2x2"),
        (["--loss", "ce", "--fsdp"], "--fsdp: the loss reads the sharded item table directly.*got --loss ce"),
        (["--loss", "softmax"], "argument --loss: invalid choice: 'softmax'"),
    ],
)
def test_bad_ce_flag_combinations_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("examples/train.py: error:")]
    assert re.search(message, line), err



TINY = ["--dataset", "synthetic", "--synthetic-items", "300", "--synthetic-users", "64", "--max-len", "10",
        "--k", "3", "--dim", "16", "--num-layers", "1", "--num-heads", "2", "--batch-size", "16"]


def test_step_cost_times_each_loss_beside_a_free_step(capsys):
    """examples/step_cost.py (benchmarks/results/ml100k.md, 'CutBCE vs full-softmax cross-entropy'): every loss and 'free' timed, interleaved."""
    from examples import step_cost

    cfg = tiny_config(Path("unused"), batch_size=16, loss="cutbce")
    times = step_cost.step_costs(cfg, ["cutbce", "ce", "sampled"], rounds=2)
    assert list(times) == ["free", "cutbce", "ce", "sampled"]
    assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in times.values())
    assert step_cost.main(TINY + ["--rounds", "1", "--losses", "ce"]) == 0
    out = capsys.readouterr().out
    assert "free" in out and re.search(r"ce .* loss -?\d+\.\d% of the step", out), out


@pytest.mark.parametrize("argv, message", [(["--losses", "ce,softmax"], "--losses takes names of"),
                                           (["--rounds", "0"], "--rounds must be >= 1"),
                                           (["--losses", "ce", "--pos-weight", "2"], "--loss ce has no positive")])
def test_step_cost_bad_flags_exit_2(capsys, argv, message):
    from examples import step_cost

    with pytest.raises(SystemExit) as exit_info:
        step_cost.main(TINY + argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err, err
