"""Rung L3: the torch_xla bridge on PJRT_DEVICE=CPU against the native path, JAX and the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

# torch_xla first: it must be imported before jax (torch_xla's jax_import_guard).
torch_xla = pytest.importorskip("torch_xla", reason="needs torch_xla: pip install 'torch-cutbce[xla]'")
import torch_xla.debug.metrics as xla_metrics  # noqa: E402

import jax_kernels  # noqa: E402
import torch_cutbce as tc  # noqa: E402
from parity import assert_close, jax_x64  # noqa: E402
from torch_cutbce.jax_bridge import xla as xla_bridge  # noqa: E402

pytestmark = [pytest.mark.xla, pytest.mark.rung3]

N, V, D, L = 45, 301, 12, 5  # odd on purpose: no block divides them
BLOCK_V = 128


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64) * 2
    items = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    targets = torch.randint(-1, V, (N, L), generator=g)
    targets[:, 1] = targets[:, 0]  # duplicates
    targets[0] = -1  # a row with no positives
    targets[1, :3] = V - 1
    hidden[2] *= 40  # logits of magnitude ~50 and more
    weight = torch.rand(N, generator=g, dtype=torch.float64)
    weight[3] = 0  # a masked position
    class_weight = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    pos_weight = torch.rand(V, generator=g, dtype=torch.float64) * 3 + 0.25
    cast = lambda t: t.to(dtype)
    return dict(hidden=cast(hidden), item_weight=cast(items), bias=cast(bias), targets=targets,
                weight=cast(weight), class_weight=cast(class_weight), pos_weight=cast(pos_weight))


OPTIONS = {
    "plain": (),
    "bias": ("bias",),
    "weights": ("weight", "class_weight", "pos_weight"),
    "all": ("bias", "weight", "class_weight", "pos_weight"),
}


def _run(inputs, device, options, reduction, backend, grads=("hidden", "item_weight", "bias", "weight"), seed=1):
    """Loss, metrics and the gradients of `sum(loss * random upstream)`, all moved back to CPU."""
    args = {k: v.detach().clone().to(device) for k, v in inputs.items()}
    leaves = [k for k in grads if k in ("hidden", "item_weight") or k in options]
    for k in leaves:
        args[k].requires_grad_(True)
    kwargs = {k: args[k] for k in ("weight", "class_weight", "pos_weight") if k in options}
    loss, metrics = tc.cut_bce_with_logits(
        args["hidden"], args["item_weight"], args["targets"], args["bias"] if "bias" in options else None,
        reduction=reduction, return_metrics=True, block_v=BLOCK_V, backend=backend, **kwargs,
    )
    if leaves:
        # Drawn in float64 whatever the loss dtype, so every dtype's run gets the same upstream.
        upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        (loss * upstream.to(loss.dtype).to(device)).sum().backward()
    out = {"loss": loss.detach().cpu()}
    out.update({f"metric_{k}": v.cpu() for k, v in metrics._asdict().items()})
    out.update({f"d_{k}": args[k].grad.cpu() for k in leaves})
    return out


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_bridge_matches_native_and_float64_oracle(reduction, options):
    opts = OPTIONS[options]
    bridge = _run(_inputs(), torch_xla.device(), opts, reduction, "auto")
    native = _run(_inputs(), "cpu", opts, reduction, "native")
    truth = _run(_inputs(torch.float64), "cpu", opts, reduction, "dense")
    assert bridge.keys() == native.keys() == truth.keys()
    for key in bridge:  # float32 against the float64 oracle, and against the native path
        assert_close(bridge[key], truth[key], dtype="float32", name=f"{key} vs oracle")
        assert_close(bridge[key], native[key], dtype="float32", name=f"{key} vs native")


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_bridge_forced_pallas_interpret_matches_native(reduction):
    """backend='xla_pallas' on XLA:CPU runs the Pallas kernels in interpret mode inside call_jax."""
    bridge = _run(_inputs(), torch_xla.device(), OPTIONS["all"], reduction, "xla_pallas")
    native = _run(_inputs(), "cpu", OPTIONS["all"], reduction, "native")
    truth = _run(_inputs(torch.float64), "cpu", OPTIONS["all"], reduction, "dense")
    for key in bridge:
        assert_close(bridge[key], truth[key], dtype="float32", name=f"{key} vs oracle")
        assert_close(bridge[key], native[key], dtype="float32", name=f"{key} vs native")


def test_bridge_float64_matches_oracle_to_1e10():
    # float64 on XLA needs JAX's x64 mode: on for this case only, thread-locally, as users switch it
    # (the session runs with it off). Autograd runs the XLA backward on its own thread, where the
    # context does not hold: the bridge lowers its backward in the forward's mode ('none' has one).
    with jax_x64("float64"):
        bridge = _run(_inputs(torch.float64), torch_xla.device(), OPTIONS["all"], "none", "auto")
    truth = _run(_inputs(torch.float64), "cpu", OPTIONS["all"], "none", "dense")
    for key in bridge:
        assert_close(bridge[key], truth[key], dtype="float64", name=key)


def test_bridge_float64_without_x64_is_a_clear_error():
    """With x64 off (JAX's default), float64 tensors on XLA raise instead of running in float32."""
    inputs = _inputs(torch.float64)
    with pytest.raises(TypeError, match="jax_enable_x64"):
        tc.cut_bce_with_logits(inputs["hidden"].to(torch_xla.device()), inputs["item_weight"].to(torch_xla.device()),
                               inputs["targets"].to(torch_xla.device()), block_v=BLOCK_V)


def test_bridge_matches_jax_on_the_same_inputs():
    inputs = _inputs()
    bridge = _run(inputs, torch_xla.device(), OPTIONS["all"], "mean", "auto", grads=())
    as_np = {k: v.numpy() for k, v in inputs.items()}
    loss, counts = jax_kernels.cut_bce(
        as_np["hidden"], as_np["item_weight"], as_np["targets"], as_np["bias"], weight=as_np["weight"],
        class_weight=as_np["class_weight"], pos_weight=as_np["pos_weight"], reduction="mean",
        return_metrics=True, block_v=BLOCK_V, impl="blocked",
    )
    assert_close(bridge["loss"], torch.tensor(np.asarray(loss)), dtype="float32", name="loss")
    for name, value in zip(("tp", "fp", "fn", "tn"), counts):
        assert_close(bridge[f"metric_{name}"], torch.tensor(np.asarray(value)), dtype="float32", name=name)


@pytest.mark.parametrize("grads", [("hidden",), ("item_weight",), ("hidden", "item_weight"), ("hidden", "item_weight", "bias")])
def test_every_requires_grad_combination(grads):
    bridge = _run(_inputs(), torch_xla.device(), OPTIONS["bias"], "none", "auto", grads=grads)
    native = _run(_inputs(), "cpu", OPTIONS["bias"], "none", "native")
    assert {k for k in bridge if k.startswith("d_")} == {f"d_{k}" for k in grads}
    for key in bridge:
        assert_close(bridge[key], native[key], dtype="float32", name=key)


def test_bfloat16_on_xla_accumulates_in_float32():
    opts = OPTIONS["all"]
    bridge = _run(_inputs(torch.bfloat16), torch_xla.device(), opts, "sum", "auto")
    low_precision_reference = _run(_inputs(torch.bfloat16), "cpu", opts, "sum", "dense")
    truth = _run(_inputs(torch.float64), "cpu", opts, "sum", "dense")
    assert bridge["loss"].dtype == torch.float32
    assert bridge["d_hidden"].dtype == torch.bfloat16
    for key in ("loss", "d_hidden", "d_item_weight", "d_bias"):
        assert_close(bridge[key], low_precision_reference[key], truth[key], dtype="bfloat16", name=key)


def test_mixing_xla_and_cpu_tensors_is_a_clear_error():
    inputs = _inputs()
    with pytest.raises(ValueError, match="item_weight is on cpu but hidden is on xla"):
        tc.cut_bce_with_logits(inputs["hidden"].to(torch_xla.device()), inputs["item_weight"], inputs["targets"])
    with pytest.raises(ValueError, match="needs tensors on an XLA device"):
        tc.cut_bce_with_logits(inputs["hidden"], inputs["item_weight"], inputs["targets"], backend="xla")


class _TinyRecommender(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.items = torch.nn.Embedding(V, D)
        self.mix = torch.nn.Linear(D, D)

    def forward(self, item_ids, targets):
        hidden = torch.tanh(self.mix(self.items(item_ids)))
        return tc.cut_bce_with_logits(hidden, self.items.weight, targets, block_v=BLOCK_V)


def _train(device, steps, mode="eager"):
    """Returns final parameters and, per step, (compile count, bridge trace count) after that step."""
    torch.manual_seed(0)
    model = _TinyRecommender().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # stateless: step 1 is already the steady graph
    item_ids = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3)).to(device)
    targets = _inputs()["targets"].to(device)
    forward = torch.compile(model, backend="openxla", fullgraph=True) if mode == "dynamo" else model

    def step():
        opt.zero_grad()
        loss = forward(item_ids, targets)
        loss.backward()
        opt.step()
        return loss

    if mode == "torch_xla.compile":
        step = torch_xla.compile(step)
    history = []
    for _ in range(steps):
        step()
        if device != "cpu":
            torch_xla.sync()
        compiles = (xla_metrics.metric_data("CompileTime") or [0])[0]
        history.append((compiles, xla_bridge.trace_count()))
    return [p.detach().cpu() for p in model.parameters()], history


def test_five_optimizer_steps_match_cpu():
    on_xla, _ = _train(torch_xla.device(), 5)
    on_cpu, _ = _train("cpu", 5)
    for i, (a, b) in enumerate(zip(on_xla, on_cpu)):
        assert_close(a, b, dtype="float32", name=f"param{i}")


@pytest.mark.parametrize("mode", ["eager", "torch_xla.compile", "dynamo"])
def test_training_loop_compiles_its_step_once(mode):
    """After the first steps nothing recompiles and the call_jax lowering cache stops growing."""
    xla_metrics.clear_all()
    params, history = _train(torch_xla.device(), 20, mode)
    # (compiles so far, bridge lowerings so far) after each step: the cache is the same at 2 and 20.
    assert history[1] == history[-1], history
    if mode != "dynamo":  # dynamo compiles its forward, backward and optimizer graphs separately
        # At most once: zero when an earlier test in this process already compiled the same graph.
        assert history[-1][0] <= 1, f"the step graph compiled {history[-1][0]} times: {history}"
    reference, _ = _train("cpu", 20)
    for i, (a, b) in enumerate(zip(params, reference)):
        assert_close(a, b, dtype="float32", name=f"param{i}")
