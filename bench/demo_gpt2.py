"""Six methods on a small transformers GPT-2: predicted vs measured peak, overhead, gradients.

    python bench/demo_gpt2.py            # writes bench/results/demo_gpt2.json and the plot
    python bench/report.py               # regenerates BENCHMARKS.md

This is the same comparison `make demo` prints, kept as a benchmark record.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "demo_gpt2.json"
PLOT = HERE / "plots" / "demo_gpt2.png"
METHODS = ("checkpoint_all", "chen_sqrtn", "chen_greedy", "segments", "lp_round", "milp")
BUDGETS = ("100%", "80%", "65%", "50%")


def run(args: argparse.Namespace) -> dict:
    import torch

    from remat.compare import compare_methods
    from remat.cost import CostModel
    from remat.models import get_workload
    from remat.plotting import plot_comparison

    torch.set_num_threads(args.threads)
    workload = get_workload("gpt2-tiny", args.batch)
    options = {"milp": {"time_limit_s": args.time_limit}, "lp_round": {"time_limit_s": args.time_limit}}
    comparison = compare_methods(workload, BUDGETS, METHODS, cost_model=CostModel.PROFILE, options=options)
    plot_comparison(comparison, PLOT)
    return {
        "command": f"python bench/demo_gpt2.py --batch {args.batch} --time-limit {args.time_limit}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s)",
        "measured_by": "profiler",
        "comparison": comparison.to_json(),
    }


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _label(run: dict) -> str:
    """What ran: the method, or ``"lp_round: segments' plan"`` when plan_graph handed back a
    full-graph baseline's plan (records written before ``label`` existed say so in their note)."""
    if "label" in run:
        return run["label"]
    match = re.match(r"(\w+) on the full graph is cheaper", run.get("note") or "")
    return f"{run['method']}: {match.group(1)}'s plan" if match and match.group(1) != run["method"] else run["method"]


def markdown(results: dict) -> str:
    c = results["comparison"]
    lines = [
        "## Six methods on a small GPT-2 (the demo)",
        "",
        f"`{results['command']}` on {results['machine']}. transformers GPT-2, {c['n_nodes']} traced nodes "
        f"({c['n_nodes_reduced']} after folding aliases), batch {c['batch_size']}, dropout 0.1, costs profiled "
        f"on this machine. Eager PyTorch peak {_mib(c['eager_peak_bytes'])} MiB; checkpoint-all "
        f"{_mib(c['checkpoint_all_peak_bytes'])} MiB (fixed: {_mib(c['fixed_bytes'])} MiB of parameters and batch). "
        + ("Measured by torch.profiler's allocation events, kernel scratch included (measured per op and planned for)."
           if results.get("measured_by") == "profiler" else
           "Measured by the allocation tracker of op outputs, before kernel scratch was modelled: rerun the "
           "script to measure with the profiler."),
        "",
        "| budget (MiB) | method | status | predicted peak (MiB) | measured peak (MiB) | overhead | solve (s) | gradients vs eager |",
        "|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in c["runs"]:
        if r["predicted_peak_bytes"] is None:
            lines.append(f"| {_mib(r['budget_bytes'])} | {r['method']} | {r['status']} | - | - | - | - | {r['note']} |")
            continue
        gap = "" if r["gap"] is None or r["gap"] < 1e-4 else f" (gap {r['gap']:.1%})"
        grads = "bitwise equal" if r["bitwise_equal"] else f"differ: {r['note']}"
        lines.append(
            f"| {_mib(r['budget_bytes'])} | {_label(r)} | {r['status']}{gap} | {_mib(r['predicted_peak_bytes'])} | "
            f"{_mib(r['measured_peak_bytes'])} | {r['overhead']:.3f}x | {r['solve_s']:.1f} | {grads} |"
        )
    errors = [abs(r["peak_error"]) for r in c["runs"] if r.get("peak_error") is not None]
    if errors:
        lines += ["", f"Worst |measured - predicted| peak: {max(errors):.4%} over {len(errors)} executed plans."]
    lines += ["", "![demo](bench/plots/demo_gpt2.png)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from remat.cli_args import Parser, arg_type, positive_int, thread_count, time_limit

    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="demo_gpt2.py", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=arg_type(positive_int), default=8, help="batch size (default %(default)s)")
    parser.add_argument("--time-limit", type=arg_type(time_limit), default=20.0,
                        help="MILP / LP time limit per solve, in seconds (default %(default)g)")
    parser.add_argument("--threads", type=thread_count(), default=1, help="torch intra-op threads (default %(default)s)")
    args = parser.parse_args(argv)
    results = run(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
