"""Budget sweeps on the Checkmate paper's networks: six methods' compute overhead vs budget.

For VGG16 (batch 256), MobileNet (batch 512) and the VGG U-Net (batch 32), the batch sizes of
the Checkmate paper's budget sweeps, and GPT-2 small (batch 8, 512 tokens), the training step
(forward, loss, backward) is traced on the meta device with ``CostModel.ESTIMATE`` (a roofline
of FLOPs and bytes moved; a paper-scale step cannot be timed on a CPU). Budgets are fractions
of the checkpoint-all peak; at each, each method (``--methods``) plans the step through
``remat.planning.plan_graph`` and the simulator checks the plan. A budget a method cannot meet
is recorded as infeasible with the smallest budget it can meet; griewank, which needs a linear
chain, as not applicable.

Results go to ``bench/results/budget_sweep.json`` after every point, each with what produced it
(the traced graph's fingerprint, ``planner_version()``, the method's options): a rerun skips the
points made by the same code on the same graph with the same options and measures the others
again (delete the file, or use ``--out``, to start afresh). One plot per model goes
to ``bench/plots/budget_sweep_<model>.png``; ``markdown(results)`` renders the BENCHMARKS.md
section.

    python bench/budget_sweep.py                                    # everything, 60 s per solve
    python bench/budget_sweep.py --models vgg16,vgg-unet --time-limit 300
    python bench/budget_sweep.py --models vgg16 --batch 4 --budgets 1.0,0.9 --time-limit 5 \\
        --out /tmp/smoke.json                                       # a smoke run
    python bench/budget_sweep.py --options '{"milp": {"threads": 2}}'   # extra solver options
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from remat.solvers import planner_version
from remat.sweep import environment, parse_solver_options, pin_estimate_rates, save_json, trace_on_meta

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "budget_sweep.json"
PLOTS = HERE / "plots"

#: model -> batch size (the Checkmate paper's budget sweeps; GPT-2 small is our addition).
MODELS: dict[str, int] = {"vgg16": 256, "mobilenet": 512, "vgg-unet": 32, "gpt2-small": 8}
FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
METHODS = ("checkpoint_all", "chen_sqrtn", "chen_greedy", "griewank", "lp_round", "milp")
#: Methods that take ``time_limit_s``.
TIMED = ("lp_round", "milp")
#: Extra keyword options per method, passed to ``plan_graph`` (and so to the solver); the
#: ``--options`` flag adds to these, e.g. ``{"milp": {"max_nodes": 400}}``.
SOLVER_OPTIONS: dict[str, dict[str, object]] = {}
DEFAULT_TIME_LIMIT_S = 60.0
#: Relative tolerance of the "MILP is never worse than a baseline" check.
CHECK_RTOL = 1e-6


def model_info(model: str, batch: int, graph, trace_s: float) -> dict:
    from remat.coarsen import coarsen
    from remat.graph import NodeKind
    from remat.sweep import checkpoint_all_peak

    return {
        "model": model,
        "batch": batch,
        "n_nodes": graph.n,
        "n_nodes_coarse": coarsen(graph).coarse.n,
        "fixed_bytes": graph.fixed_bytes,
        "checkpoint_all_peak_bytes": checkpoint_all_peak(graph),
        "checkpoint_all_cost_us": graph.total_cost,
        "forward_cost_us": sum(n.cost for n in graph.nodes if n.kind is NodeKind.FORWARD),
        "trace_s": round(trace_s, 3),
    }


# ---------------------------------------------------------------------------- one point
def method_options(method: str, time_limit_s: float, extra: Mapping[str, Mapping[str, object]]) -> dict:
    opts: dict[str, object] = {}
    if method in TIMED:
        opts["time_limit_s"] = time_limit_s
    opts.update(SOLVER_OPTIONS.get(method, {}))
    opts.update(extra.get(method, {}))
    return opts


def run_point(graph, info: dict, method: str, fraction: float, options: Mapping[str, object]) -> dict:
    """Plan ``graph`` with ``method`` at ``fraction`` of its checkpoint-all peak; one record."""
    from remat.errors import InfeasibleBudgetError, SolverError, UnsupportedGraphError
    from remat.planning import plan_graph

    ref = info["checkpoint_all_peak_bytes"]
    budget = max(1, int(fraction * ref))
    point = {"model": info["model"], "batch": info["batch"], "method": method, "fraction": fraction,
             "budget_bytes": budget, "time_limit_s": options.get("time_limit_s"),
             "options": {k: v for k, v in options.items() if k != "time_limit_s"}, "n_nodes": graph.n}
    started = time.perf_counter()
    try:
        planned = plan_graph(graph, budget, method, **options)
    except InfeasibleBudgetError as exc:
        mb = exc.min_budget_bytes
        return point | {"status": "infeasible", "wall_s": _since(started), "min_budget_bytes": mb,
                        "min_budget_fraction": None if mb is None else mb / ref}
    except UnsupportedGraphError as exc:
        return point | {"status": "not applicable", "wall_s": _since(started), "note": _first(exc)}
    except SolverError as exc:  # e.g. a time limit with no plan and no baseline that fits
        return point | {"status": "no plan", "wall_s": _since(started), "note": _first(exc)}
    r = planned.result
    base = r.graph.total_cost
    return point | {
        "status": r.status.value,
        "overhead": planned.overhead,
        "cost_us": planned.sim.total_cost,
        "peak_bytes": planned.sim.peak_bytes,
        "peak_fraction": planned.sim.peak_bytes / ref,
        "objective": r.objective,
        "lower_bound": r.lower_bound,
        "lower_bound_overhead": None if r.lower_bound is None or base <= 0 else r.lower_bound / base,
        "gap": r.gap,
        "solve_s": r.solve_s,
        "wall_s": _since(started),
        "n_nodes_solved": r.graph.n,
        "exact": getattr(planned, "exact", True),
        "note": getattr(planned, "note", ""),
        "recomputed_nodes": int(sum(c > 1 for c in planned.sim.compute_counts)),
        "backend": r.stats.backend,
        "nodes_explored": r.stats.nodes_explored,
    }


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


def _first(exc: BaseException) -> str:
    return str(exc).split(";")[0]


# ---------------------------------------------------------------------------- the sweep
def point_key(p: Mapping) -> tuple:
    """What produced a point: model, batch, method, budget, the traced graph, the planning
    code and the method's options. A stored point with another key is measured again."""
    return (p["model"], p["batch"], p["method"], round(float(p["fraction"]), 6), p.get("fingerprint"),
            p.get("planner"), p.get("time_limit_s"), json.dumps(p.get("options", {}), sort_keys=True))


def model_key(model: str, batch: int) -> str:
    return f"{model}@{batch}"


def run(models: Mapping[str, int], fractions: Sequence[float], methods: Sequence[str], time_limit_s: float,
        out: Path, *, options: Mapping[str, Mapping[str, object]] | None = None,
        trace_fn: Callable[[str, int], object] = trace_on_meta, plots: Path | None = None,
        log: Callable[[str], None] = print) -> dict:
    """Run every missing (model, fraction, method) point, writing ``out`` after each one.

    ``trace_fn(model, batch)`` returns a ``TracedStep`` or a ``Graph`` (tests pass small graphs).
    """
    results = load(out)
    results["meta"].update(time_limit_s=time_limit_s, cost_model="estimate", rates=pin_estimate_rates(out.parent),
                           **environment())
    planner = planner_version()
    for model, batch in models.items():
        key = model_key(model, batch)
        started = time.perf_counter()
        graph = trace_fn(model, batch)
        graph = getattr(graph, "graph", graph)  # a TracedStep or a Graph
        trace_s = time.perf_counter() - started
        fingerprint = graph.fingerprint()

        def wanted(f: float, m: str) -> tuple:
            opts = method_options(m, time_limit_s, options or {})
            return point_key({"model": model, "batch": batch, "method": m, "fraction": f, "fingerprint": fingerprint,
                              "planner": planner, "time_limit_s": opts.get("time_limit_s"),
                              "options": {k: v for k, v in opts.items() if k != "time_limit_s"}})

        done = {point_key(p) for p in results["points"]}
        todo = [(f, m) for f in fractions for m in methods if wanted(f, m) not in done]
        # points of these cells that other code, graphs or options produced are replaced
        stale = {(m, round(float(f), 6)) for f, m in todo}
        results["points"] = [p for p in results["points"] if not (
            p["model"] == model and p["batch"] == batch and (p["method"], round(float(p["fraction"]), 6)) in stale)]
        if not todo:
            log(f"{key}: every point done")
            continue
        info = model_info(model, batch, graph, trace_s)
        results["models"][key] = {**results["models"].get(key, {}), **info}
        save(results, out)
        log(f"{key}: {graph.n} nodes ({info['n_nodes_coarse']} after alias folding), checkpoint-all peak "
            f"{info['checkpoint_all_peak_bytes'] / 2**30:.2f} GiB, traced in {info['trace_s']:.1f} s")
        for fraction, method in todo:
            point = run_point(graph, info, method, fraction, method_options(method, time_limit_s, options or {}))
            point.update(fingerprint=fingerprint, planner=planner)
            results["points"].append(point)
            save(results, out)
            log("  " + describe(point))
        if plots is not None and any(p.get("overhead") is not None for p in _points_of(results, info)):
            results["models"][key]["plot"] = _display_path(plot_model(results, key, plots / f"{out.stem}_{model}.png"))
            save(results, out)
    return results


def describe(p: Mapping) -> str:
    head = f"{p['method']:14s} {p['fraction']:5.0%}: {p['status']:14s}"
    if p.get("overhead") is not None:
        gap = "" if p.get("gap") is None else f" gap {p['gap']:.2%}"
        return f"{head} overhead {p['overhead']:.4f}x peak {p['peak_fraction']:.0%}{gap} ({p['wall_s']:.1f} s)"
    if p["status"] == "infeasible" and p.get("min_budget_fraction") is not None:
        return f"{head} needs {p['min_budget_fraction']:.1%} ({p['wall_s']:.1f} s)"
    return f"{head} {p.get('note', '')[:100]}"


def load(out: Path) -> dict:
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", {})
    results.setdefault("models", {})
    results.setdefault("points", [])
    return results


def save(results: dict, out: Path) -> None:
    save_json(results, out)


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------- plots
def plot_model(results: dict, key: str, path: Path) -> Path:
    """Overhead against budget fraction, one line per method (remat.plotting.plot_overhead)."""
    from remat.plotting import plot_overhead
    from remat.sweep import SweepPoint

    info = results["models"][key]
    points = [SweepPoint(p["method"], p["budget_bytes"], p["fraction"],
                         {"overhead": p["overhead"], "status": p["status"]} if p.get("overhead") is not None else None)
              for p in _points_of(results, info)]
    order = {m: i for i, m in enumerate(METHODS)}
    points.sort(key=lambda p: (order.get(p.method, len(order)), p.budget_fraction))
    title = f"{info['model']}, batch {info['batch']} ({info['n_nodes']} nodes); hollow = time limit"
    return plot_overhead(points, path, title=title)


def _points_of(results: Mapping, info: Mapping) -> list[dict]:
    return [p for p in results["points"] if p["model"] == info["model"] and p["batch"] == info["batch"]]


# ---------------------------------------------------------------------------- reporting
def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def cell(p: Mapping | None) -> str:
    """One table cell: the overhead, or why there is none."""
    if p is None:
        return ""
    if p.get("overhead") is not None:
        text = f"{p['overhead']:.3f}x"
        if p["status"] not in ("optimal", "feasible"):
            gap = "" if p.get("gap") is None else f", gap {p['gap']:.1%}"
            text += f" ({p['status'].replace('_', ' ')}{gap})"
        return text
    if p["status"] == "infeasible":
        mf = p.get("min_budget_fraction")
        return "infeasible" + ("" if mf is None else f" (needs {mf:.1%})")
    if p["status"] == "not applicable":
        return "n/a"
    return p["status"]


def check(results: Mapping) -> dict:
    """Is the MILP ever worse than another method at a budget where it returned a plan, or
    without a plan where another method has one?"""
    by_cell: dict[tuple, dict[str, dict]] = {}
    for p in results["points"]:
        by_cell.setdefault((p["model"], p["batch"], round(p["fraction"], 6)), {})[p["method"]] = p
    compared, timed_out, short, violations = 0, [], [], []
    for (model, batch, fraction), cell_points in sorted(by_cell.items()):
        milp = cell_points.get("milp")
        if milp is None:
            continue
        others = {m: p for m, p in cell_points.items() if m != "milp" and p.get("overhead") is not None}
        if milp.get("overhead") is None:
            if others and milp["status"] in ("infeasible", "no plan"):
                best = min(others, key=lambda m: others[m]["overhead"])
                violations.append(f"{model} (batch {batch}) at {fraction:.0%}: milp {milp['status']} but {best} "
                                  f"has a plan ({others[best]['overhead']:.4f}x)")
            continue
        compared += 1
        if milp["status"] == "time_limit":
            timed_out.append((model, batch, fraction, milp.get("gap")))
        elif milp["status"] != "optimal":  # returned before the limit, above its bound
            short.append((model, batch, fraction, milp.get("gap")))
        for m, p in others.items():
            if milp["overhead"] > p["overhead"] * (1 + CHECK_RTOL):
                violations.append(f"{model} (batch {batch}) at {fraction:.0%}: milp {milp['overhead']:.4f}x > "
                                  f"{m} {p['overhead']:.4f}x")
    return {"compared": compared, "timed_out": timed_out, "short": short, "violations": violations}


def _gaps(points: list[tuple]) -> str:
    """``check``'s (model, batch, fraction, gap) points as "model 60%: 1.25%, ..."."""
    return ", ".join(f"{m} {f:.0%}: {'?' if g is None else f'{g:.2%}'}" for m, _, f, g in points)


def markdown(results: dict) -> str:
    """The BENCHMARKS.md section: per model a table of overheads by budget and method, the
    plot, solve times, and the check that the MILP is never worse than a baseline."""
    meta = results.get("meta", {})
    rates = meta.get("rates", {})
    limit = meta.get("time_limit_s")
    lines = [
        "## Budget sweeps on the paper's networks",
        "",
        f"`python bench/budget_sweep.py` (time limit {'?' if limit is None else f'{limit:g}'} s per `lp_round` and "
        "`milp` solve; "
        f"{meta.get('cpu_count')} CPU cores; torch {meta.get('torch')}, highspy {meta.get('highspy', '?')}). "
        "Each training step (forward, loss, backward) is traced on the meta device at the batch size shown (the "
        "paper's for its networks), so nothing is allocated; node costs come from `CostModel.ESTIMATE`, a roofline of the FLOPs torch's flop "
        "counter assigns to each op and the bytes it reads and writes, against rates measured on this machine "
        f"(matmul {rates.get('matmul_flops_per_us', 0) / 1e3:.1f} GFLOP/s, memory "
        f"{rates.get('bytes_per_us', 0) / 1e3:.1f} GB/s, {rates.get('op_overhead_us', 0):.1f} us per op). "
        "Steps at these sizes cannot be profiled on a CPU: they need tens of GiB and minutes per step, so the "
        "costs are estimates and the overheads are predictions of the simulator, not measured runs.",
        "",
        "Budgets are fractions of the checkpoint-all peak (every value kept: parameters, inputs, activations, "
        "gradients). Overhead is the plan's simulated cost over the cost of computing every node once. A method "
        "that cannot meet a budget shows the smallest fraction it can meet; `n/a`: griewank needs a linear "
        "chain. `time limit` marks a MILP or LP solve stopped by the limit (the best plan found, with the gap to "
        "the solver's lower bound).",
    ]
    methods = [m for m in METHODS if any(p["method"] == m for p in results["points"])]
    methods += sorted({p["method"] for p in results["points"]} - set(methods))
    for key, info in results["models"].items():
        points = _points_of(results, info)
        if not points:
            continue
        fractions = sorted({round(p["fraction"], 6) for p in points}, reverse=True)
        at = {(round(p["fraction"], 6), p["method"]): p for p in points}
        lines += [
            "",
            f"### {info['model']}, batch {info['batch']}",
            "",
            f"{info['n_nodes']} nodes traced ({info['n_nodes_coarse']} after alias folding, the graph the solvers "
            f"see); parameters, buffers and inputs {_gib(info['fixed_bytes'])} GiB; checkpoint-all peak "
            f"{_gib(info['checkpoint_all_peak_bytes'])} GiB; traced in {info['trace_s']:.1f} s.",
            "",
            "| budget | GiB | " + " | ".join(methods) + " |",
            "|---|---|" + "---|" * len(methods),
        ]
        for f in fractions:
            budget = next(p["budget_bytes"] for p in points if round(p["fraction"], 6) == f)
            lines.append(f"| {f:.0%} | {_gib(budget)} | " + " | ".join(cell(at.get((f, m))) for m in methods) + " |")
        grouped = sorted({(p["method"], p["n_nodes_solved"]) for p in points if p.get("exact") is False})
        if grouped:
            sizes = ", ".join(f"{m} {n}" for m, n in grouped)
            lines += ["", f"Grouped graphs (nodes the solver saw: {sizes}): a grouped graph has fewer plans than the "
                      "full one, so its optimum and gap are the grouped problem's; where a baseline on the full graph "
                      "is cheaper, its plan is returned (the JSON's `note` says so)."]
        if info.get("plot"):
            lines += ["", f"![{info['model']} overhead against budget]({info['plot']})"]
        lines += ["", "Solve time (s, wall time of `plan_graph`: alias folding, solve, expansion, simulation):", "",
                  "| budget | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for f in fractions:
            row = [("" if (p := at.get((f, m))) is None or p.get("wall_s") is None else f"{p['wall_s']:.2f}")
                   for m in methods]
            lines.append(f"| {f:.0%} | " + " | ".join(row) + " |")
    verdict = check(results)
    if verdict["compared"] or verdict["violations"]:
        timed = verdict["timed_out"]
        if verdict["violations"]:
            lines += ["", f"**Check: milp is worse than a baseline** at {len(verdict['violations'])} point(s):", ""]
            lines += [f"- {v}" for v in verdict["violations"]]
        else:
            lines += ["", f"**Check:** milp is never worse than any baseline at any budget where it returned a plan "
                      f"({verdict['compared']} budgets compared)."]
        if timed:
            lines += [f"Of those, {len(timed)} stopped at the time limit (gap to the lower bound): {_gaps(timed)}."]
        if verdict["short"]:
            lines += [f"At {len(verdict['short'])} budget(s) milp returned a plan above its lower bound before the "
                      f"time limit (status `feasible`: its search ended, or the gap was within its tolerance; the "
                      f"bound is the whole graph's unless the graph was grouped): {_gaps(verdict['short'])}."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command line
def parse_fractions(text: str) -> list[float]:
    """``"1.0,0.6"``, ``"100%,60%"`` or ``"60%:100%:3"`` -> fractions of each model's
    checkpoint-all peak, read as ``remat sweep --budgets`` reads budgets (each in (0, 1]; bytes
    do not apply: every model has its own peak). Raises ``ValueError``.

    >>> parse_fractions("100%,0.6"), parse_fractions("50%:100%:3")
    ([1.0, 0.6], [0.5, 0.75, 1.0])
    """
    from remat.cli_args import UsageError, fraction_list

    try:
        return fraction_list(text)
    except UsageError as exc:
        raise ValueError(str(exc)) from None


def select_models(text: str | None, defaults: Mapping[str, int], batch: int | None) -> dict[str, int]:
    from remat.models import names

    chosen = [m.strip() for m in text.split(",") if m.strip()] if text else list(defaults)
    if not chosen:
        raise ValueError("--models lists no model")
    known = names()
    selected: dict[str, int] = {}
    for entry in chosen:
        m, _, size = entry.partition(":")  # (model:batch, as the defaults are shown)
        if m not in known:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(known)} (optionally as model:batch)")
        if size:
            if not size.isdigit() or int(size) < 1:
                raise ValueError(f"{entry!r}: the batch size after ':' must be a positive integer")
            selected[m] = int(size)
        elif batch is not None or m in defaults:
            selected[m] = batch if batch is not None else defaults[m]
        else:
            raise ValueError(f"model {m!r} has no default batch size here; give it as {m}:BATCH or give --batch")
    return selected


def check_methods(text: str) -> list[str]:
    from remat.solvers import methods as registered

    chosen = [m.strip() for m in text.split(",") if m.strip()]
    known = registered()
    for m in chosen:
        if m not in known:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(known)}")
    if not chosen:
        raise ValueError("--methods lists no method")
    return chosen


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from remat.cli_args import Parser, add_bench_options  # (a usage error is one line, exit code 2)
    p = Parser(prog=prog or "budget_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None,
                   help=f"comma-separated workloads, each model or model:batch (default: "
                        f"{', '.join(f'{m}:{b}' for m, b in MODELS.items())})")
    p.add_argument("--batch", type=int, default=None,
                   help="one batch size for every model not given as model:batch (smoke runs; default: each "
                        "model's own, as in --models)")
    p.add_argument("--budgets", default=",".join(f"{f:.0%}" for f in FRACTIONS),
                   help="comma-separated fractions of each model's checkpoint-all peak (0.6 or 60%%), or "
                        "LOW:HIGH:COUNT evenly spaced (30%%:100%%:8); default %(default)s")
    add_bench_options(p, methods=METHODS, time_limit_s=DEFAULT_TIME_LIMIT_S, out=RESULTS,
                      out_shown=str(RESULTS.relative_to(ROOT)))
    p.add_argument("--plots", type=Path, default=None, help="folder for the plots (default bench/plots, or next to --out when --out is given)")
    p.add_argument("--plot-only", action="store_true", help="redraw the plots from the JSON")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the sweep from command-line arguments; usage errors exit 2 (``SystemExit``)."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    try:
        models = select_models(args.models, MODELS, args.batch)
        fractions = parse_fractions(args.budgets)
        methods = check_methods(args.methods)
        options = parse_solver_options(args.options)
    except ValueError as exc:
        p.error(str(exc))
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch {args.batch} must be at least 1")
    if not args.time_limit > 0:
        p.error(f"--time-limit {args.time_limit:g} must be positive")
    plots = args.plots or (PLOTS if args.out.resolve() == RESULTS else args.out.parent)
    from remat.cli_args import UsageError, check_solver_options, writable_file, writable_folder

    try:
        check_solver_options(options)
        writable_file(args.out, "--out")
        writable_folder(plots, "--plots" if args.plots else "--out (the plots go next to it)")
    except UsageError as exc:
        p.error(str(exc))
    if args.plot_only:
        if not args.out.is_file():
            p.error(f"--plot-only redraws the plots from --out {str(args.out)!r}, which does not exist; run the "
                    f"sweep without --plot-only to produce it (or give --out the results file of an earlier run)")
        try:
            load(args.out)
        except (ValueError, UnicodeDecodeError) as exc:
            p.error(f"--out {str(args.out)!r} is not a results file of this benchmark (not readable JSON: {exc})")
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    if args.plot_only:
        results = load(args.out)
        for key, info in results["models"].items():
            if any(p.get("overhead") is not None for p in _points_of(results, info)):
                info["plot"] = _display_path(plot_model(results, key, plots / f"{args.out.stem}_{info['model']}.png"))
        save(results, args.out)
    else:
        results = run(models, fractions, methods, args.time_limit, args.out, options=options, plots=plots)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
