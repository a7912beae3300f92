"""Profiled costs on a busy CPU: what other processes' load does to the plans, with and without
the contention check of ``remat.cost``.

``CostModel.PROFILE`` (``remat.optimize``'s default) times every op of the step on the thread
count the step will run with. When other processes keep the cores busy, a multi-threaded
kernel waits at each parallel region for a thread that is not running, so its time says more
about the scheduler than about the op, while single-threaded ops are hardly touched; plans made
from such costs recompute what is cheap only in the profile. ``remat.cost.Contention`` checks
for it while profiling and, once found, also times every later op on one thread and keeps the
faster median (with a warning).

Per model, in each round, in interleaved order, the step is traced (profiled) three times:

* ``quiet``: nothing else running;
* ``busy, unchecked``: ``--busy`` processes spinning in pure Python (default: one per core),
  with the check turned off (the behaviour before it);
* ``busy, checked``: the same load, the check on.

Each profile's plan is then made with the machine quiet again (``milp`` at each of
``--budgets``, fractions of checkpoint-all, or 10% above the smallest budget where one is
infeasible; ``--time-limit`` seconds), so that the search has the same time, and priced
with the quiet rounds' costs (the median of each op's quiet timings): the overhead a user
would pay for planning while the machine was busy. Also reported: each profile's total
against the quiet one's and the rank correlation of its op costs with the quiet costs.

    python bench/busy_cpu.py                 # about 4 minutes on 2 cores (5 rounds)
    python bench/busy_cpu.py --rounds 3      # quicker, noisier

Results go to ``bench/results/busy_cpu.json``; ``markdown(results)`` renders the
BENCHMARKS.md section (``python bench/report.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "busy_cpu.json"
MODELS = {"gpt2-tiny": 8}  # workload name -> batch size
BUDGETS = "0.4,0.5,0.7"  # fractions of checkpoint-all
CONDITIONS = ("quiet", "busy, unchecked", "busy, checked")
SPIN = "while True: pass"


class Load:
    """``count`` processes spinning in pure Python while the block runs."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Load:
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(self.count)]
        time.sleep(0.5)  # (let the scheduler spread them)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def _profile(name: str, batch_size: int, condition: str, busy: int, threads: int):
    """Trace ``name`` with PROFILE costs under ``condition``: (graph, seconds, warned)."""
    import logging

    import remat.cost as cost
    from remat.models import get_workload
    from remat.trace import trace

    import torch

    w = get_workload(name, batch_size)
    cost._PROFILE_CACHE.clear()
    saved_threads, ratio, warnings = torch.get_num_threads(), cost.CONTENTION_RATIO, []
    torch.set_num_threads(threads)  # (profile times ops on the caller's thread count)
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("remat.cost").addHandler(handler)
    try:
        if condition == "busy, unchecked":
            cost.CONTENTION_RATIO = math.inf
        started = time.perf_counter()
        if condition == "quiet":
            traced = trace(w.model, w.batch, w.loss_fn, cost_model=cost.CostModel.PROFILE)
        else:
            with Load(busy):
                traced = trace(w.model, w.batch, w.loss_fn, cost_model=cost.CostModel.PROFILE)
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(saved_threads)
        cost.CONTENTION_RATIO = ratio
        logging.getLogger("remat.cost").removeHandler(handler)
        cost._PROFILE_CACHE.clear()
    return traced.graph, seconds, any("oversubscribed" in m for m in warnings)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists (ties share their mean rank)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else 1.0


def measure(name: str, batch_size: int, rounds: int, busy: int, threads: int, fractions: list[float],
            time_limit_s: float) -> dict:
    from remat.backend import checkpoint_all_peak
    from remat.errors import InfeasibleBudgetError
    from remat.planning import plan_graph
    from remat.simulate import simulate

    profiles: dict[str, list] = {c: [] for c in CONDITIONS}
    for r in range(rounds):
        for condition in CONDITIONS[r % 3:] + CONDITIONS[:r % 3]:  # (each condition first in turn)
            profiles[condition].append(_profile(name, batch_size, condition, busy, threads))
            print(f"{name} round {r + 1} {condition}: {profiles[condition][-1][0].total_cost:.0f} us", flush=True)
    graphs = [g for c in CONDITIONS for g, _, _ in profiles[c]]
    names = [n.name for n in graphs[0].nodes]
    if any([n.name for n in g.nodes] != names for g in graphs):
        raise RuntimeError(f"{name}: the traces differ in their ops; profiles cannot be compared")
    quiet_costs = [statistics.median(g.nodes[i].cost for g, _, _ in profiles["quiet"]) for i in range(len(names))]
    reference = graphs[0].with_costs(quiet_costs)
    ceiling = checkpoint_all_peak(reference)
    row: dict = {"model": name, "batch": batch_size, "nodes": len(names), "quiet_total_us": reference.total_cost,
                 "profiles": {c: [{"total_vs_quiet": g.total_cost / reference.total_cost,
                                   "rank_correlation": spearman(list(g.costs), quiet_costs),
                                   "profile_s": seconds, "warned": warned} for g, seconds, warned in profiles[c]]
                              for c in CONDITIONS},
                 "budgets": []}
    for fraction in fractions:
        budget = int(fraction * ceiling)
        try:
            plan_graph(reference, budget, "milp", time_limit_s=time_limit_s)
        except InfeasibleBudgetError as exc:  # (then 10% above the smallest budget the planner states)
            budget = math.ceil(1.1 * exc.min_budget_bytes)
        point: dict = {"budget_bytes": budget, "budget_fraction": budget / ceiling, "conditions": {}}
        for condition in CONDITIONS:
            own, quiet = [], []
            for graph, _, _ in profiles[condition]:
                plan = plan_graph(graph, budget, "milp", time_limit_s=time_limit_s)
                own.append(plan.overhead)
                quiet.append(simulate(reference, plan.plan).total_cost / reference.total_cost)
            point["conditions"][condition] = {"overhead_own": own, "overhead_quiet": quiet}
        row["budgets"].append(point)
    return row


def markdown(results: dict) -> str:
    meta = results.get("meta", {})
    lines = [
        "## Profiled costs on a busy CPU (`bench/busy_cpu.py`)",
        "",
        f"Command: `{meta.get('command', 'python bench/busy_cpu.py')}`; measured {meta.get('measured', '?')}, "
        f"{meta.get('threads', '?')} profiling threads on {meta.get('cpus', '?')} cores, load: "
        f"{meta.get('busy', '?')} processes spinning in Python, {meta.get('rounds', '?')} interleaved rounds "
        "(medians). `unchecked` is the profiler without `remat.cost.Contention` (as it was before it), `checked` "
        "with it. Each profile's plan (`milp`, made with the machine quiet again, "
        f"{meta.get('time_limit_s', '?')} s) is priced with the quiet profiles' costs (each op's median): the "
        "overhead paid for having profiled while the machine was busy.",
        "",
        "| model | condition | profile total vs quiet (worst round) | rank correlation with quiet | warned | profile s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    median = statistics.median
    for row in results.get("models", []):
        for condition, runs in row["profiles"].items():
            totals = [r["total_vs_quiet"] for r in runs]
            lines.append(
                f"| {row['model']} ({row['nodes']} ops) | {condition} | {median(totals):.2f}x ({max(totals):.2f}x) | "
                f"{median([r['rank_correlation'] for r in runs]):.2f} | {sum(r['warned'] for r in runs)} of "
                f"{len(runs)} | {median([r['profile_s'] for r in runs]):.1f} |")
    lines += ["", "| model | budget | condition | plan overhead, own costs | plan overhead, quiet costs (worst round) |",
              "|---|---:|---|---:|---:|"]
    for row in results.get("models", []):
        for point in row["budgets"]:
            for condition, c in point["conditions"].items():
                lines.append(
                    f"| {row['model']} | {point['budget_fraction']:.0%} | {condition} | {median(c['overhead_own']):.3f}x | "
                    f"{median(c['overhead_quiet']):.3f}x ({max(c['overhead_quiet']):.3f}x) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from remat.cli_args import (Parser, UsageError, arg_type, fraction_list, positive_int, thread_count, time_limit,
                                writable_file)

    cpus = os.cpu_count() or 1
    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="busy_cpu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated models, from: {', '.join(MODELS)} (default %(default)s)")
    parser.add_argument("--rounds", type=arg_type(positive_int), default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--busy", type=arg_type(positive_int), default=cpus,
                        help=f"spinning processes of the load (default {cpus}: one per core)")
    parser.add_argument("--threads", type=thread_count(2, " (one thread cannot stall)"), default=2,
                        help="profiling threads (default 2)")
    parser.add_argument("--budgets", default=BUDGETS,
                        help=f"comma-separated fractions (0.5) or percentages (50%%) of checkpoint-all, or LOW:HIGH:COUNT "
                             f"evenly spaced (default {BUDGETS})")
    parser.add_argument("--time-limit", type=arg_type(time_limit), default=10.0, help="seconds per plan (default 10)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON (default bench/results/busy_cpu.json)")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown model(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    try:
        fractions = fraction_list(args.budgets)
    except UsageError as exc:
        message = str(exc)
        parser.error(message if message.startswith("--budgets") else f"--budgets {args.budgets!r}: {message}")
    try:
        writable_file(args.out, "--out")
    except UsageError as exc:
        parser.error(str(exc))
    from remat.sweep import environment, save_json

    command = " ".join(["python bench/busy_cpu.py", *(argv if argv is not None else sys.argv[1:])])
    results = {"meta": {"command": command, "measured": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
                        "busy": args.busy, "threads": args.threads, "cpus": cpus, "fractions": fractions,
                        "time_limit_s": args.time_limit, "environment": environment()},
               "models": []}
    for name in models:
        results["models"].append(measure(name, MODELS[name], args.rounds, args.busy, args.threads, fractions,
                                         args.time_limit))
        save_json(results, args.out)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
