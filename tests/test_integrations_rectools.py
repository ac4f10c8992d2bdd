"""`torch_cutbce.integrations.rectools.CutBCEModule` in RecTools' own SASRec and BERT4Rec
(rectools[torch] 0.19.0, numpy 1.26; the environment: ci/rectools.sh, .venv-rectools).

The truth is independent of the conversion: RecTools' own full-catalog logits (`torch_model(batch)`,
every row of the table) in float64, restricted to the catalog's own item ids
(`get_known_items_sorted_internal_ids()`), plus the bias, a dense BCE against the one-hot of `y` on
the positions whose `y` is one of those items, times `yw`, over their count. The rule for float32
(tests/parity.py's for a reduced dtype): CutBCE's error against that truth is at most the dense
float32 BCE's own plus 1e-5, for the loss and every parameter's gradient; in float64 within 1e-10.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("rectools", reason="RecTools runs in its own environment: bash ci/rectools.sh")
pytest.importorskip("pytorch_lightning")

import pandas as pd  # noqa: E402
from parity import relative_error  # noqa: E402
from pytorch_lightning import seed_everything  # noqa: E402
from rectools import Columns  # noqa: E402
from rectools.dataset import Dataset  # noqa: E402
from rectools.models import BERT4RecModel, SASRecModel  # noqa: E402

from torch_cutbce import SpecialRows, cut_bce_with_logits  # noqa: E402
from torch_cutbce.integrations.rectools import CutBCEModule  # noqa: E402

MODELS = {"sasrec": SASRecModel, "bert4rec": BERT4RecModel}
USERS, ITEMS = 40, 60
FLOAT32_SLACK = 1e-5


def interactions(seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [(u, f"i{i}", float(rng.integers(1, 4)), t)  # weights 1..3: yw matters
            for u in range(USERS) for t, i in enumerate(rng.choice(ITEMS, size=rng.integers(3, 12), replace=False))]
    return pd.DataFrame(rows, columns=[Columns.User, Columns.Item, Columns.Weight, Columns.Datetime])


def last_of_even_users(interactions: pd.DataFrame) -> np.ndarray:
    """The validation split: every even user's last interaction."""
    last = interactions.groupby(Columns.User)[Columns.Datetime].transform("max") == interactions[Columns.Datetime]
    return (last & (interactions[Columns.User] % 2 == 0)).to_numpy()


def build(name, *, epochs=1, item_bias=True, **config):
    seed_everything(0, verbose=False)
    config = dict(n_factors=16, n_blocks=1, n_heads=2, session_max_len=8, dropout_rate=0.0, batch_size=64,
                  deterministic=True, epochs=epochs, loss="cutbce", lightning_module_type=CutBCEModule,
                  lightning_module_kwargs={"item_bias": item_bias}) | config
    return MODELS[name](**config)


def fitted(name, **config):
    model = build(name, **config)
    model.fit(Dataset.construct(interactions()))
    return model


def train_batch(module, seed=0):
    np.random.seed(seed)  # BERT4Rec's masking
    return next(iter(module.data_preparator.get_dataloader_train()))


def dense_truth(module, batch):
    """RecTools' own logits over the catalog's own items, a dense BCE (see the module docstring)."""
    tm = module.torch_model
    items = torch.as_tensor(module.data_preparator.get_known_items_sorted_internal_ids())
    logits = tm(batch=batch)[..., items] / module.logits_t  # [B, T, V]: the item columns only
    if module.item_bias is not None:
        logits = logits + tm.item_bias
    y = batch["y"]
    one_hot = (y[..., None] == items).to(logits.dtype)
    per_position = torch.nn.functional.binary_cross_entropy_with_logits(logits, one_hot, reduction="none").sum(-1)
    real = torch.isin(y, items)
    return (per_position * batch["yw"] * real).sum() / real.sum()


def loss_and_grads(fn, module, batch):
    module.torch_model.zero_grad(set_to_none=True)
    loss = fn(module, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in module.torch_model.named_parameters()
                           if p.grad is not None}


def ours(module, batch):
    return module._calc_custom_loss(batch, 0)


def in_float64(module):
    module = copy.deepcopy(module)
    module.torch_model.double()
    return module


@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_match_a_dense_bce_over_the_items(name):
    module = fitted(name).lightning_model
    batch = train_batch(module)
    truth = loss_and_grads(dense_truth, in_float64(module), batch)
    dense32 = loss_and_grads(dense_truth, module, batch)
    ours32 = loss_and_grads(ours, module, batch)
    ours64 = loss_and_grads(ours, in_float64(module), batch)
    assert set(ours32[1]) == set(truth[1]) and "item_bias" in truth[1]
    cases = [("loss", ours32[0], dense32[0], ours64[0], truth[0])] + [
        (n, ours32[1][n], dense32[1][n], ours64[1][n], truth[1][n]) for n in truth[1]]
    for label, o, d, o64, t in cases:
        ours_err, _ = relative_error(o.double().numpy(), t.numpy())
        dense_err, _ = relative_error(d.double().numpy(), t.numpy())
        assert ours_err <= dense_err + FLOAT32_SLACK, f"{name} {label}: {ours_err:.2e} > {dense_err:.2e} + slack"
        exact_err, _ = relative_error(o64.numpy(), t.numpy())
        assert exact_err <= 1e-10, f"{name} {label} in float64: {exact_err:.2e}"
    assert batch["y"].eq(0).any()  # the batch has positions without a target


def test_the_truth_fails_on_the_traps():
    """BERT4Rec: scoring MASK as a negative (a padding-row-only conversion) or taking `yw` as the
    target mask is far from the truth, so the test above can fail."""
    module = in_float64(fitted("bert4rec").lightning_model)
    batch = train_batch(module)
    with torch.no_grad():
        truth = dense_truth(module, batch)
        table = module.torch_model.item_model.get_all_embeddings()
        hidden = module.torch_model.encode_sessions(batch, table)
        y, yw, bias = batch["y"], batch["yw"].double(), module.item_bias
        real = y >= 2
        first = dict(weight=yw * real, reduction="sum")
        right = cut_bce_with_logits(hidden, table, y[..., None], bias, special_rows=SpecialRows.first(2),
                                    **first) / real.sum()
        # The padding rule alone: PAD left out, MASK scored as an item (its bias 0).
        mask_scored = cut_bce_with_logits(hidden, table, y[..., None], torch.cat([bias.new_zeros(2), bias]),
                                          special_rows=SpecialRows.first(1), **first) / real.sum()
        yw_as_mask = cut_bce_with_logits(hidden, table, y[..., None], bias, special_rows=SpecialRows.first(2),
                                         weight=yw, reduction="sum") / real.sum()
    assert abs(float(right - truth)) <= 1e-12 * float(truth)
    assert abs(float(mask_scored - truth)) > 1e-3 * float(truth)
    assert abs(float(yw_as_mask - truth)) > 1e-1 * float(truth)


@pytest.mark.parametrize("name", MODELS)
def test_lightning_fit_trains_the_bias_and_lowers_the_loss(name):
    model = build(name, epochs=5)
    dataset = Dataset.construct(interactions())
    model.fit(dataset)
    module = model.lightning_model
    params = dict(module.torch_model.named_parameters())
    assert params["item_bias"] is module.item_bias and module.item_bias.shape == (ITEMS,)
    start = np.log(1 / ITEMS)
    assert (module.item_bias.detach() - start).abs().max() > 1e-3  # RecTools' optimizer trained it
    trained = float(ours(module, train_batch(module)))
    untrained = build(name, epochs=0)
    untrained.fit(dataset)
    assert trained < float(ours(untrained.lightning_model, train_batch(untrained.lightning_model)))


@pytest.mark.parametrize("name", MODELS)
def test_recommend_ranks_with_the_bias(name):
    model = fitted(name)
    dataset = Dataset.construct(interactions())
    tm = model.lightning_model.torch_model
    with torch.no_grad():
        tm.item_bias.normal_(0, 2)
    users = list(range(USERS))
    ranked = model.recommend(users=users, dataset=dataset, k=ITEMS, filter_viewed=False)
    bias = tm.item_bias.detach().clone()
    tm.item_bias = None  # RecTools' own scoring: the dot product alone
    plain = model.recommend(users=users, dataset=dataset, k=ITEMS, filter_viewed=False)
    tm.item_bias = torch.nn.Parameter(bias)
    ids = model.data_preparator.item_id_map
    key = [Columns.User, Columns.Item]
    both = ranked.merge(plain, on=key, suffixes=("", "_plain"))
    assert len(both) == USERS * ITEMS
    internal = ids.convert_to_internal(both[Columns.Item].to_numpy()) - model.data_preparator.n_item_extra_tokens
    expected = both["score_plain"].to_numpy() + bias.numpy()[internal]
    np.testing.assert_allclose(both[Columns.Score].to_numpy(), expected, rtol=1e-5, atol=1e-5)
    assert not ranked[Columns.Item].isin(["PAD", "MASK"]).any()
    filtered = model.recommend(users=users, dataset=dataset, k=5, filter_viewed=True)
    seen = set(map(tuple, interactions()[key].to_numpy()))
    assert not any((u, i) in seen for u, i in filtered[key].to_numpy())


@pytest.mark.parametrize("name", MODELS)
def test_validation_split_logs_the_loss_on_the_validation_targets(name):
    model = build(name, get_val_mask_func=last_of_even_users)
    model.fit(Dataset.construct(interactions()))
    logged = float(model.fit_trainer.callback_metrics["val_loss"])
    module = model.lightning_model
    batch = next(iter(module.data_preparator.get_dataloader_val()))
    assert len(batch["y"]) == USERS // 2  # one batch: the logged mean is this batch's loss
    module.eval()
    with torch.no_grad():
        ours_val = float(module._calc_custom_loss_outputs(batch, 0)["loss"])
        tm = in_float64(module)
        items = torch.as_tensor(module.data_preparator.get_known_items_sorted_internal_ids())
        logits = tm.torch_model(batch=batch)[:, -1, items] + tm.item_bias  # [B, V]
        y = batch["y"][:, -1]
        dense = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, (y[:, None] == items).double(), reduction="none").sum(-1)
        dense = float((dense * batch["yw"][:, -1]).sum() / len(y))
    assert abs(logged - dense) <= 1e-5 * dense and abs(ours_val - dense) <= 1e-5 * dense


@pytest.mark.parametrize("name", MODELS)
def test_save_and_load_keep_the_bias_and_the_recommendations(name, tmp_path):
    model = fitted(name)
    dataset = Dataset.construct(interactions())
    before = model.recommend(users=list(range(USERS)), dataset=dataset, k=5, filter_viewed=True)
    model.save(tmp_path / "model.pkl")
    loaded = MODELS[name].load(tmp_path / "model.pkl")
    assert isinstance(loaded.lightning_model, CutBCEModule)
    torch.testing.assert_close(loaded.lightning_model.item_bias, model.lightning_model.item_bias, rtol=0, atol=0)
    after = loaded.recommend(users=list(range(USERS)), dataset=dataset, k=5, filter_viewed=True)
    pd.testing.assert_frame_equal(before, after)


def test_bad_input_names_the_argument():
    dataset = Dataset.construct(interactions())
    with pytest.raises(ValueError, match=r"loss: CutBCEModule computes loss='cutbce'; got loss='softmax'"):
        build("sasrec", loss="softmax").fit(dataset)
    with pytest.raises(TypeError, match=r"options: unknown keywords \['block'\]"):
        build("sasrec", lightning_module_kwargs={"options": {"block": 8}}).fit(dataset)
    with pytest.raises(TypeError, match=r"item_bias: expected True or False, got 1"):
        build("bert4rec", lightning_module_kwargs={"item_bias": 1}).fit(dataset)
    # round 7: a misspelt keyword trained without a bias, silently; bias_init='a' failed deep in torch
    with pytest.raises(TypeError, match=r"lightning_module_kwargs: unknown keywords \['itembias'\]; .*item_bias"):
        build("sasrec", lightning_module_kwargs={"itembias": True}).fit(dataset)
    with pytest.raises(TypeError, match=r"bias_init: expected a finite number .* got 'a'"):
        build("sasrec", lightning_module_kwargs={"item_bias": True, "bias_init": "a"}).fit(dataset)


def test_the_benchmark_runs_tiny(tmp_path):
    from benchmarks import rectools_loss

    out = tmp_path / "rectools_loss.txt"
    rectools_loss.main(["--num-items", "300", "--rounds", "1", "--out", str(out)])
    text = out.read_text()
    assert "| 300 |" in text and "MiB" in text and "x |" in text
    with pytest.raises(SystemExit):
        rectools_loss.main(["--rounds", "0", "--out", str(out)])


def test_the_ml100k_example_runs_tiny(tmp_path, capsys):
    from examples import rectools_ml100k

    rng = np.random.default_rng(0)
    lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    lines += [f"u{u}\tm{i}\t1\t{t}" for u in range(30) for t, i in enumerate(rng.choice(40, 8, replace=False))]
    inter = tmp_path / "tiny.inter"
    inter.write_text("\n".join(lines) + "\n")
    tiny = ["--data-path", str(inter), "--epochs", "1", "--factors", "8", "--blocks", "1", "--heads", "1",
            "--max-len", "8", "--resamples", "50"]
    assert rectools_ml100k.main([*tiny, "--losses", "cutbce", "bce", "--out", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "| CutBCE |" in out and "| RecTools BCE |" in out and "interval" in out
    with pytest.raises(SystemExit):
        rectools_ml100k.main([*tiny, "--losses", "softmax"])  # the table needs CutBCE
