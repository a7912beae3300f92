"""The ``remat`` command: argument parsing -> public API -> printing.

Exit codes: 0 success, 1 no plan fits the budget (the message gives the smallest budget that
works), 2 bad usage. ``remat bench`` runs the benchmark scripts of a source checkout's bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from remat.builders import graph_from_spec
from remat.cli_args import (
    BENCH_SCRIPTS,
    EXIT_INFEASIBLE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    budget_list,
    budget_of,
    build_parser,
    check_backend,
    check_methods,
    default_sweep_methods,
    json_path,
    method_list,
    plot_path,
    resolve_target,
    solver_options,
    writable_file,
)
from remat.errors import GraphError, InfeasibleBudgetError, RematError, UnsupportedGraphError, user_line
from remat.graph import Graph
from remat.solvers import methods as registered_methods
from remat.solvers import solve
from remat.sweep import ResultStore, SweepPoint, checkpoint_all_peak, run_interruptibly, sweep
from remat.units import format_bytes, format_bytes_exactly, percent_hint, percent_meant, read_budget

# Tables stay readable when output goes to a file or a CI log (rich assumes 80 columns there).
# No markup or emoji codes: what is printed quotes the user's arguments, paths and source lines
# ("[/]" in a method name raised rich's markup error; "x[idx]" in a quoted line disappeared).
out = Console(width=None if sys.stdout is not None and sys.stdout.isatty() else 160, markup=False, emoji=False)
err = Console(stderr=True, soft_wrap=True, markup=False, emoji=False)


def _labelled(label: str, text: str) -> Text:
    """``label`` in red, then ``text`` as it is."""
    return Text.assemble((label, "red"), " ", text)


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C, already reported by the command."""


def _load_graph(args: argparse.Namespace) -> Graph:
    if getattr(args, "model", None):
        if args.graph:
            raise UsageError("give --graph or --model, not both")
        return _traced(args).graph
    if not args.graph:
        raise UsageError("say what to plan: --graph chain:32 (or unet:4, random:60:7)"
                         + (" or --model gpt2-tiny" if hasattr(args, "model") else ""))
    try:
        return graph_from_spec(args.graph)
    except GraphError as exc:
        raise UsageError(str(exc)) from None


@contextlib.contextmanager
def _current_directory_importable():
    """The current directory on ``sys.path`` (first, as ``python -m`` puts it) while a
    ``--model package.module:function`` is imported and called: the ``remat`` script's
    ``sys.path`` starts with its own folder, not the one it runs in. Taken off again after."""
    cwd = os.getcwd()
    if any(isinstance(entry, str) and os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # (the module took it off itself)
            sys.path.remove(cwd)


def _workload(args: argparse.Namespace, *, meta: bool = False):
    import torch

    from remat.models import WorkloadError, get_workload

    try:
        with _current_directory_importable(), torch.device("meta") if meta else contextlib.nullcontext():
            return get_workload(args.model, args.batch, searched="in the current directory or on PYTHONPATH")
    except WorkloadError as exc:
        raise UsageError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a user's factory failed: say which and how it should look
        if ":" not in args.model:
            raise
        where = user_line(exc)
        raise UsageError(f"--model {args.model!r}: calling it with the batch size failed{where} ({type(exc).__name__}: "
                         f"{exc}); a model spec names `def make(batch_size: int) -> remat.models.Workload`") from None


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: Python's, the CPU allocator's (a ``RuntimeError`` saying it
    cannot allocate) or a device's (``torch.OutOfMemoryError``)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def _on_meta(args: argparse.Namespace) -> bool:
    """Estimated costs need no data: trace on the meta device unless the plan is to be run."""
    return args.command == "solve" and args.costs == "estimate" and not args.run


def _traced(args: argparse.Namespace):
    if not hasattr(args, "_traced"):
        from remat.cost import CostModel
        from remat.trace import trace

        meta = _on_meta(args)
        w = _workload(args, meta=True) if meta else _workload(args)  # (an unknown model is refused first)
        if meta:
            err.print(f"tracing {args.model} (batch {args.batch}) on the meta device: costs are estimated from "
                      f"FLOPs and bytes, no tensor is allocated, and kernel scratch memory is not counted (peaks "
                      f"may be under what the step allocates; --run traces real tensors and counts it)",
                      highlight=False)
        else:
            what = "and timing every node" if args.costs == "profile" else "with estimated costs"
            err.print(f"tracing {args.model} (batch {args.batch}) on real tensors {what}", highlight=False)
        args._workload = w
        cost_model = CostModel.PROFILE if args.costs == "profile" else CostModel.ESTIMATE
        if cost_model is CostModel.ESTIMATE:
            _pin_rates()
        with _activity(f"tracing {args.model}"):
            args._traced = trace(w.model, w.batch, w.loss_fn, cost_model=cost_model, name=args.model)
        graph = args._traced.graph
        err.print(f"traced {graph.n} nodes; checkpoint-all peak {format_bytes(checkpoint_all_peak(graph))}",
                  highlight=False)
    return args._traced


def _pin_rates() -> None:
    """Estimated costs divide by this machine's rates: read them from the user's cache (or
    measure and keep them there), so that runs on one machine give the same costs."""
    from remat.backend_cache import estimate_rates_file
    from remat.cost import machine_rates

    def changed() -> int | None:
        return path.stat().st_mtime_ns if path.exists() else None

    path = estimate_rates_file()
    before = changed()
    machine_rates("cpu", cache_path=path)
    after = changed()
    if after is None:  # (the warning said why)
        err.print("estimated costs use this machine's rates, measured for this run only", highlight=False)
        return
    verb = "read from" if after == before else "measured, kept in"
    err.print(f"estimated costs use this machine's rates, {verb} {path} (delete it to measure them again)",
              highlight=False)


class _ShowLatest(logging.Handler):
    """Shows remat's latest log message (solver incumbents, bounds) in the status line."""

    def __init__(self, status, prefix: str) -> None:
        super().__init__(logging.INFO)
        self.status, self.prefix = status, prefix

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:  # (kept on screen, not only in the passing status line)
            self.status.console.print(f"warning: {record.getMessage()}", highlight=False, markup=False)
            return
        self.status.update(f"{self.prefix}: {record.getMessage()[:120]}")


@contextlib.contextmanager
def _native_stdout_to_stderr():
    """Native libraries write to file descriptor 1 directly (HiGHS prints a banner when it
    starts); while they run it points to stderr, so stdout holds only tables and --json."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no usable descriptors (embedded interpreters)
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).fflush(None)  # what C code buffered goes to stderr too
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def _activity(message: str):
    """A status line for long work that also shows remat's progress messages (INFO logs)."""
    logger = logging.getLogger("remat")
    with _native_stdout_to_stderr(), err.status(message, spinner="dots") as status:
        handler = _ShowLatest(status, message)
        level, propagate = logger.level, logger.propagate
        quiet = logger.getEffectiveLevel() > logging.INFO  # without -v, show progress here only
        logger.addHandler(handler)
        if quiet:
            logger.setLevel(logging.INFO)
            logger.propagate = False
        try:
            yield status
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


# ---------------------------------------------------------------- commands
#: The solver flags ``solver_options`` passes on: (flag, its value, the option it becomes, the
#: methods that take it, in words), so that ``solve`` can say which its method ignores.
_SOLVER_FLAGS = (("--time-limit", lambda a: a.time_limit, "time_limit_s", "milp and lp_round take"),
                 ("--backend", lambda a: a.backend, "backend", "milp takes"))


def cmd_solve(args: argparse.Namespace) -> int:
    check_methods([args.method])
    if args.run and not args.model:
        raise UsageError("--run needs --model: built-in graphs have no tensors to run")
    options = solver_options(args.method, args)
    unused = [f"{flag} (which {takers})" for flag, given, option, takers in _SOLVER_FLAGS
              if given(args) is not None and option not in options]
    if unused:
        err.print(f"note: method {args.method!r} ignores {' and '.join(unused)}", highlight=False)
    graph = _load_graph(args)
    budget = budget_of(args.budget, graph)
    if args.model and args.run:
        return _solve_and_run(args, budget, options)
    if args.model:
        return _solve_model(args, graph, budget, options)
    try:
        with _activity(f"planning {graph.name} with {args.method}"):
            result = run_interruptibly(lambda: solve(graph, budget, method=args.method, **options))
    except InfeasibleBudgetError as exc:
        if args.json:  # (on stdout: outside the activity, which sends native output to stderr)
            _print_infeasible(args, graph, budget, exc.min_budget_bytes)
        raise _hinted(exc, args) from None  # (the message on stderr, exit code 1)
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


def _solve_model(args: argparse.Namespace, graph: Graph, budget: int, options: dict[str, object]) -> int:
    """Plan a traced model (``plan_graph``: reduction, full-graph baselines) without running it."""
    from remat.planning import plan_graph

    reference = checkpoint_all_peak(graph)
    try:
        with _activity(f"planning {args.model} with {args.method}"):
            planned = run_interruptibly(lambda: plan_graph(graph, budget, method=args.method, **options))
    except InfeasibleBudgetError as exc:
        least = exc.min_budget_bytes
        by = "" if args.method == "milp" else f"with method {args.method!r}, "  # (another may need less)
        needs = "" if least is None else (f"; {by}{args.model} at batch {args.batch} needs at least "
                                          f"{format_bytes(least)} ({_percent_at_least(least, reference)} of "
                                          f"checkpoint-all)")
        if args.json:  # (on stdout: outside the activity, which sends native output to stderr)
            _print_infeasible(args, graph, budget, least)
        err.print(_labelled("no plan fits:", f"{_hinted(exc, args)}{needs}"), highlight=False)
        return EXIT_INFEASIBLE
    r = planned.result
    record = {
        **r.summary(), "graph": graph.name, "n_nodes": graph.n, "model": args.model, "batch": args.batch,
        "costs": args.costs, "traced_on": "meta" if _on_meta(args) else "cpu", "budget_bytes": budget,
        "peak_bytes": planned.sim.peak_bytes, "predicted_peak_bytes": planned.sim.peak_bytes,
        "cost": planned.sim.total_cost, "overhead": planned.overhead, "checkpoint_all_peak_bytes": reference,
        "recomputed_nodes": int(sum(c > 1 for c in planned.sim.compute_counts)), "note": planned.note,
    }
    if args.json:
        print(json.dumps(record))
        return EXIT_OK
    table = Table(title=f"{args.model}, batch {args.batch}: {graph.n} nodes, method {args.method}; checkpoint-all "
                        f"peak {format_bytes(reference)}")
    for col in ("budget", "predicted peak", "overhead", "status", "gap", "solve time"):
        table.add_column(col, justify="right")
    table.add_row(f"{format_bytes(budget)} ({budget / reference:.0%})", format_bytes(planned.sim.peak_bytes),
                  f"{planned.overhead:.3f}x", r.status.value, "-" if r.gap is None else f"{r.gap:.2%}",
                  f"{r.solve_s:.2f} s")
    out.print(table)
    if planned.note:
        out.print(planned.note, highlight=False)
    return EXIT_OK


def _solve_and_run(args: argparse.Namespace, budget: int, options: dict[str, object]) -> int:
    from remat.compare import compare_methods

    with _activity(f"planning with {args.method} and running the plan"):
        comparison = compare_methods(args._workload, [budget], [args.method], options={args.method: options},
                                     run=True, traced=_traced(args))
    record = comparison.runs[0]
    if record.status == "infeasible":
        if args.json:
            _print_infeasible(args, _traced(args).graph, budget, record.min_budget_bytes,
                              reference=comparison.checkpoint_all_peak_bytes)
        hint = percent_hint(args.budget, _BUDGET_SPELLED)
        err.print(_labelled("no plan fits:", f"budget {format_bytes_exactly(budget)} is infeasible for "
                            f"method {args.method!r} on {args.model}: {record.note}{f' ({hint})' if hint else ''}"),
                  highlight=False)
        return EXIT_INFEASIBLE
    if record.status == "not applicable":
        raise UsageError(record.note)
    if record.predicted_peak_bytes is None:  # no plan (a time limit with none found): the solver's note
        err.print(_labelled("error:", f"method {args.method!r} found no plan for {args.model} under "
                            f"{format_bytes_exactly(budget)}: {record.note}"), highlight=False)
        return EXIT_INFEASIBLE
    payload = {**comparison.to_json(), **comparison.to_json()["runs"][0], "peak_bytes": record.predicted_peak_bytes,
               "cost": record.overhead * comparison.checkpoint_all_cost_us}
    payload.pop("runs")
    if args.json:
        print(json.dumps(payload))
    else:
        _print_runs(comparison)
    return EXIT_OK if record.bitwise_equal is not False else EXIT_INFEASIBLE


#: How ``percent_hint`` spells a budget of `remat solve`.
_BUDGET_SPELLED = "--budget {}"


def _hinted(exc: InfeasibleBudgetError, args: argparse.Namespace) -> InfeasibleBudgetError:
    """``exc``, saying how to ask for a percentage where --budget was a bare whole number up to
    100, which is bytes (as ``optimize`` says it for ``budget="60"``)."""
    hint = percent_hint(args.budget, _BUDGET_SPELLED)
    return exc.with_detail(hint) if hint else exc


def _note_bytes_meant_as_percent(text: str, no_plan: Sequence[int]) -> None:
    """After a sweep or demo: where --budgets ``text`` names a bare whole number up to 100
    (bytes, as documented; ``percent_meant``) and no plan fits at it, how to ask for
    percentages instead."""
    ranged = text.count(":") == 2
    parts = text.split(":")[:2] if ranged else text.split(",")
    bare = list(dict.fromkeys(part.strip() for part in parts if percent_meant(part) is not None))
    if not {percent_meant(part) for part in bare} & set(no_plan):
        return
    written = [f"{part.strip()}%" if part.strip() in bare else part.strip() for part in parts if part.strip()]
    written = ":".join([*written, text.split(":")[2].strip()]) if ranged else ",".join(written)
    listed = bare[0] if len(bare) == 1 else f"{', '.join(bare[:-1])} and {bare[-1]}"
    err.print(f"note: --budgets {text!r} reads {listed} as bytes; for percentages of the checkpoint-all peak write "
              f"--budgets {written}", highlight=False)


def _print_infeasible(args: argparse.Namespace, graph: Graph, budget: int, least: int | None, *,
                      reference: int | None = None) -> None:
    """``--json`` when no plan fits: the status, the budget asked for and the smallest budget
    the method can meet (null when it has none), on stdout; the message goes to stderr."""
    reference = checkpoint_all_peak(graph) if reference is None else reference
    record: dict[str, object] = {"graph": graph.name, "n_nodes": graph.n, "method": args.method,
                                 "status": "infeasible", "budget_bytes": budget, "min_budget_bytes": least,
                                 "checkpoint_all_peak_bytes": reference, "budget_fraction": budget / reference,
                                 "min_budget_fraction": None if least is None else least / reference}
    if getattr(args, "model", None):
        record.update(model=args.model, batch=args.batch, costs=args.costs)
    print(json.dumps(record))


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


@contextlib.contextmanager
def _progress():
    columns = TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    with _native_stdout_to_stderr(), Progress(*columns, console=err, transient=True) as progress:
        yield progress


def cmd_demo(args: argparse.Namespace) -> int:
    names = method_list(args.methods)
    out_path = writable_file(json_path(args.out, plot_option=False), "--out")
    writable_file(out_path.with_suffix(".png"), "--out (its plot, .png)")
    budget_list(args.budgets, None)  # checked before the model is traced
    from remat.compare import compare_methods
    from remat.plotting import plot_comparison
    traced = _traced(args)
    budgets = budget_list(args.budgets, traced.graph)
    options = {m: solver_options(m, args) for m in names}
    with _progress() as progress:
        task = progress.add_task("planning and running", total=len(budgets) * len(names))
        comparison = compare_methods(
            args._workload, budgets, names, options=options, traced=traced,
            on_run=lambda r: progress.update(task, advance=1, description=f"{r.method} @ {format_bytes(r.budget_bytes)}"),
        )
    _print_runs(comparison)
    _note_bytes_meant_as_percent(args.budgets, [r.budget_bytes for r in comparison.runs if r.status == "infeasible"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(comparison.to_json(), indent=1))
    plot_file = plot_comparison(comparison, out_path.with_suffix(".png"))
    out.print(f"wrote {out_path} and {plot_file}")
    ok = all(r.bitwise_equal is not False for r in comparison.runs)
    if not ok:
        err.print(Text("some plans did not reproduce eager gradients bitwise", "red"))
    return EXIT_OK if ok else EXIT_INFEASIBLE


def cmd_sweep(args: argparse.Namespace) -> int:
    names = method_list(default_sweep_methods() if args.methods is None else args.methods)
    out_path = writable_file(json_path(args.out), "--out")
    plot_file = writable_file(plot_path(args.plot, out_path), "--plot" if args.plot else "--out (its plot, .png)")
    graph = _load_graph(args)
    budgets = budget_list(args.budgets, graph)
    options = {m: solver_options(m, args) for m in names}
    try:
        store = ResultStore(out_path)
    except ValueError as exc:
        raise UsageError(f"--out: {exc}") from None
    reference = checkpoint_all_peak(graph)
    store.meta.setdefault("graphs", {})[graph.fingerprint()] = {
        "name": graph.name, "n_nodes": graph.n, "checkpoint_all_peak_bytes": reference}
    total = len(budgets) * len(names)
    done: list[SweepPoint] = []
    with _progress() as progress:
        task = progress.add_task(f"sweeping {graph.name}", total=total)

        def advance(point: SweepPoint) -> None:
            done.append(point)
            progress.update(task, advance=1, description=f"{point.method} @ {format_bytes(point.budget_bytes)}")

        try:
            points = sweep(graph, names, budgets, options=options, on_point=advance, store=store)
        except KeyboardInterrupt:
            progress.stop()
            err.print(f"interrupted: {len(done)} of {total} points are in {out_path}; run the same command again "
                      f"to resume" if done else f"interrupted before the first point was done: nothing was written "
                      f"to {out_path}", highlight=False)
            raise _Interrupted from None
    store.save()  # the graph's record in meta, also when every point was already there
    resumed = sum(p.read_back for p in points)
    if resumed:
        err.print(f"{resumed} of {total} points read back from {out_path} (same graph, method, options and "
                  f"remat version); delete it to solve them again", highlight=False)
    from remat.plotting import plot_overhead

    _print_sweep(graph, points, names, reference)  # (first: a plot that fails loses nothing)
    _note_bytes_meant_as_percent(args.budgets, [p.budget_bytes for p in points if p.result is None and not p.skipped])
    plot_overhead(points, plot_file, title=f"{graph.name} ({graph.n} nodes)")
    out.print(f"wrote {out_path} and {plot_file}")
    return EXIT_OK


def _print_sweep(graph: Graph, points: Sequence[SweepPoint], names: Sequence[str], reference: int) -> None:
    table = Table(title=f"{graph.name}: overhead by budget (needs X% = no plan fits below X% of the checkpoint-all "
                        f"peak)")
    table.add_column("budget", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for budget in dict.fromkeys(p.budget_bytes for p in points):
        row = [f"{format_bytes(budget)} ({budget / reference:.0%})"]
        for name in names:
            p = next(q for q in points if q.budget_bytes == budget and q.method == name)
            row.append(_sweep_cell(p, reference, [q for q in points if q.method == name]))
        table.add_row(*row)
    out.print(table)


def _sweep_cell(p: SweepPoint, reference: int, column: Sequence[SweepPoint] = ()) -> str:
    if p.skipped:
        return "n/a"
    if p.result is not None:
        return f"{p.result['overhead']:.3f}x"
    if p.min_budget_bytes is None:
        return "no plan"
    # (as many decimals in every row as the highest budget it is shown against needs: not
    # 'needs 100.0%' at 90% and 'needs 100.02%' at 100% for one smallest budget)
    failed = max([q.budget_bytes for q in column if q.result is None and not q.skipped
                  and q.min_budget_bytes == p.min_budget_bytes] + [p.budget_bytes])
    return f"needs {_needs_shown(p.min_budget_bytes, failed, reference)}"


def _needs_shown(least: int, budget: int, reference: int) -> str:
    """The smallest feasible budget as a percentage of ``reference`` with as many decimals as
    it takes to show it above the budget that failed (as given and as its row shows it: 0
    decimals); in bytes where no percentage would (5714242 B against 5713218 B is 100.018%),
    and above the reference (a percentage over 100% is not a budget one can ask for)."""
    if least > reference:
        return format_bytes_exactly(least)
    budget_pct = 100 * budget / reference
    shown_budget = float(f"{budget_pct:.0f}")
    for digits in range(1, 4):  # (as many as tell it from the budget; then rounded up, so that it plans)
        if float(f"{100 * least / reference:.{digits}f}") > max(budget_pct, shown_budget):
            return _percent_at_least(least, reference, digits)
    return format_bytes_exactly(least)


def _percent_at_least(least: int, reference: int, digits: int = 1) -> str:
    """``least`` bytes as a percentage of ``reference`` with ``digits`` decimals, rounded up so
    that asking for it gives at least ``least`` bytes (44.4% of a peak, shown for a need of
    44.43%, was refused when asked for)."""
    value = math.ceil(100 * least / reference * 10**digits) / 10**digits
    while value <= 100 and read_budget(f"{value:.{digits}f}%").resolve(reference) < least:
        value += 10**-digits  # (the fraction's bytes are rounded down)
    return f"{value:.{digits}f}%"


#: One line per method for ``remat methods`` (the README's table says more).
METHOD_SUMMARIES = {
    "checkpoint_all": "keep every activation: no recomputation (the reference cost)",
    "recompute_all": "keep only the previous stage's value and recompute the rest when needed",
    "chen_sqrtn": "Chen et al.: a checkpoint every ~sqrt(n) candidate nodes",
    "chen_greedy": "Chen's greedy segmentation, its memory threshold searched to meet the budget",
    "segments": "keep what crosses block boundaries, recompute each block once (torch.utils.checkpoint per block)",
    "nested": "block boundaries at two or three levels of recomputation",
    "chain": "a dynamic programme over the chain of blocks, at as many levels as pay off (as revolve and rotor)",
    "griewank": "revolve (binomial checkpointing), for linear chains",
    "descent": "op-level local search: from checkpoint-all, recompute what the peak holds until the plan fits",
    "lp_round": "an LP relaxation with rounding",
    "milp": "the cheapest plan found, with a lower bound for the whole graph and the gap to it (the default)",
}


def cmd_methods(args: argparse.Namespace) -> int:
    names = registered_methods()
    width = max(map(len, names), default=0)
    for name in names:  # (the name first: `remat methods | cut -d' ' -f1` lists them)
        summary = METHOD_SUMMARIES.get(name, "")
        print(f"{name:<{width}}  {summary}".rstrip())
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
            err.print(_labelled("error:", f"the benchmark's results are written, but BENCHMARKS.md could not be "
                                f"regenerated ({type(exc).__name__}: {exc}); run `python bench/report.py` once the "
                                f"other results are complete"), highlight=False)
            return EXIT_INFEASIBLE
    return code


COMMANDS = {"solve": cmd_solve, "sweep": cmd_sweep, "demo": cmd_demo, "methods": cmd_methods, "bench": cmd_bench}


@contextlib.contextmanager
def _least_peak_kept(keep: bool):
    """With ``keep``, the least-peak plans of earlier runs are handed to the planner first, and
    those this run finds are kept for the next (``backend_cache.least_peak_dir``): the smallest
    budget an error states comes from time-limited searches, and asked for in a new process with
    the same time limit it was refused (the next search found a larger one)."""
    if not keep:
        yield
        return
    from remat.backend_cache import least_peak_dir, load_least_peak, store_least_peak
    from remat.solvers.prepared import least_peak_records

    directory = least_peak_dir()
    load_least_peak(directory)
    known = least_peak_records()
    try:
        yield
    finally:
        store_least_peak(directory, known)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error (or the help)
        return int(exc.code or 0)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        resolve_target(args)
        check_backend(getattr(args, "backend", None))  # (one not installed: before any work)
        with _least_peak_kept(args.command in ("solve", "sweep")):
            return COMMANDS[args.command](args)
    except (UsageError, UnsupportedGraphError) as exc:
        err.print(_labelled("error:", str(exc)), highlight=False)
        return EXIT_USAGE
    except InfeasibleBudgetError as exc:
        err.print(_labelled("no plan fits:", str(exc)), highlight=False)
        return EXIT_INFEASIBLE
    except RematError as exc:
        err.print(_labelled("error:", str(exc)), highlight=False)
        return EXIT_INFEASIBLE
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        hint = (" with a smaller --batch, or with --costs estimate, which traces on the meta device without "
                "allocating" if getattr(args, "model", None) else "")
        err.print(_labelled("error:", f"out of memory: {first}; try again{hint}"), highlight=False)
        return EXIT_INFEASIBLE
    except BrokenPipeError:  # the reader of the output went away (`| head`): nothing to say
        _quiet_stdout()
        return EXIT_INFEASIBLE
    except OSError as exc:  # writing the output failed (a full disk, a closed stream)
        _quiet_stdout()
        err.print(_labelled("error:", f"could not finish: {exc}"), highlight=False)
        return EXIT_INFEASIBLE
    except KeyboardInterrupt as exc:
        if not isinstance(exc, _Interrupted):
            err.print("interrupted", highlight=False)
        # A solver thread in C code cannot be stopped, and a solver's own threads torn down at
        # interpreter exit abort the process: leave without finalizing (every result file was
        # written atomically already).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)


def _quiet_stdout() -> None:
    """Send what is left of standard output to the null device, so that the interpreter's last
    flush does not fail a second time."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # (no stdout at all)
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

