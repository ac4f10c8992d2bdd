"""DTensor inputs on P = 2, 3, 4 gloo ranks against a float64 oracle of one process.

Each rank has its own positions and upstream gradient; the table is Shard(0) (uneven: V = 301),
Replicate(), or the positions themselves are DTensors (tests/_dtensor_ranks.py). Data-parallel
semantics (torch_cutbce/distributed.py): each rank's loss, metrics and d_hidden are its own
positions' as on one device, the table's gradient is that of the mean of the ranks' losses.
Issue 39: a table with fewer rows than ranks gives every rank a gradient, and a bad batch on one
rank stops every rank.
"""

from __future__ import annotations

import re

import pytest
import torch

import _dtensor_ranks as R
import _fsdp_ranks as F
import torch_cutbce as tc
from distributed_harness import run_ranks
from parity import REDUCTIONS, TOLERANCES, assert_close, torch_dtype

pytestmark = pytest.mark.rung3

WORLDS = (2, 3, 4)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"P{p}" for p in WORLDS])
def ranks(request):
    # The timeout: a rank left waiting in a collective (a bad batch, a missing gradient) fails the
    # run instead of hanging it; a run takes well under a minute.
    return request.param, run_ranks(request.param, R.cases_program, timeout_s=600)


def _dense(case: str, rank: int, world: int, dtype: str) -> dict:
    """The dense reference of one rank's loss on one process, in `dtype` (float64: the oracle)."""
    table_layout, position_layout, reduction, case_dtype, loss = R.CASES[case]
    t = torch_dtype(dtype)
    source = 0 if position_layout == "replicate" else rank
    tab, pos = R.table(case_dtype), R.positions(source, case_dtype)
    targets = torch.as_tensor(pos["targets"])
    if position_layout == "shard":
        targets = targets[:, :3]
    leaves = {k: torch.as_tensor(v).to(t).requires_grad_(True) for k, v in
              dict(hidden=pos["hidden"], item_weight=tab["item_weight"], bias=tab["bias"], weight=pos["weight"]).items()}
    class_weight, pos_weight = (torch.as_tensor(tab[k]).to(t) for k in ("class_weight", "pos_weight"))
    item_weight, bias = leaves["item_weight"], leaves["bias"]
    if case in R.SPECIAL_ROWS:  # the loss over the items alone, their own ids (never the code under test)
        rows = item_weight.shape[0]
        items = torch.tensor([r for r in range(rows) if r not in {i % rows for i in R.SPECIAL_ROWS[case].indices}])
        column = torch.full((rows,), -1).index_copy(0, items, torch.arange(items.numel()))
        targets = torch.where(targets >= 0, column[targets.clamp(min=0)], -1)
        item_weight, bias, class_weight, pos_weight = (x[items] for x in (item_weight, bias, class_weight, pos_weight))
    loss, metrics = tc.dense_bce_with_logits(
        leaves["hidden"], item_weight, targets, bias, weight=leaves["weight"], class_weight=class_weight,
        pos_weight=pos_weight, reduction=reduction, return_metrics=True, **loss.arguments())
    if case in R.SPECIAL_ROWS:  # run_case's counts say whether the table was kept as it lies
        metrics = tc.CutBCEMetrics(*(torch.ones(1),) * 4)
    (loss * R.upstream(source, reduction).to(loss.dtype)).sum().backward()
    out = {"loss": loss.detach(), **metrics._asdict()}
    return out | {f"d_{k}": v.grad for k, v in leaves.items()}


def _expected(case: str, world: int, dtype: str) -> list[dict]:
    """Each rank's expected results: its own loss, metrics, d_hidden, d_weight; the table's gradient
    of the mean of the ranks' losses (data parallel) or of the one loss (replicated positions),
    this rank's rows of it."""
    per_rank = [_dense(case, r, world, dtype) for r in range(world)]
    table_layout, position_layout = R.CASES[case][:2]
    out = []
    for rank, res in enumerate(per_rank):
        res = {k: v.double() for k, v in res.items()}
        for key in ("d_item_weight", "d_bias"):
            if position_layout != "replicate":
                # The ranks' gradients join in their own dtype, as DDP / FSDP reduce a dense loss's:
                # the 16-bit yardstick rounds at each addition too.
                total = per_rank[0][key]
                for r in per_rank[1:]:
                    total = total + r[key]
                res[key] = (total / world).double()
            if table_layout != "replicate":
                shard, shards = R.shard_coordinate(case, rank, world)
                chunks = res[key].chunk(shards)
                res[key] = chunks[shard] if shard < len(chunks) else res[key][:0]
        out.append(res)
    return out


@pytest.mark.parametrize("case", list(R.CASES))
def test_dtensor_case_matches_the_oracle(ranks, case):
    world, results = ranks
    if case not in R.cases_for(world):
        pytest.skip(f"{case} needs 4 ranks")
    dtype = R.CASES[case][3]
    truth = _expected(case, world, "float64")
    reference = _expected(case, world, dtype) if dtype != "float32" else truth
    for rank, got in enumerate(results):
        got = dict(got[case])
        placements = got.pop("grad_placements")
        expected = {"shard": ("S(0)",), "replicate": ("R",), "hsdp": ("R", "S(0)")}[R.CASES[case][0]]
        assert placements["item_weight"] == expected and placements["bias"] == expected, placements
        assert_close(got, reference[rank], truth[rank], dtype=dtype, name=f"P{world} rank{rank} {case}")


# What each refused layout must say: the argument, its placement, what is supported.
REFUSALS = {
    "table-shard1": r"item_weight is a DTensor with placements \(Shard\(dim=1\),\).*Shard\(0\) over one mesh dimension",
    "table-partial": r"item_weight is a DTensor with placements \(Partial\(sum\),\).*Partial .* not supported",
    "bias-plain": r"bias is a plain tensor but item_weight is a DTensor .*Shard\(dim=0\).*make bias a DTensor",
    "bias-replicated": r"bias is a DTensor with placements \(Replicate\(\),\).*must have item_weight's mesh and placements",
    "hidden-shard1": r"hidden is a DTensor with placements \(Shard\(dim=1\),\).*Shard\(0\) over every mesh dimension",
    "targets-plain": r"targets is a plain tensor but hidden is a DTensor",
    "other-mesh": r"item_weight is a DTensor .* but the positions lie on another mesh",
    "vocab-parallel": r"vocab_parallel= is for plain tensors; with DTensor arguments",
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_unsupported_layouts_are_refused_by_name(ranks, name):
    world, results = ranks
    for rank, result in enumerate(results):
        got = result["refusals"][name]
        assert got is not None, f"P{world} rank{rank} {name}: no error"
        assert got[0] == "ValueError" and re.search(REFUSALS[name], got[1]), f"P{world} rank{rank} {name}: {got}"


@pytest.mark.parametrize("variant", list(F.VARIANTS))
def test_fsdp2_training_equals_one_process_on_the_mean_loss(ranks, variant):
    """3 SGD steps of a small FSDP2 model whose table the loss reads (tests/_fsdp_ranks.py) against
    one process training on the mean of the ranks' dense losses: within 1e-5 relative, and within
    the bfloat16 tolerance for bfloat16 parameters (the forward runs in bfloat16 there, the twin in
    float32). Every rank holds a gradient for every parameter at each step, also with fewer items
    than ranks (an empty table shard; those variants clip the gradients' norm)."""
    world, results = ranks
    twin = F.one_process(variant, world)
    param_dtype = F.VARIANTS[variant][4]
    dtype = "bfloat16" if param_dtype is torch.bfloat16 else "float32"
    tied, reshard = F.VARIANTS[variant][:2]
    for rank, result in enumerate(results):
        got = result["fsdp"][variant]
        # The loss read the Shard(0) DTensor wherever FSDP2 had resharded the table.
        assert all(got["read_sharded"]) if reshard else not any(got["read_sharded"]), got["read_sharded"]
        assert all(got["with_grad"]), f"P{world} rank{rank} {variant}: a parameter without a gradient"
        for name, value in twin.items():
            err = float((got["params"][name] - value).abs().max() / value.abs().max())
            assert err <= TOLERANCES[dtype], f"P{world} rank{rank} {variant} {name}: {err:.2e}"


def _empty_shard_oracle(world: int, reduction: str) -> dict:
    """One process, float64: the table's gradient of the mean of the ranks' losses on the V = P - 1
    table (tests/_dtensor_ranks.py), its norm, the gradient clipped as clip_grad_norm_ does, and the
    table after the SGD step."""
    table = {k: v.clone().requires_grad_(True) for k, v in R.small_table(world).items()}
    for rank in range(world):
        hidden, targets = R.small_positions(rank, world)
        loss = tc.dense_bce_with_logits(hidden, table["item_weight"], targets, table["bias"], reduction=reduction)
        ((loss * R.small_upstream(rank, reduction)).sum() / world).backward()
    norm = torch.cat([p.grad.flatten() for p in table.values()]).norm()
    scale = min(1.0, R.CLIP_NORM / (float(norm) + 1e-6))
    out = {"norm": norm}
    for k, p in table.items():
        out[f"d_{k}"] = p.grad * scale
        out[f"stepped_{k}"] = p.detach() - R.STEP_LR * p.grad * scale
    return out


@pytest.mark.parametrize("backend", R.BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_rank_gets_a_gradient_with_fewer_items_than_ranks(ranks, reduction, backend):
    """V = P - 1 rows Shard(0): the last rank's shard is empty, yet it gets gradients of local shape
    (0, D) and (0,) with the table's placements, so clip_grad_norm_ and SGD run on every rank; the
    norm, each rank's clipped gradient rows and the stepped table match the oracle."""
    world, results = ranks
    want = _empty_shard_oracle(world, reduction)
    for rank, result in enumerate(results):
        got = result["empty-shard"][(reduction, backend)]
        assert got["grad_type"] == {"item_weight": "DTensor", "bias": "DTensor"}, f"P{world} rank{rank} {got}"
        assert set(got["grad_placements"].values()) == {("S(0)",)}, got["grad_placements"]
        for key in ("norm", "d_item_weight", "d_bias", "stepped_item_weight", "stepped_bias"):
            expected = want[key]
            if key.startswith("d_"):  # this rank's rows: torch.chunk's, as Shard(0) lays them out
                chunks = expected.chunk(world)
                expected = chunks[rank] if rank < len(chunks) else expected[:0]
            assert got[key].shape == expected.shape, f"P{world} rank{rank} {key}: {got[key].shape}"
            err = float((got[key] - expected).abs().max()) / float(want[key].abs().max()) if expected.numel() else 0.0
            assert err <= TOLERANCES["float32"], f"P{world} rank{rank} {reduction} {backend} {key}: {err:.2e}"


# A bad batch on rank 1 only: every rank raises (the same error for an id >= V and a wrong hidden
# size; rank 1's own and one naming it for other refusals), each call within seconds. A rank left
# waiting in a collective would hang its run: the fixture's timeout fails it instead.
BAD_BATCH_ERRORS = {
    "id-too-large": (r"ValueError", rf"targets on rank 1 holds item id {R.V + 6}, but item_weight has only V={R.V} "),
    "hidden-size": (r"ValueError", rf"hidden on rank 1 has hidden size D={R.D - 1}, but item_weight is "
                                   rf"\[{R.V}, {R.D}\] \(every rank's hidden must be \[\*S, {R.D}\]\)"),
    "float-targets": (r"ValueError", r"rank 1 refused its arguments"),
}
BAD_BATCH_ERRORS.update({f"special-{name}": error for name, error in BAD_BATCH_ERRORS.items()})
OWN_ERROR = ("TypeError", r"targets must be integer item ids")  # rank 1's own, for float targets


@pytest.mark.parametrize("layout", ["bad-batches", "bad-batches-hsdp"])
@pytest.mark.parametrize("name", R.BAD_BATCHES)
def test_a_bad_batch_on_one_rank_stops_every_rank(ranks, name, layout):
    world, results = ranks
    if layout not in results[0]:
        pytest.skip(f"{layout} needs 4 ranks")
    for rank, result in enumerate(results):
        got = result[layout][name]
        own = name.endswith("float-targets") and rank == 1
        kind, pattern = OWN_ERROR if own else BAD_BATCH_ERRORS[name]
        assert got["error"] is not None and got["error"][0] == kind, f"P{world} rank{rank} {name}: {got}"
        assert re.search(pattern, got["error"][1]), f"P{world} rank{rank} {name}: {got['error'][1]}"
        assert got["seconds"] < 30, f"P{world} rank{rank} {name}: {got['seconds']:.1f} s"
        assert result[layout]["good"]["error"] is None, f"P{world} rank{rank}: {result[layout]['good']}"
    if not name.endswith("float-targets"):  # the same message on every rank
        assert len({result[layout][name]["error"] for result in results}) == 1
