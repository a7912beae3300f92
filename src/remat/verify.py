"""Checking a planned step against plain PyTorch: same loss, gradients (of the parameters and of
the batch tensors that require grad), buffers, parameters and batch tensors the step modifies
in place, and random state, and the measured peak next to the simulated one. Each step runs on
its own copies of the model and of the batch."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from remat.errors import TraceError, a_type
from remat.execute import PlannedStep, grad_through_hooks
from remat.memory import MemoryReport, measure_peak, resident_bytes_of
from remat.optimize import TrainingStep
from remat.trace import InputRole, TracedStep, batch_index, check_batch


@dataclass(frozen=True, eq=False)
class StepState:
    """Everything a training step changes: loss, gradients, buffers, the random generator; the
    parameters it modified in place (``params``, by name) and the batch tensors (``batch``, by
    ``"batch[i]"``); the gradients of the batch tensors that require grad (``batch_grads``, by
    ``"batch[i]"``)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    rng_state: torch.Tensor
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    batch_grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Agreement:
    """How a step compares to a reference: ``bitwise`` when every tensor is ``torch.equal``;
    ``max_abs_diff`` over the floating-point tensors.

    ``check_step`` fills in what eager PyTorch does run to run when the steps differ: some
    kernels are not deterministic (on a CPU with several threads, ``index_put`` with
    ``accumulate``, the gradient of ``weight[ids]`` with repeated ids, adds in the order the
    threads get there), so eager differs from itself there. ``eager_nondeterministic`` names the
    tensors eager computed differently in repeated runs, ``eager_self_diff`` the largest
    difference it showed; ``matches_where_eager_is_deterministic`` is True when every tensor
    that differs is one of them."""

    bitwise: bool
    max_abs_diff: float
    mismatches: tuple[str, ...]
    eager_nondeterministic: tuple[str, ...] = ()
    eager_self_diff: float = 0.0

    @property
    def matches_where_eager_is_deterministic(self) -> bool:
        return set(map(_mismatch_label, self.mismatches)) <= set(self.eager_nondeterministic)


def _mismatch_label(mismatch: str) -> str:
    """The tensor a line of ``Agreement.mismatches`` names (``"grad w: max |diff| 1e-9"``: ``"grad w"``)."""
    return mismatch.split(":")[0]


def _copied(batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A step's own copy of the batch: each tensor cloned, requiring grad where it did (as a leaf:
    the gradient a step hands to a tensor computed outside it is compared, not passed on), so a
    step that modifies its input in place leaves the caller's, and the other step's, as they were."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in batch]


def eager_step(
    model: torch.nn.Module, batch: Sequence[torch.Tensor], loss_fn: Callable[..., torch.Tensor], *, seed: int = 0
) -> tuple[StepState, MemoryReport]:
    """One plain PyTorch step (``loss_fn(model, *batch).backward()``) on a copy of ``model`` and
    of ``batch``, with its measured peak (parameters, buffers and batch counted as resident), measured the
    way the step's device is (``measure_peak``: the profiler on CPU, the allocator on CUDA)."""
    anchors = [*list(model.parameters())[:1], *batch]  # (only their device is read)
    return _eager(model, batch, loss_fn, seed,
                  lambda step, resident: measure_peak(lambda *_: step(), *anchors, resident_bytes=resident))


def _eager_state(model: torch.nn.Module, batch: Sequence[torch.Tensor], loss_fn: Callable[..., torch.Tensor], *,
                 seed: int = 0) -> StepState:
    """``eager_step``'s state alone: the same step, its peak not measured."""
    return _eager(model, batch, loss_fn, seed, lambda step, resident: step())[0]


_Run = TypeVar("_Run")


def copied_model(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)``, also of a model whose modules hold a tensor computed with
    autograd as a plain attribute, which ``deepcopy`` refuses: the weight that the legacy
    ``torch.nn.utils.weight_norm`` computes before each forward from its parameters (so the
    copy's is recomputed too). Such attributes are copied detached. A parameter's Python
    attributes (a tag, ``w.no_decay = True``), which ``deepcopy`` of a parameter drops, are
    given to the copy's (a forward reading one computed another loss in the copy)."""
    computed = [(module, key, value) for module in model.modules() for key, value in vars(module).items()
                if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    try:
        for module, key, value in computed:
            module.__dict__[key] = value.detach()
        copied = copy.deepcopy(model)
        mine = dict(copied.named_parameters(remove_duplicate=False))
        for name, p in model.named_parameters(remove_duplicate=False):
            for key, value in vars(p).items():
                if key not in vars(mine[name]):
                    setattr(mine[name], key, copy.deepcopy(value))
        return copied
    finally:
        for module, key, value in computed:
            module.__dict__[key] = value


def _eager(model: torch.nn.Module, batch: Sequence[torch.Tensor], loss_fn: Callable[..., torch.Tensor], seed: int,
           run: Callable[[Callable[[], None], int], _Run]) -> tuple[StepState, _Run]:
    """One plain PyTorch step on a copy of ``model``, called through ``run(step, resident)``
    (``resident``: the bytes of the copy's parameters and buffers and of the batch), and
    ``run``'s result."""
    model = copied_model(model)
    batch = _copied(batch)
    resident = resident_bytes_of(list(model.parameters()), list(model.buffers()), batch)
    versions = {k: p._version for k, p in model.named_parameters()}
    batch_versions = [t._version for t in batch]
    torch.manual_seed(seed)
    kept: list[torch.Tensor] = []

    def step() -> None:
        loss = loss_fn(model, *batch)
        loss.backward()
        kept.append(loss.detach())

    result = run(step, resident)
    state = StepState(
        loss=kept[0],
        grads={k: p.grad for k, p in model.named_parameters()},
        buffers={k: b.clone() for k, b in model.named_buffers()},
        rng_state=torch.get_rng_state(),
        params={k: p.detach() for k, p in model.named_parameters() if p._version != versions[k]},
        batch={f"batch[{i}]": t.detach() for i, t in enumerate(batch) if t._version != batch_versions[i]},
        batch_grads={f"batch[{i}]": t.grad for i, t in enumerate(batch) if t.requires_grad},
    )
    return state, result


def planned_step(
    model: torch.nn.Module, batch: Sequence[torch.Tensor], traced: TracedStep, step: PlannedStep, *, seed: int = 0
) -> tuple[StepState, MemoryReport]:
    """Run a planned step once, measured, on a fresh copy of ``model`` and of ``batch``."""
    return _planned(model, batch, traced, step, seed, lambda run, flat: measure_peak(run, *flat))


def _planned_state(model: torch.nn.Module, batch: Sequence[torch.Tensor], traced: TracedStep, step: PlannedStep,
                   *, seed: int = 0) -> StepState:
    """``planned_step``'s state alone: the same step, its peak not measured."""
    return _planned(model, batch, traced, step, seed, lambda run, flat: run(*flat))[0]


def _planned(model: torch.nn.Module, batch: Sequence[torch.Tensor], traced: TracedStep, step: PlannedStep, seed: int,
             run: Callable[[Callable[..., None], list], _Run]) -> tuple[StepState, _Run]:
    """One planned step on a fresh copy of ``model`` and of ``batch``, called through
    ``run(step, flat_inputs)``, and ``run``'s result. The step's updates are applied as
    ``TrainingStep`` applies them (to buffers, parameters and batch tensors)."""
    model = copied_model(model)
    batch = _copied(batch)
    flat = traced.flat_inputs(model, batch)
    targets = traced.update_targets(model, batch)
    kept: list = []
    torch.manual_seed(seed)
    report = run(lambda *a: kept.append(step(*a)), flat)
    rng_state = torch.get_rng_state()
    out = traced.unpack(kept.pop())
    params = dict(model.named_parameters())
    with torch.no_grad():  # (the gradients through the parameters' hooks, as TrainingStep hands them out)
        grads = {k: g if g is None else grad_through_hooks(params[k], g) for k, g in out.grads.items()}
        for k, v in out.updates.items():
            targets[k].copy_(v)
    role_of = {s.key: s.role for s in traced.inputs}
    state = StepState(
        loss=out.loss,
        grads=grads,
        buffers={k: b.clone() for k, b in model.named_buffers()},
        rng_state=rng_state,
        params={k: targets[k].detach() for k in out.updates if role_of[k] is InputRole.PARAM},
        batch={k: targets[k].detach() for k in out.updates if role_of[k] is InputRole.INPUT},
        batch_grads=dict(out.input_grads),
    )
    return state, report


def compare(got: StepState, want: StepState) -> Agreement:
    """Compare two steps tensor by tensor."""
    mismatches: list[str] = []
    worst = 0.0

    def check(label: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        nonlocal worst
        if a is None or b is None:
            if a is not b:
                mismatches.append(f"{label}: present in one step only")
            return
        if a.shape != b.shape:
            mismatches.append(f"{label}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            return
        if torch.equal(a, b):
            return
        if a.is_floating_point():
            diff = float((a.double() - b.double()).abs().max())
            worst = max(worst, diff)
            mismatches.append(f"{label}: max |diff| {diff:.3g}")
        else:
            mismatches.append(f"{label}: differs")

    check("loss", got.loss, want.loss)
    for key in sorted(set(got.grads) | set(want.grads)):
        check(f"grad {key}", got.grads.get(key), want.grads.get(key))
    for key in sorted(set(got.batch_grads) | set(want.batch_grads), key=batch_index):
        check(f"grad {key}", got.batch_grads.get(key), want.batch_grads.get(key))
    for key in sorted(set(got.buffers) | set(want.buffers)):
        check(f"buffer {key}", got.buffers.get(key), want.buffers.get(key))
    for key in sorted(set(got.params) | set(want.params)):
        check(f"param {key}", got.params.get(key), want.params.get(key))
    for key in sorted(set(got.batch) | set(want.batch), key=batch_index):
        check(key, got.batch.get(key), want.batch.get(key))
    check("random generator state", got.rng_state, want.rng_state)
    return Agreement(bitwise=not mismatches, max_abs_diff=worst, mismatches=tuple(mismatches))


def _compare_modified(got: StepState, want: StepState, model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> Agreement:
    """``compare``, where a parameter or batch tensor one step modified in place and the other
    did not is compared with the value the other left it at: ``model``'s, ``batch``'s (both
    steps ran on copies of them)."""
    params = dict(model.named_parameters())

    def left(state: StepState, other: StepState) -> StepState:
        return replace(state, params={**{k: params[k].detach() for k in other.params if k in params}, **state.params},
                       batch={**{k: batch[batch_index(k)].detach() for k in other.batch}, **state.batch})

    return compare(left(got, want), left(want, got))


def check_step(step: object, loss_fn: Callable[..., torch.Tensor], *batch: torch.Tensor, seed: int = 0,
               eager_repeats: int = 2) -> Agreement:
    """Run one eager PyTorch step and one step of ``step`` (a ``remat.TrainingStep``) from copies
    of its model and of the batch (each step its own: requiring grad where the batch does), with
    the same seed, and compare loss, gradients (``"grad batch[0]"`` for a batch tensor that
    requires grad), buffers, the parameters (``"param 0.weight"``) and batch tensors
    (``"batch[0]"``) a step modified in place, and the random generator's state. ``step.model``
    and the batch are left as they were; it needs the memory of an eager step.
    When they differ, eager runs ``eager_repeats`` more times against its first run, and the
    result names the tensors eager itself does not reproduce (``Agreement``): a difference
    there is eager's own, not the plan's.

    >>> import torch, remat
    >>> from remat.verify import check_step
    >>> model, x = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)), torch.randn(3, 4)
    >>> loss_fn = lambda m, x: m(x).square().mean()
    >>> step = remat.optimize(model, x, loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    >>> check_step(step, loss_fn, x).bitwise
    True
    """
    order = "check_step(step, loss_fn, *batch)"
    swapped = " (step and loss_fn swapped?)" if isinstance(loss_fn, TrainingStep) else ""
    _check_step_argument(step, "check_step", order, swapped)
    if not callable(loss_fn):
        shown = f"a tensor of shape {tuple(loss_fn.shape)}" if isinstance(loss_fn, torch.Tensor) else a_type(loss_fn)
        raise TraceError(f"check_step's loss_fn is {shown}, not a callable (loss_fn left out?); call {order}, with "
                         f"the loss_fn given to remat.optimize")
    batch = step._batch(batch)
    loss_fn = step.positional(loss_fn)  # (a dict batch: gathered back into a dict for eager's loss_fn)
    with step._errors_by_key():
        step = step._step_for(batch)  # (the program eager runs for this batch: see ``TrainingStep.for_batch``)
        check_batch(step.traced.batch_spec, batch)  # (before eager runs it: a batch the step refuses is named)
        want = _eager_state(step.model, batch, loss_fn, seed=seed)  # (states only: no peak is read here)
        got = _planned_state(step.model, batch, step.traced, step.planned, seed=seed)
    agreement = _compare_modified(got, want, step.model, batch)
    if agreement.bitwise:
        return agreement
    unstable: dict[str, None] = {}
    worst = 0.0
    for _ in range(eager_repeats):
        again = _compare_modified(_eager_state(step.model, batch, loss_fn, seed=seed), want, step.model, batch)
        unstable.update(dict.fromkeys(map(_mismatch_label, again.mismatches)))
        worst = max(worst, again.max_abs_diff)
    return replace(agreement, eager_nondeterministic=tuple(unstable), eager_self_diff=worst)


def check_counted_bytes(step: object, *batch: torch.Tensor, seed: int = 0) -> list[str]:
    """Run ``step`` (a ``remat.TrainingStep``) once on a copy of its model and list every
    output, of every node as it runs, whose dtype or storage size is not what the plan was
    counted with: what remat's simulator, and so the predicted peak, assume each kernel
    allocates. An empty list: on this device every node's outputs are the bytes counted (kernel
    scratch aside, which the measured peak covers). Worth running once for a model with custom
    ops, whose fake implementations size the outputs the plan counts.

    >>> import torch, remat
    >>> model, x = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), torch.randn(3, 4)
    >>> loss_fn = lambda m, x: m(x).square().mean()
    >>> step = remat.optimize(model, x, loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    >>> check_counted_bytes(step, x)
    []
    """
    order = "check_counted_bytes(step, *batch)"
    _check_step_argument(step, "check_counted_bytes", order)
    if batch and callable(batch[0]):
        raise TraceError(f"check_counted_bytes takes the batch only, not loss_fn, and its first batch argument is "
                         f"{a_type(batch[0])}; call {order}")
    batch = step._batch(batch)
    with step._errors_by_key():
        step = step._step_for(batch)
    traced: TracedStep = step.traced
    model = copied_model(step.model)
    wrong: list[str] = []

    def observe(node: int, out: object) -> None:
        counted = traced.fx_node(node).meta.get("val")
        outs = out if isinstance(out, (tuple, list)) else [out]
        fakes = counted if isinstance(counted, (tuple, list)) else [counted]
        for k, (real, fake) in enumerate(zip(outs, fakes)):
            if not (isinstance(real, torch.Tensor) and isinstance(fake, torch.Tensor)):
                continue
            have, want = real.untyped_storage().nbytes(), fake.untyped_storage().nbytes()
            if real.dtype != fake.dtype or have != want:
                which = f"[{k}]" if isinstance(out, (tuple, list)) else ""
                wrong.append(f"{traced.node_names[node]}{which} ({traced.fx_node(node).target}): {real.dtype}, "
                             f"{have} B; counted {fake.dtype}, {want} B")

    torch.manual_seed(seed)
    with step._errors_by_key():
        flat = traced.flat_inputs(model, batch)
    step.planned.run(flat, observe=observe)
    return list(dict.fromkeys(wrong))  # a recomputed node reports once


def _check_step_argument(step: object, function: str, order: str, swapped: str = "") -> None:
    """Refuse (``TraceError``, as ``optimize`` refuses its arguments) a first argument of
    ``function`` that is not a ``TrainingStep``."""
    if not isinstance(step, TrainingStep):
        raise TraceError(f"{function}'s first argument is {a_type(step)}, not the TrainingStep remat.optimize "
                         f"returns{swapped}; call {order}")
