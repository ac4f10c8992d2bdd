"""The TorchTPU bridge (torch_cutbce/jax_bridge/tpu.py) checked without a TPU: meta tensors and
libtpu's compile-only client.

Runs only in the TorchTPU environment (ci/torch_tpu.sh: torch 2.13, torch_tpu, jax 0.10.2,
libtpu), in a pytest process of its own: TorchTPU autoloads through an entry point when torch is
imported, so TORCH_DEVICE_BACKEND_AUTOLOAD=0 must be set before the first `import torch` of the
process (here, at module top; the CI script sets it too). Elsewhere the module skips.

What holds here: every op passes `torch.library.opcheck`; the table's fakes agree with the
StableHLO TorchTPU would run (`jax_op`'s export for TPU); `cut_bce_with_logits(backend='torch_tpu')`
on meta tensors gives the loss and gradients their shapes and dtypes for every option and
reduction; a SASRec step holding the loss compiles with `torch.compile(fullgraph=True,
backend='aot_eager')` and exports with `torch.export`, one node per op; each op's StableHLO compiles
for v5e, v6e and tpu7x. Values are not checked: nothing runs on a TPU here.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # before torch (module docstring)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tracing and export need no TPU runtime here

import pytest  # noqa: E402

pytest.importorskip("torch_tpu", reason="needs torch_tpu: the TorchTPU environment, ci/torch_tpu.sh")

import torch  # noqa: E402

if "torch_tpu" not in sys.modules and os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] != "0":
    pytest.skip("torch was imported with TorchTPU's autoload on: run this file in its own pytest process "
                "with TORCH_DEVICE_BACKEND_AUTOLOAD=0", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import torch_cutbce as tc  # noqa: E402
from cutbce_common.focal import Focal  # noqa: E402
from cutbce_common.loss import Loss  # noqa: E402
from cutbce_common.options import CutBCEOptions  # noqa: E402
from torch_cutbce.jax_bridge import tpu as tpu_bridge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N, V, D, L = 16, 256, 128, 3
OPS = {"rows": tpu_bridge.rows, "rows_backward": tpu_bridge.rows_backward, "weighted_sum": tpu_bridge.weighted_sum}

OPTIONS = {
    "plain": CutBCEOptions(),
    "metrics": CutBCEOptions(compute_metrics=True, block_v=128),
    "focal": CutBCEOptions(loss=Loss(Focal(2.0, 0.25, False))),
    "focal balanced, metrics": CutBCEOptions(compute_metrics=True, loss=Loss(Focal(2.0, 0.25, True))),
    "label smoothing, focal": CutBCEOptions(loss=Loss(Focal(1.5, 0.25, True), label_smoothing=0.1)),
    "blocked": CutBCEOptions(impl="blocked", block_v=128),
}


def _meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def _op_args(op: str, options: CutBCEOptions, dtype=torch.float32, bias=True, weights=True):
    """The op's arguments on meta tensors (int32 ids, as the entries pass them)."""
    vec = lambda: _meta(V) if weights else None  # noqa: E731
    args = [_meta(N, D, dtype=dtype), _meta(V, D, dtype=dtype), _meta(N, L, dtype=torch.int32),
            _meta(V, dtype=dtype) if bias else None, vec(), vec()]
    extra = [] if op == "rows" else [_meta(N)]
    return args + extra + [options.encode()]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("name", ["plain", "focal balanced, metrics"])
def test_opcheck(op, name):
    args = _op_args(op, OPTIONS[name])
    if op != "rows_backward":  # its inputs need no gradient: it is a backward
        for i in (0, 1, 3):
            args[i].requires_grad_(True)
    torch.library.opcheck(OPS[op], tuple(args))


def _exported_avals(op: str, args):
    """The output avals of the StableHLO TorchTPU runs for `args` (`jax_op`'s `JaxCallable.exported`)."""
    to_jax = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
              torch.int32: jnp.int32}
    structs = [None if a is None else jax.ShapeDtypeStruct(tuple(a.shape), to_jax[a.dtype]) for a in args[:-1]]
    return OPS[op]._init_fn.exported(*structs, args[-1]).out_avals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("op", list(OPS))
def test_fakes_match_the_export(op, name, dtype):
    """The table's shape rules (the ops' fakes) against the export TorchTPU's default fake reads."""
    if dtype == torch.float16 and OPTIONS[name].impl == "auto":
        pytest.skip("float16 on a TPU: 'auto' is the blocked loop, covered by the 'blocked' options")
    for bias in (True, False):
        args = _op_args(op, OPTIONS[name], dtype, bias=bias, weights=bias)
        fake = OPS[op]._abstract_fn(*args)
        avals = _exported_avals(op, args)
        assert len(fake) == len(avals), (fake, avals)
        for f, a in zip(fake, avals):
            assert tuple(f.shape) == a.shape and str(f.dtype).removeprefix("torch.") == str(a.dtype), (f, a)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("name", ["plain", "bias", "weights", "all"])
@pytest.mark.parametrize("focal", [None, Focal(2.0, 0.25, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_loss_and_gradients(reduction, name, focal, dtype):
    bias = name in ("bias", "all")
    weights = name in ("weights", "all")
    hidden = _meta(4, 5, D, dtype=dtype, grad=True)
    items = _meta(V, D, dtype=dtype, grad=True)
    b = _meta(V, grad=True) if bias else None
    weight = _meta(4, 5, grad=True) if weights else None
    loss, metrics = tc.cut_bce_with_logits(
        hidden, items, torch.empty(4, 5, L, dtype=torch.int64, device="meta"), b, weight=weight,
        class_weight=_meta(V) if weights else None, pos_weight=_meta(V) if weights else None,
        reduction=reduction, return_metrics=True, focal=focal, backend="torch_tpu")
    assert loss.device.type == "meta" and loss.dtype == torch.float32
    assert loss.shape == ((4, 5) if reduction == "none" else ())
    assert metrics.tp.shape == loss.shape
    loss.sum().backward()
    leaves = [hidden, items] + [t for t in (b, weight) if t is not None]
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, t


def test_auto_picks_the_bridge_for_tpu_tensors_and_refuses_other_devices():
    from torch_cutbce import engines

    assert engines.resolve_backend("auto", torch.empty(1, device="meta")) == "native"
    assert "torch_tpu" in tc.BACKENDS
    with pytest.raises(ValueError, match="backend='torch_tpu' needs tensors on a TorchTPU device"):
        tc.cut_bce_with_logits(torch.zeros(2, D), torch.zeros(V, D), torch.zeros(2, 1, dtype=torch.long),
                               backend="torch_tpu")
    with pytest.raises(ValueError, match="mesh="):
        tc.cut_bce_with_logits(_meta(2, D), _meta(V, D), torch.empty(2, 1, dtype=torch.long, device="meta"),
                               backend="torch_tpu", mesh=object())


def _sasrec_step():
    """A SASRec training step's loss on meta tensors (its parameters on meta too)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from sasrec import RecConfig, SASRec

    with torch.device("meta"):
        model = SASRec(RecConfig(num_items=V, max_len=8, dim=D, num_layers=1, dropout=0.0))

    def step(items, targets, mask):
        hidden = model(items)
        return tc.cut_bce_with_logits(hidden, model.item_weight, targets, model.item_bias, weight=mask,
                                      backend="torch_tpu")

    items = torch.empty(2, 8, dtype=torch.int64, device="meta")
    targets = torch.empty(2, 8, L, dtype=torch.int64, device="meta")
    return model, step, (items, targets, _meta(2, 8))


def _op_nodes(graph) -> dict[str, int]:
    counts = {}
    for node in graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and "cutbce_tpu" in name:
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_sasrec_step_compiles_fullgraph_with_one_node_per_op():
    model, step, args = _sasrec_step()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def counting(gm_inner, _):
            graphs.append(gm_inner)
            return make_boxed_func(gm_inner.forward)

        return aot_autograd(fw_compiler=counting, bw_compiler=counting)(gm, example_inputs)

    loss = torch.compile(step, fullgraph=True, backend=backend)(*args)
    loss.backward()
    assert loss.shape == () and model.item_emb.weight.grad.shape == model.item_emb.weight.shape
    dynamo_nodes = _op_nodes(graphs[0].graph)
    assert dynamo_nodes == {"cutbce_tpu.weighted_sum.default": 1}, dynamo_nodes
    aot_forward = _op_nodes(graphs[1].graph)
    assert aot_forward == {"cutbce_tpu.weighted_sum.default": 1}, aot_forward
    # And with the aot_eager backend itself, as users call it.
    torch._dynamo.reset()
    assert torch.compile(step, fullgraph=True, backend="aot_eager")(*args).shape == ()


def test_sasrec_step_exports_with_one_node_per_op():
    model, step, args = _sasrec_step()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, items, targets, mask):
            return step(items, targets, mask)

    exported = torch.export.export(Step(), args)
    assert _op_nodes(exported.graph) == {"cutbce_tpu.weighted_sum.default": 1}, exported.graph
    rows_step = lambda items, targets, mask: tc.cut_bce_with_logits(  # noqa: E731
        model(items), model.item_weight, targets, model.item_bias, backend="torch_tpu", reduction="none")

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, items, targets, mask):
            return rows_step(items, targets, mask)

    exported = torch.export.export(Rows(), args)
    assert _op_nodes(exported.graph) == {"cutbce_tpu.rows.default": 1}, exported.graph


def test_each_op_compiles_for_v5e_v6e_tpu7x(tmp_path):
    """benchmarks/tpu_bridge_hbm.py on small shapes in a child (the compile-only client needs
    JAX's TPU plugin, which this process keeps off): every op compiles for every chip, through
    both bridges' lowerings, with sane memory figures."""
    out = tmp_path / "hbm.csv"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu_bridge_hbm.py"), "--n", "256", "--v",
                           "2048", "--d", "128", "--slots", "4", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["bridge"], r["op"], r["chip"]) for r in rows} == {
        (b, op, chip) for b in ("torch_tpu", "torch_xla") for op in OPS for chip in ("v5e", "v6e", "tpu7x")}
    for r in rows:
        assert r["status"] == "ok", r
        inputs = 256 * 128 * 2 + 2048 * 128 * 2  # bfloat16 hidden and table at least
        assert int(r["argument_bytes"]) >= inputs, r
        # No [N, V] buffer: temporaries stay below the logits' float32 size.
        assert 0 <= int(r["temp_bytes"]) < 256 * 2048 * 4, r
