"""A small FSDP2 model trained 3 SGD steps on P gloo ranks, and its one-process twin (tests/test_torch_dtensor.py).

The model: an item table (tied: also the input embedding; untied: a second table read only by the
loss), a Linear and tanh. Rank r trains on its own batch of step s; the twin trains one process
on the mean of the ranks' losses with dense BCE (or their sum, for a divide factor of 1). With
fewer items than ranks (V = P - 1: the last rank's table shard is empty) each step clips the
gradients' norm first, a collective over every rank's gradients.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import torch_cutbce as tc

V, D, STEPS, LR = 301, 16, 3, 0.5
CLIP_NORM = 0.5
VARIANTS = {  # name: tied, reshard_after_forward, microbatches, divide factor, param dtype, fewer items than ranks
    "tied-reshard": (True, True, 1, None, None, False),
    "tied-no-reshard": (True, False, 1, None, None, False),
    "untied-reshard": (False, True, 1, None, None, False),
    "untied-accumulate": (False, True, 2, None, None, False),
    "untied-divide-1": (False, True, 1, 1.0, None, False),
    "tied-bf16-params": (True, True, 1, None, torch.bfloat16, False),
    "untied-fewer-items-than-ranks": (False, True, 1, None, None, True),
    "tied-fewer-items-than-ranks": (True, True, 1, None, None, True),
    "triton-tied-reshard": (True, True, 1, None, None, False),  # backend='triton' (Triton's interpreter)
}


def backend(variant: str) -> str:
    """The loss's backend: 'triton' for the variants named so (the ranks interpret it), else 'auto'."""
    return "triton" if variant.startswith("triton-") else "auto"


def num_items(variant: str, world: int) -> int:
    return world - 1 if VARIANTS[variant][5] else V


class Model(nn.Module):
    def __init__(self, tied: bool, items: int = V):
        super().__init__()
        self.items = nn.Embedding(items, D)
        self.proj = nn.Linear(D, D)
        self.out = None if tied else nn.Embedding(items, D)

    def forward(self, ids):
        return torch.tanh(self.proj(self.items(ids)))

    def table(self):
        return self.items.weight if self.out is None else self.out.weight


def batch(rank: int, step: int, micro: int, items: int = V):
    """Rank `rank`'s batch: uneven sizes over the ranks, padded ids, duplicates."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    n = 6 + rank
    targets = torch.randint(-1, items, (n, 3), generator=g)
    targets[:, 2] = targets[:, 0]
    return torch.randint(0, items, (n,), generator=g), targets


def initial_model(tied: bool, items: int = V) -> Model:
    torch.manual_seed(0)
    return Model(tied, items)


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()


def fsdp_program(rank: int, world: int, variants: tuple[str, ...]) -> dict:
    """`train` for each variant: {variant: its result}."""
    return {variant: train(rank, world, variant) for variant in variants}


def train(rank: int, world: int, variant: str) -> dict:
    """3 SGD steps with FSDP2 on this rank; the parameters after them, whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    tied, reshard, micro, factor, param_dtype, clip = VARIANTS[variant]
    items = num_items(variant, world)
    model = initial_model(tied, items)
    mesh = init_device_mesh("cpu", (world,))
    # reduce_dtype only with param_dtype: FSDP2 (torch 2.9) fails on a module never called in forward
    # (the untied table) when reduce_dtype is set alone.
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype and torch.float32)
    for module in (model.items, model.out):
        if module is not None:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if factor is not None:
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(factor)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    read_sharded, with_grad = [], []
    for step in range(STEPS):
        for m in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            ids, targets = batch(rank, step, m, items)
            hidden = model(ids)
            table = model.table()
            read_sharded.append(type(table).__name__ == "DTensor")
            (tc.cut_bce_with_logits(hidden, table, targets, backend=backend(variant)) / micro).backward()
        # Every parameter has a gradient on every rank: the next collective over them (this clip,
        # full_tensor(), a DTensor-aware optimizer) then runs on every rank.
        with_grad.append(all(p.grad is not None for p in model.parameters()))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {"params": {n: _full(p) for n, p in model.named_parameters()}, "read_sharded": read_sharded,
            "with_grad": with_grad}


def one_process(variant: str, world: int) -> dict:
    """The twin: one process, dense BCE, on the mean (or, for factor 1, the sum) of the ranks' losses."""
    tied, _, micro, factor, _, clip = VARIANTS[variant]
    items = num_items(variant, world)
    model = initial_model(tied, items)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scale = 1.0 if factor == 1.0 else 1.0 / world
    for step in range(STEPS):
        for m in range(micro):
            losses = [tc.dense_bce_with_logits(model(ids), model.table(), targets)
                      for ids, targets in (batch(r, step, m, items) for r in range(world))]
            (sum(losses) * scale / micro).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in copy.deepcopy(model).named_parameters()}
