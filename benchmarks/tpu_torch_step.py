"""The whole PyTorch SASRec training step, compiled for TPU on a host without one: per-chip HBM.

    .venv/bin/python benchmarks/tpu_torch_step.py --dtypes float32 bfloat16    # every cell
    .venv/bin/python benchmarks/tpu_torch_step.py --presets moderate --losses cutbce

One cell is one step of examples/sasrec.py (forward, loss, backward, Adam) with CutBCE through the
torch_xla bridge (`backend="xla_pallas"`) or BCEWithLogitsLoss on the dense `[B, T, V]` logits, as
examples/train.py trains them. Two subprocesses per cell, as torch_xla runs on the CPU here while
the compile needs libtpu: torch_xla stages the step, never runs it, with the bridge lowered for
TPU; libtpu's compile-only client compiles the graph (docs/toolchain.md, 'The whole torch_xla training
step'). Rows go to results/tpu_torch_step.csv, results/tpu_torch_step.md is rewritten from it;
what is measured and how: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.provenance import append_rows, git_sha, machine  # noqa: E402
from benchmarks import tpu_compile  # noqa: E402

# 'dense_unhinted' is 'dense' without the sharding hints on its [N, V] tensors; it differs only
# for several chips (examples/train.py --mesh shards nothing but the batch), so it runs only there.
LOSSES = ("cutbce", "dense", "dense_unhinted")
FIELDS = ("chip", "topology", "chips", "loss", "dtype", "batch", "seq_len", "positions_per_chip", "V", "D",
          "L", "status", "error", "trace_seconds", "compile_seconds", "tpu_custom_calls", "argument_bytes",
          "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "peak_bytes", "git_sha", "source_hash",
          "command", "host")
# The code a row depends on, hashed per row: the working tree can change between two cells.
SOURCES = ("jax_kernels/**/*.py", "torch_cutbce/**/*.py", "examples/sasrec.py", "examples/train.py",
           "benchmarks/tpu_torch_step.py")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One compile: a chip, a slice of it, the step's loss and sizes (the examples' SASRec, 2 layers)."""

    chip: str
    topology: str  # jax.experimental.topologies name, e.g. "v6e:2x4"
    chips: int  # devices the program is partitioned over (data parallel); 1 = the first chip only
    loss: str  # cutbce | dense
    dtype: str = "float32"  # parameters and activations; Adam's moments follow the parameters
    batch: int = 64
    seq_len: int = 50
    num_items: int = 100_000  # V
    dim: int = 64  # D
    labels: int = 8  # L: the next L items are a position's positives

    @property
    def positions_per_chip(self) -> int:
        return self.batch * self.seq_len // self.chips


# The paper (arXiv 2610.05559): 8-chip TPU v6e, Yambda-like V = 876,939, batch 64 x length 256,
# next 8 items. It does not state D; 64 is the examples' default.
PAPER = dict(batch=64, seq_len=256, num_items=876_939, dim=64, labels=8)
PRESETS = {
    # single chip, a shape that compiles in well under a minute
    "moderate": [dict(chip=c, topology=f"{c}:2x2", chips=1) for c in ("v5e", "v6e")],
    # the paper's: data parallel over 8 v6e chips under torch_xla SPMD
    "paper": [dict(chip="v6e", topology="v6e:2x4", chips=8, **PAPER)],
    # the paper's per-chip share run as a single-chip program (2,048 positions, table replicated):
    # what pure data parallelism holds per chip, without the all-reduce of the gradients
    "paper_per_chip": [dict(chip="v6e", topology="v6e:2x2", chips=1, **dict(PAPER, batch=8))],
    # for the quick test
    "tiny": [dict(chip="v5e", topology="v5e:2x2", chips=1, batch=4, seq_len=16, num_items=1000)],
}


# ----------------------------------------------------------------------------- 1. trace (torch_xla)


def lower_bridge_for_tpu() -> None:
    """Make torch_xla's `call_jax` lower JAX functions for TPU instead of JAX's default backend.

    `JaxCallable.specialize` (torch_xla/core/xla_builder.py) lowers with `jax.jit(...).lower(...)`,
    i.e. for the CPU on this host, which would pick the bridge's CPU path. This copy differs only in
    `lowering_platforms=("tpu",)`, so the Pallas kernels become `tpu_custom_call`s in the graph.
    Lasts for the process; the trace subprocess applies it before the first `call_jax`.
    """
    import jax
    import torch_xla.core.xla_builder as xb

    tpu_compile.pin_mosaic_version()

    def specialize(self, sample_flat_args):
        to_jax = xb.maybe_get_torchax().ops.mappings.t2j_dtype
        structs = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, to_jax(a.dtype))
                        for a in sample_flat_args)
        lowered = (jax.jit(self._flat_input_func.flat_call, keep_unused=True)
                   .trace(structs).lower(lowering_platforms=("tpu",)))
        proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
        return xb.xla_computation_as_func(xb.computation_from_module_proto("jax_callable", proto), "jax_func")

    xb.JaxCallable.specialize = specialize


def _placeholder_like(tensor):
    """An XLA tensor of `tensor`'s shape and dtype with no buffer: an HLO parameter, never data."""
    import torch
    import torch_xla.core.xla_builder as xb

    return torch.nn.Parameter(xb.create_placeholder_tensor(tuple(tensor.shape), tensor.dtype),
                              requires_grad=tensor.requires_grad)


def placeholder_model(cell: Cell):
    """The examples' SASRec with every parameter a placeholder on the XLA device."""
    import torch

    from examples.sasrec import SASRec, RecConfig

    with torch.device("meta"):  # shapes only: the real table would be built and copied for nothing
        model = SASRec(RecConfig(cell.num_items, cell.seq_len, cell.dim)).to(getattr(torch, cell.dtype))
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = _placeholder_like(param)
    return model.train()


def adam_in_steady_state(model):
    """`torch.optim.Adam` as examples/train.py makes it, after one step: moments exist (placeholders)."""
    import torch
    import torch_xla.core.xla_builder as xb

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for p in model.parameters():
        optimizer.state[p] = {
            "step": torch.tensor(1.0),  # Adam keeps it on the host unless capturable
            "exp_avg": xb.create_placeholder_tensor(tuple(p.shape), p.dtype),
            "exp_avg_sq": xb.create_placeholder_tensor(tuple(p.shape), p.dtype),
        }
    return optimizer


def step_loss(cell: Cell, model, batch, mesh):
    """The examples' full-catalog loss (examples/losses.py, `--normalization items`: the mean over real
    positions and all V items; the divisor changes no buffer the compiler allocates).

    'cutbce' goes through the bridge's Pallas path; 'dense' is `torch.nn.BCEWithLogitsLoss` on the
    `[B, T, V]` logits and multi-hot, the code CutBCE replaces. Under SPMD 'dense' marks both
    `[B, T, V]` tensors sharded along the batch: the multi-hot starts as `torch.zeros`, which the
    partitioner otherwise keeps whole on every chip ('dense_unhinted', examples/train.py's code).
    """
    import torch

    from examples.losses import multi_hot
    from torch_cutbce import cut_bce_with_logits

    hidden = model(batch["inputs"])
    weight, targets = batch["weight"].to(hidden.dtype), batch["targets"]
    denominator = weight.sum().clamp(min=1) * cell.num_items
    if cell.loss == "cutbce":
        sharding = dict(mesh=mesh, vocab_axis=None, data_axis="data") if mesh is not None else {}
        total = cut_bce_with_logits(hidden, model.item_weight, targets, model.item_bias, weight=weight,
                                    reduction="sum", backend="xla_pallas", **sharding)
        return total / denominator
    logits = hidden @ model.item_weight.T + model.item_bias
    labels = multi_hot(targets, cell.num_items).to(logits.dtype)
    if mesh is not None and cell.loss == "dense":
        import torch_xla.distributed.spmd as xs

        for t in (logits, labels):
            xs.mark_sharding(t, mesh, ("data", None, None))
    per_item = torch.nn.BCEWithLogitsLoss(reduction="none")(logits, labels)
    return (per_item.sum(-1) * weight).sum() / denominator


def trace(cell: Cell, out_dir: Path) -> None:
    """Stage one training step and write its HLO (step.pb) and what the compile needs (step.json)."""
    import numpy as np
    import torch_xla
    import torch_xla.runtime as xr

    from examples.train import TrainConfig, make_batch

    mesh = None
    if cell.chips > 1:
        import torch_xla.distributed.spmd as xs

        xr.use_spmd()  # before any XLA tensor exists
        mesh = xs.Mesh(np.arange(cell.chips), (cell.chips,), ("data",))
    lower_bridge_for_tpu()
    start = time.perf_counter()
    device = torch_xla.device()
    model = placeholder_model(cell)
    optimizer = adam_in_steady_state(model)
    params = list(model.parameters())
    updated = params + [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    updated_ids = [torch_xla._XLAC._xla_get_tensor_id(t) for t in updated]  # before they are replaced

    cfg = TrainConfig(max_len=cell.seq_len, batch_size=cell.batch, k=cell.labels)
    rows = np.random.default_rng(0).integers(1, cell.num_items + 1, size=(cell.batch, cell.seq_len + cell.labels))
    batch = {name: t.to(device) for name, t in make_batch(rows, cfg, model, 0).items()}
    if mesh is not None:
        for t in batch.values():
            xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))

    loss = step_loss(cell, model, batch, mesh)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    # What torch_xla.sync() would run here: every live tensor with pending work.
    # (Adam updates the parameters and moments in place: `updated` holds the new values now.)
    outputs = [loss] + updated + [p.grad for p in params]
    proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    input_ids, inputs = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    # Parameter j of the HLO is inputs[j] (the order torch_xla's dynamo bridge relies on too).
    aliases = {input_ids.index(tid): 1 + i for i, tid in enumerate(updated_ids) if tid in input_ids}
    (out_dir / "step.pb").write_bytes(proto)
    meta = dict(aliases=aliases, input_shapes=[list(t.shape) for t in inputs], num_outputs=len(outputs),
                tpu_custom_calls=text.count('custom_call_target="tpu_custom_call"'),
                trace_seconds=time.perf_counter() - start)
    (out_dir / "step.json").write_text(json.dumps(meta))


# ----------------------------------------------------------------------------- 2. compile (libtpu)


def _with_aliases(stablehlo: bytes, aliases: dict[int, int]) -> bytes:
    """The StableHLO module as bytecode, input j donated to output aliases[j] (shapes must agree)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        (main,) = [op for op in module.body.operations
                   if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main"]
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        old = ir.ArrayAttr(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else None
        i32 = ir.IntegerType.get_signless(32)
        arg_attrs = []
        for j, arg_type in enumerate(ftype.inputs):
            entries = {old[j][k].name: old[j][k].attr for k in range(len(old[j]))} if old is not None else {}
            out = aliases.get(j)
            if out is not None:
                if str(arg_type) != str(ftype.results[out]):
                    raise ValueError(f"input {j} ({arg_type}) cannot alias output {out} ({ftype.results[out]})")
                entries["tf.aliasing_output"] = ir.IntegerAttr.get(i32, out)
            arg_attrs.append(ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        return mlir.module_to_bytecode(module)


def compile_step(cell: Cell, out_dir: Path, xla_dump_to: str | None = None) -> dict:
    """Compile out_dir/step.pb for `cell.chips` chips of `cell.topology`; never raises for a failed compile.

    `xla_dump_to`: a folder for XLA's dump of the compile (optimized HLO, buffer assignment and the
    memory-usage report that names each temp buffer). libtpu refuses `--xla_dump_to` in
    LIBTPU_INIT_ARGS; it takes it as a compile option.
    """
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client

    meta = json.loads((out_dir / "step.json").read_text())
    devices = tuple(tpu_compile.topology(cell.topology).devices[: cell.chips])
    start = time.perf_counter()
    try:
        stablehlo = xla_client._xla.mlir.hlo_to_stablehlo((out_dir / "step.pb").read_bytes())
        bytecode = _with_aliases(stablehlo, {int(j): o for j, o in meta["aliases"].items()})
        dump = {"xla_dump_to": xla_dump_to, "xla_dump_hlo_as_text": True} if xla_dump_to else None
        options = compiler.get_compile_options(num_replicas=1, num_partitions=cell.chips,
                                               device_assignment=np.array(devices).reshape(1, cell.chips),
                                               env_options_overrides=dump)
        stats = devices[0].client.compile(bytecode, xla_client.DeviceList(devices), options).get_compiled_memory_stats()
    except Exception as e:  # noqa: BLE001 (a step that does not fit is a result, with the compiler's words)
        return dict(error=f"{type(e).__name__}: {e}", compile_seconds=time.perf_counter() - start)
    sizes = tpu_compile.memory_bytes(stats)
    peak = sizes["argument_bytes"] + sizes["output_bytes"] - sizes["alias_bytes"] + sizes["temp_bytes"] + sizes["code_bytes"]
    return dict(error=None, compile_seconds=time.perf_counter() - start, peak_bytes=peak, **sizes)


# ----------------------------------------------------------------------------- driver


def _child(mode: str, cell: Cell, out_dir: Path, timeout_s: float, xla_dump_to: str | None = None):
    """Run `mode` ('trace' or 'compile') for `cell` in a fresh process; (stdout last line, error)."""
    if mode == "trace":  # torch_xla on the CPU, libtpu not on the path
        env = tpu_compile.child_env(libtpu=False, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(cell.chips))
    else:  # libtpu only here
        env = tpu_compile.child_env(PJRT_DEVICE="CPU")
    cmd = [sys.executable, __file__, f"--{mode}", json.dumps(dataclasses.asdict(cell)), str(out_dir)]
    if xla_dump_to and mode == "compile":
        cmd += ["--xla-dump-to", xla_dump_to]
    result, error = tpu_compile.run_child(cmd, env, timeout_s, stderr_tail=1500, require_exit_zero=True)
    return result, (None if error is None else f"{mode}: {error}")


def run_cell(cell: Cell, timeout_s: float, xla_dump_to: str | None = None) -> dict:
    """Trace then compile one cell; a CSV row (without git_sha)."""
    row = dict(chip=cell.chip, topology=cell.topology, chips=cell.chips, loss=cell.loss, dtype=cell.dtype,
               batch=cell.batch, seq_len=cell.seq_len, positions_per_chip=cell.positions_per_chip,
               V=cell.num_items, D=cell.dim, L=cell.labels)
    with tempfile.TemporaryDirectory(prefix="tpu_torch_step_") as tmp:
        meta, error = _child("trace", cell, Path(tmp), timeout_s)
        if error:
            return dict(row, status="error", error=error)
        row.update(trace_seconds=round(meta["trace_seconds"], 1), tpu_custom_calls=meta["tpu_custom_calls"])
        dump = str(Path(xla_dump_to) / f"{cell.chip}-x{cell.chips}-{cell.loss}-{cell.dtype}") if xla_dump_to else None
        result, error = _child("compile", cell, Path(tmp), timeout_s, dump)
    if error:
        return dict(row, status="error", error=error)
    row.update({k: v for k, v in result.items() if k != "error"}, compile_seconds=round(result["compile_seconds"], 1))
    return dict(row, status="ok" if result["error"] is None else "error", error=(result["error"] or "")[:1500])


def source_hash() -> str:
    """12 hex digits of sha256 over SOURCES (names and contents), to tell rows of different code apart."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for pattern in SOURCES for p in ROOT.glob(pattern)):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def gib(value) -> str:
    return f"{int(value) / 2**30:.2f}" if value not in (None, "") else ""


def write_markdown(csv_path: Path, md_path: Path) -> None:
    """The table docs/tpu.md quotes: the newest row of every (chip, topology, chips, shape, loss)."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    newest = {}
    for r in rows:
        newest[tuple(r[k] for k in ("chip", "topology", "chips", "dtype", "batch", "seq_len", "V", "D", "L", "loss"))] = r
    shown = [r for r in rows if any(r is n for n in newest.values())]  # in the order they were made
    lines = [
        "# The PyTorch SASRec training step compiled for TPU: per-chip HBM, CutBCE vs dense",
        "",
        "One step of examples/sasrec.py (2 layers, forward, loss, backward, `torch.optim.Adam`), staged by",
        "torch_xla 2.9 on a CPU host with the bridge lowered for TPU, compiled by libtpu 0.0.20's compile-only",
        "client (benchmarks/tpu_torch_step.py explains how). Nothing ran on a TPU: the bytes are XLA's",
        "memory statistics of the compiled program, per chip. Peak = argument + output - alias + temp + code.",
        "The paper (arXiv 2610.05559) reports 22.37 GiB (dense) -> 7.67 GiB (CutBCE) per chip for its 8-chip",
        "v6e step at V = 876,939, batch 64 x 256, L = 8 (its D is not stated; here D = 64).",
        "",
        "Made by " + ", then ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in shown))
        + " (the newest row of each cell; source hashes: "
        + ", ".join(dict.fromkeys(r["source_hash"] or "not recorded" for r in shown)) + ").",
    ]
    lines += ["", "Per chip, the same step with each loss (peak GiB; 'dense_unhinted' only where it differs):", "",
              "| chip | chips | dtype | batch x len | V | dense | dense_unhinted | **CutBCE** | dense / CutBCE | paper: dense -> CutBCE |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    configs = {}
    for key, r in newest.items():
        configs.setdefault(key[:-1], {})[r["loss"]] = r
    for key, by_loss in configs.items():
        chip, topology, chips, dtype, batch, seq_len, v = key[:7]
        peak = {loss: (by_loss[loss]["peak_bytes"] if by_loss[loss]["status"] == "ok" else "does not fit")
                if loss in by_loss else "" for loss in LOSSES}
        shown = {loss: gib(x) if x not in ("", "does not fit") else x for loss, x in peak.items()}
        numbers = [int(peak[x]) for x in ("dense", "cutbce") if peak[x] not in ("", "does not fit")]
        ratio = f"{numbers[0] / numbers[1]:.1f}x" if len(numbers) == 2 else ""
        paper = "22.37 -> 7.67 GiB" if (chips, batch, seq_len, v) == ("8", "64", "256", "876939") else ""
        lines.append(f"| {chip} ({topology}) | {chips} | {dtype} | {batch} x {seq_len} | {int(v):,} | {shown['dense']} | "
                     f"{shown['dense_unhinted']} | **{shown['cutbce']}** | {ratio} | {paper} |")
    lines += ["", "Every row (the newest of each cell; the CSV keeps all runs):", "",
              "| chip | chips | dtype | batch x len (positions / chip) | V | D | L | loss | status | argument GiB | output GiB | alias GiB | temp GiB | **peak GiB** | compile s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in newest.values():
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error'][:230]}".replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r['chip']} ({r['topology']}) | {r['chips']} | {r['dtype']} | {r['batch']} x {r['seq_len']} "
            f"({int(r['positions_per_chip']):,}) | {int(r['V']):,} | {r['D']} | {r['L']} | {r['loss']} | {status} | "
            f"{gib(r['argument_bytes'])} | {gib(r['output_bytes'])} | {gib(r['alias_bytes'])} | {gib(r['temp_bytes'])} | "
            f"{'**' + gib(r['peak_bytes']) + '**' if r['peak_bytes'] else ''} | {r['compile_seconds']} |")
    md_path.write_text("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["moderate", "paper_per_chip", "paper"], choices=sorted(PRESETS))
    p.add_argument("--losses", nargs="+", default=LOSSES, choices=LOSSES)
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--timeout-s", type=float, default=900.0, help="per subprocess (trace, compile)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "tpu_torch_step.csv")
    p.add_argument("--xla-dump-to", help="a folder for XLA's dumps, one subfolder per cell (buffer assignment, memory report)")
    p.add_argument("--trace", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--compile", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    for mode, fn in (("trace", trace), ("compile", compile_step)):
        if getattr(args, mode):
            spec, out_dir = getattr(args, mode)
            extra = {"xla_dump_to": args.xla_dump_to} if mode == "compile" else {}
            result = fn(Cell(**json.loads(spec)), Path(out_dir), **extra)
            if mode == "trace":
                result = json.loads((Path(out_dir) / "step.json").read_text())
            tpu_compile.print_result(result)
            return
    tpu_compile.require_overlay()
    sha, host = git_sha(), machine()
    command = ".venv/bin/python benchmarks/tpu_torch_step.py " + " ".join(sys.argv[1:])
    with append_rows(args.out, FIELDS) as write:
        for preset in args.presets:
            for spec in PRESETS[preset]:
                for dtype in args.dtypes:
                    for loss in args.losses:
                        if loss == "dense_unhinted" and spec["chips"] == 1:
                            continue  # the same program as 'dense' on one chip
                        cell = Cell(loss=loss, dtype=dtype, **spec)
                        code = source_hash()
                        row = dict(run_cell(cell, args.timeout_s, args.xla_dump_to), git_sha=sha,
                                   source_hash=code if code == source_hash() else "changed during the cell",
                                   command=command.strip(), host=host)
                        write(row)
                        print(f"{preset} {cell.chip} x{cell.chips} {dtype} {loss} B {cell.batch} T {cell.seq_len} "
                              f"V {cell.num_items}: {row['status']} peak {gib(row.get('peak_bytes'))} GiB "
                              f"temp {gib(row.get('temp_bytes'))} GiB, {row.get('compile_seconds', '')} s "
                              f"{row['error'][:300]}", flush=True)
    write_markdown(args.out, args.out.with_suffix(".md"))


if __name__ == "__main__":
    main()
