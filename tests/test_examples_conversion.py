"""The conversion guide (docs/converting.md) applied to the example's own sampled SASRec.

The guide's code blocks are executed here, not paraphrased: `guide_steps()` reads the fenced Python
of each numbered section, and the tests run them on the example's SASRec (`examples/sasrec.py`) seen
through the layout the guide is written for (`ClientSASRec`: a `log2feats` method, numpy batches,
item ids with 0 for padding). The sampled loss the example trains with (`examples/losses.py`,
`--loss sampled`) is the "before"; the guide's steps must turn it into a full-catalog loss whose
value and every parameter's gradient are as exact as the dense `BCEWithLogitsLoss` on the
materialised logits in float32, measured against the same dense loss in float64.

Sections 10-13 (other models and layouts) run on variants of the same model: one trained with
full-softmax cross-entropy (10), one whose `forward` returns the last position's `[B, D]` state
(11), one whose bias counts the padding row (12), and a full-ranking evaluator that scores the
padding column (13).
"""

from __future__ import annotations

import copy
import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_cutbce
from examples import data
from examples.losses import sampled_bce_loss
from examples.sasrec import RecConfig, SASRec
from parity import TOLERANCES

pytestmark = pytest.mark.rung4

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "converting.md"
V, T, D, B = 97, 12, 16, 9


def guide_steps() -> dict[int, list[str]]:
    """{section number: [its fenced Python blocks]} of docs/converting.md ('## 3. ...' -> 3); the
    text under an unnumbered '## ' heading belongs to no section."""
    steps, number = {}, None
    for part in re.split(r"^(## .*)$", GUIDE.read_text(), flags=re.M):
        if part.startswith("## "):
            heading = re.match(r"## (\d+)\.", part)
            number = int(heading.group(1)) if heading else None
        elif number is not None:
            steps[number] = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", part, flags=re.S)]
    return steps


class ClientSASRec(SASRec):
    """The example's SASRec in the layout of common PyTorch SASRec code: `log2feats` on numpy ids."""

    def log2feats(self, log_seqs):
        return self(torch.as_tensor(log_seqs, device=self.item_emb.weight.device))


def client_model(dtype=torch.float32) -> ClientSASRec:
    torch.manual_seed(0)
    model = ClientSASRec(RecConfig(V, T, D, num_layers=1, num_heads=2, dropout=0.0, item_bias=True))
    with torch.no_grad():  # step 4's initialisation, then a spread, as after some training
        model.item_bias.copy_(math.log(1 / V) + torch.randn(V))
        model.item_emb.weight[1:].mul_(40)  # logits of several units, some large
    return model.to(dtype)


def client_batch(seed=0):
    """Numpy ids as a sampler yields them: left-padded sequences, next items (0 at padding), negatives."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 2, size=B)
    rows = np.zeros((B, T + 1), dtype=np.int64)
    for b, n in enumerate(lengths):
        rows[b, T + 1 - n:] = rng.integers(1, V + 1, size=n)
    rows[0, -4:] = rows[0, -5]  # repeated items: duplicates in a sequence
    seq, pos = rows[:, :-1], rows[:, 1:] * (rows[:, :-1] != 0)
    neg = rng.integers(1, V + 1, size=(B, T))
    return seq, pos, neg


def run_steps(model, numbers, **names) -> dict:
    """Executes the guide's blocks of steps `numbers` in one namespace; returns the namespace."""
    steps = guide_steps()
    space = dict(model=model, torch=torch, torch_cutbce=torch_cutbce, F=F, np=np, math=math,
                 catalog_item_ids=np.arange(1, V + 1))  # the data's item ids (step 9)
    space.update(names)
    for number in numbers:
        for block in steps[number]:
            exec(compile(block, f"{GUIDE.name} step {number}", "exec"), space)
    return space


def step_5_divisor() -> str:
    """The expression step 5 divides the 'sum' by (its recommended normalisation), e.g. `real.sum()`."""
    (block,) = guide_steps()[5]
    match = re.search(r'reduction="sum"\)\s*/\s*(.+?)\s*$', block)
    assert match, f"step 5 no longer divides a 'sum' by something:\n{block}"
    return match.group(1)


def dense_loss(model, seq, pos) -> torch.Tensor:
    """What the guide's steps replace, built from the example's own definitions (not the guide's):
    BCE on the materialised `[B, T, V]` logits of the example's item table and bias, labels at the
    example's catalog ids, padded positions masked, divided as step 5 divides."""
    hidden = model(torch.as_tensor(seq))
    pos = torch.as_tensor(pos)
    real = (pos != 0).to(hidden.dtype)
    logits = hidden @ model.item_weight.T + model.item_bias
    labels = F.one_hot(data.to_catalog_ids(pos).clamp(min=0), V).to(hidden.dtype)  # padded rows: weight 0
    total = (F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(-1) * real).sum()
    return total / eval(step_5_divisor(), dict(real=real, items=model.item_weight, hidden=hidden))


def loss_and_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def test_the_guide_has_the_steps_it_promises():
    steps = guide_steps()
    assert sorted(steps) == list(range(1, 14)), sorted(steps)
    assert "log2feats" in steps[1][0] and "weight[1:]" in steps[2][0] and "cut_bce_with_logits" in steps[5][0]
    assert "autograd.grad" in steps[9][0] and "cross_entropy" in steps[10][0] and "model(seq)" in steps[11][0]
    assert "item_bias[1:]" in steps[12][0] and "def full_sort_predict" in steps[13][0]


def test_before_is_the_examples_sampled_loss():
    """The starting point runs: the example's sampled BCE on the same model and batch."""
    model, (seq, pos, neg) = client_model(), client_batch()
    hidden = model.log2feats(seq)
    pos_t, neg_t = torch.as_tensor(pos), torch.as_tensor(neg)
    loss = sampled_bce_loss(hidden, model.item_weight, model.item_bias, data.to_catalog_ids(pos_t),
                            data.to_catalog_ids(neg_t)[..., None], (pos_t != 0).float())
    assert torch.isfinite(loss) and loss > 0


def test_converted_loss_and_gradients_as_exact_as_dense_bce():
    """Steps 1-5 give the dense BCE's value and gradients for every parameter: in float32 no
    further from the float64 dense result than float32 dense BCE is, plus the float32 tolerance."""
    seq, pos, _ = client_batch()
    model32 = client_model()
    model64 = copy.deepcopy(model32).double()
    dense_model32, dense_model64 = copy.deepcopy(model32), copy.deepcopy(model64)
    fast = loss_and_grads(model32, run_steps(model32, [1, 2, 3, 5], seq=seq, pos=pos)["loss"])
    dense32 = loss_and_grads(dense_model32, dense_loss(dense_model32, seq, pos))
    truth = loss_and_grads(model64, run_steps(model64, [1, 2, 3, 5], seq=seq, pos=pos)["loss"])
    truth_dense = loss_and_grads(dense_model64, dense_loss(dense_model64, seq, pos))
    torch.testing.assert_close(truth[0], truth_dense[0], rtol=1e-12, atol=0)  # float64: the same loss
    tol = TOLERANCES["float32"]
    for name in ["loss", *truth[1]]:
        got, ref, true = (r[0] if name == "loss" else r[1][name] for r in (fast, dense32, truth_dense))
        scale = true.abs().max().clamp(min=1e-30)
        err, ref_err = (got - true).abs().max() / scale, (ref - true).abs().max() / scale
        assert err <= ref_err + tol, f"{name}: error {err:.3e} > dense float32's {ref_err:.3e} + {tol}"
    assert fast[1]["item_emb.weight"][0].abs().max() == 0  # the padding row never learns
    assert truth[1]["item_bias"].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_9_check_passes_on_the_converted_model(dtype):
    """The guide's own checks, the loss and every parameter's gradient, pass on a right conversion."""
    seq, pos, _ = client_batch(seed=1)
    space = run_steps(client_model(dtype), [1, 2, 3, 5, 9], seq=seq, pos=pos)
    assert len(space["got"]) == len(list(space["model"].parameters()))  # every parameter was compared


def test_step_9_catches_what_the_loss_alone_misses():
    """A detached item table gives the right loss value and a wrong table gradient: the loss check
    passes, the every-gradient check fails and names the parameter."""
    seq, pos, _ = client_batch(seed=1)
    model = client_model()
    space = run_steps(model, [1, 2, 3], seq=seq, pos=pos)
    steps = guide_steps()
    space["items"] = space["items"].detach()
    exec(compile(steps[5][0], "step 5", "exec"), space)
    loss_check, gradient_check = steps[9][0].split("\nnames, params")
    exec(compile(loss_check, "step 9 (loss)", "exec"), space)  # passes
    with pytest.raises(AssertionError, match="item_emb.weight"):
        exec(compile("names, params" + gradient_check, "step 9 (gradients)", "exec"), space)


def test_step_9_fails_on_a_mask_row_scored_as_a_negative():
    """Issue 45: a table with PAD (0) and MASK (1) rows, converted by the padding rule alone (steps
    2-5 leave row 0 out, row 1 stays an item). Step 9's check, built from the catalog's own ids
    (2..V), fails on the loss; the same check passes on the conversion that names both rows."""
    seq, pos, _ = client_batch(seed=1)
    seq, pos = (np.where(x == 1, 2, x) for x in (seq, pos))  # id 1 is MASK: never in the data
    model = client_model()
    steps, catalog = guide_steps(), np.arange(2, V + 1)
    space = run_steps(model, [1, 2, 3, 5], seq=seq, pos=pos, catalog_item_ids=catalog)
    loss_check = steps[9][0].split("\nnames, params")[0]
    with pytest.raises(AssertionError, match="not close"):
        exec(compile(loss_check, "step 9 (loss)", "exec"), space)
    special = torch_cutbce.SpecialRows.first(2)
    space["loss"] = torch_cutbce.cut_bce_with_logits(
        space["hidden"], model.item_emb.weight, space["pos"][..., None], model.item_bias[1:], weight=space["real"],
        reduction="sum", special_rows=special) / space["real"].sum()  # the bias of rows 2..V: [V - 1] items
    exec(compile(steps[9][0], "step 9", "exec"), space)


def test_step_9_floor_is_for_gradients_that_are_zero_in_truth():
    """What step 9 says of the attention's key bias: its true gradient is 0 (float64: 1e-20 of the
    largest), the two float32 routes return different rounding noise (no relative tolerance holds),
    and that noise lies far below the floor."""
    seq, pos, _ = client_batch(seed=0)
    spaces = {dtype: run_steps(client_model(dtype), [1, 2, 3, 5, 9], seq=seq, pos=pos)
              for dtype in (torch.float32, torch.float64)}
    keys = slice(D, 2 * D)  # qkv.bias is [q | k | v]

    def key_bias(space, route):
        return space[route][space["names"].index("blocks.0.qkv.bias")][keys]

    truth = spaces[torch.float64]
    largest = max(float(w.abs().max()) for w in truth["want"])
    assert float(key_bias(truth, "want").abs().max()) < 1e-15 * largest
    got, want, floor = key_bias(spaces[torch.float32], "got"), key_bias(spaces[torch.float32], "want"), \
        spaces[torch.float32]["floor"]
    assert not torch.allclose(got, want, rtol=1e-4, atol=0)  # noise against noise
    assert float((got - want).abs().max()) < 1e-3 * floor


def test_step_4_bias_initialised_and_added_at_inference():
    """Step 4's bias starts at log(1 / V), and its `predict` equals the dense scores of the given
    items with the bias of the right (shifted) ids; the padding id 0 scores -inf, not the last
    item's bias (what `item_bias[item_indices - 1]` read there)."""
    model, (seq, _, _) = client_model(), client_batch()
    space = run_steps(model, [4], self=model, nn=torch.nn, item_num=V)
    assert model.item_bias.shape == (V,) and torch.equal(model.item_bias, torch.full((V,), math.log(1 / V)))
    with torch.no_grad():
        model.item_bias.add_(torch.randn(V))  # a learned spread: a wrong id shift must show
        item_indices = np.random.default_rng(2).integers(1, V + 1, size=(B, 5))
        item_indices[:, -1] = 0  # candidate lists padded with 0
        item_indices[0, 0] = V  # the last item, whose bias a wrap-around would read at id 0
        got = space["predict"](model, None, seq, item_indices)
        scores = model.log2feats(seq)[:, -1] @ model.item_weight.T + model.item_bias  # [B, V], catalog ids
        want = scores.gather(1, torch.as_tensor(item_indices[:, :-1]) - 1)
    torch.testing.assert_close(got[:, :-1], want)
    assert (got[:, -1] == -math.inf).all()


def test_full_catalog_evaluation_of_step_7():
    """Step 7's top 10 equal the dense ranking of every item with the seen ones left out, in item ids."""
    model, (seq, _, _) = client_model(), client_batch()
    history = seq  # what each user has seen: the sequence, 0 = padding
    with torch.no_grad():
        space = run_steps(model, [1, 2, 7], seq=seq, pos=np.zeros_like(seq), history=history)
        final = model.log2feats(seq)[:, -1]
        scores = final @ model.item_weight.T + model.item_bias
    seen = torch.zeros(B, V + 1, dtype=torch.bool).scatter_(1, torch.as_tensor(history), True)[:, 1:]
    scores = scores.masked_fill(seen, -math.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :10] + 1
    assert torch.equal(space["top_item_ids"], order)


def test_section_10_from_full_softmax_cross_entropy():
    """Section 10's "before" is the softmax cross-entropy over every table row (padding column
    included) at the next item; its "after" is the converted loss: the dense BCE's value and
    every gradient (float64)."""
    seq, pos, _ = client_batch(seed=2)
    model = client_model(torch.float64)
    before, after = guide_steps()[10]
    space = run_steps(model, [], seq=seq, pos=pos)
    exec(compile(before, "section 10 (before)", "exec"), space)
    logits = model.log2feats(seq) @ model.item_emb.weight.T  # [B, T, V + 1]
    real = torch.as_tensor(pos) != 0
    want = -torch.log_softmax(logits[real], -1).gather(1, torch.as_tensor(pos)[real][:, None]).mean()
    torch.testing.assert_close(space["loss"], want, rtol=1e-12, atol=0)

    exec(compile(after, "section 10 (after)", "exec"), space)
    assert space["targets"].shape == (B, T, 1)
    assert_same_loss_and_gradients(model, space["loss"], dense_loss(model, seq, pos))


class LastPositionModel(ClientSASRec):
    """Section 11's layout: `forward` takes numpy ids and returns the last position's `[B, D]` state."""

    def forward(self, log_seqs):
        return SASRec.forward(self, torch.as_tensor(log_seqs, device=self.item_emb.weight.device))[:, -1]

    def log2feats(self, log_seqs):
        return SASRec.forward(self, torch.as_tensor(log_seqs, device=self.item_emb.weight.device))


def last_position_model(dtype) -> LastPositionModel:
    model = LastPositionModel(RecConfig(V, T, D, num_layers=1, num_heads=2, dropout=0.0, item_bias=True))
    model.load_state_dict(client_model().state_dict())
    return model.to(dtype)


def assert_same_loss_and_gradients(model, guide_loss, dense_loss):
    """float64: the guide's loss and every parameter's gradient equal the dense loss's."""
    got, want = loss_and_grads(model, guide_loss), loss_and_grads(model, dense_loss)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
    largest = max(float(w.abs().max()) for w in want[1].values())
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-9, atol=1e-12 * largest, msg=name)
    return got


@pytest.mark.parametrize("k", [None, 3])
def test_section_11_last_position_model(k):
    """A `[B, D]` model: section 11's loss (next item `[B]`, or next k items `[B, k]` with 0 for
    none) equals the dense BCE on `[B, V]` logits, divided by the rows, value and every gradient."""
    seq, pos, _ = client_batch(seed=3)
    rng = np.random.default_rng(4)
    next_items = rng.integers(1, V + 1, size=B) if k is None else rng.integers(1, V + 1, size=(B, k))
    if k:
        next_items[1, 1:] = 0  # fewer than k items follow that sequence
        next_items[2, 2] = next_items[2, 0]  # a duplicate counts once
    model = last_position_model(torch.float64)
    space = run_steps(model, [11], seq=seq, next_items=next_items)
    assert space["hidden"].shape == (B, D) and space["targets"].shape == (B, k or 1)

    logits = model(seq) @ model.item_weight.T + model.item_bias  # [B, V]
    ids = torch.as_tensor(next_items).reshape(B, -1)
    labels = torch.zeros(B, V + 1, dtype=torch.float64).scatter_(1, ids, 1.0)[:, 1:]  # item ids -> catalog
    dense = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum() / B
    assert_same_loss_and_gradients(model, space["loss"], dense)


def test_section_12_item_count_with_the_padding_row():
    """A `[V + 1]` bias (item_num counted the padding row): section 12 slices table and bias, finds
    V, and gives the dense loss's value and gradients; entry 0 of the bias gets gradient exactly 0."""
    seq, pos, _ = client_batch(seed=5)
    model = client_model(torch.float64)
    with torch.no_grad():
        padded = torch.cat([torch.randn(1, dtype=torch.float64), model.item_bias])  # entry j = item id j
    model.item_bias = torch.nn.Parameter(padded)
    space = run_steps(model, [1, 2, 3, 12], seq=seq, pos=pos)
    assert space["V"] == V and space["items"].shape == (V, D) and space["bias"].shape == (V,)

    hidden, pos_t = model(torch.as_tensor(seq)), torch.as_tensor(pos)
    logits = hidden @ model.item_emb.weight[1:].T + model.item_bias[1:]
    labels = F.one_hot(pos_t, V + 1)[..., 1:].double()
    real = (pos_t != 0).double()
    dense = (F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(-1) * real).sum() / real.sum()
    _, grads = assert_same_loss_and_gradients(model, space["loss"], dense)
    assert grads["item_bias"][0] == 0 and grads["item_bias"][1:].abs().max() > 0


def test_section_13_full_ranking_evaluator_with_the_padding_column():
    """Section 13's `[U, V + 1]` scores: column 0 is -inf, columns 1: are the dense catalog scores
    with their own bias, and their ranking (seen items left out) is step 7's."""
    model, (seq, _, _) = client_model(), client_batch(seed=6)
    with torch.no_grad():
        space = run_steps(model, [1, 2, 7, 13], seq=seq, pos=np.zeros_like(seq), history=seq)
        scores = space["full_sort_predict"](model, seq)
        want = model.log2feats(seq)[:, -1] @ model.item_weight.T + model.item_bias
    assert scores.shape == (B, V + 1) and (scores[:, 0] == -math.inf).all()
    torch.testing.assert_close(scores[:, 1:], want)
    seen = torch.zeros(B, V + 1, dtype=torch.bool).scatter_(1, torch.as_tensor(seq), True)
    seen[:, 0] = False  # the padding column is -inf already
    ranked = torch.sort(scores.masked_fill(seen, -math.inf), dim=1, descending=True, stable=True).indices[:, :10]
    assert torch.equal(ranked, space["top_item_ids"])  # column j = item id j
