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
While AOTAutograd traces, upsampling traces as itself, as in ``remat.optimize``'s tracer
(``eager_ops.EAGER_KERNEL_OPS``): decomposed, it was indexing and an accumulating
``index_put`` backward, slower than eager's kernels (1.5-1.9x eager on a GPU) and, for
bilinear, not eager's gradients bitwise.

A fractional budget (``0.6``, ``"60%"``) is a fraction of the compiled region's eager peak:
the region's forward and backward run once as plain PyTorch on the example inputs when the
graph is compiled, measured (``memory.region_eager_peak``). So ``"100%"`` means "no more than
eager PyTorch": remat's own accounting of the unplanned joint graph is higher (AOTAutograd
hands the backward a gradient for every output, the forward's outputs stay alive), so
"100%" of it allowed more memory than eager PyTorch used. Where no eager run is possible (the partitioner
called without the backend, e.g. through ``aot_function``) the fraction is of that
unoptimized peak, and the report says so.

Each node's kernel scratch memory (``remat.scratch``) is measured with the costs
(``CostModel.PROFILE``) or estimated by rule (``ESTIMATE``) and planned for.

Plans are cached by the graph's structural fingerprint (scratch bytes included), budget,
method and options, in memory and as JSON under ``cache_dir`` (``backend_cache``): a recompile
or a restart does not solve again.

Whatever the backend cannot plan (dynamic shapes, mutating ops, a graph without backward, an
infeasible budget, a failing solver) it hands to PyTorch's min-cut partitioner with a
``RematFallbackWarning`` naming the reason: gradients are always right, only not planned. A
method that fails on a graph (e.g. the MILP's time limit) is first replaced by remat's
cheapest fitting baseline, also with a warning. Code that dynamo does not capture never
reaches any backend: ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` (unless
``torch._dynamo.config.allow_rnn``) run eagerly, unplanned; the backend warns with a
``RematFallbackWarning`` naming the module (``backend_dynamo``).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import types
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.fx as fx

from remat import backend_cache, backend_dynamo, backend_joint, distributed
from remat.backend_dynamo import RematFallbackWarning
from remat.backend_joint import JointStep, UnsupportedJointGraph
from remat.backend_split import split
from remat.cost import CostModel, node_costs
from remat.eager_ops import EAGER_KERNEL_OPS, _replaced_py_kernels
from remat.errors import InfeasibleBudgetError, MethodError, RematError, SolverError, a_type
from remat.fx_graph import with_scratch
from remat.graph import Graph
from remat.memory import region_eager_peak
from remat.planning import GraphPlan, plan_graph
from remat.schedule import Plan, Schedule
from remat.scratch import ScratchModel, node_scratch
from remat.simulate import simulate
from remat.units import EAGER, BudgetError, check_budget, format_bytes, format_bytes_exactly, parse_budget

log = logging.getLogger("remat.backend")


def _user_stacklevel() -> int:
    """The ``stacklevel`` (for a warning raised by the caller) of the innermost frame outside
    remat and torch: the user's line that ran the compiled model, not torch's compiler."""
    skip = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules["remat"]))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2

CUDA_FREE = "cuda-free"
#: How many times a plan whose replayed random ops' generator states do not fit beside it is
#: planned again with that much less budget (each time the states of the new plan are counted).
REPLAY_STATE_TRIES = 3
#: Methods that look for the cheapest plan: computing every node once is their answer
#: whenever it fits, so it is not solved for.
OPTIMAL_METHODS = ("milp", "lp_round")
#: What the backend plans with when the requested method fails (time limit, solver error).
RESCUE_METHODS = ("segments", "chen_greedy", "chen_sqrtn", "checkpoint_all")


class _NotPlanned(RematError):
    """Internal: a reason to hand the graph to PyTorch's partitioner; ``min_budget_bytes``: the
    smallest budget the method meets, when the reason is an infeasible budget and it is known
    (``budget_bytes``, ``method`` and ``detail`` then describe it, for ``public``)."""

    def __init__(self, message: str, min_budget_bytes: int | None = None, *, budget_bytes: int | None = None,
                 method: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.budget_bytes, self.method, self.detail = budget_bytes, method, detail

    def public(self, graph_name: str) -> RematError:
        """What a backend made with ``fallback=False`` raises: an infeasible budget as the
        public ``InfeasibleBudgetError`` (with ``min_budget_bytes``), any other reason as a
        ``RematError`` naming the graph."""
        if self.budget_bytes is not None:
            return InfeasibleBudgetError(budget_bytes=self.budget_bytes, min_budget_bytes=self.min_budget_bytes,
                                         method=self.method, graph_name=graph_name, detail=self.detail)
        return RematError(f"remat.backend cannot plan {graph_name}: {self}")


# ---------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``bytes`` (absolute), ``fraction`` (of the compiled
    region's eager peak, measured when it is compiled; see the module docstring) or
    ``cuda_free`` (the CUDA device's free memory plus what the graph's inputs already hold)."""

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
                    f"budget {budget!r} is a float, which means a fraction of the eager peak, and must be "
                    f"in (0, 1]; give bytes as an int (e.g. budget={int(budget) if math.isfinite(budget) and budget > 1 else 2**30})"
                )
            return cls(fraction=budget)
        if isinstance(budget, str):
            return cls._parse_text(budget)
        raise BudgetError(
            f"budget {budget!r} is {a_type(budget)}; give bytes (int), a fraction (float) or a "
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
                raise BudgetError(f"budget {budget!r} must be a percentage in (0%, 100%] of the eager peak")
            return cls(fraction=value / 100.0)
        try:
            return cls(bytes=parse_budget(budget))
        except ValueError as exc:
            raise BudgetError(f"{exc}, or 'cuda-free' (CUDA only)") from None

    def resolve(self, reference_bytes: int, fixed_bytes: int, device: torch.device) -> int:
        """The budget in bytes for one graph (``reference_bytes``: what a fraction is of)."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return max(1, int(self.fraction * reference_bytes))
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
            return f"{self.fraction:.0%} of the eager peak"
        return CUDA_FREE


# ---------------------------------------------------------------------------- reports
@dataclass(frozen=True)
class PartitionReport:
    """What the backend did with one joint graph. ``fallback`` is the reason it used PyTorch's
    partitioner instead (the plan fields are then None); ``note`` says why ``method`` is not
    the requested one. Peaks in bytes as remat simulates them (kernel scratch included);
    ``eager_peak_bytes``: the region's eager peak as measured at compile time (None where it
    could not run); ``reference`` what a fractional budget was a fraction of (``"eager"`` or
    ``"unoptimized"``, None for a budget in bytes); ``overhead``: the plan's compute cost over
    computing every node once, ``lower_bound``: the least any plan can cost in that unit (None
    where the method proves nothing, or a plan cached before reports had it). Under torch.distributed, ``agreed_ranks`` ranks use the plan
    that rank ``source_rank`` loaded or solved (``from_cache``, ``status`` and ``solve_s`` are
    that rank's)."""

    graph_name: str
    method: str
    fallback: str | None = None
    n_nodes: int | None = None
    fingerprint: str | None = None
    budget_bytes: int | None = None
    unoptimized_peak_bytes: int | None = None
    eager_peak_bytes: int | None = None
    reference: str | None = None
    predicted_peak_bytes: int | None = None
    overhead: float | None = None
    status: str | None = None
    solve_s: float | None = None
    from_cache: bool = False
    saved_values: int | None = None
    backward_recomputes: int | None = None
    replayed_random_ops: int | None = None
    note: str | None = None
    captured: bool = True  # False: code dynamo left eager (``fallback`` says which), no graph
    source_rank: int | None = None
    agreed_ranks: int | None = None
    lower_bound: float | None = None  # no plan costs less (a multiple like ``overhead``), if proven
    #: when ``fallback`` is an infeasible budget: the smallest budget in bytes the method meets
    #: (ask for it, as ``budget=`` bytes, and the graph is planned), if known
    min_budget_bytes: int | None = None
    #: when ``fallback`` is set: PyTorch's partitioner that split the graph instead ("min-cut", or
    #: "default" for a graph that modifies an input in place)
    partitioner: str = "min-cut"

    def __str__(self) -> str:
        if not self.captured:
            return f"{self.graph_name}: not captured by dynamo, ran eagerly ({self.fallback})"
        if self.fallback is not None:
            which = "min-cut partitioner" if self.partitioner == "min-cut" else "default partitioner (no recomputation)"
            return f"{self.graph_name}: PyTorch's {which} ({self.fallback})"
        source = "cached plan" if self.from_cache else f"solved in {self.solve_s:.2f} s ({self.status})"
        if self.note:
            source += f" [{self.note}]"
        if self.agreed_ranks:
            source += f", agreed by {self.agreed_ranks} ranks (planned on rank {self.source_rank})"
        of = ""
        if self.reference is not None:
            reference = self.eager_peak_bytes if self.reference == "eager" else self.unoptimized_peak_bytes
            of = f" ({self.budget_bytes / reference:.0%} of the {self.reference} peak)"
        eager = "" if self.eager_peak_bytes is None else f"eager {format_bytes(self.eager_peak_bytes)}, "
        return (
            f"{self.graph_name}: {self.method} {source}; predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} of budget {format_bytes(self.budget_bytes)}{of} "
            f"({eager}unoptimized {format_bytes(self.unoptimized_peak_bytes)}), overhead {self.overhead:.3f}x"
            f"{'' if self.lower_bound is None else f' (no plan costs less than {self.lower_bound:.3f}x)'}, "
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
                 scratch: ScratchModel | None = None, process_group: object = distributed.DEFAULT_GROUP) -> None:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        self.budget = budget
        self.method = method
        self.cost_model = cost_model
        if scratch is None:
            scratch = ScratchModel.MEASURE if cost_model is CostModel.PROFILE else ScratchModel.ESTIMATE
        self.scratch = scratch
        self.cache_dir = cache_dir
        self.fallback = fallback
        self.solver_options = dict(solver_options)
        self.process_group = process_group
        self.reports: list[PartitionReport] = []
        self._eager_peak: int | None = None  # of the graph being compiled, for partition()
        backend_dynamo.watch(self)
        self._aot = aot_autograd(
            fw_compiler=fw_compiler or boxed_nop,
            bw_compiler=bw_compiler or fw_compiler or boxed_nop,
            partition_fn=self.partition,
            keep_inference_input_mutations=True,
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **compile_options: object) -> object:
        if compile_options:  # (torch.compile hands its mode= and options= to a backend as keywords)
            given = ", ".join(f"{key}={value!r}" for key, value in compile_options.items())
            raise ValueError(f"torch.compile's {given} does not apply to remat.backend, which plans the graph and "
                             f"runs it as it is (like aot_eager) or with its fw_compiler/bw_compiler; drop it, and "
                             f"give remat.backend(..., fw_compiler=...) to compile the planned graphs")
        backend_dynamo.install()  # again, if torch._dynamo.reset() dropped it
        self._eager_peak = self._measure_eager(gm, example_inputs) if self.budget.fraction is not None else None
        try:
            # AOTAutograd traces the joint graph (and partitions and compiles it) within this
            # call, under the python dispatcher; upsampling traces as itself there, as in the
            # eager route, not as indexing with an accumulating ``index_put`` backward
            with _replaced_py_kernels(dict.fromkeys(EAGER_KERNEL_OPS)):
                return self._aot(gm, example_inputs)
        finally:
            self._eager_peak = None

    def _measure_eager(self, gm: fx.GraphModule, example_inputs: list) -> int | None:
        """The captured region's eager peak (what fractional budgets are of), or None if it
        cannot run here (fake inputs, an op that fails eagerly): fractions are then of the
        unoptimized peak."""
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
            return None  # an inference graph: nothing is partitioned
        if any(isinstance(t, FakeTensor) for t in example_inputs):
            log.warning("remat.backend: the graph's example inputs are fake; budget fractions are of the unoptimized peak")
            return None
        if _symbolic(gm):  # (not planned: the partitioner says so; running it printed fx's traceback first)
            return None
        try:
            with unset_fake_temporarily():
                return region_eager_peak(gm, list(example_inputs)).peak_bytes
        except Exception as exc:
            log.warning("remat.backend: the captured graph did not run eagerly (%s); budget fractions are of "
                        "the unoptimized peak", _reason(exc))
            return None

    def partition(self, joint: fx.GraphModule, joint_inputs: object, *, num_fwd_outputs: int, **kwargs: object):
        """AOTAutograd's ``partition_fn``: the forward and backward modules of a joint graph."""
        name = f"graph{len(self.reports)}"
        try:
            fw, bw, report = self._plan(joint, num_fwd_outputs, name)
        except BudgetError:
            raise  # a usage error ('cuda-free' on CPU): say so, do not paper over it
        except Exception as exc:  # everything else: PyTorch's partitioner, loudly
            if isinstance(exc, _NotPlanned) and exc.budget_bytes is not None and self._eager_peak is not None \
                    and self.budget.fraction is not None:  # (what the fraction was of: the unoptimized peak is stated)
                meant = f"the budget is {self.budget.fraction:.0%} of the region's eager peak, {format_bytes(self._eager_peak)}"
                if exc.min_budget_bytes is not None:
                    meant += f", and the smallest feasible one {exc.min_budget_bytes / self._eager_peak:.0%} of it"
                exc = _NotPlanned(f"{exc}; {meant}", exc.min_budget_bytes, budget_bytes=exc.budget_bytes,
                                  method=exc.method, detail=f"{exc.detail}; {meant}" if exc.detail else meant)
            if not self.fallback:
                if isinstance(exc, _NotPlanned):
                    raise exc.public(name) from exc
                raise
            reason = _reason(exc)
            from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

            # PyTorch's min-cut partitioner may recompute, in the backward, a value read from an
            # input the forward then modifies in place (a buffer updated under no_grad): it reads
            # the new value (torch 2.13: gradients 0.9 off). Such a graph gets the partitioner
            # that recomputes nothing.
            mutating = bool(backend_joint.mutated_inputs(joint, num_fwd_outputs))
            instead = ("default partitioner, which recomputes nothing (the graph modifies an input in place, "
                       "which the min-cut partitioner may recompute from after the change)" if mutating
                       else "default min-cut partitioner")
            warnings.warn(
                f"remat.backend: not planning {name} ({reason}); using PyTorch's {instead} for it instead",
                RematFallbackWarning,
                stacklevel=_user_stacklevel(),
            )
            self.reports.append(PartitionReport(name, self.method, fallback=reason,
                                                min_budget_bytes=getattr(exc, "min_budget_bytes", None),
                                                partitioner="default" if mutating else "min-cut"))
            partition = default_partition if mutating else min_cut_rematerialization_partition
            return partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        self.reports.append(report)
        log.info("remat.backend: %s", report)
        return fw, bw

    def _plan(self, joint: fx.GraphModule, num_fwd_outputs: int, name: str):
        group = distributed.planning_group(self.process_group)
        agreed_scratch = False  # (ranks planning together exchange their scratch once per graph)
        try:
            step = backend_joint.prepare(joint, num_fwd_outputs, name=name)
            inputs = self._example_inputs(step)
            scratch = self._scratch(step, inputs, group)
            agreed_scratch = True
            step = replace(step, graph=with_scratch(step.graph, step.node_names, scratch))
            graph = step.graph
            unoptimized = checkpoint_all_peak(graph)
            eager = self._eager_peak
            reference = None if self.budget.fraction is None else ("eager" if eager is not None else "unoptimized")
            budget_bytes = self.budget.resolve(eager if eager is not None else unoptimized, graph.fixed_bytes,
                                               _device_of(step))
            fingerprint = graph.fingerprint(costs=False)
            most_held = backend_joint.most_replay_state_bytes(step)
        except Exception as exc:
            if group is not None:  # tell the other ranks (re-raises here)
                if not agreed_scratch:
                    distributed.agree_on_scratch(group, {})
                distributed.plan_together(group, None, None, exc, None)
            raise

        def key_of(budget: int) -> str:
            return backend_cache.cache_key(fingerprint, budget, self.method, self.solver_options)

        agreement = None
        if group is not None:  # one budget, and one plan if the graphs are the same
            agreement = distributed.plan_together(
                group, fingerprint, budget_bytes, None,
                lambda budget: self._load_or_solve(step, inputs, key_of(budget), budget, unoptimized)[0])
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
            record, plan = self._load_or_solve(step, inputs, key_of(budget_bytes), budget_bytes, unoptimized)
        sim = simulate(graph, plan)
        held = backend_joint.replay_state_bytes(step, sim.compute_counts)
        # the generator states of the random ops the plan replays (which the simulator does not
        # see) must fit beside it: planned again with that much less, until they do
        for _ in range(REPLAY_STATE_TRIES):
            if agreement is not None or sim.peak_bytes + held <= budget_bytes or held >= most_held:
                break
            try:
                record, plan = self._load_or_solve(step, inputs, key_of(budget_bytes - held), budget_bytes - held,
                                                   unoptimized)
            except _NotPlanned:
                break
            sim = simulate(graph, plan)
            held = backend_joint.replay_state_bytes(step, sim.compute_counts)
        if agreement is None and sim.peak_bytes + held > budget_bytes:
            # the last try leaves room for every random op's state: its plan fits (held <= most_held)
            try:
                record, plan = self._load_or_solve(step, inputs, key_of(budget_bytes - most_held),
                                                   budget_bytes - most_held, unoptimized)
            except _NotPlanned as exc:
                least = None if exc.min_budget_bytes is None else exc.min_budget_bytes - most_held  # (it counts them)
                raise _infeasible(budget_bytes, least, self.method, unoptimized, most_held, states_first=True) from None
            sim = simulate(graph, plan)
            held = backend_joint.replay_state_bytes(step, sim.compute_counts)
        parts = split(step, joint, plan, sim)
        report = PartitionReport(
            graph_name=name,
            method=record["method"],
            n_nodes=graph.n,
            fingerprint=fingerprint,
            budget_bytes=budget_bytes,
            unoptimized_peak_bytes=unoptimized,
            eager_peak_bytes=eager,
            reference=reference,
            predicted_peak_bytes=sim.peak_bytes + held,
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
            lower_bound=record.get("lower_bound"),
        )
        return parts.forward, parts.backward, report

    def _example_inputs(self, step: JointStep) -> list[torch.Tensor] | None:
        """Real inputs to run the planning graph on (profiled costs, measured scratch), or None
        when nothing needs them."""
        if self.cost_model is not CostModel.PROFILE and self.scratch is not ScratchModel.MEASURE:
            return None
        return backend_joint.example_inputs(step)

    def _scratch(self, step: JointStep, inputs: list[torch.Tensor] | None, group: object) -> dict[str, int]:
        """Kernel scratch bytes by node name, as ``self.scratch`` says (estimated if measuring
        fails). Ranks planning together take each node's at its largest over the ranks
        (``distributed.agree_on_scratch``): measured scratch differs by a few KiB from rank to
        rank, and ranks agree on a plan only for the same graph. (They used to estimate it, and
        the estimate's cover of convolutions put a small CNN's smallest budget at 121% of its
        eager peak, so no fraction of it could be planned.)"""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        skip = frozenset(nm for i, nm in enumerate(step.node_names) if step.is_alias(i))
        scratch = None
        with unset_fake_temporarily():
            if self.scratch is ScratchModel.MEASURE and inputs is not None:
                try:
                    scratch = node_scratch(step.module, inputs, ScratchModel.MEASURE, skip=skip)
                except Exception as exc:  # synthetic inputs can break data-dependent ops
                    log.warning("remat.backend: measuring scratch memory failed (%s); estimating it instead", _reason(exc))
            if scratch is None:
                model = ScratchModel.NONE if self.scratch is ScratchModel.NONE else ScratchModel.ESTIMATE
                scratch = node_scratch(step.module, [], model, skip=skip)
        return scratch if group is None else distributed.agree_on_scratch(group, scratch)

    def _load_or_solve(self, step: JointStep, inputs: list[torch.Tensor] | None, key: str, budget_bytes: int,
                       unoptimized: int) -> tuple[dict, Plan]:
        """The plan of ``key`` and its record: from the cache if it replays, else solved and
        stored; the record's ``from_cache`` says which."""
        record = backend_cache.load(key, self.cache_dir)
        plan, why = backend_cache.replayed(step.graph, record, budget_bytes) if record is not None else (None, "")
        if plan is not None:
            return {**record, "from_cache": True}, plan
        if record is not None:
            log.warning("remat.backend: discarding the cached plan %s: %s (graph %s); planning the graph again",
                        backend_cache.where(key, self.cache_dir), why, step.graph.name)
        planned, record = self._solve(step, inputs, budget_bytes, unoptimized)
        backend_cache.store(key, record, self.cache_dir)
        return {**record, "from_cache": False}, planned.plan

    def _costs(self, step: JointStep, inputs: list[torch.Tensor] | None) -> dict[str, float]:
        """Node costs in microseconds, measured on real tensors outside the compiler's fake mode."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        zero = frozenset(nm for i, nm in enumerate(step.node_names) if step.is_alias(i))
        with unset_fake_temporarily():
            if self.cost_model is CostModel.PROFILE and inputs is not None:
                try:
                    return node_costs(step.module, inputs, CostModel.PROFILE, zero_cost=zero)
                except Exception as exc:  # synthetic inputs can break data-dependent ops
                    log.warning("remat.backend: profiling failed (%s); estimating costs instead", _reason(exc))
            return node_costs(step.module, [], CostModel.ESTIMATE, zero_cost=zero)

    def _solve(self, step: JointStep, inputs: list[torch.Tensor] | None, budget_bytes: int, unoptimized: int
               ) -> tuple[GraphPlan, dict]:
        costs = self._costs(step, inputs)
        graph = step.graph.with_costs([costs[nm] for nm in step.node_names])
        method, status, note = self.method, None, None
        if self.method in OPTIMAL_METHODS and budget_bytes >= unoptimized:
            planned, method, status = plan_graph(graph, budget_bytes, method="checkpoint_all"), "checkpoint_all", "optimal"
        else:
            try:
                planned = plan_graph(graph, budget_bytes, method=self.method, **self.solver_options)
            except InfeasibleBudgetError as exc:
                raise _infeasible(budget_bytes, exc.min_budget_bytes, self.method, unoptimized,
                                  backend_joint.most_replay_state_bytes(step)) from exc
            except SolverError as exc:
                planned, method = _rescue(graph, budget_bytes, unoptimized, self.method, exc,
                                          backend_joint.most_replay_state_bytes(step))
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
            "lower_bound": _bound_overhead(planned),
        }
        return planned, record


def _bound_overhead(planned: GraphPlan) -> float | None:
    """The plan's lower bound as a multiple of computing every node once (as ``overhead``),
    or None when the method proves none."""
    bound, total = planned.lower_bound, planned.graph.total_cost
    return None if bound is None or total <= 0 else bound / total


def _infeasible(budget_bytes: int, least: int | None, method: str, unoptimized: int, state_bytes: int = 0,
                states_first: bool = False) -> _NotPlanned:
    """The error of a budget the method cannot meet. ``least`` is the smallest budget the planner
    meets; the smallest stated adds ``state_bytes``, the generator states a plan of the graph may
    hold (``backend_joint.most_replay_state_bytes``), which the planner does not see: a plan of
    ``least`` that replays a random op would not fit, and with them one always does (``_plan``'s
    last try). ``states_first``: the budget failed only once those states were set aside."""
    stated = None if least is None else least + state_bytes
    smallest = format_bytes_exactly(stated) if stated is not None else "unknown"
    if state_bytes and least is not None:
        smallest += (f" (the planner's smallest, {format_bytes(least)}, and {format_bytes(state_bytes)} for the "
                     f"generator states of the random ops a plan may replay)")
    what = (f"budget {format_bytes_exactly(budget_bytes)} leaves too little beside the generator states of the "
            f"random ops a plan may replay ({format_bytes(state_bytes)}) for method {method!r}" if states_first
            else f"budget {format_bytes_exactly(budget_bytes)} is infeasible for method {method!r}")
    detail = (f"with {format_bytes(state_bytes)} for the generator states of the random ops a plan may replay; "
              if state_bytes and least is not None else "") + f"the unoptimized peak is {format_bytes(unoptimized)}"
    return _NotPlanned(
        f"{what}: the smallest feasible budget is {smallest}; the unoptimized peak is {format_bytes(unoptimized)}",
        stated, budget_bytes=budget_bytes, method=method, detail=detail)


def _rescue(graph: Graph, budget_bytes: int, unoptimized: int, method: str, error: Exception,
            state_bytes: int = 0) -> tuple[GraphPlan, str]:
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
        raise _infeasible(budget_bytes, min(known) if known else None, method, unoptimized, state_bytes) from error
    planned, used = min(found, key=lambda pair: pair[0].sim.total_cost)
    warnings.warn(
        f"remat.backend: method {method!r} failed on {graph.name} ({_reason(error)}); planning it with "
        f"remat's {used!r} instead (overhead {planned.overhead:.3f}x, predicted peak "
        f"{format_bytes(planned.sim.peak_bytes)} of budget {format_bytes(budget_bytes)})",
        RematFallbackWarning,
        stacklevel=2,
    )
    return planned, used


def _symbolic(gm: fx.GraphModule) -> bool:
    """Does the captured graph take symbolic sizes (dynamo compiled it for several shapes)?"""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor)
                                               and any(isinstance(d, torch.SymInt) for d in value.shape)):
            return True
    return False


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (UnsupportedJointGraph, _NotPlanned, distributed.RankDisagreement)):
        return text
    return f"{type(exc).__name__}: {text}"


def _check_method(method: str, options: dict[str, object]) -> None:
    """Reject an unknown method or option now rather than at the first compile (the options'
    values too: threads=0, mip_gap=-1, an unknown MILP backend, which the method would check
    inside a compile, where a failure falls back)."""
    from remat.planning import check_method

    try:
        check_method(method, options)
    except MethodError as exc:
        raise MethodError(f"{exc} (remat.backend(method={method!r}, ...))") from None


def create(
    budget: int | float | str | None = None,
    *,
    budget_bytes: int | None = None,
    method: str = "milp",
    cost_model: CostModel = CostModel.PROFILE,
    scratch: ScratchModel | None = None,
    cache_dir: str | os.PathLike | None = "default",
    fallback: bool = True,
    fw_compiler=None,
    bw_compiler=None,
    process_group: object = distributed.DEFAULT_GROUP,
    **solver_options: object,
) -> RematBackend:
    """A ``torch.compile`` backend that plans every training graph with remat; what
    ``remat.backend(...)`` calls.

    ``budget``: bytes (int), a fraction of the compiled region's eager peak (``0.6`` or
    ``"60%"``; measured when the region is compiled, so ``"100%"`` is no more than eager
    PyTorch), a size (``"2GiB"``) or ``"cuda-free"`` (the CUDA device's free memory at compile time plus
    what the graph's inputs hold). ``budget_bytes`` is an int ``budget``. A peak is what remat
    simulates for the compiled region: its inputs, parameters, activations, tangents and
    gradients.

    ``method`` and ``solver_options`` go to ``plan_graph`` (e.g. ``time_limit_s=30``).
    ``cost_model``: PROFILE times every node once per graph on synthetic inputs (ESTIMATE if
    that fails). ``scratch``: how kernel scratch memory is found (``remat.scratch``; by default
    measured with PROFILE, estimated otherwise). ``cache_dir``: where plans are kept (``"default"``:
    ``$XDG_CACHE_HOME/remat/plans``; None: this process only). ``fallback=False`` raises instead
    of using PyTorch's partitioner (an infeasible budget as ``InfeasibleBudgetError``, with the
    smallest budget; dynamo wraps it in its ``BackendCompilerFailed``). ``fw_compiler``/``bw_compiler`` compile the two graphs
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
    parsed = Budget.parse(check_budget(budget if budget is not None else budget_bytes,
                                       time_limit_s=solver_options.get("time_limit_s"), cuda_free=True, of=EAGER))
    _check_method(method, solver_options)
    distributed.check_group(process_group)
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model {cost_model!r} is not a CostModel; use CostModel.PROFILE or CostModel.ESTIMATE")
    if scratch is not None and not isinstance(scratch, ScratchModel):
        raise ValueError(f"scratch {scratch!r} is not a ScratchModel; use ScratchModel.MEASURE, ESTIMATE or NONE")
    if not isinstance(fallback, bool):
        raise ValueError(f"fallback={fallback!r} must be True (a graph remat cannot plan gets PyTorch's "
                         f"partitioner, with a warning) or False (it raises)")
    if cache_dir == "default":
        directory = backend_cache.default_cache_dir()
    else:
        directory = None if cache_dir is None else Path(cache_dir)
    return RematBackend(parsed, method, cost_model=cost_model, cache_dir=directory, fallback=fallback,
                        fw_compiler=fw_compiler, bw_compiler=bw_compiler, solver_options=solver_options,
                        scratch=scratch, process_group=process_group)


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
