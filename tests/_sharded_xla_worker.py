"""Subprocess side of tests/test_torch_sharded.py: torch_xla SPMD on 4 CPU devices.

Run as `python tests/_sharded_xla_worker.py OUT.json DUMP_DIR` with PJRT_DEVICE=CPU,
CPU_NUM_DEVICES=4 and XLA_FLAGS="--xla_dump_to=DUMP_DIR --xla_dump_hlo_as_text" (set by the test:
`use_spmd()` must run before any XLA tensor exists, and the dump is how the partitioned program is
read back). Three things are measured against the native CPU path, with the table marked sharded
along V and the positions along 'data':

- `plain`: the existing bridge (`cut_bce_with_logits(backend='xla')`) unchanged. Its `call_jax`
  computation carries no sharding, so the SPMD partitioner is free to choose, and it all-gathers the
  whole table before the tile loop (exact, but every device loops over all V).
- `sharded_*`: the bridge proposed below, whose `call_jax` function is `jax_kernels.sharded`'s
  shard_map over an `AbstractMesh` of the same shape. Its manual-sharding annotations survive into
  the torch_xla graph, so each device loops over its own V / shards rows and the collectives are
  the shard_map's psums.
- `one_pass`: `cut_bce_with_logits(mesh=)` itself on a 2 x 2 mesh, every option on, per reduction:
  its results (the test compares them with the float64 oracle) and the partitioned program's
  facts ('mean' / 'sum': the one-pass op, one tile loop; 'none': forward and backward loops).

For each case the report holds relative errors (rows, counts, gradients of `sum(rows * g)` for a
random g) and facts read from the partitioned HLO. The custom ops below are the code proposed for
`torch_cutbce/jax_bridge/xla.py` (namespace `cutbce_sharded_proposal` here, to avoid clashing).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_builder as xb  # noqa: F401 (before jax: torch_xla's JAX interop)
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla._internal.jax_workarounds import jax_import_guard

jax_import_guard()

import jax  # noqa: E402, F401 (imported after torch_xla, as call_jax needs)

from torch_cutbce.jax_bridge import xla as xla_bridge  # noqa: E402

N, V, D, L = 45, 301, 12, 5  # 45 positions over 2 or 4 data shards and 301 items over 2 or 4: all padded
BLOCK_V = 16
# name -> (torch_xla mesh shape, axis names, vocab_axis, data_axis); 8 x 1 is covered on the JAX side.
CASES = {
    "sharded_1x4": ((1, 4), ("data", "model"), "model", "data"),
    "sharded_2x2": ((2, 2), ("data", "model"), "model", "data"),
}
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def _options(compute_metrics, mesh=None, vocab_axis=None, data_axis=None):
    """The engines' `CutBCEOptions`: `BLOCK_V` tiles, the blocked JAX loop behind the bridge."""
    from cutbce_common.options import CutBCEOptions
    from torch_cutbce.arguments import mesh_layout

    return CutBCEOptions(block_v=BLOCK_V, compute_metrics=compute_metrics, impl="blocked",
                         **mesh_layout(mesh, vocab_axis, data_axis))


# ---- the measurements ------------------------------------------------------------------------


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g) * 2
    hidden[2] *= 40
    targets = torch.randint(-1, V, (N, L), generator=g)
    targets[:, 1] = targets[:, 0]
    targets[0] = -1
    targets[1, :3] = V - 1
    return dict(
        hidden=hidden, item_weight=torch.randn(V, D, generator=g), bias=torch.randn(V, generator=g),
        targets=targets, class_weight=torch.rand(V, generator=g) + 0.5, pos_weight=torch.rand(V, generator=g) * 3 + 0.25,
        upstream=torch.randn(N, generator=torch.Generator().manual_seed(1)),
    )


def _native(inputs):
    from torch_cutbce.native import ops

    h, e, b = (inputs[k].clone().requires_grad_(True) for k in ("hidden", "item_weight", "bias"))
    rows, counts = ops.rows(h, e, inputs["targets"], b, inputs["class_weight"], inputs["pos_weight"], _options(True))
    (rows * inputs["upstream"]).sum().backward()
    return {"rows": rows.detach(), "counts": counts, "d_hidden": h.grad, "d_item_weight": e.grad, "d_bias": b.grad}


def _on_mesh(inputs, mesh_shape, axis_names, rows_fn):
    device = torch_xla.device()
    mesh = xs.Mesh(np.arange(int(np.prod(mesh_shape))), mesh_shape, axis_names)
    t = {k: v.to(device) for k, v in inputs.items()}
    for k in ("hidden", "item_weight", "bias"):
        t[k].requires_grad_(True)
    # What a user of torch_xla SPMD writes: the table split along V, the positions along 'data'.
    xs.mark_sharding(t["item_weight"], mesh, ("model", None))
    xs.mark_sharding(t["bias"], mesh, ("model",))
    xs.mark_sharding(t["hidden"], mesh, ("data", None))
    rows, counts = rows_fn(t, mesh)
    (rows * t["upstream"]).sum().backward()
    out = [rows, counts, t["hidden"].grad, t["item_weight"].grad, t["bias"].grad]
    torch_xla.sync()  # one graph: forward and backward
    names = ("rows", "counts", "d_hidden", "d_item_weight", "d_bias")
    return {k: v.detach().cpu() for k, v in zip(names, out)}


def _plain_rows(t, mesh):
    from torch_cutbce.jax_bridge import xla as xla_bridge

    return xla_bridge.cut_bce_rows(
        t["hidden"], t["item_weight"], t["targets"], t["bias"], t["class_weight"], t["pos_weight"], _options(True),
    )


def _hlo_facts(dump_dir):
    """Collectives and the table's shape inside the tile loops, from the partitioned, optimized HLO."""
    texts = [open(p).read() for p in sorted(glob.glob(os.path.join(dump_dir, "*SyncTensorsGraph*after_optimizations.txt")))]
    text = "\n".join(texts)
    kinds = [m.group(1) for m in COLLECTIVE.finditer(text)]
    gathers = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", text)
    # A while loop's carried tuple type lists every array the loop reads, the table slice included.
    carried = " ".join(line.split(" while(")[0] for line in text.splitlines() if " while(" in line)
    return {"modules": len(texts), "collectives": {k: kinds.count(k) for k in sorted(set(kinds))},
            "while_loops": len(re.findall(r" while\(", text)),
            "gathered_shapes": sorted(set(gathers)), "loop_shapes": sorted(set(re.findall(r"f32\[\d+,\d+\]", carried)))}


def _errors(out, ref):
    from parity import relative_error

    return {k: relative_error(out[k], ref[k])[0] for k in ref}


def _measure(rows_fn, mesh_shape, axis_names, inputs, reference, dump_dir, vocab_shards):
    shutil.rmtree(dump_dir, ignore_errors=True)
    out = _on_mesh(inputs, mesh_shape, axis_names, rows_fn)
    return {"errors": _errors(out, reference), "hlo": _hlo_facts(dump_dir), "vocab_shards": vocab_shards}


class _TinyRecommender(torch.nn.Module):
    """A tied item table with a padding row 0, as examples/sasrec.py has: item_weight = rows 1..V."""

    def __init__(self):
        super().__init__()
        self.items = torch.nn.Embedding(V + 1, D, padding_idx=0)
        self.mix = torch.nn.Linear(D, D)
        self.item_bias = torch.nn.Parameter(torch.zeros(V))

    def forward(self, item_ids):
        return torch.tanh(self.mix(self.items(item_ids)))


def _train(device, rows_fn, mesh=None, steps=5):
    """Adam steps on the mean loss; with a mesh the table is split along V and the batch along 'data'."""
    torch.manual_seed(0)
    model = _TinyRecommender().to(device)
    if mesh is not None:
        xs.mark_sharding(model.items.weight, mesh, ("model", None))
        xs.mark_sharding(model.item_bias, mesh, ("model",))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = _inputs()
    item_ids = torch.randint(1, V + 1, (N,), generator=torch.Generator().manual_seed(3)).to(device)
    targets = inputs["targets"].to(device)
    if mesh is not None:
        xs.mark_sharding(item_ids, mesh, ("data",))
    for _ in range(steps):
        opt.zero_grad()
        hidden = model(item_ids)
        rows, _ = rows_fn(hidden, model.items.weight[1:], model.item_bias, targets, mesh)
        loss = rows.sum() / (N * V)
        loss.backward()
        opt.step()
        if mesh is not None:
            torch_xla.sync()
    return [p.detach().cpu() for p in model.parameters()]


def _native_rows(hidden, item_weight, bias, targets, mesh):
    from torch_cutbce.native import ops

    return ops.rows(hidden, item_weight, targets, bias, None, None, _options(False))


def _sharded_rows(hidden, item_weight, bias, targets, mesh):
    return xla_bridge.cut_bce_rows(hidden, item_weight, targets, bias, None, None,
                                   _options(False, mesh, vocab_axis="model", data_axis="data"))


def _measure_training(dump_dir):
    from parity import relative_error

    reference = _train("cpu", _native_rows)
    shutil.rmtree(dump_dir, ignore_errors=True)
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    params = _train(torch_xla.device(), _sharded_rows, mesh)
    errors = {f"param{i}": relative_error(a, b)[0] for i, (a, b) in enumerate(zip(params, reference))}
    return {"errors": errors, "hlo": _hlo_facts(dump_dir)}


def _measure_without_bias(inputs):
    """A bias-free call; run before and after the bias ones, its cached lowering must still unflatten."""
    from parity import relative_error
    from torch_cutbce.native import ops

    h = inputs["hidden"].clone().requires_grad_(True)
    rows, _ = ops.rows(h, inputs["item_weight"], inputs["targets"], None, None, None, _options(False))
    (rows * inputs["upstream"]).sum().backward()
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    hx = inputs["hidden"].to(torch_xla.device()).requires_grad_(True)
    rows_x, _ = xla_bridge.cut_bce_rows(
        hx, inputs["item_weight"].to(hx.device), inputs["targets"].to(hx.device), None, None, None,
        _options(False, mesh, vocab_axis="model", data_axis="data"),
    )
    (rows_x * inputs["upstream"].to(hx.device)).sum().backward()
    torch_xla.sync()
    return {"errors": {"rows": relative_error(rows_x.detach().cpu(), rows.detach())[0],
                       "d_hidden": relative_error(hx.grad.cpu(), h.grad)[0]}}


# cut_bce_with_logits(mesh=) on a 2 x 2 mesh, every option on: 'mean' / 'sum' take the one-pass op
# (cutbce::xla_weighted_sum over sharded_value_and_grad), 'none' forward then backward. Variant ->
# (reduction, a `conformance_engines.LOSSES` name): plain BCE, and label smoothing with balanced focal.
SMOOTHED = "smoothing0.2-focal1.5-balanced"
ONE_PASS = {"shape": (N, V, D, L), "seed": 5,
            "variants": {"mean": ("mean", "plain"), "sum": ("sum", "plain"), "none": ("none", "plain"),
                         f"mean-{SMOOTHED}": ("mean", SMOOTHED), f"none-{SMOOTHED}": ("none", SMOOTHED)}}


def _measure_one_pass(dump_dir):
    """Loss, metrics and gradients (wrt parity.GRADS, for parity.make_upstream) of each variant,
    for the test to compare with the float64 oracle, and the partitioned program's facts."""
    import torch_cutbce as tc
    from conformance_engines import LOSSES
    from parity import GRADS, METRIC_NAMES, make_inputs, make_upstream, select

    n, v, d, slots = ONE_PASS["shape"]
    inputs = select(make_inputs((n,), v, d, slots, seed=ONE_PASS["seed"]), dtype="float32")
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    device = torch_xla.device()
    report = {}
    for variant, (reduction, loss_name) in ONE_PASS["variants"].items():
        shutil.rmtree(dump_dir, ignore_errors=True)
        t = {k: torch.tensor(x if k == "targets" else np.float32(x)).to(device) for k, x in inputs.items()}
        for k in GRADS:
            t[k].requires_grad_(True)
        xs.mark_sharding(t["item_weight"], mesh, ("model", None))
        for k in ("bias", "class_weight", "pos_weight"):
            xs.mark_sharding(t[k], mesh, ("model",))
        xs.mark_sharding(t["hidden"], mesh, ("data", None))
        xs.mark_sharding(t["weight"], mesh, ("data",))
        loss, metrics = tc.cut_bce_with_logits(
            t["hidden"], t["item_weight"], t["targets"], t["bias"], weight=t["weight"],
            class_weight=t["class_weight"], pos_weight=t["pos_weight"], reduction=reduction, return_metrics=True,
            block_v=BLOCK_V, backend="xla_blocked", mesh=mesh, vocab_axis="model", data_axis="data",
            **LOSSES[loss_name].arguments(),
        )
        upstream = torch.tensor(np.float32(make_upstream(reduction, (n,), seed=ONE_PASS["seed"], dtype="float32")))
        grads = torch.autograd.grad(loss, [t[k] for k in GRADS], grad_outputs=upstream.to(device))
        values = dict(zip(("loss", *METRIC_NAMES, *(f"d_{k}" for k in GRADS)), (loss, *metrics, *grads)))
        torch_xla.sync()  # one program: forward and backward
        report[variant] = {"reduction": reduction, "loss": loss_name, "hlo": _hlo_facts(dump_dir),
                           "results": {k: x.detach().cpu().double().tolist() for k, x in values.items()}}
    return {"shape": ONE_PASS["shape"], "seed": ONE_PASS["seed"], **report}


def main(out_path: str, dump_dir: str) -> None:
    xr.use_spmd()
    assert xr.global_runtime_device_count() == 4, xr.global_runtime_device_count()
    inputs = _inputs()
    reference = _native(inputs)
    report = {"sizes": {"N": N, "V": V, "D": D}}
    _measure_without_bias(inputs)  # lowered first, hit again last, after the variants with bias
    report["plain"] = _measure(_plain_rows, (2, 2), ("data", "model"), inputs, reference, dump_dir, 2)
    for name, (mesh_shape, axis_names, vocab_axis, data_axis) in CASES.items():
        def rows_fn(t, mesh, vocab_axis=vocab_axis, data_axis=data_axis):
            return xla_bridge.cut_bce_rows(
                t["hidden"], t["item_weight"], t["targets"], t["bias"], t["class_weight"], t["pos_weight"],
                _options(True, mesh, vocab_axis=vocab_axis, data_axis=data_axis),
            )

        shards = mesh_shape[axis_names.index(vocab_axis)]
        report[name] = _measure(rows_fn, mesh_shape, axis_names, inputs, reference, dump_dir, shards)
    report["train_2x2"] = _measure_training(dump_dir)
    report["no_bias_after_bias"] = _measure_without_bias(inputs)
    report["one_pass"] = _measure_one_pass(dump_dir)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
