"""Holdout models: transformers' Llama, BERT, T5, ViT and ConvNext and a GRU language model,
random weights, small enough for a CPU. Each is traced, planned at 70% and 50% of its
checkpoint-all peak, executed, and checked: measured peak (torch.profiler's allocation events,
kernel scratch included) against the prediction and the budget, gradients against eager
PyTorch. The compiled route is checked too: ``torch.compile`` with ``remat.backend("100%")``
must not peak above eager PyTorch.

    python bench/holdout.py                     # every model, about 7 minutes of CPU time
    python bench/holdout.py --models llama,gru

Memory is deterministic (nothing here is timed): costs are FLOP estimates, scratch memory is
measured. Where no method meets 50%, the models are also planned at the smallest budget a
method met, so every model runs a tight plan. Results go to ``bench/results/holdout.json``;
``markdown(results)`` renders the section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "holdout.json"
MODELS = ("llama", "bert", "t5", "vit", "convnext", "gru")
FRACTIONS = (0.7, 0.5)
METHODS = ("segments", "chen_greedy", "milp")
#: The bar: measured peak within this of the prediction (and never above the budget).
PEAK_TOLERANCE = 0.02
MIB = 2**20


def _grad_diff(got, want) -> float:
    worst = 0.0
    for key, g in want.grads.items():
        if g is not None and got.grads.get(key) is not None:
            worst = max(worst, float((got.grads[key].double() - g.double()).abs().max()))
    return max(worst, float((got.loss.double() - want.loss.double()).abs()))


def _run_plan(workload, traced, planned_graph, budget: int, want, unplanned) -> dict:
    from remat.compare import plan_source
    from remat.execute import build_module
    from remat.verify import compare, planned_step

    step = build_module(traced, planned_graph.plan)
    got, memory = planned_step(workload.model, workload.batch, traced, step)
    predicted = planned_graph.sim.peak_bytes
    return {
        "plan_method": plan_source(planned_graph, planned_graph.result.method),
        "status": planned_graph.result.status.value,
        "predicted_peak_bytes": predicted,
        "measured_peak_bytes": memory.peak_bytes,
        "measured_by": memory.method.value,
        "peak_error": (memory.peak_bytes - predicted) / predicted,
        "within_budget": memory.peak_bytes <= budget,
        "overhead": planned_graph.overhead,
        "solve_s": planned_graph.result.solve_s,
        "equal_to_unplanned_step": compare(got, unplanned).bitwise,
        "bitwise_equal_to_eager": compare(got, want).bitwise,
        "max_abs_diff_to_eager": _grad_diff(got, want),
    }


def _backend_check(workload) -> dict:
    """``torch.compile(model, backend=remat.backend("100%"))``: one step measured like eager."""
    import torch

    import remat
    from remat.cost import CostModel
    from remat.memory import measure_peak, resident_bytes_of
    from remat.scratch import ScratchModel

    torch._dynamo.reset()
    model = copy.deepcopy(workload.model)
    be = remat.backend("100%", method="segments", cache_dir=None, cost_model=CostModel.ESTIMATE,
                       scratch=ScratchModel.MEASURE)
    compiled = torch.compile(model, backend=be)

    def step() -> None:
        torch.manual_seed(0)
        workload.loss_fn(compiled, *workload.batch).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()  # compiles
    for p in model.parameters():
        p.grad = None
    resident = resident_bytes_of(list(model.parameters()), list(model.buffers()), list(workload.batch))
    measured = measure_peak(step, resident_bytes=resident)
    reports = [r for r in be.reports if r.fallback is None]
    torch._dynamo.reset()
    return {
        "measured_peak_bytes": measured.peak_bytes,
        "graphs": [str(r) for r in be.reports],
        "planned_graphs": len(reports),
        "eager_reference_bytes": [r.eager_peak_bytes for r in reports],
        "warnings": sorted({str(w.message).split(";")[0] for w in caught if "remat" in str(w.message)}),
    }


def check_model(name: str, time_limit_s: float) -> dict:
    import torch

    from remat.cost import CostModel
    from remat.errors import InfeasibleBudgetError
    from remat.models import get_workload
    from remat.models.holdout import HOLDOUT
    from remat.planning import plan_graph
    from remat.schedule import Schedule
    from remat.scratch import ScratchModel
    from remat.trace import trace
    from remat.verify import eager_step, planned_step
    from remat.execute import build_module

    started = time.perf_counter()
    _, batch_size = HOLDOUT[name]
    workload = get_workload(f"remat.models.holdout:{name}", batch_size)
    traced = trace(workload.model, workload.batch, workload.loss_fn, cost_model=CostModel.ESTIMATE,
                   scratch=ScratchModel.MEASURE)
    graph = traced.graph
    top = plan_graph(graph, 2**60, "checkpoint_all")
    want, eager_memory = eager_step(workload.model, workload.batch, workload.loss_fn)
    import numpy as np

    everything_once = build_module(traced, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph))
    unplanned, _ = planned_step(workload.model, workload.batch, traced, everything_once)
    record = {
        "batch_size": batch_size,
        "n_nodes": graph.n,
        "fixed_bytes": graph.fixed_bytes,
        "scratch_nodes": sum(1 for n in graph.nodes if n.temp_bytes),
        "largest_scratch_bytes": max(n.temp_bytes for n in graph.nodes),
        "checkpoint_all_peak_bytes": top.sim.peak_bytes,
        "eager_peak_bytes": eager_memory.peak_bytes,
        "traced_step_max_abs_diff_to_eager": _grad_diff(unplanned, want),
        "runs": [],
    }
    smallest: int | None = None

    def plan_at(budget: int, label: str) -> None:
        nonlocal smallest
        for method in METHODS:
            options = {"time_limit_s": time_limit_s} if method == "milp" else {}
            row = {"budget": label, "budget_bytes": budget, "method": method}
            try:
                planned_graph = plan_graph(graph, budget, method, **options)
            except InfeasibleBudgetError as exc:
                least = exc.min_budget_bytes
                smallest = least if smallest is None or (least is not None and least < smallest) else smallest
                record["runs"].append({**row, "status": "infeasible", "min_budget_bytes": least})
                print(f"  {name} {label} {method}: infeasible (needs {least / MIB:.2f} MiB)", flush=True)
                continue
            row.update(_run_plan(workload, traced, planned_graph, budget, want, unplanned))
            record["runs"].append(row)
            print(f"  {name} {label} {method}: {_summary(row)}", flush=True)

    for fraction in FRACTIONS:
        plan_at(int(fraction * top.sim.peak_bytes), f"{fraction:.0%}")
    tight = [r for r in record["runs"] if r["budget"] == f"{FRACTIONS[-1]:.0%}"]
    if smallest is not None and all(r["status"] == "infeasible" for r in tight):
        budget = math.ceil(smallest * 1.01)
        plan_at(budget, f"{budget / top.sim.peak_bytes:.0%} (least + 1%)")
    record["backend_100"] = _backend_check(workload)
    record["wall_s"] = round(time.perf_counter() - started, 1)
    torch.manual_seed(0)
    return record


def _summary(row: dict) -> str:
    return (f"predicted {row['predicted_peak_bytes'] / MIB:.3f} MiB, measured {row['measured_peak_bytes'] / MIB:.3f} MiB "
            f"({row['peak_error']:+.3%}), within budget {row['within_budget']}, overhead {row['overhead']:.3f}x, "
            f"gradients {'bitwise' if row['bitwise_equal_to_eager'] else 'max |diff| %.2g' % row['max_abs_diff_to_eager']}")


def main(argv: list[str] | None = None) -> int:
    from remat.cli_args import Parser, UsageError, arg_type, name_list, results_file, thread_count, time_limit

    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="holdout.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated models, from: {', '.join(MODELS)} (default: all of them)")
    parser.add_argument("--time-limit", type=arg_type(time_limit), default=30.0,
                        help="seconds per milp solve (default %(default)g)")
    parser.add_argument("--threads", type=thread_count(), default=1, help="torch intra-op threads (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the results JSON (default bench/results/holdout.json)")
    args = parser.parse_args(argv)
    try:
        chosen = name_list(args.models, MODELS)
        results = results_file(args.out, {"meta": {}, "models": {}})
    except UsageError as exc:
        parser.error(str(exc))
    import torch

    from remat.solvers import planner_version
    from remat.sweep import save_json

    torch.set_num_threads(args.threads)
    results["meta"].update(command=" ".join(["python bench/holdout.py", *(argv if argv is not None else sys.argv[1:])]),
                           threads=args.threads, torch=torch.__version__, time_limit_s=args.time_limit,
                           planner=planner_version())
    for name in chosen:
        print(f"{name}: tracing, planning and running", flush=True)
        results["models"][name] = check_model(name, args.time_limit)
        save_json(results, args.out)
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    meta = results.get("meta", {})
    lines = [
        "## Holdout models: planned, executed and measured on CPU (`bench/holdout.py`)",
        "",
        f"Command: `{meta.get('command', 'python bench/holdout.py')}` ({meta.get('threads', 1)} thread, torch "
        f"{meta.get('torch', '?')}). transformers models with random weights (Llama, BERT, T5, ViT, ConvNext) and a "
        f"GRU language model, none of them used while remat was built. Each is traced (FLOP-estimate costs, kernel "
        f"scratch memory measured per op), planned with `plan_graph` at 70% and 50% of its checkpoint-all peak "
        f"(`milp` with a {meta.get('time_limit_s', '?')} s limit, on the whole op-level graph; \"milp: X's plan\" "
        f"where a baseline's plan was the best it found), and executed once. Measured = torch.profiler's allocation "
        f"events replayed (parameters and batch included, kernel scratch included). Within budget = measured <= budget. Gradients: "
        f"loss and every gradient against an eager PyTorch step from the same weights and seed; where not bitwise, "
        f"the traced step itself (no plan) differs from eager by the same amount (float summation order).",
        "",
        "| model | nodes | checkpoint-all MiB | eager MiB | budget | method | predicted MiB | measured MiB | error | within budget | overhead | gradients vs eager |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---|---:|---|",
    ]
    worst, n, over, not_equal_to_unplanned = 0.0, 0, 0, 0
    for name, rec in results.get("models", {}).items():
        head = (f"| {name} (batch {rec['batch_size']}) | {rec['n_nodes']} | {rec['checkpoint_all_peak_bytes'] / MIB:.2f} | "
                f"{rec['eager_peak_bytes'] / MIB:.2f}")
        for run in rec["runs"]:
            label = run["method"] if run.get("plan_method") in (None, run["method"]) else f"{run['method']}: {run['plan_method']}'s plan"
            if run["status"] == "infeasible":
                least = run.get("min_budget_bytes")
                lines.append(f"{head} | {run['budget']} | {label} | infeasible: needs {least / MIB:.2f} MiB | | | | | |" if least
                             else f"{head} | {run['budget']} | {label} | infeasible | | | | | |")
                continue
            n += 1
            worst = max(worst, abs(run["peak_error"]))
            over += not run["within_budget"]
            not_equal_to_unplanned += not run["equal_to_unplanned_step"]
            grads = "bitwise" if run["bitwise_equal_to_eager"] else f"max abs diff {run['max_abs_diff_to_eager']:.1e}"
            lines.append(
                f"{head} | {run['budget']} | {label} | {run['predicted_peak_bytes'] / MIB:.3f} | "
                f"{run['measured_peak_bytes'] / MIB:.3f} | {run['peak_error']:+.3%} | {'yes' if run['within_budget'] else 'NO'} | "
                f"{run['overhead']:.3f}x | {grads} |")
    lines += ["", f"{n} executed plans: largest |measured - predicted| / predicted = {worst:.3%} "
                  f"({'within' if worst <= PEAK_TOLERANCE else 'OVER'} the {PEAK_TOLERANCE:.0%} bar); measured above the "
                  f"budget in {over}; gradients identical to the unplanned traced step in "
                  f"{'every run' if not not_equal_to_unplanned else f'all but {not_equal_to_unplanned}'}.", ""]
    lines += ["`torch.compile(model, backend=remat.backend(\"100%\", method=\"segments\"))`, one training step measured "
              "the same way: \"100%\" is the compiled region's eager peak, measured when it is compiled.", "",
              "| model | eager MiB | compiled MiB | planned graphs | note |", "|---|---:|---:|---:|---|"]
    for name, rec in results.get("models", {}).items():
        b = rec.get("backend_100")
        if not b:
            continue
        note = "; ".join(b["warnings"])[:200] or "-"
        lines.append(f"| {name} | {rec['eager_peak_bytes'] / MIB:.2f} | {b['measured_peak_bytes'] / MIB:.2f} | "
                     f"{b['planned_graphs']} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
