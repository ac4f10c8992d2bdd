"""Distributed memory (FSDP2, gloo on this CPU): per-rank table bytes, peak RSS and collective bytes of one Adam step.

    .venv/bin/python benchmarks/distributed_memory.py      # P 1, 2, 4; V 2**20, D 64, N 512 per rank (~25 min on 2 cores)
    .venv/bin/python benchmarks/distributed_memory.py --worlds 2 --variants a --sweep-v 65536 1048576

A tiny SASRec-like model, `hidden = tanh(Linear(items(ids)))`, with an untied output table
`out = nn.Embedding(V, D)` read only by the loss, trained one step with Adam on P gloo processes
(spawned here, fresh ones for each row). Three ways to put the loss on the output table:

    (a) cutbce-sharded   fully_shard(items), fully_shard(out), fully_shard(model); out is never
                         called, so `out.weight` stays the Shard(0) DTensor and
                         `cut_bce_with_logits(hidden, model.out.weight, targets)` reads it as it lies
                         (torch_cutbce/distributed.py: positions all-gathered, rows reduce-scattered)
    (b) dense-gathered   as (a), but the model's forward calls `out.logits(hidden)` (a method made an
                         FSDP2 forward with `register_fsdp_forward_method`), so FSDP2 all-gathers the
                         table there (and again in the backward: reshard_after_forward=True, its
                         default); `binary_cross_entropy_with_logits(hidden @ table.T, multi_hot)`
    (c) cutbce-gathered  as (b), but `out` is fully_shard-ed with reshard_after_forward=False and its
                         forward method is `cut_bce_with_logits(hidden, self.weight, targets)` on the
                         gathered plain table

Per rank, after one warm-up step (FSDP2's lazy init, Adam's moments), of the measured step:

  - table bytes: the bytes of the local tensors of a table (`to_local()` of the parameter, of its
    gradient, of Adam's exp_avg and exp_avg_sq), for `out` and for both tables; they fall as 1/P
  - peak RSS: VmHWM over the step (proc_memory; reset to the RSS right before it), and that peak
    minus the RSS before the step; large blocks come from mmap (MALLOC_MMAP_THRESHOLD_ as
    bench.py), so freed memory leaves the RSS
  - collective bytes: every c10d op this rank issued in forward + backward + optimizer step, caught
    by a TorchDispatchMode on the `c10d` and `_c10d_functional` ops (what `dist.all_gather_into_tensor`,
    `reduce_scatter_tensor`, `all_reduce`, `broadcast`, ... and FSDP2's own collectives dispatch to),
    each counted as its largest buffer (all-gather: the output, reduce-scatter: the input,
    all-reduce / broadcast: the tensor), and split by who issued it: the innermost Python frame in
    torch_cutbce/ ("CutBCE") or in torch/distributed/fsdp/ ("FSDP2")

Targets: 3 uniform random ids per position and one padding slot (-1), L = 4; (b) takes the
multi-hot [N, V] float32 of them, built before the step. (b) builds N x V float32 tensors (2 GiB
each at N 512, V 2**20), so it runs with --dense-positions per rank (128 by default) unless told
otherwise. Every rank runs under RLIMIT_AS = its size + its share of MemAvailable, so a row that
cannot fit is reported as oom instead of taking the machine down. Memory and bytes only: this
machine is shared, no timings are reported. Results: benchmarks/results/distributed_memory.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import provenance
from proc_memory import MIB, limit_address_space, peak_rss_bytes, reset_peak_rss, rss_bytes

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "distributed_memory.md"
VARIANTS = {
    "a": "(a) CutBCE, sharded table (DTensor)",
    "b": "(b) FSDP2-gathered table, dense BCE",
    "c": "(c) FSDP2-gathered table, CutBCE",
}
SLOTS = 4  # 3 positives + 1 padding slot
ENV = dict(TORCH_CUTBCE_NO_COMPILE="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
           MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")


# ----------------------------------------------------------------------------------------- ranks


def _model(num_items: int, dim: int):
    import torch
    from torch import nn

    from torch_cutbce import cut_bce_with_logits

    class OutputTable(nn.Embedding):
        """The untied output table; its two heads are FSDP2 forward methods in (b) and (c)."""

        def logits(self, hidden):
            self.read_types.append(type(self.weight).__name__)
            return hidden @ self.weight.T

        def cut_bce(self, hidden, targets):
            self.read_types.append(type(self.weight).__name__)
            return cut_bce_with_logits(hidden, self.weight, targets)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = nn.Embedding(num_items, dim)
            self.proj = nn.Linear(dim, dim)
            self.out = OutputTable(num_items, dim)
            self.out.read_types = []

        def forward(self, ids, targets=None, head=None):
            hidden = torch.tanh(self.proj(self.items(ids)))
            if head == "logits":
                return self.out.logits(hidden)
            if head == "cut_bce":
                return self.out.cut_bce(hidden, targets)
            return hidden

    torch.manual_seed(0)  # one initial model on every rank
    with torch.no_grad():
        model = Model()
        model.out.weight.mul_(0.1)
    return model


def _collective_counter():
    """A TorchDispatchMode that records (op, bytes, source) for every c10d op dispatched under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.name()
            if func.namespace in ("c10d", "_c10d_functional") and not any(
                    s in name for s in ("barrier", "wait_tensor")):
                size = max([_nbytes(a) for a in (*args, *kwargs.values())] + [_nbytes(out)])
                self.records.append((name.split("::")[-1], size, _source()))
            return out

    mode = Counter()
    mode.records = []
    return mode


def _nbytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _source() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch_cutbce/" in name:
            return "CutBCE"
        if "/torch/distributed/fsdp/" in name:
            return "FSDP2"
        frame = frame.f_back
    return "other"


def _local_bytes(x) -> int:
    if x is None:
        return 0
    x = x.to_local() if hasattr(x, "to_local") else x
    return x.numel() * x.element_size()


def _table_bytes(param, optimizer) -> int:
    state = optimizer.state.get(param, {})
    return sum(_local_bytes(t) for t in (param, param.grad, state.get("exp_avg"), state.get("exp_avg_sq")))


def measure(rank: int, world: int, variant: str, num_items: int, dim: int, positions: int, budget: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from torch_cutbce import cut_bce_with_logits

    mesh = init_device_mesh("cpu", (world,))
    model = _model(num_items, dim)
    fully_shard(model.items, mesh=mesh)
    fully_shard(model.out, mesh=mesh, reshard_after_forward=variant != "c")
    fully_shard(model, mesh=mesh)
    head = {"a": None, "b": "logits", "c": "cut_bce"}[variant]
    if head is not None:
        register_fsdp_forward_method(model.out, head)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, num_items, (positions,), generator=g)
    targets = torch.full((positions, SLOTS), -1, dtype=torch.long)
    targets[:, :3] = torch.randint(0, num_items, (positions, 3), generator=g)
    multi_hot = None
    if variant == "b":
        multi_hot = torch.zeros(positions, num_items)
        multi_hot.scatter_(1, targets[:, :3], 1.0)
    read = []

    def step():
        if variant == "a":
            hidden = model(ids)
            read.append(type(model.out.weight).__name__)
            loss = cut_bce_with_logits(hidden, model.out.weight, targets)
        elif variant == "b":
            loss = F.binary_cross_entropy_with_logits(model(ids, head="logits"), multi_hot)
        else:
            loss = model(ids, targets, head="cut_bce")
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    limit_address_space(budget)
    step()  # warm-up: FSDP2's lazy init, Adam's moments
    optimizer.zero_grad()
    dist.barrier()
    gc.collect()
    before = rss_bytes()
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
    counter = _collective_counter()
    with counter:
        loss = step()
    peak = peak_rss_bytes()
    grad = model.out.weight.grad
    grad_local = (grad.to_local() if hasattr(grad, "to_local") else grad).double()
    return dict(
        status="ok", loss=loss, out_grad_sumsq=float((grad_local ** 2).sum()),
        out_bytes=_table_bytes(model.out.weight, optimizer),
        items_bytes=_table_bytes(model.items.weight, optimizer),
        out_grad_type=type(grad).__name__, out_weight_read=(read or model.out.read_types)[-1],
        rss_before=before, peak=peak, extra_input_bytes=_local_bytes(multi_hot),
        collectives=counter.records)


def _rank_entry(rank, world, init_file, out_dir, job):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        result = measure(rank, world, **job)
    except (RuntimeError, MemoryError) as error:
        text = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        oom = isinstance(error, MemoryError) or any(s in str(error).lower() for s in ("alloc", "memory"))
        torch.save(dict(status="oom" if oom else "error", note=f"{type(error).__name__}: {text}"),
                   os.path.join(out_dir, f"rank{rank}.pt"))
        os._exit(1)  # mp.spawn ends the other ranks (they would wait in a collective)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def run_job(world: int, job: dict, share: float) -> list[dict]:
    """`measure` on `world` fresh gloo ranks; one dict per rank (status oom / error where it failed)."""
    import torch
    import torch.multiprocessing as mp

    job = dict(job, budget=int(mem_available() * share / world))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_rank_entry, args=(world, os.path.join(tmp, "init"), tmp, job), nprocs=world, join=True)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
            last = [line for line in str(error).splitlines() if line.strip()][-1:] or [type(error).__name__]
            failure = dict(status="error", note=last[0][:160])
        else:
            failure = None
        out = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else
                       (failure or dict(status="error", note="no result")))
        if failure and all(o["status"] == "ok" for o in out):
            out = [failure] * world
        return out


# ---------------------------------------------------------------------------------------- report


def _mib(b) -> str:
    return f"{b / MIB:,.1f}"


def summarize(ranks: list[dict]) -> dict:
    bad = [r for r in ranks if r["status"] != "ok"]
    if bad:
        return dict(status=bad[0]["status"], note=bad[0].get("note", ""))
    per_rank = []
    for r in ranks:
        by = {"CutBCE": 0, "FSDP2": 0, "other": 0}
        for _, size, source in r["collectives"]:
            by[source] += size
        per_rank.append(by)
    worst = lambda key: max(r[key] for r in ranks)  # noqa: E731
    return dict(
        status="ok", out_bytes=worst("out_bytes"), both_bytes=max(r["out_bytes"] + r["items_bytes"] for r in ranks),
        rss_before=worst("rss_before"), peak=worst("peak"), step_extra=max(r["peak"] - r["rss_before"] for r in ranks),
        coll_total=max(sum(b.values()) for b in per_rank), coll_cutbce=max(b["CutBCE"] for b in per_rank),
        coll_fsdp=max(b["FSDP2"] for b in per_rank), coll_other=max(b["other"] for b in per_rank),
        input_extra=worst("extra_input_bytes"), read=ranks[0]["out_weight_read"], grad_type=ranks[0]["out_grad_type"],
        losses=[r["loss"] for r in ranks], grad_sumsq=[r["out_grad_sumsq"] for r in ranks],
        ops=_op_table(ranks[0]["collectives"]))


def _op_table(records) -> list[tuple]:
    rows: dict = {}
    for op, size, source in records:
        count, total = rows.get((source, op, size), (0, 0))
        rows[(source, op, size)] = (count + 1, total + size)
    return [(source, op, size, count) for (source, op, size), (count, _) in sorted(rows.items())]


def cpu_lines() -> list[str]:
    model = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    flags = set(provenance._cpuinfo().get("flags", "").split())
    simd = "avx512f present" if "avx512f" in flags else ("avx2 only (no avx512f)" if "avx2" in flags else "no avx2")
    return [f"- `lscpu | grep 'Model name'`: `{' '.join(model.split())}`; /proc/cpuinfo flags: {simd}",
            f"- provenance.machine(): {provenance.machine()}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--num-items", type=int, default=2 ** 20)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--positions", type=int, default=512, help="N per rank for (a) and (c)")
    parser.add_argument("--dense-positions", type=int, default=128, help="N per rank for (b)")
    parser.add_argument("--sweep-v", type=int, nargs="*", default=[2 ** 16, 2 ** 20],
                        help="V of the collective-bytes sweep of (a) at P 2 (none: skip it)")
    parser.add_argument("--memory-share", type=float, default=0.8,
                        help="the fraction of MemAvailable the ranks of one row may take together")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.update(ENV)  # inherited by the spawned ranks (glibc reads MALLOC_* at start)
    stamp = provenance.stamp()
    print(stamp, flush=True)

    def job(variant, v=args.num_items):
        n = args.dense_positions if variant == "b" else args.positions
        return dict(variant=variant, num_items=v, dim=args.dim, positions=n)

    main_rows = []
    for world in args.worlds:
        for variant in args.variants:
            j = job(variant)
            s = summarize(run_job(world, j, args.memory_share))
            main_rows.append((world, variant, j, s))
            print(f"P {world} {variant} N {j['positions']}: {_brief(s)}", flush=True)
    sweep_rows = []
    for v in args.sweep_v:
        found = [s for w, var, j, s in main_rows if w == 2 and var == "a" and j["num_items"] == v]
        s = found[0] if found else summarize(run_job(2, job("a", v), args.memory_share))
        sweep_rows.append((v, s))
        print(f"sweep P 2 (a) V {v}: {_brief(s)}", flush=True)

    text = render(args, stamp, main_rows, sweep_rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(provenance.scrub(text))
    print(f"\nwrote {args.out}")
    return 0


def _brief(s) -> str:
    if s["status"] != "ok":
        return f"{s['status']}: {s.get('note', '')}"
    return (f"out table {_mib(s['out_bytes'])} MiB, peak {_mib(s['peak'])} MiB (+{_mib(s['step_extra'])}), "
            f"collectives {_mib(s['coll_total'])} MiB (CutBCE {_mib(s['coll_cutbce'])}, FSDP2 {_mib(s['coll_fsdp'])})")


def render(args, stamp, main_rows, sweep_rows) -> str:
    d, v = args.dim, args.num_items
    lines = [
        "# Distributed memory: per-rank table bytes, peak RSS and collective bytes of one Adam step (FSDP2, gloo, CPU)",
        "",
        f"`{stamp}`",
        "",
        f"Written by `{' '.join(['.venv/bin/python', 'benchmarks/distributed_memory.py', *sys.argv[1:]])}`" +
        " (the docstring there says what each column measures).",
        "",
        *cpu_lines(),
        f"- torch threads per rank 1; TORCH_CUTBCE_NO_COMPILE=1 (eager tiles); gloo, P processes on this "
        f"{os.cpu_count()}-core host, fresh ones for each row",
        "- memory and bytes only: the host is shared with other jobs, no timings are reported",
        "",
        f"## V = {v:,} (2**{v.bit_length() - 1}), D = {d}, L = {SLOTS} (3 ids + 1 padding), float32",
        "",
        "Per rank (the largest over the ranks). Table bytes: local tensors of the parameter, its gradient, "
        "Adam's exp_avg and exp_avg_sq, after the step; `out` is the loss's table, `both` adds the input "
        "embedding `items`. Peak: VmHWM over the measured step (absolute, and minus the RSS right before "
        "it). Collective bytes: the largest buffer of each c10d op issued in forward + backward + "
        "optimizer step, summed; the split says whose Python code issued it.",
        "",
        "| variant | P | N / rank | `out` table MiB | both tables MiB | RSS before MiB | peak RSS MiB | "
        "peak - before MiB | collectives MiB | of which CutBCE | of which FSDP2 | loss reads |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for world, variant, j, s in main_rows:
        head = f"| {VARIANTS[variant]} | {world} | {j['positions']} |"
        if s["status"] != "ok":
            lines.append(head + f" {s['status']}: {s.get('note', '')} |" + " |" * 8)
            continue
        lines.append(head + " " + " | ".join([_mib(s["out_bytes"]), _mib(s["both_bytes"]), _mib(s["rss_before"]),
                                        _mib(s["peak"]), _mib(s["step_extra"]), _mib(s["coll_total"]),
                                        _mib(s["coll_cutbce"]), _mib(s["coll_fsdp"]), s["read"]]) + " |")
    dense = [(w, s) for w, var, j, s in main_rows if var == "b" and s["status"] == "ok"]
    if dense:
        lines += ["", f"(b) runs at N = {args.dense_positions} per rank, not {args.positions}: its [N, V] float32 "
                  f"tensors (logits, multi-hot, the loss's elementwise terms and gradient) take "
                  f"{args.dense_positions * v * 4 / MIB:,.0f} MiB each at that N, "
                  f"{args.positions * v * 4 / MIB:,.0f} MiB at N = {args.positions}; the multi-hot "
                  f"({_mib(dense[0][1]['input_extra'])} MiB) is built before the step, so it is in "
                  "'RSS before'."]
    other = [s["coll_other"] for _, _, _, s in main_rows if s["status"] == "ok"]
    lines += ["", f"Collectives issued from neither torch_cutbce/ nor torch/distributed/fsdp/: "
              f"{_mib(max(other, default=0))} MiB at most."]
    checks = _checks(main_rows)
    if checks:
        lines += ["", "Checks:", *checks]

    lines += ["", f"## Collective bytes of (a) against V (P = 2, N = {args.positions} per rank)", "",
              "| V | collectives MiB | of which CutBCE (the loss) | of which FSDP2 | FSDP2's largest buffer |",
              "|---:|---:|---:|---:|---:|"]
    for vv, s in sweep_rows:
        if s["status"] != "ok":
            lines.append(f"| {vv:,} | {s['status']}: {s.get('note', '')} | | | |")
            continue
        largest = max((size for source, _, size, _ in s["ops"] if source == "FSDP2"), default=0)
        lines.append(f"| {vv:,} | {_mib(s['coll_total'])} | {s['coll_cutbce'] / 1024:,.1f} KiB | "
                     f"{_mib(s['coll_fsdp'])} | {_mib(largest)} MiB |")
    lines += _sweep_note(sweep_rows, args)

    lines += ["", f"## The collectives of one step, rank 0, P = 2, V = {v:,}", "",
              "| variant | issued by | c10d op | bytes each | count |", "|---|---|---|---:|---:|"]
    for world, variant, _, s in main_rows:
        if world != 2 or s["status"] != "ok":
            continue
        for source, op, size, count in s["ops"]:
            lines.append(f"| {VARIANTS[variant]} | {source} | {op} | {size:,} | {count} |")
    return "\n".join(lines) + "\n"


def _checks(main_rows) -> list[str]:
    out = []
    by = {(w, var): s for w, var, _, s in main_rows if s["status"] == "ok"}
    for world in sorted({w for w, _ in by}):
        a, c = by.get((world, "a")), by.get((world, "c"))
        if a and c:
            dl = max(abs(x - y) for x, y in zip(a["losses"], c["losses"]))
            dg = max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a["grad_sumsq"], c["grad_sumsq"]))
            out.append(f"- P {world}: (a) and (c) give each rank the same loss (largest difference {dl:.2e}) and "
                       f"the same `out` gradient shard (sum of squares, largest relative difference {dg:.2e}); "
                       f"(a)'s gradient is a {a['grad_type']}, its loss read a {a['read']}, (c)'s a {c['read']}")
        b = by.get((world, "b"))
        if b:
            out.append(f"- P {world}: the counter sees FSDP2's collectives: (b) {_mib(b['coll_fsdp'])} MiB "
                       f"issued from torch/distributed/fsdp/")
    return out


def _sweep_note(sweep_rows, args) -> list[str]:
    ok = [(v, s) for v, s in sweep_rows if s["status"] == "ok"]
    if len(ok) < 2:
        return []
    (v0, s0), (v1, s1) = ok[0], ok[-1]
    same = s0["coll_cutbce"] == s1["coll_cutbce"]
    return ["", f"The loss's collectives {'do not grow' if same else 'GROW'} with V: "
            f"{s0['coll_cutbce']:,} bytes at V = {v0:,}, {s1['coll_cutbce']:,} at V = {v1:,}"
            f"{'' if same else ' (a bug: distributed.py promises O(N D) bytes)'}. "
            f"The step's total grows ({_mib(s0['coll_total'])} -> {_mib(s1['coll_total'])} MiB) through FSDP2's "
            "collectives of the input embedding `items` (fully_shard(model.items): all-gather of the V x D table "
            "in the forward and again in the backward, reduce-scatter of its V x D gradient), which the loss "
            "does not touch; `out`, the loss's table, is never gathered in (a)."]


if __name__ == "__main__":
    sys.exit(main())
