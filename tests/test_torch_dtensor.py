"""DTensor inputs on P = 2, 3, 4 gloo ranks against a float64 oracle of one process.

Each rank has its own positions and upstream gradient; the table is Shard(0) (uneven: V = 301),
Replicate(), or the positions themselves are DTensors (tests/_dtensor_ranks.py). Data-parallel
semantics (torch_cutbce/distributed.py): each rank's loss, metrics and d_hidden are its own
positions' as on one device, the table's gradient is that of the mean of the ranks' losses.
"""

from __future__ import annotations

import pytest
import torch

import _dtensor_ranks as R
import torch_cutbce as tc
from distributed_harness import run_ranks
from parity import assert_close, torch_dtype

pytestmark = pytest.mark.rung3

WORLDS = (2, 3, 4)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"P{p}" for p in WORLDS])
def ranks(request):
    return request.param, run_ranks(request.param, R.cases_program, tuple(R.CASES))


def _dense(case: str, rank: int, world: int, dtype: str) -> dict:
    """The dense reference of one rank's loss on one process, in `dtype` (float64: the oracle)."""
    table_layout, position_layout, reduction, case_dtype, focal = R.CASES[case]
    t = torch_dtype(dtype)
    source = 0 if position_layout == "replicate" else rank
    tab, pos = R.table(case_dtype), R.positions(source, case_dtype)
    targets = torch.as_tensor(pos["targets"])
    if position_layout == "shard":
        targets = targets[:, :3]
    leaves = {k: torch.as_tensor(v).to(t).requires_grad_(True) for k, v in
              dict(hidden=pos["hidden"], item_weight=tab["item_weight"], bias=tab["bias"], weight=pos["weight"]).items()}
    loss, metrics = tc.dense_bce_with_logits(
        leaves["hidden"], leaves["item_weight"], targets, leaves["bias"], weight=leaves["weight"],
        class_weight=torch.as_tensor(tab["class_weight"]).to(t), pos_weight=torch.as_tensor(tab["pos_weight"]).to(t),
        reduction=reduction, return_metrics=True, focal=focal)
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
                res[key] = sum(r[key].double() for r in per_rank) / world
            if table_layout == "shard":
                res[key] = res[key].chunk(world)[rank] if rank < len(res[key].chunk(world)) else res[key][:0]
        out.append(res)
    return out


@pytest.mark.parametrize("case", list(R.CASES))
def test_dtensor_case_matches_the_oracle(ranks, case):
    world, results = ranks
    dtype = R.CASES[case][3]
    truth = _expected(case, world, "float64")
    reference = _expected(case, world, dtype) if dtype != "float32" else truth
    for rank, got in enumerate(results):
        got = dict(got[case])
        placements = got.pop("grad_placements")
        if R.CASES[case][0] == "shard":
            assert placements["item_weight"] == ("S(0)",) and placements["bias"] == ("S(0)",), placements
        else:
            assert placements["item_weight"] == ("R",), placements
        assert_close(got, reference[rank], truth[rank], dtype=dtype, name=f"P{world} rank{rank} {case}")
