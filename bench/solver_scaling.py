"""Solver scaling: the largest graph each MILP backend solves to proven optimality in time.

For linear chains (``chain_graph(L)``, 2L+1 nodes) and U-Nets (``unet_graph(D)``, 4D+3 nodes)
of about 20, 40, 80, 160 and 320 nodes, at budgets of 100%, 70%, 50% and 30% of the
checkpoint-all peak and at the smallest feasible budget, solve ``method="milp"`` with HiGHS
and with CP-SAT (2 threads each: HiGHS ``threads=2``, whose branch and bound is serial;
CP-SAT ``num_workers=2``) from the same warm start, and with the default pipeline (HiGHS plus
early proofs by lower bounds), and record status, objective, bound, gap and wall time of the
whole ``solve()`` call (warm start included). Results go to JSON after every cell; a rerun skips the
cells already there.

    python bench/solver_scaling.py                      # the full grid, 60 s per solve
    python bench/solver_scaling.py --sizes 20,40,80     # some sizes only
    python bench/solver_scaling.py --quick              # 20 and 40 nodes, 10 s, own JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from remat import InfeasibleBudgetError, RematError, simulate, solve
from remat.builders import chain_graph, unet_graph
from remat.graph import Graph
from remat.schedule import Schedule
from remat.solvers.milp import minimum_budget

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "solver_scaling.json"
PLOT = HERE / "plots" / "solver_scaling.png"
SIZES = (20, 40, 80, 160, 320)
LEVELS = ("100%", "70%", "50%", "30%", "min")
#: "highs" and "cpsat": the backend's own search from the same warm start (early_proof=False);
#: "highs+bounds": the default pipeline, which returns a warm-start plan that meets a proven
#: lower bound (every node's cost once, or the LP relaxation) without searching.
BACKENDS = ("highs", "cpsat", "highs+bounds")
_OPTIONS = {"highs": {"backend": "highs", "early_proof": False},
            "cpsat": {"backend": "cpsat", "early_proof": False},
            "highs+bounds": {"backend": "highs", "early_proof": True}}
FAMILIES = ("chain", "unet")
THREADS = 2


def make_graph(family: str, target_n: int) -> Graph:
    """The graph of ``family`` whose node count is closest to ``target_n``."""
    if family == "chain":
        return chain_graph(max(1, round((target_n - 1) / 2)))
    if family == "unet":
        return unet_graph(max(1, round((target_n - 3) / 4)))
    raise ValueError(f"unknown family {family!r}; use chain or unet")


def checkpoint_all_peak(graph: Graph) -> int:
    plan = Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph)
    return simulate(graph, plan).peak_bytes


def graph_info(graph: Graph, family: str, target_n: int, time_limit_s: float) -> dict:
    started = time.perf_counter()
    found = minimum_budget(graph, time_limit_s=time_limit_s, threads=THREADS)
    return {
        "family": family,
        "target_n": target_n,
        "n_nodes": graph.n,
        "checkpoint_all_peak_bytes": checkpoint_all_peak(graph),
        "min_budget_bytes": found.budget_bytes,
        "min_budget_proven": found.proven,
        "min_budget_lower_bytes": found.lower_bound_bytes,
        "min_budget_s": round(time.perf_counter() - started, 3),
    }


def budget_of(info: dict, level: str) -> int:
    if level == "min":
        return info["min_budget_bytes"]
    return int(info["checkpoint_all_peak_bytes"] * float(level.rstrip("%")) / 100)


def run_cell(graph: Graph, info: dict, backend: str, level: str, time_limit_s: float) -> dict:
    budget = budget_of(info, level)
    cell = {"family": info["family"], "target_n": info["target_n"], "n_nodes": graph.n, "backend": backend,
            "level": level, "budget_bytes": budget, "time_limit_s": time_limit_s}
    if budget < info["min_budget_lower_bytes"]:  # equal to min_budget_bytes when proven
        return cell | {"status": "infeasible", "wall_s": None, "note": "below a proven lower bound on the minimum budget"}
    started = time.perf_counter()
    try:
        r = solve(graph, budget, method="milp", time_limit_s=time_limit_s, threads=THREADS, **_OPTIONS[backend])
    except InfeasibleBudgetError as exc:
        return cell | {"status": "infeasible", "wall_s": round(time.perf_counter() - started, 3),
                       "note": f"min budget {exc.min_budget_bytes} B"}
    except RematError as exc:
        return cell | {"status": "error", "wall_s": round(time.perf_counter() - started, 3), "note": str(exc)}
    return cell | {
        "status": r.status.value,
        "objective": r.objective,
        "lower_bound": r.lower_bound,
        "gap": r.gap,
        "peak_bytes": r.peak_bytes,
        "overhead": r.overhead,
        "wall_s": round(time.perf_counter() - started, 3),
        "n_variables": r.stats.n_variables,
        "n_constraints": r.stats.n_constraints,
        "nodes_explored": r.stats.nodes_explored,
    }


def _key(cell: dict) -> tuple:
    return (cell["family"], cell["target_n"], cell["backend"], cell["level"])


def run(sizes, families, backends, levels, time_limit_s: float, out: Path) -> dict:
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", {})
    results["meta"].update(_meta(time_limit_s))
    results.setdefault("graphs", {})
    results.setdefault("cells", [])
    done = {_key(c) for c in results["cells"]}
    for target_n in sizes:
        for family in families:
            graph = make_graph(family, target_n)
            gkey = f"{family}:{target_n}"
            if gkey not in results["graphs"]:
                results["graphs"][gkey] = graph_info(graph, family, target_n, time_limit_s)
                _save(results, out)
            info = results["graphs"][gkey]
            print(f"{gkey}: {graph.n} nodes, min budget {info['min_budget_bytes']} B "
                  f"({'proven' if info['min_budget_proven'] else 'not proven'}, {info['min_budget_s']} s)", flush=True)
            for backend in backends:
                for level in levels:
                    key = (family, target_n, backend, level)
                    if key in done:
                        continue
                    cell = run_cell(graph, info, backend, level, time_limit_s)
                    print(f"  {backend:6s} {level:>4s}: {cell['status']:10s} obj={cell.get('objective')} "
                          f"bound={cell.get('lower_bound')} {cell.get('wall_s')} s", flush=True)
                    results["cells"].append(cell)
                    done.add(key)
                    _save(results, out)
    return results


def _meta(time_limit_s: float) -> dict:
    import highspy
    import ortools

    return {
        "time_limit_s": time_limit_s,
        "threads": {"highs": THREADS, "cpsat": THREADS},
        "highspy": getattr(highspy, "__version__", None) or ".".join(map(str, (highspy.Highs().versionMajor(), highspy.Highs().versionMinor(), highspy.Highs().versionPatch()))),
        "ortools": ortools.__version__,
        "cpu_count": os.cpu_count(),
        "machine": platform.platform(),
        "python": platform.python_version(),
    }


def _save(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(out)


# ---------------------------------------------------------------------------- reporting
def proven_within(cell: dict, limit_s: float) -> bool:
    return cell["status"] == "optimal" and cell["wall_s"] is not None and cell["wall_s"] <= limit_s


def headline(results: dict) -> dict:
    """``{(family, backend, level): largest n proven optimal within the limit, or None}``."""
    best: dict = {}
    for c in results["cells"]:
        key = (c["family"], c["backend"], c["level"])
        best.setdefault(key, None)
        if proven_within(c, c["time_limit_s"]):
            best[key] = max(best[key] or 0, c["n_nodes"])
    return best


def markdown(results: dict) -> str:
    """The BENCHMARKS.md section: the headline (largest n proven optimal per backend and
    budget level) and every cell."""
    meta, cells = results["meta"], results["cells"]
    limit = meta["time_limit_s"]
    families = [f for f in FAMILIES if any(c["family"] == f for c in cells)]
    backends = [b for b in BACKENDS if any(c["backend"] == b for c in cells)]
    best = headline(results)
    infeasible = {(c["family"], c["level"]) for c in cells if c["status"] == "infeasible"}
    lines = [
        "## Solver scaling (MILP)",
        "",
        f"`python bench/solver_scaling.py` (time limit {limit:g} s per solve, {meta['threads']['highs']} threads "
        f"for HiGHS, {meta['threads']['cpsat']} CP-SAT workers; {meta['cpu_count']} CPU cores; highspy "
        f"{meta['highspy']}, ortools {meta['ortools']}). Budgets are fractions of the checkpoint-all peak, and "
        f"`min` is the smallest feasible budget (found by the peak-minimizing MILP). Times are the wall time of the "
        f"whole `solve()` call, warm start included. `highs` and `cpsat`: the backend's own branch and bound from "
        f"the same warm start (baselines and LP rounding; `early_proof=False`); `highs+bounds`: the default "
        f"pipeline, which skips the search when a warm-start plan meets a proven lower bound (every node's cost "
        f"once, or the LP relaxation).",
        "",
        "**Largest graph (nodes) proven optimal within the time limit**",
        "",
        "| budget | " + " | ".join(f"{f} / {b}" for f in families for b in backends) + " |",
        "|---|" + "---|" * (len(families) * len(backends)),
    ]
    for level in LEVELS:
        row = []
        for f in families:
            for b in backends:
                n = best.get((f, b, level))
                row.append(str(n) if n else ("infeasible" if (f, level) in infeasible and n is None else "none"))
        lines.append(f"| {level} | " + " | ".join(row) + " |")
    lines += ["", "| graph | nodes | budget | B | backend | status | objective | bound | gap | time (s) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    order = {lv: i for i, lv in enumerate(LEVELS)}
    for c in sorted(cells, key=lambda c: (c["family"], c["n_nodes"], order[c["level"]], c["backend"])):
        gap = "" if c.get("gap") is None else f"{c['gap']:.3%}"
        bound = "" if c.get("lower_bound") is None else f"{c['lower_bound']:.6g}"
        obj = "" if c.get("objective") is None else f"{c['objective']:.6g}"
        t = "" if c.get("wall_s") is None else f"{c['wall_s']:.1f}"
        lines.append(f"| {c['family']} | {c['n_nodes']} | {c['level']} | {c['budget_bytes']} | {c['backend']} | "
                     f"{c['status']} | {obj} | {bound} | {gap} | {t} |")
    unproven = [g for g in results["graphs"].values() if not g["min_budget_proven"]]
    if unproven:
        names = ", ".join(f"{g['family']} {g['n_nodes']}" for g in unproven)
        lines += ["", f"Minimum budgets not proven minimal within the limit (best found used): {names}."]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limit = results["meta"]["time_limit_s"]
    families = [f for f in FAMILIES if any(c["family"] == f for c in results["cells"])]
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4.5), squeeze=False)
    colors = dict(zip(LEVELS, ("tab:blue", "tab:green", "tab:orange", "tab:red", "tab:purple")))
    styles = {"highs": "-", "cpsat": "--", "highs+bounds": ":"}
    for ax, family in zip(axes[0], families):
        for backend in BACKENDS:
            for level in LEVELS:
                cells = sorted((c for c in results["cells"] if c["family"] == family and c["backend"] == backend
                                and c["level"] == level and c.get("wall_s") is not None
                                and c["status"] != "infeasible"), key=lambda c: c["n_nodes"])
                if not cells:
                    continue
                xs = [c["n_nodes"] for c in cells]
                ys = [c["wall_s"] for c in cells]
                ax.plot(xs, ys, styles[backend], color=colors[level], marker="o", label=f"{backend} {level}")
                timed_out = [(x, y) for x, y, c in zip(xs, ys, cells) if c["status"] != "optimal"]
                if timed_out:
                    ax.scatter(*zip(*timed_out), marker="x", s=80, color="black", zorder=3)
        ax.axhline(limit, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("graph nodes")
        ax.set_ylabel("solve time (s)")
        ax.set_title(f"{family}: solve time (x = not proven optimal)")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated node counts")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--levels", default=",".join(LEVELS))
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    p.add_argument("--quick", action="store_true", help="20 and 40 nodes, 10 s, written to solver_scaling_quick.json")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    time_limit = args.time_limit
    out = args.out or RESULTS
    if args.quick:
        sizes, time_limit = [s for s in sizes if s <= 40] or [20, 40], 10.0
        out = args.out or RESULTS.with_name("solver_scaling_quick.json")
    logging.basicConfig(level=logging.WARNING)
    if args.plot_only:
        results = json.loads(out.read_text())
    else:
        results = run(sizes, args.families.split(","), args.backends.split(","), args.levels.split(","),
                      time_limit, out)
    plot(results, PLOT if out == RESULTS else PLOT.with_name(out.stem + ".png"))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
