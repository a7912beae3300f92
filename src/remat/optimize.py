"""``optimize``: trace a training step, plan it inside a memory budget, and hand back a
``TrainingStep`` that drops into an ordinary training loop.

>>> import torch
>>> from remat.models import get_workload
>>> w = get_workload("mlp", batch_size=4)
>>> step = optimize(w.model, w.batch, w.loss_fn, "100%", method="checkpoint_all", cost_model=None)
>>> opt = torch.optim.SGD(w.model.parameters(), lr=0.1)
>>> loss = step(w.batch); opt.step(); opt.zero_grad()
>>> step.report.predicted_peak_bytes <= step.report.budget_bytes
True

Gradients follow ``loss.backward()``: a parameter whose ``.grad`` is None receives the new
gradient (laid out like the parameter, as autograd does), an existing ``.grad`` is added to in
place. So ``optimizer.zero_grad()`` (set_to_none, the default) and gradient accumulation both
behave as usual. A batch tensor that requires grad (in the example batch, and so in every batch)
gets its gradient as from ``loss.backward()``: ``torch.autograd.backward`` hands it over, so a
leaf's ``.grad`` is set or added to, and a tensor computed outside the step (an encoder's output)
passes it on into the graph that computed it. Buffers, parameters and batch tensors the step
mutates (batch-norm running statistics, an embedding's ``max_norm`` renormalization, an input
modified in place) are updated once per call, after the plan has run; each is found before the
plan runs, so a step that cannot apply one writes nothing.

Plans are saved as JSON (``step.save(path)``) keyed by the traced graph's structural
fingerprint and the budget, with what was measured per node (costs, kernel scratch bytes);
``TrainingStep.load`` re-traces the model (cheap), rebuilds the report from the plan (the
simulator's account, not the file's words) and refuses a file made for another graph or
budget, one that does not parse, or one whose report the plan contradicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from remat.cost import CostModel
from remat.distributed import refuse_wrapped
from remat.errors import InfeasibleBudgetError, ScheduleError, TraceError, a_type
from remat.execute import PlanFacts, PlannedStep, build_module, grad_through_hooks
from remat.files import write_atomically
from remat.graph import Graph
from remat.guards import ModelView
from remat.planning import check_method, plan_graph
from remat.schedule import Plan, Schedule, plan_from_order
from remat.simulate import simulate
from remat.solvers import SolveStatus
from remat.solvers.base import relative_gap
from remat.trace import (KeywordBatch, LossFn, TracedStep, batch_index, check_arguments, keys_shown, keyword_batch,
                         named_by_key, tensors_of, trace, wrapped_dict)
from remat.units import BudgetError, check_budget, format_bytes, parse_budget, percent_hint

log = logging.getLogger("remat")

PLAN_FORMAT = "remat.training_step"
PLAN_VERSION = 3


class PlanFileError(ScheduleError):
    """A saved plan cannot be read (missing, not JSON, malformed)."""


class StalePlanError(PlanFileError):
    """A saved plan was made for a different graph or budget than the one asked for."""


@dataclass(frozen=True)
class StepReport:
    """What the plan promises. Costs are in the traced graph's unit (microseconds);
    ``overhead`` is the plan's cost over checkpoint-all's (1.0: no recomputation)."""

    method: str
    status: SolveStatus
    budget_bytes: int
    predicted_peak_bytes: int
    fixed_bytes: int
    checkpoint_all_peak_bytes: int
    cost_us: float
    checkpoint_all_cost_us: float
    overhead: float
    recomputed_nodes: int
    n_nodes: int
    solve_s: float
    fingerprint: str
    note: str = ""  # how the plan was found when the solver saw a grouped graph
    #: a lower bound on the cost of every plan of this step under the budget, in ``cost_us``'s
    #: unit (None when the method proves none)
    lower_bound_us: float | None = None

    @property
    def gap(self) -> float | None:
        """How far the plan's cost may be above the best possible, relative to its cost
        (``(cost_us - lower_bound_us) / cost_us``); None without a bound."""
        return relative_gap(self.cost_us, self.lower_bound_us)

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["status"] = self.status.value
        return record

    @classmethod
    def from_json(cls, record: dict[str, object]) -> StepReport:
        fields = dict(record)
        fields["status"] = SolveStatus(fields["status"])
        return cls(**fields)

    def __str__(self) -> str:
        return (
            f"{self.method} ({self.status.value}): predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"of budget {format_bytes(self.budget_bytes)} (checkpoint-all "
            f"{format_bytes(self.checkpoint_all_peak_bytes)}), overhead {self.overhead:.3f}x, "
            f"{self.recomputed_nodes} of {self.n_nodes} nodes recomputed"
            + (f"; no plan costs less than {self.lower_bound_us / self.checkpoint_all_cost_us:.3f}x (gap {self.gap:.1%})"
               if self.gap is not None and self.checkpoint_all_cost_us > 0 else "")
        )


class TrainingStep:
    """One planned training step of ``model``: ``step(batch)`` (or ``step(*batch)``) returns
    the loss (detached) and fills every trainable parameter's ``.grad`` as ``loss.backward()``
    would, and the gradient of every batch tensor that requires grad. ``batch`` is what
    ``optimize`` was given as ``example_inputs``, with the same shapes, and requiring grad where
    the example did: one tensor, or a tuple or list of tensors (as a ``DataLoader`` yields
    them)."""

    def __init__(
        self, model: torch.nn.Module, traced: TracedStep, plan: Plan, planned: PlannedStep, report: StepReport,
        replan: Replan | None = None, batch_keys: tuple[str, ...] | None = None,
    ) -> None:
        self.model = model
        self.traced = traced
        self.plan = plan
        self.planned = planned
        self.report = report
        self._replan = replan
        #: a batch given as a dict of tensors: its keys, in the order the step takes its tensors
        self.batch_keys = batch_keys
        #: the steps planned for each branch met so far, this one's included (shared between them)
        self._branches: dict[tuple[bool, ...], TrainingStep] = {traced.branch_answers: self}

    def __call__(self, *batch: torch.Tensor | Sequence[torch.Tensor], **keywords: object) -> torch.Tensor:
        if keywords:  # (``step(**batch)``: the dict is the batch)
            raise TraceError(
                f"step() got keyword arguments ({', '.join(map(str, keywords))}); pass the batch as it was given to "
                f"optimize: step(batch) for a dict batch, step(x, y) or step((x, y)) for a tuple"
            )
        if torch.is_inference_mode_enabled():  # (the gradients would be inference tensors, unusable after)
            raise TraceError(
                "step() was called under torch.inference_mode(), where eager PyTorch's backward raises: a "
                "training step computes gradients; call it outside inference_mode"
            )
        if not torch.is_grad_enabled():  # (it would compute and hand out gradients all the same)
            raise TraceError(
                "step() was called with gradients off (under torch.no_grad() or torch.set_grad_enabled(False)), "
                "where eager PyTorch's backward raises: a training step computes gradients; call it with "
                "gradients on"
            )
        batch = self._batch(batch)
        with self._errors_by_key():
            return self._step_for(batch)._run(batch)

    def for_batch(self, *batch: torch.Tensor | Sequence[torch.Tensor]) -> TrainingStep:
        """The planned step that runs ``batch`` as eager PyTorch does. Library code can pick the
        program eager runs from the batch's values: transformers attends without the
        ``attention_mask`` when it masks no token (``is_causal=True`` in SDPA) and adds it to the
        scores otherwise, which rounds otherwise (and builds a packed-sequence mask from
        ``position_ids`` only where a row holds several sequences). Such a step is traced for
        the example batch's branch (``traced.branch_points``); a batch that takes another gets
        the step traced and planned for that branch, with this step's method and budget, the
        first time one comes (``InfeasibleBudgetError`` if that program cannot fit the budget),
        and kept. Call it with a batch of each kind before training to plan every branch up
        front."""
        batch = self._batch(batch)
        with self._errors_by_key():
            return self._step_for(batch)

    def _step_for(self, batch: tuple[torch.Tensor, ...]) -> TrainingStep:
        """``for_batch`` of a batch ``_batch`` has already checked."""
        if not self.traced.branch_points:
            return self
        answers = self.traced.answers_for(batch)
        step = self._branches.get(answers)
        if step is None:
            if self._replan is None:
                raise TraceError(
                    f"this batch takes another branch at transformers' {_checks(self.traced)} than the step was "
                    f"traced for (answers {answers}, the example's {self.traced.branch_answers}), and this step "
                    f"cannot plan another: call remat.optimize with this batch"
                )
            log.info("planning the step for batches whose checks at %s answer %s (the example's: %s)",
                     _checks(self.traced), answers, self.traced.branch_answers)
            step = self._replan(answers, batch)
            step._replan, step._branches, step.batch_keys = self._replan, self._branches, self.batch_keys
            self._branches[answers] = step
        return step

    def _run(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        view = ModelView(self.model)  # (the model's tensors by name, read once for the step)
        flat = self.traced.flat_inputs(self.model, batch, view)
        targets = self.traced.update_targets(self.model, batch, view)  # (before anything runs or is written)
        outputs = self.traced.unpack(self.planned(*flat))
        params = view.parameters
        with torch.no_grad():
            for key, value in outputs.updates.items():  # (eager's come in its forward, before any hook)
                targets[key].copy_(value)
            handed: set[int] = set()  # the storages of the gradients handed out as .grad so far
            # one parameter at a time, as eager's backward: a hook sees the .grad and values eager's would
            for key in _in_backward_order(outputs.grads, self.traced.grad_order):
                # (taken out of the step's outputs: a gradient a hook replaces, or one copied into
                # the parameter's layout, is freed at once, as eager frees it, not held to the end
                # beside every other; held, three hooks' results measured 49% over the budget)
                grad = outputs.grads.pop(key)
                if grad is not None:
                    param = params[key]
                    grad = grad_through_hooks(param, grad)
                    _accumulate(param, grad, handed)
                    del grad
                    for hook in list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
                        hook(param)
        roots = [(batch[batch_index(key)], grad) for key, grad in outputs.input_grads.items() if grad is not None]
        if roots:  # as loss.backward() reaches them: into a leaf's .grad, or on into the graph that made it
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        return outputs.loss

    def _batch(self, args: tuple[object, ...]) -> tuple[torch.Tensor, ...]:
        """``step(x, y)``, ``step((x, y))`` and ``step([x, y])`` are one batch ``(x, y)``; a step
        traced with a dict batch takes dicts with its keys (in any order)."""
        if self.batch_keys is not None:
            if len(args) == 1 and wrapped_dict(args[0]):
                raise TraceError(
                    f"step() got {a_type(args[0])} holding one dict (keys {keys_shown(tuple(args[0][0]))}); pass "
                    f"the dict itself, step(batch), as the DataLoader yields it"
                )
            if len(args) != 1 or not isinstance(args[0], Mapping):
                raise TraceError(
                    f"step() got {_describe(args)}, but this step was traced with a dict batch (keys "
                    f"{keys_shown(self.batch_keys)}); pass one such dict, as the DataLoader yields it"
                )
            return tensors_of(args[0], self.batch_keys)
        if len(args) == 1 and isinstance(args[0], Mapping):
            raise TraceError(
                f"step() got a dict (keys {keys_shown(tuple(args[0]))}), but this step was traced with a batch of "
                f"{len(self.traced.batch_spec)} tensor(s), not a dict; pass the tensors as optimize's example was"
            )
        if len(args) == 1 and isinstance(args[0], (tuple, list)):
            args = tuple(args[0])
        want = len(self.traced.batch_spec)
        if len(args) == want and all(isinstance(t, torch.Tensor) for t in args):
            return args
        shapes = ", ".join(f"{tuple(s.shape)}" for s in self.traced.batch_spec)
        call = "step(x)" if want == 1 else f"step(({', '.join(_NAMES[:want])})) or step({', '.join(_NAMES[:want])})"
        raise TraceError(
            f"step() got {_describe(args)}, but this step was traced with a batch of {want} tensor(s) of shapes "
            f"{shapes} (the example_inputs given to optimize); call {call} with tensors of those shapes"
        )

    def _errors_by_key(self) -> contextlib.AbstractContextManager[None]:
        """Errors raised inside that name a batch tensor by position (``batch[1]``) name it by key
        (``batch['labels']``) for a step traced with a dict batch."""
        return named_by_key(self.batch_keys, (TraceError, PlanFileError))

    def positional(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` as the traced step calls it: with the batch's tensors as arguments (for a
        dict batch, gathered back into a dict with this step's keys)."""
        return loss_fn if self.batch_keys is None else KeywordBatch(loss_fn, self.batch_keys)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON: the order in which nodes are computed (values are freed at
        their last use), keyed by fingerprint and budget (no pickle: the file is data). A step
        with branches (``for_batch``) saves this one's; the loaded step plans the others again
        when a batch takes them."""
        record = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fingerprint": self.report.fingerprint,
            "budget_bytes": self.report.budget_bytes,
            "n_nodes": self.traced.graph.n,
            "structure_fingerprint": _structure_fingerprint(self.traced.graph),
            "batch_requires_grad": [s.requires_grad for s in self.traced.batch_spec],
            "branch_answers": list(self.traced.branch_answers),
            "batch_keys": None if self.batch_keys is None else list(self.batch_keys),
            "compute_order": list(self.plan.compute_order),
            # each operation's name and output bytes: a stale file's error names the first that differs
            "nodes": [[node.name, node.out_bytes] for node in self.traced.graph.nodes],
            **self.traced.measurements(),
            "report": self.report.to_json(),
        }
        target = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(target))
        if not target or os.path.isdir(target):
            raise PlanFileError(f"cannot save the plan to {target!r}: it is a folder, not a file; pass a file path such "
                                f"as {os.path.join(target or '.', 'plan.json')!r}")
        if not os.path.isdir(folder):
            raise PlanFileError(f"cannot save the plan to {target!r}: folder {folder!r} does not exist; create it "
                                f"(os.makedirs) or save elsewhere")
        try:
            write_atomically(target, json.dumps(record, separators=(",", ":")))
        except OSError as exc:  # (read-only, full, not a file system that takes files: /proc)
            raise PlanFileError(f"cannot save the plan to {target!r}: {exc.strerror or exc} in folder {folder!r}; "
                                f"save it in a folder you can write to") from None

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model: torch.nn.Module,
        example_inputs: torch.Tensor | Sequence[torch.Tensor],
        loss_fn: LossFn,
        *,
        budget_bytes: int | None = None,
        allow_native_batch_norm: bool = False,
    ) -> TrainingStep:
        """Rebuild a saved step without solving. Raises ``StalePlanError`` if the model's
        traced graph (or the requested budget) differs from the file's, ``PlanFileError`` if
        the file is missing or malformed. ``allow_native_batch_norm``: as in ``optimize``."""
        _check_load_arguments(path, model, loss_fn)
        refuse_wrapped(model, "TrainingStep.load()")
        budget_bytes = _saved_budget(budget_bytes)
        record = _read_plan(path)
        branches = _saved_branches(path, record)
        saved_keys = _saved_keys(path, record)
        example_inputs, loss_fn, keys = keyword_batch(example_inputs, loss_fn, saved_keys)
        if keys != saved_keys:
            def shown(k: tuple[str, ...] | None) -> str:
                return "a tuple of tensors" if k is None else f"a dict with keys {keys_shown(k)}"

            raise StalePlanError(
                f"saved plan {os.fspath(path)!r} was made for a batch given as {shown(saved_keys)}, and this "
                f"example batch is {shown(keys)}; pass the batch as it was saved, or run optimize() again"
            )
        with named_by_key(keys, (TraceError, PlanFileError)):
            traced = trace(model, example_inputs, loss_fn, cost_model=None,
                           allow_native_batch_norm=allow_native_batch_norm, branches=branches)
            if branches is not None and traced.branch_answers != branches:
                raise StalePlanError(
                    f"saved plan {os.fspath(path)!r} was made for a step that meets {len(branches)} check(s) of the "
                    f"batch's values (transformers' attention-mask and packed-sequence checks); this model and loss "
                    f"meet {len(traced.branch_answers)}: run optimize() again and save the new plan"
                )
            _check_requires_grad(path, record, traced)
        # the step's structure without what the file measured: a file saved for this step whose
        # measured scratch was edited is corrupt, not stale (files from before the field was
        # saved are told apart by the fingerprint alone)
        this_step = record.get("structure_fingerprint") == _structure_fingerprint(traced.graph)
        if record["n_nodes"] == traced.graph.n:
            try:
                traced = traced.with_measurements(record["node_costs"], record["temp_bytes"])
            except ValueError as exc:
                raise PlanFileError(f"saved plan {os.fspath(path)!r}: {exc}; the file is corrupt: run optimize() again") from exc
        graph = traced.graph
        fingerprint = graph.fingerprint(costs=False)
        if this_step and record["fingerprint"] != fingerprint:
            raise PlanFileError(
                f"saved plan {os.fspath(path)!r} was made for this training step, but its measured scratch "
                f"(temp_bytes) is not what it was saved with (graph fingerprint {record['fingerprint'][:12]}, "
                f"with its temp_bytes {fingerprint[:12]}); the file is corrupt: delete it and run optimize() again"
            )
        if record["fingerprint"] != fingerprint or record["n_nodes"] != graph.n:
            raise StalePlanError(
                f"saved plan {os.fspath(path)!r} was made for a different training step (graph "
                f"fingerprint {record['fingerprint'][:12]}, {record['n_nodes']} nodes; this model "
                f"traces to {fingerprint[:12]}, {graph.n} nodes){_first_difference(record, traced)}: the model, "
                f"batch shape, loss or which batch tensors require grad changed; run optimize() again and save the "
                f"new plan"
            )
        if budget_bytes is not None and budget_bytes != record["budget_bytes"]:
            raise StalePlanError(
                f"saved plan {os.fspath(path)!r} was made for budget {record['budget_bytes']} B, "
                f"not {budget_bytes} B; run optimize() with the new budget"
            )
        order = record["compute_order"]
        bad = next((i for i in order if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < graph.n), None)
        if bad is not None or not order:
            raise PlanFileError(
                f"saved plan {os.fspath(path)!r}: compute order names node {bad!r}, outside "
                f"0..{graph.n - 1}; the file is corrupt: delete it and run optimize() again"
            )
        plan = plan_from_order(graph, order)
        try:
            planned = build_module(traced, plan)
        except ScheduleError as exc:
            raise PlanFileError(
                f"saved plan {os.fspath(path)!r} does not replay on this graph ({exc}); the file is "
                f"corrupt: delete it and run optimize() again"
            ) from exc
        facts = PlanFacts.of(planned)
        problems = facts.contradictions(record["report"])
        if planned.sim.peak_bytes > record["budget_bytes"]:
            problems.append(f"the plan simulates to {planned.sim.peak_bytes} B, over its budget of {record['budget_bytes']} B")
        if problems:
            raise PlanFileError(
                f"saved plan {os.fspath(path)!r}: {'; '.join(problems[:3])}; the file is corrupt: run optimize() again"
            )
        try:
            stated = record["report"]
            report = StepReport(method=stated["method"], status=SolveStatus(stated["status"]), budget_bytes=record["budget_bytes"],
                                solve_s=float(stated["solve_s"]), note=str(stated.get("note", "")),
                                lower_bound_us=_stated_bound(stated.get("lower_bound_us")), **dataclasses.asdict(facts))
        except (TypeError, ValueError, KeyError) as exc:
            raise PlanFileError(f"saved plan {os.fspath(path)!r}: unreadable report ({exc}); the file is corrupt: "
                                f"delete it and run optimize() again") from exc
        if report.lower_bound_us is not None and report.lower_bound_us > report.cost_us * (1 + 1e-9):
            raise PlanFileError(
                f"saved plan {os.fspath(path)!r}: its lower bound ({report.lower_bound_us!r}) is above the cost its "
                f"plan simulates to ({report.cost_us!r}); the file is corrupt: run optimize() again"
            )
        replan = _branch_planner(model, loss_fn, report.budget_bytes, report.method, cost_model=CostModel.PROFILE,
                                 allow_native_batch_norm=allow_native_batch_norm)
        return cls(model, traced, plan, planned, report, replan, keys)


def _saved_keys(path: str | os.PathLike, record: dict) -> tuple[str, ...] | None:
    keys = record.get("batch_keys")  # (absent from files saved before dict batches)
    if keys is None:
        return None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise PlanFileError(f"saved plan {os.fspath(path)!r}: field 'batch_keys' is not a list of distinct strings; "
                            f"the file is corrupt: delete it and run optimize() again")
    return tuple(keys)


def _checks(traced: TracedStep) -> str:
    """The library checks at ``traced``'s branch points, each named once, for messages."""
    return ", ".join(dict.fromkeys(p.name for p in traced.branch_points))


def _saved_branches(path: str | os.PathLike, record: dict) -> tuple[bool, ...] | None:
    """The branches a saved plan's step took at its checks of the batch's values (None in
    files from before they were saved: the example's are taken)."""
    branches = record.get("branch_answers")
    if branches is None:
        return None
    if not isinstance(branches, list) or not all(isinstance(b, bool) for b in branches):
        raise PlanFileError(f"saved plan {os.fspath(path)!r}: branch_answers {branches!r} is not a list of true/false; "
                            f"the file is corrupt: delete it and run optimize() again")
    return tuple(branches)


def _saved_budget(budget: object) -> int | None:
    """``load``'s ``budget_bytes``: None, or a number of bytes (``116896``, ``"2GiB"``) that must
    equal the saved plan's; a fraction names no number of bytes (it was truncated to 0 B, and
    ``116896.9`` matched a plan of 116896 B)."""
    if budget is None:
        return None
    # (a number of bytes that is not positive: check_budget's message would suggest fractions,
    # which a saved plan's budget is not)
    value = None if isinstance(budget, int) and not isinstance(budget, bool) and budget <= 0 else check_budget(budget)
    if not isinstance(value, int):
        raise BudgetError(
            f"budget_bytes={budget!r} is not a number of bytes; give the budget the plan was saved with "
            f"(step.report.budget_bytes, e.g. 1073741824 or '1GiB'), or leave it out"
        )
    return value


_NAMES = ("x", "y", "z", *(f"t{i}" for i in range(3, 64)))


def _describe(args: tuple[object, ...]) -> str:
    def one(a: object) -> str:
        return f"a tensor of shape {tuple(a.shape)}" if isinstance(a, torch.Tensor) else a_type(a)

    if not args:
        return "no batch"
    return f"{len(args)} argument(s): " + ", ".join(one(a) for a in args)


def _in_backward_order(grads: Mapping[str, object], order: Sequence[str]) -> list[str]:
    """The keys of ``grads`` in ``order``, those ``order`` lacks after them (in their own order)."""
    listed = set(order)
    return [*(k for k in order if k in grads), *(k for k in grads if k not in listed)]


def _accumulate(param: torch.Tensor, grad: torch.Tensor, handed: set[int]) -> None:
    """Add ``grad`` into ``param.grad`` as autograd does. A fresh ``.grad`` has autograd's
    layout (``_grad_strides``) and a storage of its own: two parameters whose gradients are
    one value (``x + pos + typ``) get one tensor from the step, and sharing it would make an
    in-place change of one ``.grad`` (accumulation, clipping) change both."""
    if param.grad is None:
        storage = grad.untyped_storage().data_ptr()
        strides = _grad_strides(param)
        if grad.stride() != strides or storage in handed:
            grad = torch.empty_strided(param.shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)
        handed.add(grad.untyped_storage().data_ptr())
        param.grad = grad
    else:
        param.grad += grad


def _grad_strides(param: torch.Tensor) -> tuple[int, ...]:
    """The strides autograd gives a fresh ``.grad`` (its layout contract): the parameter's own
    where its elements are dense and do not overlap (a transposed or channels-last weight),
    else contiguous ones (a parameter that is a strided view, ``w[:, ::2]``: copied into its
    strides, the gradient took a storage twice its size, over the budget). A contiguous
    parameter, nearly every one, keeps its own without asking (this runs for each parameter
    at every step)."""
    return param.stride() if param.is_contiguous() else torch.empty_like(param, device="meta").stride()


def _first_difference(record: dict, traced: TracedStep) -> str:
    """Where the saved step and ``traced`` first differ, from the file's operation names and
    output bytes (``", ..."``), or nothing for a file without them (saved before they were)."""
    saved = record.get("nodes")
    if not isinstance(saved, list) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int) for e in saved):
        return ""
    now = [(node.name, node.out_bytes) for node in traced.graph.nodes]
    k = next((i for i, (a, b) in enumerate(zip(saved, now)) if tuple(a) != b), None)
    if k is None:
        if len(saved) == len(now):
            return ("; the same operations with the same output sizes, connected differently (or other parameters, "
                    "buffers or batch)")
        longer, extra = ("saved step", saved[len(now)][0]) if len(saved) > len(now) else ("this step", now[len(saved)][0])
        return f"; the {longer} goes on where the other ends, at operation {min(len(saved), len(now))} ({extra})"

    def shown(name: str, size: int, i: int | None) -> str:
        val = traced.fx_node(i).meta.get("val") if i is not None else None
        shape = (f", {str(val.dtype).replace('torch.', '')} {tuple(val.shape)}" if isinstance(val, torch.Tensor)
                 else "")
        return f"{name!r} ({format_bytes(size)}{shape})"

    return (f"; the first operation that differs is operation {k}: the saved step computed {shown(*saved[k], None)} "
            f"there, this one {shown(*now[k], k)}")


def _structure_fingerprint(graph: Graph) -> str:
    """``graph``'s fingerprint without costs or scratch (``temp_bytes``), the two things a plan
    file's measurements set: the same for every trace of one training step."""
    nodes = tuple(dataclasses.replace(n, temp_bytes=0) for n in graph.nodes)
    return Graph(nodes=nodes, fixed_bytes=graph.fixed_bytes, outputs=graph.outputs,
                 name=graph.name).fingerprint(costs=False)


def _check_requires_grad(path: str | os.PathLike, record: dict, traced: TracedStep) -> None:
    """Refuse a saved plan made for an example batch whose tensors required grad elsewhere than
    ``traced``'s (a file without the field, from before it was saved, is left to the
    fingerprint: such a step's graph has other nodes)."""
    saved = record.get("batch_requires_grad")
    if saved is None:
        return
    here = [s.requires_grad for s in traced.batch_spec]
    if len(saved) != len(here):
        return  # (another batch: the fingerprint refuses it)
    for i, (was, now) in enumerate(zip(saved, here)):
        if was != now:
            raise StalePlanError(
                f"saved plan {os.fspath(path)!r} was made with an example batch whose batch[{i}] "
                f"{'requires' if was else 'does not require'} grad, but this example batch's batch[{i}] "
                f"{'does not' if was else 'does'} (the step computes the gradients of the batch tensors "
                f"that required grad when it was planned): load it with an example batch whose batch[{i}] "
                f"{'requires' if was else 'does not require'} grad, or run optimize() again with this one"
            )


#: ``TrainingStep.load``'s arguments, in order, for messages
_LOAD_ORDER = "remat.TrainingStep.load(path, model, example_batch, loss_fn)"


def _check_load_arguments(path: object, model: object, loss_fn: object) -> None:
    """``check_arguments`` for ``TrainingStep.load``, whose messages give load's order of
    arguments, and a ``path`` that is a file path (the model first: path and model swapped)."""
    if not isinstance(path, (str, os.PathLike)):
        swapped = " (path and model swapped?)" if isinstance(path, torch.nn.Module) else ""
        raise TraceError(
            f"the path is {a_type(path)}, not a file path{swapped}; pass the file step.save() wrote, in the order "
            f"{_LOAD_ORDER}"
        )
    check_arguments(model, loss_fn, order=_LOAD_ORDER)


def _read_plan(path: str | os.PathLike) -> dict:
    where = os.fspath(path)
    try:
        with open(where) as f:
            record = json.load(f)
    except FileNotFoundError as exc:
        raise PlanFileError(f"no saved plan at {where!r}; run optimize() and step.save() first") from exc
    except IsADirectoryError as exc:
        raise PlanFileError(f"{where!r} is a folder, not a saved plan; pass the file step.save() wrote "
                            f"(such as {os.path.join(where, 'plan.json')!r})") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(
            f"saved plan {where!r} is not readable JSON ({exc}); the file is corrupt: delete it "
            f"and run optimize() again"
        ) from exc
    expected = {
        "format": str, "version": int, "fingerprint": str, "budget_bytes": int, "n_nodes": int,
        "compute_order": list, "node_costs": list, "temp_bytes": list, "report": dict,
    }
    if not isinstance(record, dict) or record.get("format") != PLAN_FORMAT:
        raise PlanFileError(
            f"{where!r} is not a remat plan file (no format {PLAN_FORMAT!r}); save one with step.save()"
        )
    for key, kind in expected.items():
        if not isinstance(record.get(key), kind):
            raise PlanFileError(
                f"saved plan {where!r}: field {key!r} is missing or not a {kind.__name__}; the file "
                f"is corrupt: delete it and run optimize() again"
            )
    structure = record.get("structure_fingerprint")  # (absent from files saved before it was recorded)
    if structure is not None and not isinstance(structure, str):
        raise PlanFileError(
            f"saved plan {where!r}: field 'structure_fingerprint' is not a str; the file is corrupt: "
            f"delete it and run optimize() again"
        )
    flags = record.get("batch_requires_grad")  # (absent from files saved before it was recorded)
    if flags is not None and not (isinstance(flags, list) and all(isinstance(f, bool) for f in flags)):
        raise PlanFileError(
            f"saved plan {where!r}: field 'batch_requires_grad' is not a list of booleans; the file "
            f"is corrupt: delete it and run optimize() again"
        )
    if record["version"] != PLAN_VERSION:
        raise PlanFileError(
            f"saved plan {where!r} has format version {record['version']}; this remat reads version "
            f"{PLAN_VERSION}: run optimize() again"
        )
    return record


def optimize(
    model: torch.nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    loss_fn: LossFn,
    budget: int | float | str | None = None,
    *,
    budget_bytes: int | None = None,
    method: str = "milp",
    cost_model: CostModel | None = CostModel.PROFILE,
    allow_native_batch_norm: bool = False,
    **solver_options: object,
) -> TrainingStep:
    """Plan the training step ``loss_fn(model, *example_inputs)`` to fit a memory budget at
    the least compute.

    ``budget``: bytes (``int``, ``"512MiB"``), a fraction of the checkpoint-all peak (``0.6``,
    ``"60%"``), as everywhere in remat (see ``remat.units``); ``budget_bytes`` is an ``int``
    ``budget``. Give exactly one. ``solver_options`` go to the method (e.g. ``time_limit_s=30``).
    Budget and time limit are checked before anything is traced (``BudgetError``), and so are
    the method and its options (``MethodError``: an unknown method, an option it does not take).

    Raises ``InfeasibleBudgetError`` (stating the least budget the method can meet) when the
    budget is too small, ``TraceError`` when the step cannot be traced or its traced form would
    not compute eager PyTorch's gradients (naming the module), ``WrappedModelError`` for a model
    under DistributedDataParallel or FSDP (compile those with ``remat.backend``).

    ``allow_native_batch_norm``: on a CUDA device with cuDNN on, eager PyTorch runs batch norms
    with cuDNN. The traced step runs the ops cuDNN's kernels run for a norm in training mode,
    with running statistics or without (``remat.batch_norm``), and PyTorch's native kernels for
    one in eval mode (measured bitwise cuDNN's); a norm it can do neither for would run the
    native kernels (as ``torch.compile`` does), which round differently, and is refused unless
    this is True.
    """
    check_arguments(model, loss_fn)
    given = budget
    budget = _budget_argument(budget, budget_bytes, solver_options)
    check_method(method, solver_options)  # (before tracing, which can take minutes)
    refuse_wrapped(model)
    example_inputs, loss_fn, keys = keyword_batch(example_inputs, loss_fn)
    with named_by_key(keys, (TraceError, PlanFileError)):
        traced = trace(model, example_inputs, loss_fn, cost_model=cost_model,
                       allow_native_batch_norm=allow_native_batch_norm)
    graph = traced.graph
    baseline = simulate(graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph))
    budget = parse_budget(budget, reference_bytes=baseline.peak_bytes)
    replan = _branch_planner(model, loss_fn, budget, method, cost_model=cost_model,
                             allow_native_batch_norm=allow_native_batch_norm, **solver_options)
    try:
        step = _planned(model, traced, budget, method, replan, **solver_options)
    except InfeasibleBudgetError as exc:
        hint = percent_hint(given)  # (budget="60": bytes, as documented, but likely meant as a percentage)
        if not hint:
            raise
        raise exc.with_detail(hint) from exc
    step.batch_keys = keys
    return step


#: ``replan(answers, batch)``: the step traced with ``answers`` at its branch points and planned
Replan = Callable[[tuple[bool, ...], tuple[torch.Tensor, ...]], "TrainingStep"]


def _planned(model: torch.nn.Module, traced: TracedStep, budget: int, method: str, replan: Replan | None,
             **solver_options: object) -> TrainingStep:
    """``traced`` planned under ``budget`` bytes by ``method``."""
    planned_graph = plan_graph(traced.graph, budget, method=method, **solver_options)
    result = planned_graph.result
    planned = build_module(traced, planned_graph.plan)
    report = StepReport(method=method, status=result.status, budget_bytes=budget, solve_s=result.solve_s,
                        note=planned_graph.note, lower_bound_us=planned_graph.lower_bound,
                        **dataclasses.asdict(PlanFacts.of(planned)))
    return TrainingStep(model, traced, planned_graph.plan, planned, report, replan)


def _branch_planner(model: torch.nn.Module, loss_fn: LossFn, budget: int, method: str, *,
                    cost_model: CostModel | None, allow_native_batch_norm: bool, **solver_options: object) -> Replan:
    """How a step plans a branch its example did not take (``TrainingStep.for_batch``): traced
    again with those answers, on the batch that takes it, and planned as the first was."""

    def replan(answers: tuple[bool, ...], batch: tuple[torch.Tensor, ...]) -> TrainingStep:
        traced = trace(model, batch, loss_fn, cost_model=cost_model, allow_native_batch_norm=allow_native_batch_norm,
                       branches=answers)
        if traced.branch_answers != answers:  # (the model's Python took another path this time)
            raise TraceError(
                f"traced again for this batch, the step met {len(traced.branch_answers)} check(s) of the batch's values "
                f"where it met {len(answers)}: the model's code paths changed since optimize(); call remat.optimize "
                f"again"
            )
        try:
            return _planned(model, traced, budget, method, None, **solver_options)
        except InfeasibleBudgetError as exc:
            raise InfeasibleBudgetError(
                budget_bytes=exc.budget_bytes, min_budget_bytes=exc.min_budget_bytes, method=exc.method,
                graph_name=exc.graph_name,
                detail=f"the program eager runs for this batch, whose checks at "
                       f"{_checks(traced)} answer {answers}, unlike "
                       f"the example's: it needs more memory; call remat.optimize again with the larger budget",
            ) from exc

    return replan


def _stated_bound(value: object) -> float | None:
    """A saved report's lower bound: None (older files, or none proven) or a number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"lower_bound_us {value!r} is not a cost")
    return float(value)


def _budget_argument(budget: object, budget_bytes: object, solver_options: dict[str, object]) -> int | float:
    """The one budget ``optimize`` was given, checked (with the time limit) before tracing."""
    if (budget is None) == (budget_bytes is None):
        raise BudgetError(
            f"give exactly one of budget= (bytes, a fraction such as 0.6, '60%', '2GiB') and budget_bytes= (int); "
            f"got budget={budget!r}, budget_bytes={budget_bytes!r}"
        )
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)):
        raise BudgetError(
            f"budget_bytes={budget_bytes!r} must be an int number of bytes; pass fractions and strings as budget= "
            f"(e.g. budget={budget_bytes!r})"
        )
    return check_budget(budget if budget is not None else budget_bytes, time_limit_s=solver_options.get("time_limit_s"))
