"""Time and peak memory against V (log scale) from benchmark rows (bench.py's records or results.csv).

    .venv/bin/python benchmarks/plots.py benchmarks/results/results.csv   # re-plot the latest run
    .venv/bin/python benchmarks/plots.py results.csv --memory-budget-gib 8  # a run with another budget

A memory point that failed to allocate (status 'oom') has no measured height; it is drawn as an X
in the band above the memory budget line (bench.py's --memory-budget-gib: the address space each
memory worker may add), which is what the failure shows: the provider needs more than the budget.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

STYLE = {
    "dense_eager": dict(color="tab:red", marker="o"),
    "dense_compile": dict(color="tab:orange", marker="s"),
    "xla_dense": dict(color="tab:brown", marker="^"),
    "native": dict(color="tab:blue", marker="o"),
    "xla_bridge": dict(color="tab:cyan", marker="^"),
    "jax_blocked": dict(color="tab:green", marker="D"),
    "mm_floor": dict(color="gray", marker="x", linestyle="--"),
}


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _series(rows, provider, mode, field):
    points = sorted((int(r["num_items"]), _float(r.get(field))) for r in rows
                    if r["provider"] == provider and r["mode"] == mode and _float(r.get(field)) is not None)
    return [p[0] for p in points], [p[1] for p in points]


def plot(rows, out_dir: pathlib.Path, memory_budget_gib: float = 12.0) -> list[pathlib.Path]:
    """Writes time_vs_v.png and memory_vs_v.png into out_dir.

    Args:
        rows: benchmark rows (dicts with bench.py's CSV fields).
        out_dir: where the two PNG files go (created if missing).
        memory_budget_gib: the memory workers' budget in the run (bench.py's default: 12); the
            out-of-memory marks sit just above it.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    providers = [p for p in STYLE if any(r["provider"] == p for r in rows)]
    first = rows[0] if rows else {}
    subtitle = f"N={first.get('num_positions')}, D={first.get('hidden_size')}, {first.get('dtype')}; " \
               f"{first.get('machine', '')}; git {first.get('git_sha', '')}"
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for provider in providers:
            x, y = _series(rows, provider, mode, "median_ms")
            if x:
                ax.plot(x, y, label=provider, **STYLE[provider])
        ax.set(xscale="log", yscale="log", xlabel="V (items)", ylabel="median ms", title=f"time, {mode}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    written.append(_save(fig, subtitle, out_dir / "time_vs_v.png"))

    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    budget_mib = memory_budget_gib * 1024
    failures_at = {}  # V -> how many providers failed there so far (their marks are stacked)
    for provider in providers:
        x, y = _series(rows, provider, "fwd+bwd", "peak_mib")
        if x:
            ax.plot(x, y, label=provider, **STYLE[provider])
        failed = sorted(int(r["num_items"]) for r in rows if r["provider"] == provider and r["mode"] == "fwd+bwd"
                        and r.get("status") == "oom")
        if failed:
            # Above the budget line, one row per failing provider, so that marks at one V do not hide each other.
            heights = [budget_mib * 1.3 ** (1 + failures_at.get(v, 0)) for v in failed]
            for v in failed:
                failures_at[v] = failures_at.get(v, 0) + 1
            ax.scatter(failed, heights, marker="X", s=80, color=STYLE[provider]["color"],
                       label=f"{provider}: out of memory")
    if failures_at:
        ax.axhline(budget_mib, color="black", lw=1, ls=":")
        ax.axhspan(budget_mib, budget_mib * 1.3 ** (1 + max(failures_at.values())) * 1.2, color="gray", alpha=0.12)
        ax.annotate(f"budget {memory_budget_gib:g} GiB: X above = failed to allocate", xy=(0.01, budget_mib),
                    xycoords=("axes fraction", "data"), va="top", fontsize=8, xytext=(0, -3),
                    textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="V (items)", ylabel="peak MiB beyond inputs + gradients",
           title="peak memory, fwd+bwd (fresh process per point)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no point hides behind it
    written.append(_save(fig, subtitle, out_dir / "memory_vs_v.png"))
    return written


def _save(fig, subtitle, path):
    import matplotlib.pyplot as plt

    fig.suptitle(subtitle, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def latest_run(csv_path: pathlib.Path):
    """The rows of the last run in results.csv (the rows sharing the last timestamp)."""
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    last = rows[-1]["timestamp"]
    return [r for r in rows if r["timestamp"] == last]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("csv", type=pathlib.Path, nargs="?",
                        default=pathlib.Path(__file__).parent / "results" / "results.csv",
                        help="bench.py's results.csv; its last run is plotted, next to it")
    parser.add_argument("--memory-budget-gib", type=float, default=12.0,
                        help="the run's bench.py --memory-budget-gib (where out-of-memory marks go)")
    args = parser.parse_args(argv)
    for written in plot(latest_run(args.csv), args.csv.parent, args.memory_budget_gib):
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
