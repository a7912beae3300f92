"""Plots for people: compute overhead against memory budget."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from remat.sweep import SweepPoint


def plot_overhead(points: Sequence[SweepPoint], path: str | Path, *, title: str) -> Path:
    """One line per method: overhead (cost over checkpoint-all) against budget (fraction of
    the checkpoint-all peak). Infeasible cells are left out; time-limited MILP points are
    drawn hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = list(dict.fromkeys(p.method for p in points))
    for k, method in enumerate(methods):
        pts = sorted((p for p in points if p.method == method and p.result), key=lambda p: p.budget_fraction)
        if not pts:
            continue
        xs = [p.budget_fraction * 100 for p in pts]
        ys = [float(p.result["overhead"]) for p in pts]
        (line,) = ax.plot(xs, ys, marker="o", label=method, zorder=3 + k)
        hollow = [(x, y) for x, y, p in zip(xs, ys, pts) if p.result["status"] == "time_limit"]
        if hollow:
            ax.scatter(*zip(*hollow), s=90, facecolors="white", edgecolors=line.get_color(), zorder=10)
    ax.set_xlabel("memory budget (% of checkpoint-all peak)")
    ax.set_ylabel("compute overhead (x checkpoint-all cost)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
