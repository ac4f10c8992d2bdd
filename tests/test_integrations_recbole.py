"""`torch_cutbce.integrations.recbole`: RecBole 1.2.1's own SASRec and BERT4Rec with
`loss_type="CutBCE"` (the environment: ci/recbole.sh, .venv-recbole).

The truth is independent of the conversion: the model's scoring vectors against every row of its
table in float64, restricted to the item rows (ids 1..V; PAD 0 and BERT4Rec's MASK left out), plus
the bias by id, a dense BCE against the one-hot of the target on the positions whose target is an
item, over their count. float32: CutBCE's error is at most dense float32's plus 1e-5; float64 1e-10.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("recbole", reason="RecBole runs in its own environment: bash ci/recbole.sh")

from parity import relative_error  # noqa: E402
from recbole.config import Config  # noqa: E402
from recbole.data import create_dataset, data_preparation  # noqa: E402
from recbole.trainer import Trainer  # noqa: E402
from recbole.utils import init_seed  # noqa: E402

from torch_cutbce.integrations.recbole import BERT4Rec, SASRec, batch_loss  # noqa: E402

MODELS = {"SASRec": SASRec, "BERT4Rec": BERT4Rec}
USERS, ITEMS = 30, 40
FLOAT32_SLACK = 1e-5


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # RecBole's Trainer and logger write log/ and log_tensorboard/ in the working folder


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("recbole")
    (root / "tiny").mkdir()
    rng = np.random.default_rng(0)
    lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    lines += [f"u{u}\ti{i}\t1\t{t}" for u in range(USERS) for t, i in enumerate(rng.choice(ITEMS, 10, replace=False))]
    (root / "tiny" / "tiny.inter").write_text("\n".join(lines) + "\n")
    return str(root)


def setup(name, data_path, tmp_path, **extra):
    cfg = dict(data_path=data_path, epochs=2, train_batch_size=64, eval_batch_size=64, MAX_ITEM_LIST_LENGTH=8,
               hidden_size=8, inner_size=16, n_layers=1, n_heads=1, loss_type="CutBCE", train_neg_sample_args=None,
               hidden_dropout_prob=0.0, attn_dropout_prob=0.0, eval_args={"split": {"LS": "valid_and_test"},
                                                                        "order": "TO", "mode": "full"},
               topk=[5], metrics=["Hit", "NDCG"], valid_metric="NDCG@5", show_progress=False, device="cpu",
               use_gpu=False, checkpoint_dir=str(tmp_path), state="ERROR", user_inter_num_interval="[0,inf)",
               item_inter_num_interval="[0,inf)", load_col={"inter": ["user_id", "item_id", "timestamp"]}) | extra
    config = Config(model=MODELS[name], dataset="tiny", config_dict=cfg)
    init_seed(config["seed"], config["reproducibility"])
    train, valid, test = data_preparation(config, create_dataset(config))
    return config, MODELS[name](config, train.dataset), train, valid, test


def scoring(model, batch):
    """(hidden [*S, D], targets [*S]) as the model's CutBCE path scores them."""
    if isinstance(model, BERT4Rec):
        out = model.forward(batch[model.MASK_ITEM_SEQ])
        index = batch[model.MASK_INDEX]
        return out.gather(1, index[..., None].expand(-1, -1, out.shape[-1])), batch[model.POS_ITEMS]
    return model.forward(batch[model.ITEM_SEQ], batch[model.ITEM_SEQ_LEN]), batch[model.POS_ITEM_ID]


def dense_truth(model, batch):
    hidden, targets = scoring(model, batch)
    items = torch.arange(1, model.n_items)  # the item rows only
    bias = model.output_bias if isinstance(model, BERT4Rec) else model.item_bias
    logits = hidden @ model.item_embedding.weight[items].T + bias[items]
    one_hot = (targets[..., None] == items).to(logits.dtype)
    per_position = torch.nn.functional.binary_cross_entropy_with_logits(logits, one_hot, reduction="none").sum(-1)
    real = (targets > 0) & (targets < model.n_items)
    return (per_position * real).sum() / real.sum()


def loss_and_grads(fn, model, batch, upstream=1.7):
    model.zero_grad(set_to_none=True)
    loss = fn(model, batch)
    (loss * upstream).backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def first_batch(train):
    torch.manual_seed(0)
    import random

    random.seed(0)  # BERT4Rec's masking
    return next(iter(train))


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_match_a_dense_bce_over_the_items(name, data_path, tmp_path):
    _, model, train, _, _ = setup(name, data_path, tmp_path)
    model.eval()  # no dropout: the same scoring vectors in every run below
    with torch.no_grad():
        bias = model.output_bias if name == "BERT4Rec" else model.item_bias
        bias.normal_(-3, 1)  # a spread bias: an off-by-one id shift changes the loss
    batch = first_batch(train)
    model64 = copy.deepcopy(model).double()
    truth = loss_and_grads(dense_truth, model64, batch)
    dense32 = loss_and_grads(dense_truth, model, batch)
    ours32 = loss_and_grads(lambda m, b: m.calculate_loss(b), model, batch)
    ours64 = loss_and_grads(lambda m, b: m.calculate_loss(b), model64, batch)
    assert set(ours32[1]) == set(truth[1]) and ("output_bias" if name == "BERT4Rec" else "item_bias") in truth[1]
    cases = [("loss", ours32[0], dense32[0], ours64[0], truth[0])] + [
        (n, ours32[1][n], dense32[1][n], ours64[1][n], truth[1][n]) for n in truth[1]
        if not n.endswith("key.bias")]  # attention is invariant to the key's bias: its gradient is 0 up to rounding
    for label, o, d, o64, t in cases:
        ours_err, _ = relative_error(o.double().numpy(), t.numpy())
        dense_err, _ = relative_error(d.double().numpy(), t.numpy())
        assert ours_err <= dense_err + FLOAT32_SLACK, f"{name} {label}: {ours_err:.2e} > {dense_err:.2e} + slack"
        exact_err, _ = relative_error(o64.numpy(), t.numpy())
        assert exact_err <= 1e-10, f"{name} {label} in float64: {exact_err:.2e}"
    # The loss's own gradient of the table (hidden held: MASK is also an input embedding) and the bias.
    hidden, targets = scoring(model, batch)
    w = model.item_embedding.weight
    grad_w, grad_b = torch.autograd.grad(model._loss(hidden.detach(), targets, bias), (w, bias))
    special = [0, model.n_items] if name == "BERT4Rec" else [0]
    assert grad_w[special].abs().max() == 0 and grad_b[0] == 0  # PAD (, MASK): exactly 0
    assert grad_w[1:model.n_items].abs().min(-1).values.gt(0).any()
    if name == "BERT4Rec":
        assert batch[model.POS_ITEMS].eq(0).any()  # the batch has padded mask slots


@pytest.mark.parametrize("name", MODELS)
def test_the_trainer_trains_with_cutbce_and_ranks_with_the_bias(name, data_path, tmp_path):
    config, model, train, valid, test = setup(name, data_path, tmp_path)
    bias_name = "output_bias" if name == "BERT4Rec" else "item_bias"
    start = dict(model.named_parameters())[bias_name].detach().clone()
    assert start.shape == (model.n_items,) and torch.allclose(start, torch.tensor(np.log(1 / (model.n_items - 1))).float())
    trainer = Trainer(config, model)
    trainer.fit(train, valid, saved=False)
    assert (dict(model.named_parameters())[bias_name].detach() - start).abs().max() > 1e-4  # the Trainer trained it
    result = trainer.evaluate(test, load_best_model=False)
    assert set(result) == {"hit@5", "ndcg@5"}
    model.eval()
    batch = next(iter(test))[0]
    with torch.no_grad():
        scores = model.full_sort_predict(batch)
        assert scores.shape[-1] == model.n_items and torch.isneginf(scores[:, 0]).all()
        assert torch.isfinite(scores[:, 1:]).all()
        bias = dict(model.named_parameters())[bias_name]
        bias += torch.arange(model.n_items) * 100.0  # the bias alone now decides the ranking
        assert (model.full_sort_predict(batch).argmax(-1) == model.n_items - 1).all()
        batch.update(type(batch)({model.ITEM_ID: torch.arange(len(batch)) % model.n_items}))
        one = model.predict(batch)
        picked = model.full_sort_predict(batch)[torch.arange(len(batch)), batch[model.ITEM_ID]]
        torch.testing.assert_close(one, picked)
        assert torch.isneginf(one[batch[model.ITEM_ID] == 0]).all()


@pytest.mark.parametrize("name", MODELS)
def test_save_and_load_round_trip(name, data_path, tmp_path, monkeypatch):
    from torch_cutbce.integrations.recbole import load_data_and_model

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # RecBole's checkpoints pickle its Config
    config, model, train, valid, test = setup(name, data_path, tmp_path, epochs=1)
    trainer = Trainer(config, model)
    trainer.fit(train, valid, saved=True)
    before = trainer.evaluate(test, load_best_model=True)  # RecBole's own load of its checkpoint
    _, loaded, _, _, _, test2 = load_data_and_model(trainer.saved_model_file)
    assert type(loaded) is type(model) and loaded.loss_type == "CutBCE"
    for (n, p), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == n2 and torch.equal(p, p2), n
    assert Trainer(config, loaded).evaluate(
        test2, load_best_model=False) == before


def test_bad_config_names_the_key(data_path, tmp_path):
    with pytest.raises(ValueError, match=r"loss_type: expected one of \['CE', 'BPR', 'CutBCE'\], got 'cutbce'"):
        setup("SASRec", data_path, tmp_path, loss_type="cutbce")
    config, _, train, _, _ = setup("BERT4Rec", data_path, tmp_path)
    config["train_neg_sample_args"] = {"distribution": "uniform", "sample_num": 1}  # RecBole's loaders refuse it too
    with pytest.raises(ValueError, match=r"train_neg_sample_args: loss_type='CutBCE' scores every item"):
        BERT4Rec(config, train.dataset)
    with pytest.raises(ValueError, match=r"cutbce_options: unknown keywords \['block'\]"):
        setup("SASRec", data_path, tmp_path, cutbce_options={"block": 8})
    with pytest.raises(ValueError, match=r"targets: expected one item id per position of hidden, shape \(4,\); got \(4, 1\)"):
        batch_loss(torch.zeros(4, 3), torch.zeros(6, 3), torch.zeros(4, 1, dtype=torch.long), special=(0,))


def test_ce_and_bpr_stay_recboles_own(data_path, tmp_path):
    from recbole.model.sequential_recommender import sasrec

    _, ours, train, _, _ = setup("SASRec", data_path, tmp_path, loss_type="CE")
    assert not hasattr(ours, "item_bias")
    batch = first_batch(train)
    init_seed(2020, True)
    theirs = sasrec.SASRec(setup("SASRec", data_path, tmp_path, loss_type="CE")[0], train.dataset)
    theirs.load_state_dict(ours.state_dict())
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours.calculate_loss(batch), theirs.calculate_loss(batch), rtol=0, atol=0)
