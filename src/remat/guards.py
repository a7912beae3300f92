"""What a traced step took from the model's Python state, checked before every step runs.

A traced step is a fixed program: the Python values its modules read while it was traced (a
scale, a flag, an epsilon, whether a submodule was in training mode, which parameters require
grad, which hooks were registered) are built into it. Changed afterwards, eager PyTorch would
compute something else while the traced step would not: a hook reading ``self.scale``, halved
after tracing, gave gradients exactly twice eager's, silently. So ``module_state`` records those
values when the step is traced and ``ModuleState.check`` refuses a step whose model no longer
has them, naming the module, the attribute and both values.

Recorded per module: every public attribute holding a number, string, bool or None (or a tuple
of them), ``training``, and the number of forward, backward and state-dict hooks; per
parameter, ``requires_grad``; per parameter and buffer, its shape, dtype, device and strides
(the step's kernels were chosen for them: a weight stored transposed after tracing gave
gradients a rounding apart, and one of another shape failed deep in a kernel). Tensors' values
are inputs of the step, not recorded here.

The step's own Python can change that state too, which a traced step never does: a forward
counting its calls (``self.calls += 1``, a warm-up scale read from it) kept the value of the
one traced call while eager's went on counting, and a draw from Python's ``random`` or numpy's
generator was the same number at every step, both silently. ``PythonState`` is taken before
tracing; ``PythonState.settle`` refuses a trace that drew from those generators, and one whose
module attributes change again when traced a second time (a flag set on the first call only,
such as transformers' ``_output_capturing_hooks_installed``, settles and is kept). A refused
trace leaves the attributes and generators as they were before it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

import torch

from remat.errors import TraceError

_SCALARS = (bool, int, float, str, type(None))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_MISSING = object()


def _recordable(value: object) -> bool:
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, tuple) and len(value) <= 16 and all(isinstance(v, _SCALARS) for v in value)


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _hook_count(module: torch.nn.Module) -> int:
    return sum(len(getattr(module, name, ())) for name in _HOOKS)


@dataclass(frozen=True)
class ModuleState:
    """The Python state of a model's modules and parameters that a traced step relies on, by
    qualified name (so a copy of the model is checked as itself)."""

    #: (module name, attribute, value when traced)
    attributes: tuple[tuple[str, str, object], ...]
    #: (module name, number of forward and backward hooks when traced)
    hooks: tuple[tuple[str, int], ...]
    #: (parameter name, requires_grad when traced)
    requires_grad: tuple[tuple[str, bool], ...]
    #: ("parameter" or "buffer", name, shape, dtype, device, strides) when traced: the step's
    #: kernels were chosen for them (a transposed weight's gradient rounds differently)
    layouts: tuple[tuple[str, str, tuple[int, ...], torch.dtype, torch.device, tuple[int, ...]], ...] = ()
    #: the autocast around the call when traced, per device type: (device type, dtype) where on
    autocast: tuple[tuple[str, torch.dtype], ...] = ()

    def check(self, model: torch.nn.Module) -> None:
        """Raise ``TraceError`` naming the first value that differs from when the step was traced."""
        modules = dict(model.named_modules(remove_duplicate=False))
        for name, key, value in self.attributes:
            module = modules.get(name)
            if module is None:
                raise TraceError(f"module {name!r} is gone from the model since the step was traced; trace again")
            now = module.__dict__.get(key, _MISSING)
            if key == "training" and isinstance(now, bool) and now != value:
                mode, other = ("train", "eval") if value else ("eval", "train")
                call = "model" if not name else f"model.get_submodule({name!r})"
                raise TraceError(
                    f"{_where(name, module)} was traced in {mode} mode but is now in {other} mode; "
                    f"call {call}.{mode}() or trace again (remat.optimize)"
                )
            if not _same(now, value):
                shown = "is no longer set" if now is _MISSING else f"is now {now!r}"
                raise TraceError(
                    f"{_where(name, module)} attribute {key!r} {shown} but was {value!r} when the step was "
                    f"traced, and the traced step computes with that value; trace again (remat.optimize) "
                    f"after changing it"
                )
        for name, count in self.hooks:
            module = modules.get(name)
            now = _hook_count(module) if module is not None else 0
            if now != count:
                raise TraceError(
                    f"{_where(name, module)} has {now} forward/backward hook(s) but had {count} when the step "
                    f"was traced; the traced step runs the hooks it was traced with: trace again "
                    f"(remat.optimize) after adding or removing hooks"
                )
        now = _autocast_state()
        if now != self.autocast:
            def shown(state: tuple) -> str:
                return ", ".join(f"torch.autocast({d!r}, dtype={dtype})" for d, dtype in state) or "no autocast"

            raise TraceError(
                f"step() runs under {shown(now)} but the step was traced under {shown(self.autocast)}; the "
                f"traced step's casts are those of its trace: put the autocast inside loss_fn (with "
                f"torch.autocast(...): return ...) and call step() outside any, or trace again (remat.optimize) "
                f"under the same autocast"
            )
        tensors = {"parameter": dict(model.named_parameters()), "buffer": dict(model.named_buffers())}
        for kind, key, shape, dtype, device, stride in self.layouts:
            t = tensors[kind].get(key)
            if t is None:
                continue  # (a tensor gone is named below, or by the step's own inputs)
            if (tuple(t.shape), t.dtype, t.device, t.stride()) != (shape, dtype, device, stride):
                raise TraceError(
                    f"{kind} {key!r} is now {_layout(t.shape, t.dtype, t.device, t.stride())} but was "
                    f"{_layout(shape, dtype, device, stride)} when the step was traced; the traced step's "
                    f"kernels were chosen for that layout: trace again (remat.optimize) after changing it"
                )
        params = tensors["parameter"]
        for key, flag in self.requires_grad:
            p = params.get(key)
            if p is None:
                raise TraceError(f"parameter {key!r} is gone from the model since the step was traced; trace again")
            if p.requires_grad != flag:
                raise TraceError(
                    f"parameter {key!r} has requires_grad={p.requires_grad} but had {flag} when the step was "
                    f"traced, so the step would {'not ' if p.requires_grad else ''}compute its gradient as "
                    f"eager PyTorch now would{'' if p.requires_grad else ' not'}; trace again (remat.optimize) "
                    f"after freezing or unfreezing parameters"
                )


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def _layout(shape: object, dtype: torch.dtype, device: torch.device, stride: object) -> str:
    return f"shape {tuple(shape)}, {dtype} on {device}, strides {tuple(stride)}"


def _where(name: str, module: torch.nn.Module | None) -> str:
    kind = type(module).__name__ if module is not None else "gone"
    return f"module {name!r} ({kind})" if name else f"the model ({kind})"


def module_state(model: torch.nn.Module) -> ModuleState:
    """``model``'s Python state as a traced step relies on it (see the module)."""
    attributes, hooks = [], []
    for name, module in model.named_modules(remove_duplicate=False):
        for key, value in vars(module).items():
            if (key == "training" or not key.startswith("_")) and _recordable(value):
                attributes.append((name, key, value))
        hooks.append((name, _hook_count(module)))
    requires_grad = tuple((key, p.requires_grad) for key, p in model.named_parameters())
    layouts = tuple((kind, key, tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
                    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers()))
                    for key, t in named)
    return ModuleState(tuple(attributes), tuple(hooks), requires_grad, layouts, _autocast_state())


T = TypeVar("T")


def _scalar_attributes(model: torch.nn.Module) -> dict[tuple[str, str], object]:
    """Every module's attributes holding numbers, strings, bools or None (or tuples of them),
    private ones included, by (module name, attribute)."""
    return {(name, key): value for name, module in model.named_modules(remove_duplicate=False)
            for key, value in vars(module).items() if _recordable(value)}


@dataclass(frozen=True)
class PythonState:
    """The Python state a training step's code may change while traced (see the module)."""

    attributes: dict[tuple[str, str], object]
    python_random: object
    numpy_random: tuple

    @classmethod
    def of(cls, model: torch.nn.Module) -> PythonState:
        return cls(_scalar_attributes(model), random.getstate(), np.random.get_state())

    def changes(self, model: torch.nn.Module) -> list[tuple[str, str, object, object]]:
        """(module name, attribute, value before, value now) for each attribute that differs;
        ``_MISSING`` for one absent on either side."""
        now = _scalar_attributes(model)
        modules = dict(model.named_modules(remove_duplicate=False))
        for (name, key) in self.attributes.keys() - now.keys():  # gone, or no longer a scalar
            module = modules.get(name)
            now[(name, key)] = module.__dict__.get(key, _MISSING) if module is not None else _MISSING
        return [(name, key, self.attributes.get((name, key), _MISSING), value)
                for (name, key), value in now.items() if not _same(self.attributes.get((name, key), _MISSING), value)]

    def drew(self) -> str | None:
        """Which global generator outside torch was drawn from since, if one was."""
        if random.getstate() != self.python_random:
            return "Python's random module"
        state = np.random.get_state()
        if any(not np.array_equal(a, b) for a, b in zip(state, self.numpy_random, strict=True)):
            return "numpy's global generator (np.random)"
        return None

    def restore(self, model: torch.nn.Module) -> None:
        """Put the attributes and the generators back as they were."""
        modules = dict(model.named_modules(remove_duplicate=False))
        for name, key, before, _ in self.changes(model):
            module = modules.get(name)
            if module is None:
                continue
            if before is _MISSING:
                module.__dict__.pop(key, None)
            else:
                module.__dict__[key] = before
        random.setstate(self.python_random)
        np.random.set_state(self.numpy_random)

    def settle(self, model: torch.nn.Module, again: Callable[[], T]) -> T | None:
        """After one trace taken from this state: refuse (``TraceError``, this state restored) a
        trace that drew from Python's or numpy's generator; where module attributes changed,
        trace ``again`` and refuse if they change once more (a counter, not a flag set once).
        Returns the second trace, taken from the settled state, or None when nothing changed."""
        drew = self.drew()
        if drew is not None:
            self.restore(model)
            raise TraceError(
                f"the training step draws from {drew} while it runs (in the model's forward or in "
                f"loss_fn): a traced step runs no Python, so every step would reuse the numbers drawn "
                f"when it was traced; draw with torch instead (torch.rand, torch.randint, "
                f"torch.bernoulli: remat replays torch's generator), or draw outside the step and pass "
                f"the values in the batch"
            )
        if not self.changes(model):
            return None
        settled = PythonState.of(model)
        try:
            result = again()
        except BaseException:
            self.restore(model)
            raise
        moving = settled.changes(model)
        drew = settled.drew()
        if not moving and drew is None:
            return result
        self.restore(model)
        if drew is not None:
            raise TraceError(f"the training step draws from {drew} while it runs (in the model's forward or "
                             f"in loss_fn); draw with torch instead (torch.rand, torch.randint)")
        modules = dict(model.named_modules(remove_duplicate=False))
        name, key, second, third = moving[0]
        first = self.attributes.get((name, key), _MISSING)
        shown = " -> ".join("(unset)" if v is _MISSING else repr(v) for v in (first, second, third))
        raise TraceError(
            f"{_where(name, modules.get(name))} attribute {key!r} changes each time the step runs "
            f"({shown} over two traces): a traced step runs no Python, so it would keep one value while "
            f"eager PyTorch changes it at every step; keep such state in a tensor buffer the forward "
            f"updates in place (self.register_buffer({key.lstrip('_')!r}, torch.zeros(())), then "
            f"self.{key.lstrip('_')}.add_(1)), or change it outside the model between steps"
        )
