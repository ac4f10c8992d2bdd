"""The torch engine registry describes itself (torch_cutbce/engines.py; docs/design.md, 'The engine map').

`BACKENDS`, backend='auto', the `mesh=` / `vocab_parallel=` checks and the vocab-parallel layout read
each `Engine`'s fields, so a new engine is one registry entry: checked here with stand-in engines
put in the registry for one test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import pytest
import torch
from parity import assert_close

import torch_cutbce
from torch_cutbce import cut_bce_with_logits, dense_bce_with_logits, engines
from torch_cutbce.route import VocabParallelOptions

NUM_ITEMS, HIDDEN_SIZE = 37, 6


HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA_ENGINE = "triton" if HAS_TRITON else "native"


def _on(device_type: str, dtype=torch.float32):
    """What `resolve_backend` reads of `hidden`: its device (any type, no tensor needed) and dtype."""
    return types.SimpleNamespace(device=types.SimpleNamespace(type=device_type), dtype=dtype)


def test_the_backends_are_auto_and_the_registry_in_its_order():
    assert torch_cutbce.BACKENDS == ("auto", *engines.ENGINES)
    assert torch_cutbce.BACKENDS == ("auto", "native", "dense", "triton", "chunked", "xla", "xla_blocked", "xla_pallas",
                                     "torch_tpu")


@pytest.mark.parametrize("device_type, engine", [("cpu", "native"), ("cuda", CUDA_ENGINE), ("meta", "native"),
                                                 ("mps", "native"), ("xla", "xla"), ("tpu", "torch_tpu")])
def test_auto_picks_by_device_type(device_type, engine):
    assert engines.resolve_backend("auto", _on(device_type, torch.bfloat16)) == engine
    assert engines.resolve_backend("dense", _on(device_type)) == "dense"  # a named backend is kept


def test_an_engine_naming_a_device_type_wins_over_any_device_where_it_is_available(monkeypatch):
    """As the Triton engine is registered for CUDA, a made-up engine for a made-up device type (after native in the
    registry: a device type named beats `ANY_DEVICE`, whatever the order)."""
    available = []
    native = engines.ENGINES["native"]
    fake = dataclasses.replace(native, name="fake", auto_on=("npu",), available=lambda: bool(available))
    monkeypatch.setitem(engines.ENGINES, "fake", fake)
    monkeypatch.setattr(engines, "_said_unavailable", set())
    with pytest.warns(UserWarning, match="backend='auto' passes over 'fake' for npu tensors"):
        assert engines.resolve_backend("auto", _on("npu")) == "native"
    available.append(True)
    assert engines.resolve_backend("auto", _on("npu")) == "fake"
    assert engines.resolve_backend("auto", _on("cpu")) == "native"
    monkeypatch.setitem(engines.ENGINES, "native", dataclasses.replace(native, auto_on=()))
    with pytest.raises(ValueError, match="backend='auto' finds no engine for tensors on"):
        engines.resolve_backend("auto", _on("cpu"))


def test_the_parallel_option_checks_read_the_fields(monkeypatch):
    vocab_parallel, mesh = VocabParallelOptions(0, 4, 8), types.SimpleNamespace(axis_names=("data", "model"))
    engines.check_parallel_options("native", None, vocab_parallel)
    engines.check_parallel_options("xla_blocked", mesh, None)
    engines.check_parallel_options("auto", mesh, None)  # the tensors decide
    monkeypatch.setitem(engines.ENGINES, "dense", dataclasses.replace(engines.ENGINES["dense"],
                                                                      takes_vocab_parallel=True, takes_mesh=True))
    monkeypatch.setitem(engines.ENGINES, "native", dataclasses.replace(engines.ENGINES["native"],
                                                                       takes_vocab_parallel=False))
    engines.check_parallel_options("dense", None, vocab_parallel)
    engines.check_parallel_options("dense", mesh, None)
    with pytest.raises(ValueError, match=r"vocab_parallel= needs an engine that takes a slice of the table "
                                         r"\(backend='auto' or 'dense' / 'triton' / 'chunked'\), got backend='native'"):
        engines.check_parallel_options("native", None, vocab_parallel)
    with pytest.raises(ValueError, match=r"mesh= runs under torch_xla SPMD and needs XLA tensors, got backend='native'"):
        engines.check_parallel_options("native", mesh, None)


def test_the_device_checks_read_the_fields():
    cpu = {"hidden": torch.zeros(1)}
    engines.check_devices(cpu, "native", engines.ENGINES["native"])
    engines.check_devices(cpu, "dense", engines.ENGINES["dense"])
    with pytest.raises(ValueError, match=r"backend='xla' needs tensors on an XLA device \(torch_xla\), got cpu"):
        engines.check_devices(cpu, "xla", engines.ENGINES["xla"])


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_vocab_parallel_wraps_the_engine_chosen_for_the_tensors(one_rank_group, monkeypatch, reduction):
    """`select(backend, vocab_parallel)` is the backend's engine under `over_ranks`: the engine gets this
    rank's slice, its options' offset and id limit, and the ids outside its slice count as padding."""
    native = engines.ENGINES["native"]
    assert engines.select("native", None) is native
    wrapped = engines.select("native", VocabParallelOptions(0, NUM_ITEMS, NUM_ITEMS))
    assert wrapped.rows is not native.rows and not wrapped.drops_padded_positions

    seen = []

    def rows(flat, route):
        seen.append(("rows", route.options.offset, route.options.id_limit, flat[1].shape[0]))
        return native.rows(flat, route)

    def weighted_sum(flat, weight, divisor, route):
        seen.append(("weighted_sum", route.options.offset, route.options.id_limit, flat[1].shape[0]))
        return native.weighted_sum(flat, weight, divisor, route)

    inner = dataclasses.replace(native, rows=rows, weighted_sum=weighted_sum)
    monkeypatch.setitem(engines._OVER_RANKS, "native", engines.over_ranks(inner))

    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, HIDDEN_SIZE, dtype=torch.float64, generator=generator)
    items = torch.randn(NUM_ITEMS, HIDDEN_SIZE, dtype=torch.float64, generator=generator)
    targets = torch.randint(-1, NUM_ITEMS, (5, 4), generator=generator)
    start = 11  # one rank holding items [start, V): the ids below start are another rank's
    got = cut_bce_with_logits(hidden, items[start:], targets, reduction=reduction,
                              vocab_parallel=VocabParallelOptions(start, NUM_ITEMS, NUM_ITEMS))
    local = torch.where(targets >= start, targets - start, -1)
    want = dense_bce_with_logits(hidden, items[start:], local, reduction=reduction)
    if reduction == "sum":
        assert seen == [("weighted_sum", start, NUM_ITEMS, NUM_ITEMS - start)]
    else:
        assert seen == [("rows", start, NUM_ITEMS, NUM_ITEMS - start)]
    assert_close(got, want, dtype="float64", name=f"vocab_parallel {reduction} over a wrapped engine")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (a CUDA build of torch ships it)")
def test_a_cuda_tensor_runs_the_triton_kernels_by_default():
    """No GPU needed: fake CUDA tensors (torch's FakeTensorMode) go through the entry; the op that
    runs is the Triton engine's one-pass loss (bfloat16 / float16), native's for float32 (the cost
    model's choice: test_the_auto_dtypes_are_the_cost_models) and float64.
    Without gradients: autograd on a CUDA tensor, even a fake one, initializes the CUDA driver."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpsCalled(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.name()))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        for dtype, op in ((torch.float32, "torch_cutbce::loss"), (torch.bfloat16, "torch_cutbce::triton_loss"),
                          (torch.float16, "torch_cutbce::triton_loss"), (torch.float64, "torch_cutbce::loss")):
            hidden = torch.empty(5, HIDDEN_SIZE, device="cuda", dtype=dtype)
            items = torch.empty(NUM_ITEMS, HIDDEN_SIZE, device="cuda", dtype=dtype)
            targets = torch.zeros(5, 2, dtype=torch.long, device="cuda")
            assert torch_cutbce.resolved_backend(hidden) == ("triton" if op == "torch_cutbce::triton_loss" else "native")
            with OpsCalled() as called:
                assert cut_bce_with_logits(hidden, items, targets).shape == ()
            assert op in called.names, sorted(called.names)
        # The dtype the logits' matmul sees decides: bfloat16 hidden with a float64 table is float64.
        mixed = (torch.empty(5, HIDDEN_SIZE, device="cuda", dtype=torch.bfloat16),
                 torch.empty(NUM_ITEMS, HIDDEN_SIZE, device="cuda", dtype=torch.float64))
        with OpsCalled() as called:
            cut_bce_with_logits(*mixed, torch.zeros(5, 2, dtype=torch.long, device="cuda"))
        assert "torch_cutbce::loss" in called.names, sorted(called.names)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (a CUDA build of torch ships it)")
def test_the_triton_engine_takes_the_dtypes_its_kernels_do():
    from torch_cutbce.triton import launch

    assert engines.ENGINES["triton"].dtypes == launch.DTYPES


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (a CUDA build of torch ships it)")
def test_the_auto_dtypes_are_the_cost_models():
    """'auto' on CUDA picks the engine `triton/cost_model.py` predicts faster, per dtype (a model, until a
    GPU measures both)."""
    from torch_cutbce.triton import cost_model, launch

    predicted = tuple(dtype for dtype in launch.DTYPES if cost_model.faster_engine(dtype) == "triton")
    assert engines.ENGINES["triton"].auto_dtypes == predicted == (torch.bfloat16, torch.float16)
    assert engines.resolve_backend("auto", _on("cuda", torch.float32)) == "native"


def test_auto_says_when_the_engine_for_the_device_cannot_run(monkeypatch):
    """triton missing: 'auto' on CUDA runs the compiled tiles, says so once, and `resolved_backend` names them."""
    monkeypatch.setitem(engines.ENGINES, "triton", dataclasses.replace(engines.ENGINES["triton"],
                                                                       available=lambda: False))
    monkeypatch.setattr(engines, "_said_unavailable", set())
    with pytest.warns(UserWarning, match="backend='auto' passes over 'triton' for cuda tensors"):
        assert engines.resolve_backend("auto", _on("cuda", torch.bfloat16)) == "native"
    assert torch_cutbce.resolved_backend(_on("cuda", torch.bfloat16)) == "native"  # said once


_CPU_TRITON_CALL = """
import os, sys, torch
if sys.argv[1] == "after_import":
    import triton  # noqa: F401  (the interpreter is chosen here)
    os.environ["TRITON_INTERPRET"] = "1"
import torch_cutbce
h, w = torch.randn(4, 8), torch.randn(20, 8)
try:
    torch_cutbce.cut_bce_with_logits(h, w, torch.tensor([[1, 2]] * 4), backend="triton")
except ValueError as error:
    print(error)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("when, why", [("never", "TRITON_INTERPRET is not 1 in this process"),
                                       ("after_import", "TRITON_INTERPRET=1 was set after triton was first imported")])
def test_triton_on_cpu_tensors_without_the_interpreter_says_what_to_do(when, why):
    """Issue 46: triton's own "0 active drivers" (or an InterpreterError when the variable came after
    triton's import); now a ValueError naming backend='triton', the device and the two ways out."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CPU_TRITON_CALL, when], env=env, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("backend='triton' got tensors on cpu: CPU tensors run only in Triton's interpreter"), (
        done.stdout, done.stderr[-2000:])
    assert why in done.stdout and "set TRITON_INTERPRET=1" in done.stdout and "pass CUDA tensors" in done.stdout
