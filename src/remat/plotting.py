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
    if not _legend(ax):
        ax.text(0.5, 0.5, "no method planned any of these budgets", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def plot_comparison(comparison, path: str | Path) -> Path:
    """Two panels for one model: compute overhead against budget for each method, and the
    measured peak of every executed plan against the simulator's prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    ref = comparison.checkpoint_all_peak_bytes
    mib = 2**20
    for method in dict.fromkeys(r.method for r in comparison.runs):
        runs = sorted((r for r in comparison.runs if r.method == method and r.overhead is not None),
                      key=lambda r: r.budget_bytes)
        if not runs:
            continue
        (line,) = left.plot([100 * r.budget_bytes / ref for r in runs], [r.overhead for r in runs], marker="o",
                            label=method)
        measured = [r for r in runs if r.measured_peak_bytes is not None]
        right.scatter([r.predicted_peak_bytes / mib for r in measured], [r.measured_peak_bytes / mib for r in measured],
                      color=line.get_color(), label=method)
    left.set_xlabel("memory budget (% of checkpoint-all peak)")
    left.set_ylabel("compute overhead (x checkpoint-all)")
    left.set_title(f"{comparison.workload}, batch {comparison.batch_size}")
    left.grid(alpha=0.3)
    _legend(left)
    eager = comparison.eager_peak_bytes / mib
    lims = [p.predicted_peak_bytes / mib for p in comparison.runs if p.predicted_peak_bytes]
    if lims:
        lo, hi = min(lims) * 0.95, max(lims) * 1.05
        right.plot([lo, hi], [lo, hi], color="grey", linestyle="--", label="measured = predicted")
        right.set_ylim(min(lo, eager) * 0.97, max(hi, eager) * 1.03)  # (the eager line inside, not on the frame)
    right.axhline(eager, color="black", linestyle=":", label="eager PyTorch")
    right.set_xlabel("predicted peak (MiB)")
    right.set_ylabel("measured peak (MiB)")
    right.set_title("simulator vs measured run")
    right.grid(alpha=0.3)
    _legend(right, fontsize=8)
    return _save(fig, path)


def _legend(ax, **options: object) -> bool:
    """The axes' legend, if anything in them has a label (else matplotlib warns of an empty one)."""
    if not ax.get_legend_handles_labels()[0]:
        return False
    ax.legend(**options)
    return True


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
