"""What each rank runs for tests/test_torch_dtensor.py (through tests/distributed_harness.py).

Every rank has its own positions (uneven counts and target widths, padded positions, duplicates,
large logits: `parity.make_inputs`) and the one table, laid out as the case says. A case returns
the rank's loss, metrics and gradients of `sum(loss * upstream)`, with a non-uniform upstream of
the rank's own; the test compares them with a float64 oracle of one process. Beside the cases
(issue 39): a step on a table with fewer rows than ranks, and bad batches on rank 1 alone.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import torch_cutbce as tc
from cutbce_common.loss import Loss
from parity import REDUCTIONS, make_inputs, select, torch_dtype

V, D = 301, 12
FOCAL = tc.Focal(gamma=1.5, alpha=0.25, apply_class_balancing=True)
TABLE_NAMES = ("item_weight", "bias", "class_weight", "pos_weight")


def positions_count(rank: int) -> int:
    return 5 + 3 * rank  # uneven over the ranks


def table(dtype: str) -> dict:
    inputs = select(make_inputs((8,), V, D, 3, seed=0), dtype=dtype)
    return {k: inputs[k] for k in TABLE_NAMES}


def positions(rank: int, dtype: str) -> dict:
    inputs = select(make_inputs((positions_count(rank),), V, D, 3 + rank % 2, seed=10 + rank), dtype=dtype)
    return {k: inputs[k] for k in ("hidden", "targets", "weight")}


def upstream(rank: int, reduction: str) -> torch.Tensor:
    shape = (positions_count(rank),) if reduction == "none" else ()
    return torch.rand(shape, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64) + 0.5


PLAIN = Loss()
SMOOTHED = Loss(FOCAL, label_smoothing=0.1)  # label smoothing (issue 30) with focal
CASES = {  # name: (table layout, positions layout, reduction, dtype, Loss)
    **{f"sharded-{r}": ("shard", "plain", r, "float32", PLAIN) for r in ("none", "sum", "mean")},
    "sharded-focal-mean": ("shard", "plain", "mean", "float32", Loss(FOCAL)),
    "sharded-focal-smoothing-none": ("shard", "plain", "none", "float32", SMOOTHED),
    "sharded-bfloat16-mean": ("shard", "plain", "mean", "bfloat16", PLAIN),
    "replicated-mean": ("replicate", "plain", "mean", "float32", PLAIN),
    "hidden-shard-sum": ("shard", "shard", "sum", "float32", PLAIN),
    "hidden-replicate-none": ("shard", "replicate", "none", "float32", PLAIN),
    "hsdp-mean": ("hsdp", "plain", "mean", "float32", PLAIN),  # 4 ranks: 2 replicas x 2 shards
    "plain-constants-sum": ("shard", "plain", "sum", "float32", PLAIN),  # class/pos weight plain [V]
    "dense-backend-none": ("shard", "plain", "none", "float32", PLAIN),  # backend='dense' per rank
    "triton-backend-mean": ("shard", "plain", "mean", "float32", SMOOTHED),  # the Triton kernels per rank
    "module-mean": ("shard", "plain", "mean", "float32", SMOOTHED),  # CutBCEWithLogitsLoss
}
# Special rows of a sharded table (issue 46): excluded in place, the table never sliced (a slice of
# a Shard(0) DTensor comes back Replicate(): the whole table gathered on every rank).
SPECIAL_ROWS = {
    "special-first-mean": tc.SpecialRows.first(2),
    "special-inside-sum": tc.SpecialRows([0, 150, -1]),
    "special-last-none": tc.SpecialRows.last(1),
}
CASES |= {name: ("shard", "plain", name.rsplit("-", 1)[1], "float32", SMOOTHED) for name in SPECIAL_ROWS}


def cases_for(world: int) -> tuple[str, ...]:
    return tuple(name for name, case in CASES.items() if case[0] != "hsdp" or world == 4)


def shard_coordinate(case: str, rank: int, world: int) -> tuple[int, int]:
    """(this rank's shard, the number of shards) of the case's table."""
    return (rank % 2, 2) if CASES[case][0] == "hsdp" else (rank, world)


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def run_case(rank: int, world: int, name: str, mesh) -> dict:
    """One case on this rank: inputs laid out, the loss, its metrics and gradients."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    table_layout, position_layout, reduction, dtype, loss = CASES[name]
    tdt = torch_dtype(dtype)
    tab = {k: torch.as_tensor(v).to(tdt if k in ("item_weight", "bias") else torch.float32)
           for k, v in table(dtype).items()}
    placement = {"shard": [Shard(0)], "replicate": [Replicate()], "hsdp": [Replicate(), Shard(0)]}[table_layout]
    if table_layout == "hsdp":
        mesh = _hsdp_mesh()
    plain = ("class_weight", "pos_weight") if name.startswith("plain-constants") else ()
    tab = {k: v if k in plain else distribute_tensor(v, mesh, placement) for k, v in tab.items()}
    source = 0 if position_layout == "replicate" else rank
    pos = positions(source, dtype)
    pos = dict(hidden=torch.as_tensor(pos["hidden"]).to(tdt), targets=torch.as_tensor(pos["targets"]),
               weight=torch.as_tensor(pos["weight"]).float())
    if position_layout == "shard":  # each rank's own positions, as one global batch Shard(0)
        total = sum(positions_count(r) for r in range(world))
        pos["targets"] = pos["targets"][:, :3].contiguous()  # one DTensor: the same width on every rank
        pos = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False, shape=torch.Size((total, *v.shape[1:])),
                                     stride=torch.empty(total, *v.shape[1:]).stride())
               for k, v in pos.items()}
    elif position_layout == "replicate":
        pos = {k: DTensor.from_local(v, mesh, [Replicate()], run_check=False) for k, v in pos.items()}
    leaves = {k: tab[k].detach().requires_grad_(True) for k in ("item_weight", "bias")}
    leaves |= {k: pos[k].detach().requires_grad_(True) for k in ("hidden", "weight")}
    if name.startswith("module"):  # the nn.Module, its weights buffers (plain [V]: each rank its rows)
        loss_fn = tc.CutBCEWithLogitsLoss(reduction, pos_weight=tab["pos_weight"].full_tensor(),
                                          class_weight=tab["class_weight"].full_tensor(), return_metrics=True,
                                          block_v=16, **loss.arguments())
        loss, metrics = loss_fn(leaves["hidden"], leaves["item_weight"], pos["targets"], leaves["bias"],
                                weight=leaves["weight"])
    elif name in SPECIAL_ROWS:  # no metrics: rows excluded in place of a sharded table refuse them
        special = SPECIAL_ROWS[name]
        catalog = tc.without_special_rows(leaves["item_weight"], pos["targets"], special, leaves["bias"])
        kept = catalog.item_weight is leaves["item_weight"] and catalog.bias is leaves["bias"]
        loss = tc.cut_bce_with_logits(
            leaves["hidden"], leaves["item_weight"], pos["targets"], leaves["bias"], weight=leaves["weight"],
            class_weight=tab["class_weight"], pos_weight=tab["pos_weight"], reduction=reduction, block_v=16,
            **loss.arguments(), special_rows=special)
        metrics = tc.CutBCEMetrics(*(torch.tensor([float(kept)]),) * 4)  # tp: the table kept as it lies
    else:
        loss, metrics = tc.cut_bce_with_logits(
            leaves["hidden"], leaves["item_weight"], pos["targets"], leaves["bias"], weight=leaves["weight"],
            class_weight=tab["class_weight"], pos_weight=tab["pos_weight"], reduction=reduction,
            return_metrics=True, block_v=16, **loss.arguments(),
            backend=name.split("-backend")[0] if "-backend" in name else "auto")
    g = upstream(source, reduction).to(loss.dtype)
    if isinstance(loss, DTensor):
        raise AssertionError("the loss must be this rank's plain tensor")
    (loss * g).sum().backward()
    local = lambda x: x.to_local() if isinstance(x, DTensor) else x  # noqa: E731
    out = {"loss": loss.detach(), **{k: local(v) for k, v in metrics._asdict().items()}}
    out |= {f"d_{k}": local(v.grad) for k, v in leaves.items()}
    out["grad_placements"] = {k: tuple(str(p) for p in v.grad.placements) for k, v in leaves.items()
                              if isinstance(v.grad, DTensor)}
    return out


def _hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def cases_program(rank: int, world: int) -> dict:
    """Every case for this world, the refusals, the table with fewer rows than ranks, the FSDP2
    runs (tests/_fsdp_ranks.py) and the bad batches: one spawn of the ranks per world."""
    import _fsdp_ranks
    from torch.distributed.tensor import Replicate, Shard

    mesh = _mesh(world)
    out = {name: run_case(rank, world, name, mesh) for name in cases_for(world)}
    out["refusals"] = refusals(mesh)
    out["empty-shard"] = {(r, b): empty_shard_step(rank, world, mesh, r, b) for r in REDUCTIONS for b in BACKENDS}
    out["fsdp"] = _fsdp_ranks.fsdp_program(rank, world, tuple(_fsdp_ranks.VARIANTS))
    # Last: with a rank left waiting, the test's timeout ends the run.
    out["bad-batches"] = bad_batches(rank, mesh, [Shard(0)])
    if world == 4:  # HSDP: the replicas stop too
        out["bad-batches-hsdp"] = bad_batches(rank, _hsdp_mesh(), [Replicate(), Shard(0)])
    return out


def refusals(mesh) -> dict:
    """Each unsupported layout: the error's type and message (None: no error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    tab = {k: torch.as_tensor(v).float() for k, v in table("float32").items()}
    pos = positions(dist.get_rank(), "float32")
    hidden, targets = torch.as_tensor(pos["hidden"]).float(), torch.as_tensor(pos["targets"])
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tab.items()}
    other = init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("other",))
    calls = {
        "table-shard1": lambda: (hidden, distribute_tensor(tab["item_weight"], mesh, [Shard(1)]), targets),
        "table-partial": lambda: (hidden, DTensor.from_local(tab["item_weight"], mesh, [Partial()]), targets),
        "bias-plain": lambda: (hidden, sharded["item_weight"], targets, tab["bias"]),
        "bias-replicated": lambda: (hidden, sharded["item_weight"], targets,
                                    distribute_tensor(tab["bias"], mesh, [Replicate()])),
        "hidden-shard1": lambda: (DTensor.from_local(hidden[None], mesh, [Shard(1)], run_check=False),
                                  sharded["item_weight"], DTensor.from_local(targets[None], mesh, [Shard(1)],
                                                                              run_check=False)),
        "targets-plain": lambda: (DTensor.from_local(hidden, mesh, [Shard(0)], run_check=False),
                                  sharded["item_weight"], targets),
        "other-mesh": lambda: (DTensor.from_local(hidden, other, [Shard(0)], run_check=False),
                               sharded["item_weight"], DTensor.from_local(targets, other, [Shard(0)], run_check=False)),
    }
    out = {}
    for name, make in calls.items():
        try:
            tc.cut_bce_with_logits(*make())
            out[name] = None
        except Exception as error:  # noqa: BLE001 (the test checks type and message)
            out[name] = (type(error).__name__, str(error))
    from torch_cutbce.vocab_parallel import VocabParallelOptions

    try:
        tc.cut_bce_with_logits(hidden, sharded["item_weight"], targets, vocab_parallel=VocabParallelOptions(0, 1, V))
        out["vocab-parallel"] = None
    except Exception as error:  # noqa: BLE001
        out["vocab-parallel"] = (type(error).__name__, str(error))
    return out


# Fewer items than ranks (issue 39): V = P - 1, so the last rank's Shard(0) is empty (at P = 2 the
# `[1, D]` table of the issue). A step is the loss, clip_grad_norm_ and an SGD step: both run
# collectives over every rank's gradients, so a rank without one would fail them.
BACKENDS = ("auto", "dense")
CLIP_NORM, STEP_LR = 0.05, 0.5


def small_table(world: int) -> dict:
    inputs = make_inputs((4,), world - 1, D, 2, seed=1)
    return {k: torch.as_tensor(inputs[k]) for k in ("item_weight", "bias")}


def small_positions(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = make_inputs((4 + rank,), world - 1, D, 2, seed=20 + rank)
    return torch.as_tensor(inputs["hidden"]), torch.as_tensor(inputs["targets"])


def small_upstream(rank: int, reduction: str) -> torch.Tensor:
    shape = (4 + rank,) if reduction == "none" else ()
    return torch.rand(shape, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64) + 0.5


def empty_shard_step(rank: int, world: int, mesh, reduction: str, backend: str) -> dict:
    """One step on a table of V = P - 1 rows: each rank's gradients (local part and placements),
    the total norm clip_grad_norm_ saw, and the table after the step, whole."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    params = {k: distribute_tensor(v.float(), mesh, [Shard(0)]).requires_grad_(True)
              for k, v in small_table(world).items()}
    hidden, targets = small_positions(rank, world)
    loss = tc.cut_bce_with_logits(hidden.float(), params["item_weight"], targets, params["bias"],
                                  reduction=reduction, backend=backend)
    (loss * small_upstream(rank, reduction).float()).sum().backward()
    grads = {k: p.grad for k, p in params.items()}
    out = {"grad_type": {k: type(g).__name__ for k, g in grads.items()},
           "grad_placements": {k: tuple(str(x) for x in g.placements) for k, g in grads.items()
                               if isinstance(g, DTensor)}}
    if len(out["grad_placements"]) < len(grads):  # a rank without a gradient: the collectives below would fail
        return out
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP_NORM)
    out["norm"] = (norm.full_tensor() if isinstance(norm, DTensor) else norm).double()
    out |= {f"d_{k}": g.to_local().double() for k, g in grads.items()}  # clipped
    torch.optim.SGD(list(params.values()), lr=STEP_LR).step()
    return out | {f"stepped_{k}": p.detach().full_tensor().double() for k, p in params.items()}


# Bad batches on rank 1 only (issue 39): each must stop every rank, none left in a collective.
BAD_BATCHES = ("id-too-large", "hidden-size", "float-targets")
# The same with special_rows= (round 7: its id check ran before the ranks agreed, on rank 1 alone).
BAD_BATCHES += tuple(f"special-{name}" for name in BAD_BATCHES)


def bad_batches(rank: int, mesh, placements) -> dict:
    """Each bad batch on rank 1 (the others good) through a table laid out `placements` on `mesh`:
    what each rank raised and how long the call took; then a good step, which runs only if the
    ranks' collectives still pair."""
    from torch.distributed.tensor import distribute_tensor

    item_weight = distribute_tensor(torch.as_tensor(table("float32")["item_weight"]).float(), mesh, placements)
    item_weight.requires_grad_(True)
    out = {}
    for name in (*BAD_BATCHES, "good"):
        pos = positions(rank, "float32")
        hidden, targets = torch.as_tensor(pos["hidden"]).float(), torch.as_tensor(pos["targets"]).clone()
        bad = name.removeprefix("special-")
        special = {"special_rows": tc.SpecialRows([0, -1])} if name.startswith("special-") else {}
        if rank == 1 and bad == "id-too-large":
            targets[2, 0] = V + 6
        elif rank == 1 and bad == "hidden-size":
            hidden = hidden[:, 1:]
        elif rank == 1 and bad == "float-targets":
            targets = targets.float()
        start = time.perf_counter()
        try:
            tc.cut_bce_with_logits(hidden, item_weight, targets, **special).backward()
            error = None
        except Exception as raised:  # noqa: BLE001 (the test checks type and message)
            error = (type(raised).__name__, str(raised))
        out[name] = {"error": error, "seconds": time.perf_counter() - start}
    return out
