"""Special rows (torch_cutbce/special_rows.py): rows of the table that are not items, anywhere, given
once as a `SpecialRows` and taken by the entry, the module, top-k and `without_special_rows`.

The reference never uses the code under test: a float64 dense BCE over the catalog's own item rows
(an explicit list), each label id (a table row) mapped to its column by hand. Run on the native and
dense backends, in float64 and float32 (the parity rule of tests/parity.py), with a bias given per
item or per table row, several positives per position, special ids among them, padded positions,
and ids of every integer dtype (issue 46: uint8 ids made every padding id item 255).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity import assert_close
from torch_cutbce import (CutBCEWithLogitsLoss, SpecialRows, cut_bce_with_logits, full_catalog_topk,
                          without_padding_row, without_special_rows)

ROWS, D = 23, 8
LAYOUTS = {  # name: (SpecialRows, its rows)
    "pad-mask-first": (SpecialRows.first(2), [0, 1]),  # RecTools' BERT4Rec: PAD 0, MASK 1
    "pad-first-mask-last": (SpecialRows.first(1) + SpecialRows.last(1), [0, ROWS - 1]),  # RecBole: MASK = n_items
    "pad-last": (SpecialRows.last(1), [ROWS - 1]),  # RePlay: padding_value = V
    "inside": (SpecialRows([9]), [9]),
    "ends-and-inside": (SpecialRows([0, 9, 10, -1]), [0, 9, 10, ROWS - 1]),
    "mask": (SpecialRows.from_mask(torch.arange(ROWS) % 7 == 3), [3, 10, 17]),
}


def items_of(special: list[int]) -> torch.Tensor:
    return torch.tensor([r for r in range(ROWS) if r not in special])


def make_batch(special, dtype, seed=0, bias_rows=False):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(ROWS, D, generator=g, dtype=torch.float64)  # special rows not zero: scoring them shows
    hidden = torch.randn(3, 5, D, generator=g, dtype=torch.float64)
    v = ROWS - len(special)
    bias = torch.randn(ROWS if bias_rows else v, generator=g, dtype=torch.float64) - 2
    ids = torch.randint(0, ROWS, (3, 5, 4), generator=g)
    ids[0, 0] = special[0]  # a position whose only labels are special rows
    ids[1, :, -1] = special[-1]  # special labels beside real ones
    ids[2, 1, 0] = -1  # negative ids are padding too
    ids[2, 2, :2] = items_of(special)[0]  # a duplicate
    real = (torch.arange(5) < torch.tensor([[5], [3], [4]])).to(torch.float64)  # ragged sequences
    cast = [x.to(dtype).requires_grad_() for x in (hidden, table, bias)]
    return cast, ids, real.to(dtype)


def dense_reference(hidden, table, bias, ids, real, special, reduction="sum"):
    """float64 BCE over the catalog's items (an explicit list of rows), per position summed, times real."""
    hidden, table, bias, real = (x.to(torch.float64) for x in (hidden, table, bias, real))
    items = items_of(special)
    item_bias = bias[items] if bias.shape[0] == ROWS else bias
    logits = hidden @ table[items].T + item_bias  # [3, 5, V]: column c = the c-th item row
    labels = (ids[..., None] == items).any(-2).to(logits.dtype)
    per_position = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(-1) * real
    if reduction == "mean":
        return per_position.sum() / (per_position.numel() * items.numel())
    return per_position.sum() / real.sum()


@pytest.mark.parametrize("backend", ["native", "dense"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("bias_rows", [False, True], ids=["bias-V", "bias-R"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_special_rows_match_the_dense_loss_over_the_items(layout, bias_rows, dtype, backend):
    special_rows, special = LAYOUTS[layout]
    (hidden, table, bias), ids, real = make_batch(special, getattr(torch, dtype), bias_rows=bias_rows)
    loss = cut_bce_with_logits(hidden, table, ids, bias, weight=real, reduction="sum", backend=backend,
                               special_rows=special_rows) / real.sum()
    got = torch.autograd.grad(loss, (hidden, table, bias))
    truth_inputs = [x.detach().to(torch.float64).requires_grad_() for x in (hidden, table, bias)]
    truth = dense_reference(*truth_inputs, ids, real, special)
    want = torch.autograd.grad(truth, truth_inputs)
    assert_close(loss.detach(), truth.detach(), dtype=dtype, name=f"loss, {layout}")
    for name, g, w in zip(("hidden", "item_weight", "bias"), got, want):
        assert_close(g, w, dtype=dtype, name=f"d_{name}, {layout}")
    assert torch.count_nonzero(got[1][special]) == 0, "a special row got a gradient"
    if bias_rows:
        assert torch.count_nonzero(got[2][special]) == 0, "a special row's bias got a gradient"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mean_divides_by_the_items_and_the_module_agrees(layout):
    special_rows, special = LAYOUTS[layout]
    (hidden, table, bias), ids, real = make_batch(special, torch.float64)
    want = dense_reference(hidden, table, bias, ids, torch.ones_like(real), special, reduction="mean")
    got = cut_bce_with_logits(hidden, table, ids, bias, special_rows=special_rows)
    module = CutBCEWithLogitsLoss(special_rows=special_rows)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(module(hidden, table, ids, bias), want, rtol=1e-12, atol=0)
    assert "special_rows=SpecialRows(" in repr(module)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_metrics_count_the_items_only(layout, reduction):
    special_rows, special = LAYOUTS[layout]
    (hidden, table, bias), ids, real = make_batch(special, torch.float32)
    _, metrics = cut_bce_with_logits(hidden, table, ids, bias, weight=real, reduction=reduction,
                                     return_metrics=True, special_rows=special_rows)
    items = items_of(special)
    with torch.no_grad():
        z = hidden @ table[items].T + bias
    y = (ids[..., None] == items).any(-2)
    for name, hit in dict(tp=(z > 0) & y, fp=(z > 0) & ~y, fn=(z <= 0) & y, tn=(z <= 0) & ~y).items():
        want = hit.float().sum(-1) * real
        torch.testing.assert_close(getattr(metrics, name), want if reduction == "none" else want.sum(), msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_views_at_the_ends_and_exclusions_inside_never_copy_the_table(layout):
    special_rows, special = LAYOUTS[layout]
    (_, table, bias), ids, _ = make_batch(special, torch.float32)
    c = without_special_rows(table, ids, special_rows, bias)
    assert c.item_weight.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    plan = special_rows.resolve(ROWS)
    assert c.item_weight.shape == (ROWS - plan.lead - plan.trail, D) and c.num_items == ROWS - len(special)
    inside = [r - plan.lead for r in special if plan.lead <= r < ROWS - plan.trail]
    if inside:
        assert c.class_weight[inside].eq(0).all() and int((c.class_weight == 1).sum()) == c.item_weight.shape[0] - len(inside)
    else:
        assert c.class_weight is None and c.bias is bias


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_ids_of_every_integer_dtype_give_the_int64_result(dtype):
    """Issue 46: `without_padding_row` on uint8 ids made each padding id 0 the item 255."""
    table, hidden = torch.randn(301, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 7, 0], [0, 0, 0]])
    c = without_padding_row(table, ids.to(dtype), 0)
    assert c.targets.dtype == torch.int64 and c.targets.tolist() == [[-1, 6, -1], [-1, -1, -1]]
    special = SpecialRows.first(2)
    want = cut_bce_with_logits(hidden, table, ids, special_rows=special)
    got = cut_bce_with_logits(hidden, table, ids.to(dtype), special_rows=special)
    assert torch.equal(got, want)
    torch.testing.assert_close(cut_bce_with_logits(hidden, c.item_weight, c.targets),
                               cut_bce_with_logits(hidden, table[1:], torch.tensor([[-1, 6, -1], [-1, -1, -1]])))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool])
def test_the_id_conversions_take_every_integer_dtype(dtype):
    from torch_cutbce import ids_to_multi_hot, multi_hot_to_ids

    multi_hot = torch.zeros(2, 300, dtype=torch.int64)
    multi_hot[0, [3, 100]] = 1
    assert multi_hot_to_ids(multi_hot.to(dtype), 3).tolist() == [[3, 100, -1], [-1, -1, -1]]
    if dtype != torch.bool:
        ids = torch.tensor([[3, 100, 0]]).to(dtype)
        assert torch.equal(ids_to_multi_hot(ids, 300), ids_to_multi_hot(ids.long(), 300))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bias_rows", [False, True], ids=["bias-V", "bias-R"])
def test_topk_ranks_the_items_only_in_table_ids(layout, bias_rows):
    special_rows, special = LAYOUTS[layout]
    (hidden, table, bias), _, _ = make_batch(special, torch.float64, bias_rows=bias_rows)
    items = items_of(special)
    exclude = torch.full((3, 5, 2), -1)
    exclude[0, :, 0] = items[3]  # a seen item, by its table row
    with torch.no_grad():
        scores, ids = full_catalog_topk(hidden, table, 6, bias, block_v=4, exclude=exclude, special_rows=special_rows)
        dense = hidden @ table[items].T + (bias[items] if bias_rows else bias)
        dense = dense.masked_fill((exclude[..., None] == items).any(-2), float("-inf"))
        order = torch.sort(dense, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, items[order.indices[..., :6]])
    torch.testing.assert_close(scores, order.values[..., :6], rtol=1e-12, atol=1e-12)  # tiles sum otherwise
    assert not torch.isin(ids, torch.tensor(special)).any()


@pytest.mark.parametrize("per_position", [True, False])
@pytest.mark.parametrize("over", ["items", "rows"])
def test_topk_takes_a_bool_exclude_mask(over, per_position):
    """Round 7: a bool `exclude` was read as item ids 0 and 1. Now a mask over the items or the rows,
    per position or for all: the same as the ids it marks."""
    special_rows, special = LAYOUTS["ends-and-inside"]
    (hidden, table, bias), _, _ = make_batch(special, torch.float64)
    items = items_of(special)
    g = torch.Generator().manual_seed(3)
    marked = torch.rand(3, 5, items.numel(), generator=g) < 0.4  # over the items
    if not per_position:
        marked = marked[0, 0].expand(3, 5, -1)
    ids = torch.where(marked, items, -1)  # the same exclusion as table-row ids
    mask = marked if over == "items" else torch.zeros(3, 5, ROWS, dtype=torch.bool).index_copy(2, items, marked)
    with torch.no_grad():
        want = full_catalog_topk(hidden, table, 6, bias, block_v=4, exclude=ids, special_rows=special_rows)
        got = full_catalog_topk(hidden, table, 6, bias, block_v=4, special_rows=special_rows,
                                exclude=mask if per_position else mask[0, 0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_under_torch_compile_fullgraph():
    special_rows, special = LAYOUTS["ends-and-inside"]
    (hidden, table, bias), ids, real = make_batch(special, torch.float32)
    step = lambda h, t, b: cut_bce_with_logits(h, t, ids, b, weight=real, reduction="sum",  # noqa: E731
                                               special_rows=special_rows)
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(hidden, table, bias), step(hidden, table, bias))


def test_the_whole_table_without_the_rule_is_a_different_loss():
    """What the rule prevents: the padding row scored as a negative of every position."""
    (hidden, table, bias), ids, real = make_batch([ROWS - 1], torch.float64)
    with torch.no_grad():
        full_bias = torch.cat([bias, bias.new_zeros(1)])
        wrong = cut_bce_with_logits(hidden, table, ids.masked_fill(ids == ROWS - 1, -1), full_bias,
                                    weight=real, reduction="sum") / real.sum()
        right = dense_reference(hidden, table, bias, ids, real, [ROWS - 1])
    assert abs(float(wrong - right)) > 1e-3 * float(right)


@pytest.mark.parametrize("padding_idx", [0, 9, ROWS - 1])
def test_without_padding_row_is_one_special_row(padding_idx):
    (hidden, table, bias), ids, real = make_batch([padding_idx], torch.float64)
    c = without_padding_row(table, ids, padding_idx, bias)
    loss = cut_bce_with_logits(hidden, c.item_weight, c.targets, c.bias, class_weight=c.class_weight,
                               weight=real, reduction="sum") / real.sum()
    torch.testing.assert_close(loss, dense_reference(hidden, table, bias, ids, real, [padding_idx]))


@pytest.mark.parametrize("call, error, words", [
    (lambda t, i: without_padding_row(t, i, ROWS), ValueError, ["padding_idx", f"< {ROWS}", str(ROWS)]),
    (lambda t, i: without_padding_row(t, i, -1), ValueError, ["padding_idx", "negative", "-1"]),
    (lambda t, i: without_padding_row(t, i, True), TypeError, ["padding_idx", "True", "bool"]),
    (lambda t, i: without_padding_row(t, i, 1.0), TypeError, ["padding_idx", "float"]),
    (lambda t, i: without_padding_row(t[0], i, 0), ValueError, ["item_weight", "[R, D]", f"({D},)"]),
    (lambda t, i: without_padding_row(t, i.float(), 0), TypeError, ["targets", "integer", "float32"]),
    (lambda t, i: without_padding_row(t, i, 0, torch.zeros(5)), ValueError,
     ["bias", f"[{ROWS - 1}]", f"[{ROWS}]", "(5,)"]),
    (lambda t, i: without_padding_row(t, i, 0, [0.0] * (ROWS - 1)), TypeError, ["bias", "torch.Tensor", "list"]),
    (lambda t, i: without_padding_row(t, i, 0, class_weight=torch.zeros(3)), ValueError, ["class_weight", "(3,)"]),
    (lambda t, i: without_padding_row(t, i + ROWS, 0), ValueError, ["targets", "id", f"{ROWS} rows"]),
    (lambda t, i: without_special_rows(t, i, [0, 1]), TypeError, ["special_rows", "SpecialRows", "list"]),
    (lambda t, i: without_special_rows(t, i, SpecialRows([ROWS])), ValueError, ["special_rows", f"[{ROWS}]"]),
    (lambda t, i: without_special_rows(t, i, SpecialRows.first(ROWS)), ValueError, ["special_rows", "all"]),
    (lambda t, i: without_special_rows(t, i, SpecialRows.from_mask(torch.zeros(3, dtype=torch.bool))),
     ValueError, ["mask", "3", f"{ROWS} rows"]),
    (lambda t, i: SpecialRows([0.5]), TypeError, ["indices", "0.5"]),
    (lambda t, i: SpecialRows.first(-1), ValueError, ["count", "-1"]),
    (lambda t, i: SpecialRows.from_mask([0, 1]), TypeError, ["mask", "bool"]),
    (lambda t, i: cut_bce_with_logits(torch.zeros(3, 5, D), t, i, special_rows=SpecialRows.first(1),
                                      vocab_parallel=object()), ValueError, ["special_rows", "vocab_parallel"]),
    (lambda t, i: full_catalog_topk(torch.zeros(2, D), t, 3, special_rows=3), TypeError, ["special_rows", "int"]),
    (lambda t, i: full_catalog_topk(torch.zeros(2, D), t, ROWS, special_rows=SpecialRows.first(1)), ValueError,
     ["k", f"V={ROWS - 1}"]),
    (lambda t, i: CutBCEWithLogitsLoss(special_rows=(0,)), TypeError, ["special_rows", "tuple"]),
    # round 7: top-k's k=None and a list bias were Python's own errors
    (lambda t, i: full_catalog_topk(torch.zeros(2, D), t, None), TypeError, ["k", "None", f"V={ROWS}"]),
    (lambda t, i: full_catalog_topk(torch.zeros(2, D), t, 3, [0.0] * ROWS), TypeError, ["bias", "list"]),
    (lambda t, i: full_catalog_topk(torch.zeros(2, D), t, 3, exclude=torch.zeros(2, 5, dtype=torch.bool)),
     ValueError, ["exclude", "bool mask", f"V = {ROWS}", "(2, 5)"]),
    # round 7: a per-item length one off the items is named for the special row it likely lacks
    (lambda t, i: without_special_rows(t, i, SpecialRows([0, -1]), torch.zeros(ROWS - 1)), ValueError,
     ["bias", f"[V] = [{ROWS - 2}]", f"[R] = [{ROWS}]", f"({ROWS - 1},)", "one special row fewer", "output_bias[1:]"]),
    (lambda t, i: without_special_rows(t, i, SpecialRows.first(1), pos_weight=torch.ones(ROWS - 2)), ValueError,
     ["pos_weight", f"[V] = [{ROWS - 1}]", "one special row more", "forgotten in special_rows"]),
    (lambda t, i: cut_bce_with_logits(torch.zeros(3, 5, D), t, i, class_weight=torch.ones(ROWS - 5),
                                      special_rows=SpecialRows([0, 9, -1])), ValueError,
     ["class_weight", f"[V] = [{ROWS - 3}]", f"[R] = [{ROWS}]", f"({ROWS - 5},)"]),
    (lambda t, i: cut_bce_with_logits(torch.zeros(3, 5, D), t, i, torch.zeros(7), special_rows=SpecialRows([9])),
     ValueError, ["bias", f"[V] = [{ROWS - 1}]", f"[R] = [{ROWS}]", "(7,)"]),
    (lambda t, i: full_catalog_topk(torch.zeros(2, D), t, 3, torch.zeros(ROWS - 1),
                                    special_rows=SpecialRows([0, -1])), ValueError, ["bias", "one special row fewer"]),
    # round 7: uint64 ids >= 2**63 wrapped to negative ids (padding) with special_rows
    (lambda t, i: cut_bce_with_logits(torch.zeros(3, 5, D), t, torch.full((3, 5, 1), 2**63 + 3, dtype=torch.uint64),
                                      special_rows=SpecialRows.first(1)), TypeError, ["targets", "uint64", "int64"]),
    (lambda t, i: without_special_rows(t, i.to(torch.uint32), SpecialRows.first(1)), TypeError, ["targets", "uint32"]),
    # round 7: from_mask of a non-mask, and joining masks of two tables
    (lambda t, i: SpecialRows.from_mask("ab"), TypeError, ["from_mask", "mask", "str"]),
    (lambda t, i: SpecialRows.from_mask(None), TypeError, ["from_mask", "mask", "NoneType"]),
    (lambda t, i: SpecialRows.from_mask(torch.ones(3, dtype=torch.bool)) + SpecialRows.from_mask(
        torch.ones(4, dtype=torch.bool)), ValueError, ["SpecialRows", "[3, 4]"]),
])
def test_bad_input_names_the_argument(call, error, words):
    (_, table, _), ids, _ = make_batch([0], torch.float32)
    with pytest.raises(error) as raised:
        call(table.detach(), ids)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_both_ends_read_as_they_mean():
    """Round 7: `first(1) | last(1)` was a TypeError; `+` and `|` are the union."""
    both = SpecialRows.first(1) + SpecialRows.last(1)
    assert both == SpecialRows.first(1) | SpecialRows.last(1) == SpecialRows([0, -1])
    assert (SpecialRows.first(2) + SpecialRows([1, 5])).indices == (0, 1, 5)
    mask = torch.zeros(ROWS, dtype=torch.bool)
    mask[4] = True
    joined = SpecialRows.from_mask(mask) + SpecialRows.last(1)
    assert joined.resolve(ROWS).special == (4, ROWS - 1) and joined.table_rows == ROWS
    assert SpecialRows.from_mask(mask.numpy()) == SpecialRows.from_mask(mask.tolist()) == SpecialRows.from_mask(mask)


def poisoned(table, bias, special):
    """The table and bias with their special rows holding what must never be read: inf, -inf, NaN."""
    table, bias = table.detach().clone(), bias.detach().clone()
    for k, r in enumerate(special):
        table[r] = (float("inf"), float("-inf"), float("nan"))[k % 3]
        table[r, 0] = float("nan") if k % 2 else table[r, 0]
        bias[r] = float("inf")
    return table.requires_grad_(), bias.requires_grad_()


@pytest.mark.parametrize("backend", ["native", "dense"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_special_rows_holding_inf_and_nan_never_reach_the_loss(layout, reduction, backend):
    """Round 7: a special row kept inside (class weight 0) holding inf or NaN, or with a +inf bias,
    made the loss NaN (0 x inf). Whatever a special row holds, loss, metrics and gradients are those
    of a finite one, and its gradients are exactly 0."""
    special_rows, special = LAYOUTS[layout]
    (hidden, table, bias), ids, real = make_batch(special, torch.float64, bias_rows=True)
    upstream = torch.randn(3, 5, dtype=torch.float64) if reduction == "none" else torch.tensor(1.5, dtype=torch.float64)
    results = []
    for t, b in ((table, bias), poisoned(table, bias, special)):
        loss, metrics = cut_bce_with_logits(hidden, t, ids, b, weight=real, reduction=reduction, backend=backend,
                                            return_metrics=True, special_rows=special_rows)
        results.append((loss, metrics, torch.autograd.grad(loss, (hidden, t, b), upstream)))
    (want, want_metrics, want_grads), (got, got_metrics, got_grads) = results
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip((*got_metrics, *got_grads), (*want_metrics, *want_grads)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert torch.count_nonzero(got_grads[1][special]) == 0 and torch.count_nonzero(got_grads[2][special]) == 0


def test_metrics_with_a_special_row_inside_and_no_hidden_size():
    """Round 7: return_metrics=True with a special row inside and D = 0 was a reshape error."""
    bias = torch.randn(ROWS, dtype=torch.float64)
    ids = torch.tensor([[3], [-1], [9]])
    loss, metrics = cut_bce_with_logits(torch.zeros(3, 0, dtype=torch.float64), torch.zeros(ROWS, 0, dtype=torch.float64),
                                        ids, bias, reduction="none", return_metrics=True, special_rows=SpecialRows([9]))
    items = items_of([9])
    y = (ids[..., None] == items).any(-2)
    z = bias[items].expand(3, -1)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(z, y.double(), reduction="none").sum(-1))
    assert metrics.tp.tolist() == ((z > 0) & y).sum(-1).float().tolist()
    assert (metrics.fp + metrics.tn + metrics.tp + metrics.fn).tolist() == [ROWS - 1.0] * 3


def test_no_framework_is_imported_by_torch_cutbce_or_its_integration():
    """`import torch_cutbce` loads no integration; the RePlay module imports nothing of RePlay."""
    import subprocess
    import sys

    code = ("import sys, torch_cutbce; print('torch_cutbce.integrations' in sys.modules); "
            "from torch_cutbce.integrations import replay; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('replay', 'lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "[]"], out.stdout
