"""Rung L1 (torch): the native chunked autograd.Function against the float64 dense oracle.

The oracle is `dense_bce_with_logits` (torch's binary_cross_entropy_with_logits on materialized
logits, pinned down in test_reference.py) run in float64 on the very values the fast path sees.
Every comparison covers the loss, every gradient autograd is asked for (with a random,
non-uniform upstream gradient) and the TP/FP/FN/TN counts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parity import (
    DTYPES, GRADS, OPTION_SETS, OPTIONAL, REDUCTIONS, assert_close, check_against_oracle, make_inputs, make_upstream,
    run_torch, select,
)
from torch_cutbce import (
    CutBCEWithLogitsLoss, cut_bce_with_logits, dense_bce_with_logits, ids_to_multi_hot, multi_hot_to_ids,
)

pytestmark = pytest.mark.rung1

# N = 15 positions, V = 37 items, block_v = 8: a ragged last tile.
LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, BLOCK_V = (3, 5), 37, 8, 5, 8


def native(*args, **kwargs):
    return cut_bce_with_logits(*args, backend="native", **kwargs)


def check_native(inputs, lead_shape, *, fn=native, **kwargs):
    """`parity.check_against_oracle` for the torch native path (`fn`, default: the path itself)."""
    return check_against_oracle(run_torch, fn, dense_bce_with_logits, inputs, lead_shape, name="native", **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_native_matches_oracle(dtype, options, reduction):
    raw = make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=11)
    inputs = select(raw, OPTION_SETS[options], dtype)
    out = check_native(inputs, LEAD_SHAPE, dtype=dtype, reduction=reduction, seed=11, block_v=BLOCK_V)
    assert {f"d_{k}" for k in GRADS if k in inputs} <= set(out)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "lead_shape, num_items, num_slots, block_v",
    [
        ((5,), 37, 3, 64),  # N < block_v, and block_v > V
        ((2, 3, 4), 50, 4, 7),  # rank-3 lead shape; 7 does not divide 50
        ((4, 6), 48, 3, 16),  # block_v divides V
        ((7,), 13, 1, 1),  # one column per tile; L = 1
        ((1,), 5, 3, 2),  # a single position
        ((3, 1, 2), 129, 6, None),  # the default block_v
    ],
)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_odd_shapes(lead_shape, num_items, num_slots, block_v, reduction, dtype):
    raw = make_inputs(lead_shape, num_items, 5, num_slots, seed=num_items)
    check_native(select(raw, OPTIONAL, dtype), lead_shape, dtype=dtype, reduction=reduction, seed=3, block_v=block_v)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_large_logits_everywhere(dtype):
    """Logits ~ N(0, 30^2): most |z| are tens, many 50 to 100, on positives and negatives alike."""
    raw = make_inputs((4, 4), 41, 8, 4, seed=5, scale=30.0)
    z = raw["hidden"].reshape(16, 8) @ raw["item_weight"].T
    assert (np.abs(z) >= 50).mean() > 0.05
    for reduction in REDUCTIONS:
        check_native(select(raw, OPTIONAL, dtype), (4, 4), dtype=dtype, reduction=reduction, seed=5, block_v=9)


@pytest.mark.parametrize(
    "grad_names",
    [("hidden",), ("item_weight",), ("hidden", "item_weight"), ("hidden", "item_weight", "bias"), ("bias",),
     ("weight",)],
    ids=lambda names: "+".join(names),
)
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_requires_grad_combinations(grad_names, reduction):
    """Each subset of inputs requiring grad gets exactly its gradients (ctx.needs_input_grad)."""
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=7))
    out = check_native(inputs, LEAD_SHAPE, dtype="float64", reduction=reduction, seed=7,
                       grad_names=grad_names, block_v=BLOCK_V)
    assert {k for k in out if k.startswith("d_")} == {f"d_{k}" for k in grad_names}


def test_auto_backend_on_cpu_is_native_and_metrics_are_optional():
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=8))
    upstream = make_upstream("none", LEAD_SHAPE, seed=8)
    fast = run_torch(cut_bce_with_logits, inputs, dtype="float64", upstream=upstream, reduction="none",
                     return_metrics=False)
    truth = run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, reduction="none",
                      return_metrics=False)
    assert_close(fast, truth, dtype="float64", name="auto backend")
    assert "tp" not in fast


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_grad_forward_gives_the_same_loss(reduction):
    t = {k: torch.tensor(v) for k, v in make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=17).items()}
    args = (t["hidden"].float().requires_grad_(), t["item_weight"].float(), t["targets"], t["bias"].float())
    with torch.no_grad():
        loss, metrics = native(*args, reduction=reduction, return_metrics=True, block_v=BLOCK_V)
    ref_loss, ref_metrics = dense_bce_with_logits(*(a.double() if a.is_floating_point() else a for a in args),
                                                  reduction=reduction, return_metrics=True)
    assert not loss.requires_grad
    assert_close({"loss": loss, **metrics._asdict()}, {"loss": ref_loss, **ref_metrics._asdict()},
                 dtype="float32", name="no_grad")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dense_backend_is_the_reference(dtype):
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=9), OPTIONAL, dtype)
    dense = lambda *a, **k: cut_bce_with_logits(*a, backend="dense", **k)  # noqa: E731
    check_native(inputs, LEAD_SHAPE, dtype=dtype, reduction="mean", seed=9, fn=dense)


def test_int32_targets():
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=10))
    inputs["targets"] = inputs["targets"].astype(np.int32)
    check_native(inputs, LEAD_SHAPE, dtype="float64", reduction="sum", seed=10, block_v=BLOCK_V)


# -- the nn.Module ----------------------------------------------------------------------------


def _tensors(raw, dtype=torch.float64):
    return {k: torch.tensor(v) if k == "targets" else torch.tensor(v, dtype=dtype) for k, v in raw.items()}


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_matches_functional(reduction):
    t = _tensors(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=12))
    module = CutBCEWithLogitsLoss(reduction, pos_weight=t["pos_weight"], class_weight=t["class_weight"],
                                  block_v=BLOCK_V, return_metrics=True)
    assert f"reduction={reduction!r}" in repr(module)
    hidden = t["hidden"].requires_grad_()
    g = torch.tensor(make_upstream(reduction, LEAD_SHAPE, seed=12))
    loss, metrics = module(hidden, t["item_weight"], t["targets"], t["bias"], t["weight"])
    (d_hidden,) = torch.autograd.grad(loss, hidden, g)
    ref_loss, ref_metrics = dense_bce_with_logits(
        hidden, t["item_weight"], t["targets"], t["bias"], weight=t["weight"], class_weight=t["class_weight"],
        pos_weight=t["pos_weight"], reduction=reduction, return_metrics=True)
    (ref_d_hidden,) = torch.autograd.grad(ref_loss, hidden, g)
    assert_close({"loss": loss, "d_hidden": d_hidden, **metrics._asdict()},
                 {"loss": ref_loss, "d_hidden": ref_d_hidden, **ref_metrics._asdict()},
                 dtype="float64", name="module")


def test_module_buffers_follow_to_and_state_dict():
    t = _tensors(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=13), dtype=torch.float32)
    module = CutBCEWithLogitsLoss(pos_weight=t["pos_weight"], class_weight=t["class_weight"])
    assert set(module.state_dict()) == {"pos_weight", "class_weight"}
    module = module.to(torch.float64)
    assert module.pos_weight.dtype == module.class_weight.dtype == torch.float64
    fresh = CutBCEWithLogitsLoss(pos_weight=torch.zeros(NUM_ITEMS, dtype=torch.float64),
                                 class_weight=torch.zeros(NUM_ITEMS, dtype=torch.float64))
    fresh.load_state_dict(module.state_dict())
    args = (t["hidden"].double(), t["item_weight"].double(), t["targets"])
    torch.testing.assert_close(fresh(*args), module(*args), rtol=1e-10, atol=0)
    assert CutBCEWithLogitsLoss().state_dict() == {}  # None buffers are not saved


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_with_vocab_parallel_equals_the_function(one_rank_group, reduction):
    from torch_cutbce.vocab_parallel import VocabParallelOptions

    t = _tensors(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=14))
    options = VocabParallelOptions.even(NUM_ITEMS)
    g = torch.tensor(make_upstream(reduction, LEAD_SHAPE, seed=14))

    def loss_and_grads(fn):
        leaves = {k: t[k].clone().requires_grad_() for k in ("hidden", "item_weight", "bias")}
        loss, metrics = fn(leaves["hidden"], leaves["item_weight"], t["targets"], leaves["bias"], t["weight"])
        grads = torch.autograd.grad(loss, list(leaves.values()), g)
        return {"loss": loss, **metrics._asdict(), **{f"d_{k}": d for k, d in zip(leaves, grads)}}

    module = CutBCEWithLogitsLoss(reduction, pos_weight=t["pos_weight"], class_weight=t["class_weight"],
                                  block_v=BLOCK_V, return_metrics=True, vocab_parallel=options)
    assert f"vocab_parallel=VocabParallelOptions(start=0, stop={NUM_ITEMS}, num_items={NUM_ITEMS})" in repr(module)
    got = loss_and_grads(module)
    expected = loss_and_grads(lambda h, w, ids, b, wt: cut_bce_with_logits(
        h, w, ids, b, weight=wt, class_weight=t["class_weight"], pos_weight=t["pos_weight"], reduction=reduction,
        return_metrics=True, block_v=BLOCK_V, vocab_parallel=options))
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_vocab_parallel_scalar_losses_take_one_pass(one_rank_group, monkeypatch, reduction):
    """'sum' / 'mean' with vocab_parallel compute each rank's gradients in its forward: the rows
    engine and its tile-recomputing backward never run, and the result equals one process's."""
    from torch_cutbce.native import loop
    from torch_cutbce.vocab_parallel import VocabParallelOptions

    t = _tensors(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=15))

    def loss_and_grads(**options):
        leaves = {k: t[k].clone().requires_grad_() for k in ("hidden", "item_weight", "bias", "weight")}
        loss, metrics = cut_bce_with_logits(
            leaves["hidden"], leaves["item_weight"], t["targets"], leaves["bias"], weight=leaves["weight"],
            class_weight=t["class_weight"], pos_weight=t["pos_weight"], reduction=reduction, return_metrics=True,
            block_v=BLOCK_V, **options)
        (loss * 0.75).backward()
        return {"loss": loss, **metrics._asdict(), **{f"d_{k}": x.grad for k, x in leaves.items()}}

    expected = loss_and_grads()

    def two_passes(*args, **kwargs):
        raise AssertionError("vocab_parallel 'sum' / 'mean' ran the rows engine (two passes)")

    monkeypatch.setattr(loop, "rows_forward", two_passes)
    monkeypatch.setattr(loop, "rows_backward", two_passes)
    got = loss_and_grads(vocab_parallel=VocabParallelOptions.even(NUM_ITEMS))
    assert_close(got, expected, dtype="float64", name=f"vocab_parallel {reduction}")


class _Mesh:
    """Stands in for a torch_xla SPMD Mesh (what the module reads of one: axis names, shape, device ids)."""

    axis_names = ("data", "model")
    mesh_shape = (1, 1)
    device_ids = np.arange(1)


def test_module_passes_the_mesh_through():
    t = _tensors(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=15))
    args = (t["hidden"], t["item_weight"], t["targets"])
    module = CutBCEWithLogitsLoss(mesh=_Mesh(), vocab_axis="model", data_axis=None)
    assert "mesh=Mesh((1, 1), ('data', 'model')), vocab_axis='model', data_axis=None" in repr(module)
    # On CPU tensors the mesh reaches the function, which refuses it with its own message.
    with pytest.raises(ValueError, match="mesh= runs under torch_xla SPMD") as from_function:
        cut_bce_with_logits(*args, mesh=_Mesh(), vocab_axis="model", data_axis=None)
    with pytest.raises(ValueError, match="mesh= runs under torch_xla SPMD") as from_module:
        module(*args)
    assert str(from_module.value) == str(from_function.value)


def test_module_checks_its_parallel_options_when_built():
    from torch_cutbce.vocab_parallel import VocabParallelOptions

    options = VocabParallelOptions(0, NUM_ITEMS, NUM_ITEMS)
    with pytest.raises(ValueError, match=r"mesh= runs under torch_xla SPMD and needs XLA tensors, got backend='native'"):
        CutBCEWithLogitsLoss(mesh=_Mesh(), backend="native")
    with pytest.raises(ValueError, match=r"vocab_axis='items' is not an axis of the mesh"):
        CutBCEWithLogitsLoss(mesh=_Mesh(), vocab_axis="items")
    with pytest.raises(ValueError, match=r"share mesh axes \['data'\]"):
        CutBCEWithLogitsLoss(mesh=_Mesh(), vocab_axis="data", data_axis="data")
    with pytest.raises(TypeError, match="mesh must be a torch_xla.distributed.spmd.Mesh, got tuple"):
        CutBCEWithLogitsLoss(mesh=(2, 2))
    with pytest.raises(ValueError, match=r"vocab_parallel= needs an engine that takes a slice .* got backend='dense'"):
        CutBCEWithLogitsLoss(vocab_parallel=options, backend="dense")
    with pytest.raises(TypeError, match="vocab_parallel must be a VocabParallelOptions or None, got tuple"):
        CutBCEWithLogitsLoss(vocab_parallel=(0, NUM_ITEMS, NUM_ITEMS))
    with pytest.raises(ValueError, match="exclude each other"):
        CutBCEWithLogitsLoss(mesh=_Mesh(), vocab_parallel=options)


# -- switching over from BCEWithLogitsLoss ----------------------------------------------------


def test_multi_hot_round_trip():
    targets = torch.tensor(make_inputs((4, 3), 17, 2, 6, seed=14)["targets"])
    dense = ids_to_multi_hot(targets, 17)
    ids = multi_hot_to_ids(dense)
    assert ids.shape[:-1] == targets.shape[:-1] and ids.dtype == torch.long
    torch.testing.assert_close(ids_to_multi_hot(ids, 17), dense)
    # each row: its distinct valid ids, ascending, then padding
    for row, got in zip(targets.reshape(-1, 6).tolist(), ids.reshape(-1, ids.shape[-1]).tolist()):
        want = sorted({i for i in row if i >= 0})
        assert got == want + [-1] * (len(got) - len(want))
    wide = multi_hot_to_ids(dense, max_positives=8, pad_id=-3)
    assert wide.shape[-1] == 8 and (wide[..., ids.shape[-1]:] == -3).all()
    with pytest.raises(ValueError, match="max_positives"):
        multi_hot_to_ids(dense, max_positives=1)
    with pytest.raises(ValueError, match="pad_id"):
        multi_hot_to_ids(dense, pad_id=0)


def test_target_helpers_report_bad_input():
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        ids_to_multi_hot(torch.zeros(2, 3), 5)
    with pytest.raises(ValueError, match=r"ids holds item id 5, but num_items=5"):
        ids_to_multi_hot(torch.tensor([[0, 5]]), 5)


def test_one_line_switch_over_from_bce_with_logits_loss():
    """`BCEWithLogitsLoss()(h @ E.T + b, multi_hot)` -> `cut_bce_with_logits(h, E, multi_hot_to_ids(multi_hot), b)`."""
    t = _tensors(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=15))
    multi_hot = ids_to_multi_hot(t["targets"], NUM_ITEMS, dtype=torch.float64)
    params = [t["hidden"].requires_grad_(), t["item_weight"].requires_grad_(), t["bias"].requires_grad_()]
    before = torch.nn.BCEWithLogitsLoss()(t["hidden"] @ t["item_weight"].T + t["bias"], multi_hot)
    after = cut_bce_with_logits(t["hidden"], t["item_weight"], multi_hot_to_ids(multi_hot), t["bias"])
    grads_before = torch.autograd.grad(before * 1.7, params)
    grads_after = torch.autograd.grad(after * 1.7, params)
    assert_close({"loss": after, **dict(zip("hbe", grads_after))},
                 {"loss": before, **dict(zip("hbe", grads_before))}, dtype="float64", name="switch-over")


# -- non-finite inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("bad_value", [math.nan, math.inf])
def test_non_finite_hidden_propagates_like_the_reference(bad_value):
    inputs = select(make_inputs(LEAD_SHAPE, NUM_ITEMS, HIDDEN_SIZE, NUM_SLOTS, seed=16))
    inputs["hidden"][1, 2, 3] = bad_value
    upstream = make_upstream("none", LEAD_SHAPE, seed=16)
    fast = run_torch(native, inputs, dtype="float64", upstream=upstream, reduction="none", block_v=BLOCK_V)
    truth = run_torch(dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, reduction="none")
    assert not np.isfinite(fast["loss"][1, 2])
    assert np.isfinite(np.delete(fast["loss"].ravel(), 7)).all()  # other positions are untouched
    # NaN stays NaN where the reference has NaN. An Inf may come out as NaN where the reference has
    # +-Inf (the fused form adds the background's 0 * Inf to the correction's), so for Inf only
    # the pattern of non-finite values is compared.
    pattern = np.isnan if math.isnan(bad_value) else np.isfinite
    for key in ("loss", "d_hidden", "d_item_weight", "d_bias", "d_weight"):
        np.testing.assert_array_equal(pattern(fast[key]), pattern(truth[key]), err_msg=key)
    loss = native(*(torch.tensor(inputs[k]) for k in ("hidden", "item_weight", "targets")), reduction="sum")
    assert not torch.isfinite(loss)
