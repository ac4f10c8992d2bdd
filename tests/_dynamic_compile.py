"""`torch.compile` with dynamic shapes on a torch engine (test_torch_toolchain.py: native,
test_triton_interpreter.py: Triton): `dynamic=True` and `mark_dynamic` each give one graph over
several N, with the eager loss and gradients.

The loss options are read the way a training script holds them, from a global dict and a CutBCE
module's fields (dynamo makes such floats symbolic under dynamic=True), and also left at their
defaults (label_smoothing's 0.0 default is one such float: every engine failed there).
"""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from torch_cutbce import CutBCEWithLogitsLoss, Focal, cut_bce_with_logits

SIZES = (5, 9, 14)  # N: three shapes, one graph
CONFIG = {"focal": Focal(1.5, 0.3, True), "label_smoothing": 0.2}  # a training script's options
STEPS = ("defaults", "global_options", "module")


def _inputs(n, v=37, d=8, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    hidden = torch.randn(n, d, generator=g)
    items = torch.randn(v, d, generator=g) / d ** 0.5
    targets = torch.randint(-1, v, (n, 3), generator=g)
    return hidden, items, targets


def _step(kind: str, backend: str):
    module = CutBCEWithLogitsLoss(reduction="sum", backend=backend, **CONFIG)

    def step(hidden, items, targets):
        if kind == "defaults":
            return cut_bce_with_logits(hidden, items, targets, backend=backend)
        if kind == "global_options":
            return cut_bce_with_logits(hidden, items, targets, backend=backend, reduction="sum", **CONFIG)
        return module(hidden, items, targets)

    return step


def _run(fn, hidden, items, targets, mark=False):
    leaves = [x.clone().requires_grad_() for x in (hidden, items)]
    if mark:  # N of hidden and targets
        torch._dynamo.mark_dynamic(leaves[0], 0)
        torch._dynamo.mark_dynamic(targets, 0)
    loss = fn(*leaves, targets)
    loss.backward()
    return [loss.detach()] + [x.grad for x in leaves]


def check_one_graph_with_eager_values(backend: str, kind: str, mode: str, compiler: str = "aot_eager"):
    """`mode`: 'dynamic' (`dynamic=True`) or 'mark_dynamic' (N marked on each input)."""
    step = _step(kind, backend)
    counter = CompileCounterWithBackend(compiler)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=counter, dynamic=True if mode == "dynamic" else None)
    frames = []
    for n in SIZES:
        hidden, items, targets = _inputs(n)
        got_all = _run(compiled, hidden, items, targets, mark=mode == "mark_dynamic")
        for got, want in zip(got_all, _run(step, hidden, items, targets)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"N={n}: {m}")
        frames.append(counter.frame_count)
    # No recompile for a new N: the frames compiled at the first N are all there ever are (one on
    # torch 2.9; torch 2.14's dynamo compiles a second frame at the first call under dynamic=True,
    # once, as ci/core_only.sh found). A graph per N, or a failure to compile, fails here.
    assert frames == [frames[0]] * len(SIZES) and frames[0] <= 2, f"frames compiled after each N in {SIZES}: {frames}"
