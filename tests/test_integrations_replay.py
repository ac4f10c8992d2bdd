"""`torch_cutbce.integrations.replay.CutBCE` in RePlay's own SasRec and LightningModule, against
RePlay's own `BCE` (replay-rec 0.22; the environment: ci/replay.sh, .venv-replay).

The rule for float32 (tests/parity.py's rule for a reduced dtype): on the same model and batch,
CutBCE's error against a float64 truth (RePlay's BCE on the model in float64) is at most RePlay's
own float32 error plus 1e-5, for the loss and for every parameter's gradient. RePlay's `.double()`
leaves its attention masks float32 (`DefaultAttentionMask`, the encoder's key padding mask), which
skews a float64 truth; a forward pre-hook on each `MultiheadAttention` casts them to the query's dtype.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

replay = pytest.importorskip("replay", reason="RePlay runs in its own environment: bash ci/replay.sh")
pytest.importorskip("lightning")

from parity import assert_close, relative_error  # noqa: E402
from torch_cutbce import full_catalog_topk  # noqa: E402
from torch_cutbce.integrations import replay as integration  # noqa: E402
from torch_cutbce.integrations.replay import CutBCE, score_with_bias  # noqa: E402

V, D, T, HEADS = 40, 16, 8, 2
FLOAT32_SLACK = 1e-5


def build_model(loss, *, padding_value=V, seed=0):
    """RePlay's SasRec as its docs build it (no dropout, so that runs compare), V items."""
    from replay.nn.sequential import SasRec

    body = build_body(padding_value, seed)
    torch.manual_seed(seed)
    return SasRec(body=body, loss=loss)


def build_body(padding_value=V, seed=0):
    from replay.data import FeatureHint, FeatureSource, FeatureType
    from replay.data.nn import TensorFeatureInfo, TensorFeatureSource, TensorSchema
    from replay.nn.agg import SumAggregator
    from replay.nn.embedding import SequenceEmbedding
    from replay.nn.mask import DefaultAttentionMask
    from replay.nn.sequential import PositionAwareAggregator, SasRecBody, SasRecTransformerLayer

    schema = TensorSchema([TensorFeatureInfo(
        "item_id", is_seq=True, feature_type=FeatureType.CATEGORICAL, embedding_dim=D,
        padding_value=padding_value, cardinality=V, feature_hint=FeatureHint.ITEM_ID,
        feature_sources=[TensorFeatureSource(FeatureSource.INTERACTIONS, "item_id")])])
    torch.manual_seed(seed)
    body = SasRecBody(
        embedder=SequenceEmbedding(schema=schema),
        embedding_aggregator=PositionAwareAggregator(embedding_aggregator=SumAggregator(embedding_dim=D),
                                                     max_sequence_length=T, dropout=0.0),
        attn_mask_builder=DefaultAttentionMask(reference_feature_name="item_id", num_heads=HEADS),
        encoder=SasRecTransformerLayer(embedding_dim=D, num_heads=HEADS, num_blocks=2, dropout=0.0,
                                       activation="relu", hidden_dim=2 * D),
        output_normalization=torch.nn.LayerNorm(D))
    return body


def _masks_in_query_dtype(module, args, kwargs):
    for key in ("attn_mask", "key_padding_mask"):
        if kwargs.get(key) is not None and kwargs[key].is_floating_point():
            kwargs[key] = kwargs[key].to(args[0].dtype)
    return args, kwargs


def in_float64(model):
    model = copy.deepcopy(model).double()
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            m.register_forward_pre_hook(_masks_in_query_dtype, with_kwargs=True)
    return model


def make_batch(num_labels=1, seed=0, padding_value=V, batch=5):
    """RePlay's training batch: left-padded sequences, next-item labels (`num_labels` next items,
    ragged: labels past a sequence's end padded with `padding_value`, masked per label)."""
    g = torch.Generator().manual_seed(seed)
    items = [i for i in range(V + 1) if i != padding_value]
    lengths = torch.tensor([T + num_labels, 3 + num_labels, 6, T + 1, 2])[:batch]
    seqs = []
    for n in lengths.tolist():
        s = torch.tensor(items)[torch.randint(0, V, (n,), generator=g)]
        seqs.append(torch.cat([torch.full((T + num_labels - n,), padding_value), s]))
    full = torch.stack(seqs)  # [B, T + P], left padded
    ids = full[:, :T]
    labels = torch.stack([full[:, 1 + j:T + 1 + j] for j in range(num_labels)], -1)  # [B, T, P]
    label_mask = labels != padding_value
    padding_mask = ids != padding_value
    label_mask &= padding_mask.unsqueeze(-1)  # a label counts for a real input position only
    for b in (1, 3)[:batch]:  # these sequences end at T: their last positions have fewer next items
        for j in range(1, num_labels):
            label_mask[b, T - j, j:] = False
    labels = labels.masked_fill(~label_mask, padding_value)
    return dict(feature_tensors={"item_id": ids}, padding_mask=padding_mask, positive_labels=labels,
                negative_labels=None, target_padding_mask=label_mask)


def for_replay_bce(batch):
    """The same multi-hot for RePlay's BCE, which fails on a padded label in a real row: each padded
    label there replaced by a real label of its row (a duplicate: the multi-hot is unchanged)."""
    labels, mask = batch["positive_labels"], batch["target_padding_mask"]
    first_real = torch.gather(labels, -1, mask.long().argmax(-1, keepdim=True)).expand_as(labels)
    row_real = mask.any(-1, keepdim=True)
    out = dict(batch, positive_labels=torch.where(mask | ~row_real, labels, first_real),
               target_padding_mask=mask | row_real)
    return out


def loss_and_grads(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**copy.deepcopy(batch))["loss"]  # RePlay's BCE squeezes target_padding_mask in place
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in model.named_parameters()}
    return loss.detach(), grads


def three_ways(batch, replay_batch=None, padding_value=V):
    """(RePlay BCE float32, CutBCE float32, RePlay BCE float64) on one model."""
    from replay.nn.loss import BCE

    reference = build_model(BCE(), padding_value=padding_value)
    ours = build_model(CutBCE(), padding_value=padding_value)
    ours.load_state_dict(reference.state_dict())
    replay_batch = batch if replay_batch is None else replay_batch
    return (loss_and_grads(reference, replay_batch), loss_and_grads(ours, batch),
            loss_and_grads(in_float64(reference), replay_batch))


def assert_no_worse_than_replay(replay32, ours32, truth):
    for name, r, o, t in [("loss", replay32[0], ours32[0], truth[0])] + [
            (n, replay32[1][n], ours32[1][n], truth[1][n]) for n in truth[1]]:
        ours_err, _ = relative_error(o.double().numpy(), t.numpy())
        replay_err, _ = relative_error(r.double().numpy(), t.numpy())
        assert ours_err <= replay_err + FLOAT32_SLACK, (
            f"{name}: CutBCE's error vs the float64 truth {ours_err:.2e} > RePlay BCE's {replay_err:.2e} + "
            f"{FLOAT32_SLACK:g}")


@pytest.mark.parametrize("num_labels", [1, 3], ids=["next item", "next 3, ragged"])
def test_loss_and_every_gradient_match_replay_bce(num_labels):
    batch = make_batch(num_labels)
    replay32, ours32, truth = three_ways(batch, for_replay_bce(batch))
    assert_no_worse_than_replay(replay32, ours32, truth)
    # The test can fail: the float64 truth must be far from a variant that scores the padding row.
    assert ours32[1]["body.embedder.feature_embedders.item_id.emb.weight"][V].abs().max() == 0
    assert truth[0] > 0 and abs(float(ours32[0] - truth[0])) < 1e-5 * float(truth[0])


def test_replay_bce_fails_where_cutbce_takes_the_batch():
    """A padded label in a real row: RePlay's BCE scatters id V into V columns."""
    from replay.nn.loss import BCE

    batch = make_batch(3)
    assert (batch["target_padding_mask"].any(-1) & ~batch["target_padding_mask"].all(-1)).any()
    with pytest.raises((RuntimeError, IndexError)):
        loss_and_grads(build_model(BCE()), batch)
    assert torch.isfinite(loss_and_grads(build_model(CutBCE()), batch)[0])


@pytest.mark.parametrize("padding_value", [0, 17], ids=["first", "inside"])
def test_padding_row_first_or_inside(padding_value):
    """RePlay allows padding_value != cardinality (with a warning): its columns then skip the
    padding row, and ids after it must be shifted down by one for its BCE (its own message). CutBCE
    takes the table rows as ids and needs no shift; both agree in float64."""
    batch = make_batch(2, padding_value=padding_value)
    labels = batch["positive_labels"]
    shifted = dict(for_replay_bce(batch))
    shifted["positive_labels"] = shifted["positive_labels"] - (shifted["positive_labels"] > padding_value).long()
    with pytest.warns(UserWarning, match="padding value"):
        replay32, ours32, truth = three_ways(batch, shifted, padding_value=padding_value)
    assert_no_worse_than_replay(replay32, ours32, truth)
    ours64 = loss_and_grads(in_float64(build_model(CutBCE(), padding_value=padding_value)), batch)
    assert_close(ours64[0], truth[0], dtype="float64", name="loss")
    for name in truth[1]:
        assert_close(ours64[1][name], truth[1][name], dtype="float64", name=name)
    table_grad = ours64[1]["body.embedder.feature_embedders.item_id.emb.weight"]
    assert table_grad[padding_value].abs().max() == 0 and (labels == padding_value).any()


def test_the_table_is_read_as_a_view(monkeypatch):
    """The loss gets the embedding's own storage, and never calls RePlay's copying accessors."""
    model = build_model(CutBCE())
    weight = model.body.embedder.feature_embedders["item_id"].emb.weight
    seen = []

    def spy(hidden, item_weight, *args, **kwargs):
        seen.append(item_weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr())
        return real_loss(hidden, item_weight, *args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("CutBCE called a copying accessor (get_item_weights / get_logits)")

    real_loss = integration.cut_bce_with_logits
    monkeypatch.setattr(integration, "cut_bce_with_logits", spy)
    monkeypatch.setattr(model.body.embedder, "get_item_weights", forbidden)
    model.loss._embedding = model.body.embedder.feature_embedders["item_id"].emb  # as found from the model
    model.loss.logits_callback = forbidden  # the protocol's callback: never called in training
    loss_and_grads(model, make_batch(2))
    assert seen == [True]


def _steps(loss, batches, lr=3e-3):
    import lightning
    from replay.nn.lightning import LightningModule
    from replay.nn.lightning.optimizer import OptimizerFactory

    losses = []

    class Record(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    model = build_model(loss)
    module = LightningModule(model, optimizer_factory=OptimizerFactory(learning_rate=lr))
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, callbacks=[Record()],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return losses, model


def test_replays_lightning_training_gives_replays_losses():
    from replay.nn.loss import BCE

    batches = [for_replay_bce(make_batch(3, seed=s)) for s in range(6)]
    for b in batches:
        del b["negative_labels"]  # the module passes only what the model's forward names; None can't batch
    reference, _ = _steps(BCE(), batches)
    ours, model = _steps(CutBCE(), batches)
    assert len(ours) == len(batches) and all(math.isfinite(x) for x in ours)
    for step, (o, r) in enumerate(zip(ours, reference)):
        assert abs(o - r) <= 1e-5 * abs(r), f"step {step}: CutBCE {o!r}, RePlay BCE {r!r}"
    assert ours[-1] < ours[0]


def test_item_bias_trains_and_scores_inference_and_topk():
    model = build_model(CutBCE(item_bias=True))
    bias = model.loss.item_bias
    assert bias.shape == (V,) and any(p is bias for p in model.parameters())
    torch.testing.assert_close(bias.detach(), torch.full((V,), math.log(1 / V)))
    _, grads = loss_and_grads(model, make_batch(2))
    assert grads["loss.item_bias"].abs().max() > 0
    with torch.no_grad():
        bias.copy_(torch.randn(V, generator=torch.Generator().manual_seed(3)))

    batch = make_batch(1)
    model.eval()
    plain = model(batch["feature_tensors"], batch["padding_mask"])
    score_with_bias(model)
    out = model(batch["feature_tensors"], batch["padding_mask"])
    last = out["hidden_states"][0][:, -1, :]
    weight = model.body.embedder.feature_embedders["item_id"].emb.weight
    torch.testing.assert_close(out["logits"], plain["logits"] + bias)
    torch.testing.assert_close(out["logits"], last @ weight[:V].T + bias)
    values, top = full_catalog_topk(last, weight[:V], 10, bias)
    assert torch.equal(top, out["logits"].topk(10).indices)
    candidates = torch.tensor([3, V, 0, V - 1])  # the padding id V among them
    scored = model(batch["feature_tensors"], batch["padding_mask"], candidates_to_score=candidates)["logits"]
    want = torch.cat([out["logits"], torch.full_like(out["logits"][:, :1], -math.inf)], 1)[:, candidates]
    torch.testing.assert_close(scored, want)


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match=r"unknown options \['reductio'\]"):
        CutBCE(reductio="sum")
    with pytest.raises(TypeError, match="item_bias: expected True or False"):
        CutBCE(item_bias=1)
    model = build_model(CutBCE())
    batch = make_batch(2)
    with pytest.raises(TypeError, match="target_padding_mask: expected bool"):
        loss_and_grads(model, dict(batch, target_padding_mask=batch["target_padding_mask"].long()))
    with pytest.raises(ValueError, match=r"positive_labels and target_padding_mask: expected \[B, T, P\]"):
        loss_and_grads(model, dict(batch, positive_labels=batch["positive_labels"][:, :-1]))
    with pytest.raises(TypeError, match="a model whose `loss` is a CutBCE"):
        score_with_bias(model.body)
    with pytest.raises(ValueError, match="no item bias"):
        score_with_bias(model)


def test_the_guides_replay_block_runs():
    """docs/converting.md, 'From RePlay': its code block, executed on a RePlay body."""
    import re
    from pathlib import Path

    from replay.nn.lightning import LightningModule
    from replay.nn.lightning.optimizer import OptimizerFactory
    from replay.nn.sequential import SasRec

    guide = (Path(__file__).resolve().parents[1] / "docs" / "converting.md").read_text()
    section = guide.split("\n## From RePlay\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    space = dict(SasRec=SasRec, body=build_body(), LightningModule=LightningModule,
                 OptimizerFactory=OptimizerFactory)
    exec(compile(block, "converting.md, From RePlay", "exec"), space)
    model = space["model"]
    assert isinstance(model.loss, CutBCE) and model.get_logits == model.loss.logits
    assert space["module"].model is model and model.loss.item_bias is not None
