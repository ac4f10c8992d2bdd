"""HBM per TPU chip: CutBCE beside the dense loss a user would write, compiled for v5e, v6e, TPU7x (no TPU).

    .venv/bin/python benchmarks/tpu_hbm.py                      # every cell its libtpu knows (v5e, v6e)
    .venv/bin/python benchmarks/tpu_hbm.py --losses cutbce      # only CutBCE's cells
    .venv/bin/python benchmarks/tpu_hbm.py --cells single --v 10000 --chips v5e --out mine.csv
    .venv/bin/python benchmarks/tpu_hbm.py --report-only        # re-plot and re-tabulate the CSV

TPU7x needs libtpu >= 0.0.50, i.e. .venv-jax (ci/jax_newest.sh), which has neither optax (the
dense loss) nor matplotlib: put optax on PYTHONPATH (the children keep it), then re-plot in .venv:

    .venv-jax/bin/python -m pip install --no-deps --target /tmp/optax-overlay optax==0.2.8 absl-py==2.5.1
    PYTHONPATH=/tmp/optax-overlay .venv-jax/bin/python benchmarks/tpu_hbm.py --chips tpu7x --cells single
    .venv/bin/python benchmarks/tpu_hbm.py --report-only

Each cell compiles `jax.value_and_grad` of `cut_bce(impl='pallas')` or of optax's BCE on the
materialized logits with libtpu's compile-only client, one subprocess per cell, and appends XLA's
per-chip memory analysis to results/tpu_hbm.csv; a program that does not fit is a result (status
`oom`, with the HBM the compiler asks for). Then it writes results/tpu_hbm.md and .png. Cells,
columns and times: benchmarks/README.md, 'Compiled for TPU without a TPU'.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import re
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
if str(HERE.parent) not in sys.path:  # run as a script: `benchmarks.*` and the packages from the root
    sys.path.insert(0, str(HERE.parent))

LOSSES = ("cutbce", "dense")
CHIPS = ("v5e", "v6e", "tpu7x")
# HBM per JAX device, the capacity line of the plot: a v5e or v6e chip is one device; a TPU7x chip
# (192 GiB) is two, one per TensorCore, each with half (its compiles are per device, as the rest).
HBM_GIB = {"v5e": 16, "v6e": 32, "tpu7x": 96}
VS = (10_000, 100_000, 876_939, 1_000_000, 10_000_000)
SINGLE = dict(n=8192, d=64, num_slots=8)
# The paper's set-up: batch 64 x sequence length 256 positions, V 876,939 items, 8 v6e chips.
# Its hidden size is not stated: 64 and 256 here (--mesh-d).
PAPER = dict(chip="v6e", topology="v6e:2x4", n=64 * 256, v=876_939, num_slots=8, dtype="bfloat16")
PAPER_GIB = dict(dense=22.37, cutbce=7.67)  # the paper's whole training step per chip, dense -> CutBCE
# Layout -> (mesh shape over axes ("data", "model"), table spec, positions spec). CutBCE gets the same
# split through `cut_bce(mesh=..., vocab_axis="model", data_axis="data")`; an axis of size 1 splits nothing.
LAYOUTS = {
    "single": ((1, 1), (None, None), (None, None)),
    "replicated": ((8, 1), (None, None), ("data", None)),  # positions data-parallel, the table on every chip
    "vocab": ((1, 8), ("model", None), (None, None)),  # the table split along V, positions on every chip
}
FIELDS = ("chip", "topology", "layout", "loss", "dtype", "N", "V", "table_rows", "D", "L", "status",
          "error", "seconds", "peak_bytes", "xla_peak_bytes", "argument_bytes", "output_bytes", "temp_bytes",
          "alias_bytes", "code_bytes", "oom_needed_bytes", "git_sha", "kernels_sha", "command",
          "host", "versions")
# The versions of rows from before the `versions` column: all made in .venv (its command says so).
OLD_VERSIONS = "jax 0.7.1, libtpu 0.0.20"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One compile: a loss on one chip or mesh layout at one shape."""

    chip: str
    topology: str
    layout: str
    loss: str
    dtype: str
    n: int
    v: int
    d: int
    num_slots: int

    @property
    def table_rows(self) -> int:
        """V padded to a multiple of the vocab shards: a table held sharded must divide evenly."""
        shards = LAYOUTS[self.layout][0][1]
        return -(-self.v // shards) * shards


def dense_bce(hidden, item_weight, targets):
    """The dense loss a user writes: `[N, V]` logits, a scatter-built `[N, V]` multi-hot, optax's BCE.

    Args:
        hidden: `[N, D]`. item_weight: `[V, D]`. targets: `[N, L]` ids, negative = padding.

    Returns:
        The mean over all N x V elements (float32), as `jax_kernels.cut_bce(reduction='mean')`.
    """
    import jax.numpy as jnp
    import optax

    n, v = hidden.shape[0], item_weight.shape[0]
    # JAX indexing wraps negative ids (-1 -> the last item) before mode='drop' looks at them, so
    # padding is sent past the end of the catalog, where 'drop' ignores it.
    ids = jnp.where(targets >= 0, targets, v)
    multi_hot = jnp.zeros((n, v)).at[jnp.arange(n)[:, None], ids].set(1, mode="drop")
    return optax.sigmoid_binary_cross_entropy(hidden @ item_weight.T, multi_hot).mean()


def training_step(cell: Cell, mesh):
    """`(hidden, item_weight, targets) -> (loss, (d_hidden, d_item_weight))` for `cell`'s loss."""
    import functools

    import jax

    import jax_kernels

    if cell.loss == "dense":
        loss = dense_bce
    elif cell.layout == "single":
        loss = functools.partial(jax_kernels.cut_bce, impl="pallas")
    else:
        loss = functools.partial(jax_kernels.cut_bce, impl="pallas", mesh=mesh, vocab_axis="model",
                                 data_axis="data")
        if cell.table_rows != cell.v:
            # The padding rows after the catalog are inert (no loss, zero gradient, not in the mean).
            loss = functools.partial(jax_kernels.cut_bce, impl="pallas", mesh=mesh,
                                     vocab_axis="model", data_axis="data", num_items=cell.v)

    def step(hidden, item_weight, targets):
        return jax.value_and_grad(lambda h, w: loss(h, w, targets), argnums=(0, 1))(hidden, item_weight)

    return step


def input_structs(cell: Cell):
    """Sharded `jax.ShapeDtypeStruct`s of hidden, item_weight and targets, and the mesh they live on.

    `jax.jit` takes each input's sharding from its struct: the same as passing `in_shardings`.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import tpu_compile

    mesh_shape, table_spec, positions_spec = LAYOUTS[cell.layout]
    devices = tpu_compile.topology(cell.topology).devices
    count = mesh_shape[0] * mesh_shape[1]
    mesh = Mesh(np.array(devices[:count]).reshape(mesh_shape), ("data", "model"))
    dtype = jnp.dtype(cell.dtype)

    def struct(shape, dt, spec):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P(*spec)))

    return mesh, (struct((cell.n, cell.d), dtype, positions_spec),
                  struct((cell.table_rows, cell.d), dtype, table_spec),
                  struct((cell.n, cell.num_slots), jnp.int32, positions_spec))


def oom_needed_bytes(message: str) -> int | None:
    """A lower bound of the HBM a program that did not fit asks for, from the compiler's message.

    Three forms seen: "Ran out of memory in memory space hbm. Used 45.78G of 15.75G hbm" (the
    program's temp allocation; the message adds "Total hbm usage >= ..."), and, when one buffer alone
    exceeds the chip, "Allocation (size=327680000000) would exceed memory (size=17179869184)" (that
    buffer), from libtpu 0.0.20; "CompileTimeHbmOom: ... the total memory required for HLO
    temporaries (612.74G) exceeds available HBM (94.74G)" from libtpu 0.0.50 (the temporaries).
    """
    used = re.search(r"(?:Used |HLO temporaries \()([0-9.]+)([KMGT])(?: of [0-9.]+[KMGT] hbm|\) exceeds)", message)
    if used is not None:
        return round(float(used.group(1)) * 1024 ** (1 + "KMGT".index(used.group(2))))
    allocation = re.search(r"Allocation \(size=([0-9]+)\) would exceed memory", message)
    return int(allocation.group(1)) if allocation is not None else None


def hbm_bytes(sizes: dict) -> int:
    """HBM the compiled program holds per chip (`sizes`: `tpu_compile.memory_bytes`): its arguments,
    outputs and temporaries, less donations.

    This is what libtpu 0.0.20 checks against the chip's capacity: its out-of-memory message adds
    the same temp allocation (fragmentation included) to the arguments. libtpu 0.0.50 (tpu7x) checks
    less: it compiled the dense loss in float32 at V 10^6 with 106.9 GiB of temp for a TPU7x device
    whose available HBM its messages put at 94.74 GiB (XLA's peak 76.8 GiB). Not `peak_memory_in_bytes`,
    which is the most bytes live at once, without fragmentation but with the buffers XLA placed in
    VMEM (v5e, CutBCE at V 10^4: 18.8 MB, against 4.9 MB of HBM arguments and outputs and no HBM
    temp; v6e x 8, dense: 11.0 GB against 14.6 GB); it is recorded beside it as `xla_peak_bytes`.
    """
    return sizes["argument_bytes"] + sizes["output_bytes"] + sizes["temp_bytes"] - sizes["alias_bytes"]


def kernels_sha() -> str:
    """The first 12 hex digits of a sha256 over the `jax_kernels/**/*.py` sources this process compiles:
    names the kernels' version when the working tree differs from the commit in `git_sha`."""
    import jax_kernels

    package = Path(jax_kernels.__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


def versions() -> str:
    """Child side: the versions that made a row, e.g. "jax 0.12.0.1, libtpu 0.0.50.1, optax 0.2.8"."""
    from importlib import metadata

    import jax

    from benchmarks import tpu_compile

    out = [f"jax {jax.__version__}", "libtpu " + ".".join(map(str, tpu_compile.libtpu_version() or ("?",)))]
    try:
        out.append(f"optax {metadata.version('optax')}")
    except metadata.PackageNotFoundError:
        pass
    return ", ".join(out)


def compile_cell(cell: Cell) -> dict:
    """Child side: lower and compile one cell for its TPU topology; never raises for a failed compile.

    Returns:
        `status` ('ok', 'oom' or 'error'), `error` text, `seconds`, and for 'ok' the per-chip byte
        counts of `compiled.memory_analysis()` (an SPMD program's analysis is per device).
    """
    from benchmarks import tpu_compile

    tpu_compile.pin_mosaic_version()  # only with libtpu 0.0.20 (.venv), which needs it
    kernels = dict(kernels_sha=kernels_sha(), versions=versions())
    try:
        mesh, structs = input_structs(cell)
    except Exception as e:  # noqa: BLE001 (reported like a failed compile)
        structs, result = None, tpu_compile.CompileResult(cell.chip, f"{type(e).__name__}: {e}", 0.0)
    if structs is not None:
        result = tpu_compile.compile_for(cell.topology, training_step(cell, mesh), *structs)
    if not result.ok:
        text = " ".join(result.error.split())  # one line: the CSV stays greppable
        oom = "RESOURCE_EXHAUSTED" in text and oom_needed_bytes(text) is not None
        return dict(kernels, status="oom" if oom else "error", error=text[:2000], seconds=result.seconds,
                    oom_needed_bytes=oom_needed_bytes(text) if oom else None)
    sizes = {k: getattr(result, k) for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "code_bytes")}
    return dict(kernels, status="ok", error="", seconds=result.seconds, peak_bytes=hbm_bytes(sizes),
                xla_peak_bytes=result.xla_peak_bytes, **sizes)


def run_cell(cell: Cell, timeout_s: float) -> dict:
    """Parent side: compile `cell` in a fresh subprocess; a CSV row (without git_sha and command)."""
    from benchmarks import tpu_compile

    row = dict(chip=cell.chip, topology=cell.topology, layout=cell.layout, loss=cell.loss, dtype=cell.dtype,
               N=cell.n, V=cell.v, table_rows=cell.table_rows, D=cell.d, L=cell.num_slots)
    cmd = [sys.executable, __file__, "--one", json.dumps(dataclasses.asdict(cell))]
    result, error = tpu_compile.run_child(cmd, tpu_compile.child_env(), timeout_s)
    if error is not None:
        timed_out = error.startswith(tpu_compile.TIMEOUT_PREFIX)
        return dict(row, status="timeout" if timed_out else "error", error=error,
                    **(dict(seconds=timeout_s) if timed_out else {}))
    return dict(row, **dict(result, seconds=round(result["seconds"], 2)))


def cells(args) -> list[Cell]:
    """The selected cells, single chip (smallest V first) then the 8-chip paper shape."""
    out = []
    if "single" in args.cells:
        from benchmarks.tpu_compile import TOPOLOGIES

        out += [Cell(chip, TOPOLOGIES[chip], "single", loss, dtype, SINGLE["n"], v, SINGLE["d"], SINGLE["num_slots"])
                for dtype in args.dtypes for v in sorted(args.v) for chip in args.chips for loss in args.losses]
    if "mesh" in args.cells:
        p = PAPER
        out += [Cell(p["chip"], p["topology"], layout, loss, p["dtype"], p["n"], p["v"], d, p["num_slots"])
                for d in args.mesh_d for layout in ("replicated", "vocab") for loss in args.losses]
    return out


def latest_rows(csv_path: Path) -> list[dict]:
    """The CSV's rows, the last one of each cell (a rerun replaces an earlier row)."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    key = lambda r: tuple(r[k] for k in ("chip", "topology", "layout", "loss", "dtype", "N", "V", "D", "L"))
    return list({key(r): r for r in rows}.values())


def _gib(row, field="peak_bytes") -> float | None:
    return int(row[field]) / 2**30 if row.get(field) else None


def _fmt(row) -> str:
    """A cell of the markdown table: the peak, or why there is none."""
    if row is None:
        return "not run"
    if row["status"] == "ok":
        gib = _gib(row)
        return f"{gib * 1024:.1f} MiB" if gib < 1 else f"{gib:.2f} GiB"
    if row["status"] == "oom":
        needed = _gib(row, "oom_needed_bytes")
        return f"does not fit (>= {needed:.2f} GiB)" if needed else "does not fit"
    return row["status"]


def _ratio(cut, dense) -> str:
    """dense / CutBCE peak; '>= x' when dense did not fit (the compiler's figure is a lower bound)."""
    if cut is None or cut["status"] != "ok" or dense is None:
        return ""
    if dense["status"] == "ok":
        return f"{_gib(dense) / _gib(cut):,.0f}x"
    needed = _gib(dense, "oom_needed_bytes")
    return f">= {needed / _gib(cut):,.0f}x" if needed else ""


def markdown(rows: list[dict], command: str) -> str:
    """The README-ready tables: single chip by V, and the 8-chip paper shape beside the paper."""
    find = {(r["layout"], r["chip"], r["dtype"], r["V"], r["D"], r["loss"]): r for r in rows}
    runs, libtpu_of_chip = {}, {}
    for r in rows:
        kernels = r.get("kernels_sha", "") if r["loss"] == "cutbce" else ""
        made_with = r.get("versions") or OLD_VERSIONS
        runs.setdefault((r["command"], r["git_sha"], kernels, made_with), []).append(r["loss"])
        libtpu_of_chip.setdefault(made_with.split("libtpu ")[1].split(",")[0], set()).add(r["chip"])
    libtpus = "; ".join(f"libtpu {v} for {', '.join(sorted(chips))}" for v, chips in sorted(libtpu_of_chip.items()))
    out = [
        f"# HBM per TPU chip: CutBCE beside the dense loss (compile-only, {libtpus})",
        "",
        f"Tables written by `{command}` from the rows of the CSV beside this file, made by:",
        "",
        *(f"- `{c}` ({v}; git {sha}" + (f", `jax_kernels` sources sha256 {k}...): " if "cutbce" in losses else "): ")
          + ", ".join(f"{losses.count(loss)} {loss} rows" for loss in LOSSES if loss in losses)
          for (c, sha, k, v), losses in sorted(runs.items())),
        "",
        "(the kernels' version is named for the CutBCE rows only: the dense loss does not use them;",
        f"rows from before the CSV's `versions` column were made in .venv: {OLD_VERSIONS})",
        "",
        "Each figure is the HBM per chip (argument + output + temp - alias bytes of XLA's memory",
        "analysis) of the compiled loss part of a training step: `jax.value_and_grad` of the loss with",
        "respect to hidden and item_weight (inputs, gradients and the loss's temporaries; no model, no",
        "optimizer). CutBCE: `jax_kernels.cut_bce(impl='pallas')`. Dense:",
        "`optax.sigmoid_binary_cross_entropy(h @ E.T, multi_hot).mean()`, the multi-hot scattered from",
        "the ids (`benchmarks/tpu_hbm.py: dense_bce`). \"Does not fit (>= x)\": the TPU compiler refused",
        "the program (out of HBM); x is the lower bound its message gives (the program's temp allocation,",
        "or the one buffer larger than the chip). Nothing ran: each program was compiled for the chip",
        "with libtpu's compile-only client, no chip present. TPU7x: per TensorCore, i.e. per JAX device",
        "(a TPU7x chip is two, each with half of its 192 GiB), as a program on one device would hold it.",
        "",
        f"## One chip: N {SINGLE['n']:,}, D {SINGLE['d']}, L {SINGLE['num_slots']} (v5e: 16 GiB HBM, v6e: 32 GiB, "
        "tpu7x: 96 GiB per TensorCore)",
        "",
        "| V | chip | dtype | CutBCE peak | dense peak | dense / CutBCE |",
        "|---:|---|---|---:|---:|---:|",
    ]
    singles = sorted({(int(r["V"]), r["chip"], r["dtype"], r["D"]) for r in rows if r["layout"] == "single"},
                     key=lambda c: (c[0], CHIPS.index(c[1]) if c[1] in CHIPS else len(CHIPS), *c[2:]))
    for v, chip, dtype, d in singles:
        cut, dense = (find.get(("single", chip, dtype, str(v), d, loss)) for loss in LOSSES)
        out.append(f"| {v:,} | {chip} | {dtype} | {_fmt(cut)} | {_fmt(dense)} | {_ratio(cut, dense)} |")
    over = [r for r in rows if r["layout"] == "single" and r["status"] == "ok" and _gib(r) > HBM_GIB[r["chip"]]]
    if over:
        # libtpu 0.0.50 refuses by a smaller figure than this table's (`hbm_bytes`' docstring).
        out += ["", "Compiled although larger than the HBM by this table's count: " + ", ".join(
            f"{r['loss']} {r['chip']} {r['dtype']} V {int(r['V']):,} ({_gib(r):.2f} GiB, XLA's peak "
            f"{_gib(r, 'xla_peak_bytes'):.2f} GiB)" for r in over) + ". libtpu 0.0.50 refuses by a smaller "
            "figure than libtpu 0.0.20 did (its messages give a TPU7x device 94.74 GiB); whether it runs is "
            "not known."]
    cut_temps = [int(r["temp_bytes"]) for r in rows if r["loss"] == "cutbce" and r["status"] == "ok"]
    if cut_temps:
        # What CutBCE needs beyond its inputs and its gradients, whose sizes any training step pays.
        out += ["", f"CutBCE's HBM temp (beyond its inputs and gradients): at most {max(cut_temps) / 2**20:.1f} MiB "
                f"over its {len(cut_temps)} rows (single chip and 8 chips)."]
    p = PAPER
    out += [
        "",
        f"## The paper's shape on 8 v6e chips: {p['n']:,} positions (64 x 256), V {p['v']:,}, L {p['num_slots']}, "
        f"{p['dtype']}, per chip",
        "",
        "`replicated`: positions split over the 8 chips (2,048 each), the table whole on every chip.",
        "`vocab`: the table split along V over the 8 chips (876,944 rows, the last 5 padding: CutBCE ignores",
        "them, the dense loss counts them as items), every position on every chip. The paper does not state",
        "D. The paper's figures are its whole training step per chip (model, Adam state, activations and",
        "the loss); ours are the loss part only, so only the difference dense - CutBCE is comparable.",
        "",
        "| layout | D | CutBCE peak | dense peak | dense / CutBCE | dense - CutBCE "
        "| paper (whole step): dense -> CutBCE |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    meshes = sorted({(r["layout"], int(r["D"])) for r in rows if r["layout"] != "single"})
    for layout, d in meshes:
        cut, dense = (find.get((layout, p["chip"], p["dtype"], str(p["v"]), str(d), loss)) for loss in LOSSES)
        diff = (f"{_gib(dense) - _gib(cut):.2f} GiB" if cut and dense and cut["status"] == dense["status"] == "ok"
                else "")
        out.append(f"| {layout} | {d} | {_fmt(cut)} | {_fmt(dense)} | {_ratio(cut, dense)} | {diff} | "
                   f"{PAPER_GIB['dense']} -> {PAPER_GIB['cutbce']} GiB "
                   f"(- {PAPER_GIB['dense'] - PAPER_GIB['cutbce']:.2f} GiB) |")
    failed = [r for r in rows if r["status"] not in ("ok", "oom")]
    if failed:
        out += ["", "Cells that failed for another reason:", ""]
        out += [f"- {r['layout']} {r['chip']} {r['loss']} {r['dtype']} V {r['V']} D {r['D']}: {r['status']} "
                f"{r['error'][:300]}" for r in failed]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], png: Path) -> None:
    """Left: peak HBM per chip against V, one line per loss x chip (x dtype), capacities as lines,
    cells that did not fit as markers on their chip's capacity line. Right: the 8-chip paper shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_mesh) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw=dict(width_ratios=(3, 2)))
    colors = {("cutbce", "v5e"): "tab:blue", ("cutbce", "v6e"): "tab:cyan", ("cutbce", "tpu7x"): "tab:purple",
              ("dense", "v5e"): "tab:red", ("dense", "v6e"): "tab:orange", ("dense", "tpu7x"): "tab:brown"}
    single = [r for r in rows if r["layout"] == "single"]
    # The chips often need the same bytes: thick lines under thin ones keep all of them visible.
    chip_style = {"v5e": dict(marker="o", linewidth=5, markersize=10),
                  "v6e": dict(marker="s", linewidth=2.5, markersize=6),
                  "tpu7x": dict(marker="^", linewidth=1, markersize=4)}
    for (loss, chip), color in colors.items():
        for dtype, style in (("bfloat16", "-"), ("float32", "--")):
            mine = sorted((int(r["V"]), r) for r in single if (r["loss"], r["chip"], r["dtype"]) == (loss, chip, dtype))
            ok = [(v, _gib(r)) for v, r in mine if r["status"] == "ok"]
            if ok:
                ax.plot(*zip(*ok), style, color=color, label=f"{loss} {chip} {dtype}", **chip_style[chip])
            bad = [v for v, r in mine if r["status"] != "ok"]
            if bad:
                ax.plot(bad, [HBM_GIB[chip]] * len(bad), "X", color=color, markersize=13, markeredgecolor="k")
    ax.plot([], [], "X", color="white", markeredgecolor="k", markersize=13,
            label="did not fit (compiler: out of HBM),\ndrawn at the chip's capacity in the line's colour")
    for chip, gib in HBM_GIB.items():
        ax.axhline(gib, color="gray", linestyle={"v5e": ":", "v6e": "-.", "tpu7x": "--"}[chip], linewidth=1)
        per = " per TensorCore" if chip == "tpu7x" else ""
        ax.annotate(f"{chip} HBM {gib} GiB{per}", (0.01, gib), xycoords=("axes fraction", "data"), ha="left",
                    va="bottom", fontsize=8, color="gray")
    ax.set(xscale="log", yscale="log", xlabel="V (items in the catalog)",
           ylabel="peak HBM per chip, tpu7x per TensorCore (GiB)",
           title=f"One chip, loss + gradients: N {SINGLE['n']}, D {SINGLE['d']}, L {SINGLE['num_slots']}")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)

    mesh = sorted((r for r in rows if r["layout"] != "single"), key=lambda r: (r["layout"], int(r["D"]), r["loss"]))
    labels = [f"{r['layout']}\nD {r['D']}\n{r['loss']}" for r in mesh]
    heights = [_gib(r) if r["status"] == "ok" else HBM_GIB[PAPER["chip"]] for r in mesh]
    bar_colors = [colors[(r["loss"], PAPER["chip"])] for r in mesh]
    bars = ax_mesh.bar(range(len(mesh)), heights, color=bar_colors)
    for bar, r in zip(bars, mesh):
        if r["status"] != "ok":
            bar.set_hatch("xx")
            bar.set_alpha(0.4)
        ax_mesh.annotate("did not fit" if r["status"] != "ok" else f"{_gib(r):.3g}",
                         (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_mesh.axhline(HBM_GIB[PAPER["chip"]], color="gray", linestyle="-.", linewidth=1, label="v6e HBM 32 GiB")
    for loss, style in (("dense", "--"), ("cutbce", ":")):
        ax_mesh.axhline(PAPER_GIB[loss], color=colors[(loss, PAPER["chip"])], linestyle=style,
                        label=f"paper, whole training step, {loss}: {PAPER_GIB[loss]} GiB")
    ax_mesh.set_xticks(range(len(mesh)), labels, fontsize=7)
    ax_mesh.set(yscale="log", ylim=(None, 150), xlabel="table layout, hidden size D, loss",
                ylabel="peak HBM per chip (GiB)",
                title=f"8 x v6e, {PAPER['n']:,} positions, V {PAPER['v']:,}, {PAPER['dtype']}")
    ax_mesh.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_reports(csv_path: Path, png: Path, md: Path, command: str) -> None:
    rows = latest_rows(csv_path)
    plot(rows, png)
    md.write_text(markdown(rows, command))
    print(md.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="+", default=("single", "mesh"), choices=("single", "mesh"))
    p.add_argument("--losses", nargs="+", default=LOSSES, choices=LOSSES)
    p.add_argument("--chips", nargs="+", choices=CHIPS,
                   help="single-chip chips (default: those this environment's libtpu knows)")
    p.add_argument("--dtypes", nargs="+", default=("bfloat16", "float32"), choices=("bfloat16", "float32"),
                   help="single-chip dtypes (the paper's shape is bfloat16)")
    p.add_argument("--v", nargs="+", type=int, default=VS, help="single-chip catalog sizes")
    p.add_argument("--mesh-d", nargs="+", type=int, default=(64, 256), help="hidden sizes at the paper's shape")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per compile")
    p.add_argument("--out", type=Path, default=RESULTS / "tpu_hbm.csv", help="CSV, appended to")
    p.add_argument("--report-only", action="store_true", help="only re-plot and re-tabulate --out")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        from benchmarks import tpu_compile

        tpu_compile.print_result(compile_cell(Cell(**json.loads(args.one))))
        return
    # The interpreter's environment (.venv or .venv-jax) names the versions the rows were made with.
    command = shlex.join([f"{Path(sys.prefix).name}/bin/python", "benchmarks/tpu_hbm.py", *sys.argv[1:]])
    png, md = args.out.with_suffix(".png"), args.out.with_suffix(".md")
    if args.report_only:
        return write_reports(args.out, png, md, command)
    from benchmarks import tpu_compile

    tpu_compile.require_overlay()
    if args.chips is None:
        args.chips = [chip for chip in CHIPS if tpu_compile.libtpu_knows(chip)]
    unknown = [chip for chip in args.chips if not tpu_compile.libtpu_knows(chip)]
    if unknown:
        have = ".".join(map(str, tpu_compile.libtpu_version() or ()))
        raise SystemExit(f"{unknown} need libtpu >= 0.0.50; {tpu_compile.OVERLAY} has libtpu {have}: "
                         "use .venv-jax (see this script's docstring)")
    from benchmarks.provenance import append_rows, git_sha, machine

    sha, host = git_sha(), machine()
    with append_rows(args.out, FIELDS) as write:
        for cell in cells(args):
            row = dict(run_cell(cell, args.timeout_s), git_sha=sha, command=command, host=host)
            write(row)
            peak = f"peak {_gib(row):.3f} GiB" if row.get("peak_bytes") else ""
            print(f"{cell.layout} {cell.chip} {cell.loss} {cell.dtype} V {cell.v} D {cell.d}: {row['status']} "
                  f"{row.get('seconds', '')} s {peak} {row.get('error', '')[:150]}", flush=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # .venv-jax
        print(f"rows appended to {args.out}; no matplotlib here: re-plot with "
              ".venv/bin/python benchmarks/tpu_hbm.py --report-only")
        return
    write_reports(args.out, png, md, command)


if __name__ == "__main__":
    main()
