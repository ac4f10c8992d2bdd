"""Sharded CutBCE from PyTorch: torch_xla SPMD on 4 CPU devices, and torch.distributed vocab parallelism.

torch_xla: `_sharded_xla_worker.py` runs in a subprocess (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4,
`use_spmd()` before any XLA tensor exists) and reports relative errors against the native path and
facts read from the partitioned HLO, for the existing bridge and for the proposed sharded bridge.

torch.distributed: three gloo ranks (tests/distributed_harness.py), each holding an uneven slice of
a V = 301 table, against the single-process native path on the whole table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_cutbce as tc
from conformance_engines import LOSSES
from distributed_harness import run_ranks
from parity import TOLERANCES, assert_close, make_inputs, make_upstream, run_torch, select
from torch_cutbce.vocab_parallel import VocabParallelOptions

pytestmark = pytest.mark.rung3

TESTS = Path(__file__).resolve().parent
TOL = TOLERANCES["float32"]
# The worker's cases (not imported from it: it imports torch_xla, which the spawned ranks need not).
XLA_CASES = ("sharded_1x4", "sharded_2x2")
SMOOTHED = "smoothing0.2-focal1.5-balanced"
ONE_PASS_VARIANTS = ("mean", "sum", "none", f"mean-{SMOOTHED}", f"none-{SMOOTHED}")


@pytest.fixture(scope="module")
def xla_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xla_sharded")
    dump = tmp / "dump"
    env = dict(
        os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
        XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
        TORCH_CUTBCE_NO_COMPILE="1",  # the native reference: skip the tile compile (seconds per process)
    )
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_sharded_xla_worker.py"), str(tmp / "report.json"), str(dump)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((tmp / "report.json").read_text())


def _table_rows(shape):
    """'f32[151,12]' -> 151."""
    return int(shape.split("[")[1].split(",")[0])


@pytest.mark.xla
def test_existing_bridge_under_spmd_is_exact_but_gathers_the_table(xla_report):
    plain = xla_report["plain"]
    assert max(plain["errors"].values()) <= TOL, plain["errors"]
    # The call_jax computation carries no sharding: the partitioner all-gathers the V-sharded table
    # (302 = 301 padded to 2 shards) and every device loops over all of it.
    sizes = xla_report["sizes"]
    gathered = [_table_rows(s) for s in plain["hlo"]["gathered_shapes"] if s.endswith(f",{sizes['D']}]")]
    assert gathered and max(gathered) >= sizes["V"], plain["hlo"]


@pytest.mark.xla
@pytest.mark.parametrize("case", XLA_CASES)
def test_sharded_bridge_under_spmd_is_exact_and_loops_over_local_items(xla_report, case):
    result = xla_report[case]
    worst = max(result["errors"], key=result["errors"].get)
    assert result["errors"][worst] <= TOL, f"{case}: {worst} {result['errors']}"
    hlo = result["hlo"]
    assert hlo["modules"] == 1 and hlo["gathered_shapes"] == [], hlo  # forward + backward, one program, no gather
    sizes = xla_report["sizes"]
    shards = result["vocab_shards"]
    table_rows = {_table_rows(s) for s in hlo["loop_shapes"] if s.endswith(f",{sizes['D']}]")}
    assert -(-sizes["V"] // shards) in table_rows, hlo  # each device's tile loop reads only its slice
    assert shards == 1 or max(table_rows) < sizes["V"], hlo
    # Forward rows over the vocab axis, backward d_hidden over it and d_item_weight, d_bias over the data axis.
    assert set(hlo["collectives"]) <= {"all-reduce"} and hlo["collectives"].get("all-reduce", 0) <= 4, hlo


@pytest.mark.xla
def test_training_steps_with_the_sharded_bridge_match_cpu(xla_report):
    """5 Adam steps of a tied-table model (padding row 0, item_weight = rows 1..V) on a 2 x 2 mesh."""
    result = xla_report["train_2x2"]
    assert max(result["errors"].values()) <= TOL, result["errors"]
    sizes, hlo = xla_report["sizes"], result["hlo"]
    table_rows = {_table_rows(s) for s in hlo["loop_shapes"] if s.endswith(f",{sizes['D']}]")}
    assert table_rows and max(table_rows) < sizes["V"], hlo  # the loss still loops over local slices only
    gathered = [_table_rows(s) for s in hlo["gathered_shapes"] if s.endswith(f",{sizes['D']}]")]
    assert not gathered, hlo  # the embedding lookup gathers ids, never the table


@pytest.mark.xla
def test_sharded_bridge_without_bias_after_calls_with_bias(xla_report):
    """torch_xla 2.9's call_jax unflattens every cached variant with the latest trace's output tree."""
    errors = xla_report["no_bias_after_bias"]["errors"]
    assert max(errors.values()) <= TOL, errors


@pytest.mark.xla
@pytest.mark.parametrize("variant", ONE_PASS_VARIANTS)
def test_mesh_bridge_scalar_losses_take_one_pass(xla_report, variant):
    """`cut_bce_with_logits(mesh=)` on a 2 x 2 mesh, every option on (a non-uniform weight with zeros),
    plain and with label smoothing and balanced focal: the loss, metrics and gradients match the
    float64 oracle, and 'mean' / 'sum' compute their gradients in the loop that computes the loss
    (cutbce::xla_weighted_sum over sharded_value_and_grad): one tile loop in the program, where
    'none' has a forward and a backward."""
    report = xla_report["one_pass"]
    assert set(report) - {"shape", "seed"} == set(ONE_PASS_VARIANTS), list(report)  # each one checked
    n, v, d, slots = report["shape"]
    result = report[variant]
    reduction, loss = result["reduction"], LOSSES[result["loss"]]
    inputs = select(make_inputs((n,), v, d, slots, seed=report["seed"]), dtype="float32")
    upstream = make_upstream(reduction, (n,), seed=report["seed"], dtype="float32")
    truth = run_torch(tc.dense_bce_with_logits, inputs, dtype="float64", upstream=upstream, reduction=reduction,
                      **loss.arguments())
    fast = {k: np.asarray(x) for k, x in result["results"].items()}
    assert_close(fast, truth, dtype="float32", name=f"mesh 2x2 {variant}")
    hlo = result["hlo"]
    assert hlo["modules"] == 1 and hlo["gathered_shapes"] == [], hlo
    assert hlo["while_loops"] == (2 if reduction == "none" else 1), hlo
    assert set(hlo["collectives"]) == {"all-reduce"}, hlo


# ---- torch.distributed vocabulary parallelism ----------------------------------------------

WORLD = 3
N_SHAPE, V, D, L = (3, 7), 301, 12, 5
REDUCTIONS = ("none", "sum", "mean")
# Each variant is a reduction, the focal loss (issue 15) with 'mean', and label smoothing (issue 30)
# with focal and 'none': (reduction, the Loss's arguments).
FOCAL = tc.Focal(gamma=1.5, alpha=0.25, apply_class_balancing=True)
VARIANTS = {**{r: (r, {}) for r in REDUCTIONS}, "focal-smoothing-none": ("none", dict(focal=FOCAL, label_smoothing=0.1)),
            "focal-mean": ("mean", dict(focal=FOCAL))}


def _inputs():
    g = torch.Generator().manual_seed(0)
    n = N_SHAPE[0] * N_SHAPE[1]
    hidden = torch.randn(n, D, generator=g) * 2
    hidden[2] *= 40
    targets = torch.randint(-1, V, (n, L), generator=g)
    targets[:, 1] = targets[:, 0]
    targets[0] = -1
    targets[1, :3] = V - 1
    targets[3, :2] = torch.tensor([100, 101])  # either side of the first slice boundary (101 rows a rank)
    return dict(
        hidden=hidden.reshape(*N_SHAPE, D), item_weight=torch.randn(V, D, generator=g), bias=torch.randn(V, generator=g),
        targets=targets.reshape(*N_SHAPE, L), weight=torch.rand(N_SHAPE, generator=g),
        class_weight=torch.rand(V, generator=g) + 0.5, pos_weight=torch.rand(V, generator=g) * 3 + 0.25,
    )


def _upstream(variant):
    shape = N_SHAPE if VARIANTS[variant][0] == "none" else ()
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _loss_and_grads(loss_fn, inputs, rows):
    """For each reduction: loss, metrics and gradients of `sum(loss * upstream)`; `rows` slices the table."""
    out = {}
    for variant, (reduction, loss_arguments) in VARIANTS.items():
        leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("hidden", "weight")}
        leaves.update({k: inputs[k][rows].clone().requires_grad_(True) for k in ("item_weight", "bias")})
        loss, metrics = loss_fn(
            leaves["hidden"], leaves["item_weight"], inputs["targets"], leaves["bias"], weight=leaves["weight"],
            class_weight=inputs["class_weight"][rows], pos_weight=inputs["pos_weight"][rows],
            reduction=reduction, return_metrics=True, block_v=16, **loss_arguments,
        )
        (loss * _upstream(variant)).sum().backward()
        out[variant] = {"loss": loss.detach(), **metrics._asdict(), **{f"d_{k}": v.grad for k, v in leaves.items()}}
    return out


def vocab_parallel_program(rank, world):
    """One rank's results with its even slice of the table (run by tests/distributed_harness.py)."""
    options = VocabParallelOptions.even(V)
    loss_fn = lambda *a, **k: tc.cut_bce_with_logits(*a, vocab_parallel=options, **k)
    return {"options": (options.start, options.stop),
            "result": _loss_and_grads(loss_fn, _inputs(), slice(options.start, options.stop))}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(WORLD, vocab_parallel_program)


def test_even_split_covers_the_table(ranks):
    assert [r["options"] for r in ranks] == [(0, 101), (101, 202), (202, 301)]


@pytest.fixture(scope="module")
def single_process():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_CUTBCE_NO_COMPILE", "1")  # as on the ranks: the same eager tile math
        return _loss_and_grads(tc.cut_bce_with_logits, _inputs(), slice(None))


@pytest.mark.parametrize("reduction", list(VARIANTS))
def test_vocab_parallel_equals_single_process(ranks, single_process, reduction):
    reference = single_process[reduction]
    for rank, r in enumerate(ranks):
        got = r["result"][reduction]
        # Replicated results: the loss, the metrics, d_hidden and d_weight are whole on every rank.
        for key in ("loss", "tp", "fp", "fn", "tn", "d_hidden", "d_weight"):
            assert_close(got[key], reference[key], dtype="float32", name=f"rank{rank}:{reduction}:{key}")
    # The table's gradients: each rank holds its slice, and the slices tile the whole table.
    for key in ("d_item_weight", "d_bias"):
        joined = torch.cat([r["result"][reduction][key] for r in ranks])
        assert_close(joined, reference[key], dtype="float32", name=f"{reduction}:{key}")
    # all_reduce hands every rank the same bits.
    assert all(torch.equal(r["result"][reduction]["loss"], ranks[0]["result"][reduction]["loss"]) for r in ranks)


def test_options_are_validated():
    with pytest.raises(ValueError, match="start < stop"):
        VocabParallelOptions(5, 5, 10)
    inputs = _inputs()
    with pytest.raises(ValueError, match="item_weight holds 301 rows"):
        tc.cut_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"],
                               vocab_parallel=VocabParallelOptions(0, 100, V))
