"""Solve one graph with several methods over a range of budgets.

Pure computation: returns records; printing, plotting and files are the caller's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from remat.errors import InfeasibleBudgetError, UnsupportedGraphError
from remat.graph import Graph
from remat.solvers import solve

log = logging.getLogger("remat.sweep")


@dataclass(frozen=True)
class SweepPoint:
    """One (method, budget) cell. ``result`` is the summary of the plan, or None when the
    method has no plan at this budget (``min_budget_bytes`` then says what it needs)."""

    method: str
    budget_bytes: int
    budget_fraction: float
    result: dict[str, object] | None
    min_budget_bytes: int | None = None
    skipped: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "method": self.method,
            "budget_bytes": self.budget_bytes,
            "budget_fraction": self.budget_fraction,
            "result": self.result,
            "min_budget_bytes": self.min_budget_bytes,
            "skipped": self.skipped,
        }


def checkpoint_all_peak(graph: Graph) -> int:
    """Peak bytes of keeping everything: the reference that percentage budgets refer to."""
    return solve(graph, 2**62, method="checkpoint_all").peak_bytes


def budget_grid(graph: Graph, fractions: Sequence[float]) -> list[int]:
    """Budgets at the given fractions of the checkpoint-all peak (rounded down to bytes)."""
    ref = checkpoint_all_peak(graph)
    return [max(1, int(f * ref)) for f in fractions]


def sweep(
    graph: Graph,
    methods: Sequence[str],
    budgets_bytes: Iterable[int],
    *,
    options: dict[str, dict[str, object]] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Solve ``graph`` with every method at every budget.

    ``options[method]`` are keyword options for that method (e.g. ``time_limit_s``).
    ``on_point`` is called after each cell (for progress bars and incremental files).

    >>> from remat.builders import chain_graph
    >>> pts = sweep(chain_graph(6), ["checkpoint_all", "chen_sqrtn"], [2**40])
    >>> [p.result["overhead"] >= 1.0 for p in pts]
    [True, True]
    """
    ref = checkpoint_all_peak(graph)
    points: list[SweepPoint] = []
    opts = options or {}
    for budget in budgets_bytes:
        for method in methods:
            point = _solve_point(graph, method, int(budget), ref, opts.get(method, {}))
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def _solve_point(graph: Graph, method: str, budget: int, ref: int, options: dict[str, object]) -> SweepPoint:
    fraction = budget / ref
    try:
        result = solve(graph, budget, method=method, **options)
    except InfeasibleBudgetError as exc:
        return SweepPoint(method, budget, fraction, None, min_budget_bytes=exc.min_budget_bytes)
    except UnsupportedGraphError as exc:
        log.info("%s skipped on %s: %s", method, graph.name, exc)
        return SweepPoint(method, budget, fraction, None, skipped=str(exc))
    return SweepPoint(method, budget, fraction, result.summary())


def parse_solver_options(text: str | None) -> dict[str, dict[str, object]]:
    """Per-method solver options from JSON text (``{"milp": {"threads": 2}}``); empty if none.

    Raises ``ValueError`` naming the problem and showing the expected form.

    >>> parse_solver_options('{"milp": {"max_nodes": 100}}')
    {'milp': {'max_nodes': 100}}
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--options is not JSON ({exc.msg}); e.g. '{{\"milp\": {{\"threads\": 2}}}}'") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError("--options must map method names to option objects, e.g. '{\"milp\": {\"threads\": 2}}'")
    return value


def save_json(value: object, path: Path) -> None:
    """Write ``value`` as JSON to ``path`` atomically (a reader never sees half a file), so a
    long benchmark can be interrupted at any time and resume from what it wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    tmp.replace(path)


# ---------------------------------------------------------------------------- benchmark helpers
#: Machine rates of the ESTIMATE cost model, measured once and kept next to a benchmark's
#: results, so that a resumed run (another process) prices every node as the first one did.
ESTIMATE_RATES_FILE = "estimate_rates.json"


def pin_estimate_rates(folder: Path) -> dict[str, object]:
    """Measure the ESTIMATE cost model's machine rates, or read them from
    ``folder/ESTIMATE_RATES_FILE``, and make this process use them; returns them as a record."""
    from remat.cost import machine_rates

    folder.mkdir(parents=True, exist_ok=True)
    rates = machine_rates("cpu", cache_path=folder / ESTIMATE_RATES_FILE)
    return {"device": rates.device, "matmul_flops_per_us": rates.matmul_flops_per_us,
            "bytes_per_us": rates.bytes_per_us, "op_overhead_us": rates.op_overhead_us}


def trace_on_meta(model: str, batch: int):
    """The traced training step of built-in workload ``model`` at ``batch``, built and traced on
    the meta device (nothing allocated), node costs from ``CostModel.ESTIMATE``."""
    import torch

    from remat.cost import CostModel
    from remat.models import get_workload
    from remat.trace import trace

    with torch.device("meta"):
        w = get_workload(model, batch)
    return trace(w.model, w.batch, w.loss_fn, cost_model=CostModel.ESTIMATE, name=model)


def environment() -> dict[str, object]:
    """What a benchmark record says about the machine and the libraries it ran on."""
    import os
    import platform

    import torch

    env: dict[str, object] = {"torch": torch.__version__, "cpu_count": os.cpu_count(),
                              "machine": platform.platform(), "python": platform.python_version()}
    try:
        import highspy

        h = highspy.Highs()
        env["highspy"] = f"{h.versionMajor()}.{h.versionMinor()}.{h.versionPatch()}"
    except Exception:  # noqa: BLE001 - the version is a courtesy
        pass
    return env
