"""The host time of a planned step against eager PyTorch, where the host is what limits it.

On a GPU, a step whose kernels are short runs as fast as Python can issue them: there, what
remat adds per step in Python (checking the model against its trace, collecting the step's
inputs, handing out gradients and buffer updates) and per op (running the plan's
instructions) is what the step costs. This measures it on CPU with models whose ops are tiny,
so that the step's time is the host's:

* ``residual-cnn``: 24 residual blocks of two 3x3 convolutions (8 channels) with batch norms,
  batch 4 of 8x8 images; 196 parameters, 144 buffers;
* ``gpt2-tiny``: remat's built-in tiny GPT-2 (2 layers, width 64, dropout 0.1), batch 8 of 32
  tokens.

Variants, per model: eager PyTorch (``loss.backward()``), and at budgets of 100% (no
recomputation: remat's own overhead alone) and 60% of checkpoint-all:

* ``remat step``: ``remat.optimize(...)(batch)`` as users call it (the plan runs as Python code
  generated for it);
* ``instructions stepped``: the same step with the plan's instructions stepped through one by
  one (``PlannedStep.interpret``, how plans ran before the generated code);
* ``bookkeeping only``: the same step with the plan's ops replaced by their stored outputs:
  what the step does around the plan.

Timing hygiene: one intra-op thread (``--threads``), all variants interleaved in each round,
medians over ``--rounds`` rounds; ratios are to eager in the same run.

    python bench/step_overhead.py                # ~2 minutes on 2 cores
    python bench/step_overhead.py --rounds 10    # quicker, noisier

Results go to ``bench/results/step_overhead.json``, the plot to
``bench/plots/step_overhead.png``; ``markdown(results)`` renders the BENCHMARKS.md section
(``python bench/report.py``). ``--replot`` redraws both from the JSON. A run of some models
(``--models gpt2-tiny``) measures those again and keeps the other models' stored rows; each
row names the run that measured it (``run``: command, threads, rounds, date, environment), and
the file's ``meta`` holds only what every row's run shares.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "step_overhead.json"
PLOT = HERE / "plots" / "step_overhead.png"
MODELS = ("residual-cnn", "gpt2-tiny")
BUDGETS = ("100%", "60%")
VARIANTS = ("remat step", "instructions stepped", "bookkeeping only")


def _residual_cnn():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

        def forward(self, x):
            return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[Block(8) for _ in range(24)], nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    batch = (torch.randn(4, 3, 8, 8), torch.tensor([1, 3, 0, 2]))
    return model, batch, lambda m, x, y: F.cross_entropy(m(x), y)


def _workload(name: str):
    if name == "residual-cnn":
        return _residual_cnn()
    from remat.models import get_workload

    w = get_workload(name, 8)
    return w.model, w.batch, w.loss_fn


class _StoredOutputs:
    """Stands in for a planned step's program: returns what one real run returned."""

    def __init__(self, outputs: tuple) -> None:
        self.outputs = outputs

    def __call__(self, *flat_inputs):
        return self.outputs


def measure(name: str, rounds: int) -> dict:
    import torch

    import remat

    model, batch, loss_fn = _workload(name)
    calls = {}

    def eager():
        model.zero_grad(set_to_none=True)
        loss_fn(model, *batch).backward()

    calls["eager"] = eager
    plans = {}
    for budget in BUDGETS:
        step = remat.optimize(model, batch, loss_fn, budget=budget, method="milp", time_limit_s=30)
        plans[budget] = {"overhead": step.report.overhead, "recomputed_nodes": step.report.recomputed_nodes,
                         "nodes": step.report.n_nodes, "instructions": len(step.planned.program)}
        planned = step.planned
        stepped = remat.TrainingStep(model, step.traced, step.plan, planned, step.report)
        stepped.planned = lambda *flat, p=planned: p.interpret(flat)
        stored = remat.TrainingStep(model, step.traced, step.plan, planned, step.report)
        stored.planned = _StoredOutputs(planned(*step.traced.flat_inputs(model, batch)))
        for variant, s in zip(VARIANTS, (step, stepped, stored)):
            def run(s=s):
                model.zero_grad(set_to_none=True)
                s(batch)
            calls[f"{variant} {budget}"] = run
    for f in calls.values():  # (warm-up: the first call compiles the generated code)
        f()
        f()
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            started = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - started)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"model": name, "eager_ms": round(ms["eager"], 3), "plans": plans,
            "variants": {k: {"ms": round(v, 3), "vs_eager": round(v / ms["eager"], 4)} for k, v in ms.items() if k != "eager"},
            "parameters": sum(1 for _ in model.parameters()), "buffers": sum(1 for _ in model.buffers())}


def plot(results: dict) -> None:
    """Bars of each variant's step time over eager's, per model and budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(row, budget) for row in results["models"] for budget in row["plans"]]
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    width = 0.8 / len(VARIANTS)
    for k, variant in enumerate(VARIANTS):
        ax.bar([i + k * width for i in range(len(rows))], [row["variants"][f"{variant} {b}"]["vs_eager"] for row, b in rows],
               width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(VARIANTS) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{row['model']}\n{b}" for row, b in rows])
    ax.set_ylabel("step time / eager's")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Host time of a planned step (tiny ops, CPU, 1 thread)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def merge(stored: dict, rows: list[dict]) -> dict:
    """The results file after a run that measured ``rows`` (each with its ``run``): those rows,
    and every row of ``stored`` of a model the run did not measure, kept as it was, in the order
    of ``MODELS`` (a model no longer there after them). A kept row keeps the run that measured
    it: its own ``run``, or, in a file written before rows named theirs (when every run replaced
    the whole file), the file's ``meta``. ``meta`` holds what every row's run shares, so it
    never claims a kept row was measured by this run."""
    stored_meta = stored.get("meta") if isinstance(stored.get("meta"), dict) else {}
    measured = {row["model"] for row in rows}
    kept = [{**row, "run": row.get("run", stored_meta)} for row in stored.get("models", [])
            if isinstance(row, dict) and isinstance(row.get("model"), str) and row["model"] not in measured]
    order = {name: i for i, name in enumerate(MODELS)}
    models = sorted([*kept, *rows], key=lambda row: order.get(row["model"], len(MODELS)))
    runs = [row["run"] for row in models]
    shared = {key: value for key, value in (runs[0].items() if runs else ())
              if all(run.get(key) == value for run in runs[1:])}
    return {"meta": shared, "models": models}


def _runs(results: dict) -> list[tuple[dict, list[str]]]:
    """Each run that measured a row of ``results`` (a row without its own ``run``: the file's
    ``meta``), with the models it measured, in the order of the rows."""
    meta = results.get("meta", {})
    runs: list[tuple[dict, list[str]]] = []
    for row in results.get("models", []):
        run = row.get("run", meta)
        for seen, names in runs:
            if seen == run:
                names.append(row["model"])
                break
        else:
            runs.append((run, [row["model"]]))
    return runs or [(meta, [])]


def _provenance(run: dict) -> str:
    return (f"CPU, {run.get('threads', 1)} thread, median of {run.get('rounds', '?')} interleaved rounds, measured "
            f"{run.get('measured', '?')}")


def markdown(results: dict) -> str:
    runs = _runs(results)
    if len(runs) == 1:
        run = runs[0][0]
        command = f"Command: `{run.get('command', 'python bench/step_overhead.py')}`; {_provenance(run)}."
    else:  # (rows kept from earlier runs: each run's command and settings, with its models)
        command = "Commands: " + "; ".join(
            f"`{run.get('command', 'python bench/step_overhead.py')}` for {', '.join(f'`{m}`' for m in names)} "
            f"({_provenance(run)})" for run, names in runs) + "."
    lines = [
        "## Host time of a planned step (`bench/step_overhead.py`)",
        "",
        f"{command} Models whose "
        "ops are tiny, so that a step's time is the host's, as for a GPU step whose kernels are short: "
        "`residual-cnn` (24 residual blocks, 8 channels, batch norms; batch 4 of 8x8) and `gpt2-tiny` (batch 8 of 32 "
        "tokens). `remat step` is `remat.optimize(...)(batch)` as users call it (the plan runs as Python code "
        "generated for it); `instructions stepped` runs the same plan's instructions one by one (how plans ran "
        "before); `bookkeeping only` replaces the plan's ops by their stored outputs: what the step does around "
        "the plan (checking the model against its trace, collecting inputs, handing out gradients and updates).",
        "",
        "| model | budget | plan overhead | nodes recomputed | instructions | eager ms | remat step ms (vs eager) | "
        "instructions stepped ms (vs eager) | bookkeeping only ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results.get("models", []):
        for budget, plan in row["plans"].items():
            v = row["variants"]
            step, stepped, kept = (v[f"{name} {budget}"] for name in VARIANTS)
            lines.append(
                f"| {row['model']} | {budget} | {plan['overhead']:.3f}x | {plan['recomputed_nodes']} of {plan['nodes']} | "
                f"{plan['instructions']} | {row['eager_ms']:.2f} | {step['ms']:.2f} ({step['vs_eager']:.2f}x) | "
                f"{stepped['ms']:.2f} ({stepped['vs_eager']:.2f}x) | {kept['ms']:.2f} |"
            )
    lines += ["", "![host time of a planned step](bench/plots/step_overhead.png)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from remat.cli_args import Parser, UsageError, results_file, thread_count

    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="step_overhead.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated models, from: {', '.join(MODELS)} (default: all of them)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved timing rounds, at least 3 (default 40)")
    parser.add_argument("--threads", type=thread_count(), default=1, help="intra-op threads (default 1)")
    parser.add_argument("--replot", action="store_true", help="only print the section from the JSON")
    args = parser.parse_args(argv)
    if args.replot:
        if not RESULTS.is_file():
            parser.error(f"--replot draws the section from {RESULTS}, which does not exist; run the benchmark first")
        results = json.loads(RESULTS.read_text())
        plot(results)
        print(markdown(results))
        return 0
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        parser.error(f"--models: unknown model(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    if args.rounds < 3:
        parser.error(f"--rounds must be at least 3, not {args.rounds}")
    try:  # (the stored rows this run keeps, read before any work)
        stored = results_file(RESULTS, {}, option="results file", of="step_overhead.py")
    except UsageError as exc:
        parser.error(str(exc))
    if not isinstance(stored, dict) or not isinstance(stored.get("models", []), list):
        parser.error(f"results file {str(RESULTS)!r} is not a results file of step_overhead.py (no 'models' list); "
                     f"move it away")
    import torch

    from remat.sweep import environment, save_json

    torch.set_num_threads(args.threads)
    command = " ".join(["python bench/step_overhead.py", *(argv if argv is not None else sys.argv[1:])])
    run = {"command": command, "threads": args.threads, "rounds": args.rounds, "measured": time.strftime("%Y-%m-%d"),
           "environment": environment()}
    rows = []
    for name in models:
        row = measure(name, args.rounds)
        rows.append({**row, "run": run})
        print(json.dumps(row))
        results = merge(stored, rows)
        save_json(results, RESULTS)
    plot(results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
