"""The ``remat`` command: argument parsing -> public API -> printing.

Exit codes: 0 success, 1 no plan fits the budget (the message gives the smallest budget that
works), 2 bad usage. ``remat bench`` runs the benchmark scripts of a source checkout's bench/.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from remat.builders import graph_from_spec
from remat.errors import GraphError, InfeasibleBudgetError, RematError, UnsupportedGraphError
from remat.graph import Graph
from remat.solvers import methods as registered_methods
from remat.solvers import solve
from remat.sweep import SweepPoint, checkpoint_all_peak, sweep
from remat.units import format_bytes, parse_budget

EXIT_OK, EXIT_INFEASIBLE, EXIT_USAGE = 0, 1, 2
DEFAULT_SWEEP_METHODS = "checkpoint_all,recompute_all,chen_sqrtn,chen_greedy,segments,griewank,lp_round,milp"
DEMO_METHODS = "checkpoint_all,chen_sqrtn,chen_greedy,segments,lp_round,milp"
DEMO_BUDGETS = "100%,80%,65%,50%"
DEMO_BATCH = 8
DEMO_TIME_LIMIT_S = 20.0
#: `remat bench EXPERIMENT` -> the script bench/<name>.py whose main(argv) it runs.
BENCH_SCRIPTS = {"sweep": "budget_sweep", "max-batch": "max_batch"}

# Tables stay readable when output goes to a file or a CI log (rich assumes 80 columns there).
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad command-line input: reported and exit code 2."""


# ---------------------------------------------------------------- parsing
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description="Optimal tensor rematerialization for PyTorch.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("solve", help="plan one graph or model with one method under one budget")
    _add_target(p)
    p.add_argument("--budget", required=True, help="bytes, a unit (2GiB, 512MB) or a % of the checkpoint-all peak")
    p.add_argument("--method", default="milp", help="planning method (see `remat methods`)")
    _add_solver_options(p)
    p.add_argument("--run", action="store_true",
                   help="with --model: run the plan once, measure its peak and check gradients against eager")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    p = sub.add_parser("sweep", help="several methods over a range of budgets; JSON and a plot")
    _add_target(p, models=False)
    p.add_argument("--methods", default=DEFAULT_SWEEP_METHODS, help="comma-separated methods")
    p.add_argument("--budgets", default="30%:100%:8",
                   help="comma-separated budgets, or LOW:HIGH:COUNT (e.g. 30%%:100%%:8) evenly spaced")
    _add_solver_options(p)
    p.add_argument("--out", default="sweep.json", help="where to write the JSON records")
    p.add_argument("--plot", default=None, help="where to write the plot (default: next to --out, .png)")

    p = sub.add_parser("demo", help="optimize a real model with every method; table, JSON and plot")
    p.add_argument("--model", default="gpt2-tiny", help="built-in model or package.module:function")
    p.add_argument("--batch", type=int, default=DEMO_BATCH)
    p.add_argument("--budgets", default=DEMO_BUDGETS, help="comma-separated budgets (bytes, units or %%)")
    p.add_argument("--methods", default=DEMO_METHODS, help="comma-separated methods")
    p.add_argument("--costs", choices=("profile", "estimate"), default="profile")
    _add_solver_options(p)
    p.add_argument("--out", default="out/demo.json", help="where to write the JSON (the plot goes next to it)")
    p.set_defaults(time_limit=DEMO_TIME_LIMIT_S)

    sub.add_parser("methods", help="list the planning methods")

    p = sub.add_parser(
        "bench", help="run a paper benchmark from bench/ (sweep, max-batch), then regenerate BENCHMARKS.md",
        description="Run bench/budget_sweep.py (sweep) or bench/max_batch.py (max-batch) with the options "
                    "that follow, then regenerate BENCHMARKS.md (skip with --no-report). Needs a source "
                    "checkout. `remat bench sweep --help` lists the benchmark's options.")
    p.add_argument("experiment", nargs="?", choices=tuple(BENCH_SCRIPTS), help="which benchmark")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="the benchmark's own options (e.g. --models vgg16 --time-limit 30), and --no-report")
    return parser


def _add_target(p: argparse.ArgumentParser, *, models: bool = True) -> None:
    p.add_argument("--graph", help="a built-in graph: chain:N, unet:D, random:N:SEED")
    if models:
        p.add_argument("--model", help="a built-in model (mlp, cnn, gpt2-tiny, the paper's vgg16 ... segnet, "
                       "gpt2-small, gpt2-medium) or package.module:function")
        p.add_argument("--batch", type=int, default=8, help="batch size for --model (default 8)")
        p.add_argument("--costs", choices=("profile", "estimate"), default="profile",
                       help="node costs for --model: timed on this machine or FLOP/bytes estimate")


def _add_solver_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=float, default=None, help="MILP / LP time limit in seconds")
    p.add_argument("--backend", default=None, help="MILP backend: highs (default), cpsat, gurobi")


def _solver_options(method: str, args: argparse.Namespace) -> dict[str, object]:
    opts: dict[str, object] = {}
    if method in ("milp", "lp_round") and args.time_limit is not None:
        opts["time_limit_s"] = args.time_limit
    if method == "milp" and args.backend is not None:
        opts["backend"] = args.backend
    return opts


def _load_graph(args: argparse.Namespace) -> Graph:
    if getattr(args, "model", None):
        if args.graph:
            raise UsageError("give --graph or --model, not both")
        return _traced(args).graph
    if not args.graph:
        raise UsageError("say what to plan: --graph chain:32 (or unet:4, random:60:7) or --model gpt2-tiny")
    try:
        return graph_from_spec(args.graph)
    except GraphError as exc:
        raise UsageError(str(exc)) from None


def _workload(args: argparse.Namespace):
    from remat.models import WorkloadError, get_workload

    try:
        return get_workload(args.model, args.batch)
    except WorkloadError as exc:
        raise UsageError(str(exc)) from None


def _cost_model(args: argparse.Namespace):
    from remat.cost import CostModel

    return CostModel.PROFILE if args.costs == "profile" else CostModel.ESTIMATE


def _traced(args: argparse.Namespace):
    if not hasattr(args, "_traced"):
        from remat.trace import trace

        w = _workload(args)
        args._workload = w
        with _status(f"tracing {args.model} (batch {args.batch}) and measuring node costs"):
            args._traced = trace(w.model, w.batch, w.loss_fn, cost_model=_cost_model(args))
    return args._traced


def _status(message: str):
    return err.status(message, spinner="dots")


def _budget(text: str, graph: Graph) -> int:
    try:
        return parse_budget(text, checkpoint_all_peak(graph))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _budget_list(text: str, graph: Graph) -> list[int]:
    if text.count(":") == 2:
        low, high, count = text.split(":")
        try:
            k = int(count)
        except ValueError:
            raise UsageError(f"--budgets {text!r}: COUNT must be an integer") from None
        if k < 1:
            raise UsageError(f"--budgets {text!r}: COUNT must be at least 1")
        lo, hi = _budget(low, graph), _budget(high, graph)
        return [lo] if k == 1 else [round(lo + (hi - lo) * j / (k - 1)) for j in range(k)]
    return [_budget(part, graph) for part in text.split(",") if part.strip()]


def _check_methods(names: Sequence[str]) -> None:
    known = registered_methods()
    for name in names:
        if name not in known:
            raise UsageError(f"unknown method {name!r}; choose from {', '.join(known)}")


# ---------------------------------------------------------------- commands
def cmd_solve(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    _check_methods([args.method])
    budget = _budget(args.budget, graph)
    options = {args.method: _solver_options(args.method, args)}
    if args.run and not args.model:
        raise UsageError("--run needs --model: built-in graphs have no tensors to run")
    if args.model:
        from remat.compare import compare_methods

        with _status(f"planning with {args.method}" + (" and running the plan" if args.run else "")):
            comparison = compare_methods(args._workload, [budget], [args.method], options=options,
                                         run=args.run, traced=_traced(args))
        record = comparison.runs[0]
        if record.status == "infeasible":
            err.print(f"[red]no plan fits:[/red] budget {format_bytes(budget)} ({budget} B) is infeasible for "
                      f"method {args.method!r} on {args.model}: {record.note}", highlight=False)
            return EXIT_INFEASIBLE
        if record.status == "not applicable":
            raise UsageError(record.note)
        payload = {**comparison.to_json(), **comparison.to_json()["runs"][0], "peak_bytes": record.predicted_peak_bytes,
                   "cost": record.overhead * comparison.checkpoint_all_cost_us}
        payload.pop("runs")
        if args.json:
            print(json.dumps(payload))
        else:
            _print_runs(comparison)
        return EXIT_OK if record.bitwise_equal is not False else EXIT_INFEASIBLE
    result = solve(graph, budget, method=args.method, **options[args.method])
    record = result.summary()
    if args.json:
        print(json.dumps(record))
        return EXIT_OK
    table = Table(title=f"{graph.name}: {graph.n} nodes, method {args.method}")
    for col in ("budget", "peak", "cost", "overhead", "status", "gap", "solve time"):
        table.add_column(col, justify="right")
    table.add_row(
        format_bytes(budget), format_bytes(result.peak_bytes), f"{result.cost:.6g}", f"{result.overhead:.3f}x",
        result.status.value, "-" if result.gap is None else f"{result.gap:.2%}", f"{result.solve_s:.2f} s",
    )
    out.print(table)
    return EXIT_OK


def _print_runs(comparison) -> None:
    table = Table(title=(f"{comparison.workload}, batch {comparison.batch_size}: {comparison.n_nodes} nodes "
                         f"({comparison.n_nodes_reduced} after alias folding); eager PyTorch peak "
                         f"{format_bytes(comparison.eager_peak_bytes)}, checkpoint-all "
                         f"{format_bytes(comparison.checkpoint_all_peak_bytes)}"))
    for col in ("budget", "method", "status", "predicted peak", "measured peak", "overhead", "solve", "gradients"):
        table.add_column(col, justify="right")
    for r in comparison.runs:
        if r.predicted_peak_bytes is None:
            table.add_row(format_bytes(r.budget_bytes), r.method, r.status, "-", "-", "-", "-", r.note)
            continue
        measured = "-" if r.measured_peak_bytes is None else (
            f"{format_bytes(r.measured_peak_bytes)} ({r.peak_error:+.2%})")
        grads = "-" if r.bitwise_equal is None else "bitwise equal" if r.bitwise_equal else f"DIFFER ({r.note})"
        status = r.status if r.gap is None or r.gap < 1e-4 else f"{r.status} (gap {r.gap:.1%})"
        table.add_row(format_bytes(r.budget_bytes), r.label, status, format_bytes(r.predicted_peak_bytes), measured,
                      f"{r.overhead:.3f}x", f"{r.solve_s:.1f} s", grads)
    out.print(table)


def cmd_demo(args: argparse.Namespace) -> int:
    from remat.compare import compare_methods
    from remat.plotting import plot_comparison

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    _check_methods(names)
    traced = _traced(args)
    budgets = [_budget(b, traced.graph) for b in args.budgets.split(",") if b.strip()]
    options = {m: _solver_options(m, args) for m in names}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("planning and running", total=len(budgets) * len(names))
        comparison = compare_methods(
            args._workload, budgets, names, options=options, traced=traced,
            on_run=lambda r: progress.update(task, advance=1, description=f"{r.method} @ {format_bytes(r.budget_bytes)}"),
        )
    _print_runs(comparison)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(comparison.to_json(), indent=1))
    plot_path = plot_comparison(comparison, out_path.with_suffix(".png"))
    out.print(f"wrote {out_path} and {plot_path}")
    ok = all(r.bitwise_equal is not False for r in comparison.runs)
    if not ok:
        err.print("[red]some plans did not reproduce eager gradients bitwise[/red]")
    return EXIT_OK if ok else EXIT_INFEASIBLE


def cmd_sweep(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    _check_methods(names)
    budgets = _budget_list(args.budgets, graph)
    if not budgets:
        raise UsageError("--budgets lists no budget")
    options = {m: _solver_options(m, args) for m in names}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(f"sweeping {graph.name}", total=len(budgets) * len(names))

        def advance(point: SweepPoint) -> None:
            progress.update(task, advance=1, description=f"{point.method} @ {format_bytes(point.budget_bytes)}")

        points = sweep(graph, names, budgets, options=options, on_point=advance)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"graph": graph.name, "n_nodes": graph.n, "checkpoint_all_peak_bytes": checkpoint_all_peak(graph),
               "points": [p.to_json() for p in points]}
    out_path.write_text(json.dumps(payload, indent=1))
    from remat.plotting import plot_overhead

    plot_path = plot_overhead(points, args.plot or out_path.with_suffix(".png"), title=f"{graph.name} ({graph.n} nodes)")
    _print_sweep(graph, points, names)
    out.print(f"wrote {out_path} and {plot_path}")
    return EXIT_OK


def _print_sweep(graph: Graph, points: Sequence[SweepPoint], names: Sequence[str]) -> None:
    table = Table(title=f"{graph.name}: overhead by budget (- = no plan fits)")
    table.add_column("budget", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for budget in dict.fromkeys(p.budget_bytes for p in points):
        row = [f"{format_bytes(budget)}"]
        for name in names:
            p = next(q for q in points if q.budget_bytes == budget and q.method == name)
            row.append("n/a" if p.skipped else "-" if p.result is None else f"{p.result['overhead']:.3f}x")
        table.add_row(*row)
    out.print(table)


def cmd_methods(args: argparse.Namespace) -> int:
    for name in registered_methods():
        print(name)
    return EXIT_OK


def _bench_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "bench"


def _load_bench(name: str):
    """Import ``bench/<name>.py`` by path, as bench/report.py does."""
    import importlib.util

    path = _bench_dir() / f"{name}.py"
    if not path.is_file():
        raise UsageError(f"`remat bench` runs the scripts in a source checkout's bench/ folder, and {path} "
                         f"does not exist; run it from a clone of the repository (pip install -e .)")
    module_name = f"bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file loads
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _regenerate_report() -> None:
    _load_bench("report").main()


def cmd_bench(args: argparse.Namespace) -> int:
    if args.experiment is None:
        raise UsageError("say which benchmark to run: `remat bench sweep` (budget sweeps) or `remat bench "
                         "max-batch` (maximum batch size); `remat bench sweep --help` lists its options")
    options = list(args.options)
    report = "--no-report" not in options
    options = [o for o in options if o != "--no-report"]
    script = _load_bench(BENCH_SCRIPTS[args.experiment])
    try:
        code = script.main(options, prog=f"remat bench {args.experiment}")
    except SystemExit as exc:  # the script's argparse printed its usage error (or --help)
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    if code == EXIT_OK and report:
        try:
            _regenerate_report()
        except Exception as exc:  # noqa: BLE001 - another section's JSON may be mid-rewrite
            err.print(f"[red]error:[/red] the benchmark's results are written, but BENCHMARKS.md could not be "
                      f"regenerated ({type(exc).__name__}: {exc}); run `python bench/report.py` once the "
                      f"other results are complete", highlight=False)
            return EXIT_INFEASIBLE
    return code


COMMANDS = {"solve": cmd_solve, "sweep": cmd_sweep, "demo": cmd_demo, "methods": cmd_methods, "bench": cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return int(exc.code or 0)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except (UsageError, UnsupportedGraphError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        return EXIT_USAGE
    except InfeasibleBudgetError as exc:
        err.print(f"[red]no plan fits:[/red] {exc}", highlight=False)
        return EXIT_INFEASIBLE
    except RematError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        return EXIT_INFEASIBLE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
