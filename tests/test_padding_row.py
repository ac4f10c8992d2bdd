"""`without_padding_row` (torch_cutbce/padding_row.py): a padding row first, last or inside the table,
on the torch engines, against a float64 dense BCE over the table with that row taken out.

The reference never uses the function under test: it drops the padding column of the dense
logits by a boolean mask and maps each label id (a table row) to its column by hand. Run on the
native and dense backends, in float64 and float32 (the parity rule of tests/parity.py), with a
bias, several positives per position, the padding id among them, and padded positions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity import assert_close
from torch_cutbce import cut_bce_with_logits, without_padding_row

ROWS, D = 23, 8  # V = 22 items and one padding row


def make_batch(padding_idx, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(ROWS, D, generator=g, dtype=torch.float64)
    table[padding_idx] = 0.0  # as nn.Embedding(padding_idx=...) keeps it
    hidden = torch.randn(3, 5, D, generator=g, dtype=torch.float64)
    bias = torch.randn(ROWS - 1, generator=g, dtype=torch.float64) - 2
    ids = torch.randint(0, ROWS, (3, 5, 4), generator=g)
    ids[0, 0] = padding_idx  # a position whose only labels are padding
    ids[1, :, -1] = padding_idx  # padded labels beside real ones
    ids[2, 1, 0] = -1  # negative ids are padding too
    real = (torch.arange(5) < torch.tensor([[5], [3], [4]])).to(torch.float64)  # ragged sequences
    cast = [x.to(dtype).requires_grad_() for x in (hidden, table, bias)]
    return cast, ids, real.to(dtype)


def dense_reference(hidden, table, bias, ids, real, padding_idx):
    """float64 BCE over the items (the table without its padding row), summed, / real positions."""
    hidden, table, bias, real = (x.to(torch.float64) for x in (hidden, table, bias, real))
    keep = torch.arange(ROWS) != padding_idx
    logits = hidden @ table[keep].T + bias  # [3, 5, V]: column c = the c-th row that is not padding
    column = ids - (ids > padding_idx).long()  # table row -> column
    valid = (ids >= 0) & (ids != padding_idx)
    # Added, then capped at 1: a padding label adds 0 to column 0 (a scatter of 0 could overwrite a 1).
    labels = torch.zeros_like(logits).scatter_add_(-1, torch.where(valid, column, 0), valid.to(logits.dtype))
    labels = labels.clamp(max=1)
    per_position = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(-1)
    return (per_position * real).sum() / real.sum()


@pytest.mark.parametrize("backend", ["native", "dense"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("padding_idx", [0, 9, ROWS - 1], ids=["first", "inside", "last"])
def test_any_padding_row_matches_the_dense_loss_without_it(padding_idx, dtype, backend):
    (hidden, table, bias), ids, real = make_batch(padding_idx, getattr(torch, dtype))
    c = without_padding_row(table, ids, padding_idx, bias)
    loss = cut_bce_with_logits(hidden, c.item_weight, c.targets, c.bias, class_weight=c.class_weight,
                               weight=real, reduction="sum", backend=backend) / real.sum()
    got = torch.autograd.grad(loss, (hidden, table, bias))
    truth_inputs = [x.detach().to(torch.float64).requires_grad_() for x in (hidden, table, bias)]
    truth = dense_reference(*truth_inputs, ids, real, padding_idx)
    want = torch.autograd.grad(truth, truth_inputs)
    assert_close(loss.detach(), truth.detach(), dtype=dtype, name=f"loss, padding row {padding_idx}")
    for name, g, w in zip(("hidden", "item_weight", "bias"), got, want):
        assert_close(g, w, dtype=dtype, name=f"d_{name}, padding row {padding_idx}")
    assert torch.count_nonzero(got[1][padding_idx]) == 0, "the padding row got a gradient"


@pytest.mark.parametrize("padding_idx", [0, 9, ROWS - 1])
def test_the_table_is_a_view_at_the_ends_and_whole_inside(padding_idx):
    (_, table, bias), ids, _ = make_batch(padding_idx, torch.float32)
    c = without_padding_row(table, ids, padding_idx, bias)
    assert c.item_weight.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    if padding_idx in (0, ROWS - 1):
        assert c.item_weight.shape == (ROWS - 1, D) and c.class_weight is None and c.bias is bias
    else:
        assert c.item_weight is table and c.class_weight[padding_idx] == 0 and c.bias.shape == (ROWS,)
        assert int((c.class_weight == 1).sum()) == ROWS - 1


def test_the_whole_table_without_the_rule_is_a_different_loss():
    """What the function prevents: the padding row scored as a negative of every position."""
    (hidden, table, bias), ids, real = make_batch(ROWS - 1, torch.float64)
    with torch.no_grad():
        table[ROWS - 1] = 0.5  # a padding row that is not zero scores like any item
        full_bias = torch.cat([bias, bias.new_zeros(1)])
        wrong = cut_bce_with_logits(hidden, table, ids.masked_fill(ids == ROWS - 1, -1), full_bias,
                                    weight=real, reduction="sum") / real.sum()
        right = dense_reference(hidden, table, bias, ids, real, ROWS - 1)
    assert abs(float(wrong - right)) > 1e-3 * float(right)


@pytest.mark.parametrize("call, error, words", [
    (lambda t, i: without_padding_row(t, i, ROWS), ValueError, ["padding_idx", f"< {ROWS}", str(ROWS)]),
    (lambda t, i: without_padding_row(t, i, -1), ValueError, ["padding_idx", "negative", "-1"]),
    (lambda t, i: without_padding_row(t, i, True), TypeError, ["padding_idx", "True", "bool"]),
    (lambda t, i: without_padding_row(t, i, 1.0), TypeError, ["padding_idx", "float"]),
    (lambda t, i: without_padding_row(t[0], i, 0), ValueError, ["item_weight", "[V + 1, D]", f"({D},)"]),
    (lambda t, i: without_padding_row(t, i.float(), 0), TypeError, ["targets", "integer", "float32"]),
    (lambda t, i: without_padding_row(t, i, 0, torch.zeros(ROWS)), ValueError,
     ["bias", f"[{ROWS - 1}]", f"({ROWS},)"]),
    (lambda t, i: without_padding_row(t, i, 0, class_weight=torch.zeros(3)), ValueError, ["class_weight", "(3,)"]),
])
def test_bad_input_names_the_argument(call, error, words):
    (_, table, _), ids, _ = make_batch(0, torch.float32)
    with pytest.raises(error) as raised:
        call(table.detach(), ids)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


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
