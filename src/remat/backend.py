"""``torch.compile`` integration: an AOTAutograd backend whose partitioner runs a remat plan.

>>> import torch, remat
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> be = remat.backend(0.8, method="chen_greedy", cache_dir=None)   # calls create()
>>> compiled = torch.compile(model, backend=be)
>>> compiled(torch.randn(4, 8)).sum().backward()   # doctest: +SKIP
>>> print(be.reports[-1])                          # doctest: +SKIP

AOTAutograd traces forward and backward into one joint graph and asks a partitioner for a
forward graph (which also returns what the backward needs) and a backward graph. This
partitioner turns the joint graph into a remat ``Graph`` (``backend_joint``), plans it under
the budget with ``plan_graph`` (coarsen, solve, expand, simulate), and lowers the plan to the
two graphs (``backend_split``): the forward keeps what the plan keeps, the backward recomputes
what the plan recomputes, in the plan's order; random ops replay their generator state.

Plans are cached by the graph's structural fingerprint, budget, method and options, in memory
and as JSON under ``cache_dir`` (``backend_cache``): a recompile or a restart does not solve
again.

Whatever the backend cannot plan (dynamic shapes, mutating ops, a graph without backward, an
infeasible budget, a failing solver) it hands to PyTorch's min-cut partitioner with a
``RematFallbackWarning`` naming the reason: gradients are always right, only not planned. A
method that fails on a graph (e.g. the MILP's time limit) is first replaced by remat's
cheapest fitting baseline, also with a warning.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.fx as fx

from remat import backend_cache, backend_joint, distributed
from remat.backend_joint import JointStep, UnsupportedJointGraph
from remat.backend_split import split
from remat.cost import CostModel, node_costs
from remat.errors import InfeasibleBudgetError, RematError, SolverError
from remat.graph import Graph
from remat.planning import GraphPlan, plan_graph
from remat.schedule import Plan, Schedule
from remat.simulate import simulate
from remat.units import format_bytes, parse_budget

log = logging.getLogger("remat.backend")

CUDA_FREE = "cuda-free"
#: Methods that look for the cheapest plan: computing every node once is their answer
#: whenever it fits, so it is not solved for.
OPTIMAL_METHODS = ("milp", "lp_round")
#: What the backend plans with when the requested method fails (time limit, solver error).
RESCUE_METHODS = ("segments", "chen_greedy", "chen_sqrtn", "checkpoint_all")


class BudgetError(RematError, ValueError):
    """A budget the backend cannot read (wrong type, out of range, unknown unit, no CUDA)."""


class RematFallbackWarning(UserWarning):
    """The backend did not plan a graph with the requested method (the message says why and
    what it used instead)."""


class _NotPlanned(RematError):
    """Internal: a reason to hand the graph to PyTorch's partitioner."""


# ---------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``bytes`` (absolute), ``fraction`` (of the step's
    unoptimized peak: every node computed once, nothing recomputed) or ``cuda_free`` (the CUDA
    device's free memory plus what the graph's inputs already hold)."""

    bytes: int | None = None
    fraction: float | None = None
    cuda_free: bool = False

    @classmethod
    def parse(cls, budget: object) -> Budget:
        """``int`` bytes, ``float`` fraction in (0, 1], ``"60%"``, ``"2GiB"`` or ``"cuda-free"``.

        >>> Budget.parse("60%").fraction, Budget.parse(0.5).fraction, Budget.parse("1KiB").bytes
        (0.6, 0.5, 1024)
        """
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool) or budget is None:
            raise BudgetError(f"budget {budget!r} is not a budget; give bytes (int), a fraction (0.6), '60%', '2GiB' or 'cuda-free'")
        if isinstance(budget, int):
            if budget <= 0:
                raise BudgetError(f"budget {budget} B must be a positive number of bytes")
            return cls(bytes=budget)
        if isinstance(budget, float):
            if not (math.isfinite(budget) and 0 < budget <= 1):
                raise BudgetError(
                    f"budget {budget!r} is a float, which means a fraction of the unoptimized peak, and must be "
                    f"in (0, 1]; give bytes as an int (e.g. budget={int(budget) if math.isfinite(budget) and budget > 1 else 2**30})"
                )
            return cls(fraction=budget)
        if isinstance(budget, str):
            return cls._parse_text(budget)
        raise BudgetError(
            f"budget {budget!r} is a {type(budget).__name__}; give bytes (int), a fraction (float) or a "
            f"string such as '60%', '2GiB' or 'cuda-free'"
        )

    @classmethod
    def _parse_text(cls, budget: str) -> Budget:
        text = budget.strip().lower()
        if text == CUDA_FREE:
            if not torch.cuda.is_available():
                raise BudgetError(
                    "budget 'cuda-free' means the free memory of the CUDA device, but CUDA is not available; "
                    "on CPU give bytes ('2GiB') or a fraction ('60%')"
                )
            return cls(cuda_free=True)
        if text.endswith("%"):
            try:
                value = float(text[:-1])
            except ValueError:
                raise BudgetError(f"budget {budget!r} is not a percentage; write e.g. '60%'") from None
            if not (math.isfinite(value) and 0 < value <= 100):
                raise BudgetError(f"budget {budget!r} must be a percentage in (0%, 100%] of the unoptimized peak")
            return cls(fraction=value / 100.0)
        try:
            return cls(bytes=parse_budget(budget))
        except ValueError as exc:
            raise BudgetError(f"{exc}, or 'cuda-free' (CUDA only)") from None

    def resolve(self, unoptimized_peak_bytes: int, fixed_bytes: int, device: torch.device) -> int:
        """The budget in bytes for one graph."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return max(1, int(self.fraction * unoptimized_peak_bytes))
        if device.type != "cuda":
            raise BudgetError(
                f"budget 'cuda-free' needs a graph on a CUDA device but this graph runs on {device}; give "
                f"bytes or a fraction"
            )
        free_bytes, _total = torch.cuda.mem_get_info(device)
        # the graph's inputs (parameters, batch) are allocated already: not free, but in the peak
        return int(free_bytes) + fixed_bytes

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        if self.fraction is not None:
            return f"{self.fraction:.0%} of the unoptimized peak"
        return CUDA_FREE


# ---------------------------------------------------------------------------- reports
@dataclass(frozen=True)
class PartitionReport:
    """What the backend did with one joint graph. ``fallback`` is the reason it used PyTorch's
    partitioner instead (the plan fields are then None); ``note`` says why ``method`` is not
    the requested one. Peaks in bytes as remat simulates them; ``overhead``: the plan's compute
    cost over computing every node once. Under torch.distributed, ``agreed_ranks`` ranks use the
    plan that rank ``source_rank`` loaded or solved (``from_cache``, ``status`` and ``solve_s``
    are that rank's)."""

    graph_name: str
    method: str
    fallback: str | None = None
    n_nodes: int | None = None
    fingerprint: str | None = None
    budget_bytes: int | None = None
    unoptimized_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    overhead: float | None = None
    status: str | None = None
    solve_s: float | None = None
    from_cache: bool = False
    saved_values: int | None = None
    backward_recomputes: int | None = None
    replayed_random_ops: int | None = None
    note: str | None = None
    source_rank: int | None = None
    agreed_ranks: int | None = None

    def __str__(self) -> str:
        if self.fallback is not None:
            return f"{self.graph_name}: PyTorch's min-cut partitioner ({self.fallback})"
        source = "cached plan" if self.from_cache else f"solved in {self.solve_s:.2f} s ({self.status})"
        if self.note:
            source += f" [{self.note}]"
        if self.agreed_ranks:
            source += f", agreed by {self.agreed_ranks} ranks (planned on rank {self.source_rank})"
        return (
            f"{self.graph_name}: {self.method} {source}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of budget {format_bytes(self.budget_bytes)} "
            f"(unoptimized {format_bytes(self.unoptimized_peak_bytes)}), overhead {self.overhead:.3f}x, "
            f"{self.saved_values} values saved, {self.backward_recomputes} forward ops recomputed in the "
            f"backward, {self.replayed_random_ops} random ops replayed"
        )


# ---------------------------------------------------------------------------- the backend
def checkpoint_all_peak(graph: Graph) -> int:
    """Peak bytes of computing every node once, in order (what budget fractions are of)."""
    return simulate(graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph)).peak_bytes


def _device_of(step: JointStep) -> torch.device:
    for p in step.joint_placeholders:
        if isinstance(p.meta.get("val"), torch.Tensor):
            return p.meta["val"].device
    return torch.device("cpu")


class RematBackend:
    """A ``torch.compile`` backend (made by ``remat.backend(...)``). ``reports`` lists, in order, what it
    did with every joint graph it partitioned."""

    def __init__(self, budget: Budget, method: str, *, cost_model: CostModel, cache_dir: Path | None,
                 fallback: bool, fw_compiler, bw_compiler, solver_options: dict[str, object],
                 process_group: object = distributed.DEFAULT_GROUP) -> None:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        self.budget = budget
        self.method = method
        self.cost_model = cost_model
        self.cache_dir = cache_dir
        self.fallback = fallback
        self.solver_options = dict(solver_options)
        self.process_group = process_group
        self.reports: list[PartitionReport] = []
        self._aot = aot_autograd(
            fw_compiler=fw_compiler or boxed_nop,
            bw_compiler=bw_compiler or fw_compiler or boxed_nop,
            partition_fn=self.partition,
            keep_inference_input_mutations=True,
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> object:
        return self._aot(gm, example_inputs)

    def partition(self, joint: fx.GraphModule, joint_inputs: object, *, num_fwd_outputs: int, **kwargs: object):
        """AOTAutograd's ``partition_fn``: the forward and backward modules of a joint graph."""
        name = f"graph{len(self.reports)}"
        try:
            fw, bw, report = self._plan(joint, num_fwd_outputs, name)
        except BudgetError:
            raise  # a usage error ('cuda-free' on CPU): say so, do not paper over it
        except Exception as exc:  # everything else: PyTorch's partitioner, loudly
            if not self.fallback:
                raise
            reason = _reason(exc)
            warnings.warn(
                f"remat.backend: not planning {name} ({reason}); using PyTorch's default min-cut "
                f"partitioner for it instead",
                RematFallbackWarning,
                stacklevel=2,
            )
            self.reports.append(PartitionReport(name, self.method, fallback=reason))
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            return min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        self.reports.append(report)
        log.info("remat.backend: %s", report)
        return fw, bw

    def _plan(self, joint: fx.GraphModule, num_fwd_outputs: int, name: str):
        group = distributed.planning_group(self.process_group)
        try:
            step = backend_joint.prepare(joint, num_fwd_outputs, name=name)
            graph = step.graph
            unoptimized = checkpoint_all_peak(graph)
            budget_bytes = self.budget.resolve(unoptimized, graph.fixed_bytes, _device_of(step))
            fingerprint = graph.fingerprint(costs=False)
        except Exception as exc:
            if group is not None:  # tell the other ranks (re-raises here)
                distributed.plan_together(group, None, None, exc, None)
            raise

        def key_of(budget: int) -> str:
            return backend_cache.cache_key(fingerprint, budget, self.method, self.solver_options)

        agreement = None
        if group is not None:  # one budget, and one plan if the graphs are the same
            agreement = distributed.plan_together(
                group, fingerprint, budget_bytes, None,
                lambda budget: self._load_or_solve(step, key_of(budget), budget, unoptimized)[0])
        if agreement is not None and agreement.same_graph:
            # every rank runs the plan rebuilt from the shared compute order, the source too
            budget_bytes, record = agreement.budget_bytes, agreement.record
            plan = backend_cache.replay(graph, record, budget_bytes)
            if plan is None:
                raise _NotPlanned(f"the plan of rank {agreement.source_rank} does not replay on this rank's graph")
            if not agreement.is_source:  # this rank's cache, for its next compile or restart
                backend_cache.store(key_of(budget_bytes), {k: v for k, v in record.items() if k != "from_cache"},
                                    self.cache_dir)
        else:
            agreement = None
            record, plan = self._load_or_solve(step, key_of(budget_bytes), budget_bytes, unoptimized)
        sim = simulate(graph, plan)
        parts = split(step, joint, plan, sim)
        report = PartitionReport(
            graph_name=name,
            method=record["method"],
            n_nodes=graph.n,
            fingerprint=fingerprint,
            budget_bytes=budget_bytes,
            unoptimized_peak_bytes=unoptimized,
            predicted_peak_bytes=sim.peak_bytes,
            overhead=record.get("overhead"),
            status=record.get("status"),
            solve_s=record.get("solve_s"),
            from_cache=bool(record.get("from_cache")),
            saved_values=len(parts.saved),
            backward_recomputes=parts.backward_recomputes,
            replayed_random_ops=sum(1 for i in step.random_nodes if sim.compute_counts[i] > 1),
            note=record.get("note"),
            source_rank=agreement.source_rank if agreement else None,
            agreed_ranks=agreement.ranks if agreement else None,
        )
        return parts.forward, parts.backward, report

    def _load_or_solve(self, step: JointStep, key: str, budget_bytes: int, unoptimized: int) -> tuple[dict, Plan]:
        """The plan of ``key`` and its record: from the cache if it replays, else solved and
        stored; the record's ``from_cache`` says which."""
        record = backend_cache.load(key, self.cache_dir)
        plan = backend_cache.replay(step.graph, record, budget_bytes) if record is not None else None
        if plan is not None:
            return {**record, "from_cache": True}, plan
        if record is not None:
            log.warning("remat.backend: cached plan %s does not replay on %s; solving again", key[:12], step.graph.name)
        planned, record = self._solve(step, budget_bytes, unoptimized)
        backend_cache.store(key, record, self.cache_dir)
        return {**record, "from_cache": False}, planned.plan

    def _costs(self, step: JointStep) -> dict[str, float]:
        """Node costs in microseconds, measured on real tensors outside the compiler's fake mode."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        zero = frozenset(nm for i, nm in enumerate(step.node_names) if step.is_alias(i))
        with unset_fake_temporarily():
            if self.cost_model is CostModel.PROFILE:
                try:
                    return node_costs(step.module, backend_joint.example_inputs(step), CostModel.PROFILE, zero_cost=zero)
                except Exception as exc:  # synthetic inputs can break data-dependent ops
                    log.warning("remat.backend: profiling failed (%s); estimating costs instead", _reason(exc))
            return node_costs(step.module, [], CostModel.ESTIMATE, zero_cost=zero)

    def _solve(self, step: JointStep, budget_bytes: int, unoptimized: int) -> tuple[GraphPlan, dict]:
        costs = self._costs(step)
        graph = step.graph.with_costs([costs[nm] for nm in step.node_names])
        method, status, note = self.method, None, None
        if self.method in OPTIMAL_METHODS and budget_bytes >= unoptimized:
            planned, method, status = plan_graph(graph, budget_bytes, method="checkpoint_all"), "checkpoint_all", "optimal"
        else:
            try:
                planned = plan_graph(graph, budget_bytes, method=self.method, **self.solver_options)
            except InfeasibleBudgetError as exc:
                raise _infeasible(budget_bytes, exc.min_budget_bytes, self.method, unoptimized) from exc
            except SolverError as exc:
                planned, method = _rescue(graph, budget_bytes, unoptimized, self.method, exc)
                note = f"{self.method} failed: {_reason(exc)}"
        record = {
            "fingerprint": graph.fingerprint(costs=False),
            "budget_bytes": budget_bytes,
            "method": method,
            "note": note or planned.note or None,
            "n_nodes": graph.n,
            "solved_nodes": planned.solved_nodes,
            "compute_order": [int(i) for i in planned.plan.compute_order],
            "predicted_peak_bytes": planned.sim.peak_bytes,
            "overhead": planned.overhead,
            "status": status or planned.result.status.value,
            "solve_s": planned.result.solve_s,
        }
        return planned, record


def _infeasible(budget_bytes: int, least: int | None, method: str, unoptimized: int) -> _NotPlanned:
    smallest = f"{format_bytes(least)} ({least} B)" if least is not None else "unknown"
    return _NotPlanned(
        f"budget {format_bytes(budget_bytes)} ({budget_bytes} B) is infeasible for method {method!r}: the "
        f"smallest feasible budget is {smallest}; the unoptimized peak is {format_bytes(unoptimized)}"
    )


def _rescue(graph: Graph, budget_bytes: int, unoptimized: int, method: str, error: Exception) -> tuple[GraphPlan, str]:
    """The cheapest plan of ``RESCUE_METHODS`` that fits, after ``method`` failed (warns)."""
    found, least = [], []
    for rescue in RESCUE_METHODS:
        try:
            found.append((plan_graph(graph, budget_bytes, method=rescue), rescue))
        except InfeasibleBudgetError as exc:
            least.append(exc.min_budget_bytes)
        except RematError as exc:
            log.debug("rescue method %s failed: %s", rescue, exc)
    if not found:
        known = [b for b in least if b is not None]
        raise _infeasible(budget_bytes, min(known) if known else None, method, unoptimized) from error
    planned, used = min(found, key=lambda pair: pair[0].sim.total_cost)
    warnings.warn(
        f"remat.backend: method {method!r} failed on {graph.name} ({_reason(error)}); planning it with "
        f"remat's {used!r} instead (overhead {planned.overhead:.3f}x, predicted peak "
        f"{format_bytes(planned.sim.peak_bytes)} of budget {format_bytes(budget_bytes)})",
        RematFallbackWarning,
        stacklevel=2,
    )
    return planned, used


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (UnsupportedJointGraph, _NotPlanned, distributed.RankDisagreement)):
        return text
    return f"{type(exc).__name__}: {text}"


def _check_method(method: str, options: dict[str, object]) -> None:
    """Reject an unknown method or option now rather than at the first compile."""
    from remat.solvers import base, methods

    if method not in methods():
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(methods())}")
    base._check_options(method, base._REGISTRY[method], options)


def create(
    budget: int | float | str | None = None,
    *,
    budget_bytes: int | None = None,
    method: str = "milp",
    cost_model: CostModel = CostModel.PROFILE,
    cache_dir: str | os.PathLike | None = "default",
    fallback: bool = True,
    fw_compiler=None,
    bw_compiler=None,
    process_group: object = distributed.DEFAULT_GROUP,
    **solver_options: object,
) -> RematBackend:
    """A ``torch.compile`` backend that plans every training graph with remat; what
    ``remat.backend(...)`` calls.

    ``budget``: bytes (int), a fraction of the step's unoptimized peak (``0.6`` or ``"60%"``),
    a size (``"2GiB"``) or ``"cuda-free"`` (the CUDA device's free memory at compile time plus
    what the graph's inputs hold). ``budget_bytes`` is an int ``budget``. A peak is what remat
    simulates for the compiled region: its inputs, parameters, activations, tangents and
    gradients.

    ``method`` and ``solver_options`` go to ``plan_graph`` (e.g. ``time_limit_s=30``).
    ``cost_model``: PROFILE times every node once per graph on synthetic inputs (ESTIMATE if
    that fails). ``cache_dir``: where plans are kept (``"default"``:
    ``$XDG_CACHE_HOME/remat/plans``; None: this process only). ``fallback=False`` raises instead
    of using PyTorch's partitioner. ``fw_compiler``/``bw_compiler`` compile the two graphs
    (default: run them as they are, like ``aot_eager``).

    ``process_group``: under torch.distributed, the ranks that agree on every plan (the same
    budget, the smallest of theirs, and one plan, solved once and broadcast; see
    ``remat.distributed``). ``"default"``: the default group whenever it is initialized with
    more than one rank at compile time; a ``ProcessGroup``: that group (e.g. the data-parallel
    group when pipeline stages compile different graphs); None: every rank plans alone. A byte
    budget is per device: each rank's graph must fit it.

    Raises ``BudgetError`` for a budget it cannot read, ``ValueError`` for an unknown method or
    option.
    """
    if (budget is None) == (budget_bytes is None):
        raise BudgetError("give exactly one of budget= (bytes, fraction, '60%', 'cuda-free') and budget_bytes= (int)")
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)):
        raise BudgetError(f"budget_bytes={budget_bytes!r} must be an int number of bytes; pass fractions and strings as budget=")
    parsed = Budget.parse(budget if budget is not None else budget_bytes)
    _check_method(method, solver_options)
    distributed.check_group(process_group)
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model {cost_model!r} is not a CostModel; use CostModel.PROFILE or CostModel.ESTIMATE")
    if cache_dir == "default":
        directory = backend_cache.default_cache_dir()
    else:
        directory = None if cache_dir is None else Path(cache_dir)
    return RematBackend(parsed, method, cost_model=cost_model, cache_dir=directory, fallback=fallback,
                        fw_compiler=fw_compiler, bw_compiler=bw_compiler, solver_options=solver_options,
                        process_group=process_group)


class _CallableModule(types.ModuleType):
    """``remat.backend`` names both this module and its factory (importing a submodule makes
    it the package attribute), so the module is callable: ``remat.backend(budget=...)`` is
    ``create(budget=...)``, however it was reached."""

    def __call__(self, *args: object, **kwargs: object) -> RematBackend:
        return create(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
#: ``remat.backend`` (the package's lazy export) and ``from remat.backend import backend``
#: both give this callable module.
backend = sys.modules[__name__]
