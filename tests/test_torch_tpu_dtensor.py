"""Multi-chip TorchTPU off a TPU: an FSDP2-sharded item table through `backend='torch_tpu'`.

A SASRec-like step (an item encoder: input Embedding, Linear, tanh) whose loss reads an item table
(`weight [V, D]`, `bias [V]`) that FSDP2's `fully_shard` laid out `Shard(0)` over a 1-D DeviceMesh
of P = 4 ranks, traced on `meta` tensors under torch's fake process group (rank 0: the full
ceil(V / P) rows; rank 3: the short last shard). The loss's forward and backward are recorded op by
op (a TorchDispatchMode; the encoder runs outside it, across a detach boundary, since its own input
Embedding is a `[V, D]` table by design) and must hold exactly, in this order:

    all_gather      hidden   [n, D]    -> [P n, D]
    all_gather      targets  [n, L]    -> [P n, L]
    cutbce_tpu::rows           hidden [P n, D], the LOCAL table [V_r, D], bias [V_r]
    reduce_scatter  rows (and counts)  [P n, 1 or 5] -> [n, 1 or 5]
    all_gather      the rows' gradient [n]          -> [P n]
    cutbce_tpu::rows_backward  -> d_hidden [P n, D], d_table [V_r, D], d_bias [V_r]
    reduce_scatter  d_hidden [P n, D]  -> [n, D]

and nothing else that communicates or calls a TorchTPU op; no tensor has a dimension of V or more
elements than the local table shard (no gather of the table, no `[N, V]` logits, not even this
rank's `[P n, V_r]`); the table's gradient is a Shard(0) DTensor of the local shape. Then the two
per-chip ops, with the options string the trace passed them, are compiled for v5e, v6e and tpu7x
at both local table shapes with libtpu's compile-only client (in a child: that client needs JAX's
TPU plugin, which this process keeps off), and the exported output shapes must be the traced ones.

What does not work on meta under the fake process group, and so is not done here: a `"meta"`
DeviceMesh (`fully_shard` asks its device handle for a current device: None for meta), hence a
`"cpu"` mesh with meta parameters; and FSDP2's forward of a module on meta (its lazy init refuses
meta parameters; past that check its all-gather would allocate on the mesh's device), hence the
table module is `fully_shard`-ed but never called, the untied layout (its parameters stay sharded
DTensors, and the loss reads them as FSDP2 leaves them); the encoder stays plain.

Runs only in the TorchTPU environment (ci/torch_tpu.sh), in a pytest process of its own, as
tests/test_torch_tpu_bridge.py:
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONPATH=. .venv-tpu/bin/python -m pytest tests/test_torch_tpu_dtensor.py
Elsewhere the module skips.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # before torch (as test_torch_tpu_bridge.py)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tracing and export need no TPU runtime here

import pytest  # noqa: E402

pytest.importorskip("torch_tpu", reason="needs torch_tpu: the TorchTPU environment, ci/torch_tpu.sh")

import torch  # noqa: E402

if "torch_tpu" not in sys.modules and os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] != "0":
    pytest.skip("torch was imported with TorchTPU's autoload on: run this file in its own pytest process "
                "with TORCH_DEVICE_BACKEND_AUTOLOAD=0", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not built", allow_module_level=True)

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import torch_cutbce as tc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
P, V, D, B, T, L = 4, 1001, 64, 2, 10, 3  # V uneven over P; P n = 80 differs from D, V_r and L
N_LOCAL = B * T  # this rank's positions
N_ALL = P * N_LOCAL  # the positions each rank scores against its rows
CHUNK = -(-V // P)  # torch.chunk's rows per rank: 251
LOCAL_ROWS = {0: CHUNK, 3: V - 3 * CHUNK}  # rank 3 holds the short shard: 248
ALL_GATHER, REDUCE_SCATTER = "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"
ROWS, ROWS_BACKWARD = "cutbce_tpu.rows.default", "cutbce_tpu.rows_backward.default"
COLLECTIVE_WORDS = ("c10d.", "_c10d_functional", "all_reduce", "allreduce", "all_gather", "allgather",
                    "reduce_scatter", "broadcast", "all_to_all", "alltoall", "send", "recv")


class ItemTable(nn.Module):
    """The catalog the loss scores against: vectors and a score offset per item."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(V, D))
        self.bias = nn.Parameter(torch.empty(V))


class Encoder(nn.Module):
    """SASRec's shape without attention: item ids `[B, T]` -> hidden states `[B, T, D]`."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)

    def forward(self, ids):
        return torch.tanh(self.proj(self.items(ids)))


def _held_shape(x) -> tuple[int, ...]:
    """The shape of what this rank holds: a DTensor's local part (a mode sees DTensor-level ops too,
    e.g. the detach of AccumulateGrad on the table's gradient, with the global shape)."""
    from torch.distributed.tensor import DTensor

    return tuple((x.to_local() if isinstance(x, DTensor) else x).shape)


class Recorder(TorchDispatchMode):
    """Every op dispatched: `(name, input shapes, output shapes, string arguments)`, tensors in
    argument order (a c10d op's output buffer first, as its schema has it), DTensors by their local
    shape."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs or {}))
        self.ops.append((str(func), [_held_shape(x) for x in leaves if isinstance(x, torch.Tensor)],
                         [_held_shape(x) for x in tree_leaves(out) if isinstance(x, torch.Tensor)],
                         [x for x in leaves if isinstance(x, str)]))
        return out


@functools.lru_cache(maxsize=None)
def trace(rank: int, return_metrics: bool) -> dict:
    """One training step on meta tensors as mesh rank `rank` of P under the fake process group:
    the recorded ops of the loss's forward and backward, and what the step left behind."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=P)
    try:
        mesh = init_device_mesh("cpu", (P,))  # a "meta" mesh: fully_shard finds no device handle
        with torch.device("meta"):
            encoder, table = Encoder(), ItemTable()
        fully_shard(table, mesh=mesh)  # FSDP2's Shard(0) parameters (never called: the untied layout)
        ids = torch.empty(B, T, dtype=torch.int64, device="meta")
        targets = torch.empty(B, T, L, dtype=torch.int64, device="meta")
        hidden = encoder(ids)
        h = hidden.detach().requires_grad_(True)  # the loss's part of the step, recorded alone
        recorder = Recorder()
        with recorder:
            out = tc.cut_bce_with_logits(h, table.weight, targets, table.bias, backend="torch_tpu",
                                         reduction="mean", return_metrics=return_metrics)
            loss = out[0] if return_metrics else out
            loss.backward()
        hidden.backward(h.grad)  # the encoder's part
        return dict(ops=recorder.ops, loss=loss, metrics=out[1] if return_metrics else None, d_hidden=h.grad,
                    table=table, encoder=encoder)
    finally:
        dist.destroy_process_group()


CASES = [(rank, metrics) for rank in LOCAL_ROWS for metrics in (False, True)]
IDS = [f"rank{rank}-{'metrics' if metrics else 'loss'}" for rank, metrics in CASES]


def _is_collective(name: str) -> bool:
    return any(word in name for word in COLLECTIVE_WORDS)


@pytest.mark.parametrize("rank, metrics", CASES, ids=IDS)
def test_fsdp2_table_is_sharded_on_meta(rank, metrics):
    from torch.distributed.tensor import DTensor, Shard

    table = trace(rank, metrics)["table"]
    for p, shape in ((table.weight, (LOCAL_ROWS[rank], D)), (table.bias, (LOCAL_ROWS[rank],))):
        assert isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),), p
        assert p.shape[0] == V and tuple(p.to_local().shape) == shape and p.to_local().device.type == "meta"


@pytest.mark.parametrize("rank, metrics", CASES, ids=IDS)
def test_step_runs_the_per_chip_ops_between_the_collectives(rank, metrics):
    ops = trace(rank, metrics)["ops"]
    rows, c = LOCAL_ROWS[rank], 5 if metrics else 1  # the reduce-scattered columns: rows (+ 4 counts)
    seen = [(name, ins, outs) for name, ins, outs, _ in ops if _is_collective(name) or "cutbce_tpu" in name]
    expected = [
        (ALL_GATHER, [(N_ALL, D), (N_LOCAL, D)]),  # hidden (output buffer first)
        (ALL_GATHER, [(N_ALL, L), (N_LOCAL, L)]),  # targets
        (ROWS, [(N_ALL, D), (rows, D), (N_ALL, L), (rows,)]),  # no class / position weights: None
        (REDUCE_SCATTER, [(N_LOCAL, c), (N_ALL, c)]),  # rows and counts
        # backward
        (ALL_GATHER, [(N_ALL,), (N_LOCAL,)]),  # the rows' gradient (the counts have none)
        (ROWS_BACKWARD, [(N_ALL, D), (rows, D), (N_ALL, L), (rows,), (N_ALL,)]),
        (REDUCE_SCATTER, [(N_LOCAL, D), (N_ALL, D)]),  # d_hidden
    ]
    assert [(name, ins) for name, ins, _ in seen] == expected, "\n".join(map(str, seen))
    outputs = {name: outs for name, _, outs in seen if "cutbce_tpu" in name}
    assert outputs[ROWS] == [(N_ALL,), (4 if metrics else 0, N_ALL)], outputs
    assert outputs[ROWS_BACKWARD] == [(N_ALL, D), (rows, D), (rows,)], outputs


@pytest.mark.parametrize("rank, metrics", CASES, ids=IDS)
def test_no_op_sees_the_whole_table_or_the_logits(rank, metrics):
    """No dimension of V (no gather of the table or of its gradient, no `[N, V]` logits) and nothing
    larger than the local table shard (not even this rank's `[P n, V_r]` logits of its rows)."""
    ops = trace(rank, metrics)["ops"]
    limit = LOCAL_ROWS[rank] * D
    assert limit < N_ALL * LOCAL_ROWS[rank]  # the bound does exclude the local logits
    for name, ins, outs, _ in ops:
        for shape in ins + outs:
            assert V not in shape, (name, ins, outs)
            assert torch.Size(shape).numel() <= limit, (name, ins, outs)


@pytest.mark.parametrize("rank, metrics", CASES, ids=IDS)
def test_gradients_keep_the_layout(rank, metrics):
    from torch.distributed.tensor import DTensor, Shard

    step = trace(rank, metrics)
    assert step["loss"].shape == () and step["loss"].device.type == "meta"
    if metrics:
        assert all(x.shape == () for x in step["metrics"])
    assert step["d_hidden"].shape == (B, T, D)
    table = step["table"]
    for p, shape in ((table.weight, (LOCAL_ROWS[rank], D)), (table.bias, (LOCAL_ROWS[rank],))):
        g = p.grad
        assert isinstance(g, DTensor) and tuple(g.placements) == (Shard(0),) and g.device_mesh == p.device_mesh, g
        assert g.shape == p.shape and tuple(g.to_local().shape) == shape, g
    assert all(p.grad is not None and p.grad.shape == p.shape for p in step["encoder"].parameters())


# The compile-only child: each (chip, local table rows, op, options) compiled from the StableHLO
# TorchTPU would run (`jax_op`'s export for TPU), with the options strings the trace passed. It
# imports benchmarks/tpu_bridge_hbm.py first, which drops JAX_PLATFORMS and allows a second libtpu
# load (a compile-only client guards no chip).
_COMPILE = r"""
import dataclasses, json, sys
import benchmarks.tpu_bridge_hbm as hbm
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from benchmarks.tpu_compile import compile_for
from torch_cutbce.jax_bridge import tpu as tpu_bridge

spec = json.loads(sys.argv[1])
n, d, slots = spec["n"], spec["d"], spec["slots"]
out = []
for chip in spec["chips"]:
    topo = topologies.get_topology_desc(topology_name=hbm.TOPOLOGIES[chip], platform="tpu")
    on_chip = NamedSharding(Mesh(topo.devices[:1], ("x",)), PartitionSpec())
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_chip)
    for v in spec["rows"]:
        for op, options in spec["ops"]:
            args = [s((n, d), jnp.float32), s((v, d), jnp.float32), s((n, slots), jnp.int32),
                    s((v,), jnp.float32), None, None] + ([s((n,), jnp.float32)] if op != "rows" else [])
            exported = getattr(tpu_bridge, op)._init_fn.exported(*args, options)
            result = compile_for(chip, exported.call, *args)
            out.append(dict(op=op, options=options, v=v, out_shapes=[list(a.shape) for a in exported.out_avals],
                            **dataclasses.asdict(result)))
            print(chip, v, op, result, file=sys.stderr, flush=True)
print("RESULT " + json.dumps(out))
"""


def test_per_chip_ops_compile_for_tpu_at_the_local_shapes():
    """rows and rows_backward at [P n] positions against each local table shape (V_r = 251 and 248),
    with and without metrics, for v5e, v6e and tpu7x: 24 compile-only builds in one child (about
    45 s here, a third of it the child's start)."""
    ops, traced = [], {}
    for rank, metrics in CASES:
        for name, _, outs, strings in trace(rank, metrics)["ops"]:
            if name in (ROWS, ROWS_BACKWARD):
                (options,) = strings  # the op's one string argument
                assert json.loads(options)["compute_metrics"] is metrics
                op = name.split(".")[1]
                if [op, options] not in ops:
                    ops.append([op, options])
                traced[(op, options, LOCAL_ROWS[rank])] = [list(s) for s in outs]
    assert len(ops) == 4, ops  # rows and rows_backward, one options string per metrics setting
    chips = ["v5e", "v6e", "tpu7x"]
    spec = dict(n=N_ALL, d=D, slots=L, rows=sorted(LOCAL_ROWS.values()), chips=chips, ops=ops)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # the child needs the TPU plugin
    env.update(PYTHONPATH=str(ROOT), ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    results = json.loads(lines[-1].removeprefix("RESULT "))
    assert {(r["chip"], r["v"], r["op"], r["options"]) for r in results} == {
        (chip, v, op, options) for chip in chips for v in LOCAL_ROWS.values() for op, options in ops}
    for r in results:
        assert r["error"] is None, r
        # The export's output shapes (what TorchTPU runs) are the traced ones (the ops' fakes).
        assert r["out_shapes"] == traced[(r["op"], r["options"], r["v"])], r
