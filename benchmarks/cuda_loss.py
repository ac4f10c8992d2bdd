"""Forward + backward of the loss on a CUDA device: every engine beside the dense loss and the floor.

    .venv/bin/python benchmarks/cuda_loss.py                  # on a CUDA device: the full run, < 6 min on an H100
    .venv/bin/python benchmarks/cuda_loss.py --device cpu --small     # the reference mode: no GPU needed

One process, one setup per (shape, dtype) shared by the speed and the memory measurement (Liger's
layout). Each contender computes a 'mean' loss over hidden [N, D], item_weight [V, D] and targets
[N, L] (L = 8, a quarter of the slots padding, duplicates) and the gradients of hidden and
item_weight (`torch.autograd.grad`, dropped after each step):

    dense_eager    cut_bce_with_logits(backend='dense'): BCEWithLogitsLoss on the [N, V] logits
    dense_compile  the same under torch.compile
    native         backend='native': the loop over vocabulary tiles, torch.compile'd tile functions
    triton         backend='triton': the fused Triton kernels (CUDA only; on CPU only the check below)
    mm_floor       not a loss: z = h @ W.T, dh = G @ W, dW = G.T @ h with a random G, in the input
                   dtype, blocked over V (the [N, V] operands of V = 2**20 do not fit)
    torch_lce      torch's chunked F.linear_cross_entropy (torch >= 2.13): softmax CE, one target
                   per row (the first slot), on the same N, V, D; skipped with a message before 2.13

Per contender: one warm-up step (compiles included, `first_ms`), one step for the peak memory
(torch.cuda.max_memory_allocated after a reset, minus what was allocated before it: the inputs), then
interleaved timed rounds (each round runs every contender once; a slow contender stops after fewer
rounds, `--slow-s`). A contender whose estimated memory exceeds the device's free memory is
skipped ("skipped (needs ~X GiB)"); an out-of-memory error is recorded as `oom`. Before timing, a
small check: native, dense and triton against the float64 dense loss on the same float32 inputs
(on CPU, triton only under TRITON_INTERPRET=1); the run exits 1 if one disagrees.

Rows (CSV and JSON lines) go to `--out` (default `$OUT/cuda_loss.csv` when OUT is set, else
benchmarks/results/cuda_loss.csv; the JSON beside it). The targets, printed PASS / MISS per shape:
triton within 1.5x of mm_floor, triton's peak extra memory at most 2 x V x D x 4 bytes, triton faster
than native.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import provenance  # noqa: E402
from torch_cutbce import cut_bce_with_logits, dense_bce_with_logits, resolved_backend  # noqa: E402

CONTENDERS = ("dense_eager", "dense_compile", "native", "triton", "mm_floor", "torch_lce")
SMALL_CONTENDERS = ("dense_eager", "native", "triton", "mm_floor", "torch_lce")  # no C++ compile on CPU
GIB, MIB = 1 << 30, 1 << 20
# Bytes per [N, V] element at the peak, for the skip estimate only (never reported as measured):
# dense_eager holds float32 logits, multi-hot, elementwise terms and the metrics' bool masks in the
# forward, and logits, multi-hot, sigmoid and the logits' gradient in the backward; inductor fuses
# the elementwise work, leaving logits, multi-hot and the gradient.
DENSE_BYTES_PER_ELEMENT = {"dense_eager": 18, "dense_compile": 12}
FLOOR_BLOCK_ELEMENTS = 1 << 31  # mm_floor's [N, block_v] operands: 4 GiB each in bfloat16
TARGET_FLOOR_RATIO, TARGET_GRAD_MULTIPLE = 1.5, 2.0
FIELDS = ("timestamp", "git_sha", "device", "torch", "triton", "command", "N", "D", "V", "L", "dtype", "contender",
          "status", "rounds", "median_ms", "min_ms", "max_ms", "first_ms", "peak_mib", "estimate_gib",
          "x_floor", "x_triton", "loss", "note")


@dataclasses.dataclass(frozen=True)
class Cell:
    num_positions: int  # N
    hidden_size: int  # D
    num_items: int  # V
    dtype: str
    num_slots: int = 8  # L

    def label(self) -> str:
        return f"N={self.num_positions} D={self.hidden_size} V={self.num_items} L={self.num_slots} {self.dtype}"


def make_inputs(cell: Cell, device, seed=0):
    """hidden ~ N(0, 1), item_weight ~ N(0, 1/D) (logits of order 1), targets [N, L] with padding and duplicates."""
    g = torch.Generator(device=device).manual_seed(seed)
    n, d, v, slots = cell.num_positions, cell.hidden_size, cell.num_items, cell.num_slots
    dtype = getattr(torch, cell.dtype)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype)
    item_weight = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype)
    targets = torch.randint(0, v, (n, slots), generator=g, device=device)
    targets[torch.rand(n, slots, generator=g, device=device) < 0.25] = -1
    targets[::4, 1] = targets[::4, 0]
    return hidden, item_weight, targets


def _cut_bce(backend):
    return lambda h, w, t: cut_bce_with_logits(h, w, t, backend=backend)


def _torch_lce_available() -> bool:
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _torch_lce(h, w, t):
    # A softmax loss over one target per row: the first slot (-1, padding, ignored).
    return F.linear_cross_entropy(h, w, t[:, 0], ignore_index=-1, options=torch.nn.LinearCrossEntropyOptions())


def _floor_block(cell: Cell) -> int:
    return max(1, min(cell.num_items, FLOOR_BLOCK_ELEMENTS // max(cell.num_positions, 1)))


def mm_floor(h, w, g_block):
    """The three products of a training step, blocked over V; `g_block` [N, block_v] stands in for dz."""
    n, v, block_v = h.shape[0], w.shape[0], g_block.shape[1]
    z = torch.empty(n, block_v, dtype=h.dtype, device=h.device)
    dh, dw = torch.zeros_like(h), torch.empty_like(w)
    for start in range(0, v, block_v):
        stop = min(start + block_v, v)
        items, g = w[start:stop], g_block[:, : stop - start]
        torch.mm(h, items.T, out=z[:, : stop - start])
        dh.addmm_(g, items)
        torch.mm(g.T, h, out=dw[start:stop])
    return dh, dw


def estimate_bytes(name: str, cell: Cell) -> int:
    """Extra bytes a step needs at its peak, beyond the inputs (a skip estimate, not a measurement)."""
    n, d, v = cell.num_positions, cell.hidden_size, cell.num_items
    size = torch.finfo(getattr(torch, cell.dtype)).bits // 8
    grads = (n + v) * d * (4 + size)  # float32 gradients and their cast to the input dtype
    if name in DENSE_BYTES_PER_ELEMENT:
        return DENSE_BYTES_PER_ELEMENT[name] * n * v + grads
    if name == "mm_floor":
        return 2 * n * _floor_block(cell) * size + (n + v) * d * size
    if name == "native":
        return 6 * 16 * MIB + grads  # a few 16 MiB float32 [N, block_v] tiles
    if name == "torch_lce":
        return grads + 4 * n * min(v, 4096) * 4  # unknown chunking: a guess
    return grads + n * cell.num_slots * 4  # triton: the gradients and the int32 ids


def device_free_bytes(device) -> int:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 1 << 62


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Skipped:
    """A contender that did not run, and why (a row like a `Contender`'s)."""

    name: str
    note: str
    status: str = "skipped"
    times_ms: tuple = ()
    first_ms: None = None
    peak_mib: None = None
    loss: None = None


class Contender:
    """One way of computing the step; `status` is '' while it runs."""

    def __init__(self, name, cell, inputs, device):
        self.name, self.cell, self.device = name, cell, device
        self.status, self.note, self.times_ms = "", "", []
        self.first_ms = self.peak_mib = self.loss = None
        self.big = name in DENSE_BYTES_PER_ELEMENT
        h, w, t = inputs
        self.h, self.w, self.t = h.detach().requires_grad_(), w.detach().requires_grad_(), t
        if name == "mm_floor":
            g = torch.Generator(device=device).manual_seed(1)
            block = torch.randn(cell.num_positions, _floor_block(cell), generator=g, device=device)
            self.g_block = block.to(h.dtype)
        fn = {"dense_eager": _cut_bce("dense"), "native": _cut_bce("native"), "triton": _cut_bce("triton"),
              "torch_lce": _torch_lce}.get(name)
        if name == "dense_compile":
            fn = torch.compile(_cut_bce("dense"), dynamic=False)
        self.fn = fn

    def step(self):
        if self.name == "mm_floor":
            return mm_floor(self.h.detach(), self.w.detach(), self.g_block), None
        loss = self.fn(self.h, self.w, self.t)
        return torch.autograd.grad(loss, (self.h, self.w)), loss.detach()

    def run(self, what: str) -> float | None:
        """One step; its wall time in ms (synchronized), or None with `status` set on a failure."""
        try:
            sync(self.device)
            start = time.perf_counter()
            grads, loss = self.step()
            sync(self.device)
            elapsed = (time.perf_counter() - start) * 1e3
            if loss is not None:
                self.loss = float(loss)
            del grads
        except torch.OutOfMemoryError as error:
            self.status, self.note = "oom", f"{what}: {str(error).splitlines()[0][:200]}"
            return None
        except Exception as error:  # one contender's failure must not end the run: it is recorded
            self.status, self.note = "error", f"{what}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            return None
        finally:
            if self.big and self.device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        return elapsed

    def measure_peak(self):
        if self.device.type != "cuda":
            return  # torch keeps no allocator statistics on CPU
        sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        if self.run("memory step") is not None:
            self.peak_mib = (torch.cuda.max_memory_allocated(self.device) - before) / MIB


def skip_reason(name: str, cell: Cell, device, free_bytes: int) -> str:
    if name == "triton" and device.type != "cuda":
        return "skipped (CUDA only; on CPU the interpreter runs only the agreement check)"
    if name == "torch_lce" and not _torch_lce_available():
        return f"skipped (F.linear_cross_entropy needs torch >= 2.13; this is torch {torch.__version__})"
    need = estimate_bytes(name, cell)
    if need > free_bytes:
        return f"skipped (needs ~{need / GIB:.3g} GiB, {free_bytes / GIB:.3g} GiB free)"
    return ""


def run_cell(cell, names, device, args, deadline, free_override):
    """Every contender on one shape: warm-up, memory step, interleaved rounds. Returns the contenders."""
    inputs = make_inputs(cell, device)
    contenders = []
    for name in names:
        free = free_override if free_override is not None else device_free_bytes(device)
        reason = skip_reason(name, cell, device, free)
        if not reason and time.monotonic() > deadline:
            reason = "skipped (time limit)"
        if reason:
            contenders.append(Skipped(name, reason))
            print(f"  {name:14s} {reason}", flush=True)
            continue
        c = Contender(name, cell, inputs, device)
        c.first_ms = c.run("first call")
        if c.first_ms is not None:
            c.measure_peak()
        print(f"  {name:14s} first call {c.first_ms or 0:10.1f} ms  {c.status} {c.note}", flush=True)
        contenders.append(c)
    live = [c for c in contenders if not c.status]
    wanted = {c.name: args.rounds for c in live}
    for r in range(args.rounds):
        for c in live:
            if c.status or r >= wanted[c.name] or (r > 0 and time.monotonic() > deadline):
                continue
            elapsed = c.run(f"round {r}")
            if elapsed is not None:
                c.times_ms.append(elapsed)
                if r == 0:  # a slow contender runs fewer rounds: about args.slow_s seconds in all, >= 2
                    wanted[c.name] = max(2, min(args.rounds, int(args.slow_s * 1e3 / max(elapsed, 1e-3))))
    for c in contenders:
        if not c.status:
            c.status = "ok" if c.times_ms else "skipped"
            if not c.times_ms:
                c.note = "skipped (time limit)"
    del inputs
    return contenders


def agreement_check(device, interpret: bool) -> list[str]:
    """native, dense and triton on float32 inputs against the float64 dense loss: failures, printed."""
    cell = Cell(512, 72, 5003, "float32") if device.type == "cuda" else Cell(96, 24, 700, "float32")
    h, w, t = make_inputs(cell, device, seed=7)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    truth_loss = dense_bce_with_logits(h64, w64, t)
    truth = (truth_loss.detach(), *torch.autograd.grad(truth_loss, (h64, w64)))
    backends = ["dense", "native"]
    if importlib.util.find_spec("triton") is None:
        print("  check triton  skipped: triton is not installed")
    elif device.type == "cuda" or interpret:
        backends.append("triton")
    failures = []
    for backend in backends:
        hf, wf = h.detach().requires_grad_(), w.detach().requires_grad_()
        try:
            loss = cut_bce_with_logits(hf, wf, t, backend=backend)
            got = (loss.detach(), *torch.autograd.grad(loss, (hf, wf)))
        except Exception as error:
            failures.append(f"{backend}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
            print(f"  check {backend:7s} FAILED to run: {failures[-1]}", flush=True)
            continue
        errors = [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, truth)]
        ok = all(e <= 1e-5 for e in errors)
        print(f"  check {backend:7s} vs float64 dense at {cell.label()}: relative error loss {errors[0]:.1e}, "
              f"d_hidden {errors[1]:.1e}, d_item_weight {errors[2]:.1e} (<= 1e-5: {'ok' if ok else 'FAILED'})",
              flush=True)
        if not ok:
            failures.append(f"{backend}: errors {errors}")
    return failures


def targets(cell, by_name) -> list[str]:
    """The PASS / MISS lines of one shape (n/a where a row is missing)."""
    tri, floor, native = (by_name.get(k) for k in ("triton", "mm_floor", "native"))
    ok = lambda c: c is not None and c.status == "ok"  # noqa: E731
    lines = []
    if ok(tri) and ok(floor):
        ratio = statistics.median(tri.times_ms) / statistics.median(floor.times_ms)
        lines.append(f"{'PASS' if ratio <= TARGET_FLOOR_RATIO else 'MISS'} triton / mm_floor = {ratio:.2f}x "
                     f"(target <= {TARGET_FLOOR_RATIO}x)")
    else:
        lines.append("n/a  triton / mm_floor (a row is missing)")
    grad_mib = cell.num_items * cell.hidden_size * 4 / MIB
    if ok(tri) and tri.peak_mib is not None:
        verdict = "PASS" if tri.peak_mib <= TARGET_GRAD_MULTIPLE * grad_mib else "MISS"
        lines.append(f"{verdict} triton peak extra {tri.peak_mib:,.0f} MiB (target <= {TARGET_GRAD_MULTIPLE:g} x "
                     f"V x D x 4 B = {TARGET_GRAD_MULTIPLE * grad_mib:,.0f} MiB)")
    else:
        lines.append("n/a  triton peak memory (no triton row, or not on CUDA)")
    if ok(tri) and ok(native):
        ratio = statistics.median(tri.times_ms) / statistics.median(native.times_ms)
        lines.append(f"{'PASS' if ratio < 1 else 'MISS'} triton / native = {ratio:.2f}x (target < 1)")
    else:
        lines.append("n/a  triton / native (a row is missing)")
    return lines


def rows_of(cell, contenders, common):
    median = {c.name: statistics.median(c.times_ms) for c in contenders if c.status == "ok"}
    for c in contenders:
        m = median.get(c.name)
        yield {**common, "N": cell.num_positions, "D": cell.hidden_size, "V": cell.num_items, "L": cell.num_slots,
               "dtype": cell.dtype, "contender": c.name, "status": c.status, "rounds": len(c.times_ms),
               "median_ms": _round(m), "min_ms": _round(min(c.times_ms, default=None)),
               "max_ms": _round(max(c.times_ms, default=None)), "first_ms": _round(c.first_ms),
               "peak_mib": _round(c.peak_mib), "estimate_gib": round(estimate_bytes(c.name, cell) / GIB, 3),
               "x_floor": _ratio(m, median.get("mm_floor")), "x_triton": _ratio(m, median.get("triton")),
               "loss": "" if c.loss is None else f"{c.loss:.8g}", "note": c.note}


def _round(x):
    return "" if x is None else round(x, 3)


def _ratio(a, b):
    return "" if a is None or not b else round(a / b, 3)


def print_table(cell, rows):
    print(f"\n{cell.label()}")
    print(f"  {'contender':14s} {'median ms':>10s} {'spread ms':>19s} {'first ms':>10s} {'peak MiB':>10s} "
          f"{'x floor':>8s} {'x triton':>8s}  status")
    for r in rows:
        spread = f"{r['min_ms']}-{r['max_ms']}" if r["median_ms"] != "" else ""
        status = {"ok": "ok", "skipped": r["note"]}.get(r["status"], f"{r['status']}: {r['note']}")
        print(f"  {r['contender']:14s} {r['median_ms']!s:>10s} {spread:>19s} {r['first_ms']!s:>10s} "
              f"{r['peak_mib']!s:>10s} {r['x_floor']!s:>8s} {r['x_triton']!s:>8s}  {status}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the reference mode)")
    p.add_argument("--small", action="store_true", help="tiny shapes: N 256, D 32, V 1024 and 4096")
    p.add_argument("--n", type=int, default=None, help="positions N (default 32768; --small 256)")
    p.add_argument("--d", type=int, default=None, help="hidden size D (default 128; --small 32)")
    p.add_argument("--v", type=int, nargs="+", default=None, help="item counts V (default 2**17 2**20)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--contenders", nargs="+", default=None, choices=CONTENDERS)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds at most (default 5; --small 3)")
    p.add_argument("--slow-s", type=float, default=8.0, help="a contender's timed rounds take about this long, >= 2")
    p.add_argument("--time-limit-s", type=float, default=330.0,
                   help="after this, no new contender starts (skipped (time limit)); default 330")
    p.add_argument("--memory-gib", type=float, default=None, help="the free memory the estimates compare with")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV path (default $OUT/cuda_loss.csv if OUT is set, else benchmarks/results/cuda_loss.csv)")
    p.add_argument("--no-check", action="store_true", help="skip the agreement check")
    p.add_argument("--plan", action="store_true",
                   help="print each contender's memory estimate and what would run or be skipped; run nothing")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.small else 5)
    args.n = args.n or (256 if args.small else 32768)
    args.d = args.d or (32 if args.small else 128)
    args.v = args.v or ([1024, 4096] if args.small else [1 << 17, 1 << 20])
    args.contenders = args.contenders or (SMALL_CONTENDERS if args.small else CONTENDERS)
    if args.out is None:
        folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else provenance.ROOT / "benchmarks" / "results"
        args.out = folder / "cuda_loss.csv"
    return args


def plan(args, device) -> None:
    """The estimates and skip decisions of every (shape, dtype, contender), without running anything."""
    free = int(args.memory_gib * GIB) if args.memory_gib is not None else device_free_bytes(device)
    print(f"plan for {free / GIB:.3g} GiB free on {device.type}:")
    for v in args.v:
        for dtype in args.dtypes:
            cell = Cell(args.n, args.d, v, dtype)
            for name in args.contenders:
                reason = skip_reason(name, cell, device, free)
                print(f"  {cell.label():40s} {name:14s} ~{estimate_bytes(name, cell) / GIB:9.3f} GiB  "
                      f"{reason or 'runs'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = torch.device(args.device)
    if args.plan:
        plan(args, device)
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --small for the reference mode", file=sys.stderr)
        return 2
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else provenance.machine()
    versions = {"torch": torch.__version__, "triton": _version("triton")}
    print(f"device: {name}; torch {versions['torch']}, triton {versions['triton']}; commit {provenance.git_sha()}")
    probe = torch.zeros(1, device=device)
    print(f"backend='auto' on these tensors runs {resolved_backend(probe)!r}; TRITON_INTERPRET={int(interpret)}")
    failures = [] if args.no_check else agreement_check(device, interpret)
    common = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_sha": provenance.git_sha(), "device": name,
              **versions, "command": provenance.command()}
    free_override = None if args.memory_gib is None else int(args.memory_gib * GIB)
    deadline = started + args.time_limit_s
    verdicts = []
    json_path = args.out.with_suffix(".jsonl")
    with provenance.append_rows(args.out, FIELDS) as write, open(_mkdir(json_path), "a") as json_file:
        for v in args.v:
            for dtype in args.dtypes:
                cell = Cell(args.n, args.d, v, dtype)
                print(f"\n{cell.label()}: {len(args.contenders)} contenders", flush=True)
                contenders = run_cell(cell, args.contenders, device, args, deadline, free_override)
                rows = list(rows_of(cell, contenders, common))
                for row in rows:
                    write(row)
                    json_file.write(json.dumps(row) + "\n")
                print_table(cell, rows)
                lines = targets(cell, {c.name: c for c in contenders})
                verdicts += [f"{cell.label()}: {line}" for line in lines]
                for line in lines:
                    print(f"  {line}")
    print("\ntargets:")
    for line in verdicts:
        print(f"  {line}")
    if failures:
        print("\nagreement check FAILED: " + "; ".join(failures))
    print(f"\nrows appended to {provenance.scrub(str(args.out))} and {provenance.scrub(str(json_path))}; "
          f"wall {time.monotonic() - started:.1f} s")
    return 1 if failures else 0


def _mkdir(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
