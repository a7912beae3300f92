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
parameter, ``requires_grad``. Tensors are inputs of the step, not recorded here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        params = dict(model.named_parameters())
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
    return ModuleState(tuple(attributes), tuple(hooks), requires_grad)
