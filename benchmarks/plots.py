"""Time and peak memory against V (log scale) from benchmark rows (bench.py's records or results.csv).

    .venv/bin/python benchmarks/plots.py benchmarks/results/results.csv   # re-plot the latest run
"""

from __future__ import annotations

import csv
import pathlib
import sys

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


def plot(rows, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes time_vs_v.png and memory_vs_v.png into out_dir; returns their paths."""
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

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for provider in providers:
        x, y = _series(rows, provider, "fwd+bwd", "peak_mib")
        if x:
            ax.plot(x, y, label=provider, **STYLE[provider])
        failed = sorted(int(r["num_items"]) for r in rows if r["provider"] == provider and r["mode"] == "fwd+bwd"
                        and r.get("status") == "oom")
        if failed:
            top = max(y) if y else 1.0
            ax.scatter(failed, [top * 2] * len(failed), marker="X", s=80, color=STYLE[provider]["color"],
                       label=f"{provider}: out of memory")
    ax.set(xscale="log", yscale="log", xlabel="V (items)", ylabel="peak MiB beyond inputs + gradients",
           title="peak memory, fwd+bwd (fresh process per point)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
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


if __name__ == "__main__":
    source = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "results" / "results.csv")
    for written in plot(latest_run(source), source.parent):
        print(f"wrote {written}")
