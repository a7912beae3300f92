"""Maximum batch size each method fits into a 16 GB V100 with at most one extra forward pass.

Compared with the Checkmate paper's numbers.

For VGG19, ResNet50, MobileNet, the VGG U-Net, FCN-8 and SegNet at the paper's resolutions,
a method *fits* batch b when ``remat.planning.plan_graph`` returns a plan of the training step
at batch b whose simulated peak is at most 16·10^9 bytes (parameters, buffers, the batch,
every gradient and activation, fp32) and whose cost is at most the checkpoint-all cost plus
the cost of every forward node. The step is traced on the meta device at each batch size
tried, with ``CostModel.ESTIMATE`` costs. The search brackets the answer by doubling (or
halving) from a start, then bisects; each method starts from the largest batch found so far
for the model. For lp_round and milp a plan found within the time limit counts.

Results go to ``bench/results/max_batch.json`` after every evaluation; a rerun skips finished
(model, method) pairs and reuses the evaluations of unfinished ones, when they were made by the
same code (``planner_version()``) with the same options, time limit and memory; otherwise it
searches again. ``markdown(results)``
renders the BENCHMARKS.md section.

    python bench/max_batch.py                                 # everything, 60 s per solve
    python bench/max_batch.py --models vgg19 --methods checkpoint_all,chen_sqrtn,milp
    python bench/max_batch.py --models segnet --memory 2GB --max-batch 16 --time-limit 5 \\
        --out /tmp/smoke.json                                 # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from remat.solvers import planner_version
from remat.sweep import environment, parse_solver_options, pin_estimate_rates, save_json, trace_on_meta

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "max_batch.json"

MODELS = ("vgg19", "resnet50", "mobilenet", "vgg-unet", "fcn8", "segnet")
METHODS = ("checkpoint_all", "chen_sqrtn", "chen_greedy", "griewank", "lp_round", "milp")
TIMED = ("lp_round", "milp")
#: A V100's memory as the Checkmate code counts it: platform_memory("p32xlarge") = 16·10^9 B.
MEMORY_BYTES = 16 * 1000**3
#: The search never tries more than this (Checkmate's max-batch MILP bounds its variable at 16384).
MAX_BATCH = 16384
DEFAULT_TIME_LIMIT_S = 60.0
#: Extra keyword options per method for ``plan_graph``; ``--options`` adds to these.
SOLVER_OPTIONS: dict[str, dict[str, object]] = {}
#: Relative slack on the cost limit (float sums).
COST_RTOL = 1e-9
#: Traced graphs kept in memory per process (methods of one model revisit batch sizes).
GRAPH_CACHE = 64

#: The Checkmate paper's maximum batch sizes (Jain et al., MLSys 2020: 16 GB V100, at most one
#: extra forward pass): ``(value, at_least)``; where only one number is given it is Checkmate's
#: (our ``milp``).
PUBLISHED: dict[str, dict[str, tuple[int, bool]]] = {
    "vgg19": {"checkpoint_all": (167, False), "chen_sqrtn": (197, False), "chen_greedy": (266, False),
              "milp": (289, False)},
    "vgg-unet": {"milp": (57, False)},
    "fcn8": {"milp": (60, True)},
    "segnet": {"milp": (62, True)},
    "resnet50": {"milp": (193, True)},
    "mobilenet": {"milp": (1105, True)},
}


# ---------------------------------------------------------------------------- the search
@dataclass(frozen=True)
class Search:
    """The outcome of ``largest_fitting``: ``max_batch`` is 0 when not even ``low`` fits;
    ``capped`` when ``high`` fits (the true largest may be larger). ``evaluations`` are the
    (batch, fits) pairs in the order they were first asked."""

    max_batch: int
    capped: bool
    evaluations: tuple[tuple[int, bool], ...]


def largest_fitting(fits: Callable[[int], bool], *, start: int = 1, low: int = 1, high: int = MAX_BATCH) -> Search:
    """The largest b in [low, high] with ``fits(b)``, for a predicate that holds up to some
    batch and not beyond (monotone): double from ``start`` until it fails (or halve until it
    holds), then bisect between the last batch that fits and the first that does not. Each
    batch is asked once.

    >>> largest_fitting(lambda b: b <= 37, start=8).max_batch
    37
    """
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    memo: dict[int, bool] = {}
    order: list[tuple[int, bool]] = []

    def ask(b: int) -> bool:
        if b not in memo:
            memo[b] = bool(fits(b))
            order.append((b, memo[b]))
        return memo[b]

    def done(best: int, capped: bool = False) -> Search:
        return Search(best, capped, tuple(order))

    b = min(max(start, low), high)
    if ask(b):
        lo = b
        while True:
            if lo == high:
                return done(high, capped=True)
            b = min(2 * lo, high)
            if not ask(b):
                hi = b
                break
            lo = b
    else:
        hi = b
        while True:
            if hi == low:
                return done(low - 1)
            b = max(hi // 2, low)
            if ask(b):
                lo = b
                break
            hi = b
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return done(lo)


# ---------------------------------------------------------------------------- one evaluation
class NotApplicable(Exception):
    """The method cannot plan this model at all (griewank off chains)."""


class Graphs:
    """Traced graphs by (model, batch), each traced once per process (a bounded cache)."""

    def __init__(self, trace_fn: Callable[[str, int], object] = trace_on_meta, size: int = GRAPH_CACHE) -> None:
        self.trace_fn, self.size = trace_fn, size
        self._cache: dict[tuple[str, int], tuple[object, float]] = {}

    def get(self, model: str, batch: int) -> tuple[object, float]:
        """(graph, seconds it took to trace; 0 when cached)."""
        key = (model, batch)
        if key in self._cache:
            return self._cache[key][0], 0.0
        started = time.perf_counter()
        traced = self.trace_fn(model, batch)
        graph = getattr(traced, "graph", traced)  # a TracedStep or a Graph; keep only the graph
        elapsed = time.perf_counter() - started
        if len(self._cache) >= self.size:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = (graph, elapsed)
        return graph, elapsed


def cost_limit(graph) -> float:
    """Checkpoint-all cost plus one more pass over every forward node."""
    from remat.graph import NodeKind

    return graph.total_cost + sum(n.cost for n in graph.nodes if n.kind is NodeKind.FORWARD)


def evaluate(graph, method: str, memory_bytes: int, options: Mapping[str, object]) -> dict:
    """Does ``method`` fit ``graph`` into ``memory_bytes`` within the cost limit? One record;
    raises ``NotApplicable`` when the method cannot plan the graph at all."""
    from remat.errors import InfeasibleBudgetError, SolverError, UnsupportedGraphError
    from remat.planning import plan_graph

    base = graph.total_cost
    limit = cost_limit(graph)
    record: dict[str, object] = {"n_nodes": graph.n, "fixed_bytes": graph.fixed_bytes,
                                 "limit_overhead": limit / base if base > 0 else 1.0}
    started = time.perf_counter()
    try:
        planned = plan_graph(graph, memory_bytes, method, **options)
    except InfeasibleBudgetError as exc:
        return record | {"fits": False, "status": "infeasible", "solve_s": _since(started),
                         "min_budget_bytes": exc.min_budget_bytes}
    except UnsupportedGraphError as exc:
        raise NotApplicable(str(exc).split(";")[0]) from exc
    except SolverError as exc:
        return record | {"fits": False, "status": "no plan", "solve_s": _since(started),
                         "note": str(exc).split(";")[0]}
    cost = planned.sim.total_cost
    fits = cost <= limit * (1 + COST_RTOL)
    return record | {
        "fits": fits,
        "status": planned.result.status.value if fits else "over cost limit",
        "solver_status": planned.result.status.value,
        "overhead": planned.overhead,
        "peak_bytes": planned.sim.peak_bytes,
        "gap": planned.result.gap,
        "solve_s": _since(started),
        "n_nodes_solved": planned.result.graph.n,
        "note": getattr(planned, "note", ""),
    }


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)


# ---------------------------------------------------------------------------- the runs
def run_key(model: str, method: str) -> str:
    return f"{model}/{method}"


def run(models: Sequence[str], methods: Sequence[str], time_limit_s: float, out: Path, *,
        memory_bytes: int = MEMORY_BYTES, max_batch: int = MAX_BATCH,
        options: Mapping[str, Mapping[str, object]] | None = None, graphs: Graphs | None = None,
        pin_rates: bool = True, log: Callable[[str], None] = print) -> dict:
    """Search every missing (model, method) pair, writing ``out`` after every evaluation."""
    results = load(out)
    meta = {"time_limit_s": time_limit_s, "memory_bytes": memory_bytes, "max_batch": max_batch,
            "cost_model": "estimate", **environment()}
    if pin_rates:
        meta["rates"] = pin_estimate_rates(out.parent)
    results["meta"].update(meta)
    graphs = graphs or Graphs()
    planner = planner_version()
    for model in models:
        for method in methods:
            key = run_key(model, method)
            opts = {**({"time_limit_s": time_limit_s} if method in TIMED else {}), **SOLVER_OPTIONS.get(method, {}),
                    **(options or {}).get(method, {})}
            produced_by = {"planner": planner, "time_limit_s": opts.get("time_limit_s"), "memory_bytes": memory_bytes,
                           "max_batch_limit": max_batch, "options": {k: v for k, v in opts.items() if k != "time_limit_s"}}
            entry = results["runs"].get(key)
            if entry is not None and any(entry.get(k) != v for k, v in produced_by.items()):
                log(f"{key}: stored by other code or options; searching again")
                entry = None
            if entry is None:
                entry = results["runs"][key] = {"model": model, "method": method, "evaluations": [], **produced_by}
            entry["published"] = _published(model, method)
            if entry.get("status") in ("done", "not applicable"):
                log(f"{key}: already done (max batch {entry.get('max_batch')})")
                continue
            known = {e["batch"]: e["fits"] for e in entry["evaluations"]}

            def fits(batch: int, model=model, method=method, entry=entry, known=known, opts=opts) -> bool:
                if batch in known:
                    return known[batch]
                graph, trace_s = graphs.get(model, batch)
                record = {"batch": batch, **evaluate(graph, method, memory_bytes, opts), "trace_s": round(trace_s, 3),
                          "fingerprint": graph.fingerprint()}
                entry["evaluations"].append(record)
                known[batch] = record["fits"]
                save(results, out)
                log(f"  {model} {method} batch {batch}: {'fits' if record['fits'] else 'does not fit'} "
                    f"({record['status']}, {record['solve_s']:.1f} s)")
                return record["fits"]

            start = entry.setdefault("start", _start(results, model))  # a resumed search retraces its steps
            log(f"{key}: searching from batch {start}")
            try:
                found = largest_fitting(fits, start=start, high=max_batch)
            except NotApplicable as exc:
                entry.update(status="not applicable", max_batch=None, note=str(exc))
                _totals(entry)
                save(results, out)
                log(f"{key}: not applicable ({exc})")
                continue
            entry.update(status="done", max_batch=found.max_batch, capped=found.capped)
            _totals(entry)
            save(results, out)
            log(f"{key}: max batch {found.max_batch}{' (the search limit)' if found.capped else ''} after "
                f"{entry['n_solves']} solves, {entry['solve_s_total']:.1f} s solving")
    return results


def _published(model: str, method: str) -> dict | None:
    value = PUBLISHED.get(model, {}).get(method)
    return None if value is None else {"value": value[0], "at_least": value[1]}


def _start(results: Mapping, model: str) -> int:
    """Start the search at the largest batch any finished method reached on this model."""
    found = [e["max_batch"] for e in results["runs"].values()
             if e["model"] == model and e.get("status") == "done" and e.get("max_batch")]
    return max(found, default=1)


def _totals(entry: dict) -> None:
    evals = entry["evaluations"]
    entry["n_solves"] = len(evals)
    entry["solve_s_total"] = round(sum(e.get("solve_s") or 0.0 for e in evals), 3)
    entry["trace_s_total"] = round(sum(e.get("trace_s") or 0.0 for e in evals), 3)
    fitting = [e for e in evals if e["fits"] and e["batch"] == entry.get("max_batch")]
    entry["at_max"] = fitting[0] if fitting else None


def load(out: Path) -> dict:
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", {})
    results.setdefault("runs", {})
    return results


def save(results: dict, out: Path) -> None:
    save_json(results, out)


# ---------------------------------------------------------------------------- reporting
def _published_text(p: Mapping | None) -> str:
    if not p:
        return ""
    return f"≥ {p['value']}" if p["at_least"] else str(p["value"])


def markdown(results: dict) -> str:
    """The BENCHMARKS.md section: our maximum batch sizes next to the paper's, the search's
    work, and how our graphs differ from the paper's."""
    meta, runs = results.get("meta", {}), results.get("runs", {})
    models = [m for m in MODELS if any(e["model"] == m for e in runs.values())]
    models += sorted({e["model"] for e in runs.values()} - set(models))
    methods = [m for m in METHODS if any(e["method"] == m for e in runs.values())]
    methods += sorted({e["method"] for e in runs.values()} - set(methods))
    memory = meta.get("memory_bytes", MEMORY_BYTES)
    lines = [
        f"## Maximum batch size in {memory / 1e9:g} GB",
        "",
        f"`python bench/max_batch.py` (memory {memory / 1e9:g}·10^9 B"
        f"{', a V100 as the Checkmate code counts it' if memory == MEMORY_BYTES else ''}; time limit "
        f"{meta.get('time_limit_s', 0):g} s per `lp_round` and `milp` solve; {meta.get('cpu_count')} CPU cores). "
        "The largest batch for which a method's plan of the training step has a simulated peak within the memory "
        "and costs at most one extra forward pass (the checkpoint-all cost plus the cost of every forward node). "
        "Costs are `CostModel.ESTIMATE` on graphs traced on the meta device at each batch size tried; the search "
        "doubles (or halves) from the largest batch found so far for the model, then bisects. For `lp_round` and "
        "`milp` a plan found within the time limit counts. Paper: the Checkmate paper's numbers (Jain et al., MLSys "
        "2020, maximum batch size figure; ≥ where it gives only a lower bound); where the paper gives one number "
        "per network it is Checkmate's own, set here beside our `milp`.",
        "",
        "| model | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for model in models:
        row = []
        for method in methods:
            e = runs.get(run_key(model, method))
            if e is None:
                row.append("")
                continue
            if e.get("status") == "not applicable":
                text = "n/a"
            elif e.get("status") != "done":
                text = "(unfinished)"
            else:
                text = str(e["max_batch"]) + ("+" if e.get("capped") else "")
            paper = _published_text(e.get("published"))
            row.append(f"{text} (paper {paper})" if paper else text)
        lines.append(f"| {model} | " + " | ".join(row) + " |")
    versions: dict[str, list[str]] = {}
    for e in runs.values():
        if e.get("method") in TIMED:
            versions.setdefault(str(e.get("planner")), []).append(e["model"])
    if len(versions) > 1:
        lines += ["", "The solved rows come from more than one planner version (`planner_version()`): " + "; ".join(
            f"{v}: {', '.join(sorted(set(ms)))}" for v, ms in versions.items()) + "."]
    lines += ["", "Search work per model and method: solves (each one trace and one `plan_graph`), total solve time, "
              "and the status of the plan at the maximum (a MILP stopped by the time limit shows its gap).", "",
              "| model | method | max batch | nodes at max | solves | solve time (s) | trace time (s) | status at max | "
              "one batch more |",
              "|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for method in methods:
            e = runs.get(run_key(model, method))
            if e is None or "n_solves" not in e:
                continue
            at = e.get("at_max") or {}
            status = at.get("solver_status", "")
            if at.get("gap") is not None and status == "time_limit":
                status += f" (gap {at['gap']:.1%})"
            nodes = f"{at['n_nodes']} ({at.get('n_nodes_solved', '')} solved)" if at else ""
            lines.append(f"| {model} | {method} | {e.get('max_batch') if e.get('max_batch') is not None else 'n/a'} | "
                         f"{nodes} | {e['n_solves']} | {e['solve_s_total']:.1f} | {e['trace_s_total']:.1f} | {status} | "
                         f"{_why_not_more(e, memory)} |")
    lines += ["", DIFFERENCES]
    return "\n".join(lines) + "\n"


def _why_not_more(e: dict, memory: int = MEMORY_BYTES) -> str:
    """What stopped the search one batch above the maximum: the smallest failing batch."""
    failed = [v for v in e.get("evaluations", []) if not v.get("fits") and e.get("max_batch") is not None
              and v["batch"] > e["max_batch"]]
    if not failed:
        return ""
    v = min(failed, key=lambda v: v["batch"])
    if v.get("status") == "over cost limit" and v.get("overhead") is not None:
        return f"{v['batch']}: fits, but costs {v['overhead']:.3f}x > {v['limit_overhead']:.3f}x"
    if v.get("status") == "infeasible" and v.get("min_budget_bytes"):
        return f"{v['batch']}: infeasible (needs {_gb_above(v['min_budget_bytes'], memory)})"
    return f"{v['batch']}: {v.get('status', '?')}"


def _gb_above(need: int, memory: int) -> str:
    """``need`` bytes in GB with the decimals it takes to read above ``memory`` (not 'needs
    0.20 GB' of a 0.20 GB memory); in bytes where none do.

    >>> _gb_above(16_060_000_000, 16 * 10**9), _gb_above(200_400_000, 2 * 10**8)
    ('16.06 GB', '0.2004 GB')
    """
    for digits in range(2, 7):
        if float(f"{need / 1e9:.{digits}f}") > memory / 1e9:
            return f"{need / 1e9:.{digits}f} GB"
    return f"{need} B"


DIFFERENCES = """\
**How our graphs differ from the paper's.** Ours are operator-level graphs of the PyTorch training
step: forward, loss and backward traced together with torch.fx (`make_fx` at the aten level), in
which every operator output is a node: each saved activation, each activation gradient, each
parameter gradient and the loss; views and other zero-byte aliases are folded into the value they
alias. The paper's graphs are Keras layer-level graphs: one node per layer's forward output, one
loss node and one gradient node per layer (`checkmate/tf2_keras/extraction.py` in the Checkmate
repository), a gradient node holding as many bytes as its layer's output and costing twice its
layer. What is counted differs too. Ours: parameters, batch-norm buffers and the input batch with
its labels are fixed memory; each parameter gradient is allocated when the backward pass computes
it and kept to the end of the step; activations and activation gradients live as long as the plan
keeps them; optimizer state, convolution workspace and allocator fragmentation are not counted.
The Checkmate code (`experiments/experiment_max_batchsize_ilp.py`, `checkmate/core/dfgraph.py`)
subtracts twice the parameter bytes (parameters and their gradients) from 16·10^9 B and counts 4
bytes per element of each layer output. Costs: ours are a roofline estimate from the FLOPs torch's
flop counter assigns to each operator and the bytes it moves, with rates measured on the benchmark
machine; the Checkmate max-batch experiments default to per-layer FLOP counts from hand-written
rules (a convolution counts kernel area times input channels per output element; pooling, padding,
concatenation and reshapes count 0). Search: Checkmate's max-batch MILP makes the batch size a
variable of one MILP, with every node's memory proportional to it, solved without a time limit; we
bisect on the batch size and re-trace the step at each size, so every size (including those that do
not grow with the batch) is the traced one."""


# ---------------------------------------------------------------------------- command line
def parse_bytes(text: str) -> int:
    """``--memory``: bytes or a size (``16GB``, ``2GiB``), read as budgets are read; a
    fraction or a percentage (of a peak) is refused. Raises ``ValueError``."""
    from remat.cli_args import size_in_bytes

    return size_in_bytes(text, "--memory")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from remat.cli_args import Parser, add_bench_options  # (a usage error is one line, exit code 2)
    p = Parser(prog=prog or "max_batch.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated workloads (default {', '.join(MODELS)})")
    add_bench_options(p, methods=METHODS, time_limit_s=DEFAULT_TIME_LIMIT_S, out=RESULTS,
                      out_shown=str(RESULTS.relative_to(HERE.parent)))
    p.add_argument("--memory", default=str(MEMORY_BYTES),
                   help="device memory: bytes or a size (16GB, 2GiB); default %(default)s")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH,
                   help="largest batch the search tries (default %(default)s)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the search from command-line arguments; usage errors exit 2 (``SystemExit``)."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    from remat.models import names
    from remat.solvers import methods as registered

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not models:
        p.error("--models lists no model")
    if not methods:
        p.error("--methods lists no method")
    for m in models:
        if m not in names():
            p.error(f"unknown model {m!r}; choose from {', '.join(names())}")
    for m in methods:
        if m not in registered():
            p.error(f"unknown method {m!r}; choose from {', '.join(registered())}")
    if not args.time_limit > 0:
        p.error(f"--time-limit {args.time_limit:g} must be positive")
    if args.max_batch < 1:
        p.error(f"--max-batch {args.max_batch} must be at least 1")
    try:
        memory = parse_bytes(args.memory)
        options = parse_solver_options(args.options)
    except ValueError as exc:
        p.error(str(exc))
    from remat.cli_args import UsageError, check_solver_options, writable_file

    try:
        check_solver_options(options)
        writable_file(args.out, "--out")
    except UsageError as exc:
        p.error(str(exc))
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    results = run(models, methods, args.time_limit, args.out, memory_bytes=memory, max_batch=args.max_batch,
                  options=options)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
