"""What a traced step took from the model's Python state, checked before every step runs.

A traced step is a fixed program: the Python values its modules read while it was traced (a
scale, a flag, an epsilon, whether a submodule was in training mode, which parameters require
grad, which hooks were registered) are built into it. Changed afterwards, eager PyTorch would
compute something else while the traced step would not: a hook reading ``self.scale``, halved
after tracing, gave gradients exactly twice eager's, silently. So ``module_state`` records those
values when the step is traced and ``ModuleState.check`` refuses a step whose model no longer
has them, naming the module, the attribute and both values.

Recorded per module: its name and class and a ``forward`` set on the instance (a submodule
swapped for another class, a layer appended to a ``ModuleList``, a patched ``forward``: each
ran the traced code), every public attribute holding a number, string, bool or None (or a tuple
of them) or a function (``self.act_fn = F.gelu``), the private ones the step's code names
(``_NamedBy``: ``self._scale`` behind a property ``scale`` that ``forward`` reads; private
attributes nothing names are bookkeeping), ``training``, and its forward and backward
hooks (the functions: one replaced by another ran the old one); per
parameter, ``requires_grad``; per parameter and buffer, its shape, dtype, device and strides
(the step's kernels were chosen for them: a weight stored transposed after tracing gave
gradients a rounding apart, and one of another shape failed deep in a kernel). Recorded beside
them: ``held_values``, the scalars and functions the step may read from outside module
attributes (a config object's fields, a global schedule dict ``loss_fn`` names, a helper
function it calls), and by content the small numpy arrays and sets of scalars the step's code
names (``SMALL_ARRAY``); of the training loop's own objects (an optimizer, an LR scheduler, a
progress bar a module holds: ``_loops_class``), only the fields the step's code names, as the
loop changes the rest between steps. Tensors' values are inputs of the
step, not recorded here, with one exception: a tensor neither the model's nor the batch's
whose value the step's Python reads (``loss * scaler.get_scale()``, which reads a GradScaler's
scale with ``.item()``) left the number read built into the step (the scaler halved its scale
after an overflow, the step went on scaling by the old one, silently). ``OutsideReads`` records
such reads while the step is traced, and the tensor is checked like a held value.

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

import collections
import contextvars
import dataclasses
import decimal
import dis
import enum
import fractions
import functools
import itertools
import logging
import math
import os
import random
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

import torch
from torch.overrides import TorchFunctionMode

from remat.errors import TraceError

#: (numpy scalars and enum members too, and values of torch's own that a step may read: a dtype
#: a forward casts to, ``self.cast = torch.bfloat16``; a slice it cuts with; each was kept
#: as traced, silently)
_SCALARS = (bool, int, float, complex, str, bytes, type(None), np.generic, enum.Enum, slice, range, fractions.Fraction,
            decimal.Decimal, torch.dtype, torch.device, torch.layout, torch.memory_format)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_MISSING = object()


def _recordable(value: object) -> bool:
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, tuple) and len(value) <= 16 and all(isinstance(v, _SCALARS) for v in value)


#: the functions a step's code may call through a module attribute, a dict or a global
#: (``self.act_fn = F.gelu``, ``self.acts["tanh"]``, a helper ``loss_fn`` calls): compared as
#: functions (``_callable_key``), so one put in the place of another is refused
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


#: numpy arrays of numbers or bools of at most this many elements, and sets of numbers,
#: strings and the like of at most this many, held where the step may read them, are compared
#: by content before each step (an array changed in place, a member removed from a set read as
#: ``if 3 in self.active``): a copy is recorded when the step is traced. Larger ones are data,
#: not settings, and are not compared (reading one again before each step would cost as much as
#: a small step).
SMALL_ARRAY = 4096


def _small_array(value: object) -> bool:
    """A numpy array of numbers or bools of at most ``SMALL_ARRAY`` elements."""
    return isinstance(value, np.ndarray) and value.size <= SMALL_ARRAY and value.dtype.kind in "biufc"


def _scalar_set(value: object) -> bool:
    """A set or frozenset of at most ``SMALL_ARRAY`` numbers, strings, bools or None (or short
    tuples of them)."""
    return isinstance(value, (set, frozenset)) and len(value) <= SMALL_ARRAY and all(_recordable(v) for v in value)


def _plain(value: object) -> bool:
    """A number, string, bool or None (or a short tuple of them), or a function: compared as it
    is (never changed in place)."""
    return _recordable(value) or isinstance(value, _FUNCTIONS)


def _guarded(value: object) -> bool:
    """Is ``value`` compared by the guards: a number, string, bool or None (or a short tuple of
    them), a function, a small numpy array or a small set of such values (by content: recorded
    as ``_snapshot``)?"""
    return _plain(value) or _small_array(value) or _scalar_set(value)


def _snapshot(value: object) -> object:
    """What ``value`` is recorded as: a copy of an array, a set or a partial (changed in place,
    the copy keeps the values traced: ``act.keywords['negative_slope'] = 0.5``), the value
    itself otherwise."""
    if isinstance(value, functools.partial) and type(value) is functools.partial:
        return functools.partial(value.func, *value.args, **value.keywords)
    return value.copy() if isinstance(value, (np.ndarray, set)) else value


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)):
        return a == b
    if isinstance(a, _FUNCTIONS) and isinstance(b, _FUNCTIONS):
        return _callable_key(a) == _callable_key(b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):  # (``OutsideReads``: NaN equals NaN)
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        equal = torch.eq(a, b)
        if a.is_floating_point() or a.is_complex():
            equal.logical_or_(a.isnan().logical_and_(b.isnan()))
        return bool(equal.all())
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and bool(a == b)


def _hooks_of(module: torch.nn.Module) -> tuple[object, ...]:
    """The forward and backward hooks registered on ``module`` (the functions themselves)."""
    state = module.__dict__  # (where nn.Module keeps them: no getattr, read every step)
    found: tuple[object, ...] = ()
    for name in _HOOKS:
        table = state.get(name)
        if table:
            found += tuple(table.values())
    return found


@dataclass(frozen=True)
class ModuleState:
    """The Python state of a model's modules and parameters that a traced step relies on, by
    qualified name (so a copy of the model is checked as itself)."""

    #: (module name, attribute, value when traced)
    attributes: tuple[tuple[str, str, object], ...]
    #: (module name, its forward and backward hooks when traced: compared by ``_callable_key``)
    hooks: tuple[tuple[str, tuple[object, ...]], ...]
    #: (parameter name, requires_grad when traced)
    requires_grad: tuple[tuple[str, bool], ...]
    #: ("parameter" or "buffer", name, shape, dtype, device, strides) when traced: the step's
    #: kernels were chosen for them (a transposed weight's gradient rounds differently)
    layouts: tuple[tuple[str, str, tuple[int, ...], torch.dtype, torch.device, tuple[int, ...]], ...] = ()
    #: the autocast around the call when traced, per device type: (device type, dtype) where on
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    #: values read from outside module attributes (``HeldValue``) with their values when traced
    held: tuple[tuple[HeldValue, object], ...] = ()
    #: (module name, its class, ``_callable_key`` of a ``forward`` set on the instance or None)
    #: of every module when traced: a module swapped for one of another class (``model.act =
    #: nn.ReLU()``), one added to a ``ModuleList`` that ``forward`` loops over, or a ``forward``
    #: patched on the instance runs code the trace never saw
    modules: tuple[tuple[str, type, object], ...] = ()
    #: the LSTMs (described) traced with oneDNN off that eager PyTorch runs through oneDNN's
    #: fused kernel with it on (``trace_errors.RnnWatch``): the step is eager's under that flag only
    onednn_off: tuple[str, ...] = ()
    #: torch's own state the traced step relies on (``torch_settings``: the hooks on every module,
    #: the default dtype and device) and the functions of torch's and other packages' modules that
    #: the model's code names (``library_functions``), each with its value when traced
    settings: tuple[tuple[HeldValue, object], ...] = ()
    #: the names of each parameter shared by several modules when traced (tied weights): the
    #: step has one input and one gradient for them
    tied: tuple[tuple[str, ...], ...] = ()

    def check(self, model: torch.nn.Module, view: ModelView | None = None) -> None:
        """Raise ``TraceError`` naming the first value that differs from when the step was traced.
        ``view``: the model's modules, parameters and buffers, when the caller has read them."""
        view = view if view is not None else ModelView(model)
        modules = view.modules
        if self.modules:
            self._check_modules(modules)
        for name, recorded in self._attributes_by_module:
            module = modules.get(name)
            if module is None:
                raise TraceError(f"module {name!r} is gone from the model since the step was traced; trace again")
            state = module.__dict__
            for key, value in recorded:
                now = state.get(key, _MISSING)
                if now is value:  # (the object recorded, still there: what nearly every check finds)
                    continue
                if key == "training" and isinstance(now, bool) and now != value:
                    mode, other = ("train", "eval") if value else ("eval", "train")
                    call = "model" if not name else f"model.get_submodule({name!r})"
                    raise TraceError(
                        f"{_where(name, module)} was traced in {mode} mode but is now in {other} mode; "
                        f"call {call}.{mode}() or trace again (remat.optimize)"
                    )
                if not _same(now, value):
                    raise _changed(f"{_where(name, module)} attribute {key!r}", now, value, _ELSEWHERE)
        for held, value in self.held:
            now = held.read(model)
            if not _same(now, value):
                raise _changed(held.label, now, value, ", or pass a value that changes between steps in the "
                                                       "batch, as a tensor" + _ELSEWHERE)
        for held, value in self.settings:
            now = held.read(model)
            if not _same(now, value):
                raise _changed(held.label, now, value)
        for name, recorded in self.hooks:
            module = modules.get(name)
            now = _hooks_of(module) if module is not None else ()
            if len(now) != len(recorded):
                raise TraceError(
                    f"{_where(name, module)} has {len(now)} forward/backward hook(s) but had {len(recorded)} when the "
                    f"step was traced; the traced step runs the hooks it was traced with: trace again "
                    f"(remat.optimize) after adding or removing hooks"
                )
            changed = next((h for h, r in zip(now, recorded) if _callable_key(h) != _callable_key(r)), None)
            if changed is not None:
                raise TraceError(
                    f"{_where(name, module)} has a forward/backward hook ({_hook_name(changed)}) that is not one it "
                    f"had when the step was traced (the same number of hooks, another function); the traced step "
                    f"runs the hooks it was traced with: trace again (remat.optimize) after replacing hooks"
                )
        if self.onednn_off and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
            lstms = ", ".join(self.onednn_off[:3]) + (f" and {len(self.onednn_off) - 3} more" if len(self.onednn_off) > 3
                                                      else "")
            raise TraceError(
                f"step() runs with oneDNN on, but the step was traced with it off (torch.backends.mkldnn.flags("
                f"enabled=False)), and with it on eager PyTorch runs {lstms} through oneDNN's fused LSTM kernel, "
                f"which rounds differently from the traced step; call the step under the flag it was traced with, "
                f"`with torch.backends.mkldnn.flags(enabled=False): loss = step(batch)`, and train eagerly under it "
                f"too wherever you compare the two"
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
        tensors = {"parameter": view.parameters, "buffer": view.buffers}
        for (kind, key, shape, dtype, device, stride), placed in zip(self.layouts, self._placements):
            t = tensors[kind].get(key)
            if t is None:
                continue  # (a tensor gone is named below, or by the step's own inputs)
            if t.shape != shape or t.dtype != dtype or t.stride() != stride or (
                    (t.is_cpu, t.is_cuda, t.get_device()) != placed if placed else t.device != device):
                raise TraceError(
                    f"{kind} {key!r} is now {_layout(t.shape, t.dtype, t.device, t.stride())} but was "
                    f"{_layout(shape, dtype, device, stride)} when the step was traced; the traced step's "
                    f"kernels were chosen for that layout: trace again (remat.optimize) after changing it"
                )
        for names in self.tied:  # (each name looked up in its module: no walk over every parameter)
            first = _parameter_of(modules, names[0])
            apart = [n for n in names[1:] if _parameter_of(modules, n) is not first]
            if apart:
                raise TraceError(
                    f"parameter {apart[0]!r} is no longer {names[0]!r} (they were one tied tensor when the step "
                    f"was traced, and the step computes with one tensor and one gradient for both); trace again "
                    f"(remat.optimize) after untying them")
        params = view.parameters
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

    def _check_modules(self, modules: dict[str, torch.nn.Module]) -> None:
        if len(modules) == len(self.modules) and all(
                (m := modules.get(name)) is not None and type(m) is cls and _forward_key(m) == forward
                for name, cls, forward in self.modules):
            return
        traced = {name: (cls, forward) for name, cls, forward in self.modules}
        for name, cls, forward in self.modules:
            module = modules.get(name)
            if module is None:
                raise TraceError(f"module {name!r} is gone from the model since the step was traced; trace again")
            if type(module) is not cls:
                raise TraceError(
                    f"{f'module {name!r}' if name else 'the model'} is now {type(module).__qualname__} but was "
                    f"{cls.__qualname__} when the "
                    f"step was traced; the traced step runs the modules it was traced with: trace again "
                    f"(remat.optimize) after replacing modules"
                )
            if _forward_key(module) != forward:
                raise TraceError(
                    f"{_where(name, module)} has its forward {'replaced' if forward is not None else 'set'} on the "
                    f"instance since the step was traced; the traced step runs the forward it was traced with: "
                    f"trace again (remat.optimize) after patching forward"
                )
        added = [name for name in modules if name not in traced]
        raise TraceError(
            f"the model has module(s) {', '.join(repr(n) for n in added[:4])} that it did not have when the step was "
            f"traced (added to a ModuleList or as an attribute); the traced step runs the modules it was traced with: "
            f"trace again (remat.optimize) after adding modules"
        )

    @functools.cached_property
    def _placements(self) -> tuple[tuple[bool, bool, int] | None, ...]:
        """Per entry of ``layouts``, its device as ``(t.is_cpu, t.is_cuda, t.get_device())`` of a
        tensor there, for CPU and CUDA (read from a tensor in a fraction of the time
        ``t.device`` takes); None for other devices, compared as devices."""
        def placed(device: torch.device) -> tuple[bool, bool, int] | None:
            if device.type == "cpu":
                return (True, False, -1)
            if device.type == "cuda" and device.index is not None:
                return (False, True, device.index)
            return None

        return tuple(placed(device) for _, _, _, _, device, _ in self.layouts)

    @functools.cached_property
    def _attributes_by_module(self) -> tuple[tuple[str, tuple[tuple[str, object], ...]], ...]:
        """``attributes`` grouped by module name, in their order (each module's are recorded
        together)."""
        groups: dict[str, list[tuple[str, object]]] = {}
        for name, key, value in self.attributes:
            groups.setdefault(name, []).append((key, value))
        return tuple((name, tuple(recorded)) for name, recorded in groups.items())


class ModelView:
    """A model's modules, parameters and buffers by qualified name, each read once: every one
    is a walk over the module tree, and one step reads them several times (the guards, the
    step's inputs, where its updates and gradients go)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @functools.cached_property
    def modules(self) -> dict[str, torch.nn.Module]:
        return dict(self.model.named_modules(remove_duplicate=False))

    @functools.cached_property
    def parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    @functools.cached_property
    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_buffers())


def _parameter_of(modules: dict[str, torch.nn.Module], name: str) -> torch.nn.Parameter | None:
    """The parameter ``name`` (``"1.weight"``) of the modules by qualified name, or None."""
    owner, _, leaf = name.rpartition(".")
    module = modules.get(owner)
    return None if module is None else module._parameters.get(leaf)


def _callable_key(fn: object) -> object:
    """What tells one function or hook from another, the same in a copy of the model
    (``copy.deepcopy`` keeps functions and copies the rest): a function or builtin itself, a
    bound method's function, a partial's function, or another callable object's class."""
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        return fn
    if isinstance(fn, types.MethodType):
        return ("method", fn.__func__)
    if isinstance(fn, functools.partial):  # (with its arguments: another ``negative_slope`` is another function)
        return ("partial", _callable_key(fn.func), tuple(map(_argument_key, fn.args)),
                tuple(sorted((k, _argument_key(v)) for k, v in fn.keywords.items())))
    return ("object", type(fn))


def _argument_key(value: object) -> object:
    """What tells a partial's argument from another: a number, string and the like by value, a
    function by ``_callable_key``, anything else by its class (a copy of the model copies it)."""
    if _recordable(value):
        return ("value", type(value), value)
    return _callable_key(value) if isinstance(value, _FUNCTIONS) else ("object", type(value))


def _forward_key(module: torch.nn.Module) -> object:
    """``_callable_key`` of a ``forward`` set on the module instance (not its class's), or None."""
    forward = module.__dict__.get("forward")
    return None if forward is None else _callable_key(forward)


def _hook_name(hook: object) -> str:
    code = getattr(getattr(hook, "__code__", None) or getattr(getattr(hook, "__func__", None), "__code__", None),
                   "co_filename", None)
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    line = getattr(getattr(hook, "__code__", None), "co_firstlineno", None)
    return f"{name} at {os.path.basename(code)}:{line}" if code and line else name


#: The remedy of a changed value the step may never read (an attribute of a module of a library's
#: class is guarded whether or not the step reads it: ``_NamedBy.unread``).
_ELSEWHERE = ("; a value the step never reads (a log, a counter the loop keeps, such as a global step) belongs "
              "outside what the model and loss_fn hold")


def _changed(what: str, now: object, value: object, remedy: str = "") -> TraceError:
    if isinstance(now, list) and isinstance(value, list) and len(value) > LONG_LIST:  # (named by its first change)
        i = next((i for i, (a, b) in enumerate(zip(now, value)) if not _same(a, b)), min(len(now), len(value)))
        what = f"{what}[{i}]"
        now, value = (now[i] if i < len(now) else _MISSING), (value[i] if i < len(value) else _MISSING)
    verb = "are" if what.startswith("the keys of ") else "is"
    shown = f"{verb} no longer set" if now is _MISSING else f"{verb} now {_value_shown(now)}"
    was = "unset" if value is _MISSING else _value_shown(value)
    return TraceError(f"{what} {shown} but {'were' if verb == 'are' else 'was'} {was} when the step was traced; a "
                      f"traced step keeps "
                      f"the values it may have read, so where it reads this one it would compute with the old value: "
                      f"trace again (remat.optimize) after changing it{remedy}")


def _value_shown(value: object) -> str:
    if isinstance(value, (set, frozenset)):  # (in order: the two sets compare at a glance)
        try:
            members = sorted(value)
        except TypeError:  # (of mixed kinds)
            members = sorted(value, key=repr)
        return "{" + ", ".join(map(repr, members)) + "}" if value else "an empty set"
    if isinstance(value, functools.partial):
        shown = [*map(repr, value.args), *(f"{k}={v!r}" for k, v in value.keywords.items())]
        name = getattr(value.func, "__qualname__", None) or type(value.func).__name__
        return f"functools.partial({', '.join([name, *shown])})"
    if isinstance(value, types.BuiltinFunctionType) and getattr(value, "__module__", None):
        return f"the function {value.__module__}.{value.__name__}"
    return f"the function {_hook_name(value)}" if isinstance(value, _FUNCTIONS) else repr(value)


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def _layout(shape: object, dtype: torch.dtype, device: torch.device, stride: object) -> str:
    return f"shape {tuple(shape)}, {dtype} on {device}, strides {tuple(stride)}"


def _where(name: str, module: torch.nn.Module | None) -> str:
    kind = type(module).__name__ if module is not None else "gone"
    return f"module {name!r} ({kind})" if name else f"the model ({kind})"


def module_state(model: torch.nn.Module, loss_fn: object = None,
                 reads: Sequence[tuple[HeldValue, object]] = (), onednn_off: Sequence[str] = ()) -> ModuleState:
    """``model``'s (and ``loss_fn``'s) Python state as a traced step relies on it (see the module);
    ``reads``: ``OutsideReads.held()`` of its trace; ``onednn_off``: ``RnnWatch.onednn_off``."""
    attributes, hooks, modules = [], [], []
    named = _NamedBy(model, loss_fn)
    for name, module in model.named_modules(remove_duplicate=False):
        for key, value in vars(module).items():
            if (key == "training" or not key.startswith("_") or named.private(module, key)) and _plain(value) \
                    and not named.unread(module, key):
                attributes.append((name, key, _snapshot(value)))
        hooks.append((name, _hooks_of(module)))
        modules.append((name, type(module), _forward_key(module)))
    requires_grad = tuple((key, p.requires_grad) for key, p in model.named_parameters())
    layouts = tuple((kind, key, tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
                    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers()))
                    for key, t in named)
    shared: dict[int, list[str]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(key)
    return ModuleState(tuple(attributes), tuple(hooks), requires_grad, layouts, _autocast_state(),
                       tuple(held_values(model, loss_fn)) + tuple(reads) + tuple(_parameter_attributes(model)),
                       tuple(modules), tuple(onednn_off),
                       tuple(torch_settings() + library_functions(model, loss_fn)),
                       tuple(tuple(names) for names in shared.values() if len(names) > 1))


def _parameter_attributes(model: torch.nn.Module) -> list[tuple[HeldValue, object]]:
    """The Python attributes of the model's parameters that are numbers, strings and the like
    (a tag, ``w.scale = 2.0``): the step is traced with them (``trace._dressed_as``), so one
    changed after is built in as a module's attribute is."""
    found = []
    for name, p in model.named_parameters():
        for key, value in vars(p).items():
            if _plain(value):
                def read(m, name=name, key=key):
                    try:
                        return vars(m.get_parameter(name)).get(key, _MISSING)
                    except AttributeError:
                        return _MISSING
                found.append((HeldValue(f"parameter {name!r} attribute {key!r}", read, lambda m, v: None), value))
    return found


#: torch's hooks on every module (``torch.nn.modules.module.register_module_forward_hook`` and
#: the like), run by every module's call: a traced step runs those registered when it was traced
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")


class _Hooks(tuple):
    """Hooks, compared one by one, shown by name."""

    def __repr__(self) -> str:
        return ", ".join(_hook_name(h) for h in self) or "none"


def _global_hooks(model: object = None) -> _Hooks:
    from torch.nn.modules import module

    return _Hooks(h for name in _GLOBAL_HOOKS for h in getattr(module, name, {}).values())


def _unchangeable(model: object, value: object) -> None:
    """``HeldValue.write`` of a setting the trace never changes."""


def torch_settings() -> list[tuple[HeldValue, object]]:
    """torch's state a traced step relies on, with its value now: the hooks on every module (one
    registered after tracing changed eager's outputs, not the step's), and the default dtype and
    device (a factory without a dtype in the step, such as ``torch.full((48,), 0.1)``, then made
    float64 tensors where the trace had float32, and the step failed)."""
    settings = (
        ("torch's hooks on every module (torch.nn.modules.module.register_module_forward_hook and the like)",
         _global_hooks),
        ("torch's default dtype (torch.set_default_dtype)", lambda m: torch.get_default_dtype()),
        ("torch's default device (torch.set_default_device)", lambda m: torch.get_default_device()),
    )
    return [(HeldValue(label, read, _unchangeable), read(None)) for label, read in settings]


#: How deep ``library_functions`` follows the functions a library module's code calls.
LIBRARY_DEPTH = 2


def library_functions(model: torch.nn.Module, loss_fn: object = None) -> list[tuple[HeldValue, object]]:
    """The functions that the code of the model's modules' classes from torch and other packages
    names through their modules' globals (``F.gelu`` in ``nn.GELU.forward``, transformers'
    ``apply_rotary_pos_emb`` in a Llama attention's ``forward``), and those these functions name
    in turn, ``LIBRARY_DEPTH`` deep, with their values now. The trace ran the function each name
    held; one rebound after tracing (``F.gelu = ...``, a kernel library patching
    ``modeling_llama.apply_rotary_pos_emb``) changed eager's step and not the traced one,
    silently. The code of the user's classes, of ``loss_fn`` and of the user's hooks gives the
    functions it names through torch's and other packages' modules (``F.gelu``); the functions
    it names directly, and the user's own modules, are ``held_values``'."""
    found: dict[tuple[int, str], tuple[HeldValue, object]] = {}
    walked: set[int] = set()
    methods: dict[str, str] = {}  # (a name the code reads as an attribute: who reads it first)

    def names_in(fn: types.FunctionType, who: str, depth: int, users: bool = False) -> None:
        """``users``: ``fn`` is the user's code: only what it names through installed modules."""
        if id(fn) in walked:  # (by function: decorated forwards share their decorator's code)
            return
        walked.add(id(fn))
        inner = getattr(fn, "__wrapped__", None)  # (a decorated forward: the decorator's code and the forward's)
        if isinstance(inner, types.FunctionType):
            names_in(inner, who, depth, users)
        scope, names = fn.__globals__, _code_names(fn.__code__)
        for name in names:
            methods.setdefault(name, who)
        for name in sorted(names):
            value = scope.get(name, _MISSING)
            if isinstance(value, types.ModuleType) and (not users or _installed(value.__name__)):
                places = [(value, vars(value), attribute) for attribute in sorted(names)  # (``F.gelu``)
                          if isinstance(vars(value).get(attribute), _FUNCTIONS)]
            elif isinstance(value, _FUNCTIONS) and not name.startswith("__") and not users:
                places = [(None, scope, name)]
            elif _function_table(value) and not users:  # (transformers' ALL_ATTENTION_FUNCTIONS[...])
                places = [(name, value, key) for key in list(value) if isinstance(value.get(key), _FUNCTIONS)]
            else:
                continue
            for module, table, key in places:
                if (id(table), key) in found:
                    continue
                if isinstance(module, str):  # (an entry of a table of functions named ``module``)
                    shown = f"{scope.get('__name__', '?')}.{module}[{key!r}]"
                else:
                    shown = f"{module.__name__ if module is not None else scope.get('__name__', '?')}.{key}"
                now = table[key]
                found[(id(table), key)] = (HeldValue(f"{shown} (which {who} calls)",
                                                     lambda m, t=table, k=key: t.get(k, _MISSING), _unchangeable), now)
                if isinstance(now, types.FunctionType) and depth < LIBRARY_DEPTH and not _user_module(now.__module__):
                    names_in(now, now.__qualname__, depth + 1)

    classes = list(dict.fromkeys(type(m) for m in model.modules()))
    for cls in classes:
        for base in cls.__mro__:
            if base in (object, torch.nn.Module) or _user_class(base):
                continue
            for key in _reached_methods(base):
                names_in(_member_function(vars(base)[key]), f"{base.__qualname__}.{key}", 1)
        for owner, key, fn in user_members(cls):
            names_in(fn, f"{owner}.{key}", 1, users=True)
    hooks = [hook for m in model.modules() for hook in _hooks_of(m)]
    for fn in _loss_and_hook_functions(loss_fn, hooks):
        names_in(fn, "loss_fn" if fn is _function_of(loss_fn) else fn.__qualname__, 1, users=True)
    for name in sorted(methods):  # (``torch.Tensor.relu = ...`` after tracing: ``x.relu()`` ran the old one)
        method = getattr(torch.Tensor, name, None) if not name.startswith("__") else None
        if callable(method) and not isinstance(method, type):
            found[(id(torch.Tensor), name)] = (HeldValue(
                f"torch.Tensor.{name} (a tensor method {methods[name]} may call)",
                lambda m, k=name: getattr(torch.Tensor, k, _MISSING), _unchangeable), method)
    return list(found.values())


#: A dict (or another mapping) of at most this many entries, keyed by strings, that a library's
#: code names and that holds functions is a table the code picks one from by name (transformers'
#: ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``): its functions are held.
FUNCTION_TABLE = 64


def _function_table(value: object) -> bool:
    if not isinstance(value, (dict, Mapping)) or isinstance(value, types.MappingProxyType):
        return False
    try:
        return 0 < len(value) <= FUNCTION_TABLE and all(isinstance(k, str) for k in value) \
            and any(isinstance(value.get(k), _FUNCTIONS) for k in value)
    except Exception:  # noqa: BLE001 - a mapping that cannot be listed: not a table
        return False


def _reached_methods(cls: type) -> list[str]:
    """``forward`` of ``cls`` (its own) and the methods of its own that it names, in turn."""
    own = vars(cls)
    todo, reached = ["forward"], []
    while todo:
        key = todo.pop()
        fn = _member_function(own.get(key)) if key not in reached else None
        if fn is None:
            continue
        reached.append(key)
        todo += [name for name in _code_names(fn.__code__) if name in own]
    return reached


# ---------------------------------------------------------------------------- tensors read outside the trace
#: the ``torch.Tensor`` methods that hand a tensor's values to Python
_VALUE_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__index__", "__bool__", "__complex__")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_REMAT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class OutsideReads(TorchFunctionMode):
    """While in use (around tracing a step), records the plain tensors (not the trace's: neither
    the model's parameters and buffers nor the batch) that the step's Python reads the values of
    (``.item()``, ``float(t)``, ``.tolist()``, ``bool(t)``...), such as a ``GradScaler``'s scale
    read by ``scaler.get_scale()``, and those it computes with (``x / (self.scale * 2)`` with
    ``self.scale`` a tensor attribute, not a buffer: ``self.scale * 2`` is a constant to the
    trace). What the step got from them is built into the traced step; ``held`` gives them as
    ``HeldValue`` entries with their values now, so ``ModuleState.check`` refuses a step once
    they change. A tensor computed with counts only when the model or ``loss_fn`` holds it
    (``outside_tensors``; temporaries such as ``torch.tensor(2.0)`` in ``forward`` never change).
    Reads by remat's own code (and torch's on its behalf) are not the step's and are left out. A
    torch function mode: it sees every torch call of its thread, before dispatch (a trace costs
    6-13% more: GPT-2 small 2.03 s against 1.92 s, ResNet-50 1.39 s against 1.23 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, tuple[torch.Tensor, str, str]] = {}

    def __torch_function__(self, func: Callable, types: object, args: Sequence[object] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        how = getattr(func, "__name__", None)
        how = how if how in _VALUE_READS else "used"
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if type(t) in (torch.Tensor, torch.nn.Parameter):
                    self._saw(t, how, sys._getframe(1))
        return func(*args, **kwargs)

    def clear(self) -> None:
        self.found.clear()

    def _saw(self, t: torch.Tensor, how: str, frame: types.FrameType | None) -> None:
        if id(t) not in self.found or (how != "used" and self.found[id(t)][1] == "used"):
            where = _reader(frame)
            if where is not None:
                self.found[id(t)] = (t, how, where)

    def held(self, model: torch.nn.Module, loss_fn: object = None) -> list[tuple[HeldValue, object]]:
        """Each tensor recorded (those computed with only where ``outside_tensors`` finds them),
        as a ``HeldValue`` (its values now: a tensor), with a copy of its values. A tensor found
        where the model or ``loss_fn`` holds it is read there at each check, so one put in its
        place (``model.scale = torch.tensor(3.0)``) is compared too, not only the one traced."""
        named = outside_tensors(model, loss_fn)
        out = []
        for t, how, where in self.found.values():
            if how == "used" and id(t) not in named:
                continue
            label, locate = named.get(id(t), ("the tensor", None))
            what = label + f" (shape {tuple(t.shape)}, neither the model's nor the batch's)"
            if how == "used":
                label = f"{what}, which the step computes with at {where},"
            else:
                call = f"{how}()" if not how.startswith("__") else f"{how.strip('_')}(tensor)"
                label = f"{what}, whose value {call} read at {where},"
            if locate is None:
                read = lambda m, t=t: t.detach()  # noqa: E731  (held nowhere we can name: the tensor itself)
            else:
                def read(m, locate=locate):
                    now = locate(m)
                    return now.detach() if isinstance(now, torch.Tensor) else now
            out.append((HeldValue(label, read, lambda m, v: None), t.detach().clone()))
        return out


#: how deep ``outside_tensors`` looks into containers and objects, how many entries of each, and
#: how many containers in all (a model holding a tokenizer or a dataset stays cheap to trace)
OUTSIDE_DEPTH = 4
OUTSIDE_ENTRIES = 256
OUTSIDE_CONTAINERS = 20_000
#: ``nn.Module``'s own attributes (parameters, buffers, submodules, hooks): not the user's tensors
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def outside_tensors(model: torch.nn.Module, loss_fn: object = None
                    ) -> dict[int, tuple[str, Callable[[torch.nn.Module], object]]]:
    """id -> (description, locate) of the tensors the model and ``loss_fn`` hold outside the step's
    inputs: modules' attributes that are not parameters or buffers, and the globals and closure
    variables of ``loss_fn``, of the user's modules' ``forward`` and of the user's hooks, directly
    or inside the lists, tuples, dicts, namespaces and objects they hold, up to ``OUTSIDE_DEPTH``
    levels (private fields included: a ``GradScaler``'s ``_scale``). ``locate(model)`` follows the
    same path again (from ``model``, which may be a copy, for a module's attribute) and gives the
    value there now, ``_MISSING`` where the path is gone."""
    found: dict[int, tuple[str, Callable[[torch.nn.Module], object]]] = {}
    seen: set[int] = set()
    modules = list(model.named_modules())
    in_model = {id(m) for _, m in modules}

    def look(label: str, value: object, locate: Callable[[torch.nn.Module], object], depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if not isinstance(value, torch.nn.Parameter):
                found.setdefault(id(value), (label, locate))
            return
        if depth >= OUTSIDE_DEPTH or id(value) in seen or id(value) in in_model or len(seen) >= OUTSIDE_CONTAINERS:
            return
        if isinstance(value, dict):
            entries = [(k, f"{label}[{k!r}]") for k in list(value)[:OUTSIDE_ENTRIES]]
        elif isinstance(value, (list, tuple)):
            entries = [(i, f"{label}[{i}]") for i in range(min(len(value), OUTSIDE_ENTRIES))]
        elif _is_holder(value) or isinstance(value, torch.nn.Module):
            keys = list(vars(value)) if hasattr(value, "__dict__") else _slots(value)
            entries = [(k, f"{label}.{k}") for k in keys[:OUTSIDE_ENTRIES]
                       if not (isinstance(value, torch.nn.Module) and k in _MODULE_INTERNALS)]
        else:
            return
        seen.add(id(value))
        for key, shown in entries:
            look(shown, _get(value, key), lambda m, key=key: _get(locate(m), key), depth + 1)

    for name, module in modules:
        for key, value in vars(module).items():
            if key not in _MODULE_INTERNALS:
                look(f"model.{name}.{key}" if name else f"model.{key}", value,
                     lambda m, n=name, k=key: _get(_submodule(m, n), k), 1)
    functions = [("loss_fn", loss_fn)] if loss_fn is not None else []
    functions += [(f"{cls.__qualname__}.forward", cls.forward)
                  for cls in sorted({type(m) for _, m in modules}, key=lambda c: c.__qualname__) if _user_class(cls)]
    functions += [(f"a hook of {_where(name, module)}", hook) for name, module in modules
                  for hook in _hooks_of(module) if _user_module(getattr(_function_of(hook), "__module__", "torch"))]
    for what, fn in functions:
        for kind, name, value, read, _write in function_names(fn):
            look(f"{what}'s {kind} {name!r}", value, lambda m, r=read: r(), 1)
    return found


def _reader(frame: types.FrameType | None) -> str | None:
    """The line that read a tensor's values, as a message shows it: the innermost frame outside
    torch; None where that is remat's own code."""
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None or os.path.abspath(frame.f_code.co_filename).startswith(_REMAT_DIR):
        return None
    from remat.trace_errors import _line_shown

    return _line_shown(frame.f_code.co_filename, frame.f_lineno)


# ---------------------------------------------------------------------------- values held outside modules
@dataclass(frozen=True)
class HeldValue:
    """A Python number, string, bool or None (or a function, a small numpy array or a small set
    of scalars) the step may read from outside the model's module attributes (or by content
    from one: ``model.w_np``): a field of an object a module holds (``self.config.temperature``),
    a public class attribute of a module's class, or a global, closure variable or class attribute named
    by ``loss_fn`` or a module's ``forward`` (``sched["beta"]``, a loss weight annealed between
    steps). ``read(model)`` gives its value now (``_MISSING`` where gone); ``write`` puts one
    back. A traced step keeps the value it was traced with (a KL weight raised from 0 to 0.5
    after tracing: loss 1.50 against eager's 1.67, silently)."""

    label: str
    read: Callable[[torch.nn.Module], object]
    write: Callable[[torch.nn.Module, object], None]
    #: for a list's, deque's or set's length (``PythonState``): does it now hold a tensor (a
    #: stash the trace filled, which is warned about, rather than a counter)?
    stash: Callable[[torch.nn.Module], bool] | None = None


def _context_value(var: contextvars.ContextVar) -> object:
    """What ``var.get()`` gives in this context (its default where unset), ``_MISSING`` where it
    has neither."""
    try:
        return var.get()
    except LookupError:
        return _MISSING


def _iterator(value: object) -> bool:
    """Is ``value`` an iterator the step could advance with ``next()`` (an ``itertools.cycle``, a
    generator), not a tensor or a module?"""
    return isinstance(value, Iterator) and not isinstance(value, (torch.Tensor, torch.nn.Module))


def _held_class(value: object) -> bool:
    """Is ``value`` a class of the user's that a module or the step's code may hold as a
    configuration (``self.cfg = Config``, read as ``self.cfg.temp``): not a module's or an
    autograd function's class, whose code runs rather than being read?"""
    return isinstance(value, type) and _user_class(value) and value is not object \
        and not issubclass(value, (torch.nn.Module, torch.autograd.Function))


def _user_object(value: object) -> bool:
    """Is ``value`` an object of a class of the user's (not a container, a class, a module or a
    tensor) whose methods the step may call (``self.holder.scale(h)``)?"""
    return not isinstance(value, (dict, list, tuple, type, torch.nn.Module, torch.Tensor, types.ModuleType)) \
        and _held_class(type(value))


def _is_holder(value: object) -> bool:
    """An object whose scalar fields a step may read: a dict, a list, a namespace, a dataclass or
    a config object (anything with a ``__dict__`` that is not a module, tensor, function, class,
    Python module or random generator)."""
    if isinstance(value, (dict, list)) or _mapping(value):
        return True
    if isinstance(value, tuple):  # (a short tuple of numbers is a value; one holding a dict, a holder)
        return not _recordable(value)
    if isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
                          types.MethodType, types.BuiltinFunctionType, functools.partial, logging.Logger,
                          np.ndarray, *_GENERATORS)):
        return False
    return (hasattr(value, "__dict__") or bool(_slots(value))) and not callable(value)


def _slots(value: object) -> list[str]:
    """The public slots of ``value``'s class and its bases (a ``@dataclass(slots=True)``)."""
    names = []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if not n.startswith("_")]
    return [n for n in dict.fromkeys(names) if not n.startswith("_") and hasattr(value, n)]


#: Random generators a model or ``loss_fn`` may own: a draw from one while the step is traced is
#: built into the step (every step reused it, silently), so it is refused as the global ones are.
_GENERATORS = (random.Random, np.random.Generator, np.random.RandomState)


def _generator_state(g: object) -> object:
    if isinstance(g, random.Random):
        return g.getstate()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    return g.get_state()


def _set_generator_state(g: object, state: object) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _same_state(a: object, b: object) -> bool:
    """Equal generator states (dicts, tuples and numpy arrays within)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


#: How deep ``held_values`` looks into holders inside holders (``model.cfg.extra['temp']``,
#: ``model.cfg.model.encoder.attention['dropout']``).
NESTED_HOLDERS = 4

#: Fields of transformers' configs that record where a model came from, which no forward reads
#: (``save_pretrained`` sets ``architectures``: a checkpoint between steps refused every later
#: step), and its generation settings (for ``generate``, not the training step).
_TRANSFORMERS_METADATA = frozenset({"architectures", "transformers_version", "name_or_path", "_name_or_path"})


def _metadata(holder: object, key: object) -> bool:
    """Is ``holder.key`` transformers' bookkeeping (see ``_TRANSFORMERS_METADATA``)?"""
    module = type(holder).__module__ or ""
    if not module.startswith("transformers"):
        return False
    return key in _TRANSFORMERS_METADATA or type(getattr(holder, str(key), None)).__name__ == "GenerationConfig"


def _unset_dtype(holder: object, key: object) -> bool:
    """Is ``holder.key`` the ``dtype`` (or ``torch_dtype``) of a transformers config? Unset (None),
    it means the model's own dtype; ``save_pretrained`` sets it to that dtype's name ('float32'),
    which means the same (``_read_unset_dtype``): a checkpoint between steps refused every later
    step (GPT-Neo's forward names ``config.dtype``)."""
    return key in ("dtype", "torch_dtype") and (type(holder).__module__ or "").startswith("transformers") \
        and _configuration(type(holder))


def _read_unset_dtype(read: Callable[[torch.nn.Module], object], dtypes: frozenset[torch.dtype],
                      model: torch.nn.Module) -> object:
    """``read(model)``, a transformers config's ``dtype`` traced unset (None), as None where it
    now names the dtype of the model's floating parameters when traced (``dtypes``, by name or as
    a ``torch.dtype``), as ``save_pretrained`` sets it; any other value as it is (refused)."""
    now = read(model)
    if isinstance(now, torch.dtype) and now in dtypes:
        return None
    if isinstance(now, str) and any(now == str(d).removeprefix("torch.") for d in dtypes):
        return None
    return now


def _dtype_name(value: object) -> object:
    """A ``torch.dtype`` as its name (``'float32'``), as ``save_pretrained`` writes a transformers
    config's ``dtype``; anything else as it is."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def _read_dtype_name(read: Callable[[torch.nn.Module], object], model: torch.nn.Module) -> object:
    """``read(model)``, a transformers config's ``dtype`` traced as a ``torch.dtype``, by name."""
    return _dtype_name(read(model))


class _Length:
    """The key of a list's length among its fields (a list a forward appends to each call)."""

    def __repr__(self) -> str:
        return "len"


_LENGTH = _Length()


def _holds_values(value: object, model: torch.nn.Module) -> bool:
    """Does a value ``loss_fn`` or a ``forward`` names hold fields the step may read: a holder, a
    class of the user's, or a module outside the model (a loss module's ``label_smoothing``)?"""
    if isinstance(value, torch.nn.Module):
        return all(value is not m for m in model.modules())
    return _is_holder(value) or (isinstance(value, type) and _user_class(value))


def _mapping(value: object) -> bool:
    """A dict, or a mapping that is not one: a ``collections.abc.Mapping`` (OmegaConf's
    ``DictConfig``, Hydra's configs) or an object with ``items`` and ``[]`` (ml_collections'
    ``ConfigDict``)."""
    if isinstance(value, (dict, Mapping)):
        return True
    return (callable(getattr(value, "items", None)) and hasattr(type(value), "__getitem__")
            and not isinstance(value, (torch.nn.Module, torch.Tensor, type, str, bytes, np.ndarray)))


def _entries(holder: object, private: frozenset[str] = frozenset()) -> list[tuple[object, str, object]]:
    """(key, shown, value) of the public entries of ``holder`` (at most 256): a mapping's items
    under keys that are numbers, strings, bools, None, enum members or short tuples of them
    (``self.table[(1, 2)]``), a list's elements, an object's or a class's own public attributes
    and those of its private ones named in ``private`` (what its code reads: ``self._weight``),
    never ``nn.Module``'s own."""
    if _mapping(holder):
        try:
            pairs = list(itertools.islice(holder.items(), 1024))
        except Exception:  # noqa: BLE001 - a config with a value it cannot resolve: nothing read here
            return []
        items = [(k, f"[{k!r}]", v) for k, v in pairs if _recordable(k)]
    elif isinstance(holder, (list, tuple)):
        items = [(i, f"[{i}]", v) for i, v in enumerate(holder[:256])]
    elif not hasattr(holder, "__dict__"):
        items = [(k, f".{k}", getattr(holder, k)) for k in _slots(holder)]
    else:
        items = [(k, f".{k}", v) for k, v in vars(holder).items() if not k.startswith("_") or (
                 k in private and not (isinstance(holder, torch.nn.Module) and k in _MODULE_INTERNALS))]
    return items[:256]


def _get(holder: object, key: object) -> object:
    """``holder[key]`` of a dict, list or tuple, or its attribute ``key``; ``_MISSING`` where gone
    (the holder included)."""
    if holder is _MISSING:
        return _MISSING
    if isinstance(holder, dict):
        return holder.get(key, _MISSING)
    if key is not _LENGTH and _mapping(holder):
        try:
            return holder[key]
        except Exception:  # noqa: BLE001 - gone, or no longer resolvable
            return _MISSING
    if isinstance(holder, (list, tuple)):
        if key is _LENGTH:
            return len(holder)
        return holder[key] if isinstance(key, int) and -len(holder) <= key < len(holder) else _MISSING
    if key is _LENGTH:
        return _MISSING
    return getattr(holder, key, _MISSING)


def _put(holder: object, key: object, value: object) -> None:
    if isinstance(holder, tuple):  # (nothing to put back: a tuple's entries cannot change)
        return
    if isinstance(holder, list):
        if key is _LENGTH:  # (what a refused trace appended goes again)
            del holder[value:]
        elif isinstance(key, int) and -len(holder) <= key < len(holder):
            holder[key] = value
    elif _mapping(holder):
        holder[key] = value
    else:
        setattr(holder, key, value)


def _put_back(holder: object, key: object, value: object) -> None:
    """``_put`` a recorded value back, into the array or set there when it is one of the same
    kind (a forward that changed it in place leaves the object the model holds)."""
    if not _in_place(_get(holder, key), value):
        _put(holder, key, _snapshot(value))


def _in_place(now: object, value: object) -> bool:
    """Copy ``value`` (a recorded array or set) into ``now`` when ``now`` can take it in place."""
    if isinstance(now, np.ndarray) and isinstance(value, np.ndarray) and now is not value \
            and now.shape == value.shape and now.dtype == value.dtype and now.flags.writeable:
        np.copyto(now, value)
        return True
    if isinstance(now, set) and isinstance(value, (set, frozenset)) and now is not value:
        now.clear()
        now.update(value)
        return True
    return False


def _user_class(cls: type) -> bool:
    return _user_module(cls.__module__)


def _user_module(name: str | None) -> bool:
    """Is a class or function of this module the user's (not torch's, transformers' or Python's)?"""
    return (name or "").split(".")[0] not in ("torch", "builtins", "transformers", "typing", "abc")


def _installed(module: str | None) -> bool:
    """Is ``module`` (a module's name) part of Python's standard library or of an installed
    package (``_third_party``), rather than the user's own code?"""
    top = (module or "").partition(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or _third_party(top)


@functools.lru_cache(maxsize=1024)
def _third_party(top: str) -> bool:
    """Is ``top`` (a top-level package's name) installed, under a ``site-packages`` or
    ``dist-packages`` folder (torch, tqdm, transformers...)? A package that cannot be placed (one
    without a file) counts as the user's."""
    found = sys.modules.get(top)
    where = getattr(found, "__file__", None) or next(iter(getattr(found, "__path__", None) or ()), None)
    if not isinstance(where, str):
        return False
    folders = os.path.normpath(os.path.abspath(where)).split(os.sep)
    return "site-packages" in folders or "dist-packages" in folders


def _configuration(cls: type) -> bool:
    """Is ``cls`` a configuration's class: a dataclass, a namespace (``types.SimpleNamespace``,
    ``argparse.Namespace``), pydantic's ``BaseModel``, or a class named as one (``...Config``,
    ``...Configuration``: transformers' ``PretrainedConfig``, other libraries' config classes),
    or a subclass of one of these?"""
    if dataclasses.is_dataclass(cls):
        return True
    for base in cls.__mro__:
        name, module = base.__name__, base.__module__ or ""
        if name.endswith(("Config", "Configuration")) or (name == "BaseModel" and module.startswith("pydantic")) \
                or (name.endswith("Namespace") and module in ("types", "argparse")):
            return True
    return False


@functools.lru_cache(maxsize=4096)
def _loops_class(cls: type) -> bool:
    """Is an object of ``cls`` the training loop's rather than a configuration: of a class of an
    installed package or of Python's standard library (an optimizer, an LR scheduler, a data
    loader, a sampler, a progress bar, a summary writer, a grad scaler, a queue), or of the user's
    subclass of an installed package's class (a dataset or an optimizer of the user's), that is
    not a configuration's (``_configuration``)? Such an object is guarded only for the fields the
    step's code names (``_walk``)."""
    if _configuration(cls):
        return False
    if _installed(cls.__module__):
        return True
    tops = {(base.__module__ or "").partition(".")[0] for base in cls.__mro__[1:]}
    return any(top not in sys.stdlib_module_names and top != "typing_extensions" and _third_party(top) for top in tops)


def _the_loops(value: object) -> bool:
    """Is ``value``, a holder, an object of the training loop's (``_loops_class``), or an object of
    a class of the user's that is not a configuration (``_configuration``: a meter the loop
    updates, a logger, a trainer), not a container, a module or a class? Only the fields the
    step's code names are held of such an object (``_walk``): a meter's count, walked whole,
    refused every later step."""
    if isinstance(value, (dict, list, tuple, type, torch.nn.Module, types.FunctionType)) or _mapping(value):
        return False
    return _loops_class(type(value)) or (_user_object(value) and not _configuration(type(value)))


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _function_of(fn: object) -> types.FunctionType | None:
    for _ in range(4):
        if isinstance(fn, types.FunctionType):
            return fn
        fn = getattr(fn, "__func__", None) or getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
    return None


def function_names(fn: object) -> list[tuple[str, str, object, Callable[[], object], Callable[[object], None]]]:
    """(kind, name, value, read, write) of each closure variable (kind ``"closure variable"``)
    and module global (``"global"``) that function ``fn`` names, through bound methods, partials
    and ``functools.wraps``. ``read`` gives its value now (``_MISSING`` for a global gone),
    ``write`` sets it."""
    f = _function_of(fn)
    if f is None:
        return []
    named = []
    cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
    for name, cell in cells.items():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        named.append(("closure variable", name, value, lambda c=cell: c.cell_contents,
                      lambda v, c=cell: setattr(c, "cell_contents", v)))
    scope = f.__globals__
    for name in sorted(_code_names(f.__code__) - set(cells)):
        if name in scope:
            named.append(("global", name, scope[name], lambda n=name: scope.get(n, _MISSING),
                          lambda v, n=name: scope.__setitem__(n, v)))
    return named


def held_values(model: torch.nn.Module, loss_fn: object = None) -> list[tuple[HeldValue, object]]:
    """Every ``HeldValue`` of ``model`` and ``loss_fn`` with its value now."""
    return _walk(model, loss_fn)[0]


#: At most this many held values per object found (its holders inside it included), and
#: lists longer than ``LONG_LIST`` are not looked into: such lists are data (token ids, a
#: history), not settings, and every held value is read again before each step (a model
#: holding 50 lists of 10,000 numbers made a step 74x slower than eager's).
HELD_PER_HOLDER = 256
LONG_LIST = 64
#: How deep the user's helper functions are followed from the step's code (``loss_fn`` calling
#: a helper calling another that reads a global): each function once, so this only bounds a
#: chain of distinct helpers. Two levels left a global read three calls down unguarded (a
#: weight changed from 1.0 to 3.0 after tracing: eager's loss 3.69, the step's 1.23, silently).
USER_DEPTH = 16
#: A dict whose keys the step's code may look up (named by that code) has its key set compared
#: before each step where it has at most this many keys (its length beyond): a key added after
#: tracing changed ``d.get("b", 1.0)`` and ``sum(d.values())`` in eager and not in the step.
KEYED_DICT = 4096


def _number_list(value: object) -> bool:
    """A list or tuple of at most ``SMALL_ARRAY`` ints and floats (class weights for many
    classes), compared by content as one value where it is longer than ``LONG_LIST``."""
    return len(value) <= SMALL_ARRAY and all(type(v) in (int, float) for v in value)


def _read_prefix(locate: Callable[[torch.nn.Module], object], length: int, model: torch.nn.Module) -> object:
    """The first ``length`` entries of the list ``locate`` finds, as a list: those the step was
    traced with (the loop may append to it, as to a short one, whose entries are guarded each)."""
    now = locate(model)
    return list(now[:length]) if isinstance(now, (list, tuple)) else now


def _write_prefix(locate: Callable[[torch.nn.Module], object], model: torch.nn.Module, value: object) -> None:
    now = locate(model)
    if isinstance(now, list) and isinstance(value, list):
        now[:len(value)] = value


@functools.lru_cache(maxsize=1024)
def _behind_properties(cls: type) -> frozenset[str]:
    """The private fields the public properties of a class of the user's read (``self._beta``
    behind ``beta``): its objects' settings, guarded where a module holds one (private fields
    no property reads are bookkeeping). A configuration's class (``_configuration``), an
    installed package's too, gives those its properties read, private ones included:
    transformers' ``config._attn_implementation``, which its attention modules read, returns
    ``_attn_implementation_internal``."""
    if _configuration(cls):
        return _config_private_fields(cls)
    if not _user_class(cls) or _installed(cls.__module__):
        return frozenset()
    public = frozenset(key for base in cls.__mro__ if base is not object and _user_class(base)
                       for key, member in vars(base).items()
                       if isinstance(member, (property, functools.cached_property)) and not key.startswith("_"))
    return frozenset(name for name in _reached(cls, public) if name.startswith("_") and not name.startswith("__"))


@functools.lru_cache(maxsize=256)
def _config_private_fields(cls: type) -> frozenset[str]:
    """The private fields the properties of a configuration's class read (its installed base
    classes' included), dunder names aside."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base is object:
            continue
        for key, member in vars(base).items():
            if isinstance(member, (property, functools.cached_property)) and not key.startswith("__"):
                fn = _member_function(member)
                if fn is not None:
                    names |= _code_strings(fn.__code__)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def _code_constants(code: types.CodeType) -> frozenset[str]:
    """The string constants of ``code`` and the code nested in it (``os.environ['BETA']``)."""
    out = {c for c in code.co_consts if isinstance(c, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _code_constants(const)
    return frozenset(out)


def _code_strings(code: types.CodeType) -> frozenset[str]:
    """The names and string constants of ``code`` and the code nested in it: what it can read
    as an attribute (``self.alpha``) or a key (``self.weights['a']``)."""
    return frozenset(_code_names(code)) | _code_constants(code)


#: The instructions that load a name: an attribute, a global, a closure variable or a local.
_NAME_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_NAME",
                         "LOAD_FAST"})


#: The loads a subscript's key may start with (``d[key]``, ``d[self.name]``, ``d[NAME]``).
_KEY_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME"})

#: How deep a subscript by a variable key takes ``_name_depths``: below one, so a dict read
#: that way has its entries held and not its keys (``holder_fields``), while a list's length is
#: held still.
VARIABLE_SUBSCRIPT = 0.5


@functools.lru_cache(maxsize=4096)
def _name_depths(code: types.CodeType) -> tuple[tuple[str, float], ...]:
    """(name, depth) for the names and string keys of ``code`` (and the code nested in it): how
    many subscripts by a constant index or key every use of the name is followed by, at least
    (``self.scales[1]``: 1; ``cfg["tags"][-1]``: ``cfg`` 1, the key ``"tags"`` 0). A list or
    dict reached through fewer constant subscripts than that is read by index or key only, and
    its entries are held one by one, so the loop may add to it; one at the depth where a use
    stops may have its length or last entries read or a key looked up (``w[-1]``, ``len(w)``,
    ``d.get("b", 1.0)``, ``sum(d.values())``, ``"b" in d``, or passed on), so after
    ``w.append(2.0)`` the step would still read what it was traced with: its length and keys
    are held too. A string constant used otherwise (``getattr(self, "w")``) counts 0."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]

    def fixed_subscript(k: int) -> tuple[int, float]:
        """(how many instructions, how deep) a subscript at ``k`` takes: 1 by a constant (``[1]``,
        ``["b"]``); ``VARIABLE_SUBSCRIPT`` by a name or attribute (``REG[self.act_name]``: the
        entry a traced step read is held by its value, and the step failed if it was missing,
        so an entry added under another key changes nothing it reads, while a list's index may
        be negative, ``w[i]`` with ``i = -1``, so its length stays held); (0, 0) else."""
        if k + 1 < len(ins) and ins[k].opname == "LOAD_CONST" and ins[k + 1].opname == "BINARY_SUBSCR":
            key = ins[k].argval
            return (2, 1) if isinstance(key, str) or (type(key) is int and key >= 0) else (0, 0)
        end = key_end(k)
        if k < end < len(ins) and ins[end].opname == "BINARY_SUBSCR":
            return end + 1 - k, VARIABLE_SUBSCRIPT
        return 0, 0

    def key_end(k: int) -> int:
        """Where a key loaded at ``k`` ends: after a constant, or after a name and its
        attributes (``self.act_name``; not a method); ``k`` where none is loaded there."""
        if k < len(ins) and ins[k].opname == "LOAD_CONST":
            return k + 1
        if k >= len(ins) or ins[k].opname not in _KEY_LOADS:
            return k
        end = k + 1
        while end < len(ins) and ins[end].opname == "LOAD_ATTR" and not (
                sys.version_info >= (3, 12) and (ins[end].arg or 0) & 1):
            end += 1
        return end

    def stored_into(k: int) -> bool:
        """Is the use ending before ``k`` an entry stored or deleted (``self.stats['mean'] = v``,
        ``self._logs[name] = v``): a write, which reads neither the keys nor the length?"""
        end = key_end(k)
        return k < end < len(ins) and ins[end].opname in ("STORE_SUBSCR", "DELETE_SUBSCR")

    depths: dict[str, float] = {}
    for k, op in enumerate(ins):
        if not isinstance(op.argval, str):
            continue
        if op.opname in _NAME_LOADS:
            after = k + 1
        elif op.opname == "LOAD_CONST" and k + 1 < len(ins) and ins[k + 1].opname == "BINARY_SUBSCR":
            after = k + 2  # (the value under this key)
        elif op.opname == "LOAD_CONST":
            after = None
        else:
            continue
        depth = 0
        while after is not None and (subscript := fixed_subscript(after))[0]:
            depth, after = depth + subscript[1], after + subscript[0]
        if after is not None and stored_into(after):
            continue  # (a write into it: what it holds is the loop's to read)
        depths[op.argval] = min(depth, depths.get(op.argval, depth))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            for name, depth in _name_depths(const):
                depths[name] = min(depth, depths.get(name, depth))
    return tuple(sorted(depths.items()))


def _merge_depths(into: dict[str, float], code: types.CodeType) -> None:
    for name, depth in _name_depths(code):
        into[name] = min(depth, into.get(name, depth))


def _step_depths(named: _NamedBy, classes: Iterable[type], loss_fn: object, hooks: Iterable[object]
                 ) -> dict[str, float]:
    """``_name_depths`` of the step's code of the user's: the methods of the modules' classes
    that are the user's and that the step reaches (``_stepped``: not a ``record`` method only
    the loop calls), ``loss_fn`` (a loss object's method too), the user's hooks, and the user's
    functions these name or take as defaults, ``USER_DEPTH`` levels down."""
    depths: dict[str, float] = {}
    roots = [fn for cls in classes for _owner, key, fn in user_members(cls) if _stepped(named, cls, key)] \
        + _loss_and_hook_functions(loss_fn, hooks)
    for f in _user_helpers(roots, defaults=True):
        _merge_depths(depths, f.__code__)
    return depths


def _stepped(named: _NamedBy, cls: type, key: str) -> bool:
    """Is ``cls``'s member ``key`` code the step may run: named by the code the step reaches from
    ``forward``, ``loss_fn`` and the hooks (``_NamedBy.names``), or any member where that code
    reads attributes by names built at run time? A method only the loop calls (``model.record(k,
    v)`` filling a dict) is not: what it reads or writes refused every later step."""
    names = named.names(cls)
    return key in names or _reads_built_names(cls, names)


def _user_function(value: object) -> bool:
    """Is ``value`` a function of the user's, or a partial, bound method or wrapper of one?"""
    if isinstance(value, (type, torch.nn.Module)) or not callable(value):
        return False
    f = _function_of(value)
    return f is not None and _user_module(f.__module__)


def _table_functions(values: Iterable[object]) -> list[object]:
    """The functions in the dicts, lists and tuples of at most ``FUNCTION_TABLE`` entries among
    ``values``: a table the code picks a helper from (``ATTN_IMPLS[self.config.impl]``)."""
    found = []
    for value in values:
        if isinstance(value, (dict, list, tuple)) and len(value) <= FUNCTION_TABLE:
            found += [v for v in (value.values() if isinstance(value, dict) else value) if callable(v)]
    return found


def _user_helpers(roots: Iterable[object], *, defaults: bool) -> Iterator[types.FunctionType]:
    """The functions of ``roots`` and the user's functions their code names (as globals or
    closure variables; ``defaults``: or takes as default arguments), ``USER_DEPTH`` levels
    down, each once."""
    seen: set[int] = set()
    todo = collections.deque((root, 0) for root in roots)  # (breadth first: each at its least depth)
    while todo:
        fn, depth = todo.popleft()
        f = _function_of(fn)
        if f is None or id(f.__code__) in seen:
            continue
        seen.add(id(f.__code__))
        yield f
        if depth >= USER_DEPTH:
            continue
        named = [value for _kind, _name, value, _read, _write in function_names(f)]
        given = [*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values()] if defaults else []
        todo.extend((value, depth + 1) for value in (*named, *given, *_table_functions(named))
                    if _user_function(value))


def _member_function(member: object) -> types.FunctionType | None:
    """The function a class member runs when the step reads or calls it: a method's, a static
    or class method's, a property's getter, a cached property's."""
    if isinstance(member, property):
        member = member.fget
    elif isinstance(member, functools.cached_property):
        member = member.func
    elif isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    return _function_of(member) if member is not None else None


def user_members(cls: type) -> Iterator[tuple[str, str, types.FunctionType]]:
    """(class name, member name, function) of the methods and property getters that ``cls``'s
    classes of the user's define (dunder methods aside): the code of a module's class that the
    step may run besides ``forward``'s own callers, which the guards and the stash warning read."""
    for base in cls.__mro__:
        if base is object or not _user_class(base):
            continue
        for key, member in vars(base).items():
            if isinstance(member, (types.FunctionType, property, staticmethod, classmethod,
                                   functools.cached_property)) and not key.startswith("__"):
                fn = _member_function(member)
                if fn is not None:
                    yield base.__qualname__, key, fn


def _reached(cls: type, roots: frozenset[str], own: bool = False, readers: bool = False) -> frozenset[str]:
    """``roots`` and the names and strings of the code of ``cls``'s methods and properties (in
    its classes that are the user's) that the step may run, starting from those named in
    ``roots`` and following those that code names in turn: ``forward`` reads ``self.scale``, a
    property whose getter reads ``self._scale``, so ``_scale`` is named. An overridden member
    counts in every class (``super().forward(x)``). ``own``: only the classes of the user's own
    code are followed, not those of installed packages (``_installed``). ``readers``: the
    methods of every other class of ``cls`` are followed too where they only read
    (``_reads_only``): ``sched.get_last_lr()`` reads ``sched._last_lr``, ``sched.step()``
    changes what it reads and is the loop's, not the step's."""
    bases = [base for base in cls.__mro__
             if base is not object and _user_class(base) and not (own and _installed(base.__module__))]
    others = [base for base in cls.__mro__ if base is not object and base not in bases] if readers else []
    if not bases and not others:
        return frozenset(roots)
    names, todo = set(roots), list(roots)
    while todo:
        name = todo.pop()
        for base in bases + others:
            fn = _member_function(vars(base).get(name))
            if fn is not None and (base in bases or _reads_only(fn.__code__)):
                new = _code_strings(fn.__code__) - names
                names |= new
                todo += new
    return frozenset(names)


#: Methods that change the object they are called on (a list's, a dict's, a set's, a training
#: loop object's): code calling one is not a reader (``_reads_only``).
_CHANGING = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add",
                       "discard", "setdefault", "step", "zero_grad", "reset", "load_state_dict", "__setitem__",
                       "__setattr__", "__delitem__", "__delattr__", "setattr", "delattr"})
_STORES = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE",
                     "STORE_GLOBAL", "DELETE_GLOBAL"})


@functools.lru_cache(maxsize=4096)
def _reads_only(code: types.CodeType) -> bool:
    """Does ``code`` (and the code nested in it) only read: set no attribute, item or global,
    and name none of the methods that change an object (``_CHANGING``)? Such a method of a
    training loop's object (``get_last_lr``) is one the step may run to read a value."""
    if _CHANGING & set(code.co_names):
        return False
    if any(ins.opname in _STORES for ins in dis.get_instructions(code)):
        return False
    return all(_reads_only(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _loss_and_hook_functions(loss_fn: object, hooks: Iterable[object]) -> list[types.FunctionType]:
    """The functions of the user's that the step runs outside the modules' classes: ``loss_fn``
    (a loss object's method too) and the user's hooks."""
    found = _loss_object(loss_fn) if loss_fn is not None else None
    out = []
    for fn in (loss_fn, found[1] if found is not None else None, *hooks):
        f = _function_of(fn)
        if f is not None and _user_module(f.__module__):
            out.append(f)
    return out


def _step_roots(model: torch.nn.Module, loss_fn: object) -> frozenset[str]:
    """What the step's code names: ``forward``, the names and strings of ``loss_fn`` (a loss
    object's code too) and of the user's hooks (``m._scale`` read in ``loss_fn``), and, until
    nothing more is found, of the methods of the modules' classes of the user's these reach, of
    the functions a module holds under a name they use (``self.fn = attn_fn``), and of the
    user's helpers all of these name (``_user_helpers``). A method reached only through a helper
    (``loss_fn`` calling ``helper(m, x)``, which calls ``m.compute_loss(x)``, which reads
    ``self.w``) was not the step's, so ``w`` went unchecked, silently."""
    return _step_closure(model, loss_fn)[0]


def step_functions(model: torch.nn.Module, loss_fn: object) -> tuple[types.FunctionType, ...]:
    """The functions of the step's code that ``_step_roots`` reads (``loss_fn``, the user's
    hooks, the methods of the modules' classes of the user's they reach, the functions modules
    hold under a name they use, and the helpers all of these name), each once."""
    return _step_closure(model, loss_fn)[1]


def _step_closure(model: torch.nn.Module, loss_fn: object) -> tuple[frozenset[str], tuple[types.FunctionType, ...]]:
    """``_step_roots``' names, and the functions whose code gave them (``step_functions``)."""
    modules = list(model.modules())
    steps = _loss_and_hook_functions(loss_fn, [hook for module in modules for hook in _hooks_of(module)])
    classes = [cls for cls in dict.fromkeys(type(m) for m in modules) if _user_class(cls)]
    held = [(key, value) for m in modules for key, value in vars(m).items()
            if not isinstance(value, (type, torch.nn.Module)) and callable(value) and _function_of(value) is not None]
    names: set[str] = {"forward"}
    for f in steps:
        names |= _code_strings(f.__code__)
    while True:
        found = len(names)
        roots: list[object] = [*steps]
        for cls in classes:
            reached = _reached(cls, frozenset(names))
            names |= reached
            for base in (b for b in cls.__mro__ if b is not object and _user_class(b)):
                roots += [_member_function(vars(base)[key]) for key in reached & vars(base).keys()]
        roots += [value for key, value in held if key in names]
        functions = tuple(_user_helpers(roots, defaults=False))
        for f in functions:
            names |= _code_strings(f.__code__)
        if len(names) == found:  # (nothing new, in any class: one class's names can reach another's methods)
            return frozenset(names), functions


#: Names in code that read an object's attributes by names built at run time.
_DYNAMIC = frozenset({"getattr", "__dict__", "vars", "__getattribute__", "attrgetter"})


def _reads_built_names(cls: type, names: frozenset[str]) -> bool:
    """Does code of ``cls``, a class of the user's, that names ``names`` read attributes by names
    built at run time (``getattr(self, '_scale_' + self.which)``), or does one of its classes of
    the user's answer attributes itself (``__getattr__``: ``self.k`` served from a private
    ``self._extra`` dict)? Then any field may be read."""
    return _user_class(cls) and (not _DYNAMIC.isdisjoint(names) or any(
        _user_class(base) and ("__getattr__" in vars(base) or "__getattribute__" in vars(base))
        for base in cls.__mro__))


class _NamedBy:
    """Which private attributes of the model's modules the step may read: those that the code of
    their classes (the user's) reaches from ``forward`` and from what ``loss_fn`` and the user's
    hooks name (``_reached``), or that ``loss_fn`` and the hooks name. Private attributes
    nothing names are bookkeeping (``nn.Module``'s, transformers', a counter the loop keeps)
    and are not guarded: refusing a step over them refused correct steps. ``roots``: the names
    and strings of all the step's code (``_step_roots``); ``unread``: the public attributes
    none of it can read."""

    def __init__(self, model: torch.nn.Module, loss_fn: object = None) -> None:
        self.roots = _step_roots(model, loss_fn)
        self._by_class: dict[type, frozenset[str]] = {}

    def names(self, cls: type) -> frozenset[str]:
        named = self._by_class.get(cls)
        if named is None:
            named = self._by_class[cls] = _reached(cls, self.roots) if _user_class(cls) else self.roots
        return named

    def private(self, module: torch.nn.Module, key: str) -> bool:
        """Is ``key``, a private attribute of ``module``, one the step may read? Every one is
        where the code reached reads attributes by names built at run time (``getattr(self,
        '_scale_' + self.which)``, ``self.__dict__[name]``, ``vars(self)``: ``_DYNAMIC``)."""
        if not key.startswith("_") or key in _MODULE_INTERNALS:
            return False
        names = self.names(type(module))
        return key in names or _reads_built_names(type(module), names)

    def unread(self, module: torch.nn.Module, key: str) -> bool:
        """Is ``key``, a public attribute of ``module``, one no code of the step can read: of a
        module whose classes are all the user's own (``nn.Module`` aside: no installed package's
        code runs as its methods, ``_own_classes``) that no code of the step names (``roots``),
        where none of that code reads attributes by names built at run time (``_DYNAMIC``)? A
        counter the loop keeps on the model (``model.global_step += 1`` between steps) refused
        every later step."""
        if key == "training" or key.startswith("_") or not _own_classes(type(module)):
            return False
        return key not in self.roots and _DYNAMIC.isdisjoint(self.roots)


@functools.lru_cache(maxsize=1024)
def _own_classes(cls: type) -> bool:
    """Are ``cls`` and its bases (``nn.Module`` and ``object`` aside) all classes of the user's own
    code, none of an installed package's or of torch's?"""
    return all(base in (object, torch.nn.Module) or (_user_class(base) and not _installed(base.__module__))
               for base in cls.__mro__)


def _loss_object(loss_fn: object) -> tuple[object, types.FunctionType, str] | None:
    """(the object, the function its step runs, its label) of a ``loss_fn`` that is a callable
    object (a class with ``__call__``, a loss module outside the model) or a bound method
    (``trainer.compute_loss``), through wrappers (``__wrapped__``: a dict batch's); None for a
    plain function."""
    for _ in range(4):
        inner = getattr(loss_fn, "__wrapped__", None)
        if inner is None or isinstance(loss_fn, types.FunctionType):
            break
        loss_fn = inner
    if isinstance(loss_fn, types.MethodType):
        owner, fn, label = loss_fn.__self__, loss_fn.__func__, f"loss_fn's {type(loss_fn.__self__).__qualname__}"
    elif isinstance(loss_fn, (types.FunctionType, types.BuiltinFunctionType, functools.partial, type)):
        return None
    else:
        owner = loss_fn
        fn = _function_of(type(owner).forward if isinstance(owner, torch.nn.Module) else type(owner).__call__)
        label = "loss_fn"
    if fn is None or not hasattr(owner, "__dict__") or isinstance(owner, (type, types.ModuleType)):
        return None
    return owner, fn, label


def _walk(model: torch.nn.Module, loss_fn: object = None, *, lengths: bool = False, every_field: bool = False,
          iterators: list[tuple[str, Callable[[], object], Callable[[object], None]]] | None = None,
          caches: list[object] | None = None) -> tuple[list[tuple[HeldValue, object]], list[tuple[str, object]]]:
    """``held_values``, and (label, generator) of every random generator of ``_GENERATORS``
    found where they are looked for: module attributes (private ones too), holders, and the
    globals and closure variables the step's functions name. ``lengths``: also the length of
    each list of the model's own that holds no tensor (``PythonState``: a forward appending to
    one at every call is a counter; between steps, the loop may append to it freely), and of
    each list, deque or set (and the state of each ``itertools.count``) that is a global or a
    closure variable the step's functions name (a forward appending to a module-level ``CALLS``
    and reading ``len(CALLS)``).

    The training loop's objects (``_loops_class``: an optimizer, an LR scheduler, a data loader,
    a progress bar a module holds) change between steps as the loop runs, and the step does not
    read them: walked whole, they refused every later step (the lr a scheduler set, a bar's
    count). Their fields are held values only where the step's code names them: walked last,
    with the names and strings of the step's code (``_NamedBy.roots``) and of the code of the
    object's own class where it is the user's, so ``self.opt.param_groups[0]['lr']`` read in a
    forward is guarded. ``every_field``: walked whole all the same (``PythonState``: a forward
    that updates its progress bar changes it at every call, which a traced step never would).
    ``iterators``: gets (label, read, write) of each iterator that a module holds as an
    attribute or that is a global or a closure variable the step's functions name
    (``next(self.temps)``, ``next(SCHEDULE)``: refused while the step is traced).
    ``caches``: gets each ``functools.lru_cache`` wrapper of the user's the step's code reaches
    (emptied around the trace: ``PythonState.caches``)."""
    found: list[tuple[HeldValue, object]] = []
    generators: list[tuple[str, object]] = []
    seen: set[int] = set()
    in_model = {id(m) for m in model.modules()}
    #: (label, holder, locate, depth, lists) of the loop's objects found, walked last
    loops: list[tuple[str, object, Callable[[torch.nn.Module], object], int, bool]] = []
    #: the names and strings of the code of the loss and callable objects found
    strings: set[str] = set()
    #: (label, object, lists) of the objects of the user's classes found in holders, whose
    #: class attributes and methods that the step's code names are walked last
    objects: list[tuple[str, object, bool]] = []

    @functools.cache
    def parameter_dtypes() -> frozenset[torch.dtype]:
        return frozenset(p.dtype for p in model.parameters() if p.is_floating_point())

    def slack_of(name: str) -> float:
        """How many constant subscripts every use of ``name`` in the step's code takes
        (``_name_depths``); infinite where it is not used, or for ``PythonState``."""
        return math.inf if lengths else depths.get(name, math.inf)

    def generator(label: str, value: object) -> bool:
        if isinstance(value, _GENERATORS):
            if id(value) not in seen:
                seen.add(id(value))
                generators.append((label, value))
            return True
        return False

    def holder_fields(label: str, holder: object, locate: Callable[[torch.nn.Module], object], depth: int = 0,
                      lists: bool = False, names: frozenset[str] | None = None, room: list[int] | None = None,
                      slack: float = math.inf, named_private: frozenset[str] = frozenset()) -> None:
        """The held values of ``holder`` and of the holders in it (``NESTED_HOLDERS`` deep),
        at most ``HELD_PER_HOLDER`` in all; ``names``: only keys its code can read. ``slack``:
        how many constant subscripts the step's code takes below ``holder`` before it may read
        it whole (``_name_depths``; infinite: never, as for ``PythonState``). At 0 it may read a
        list's length or last entry or look a key up in a dict, so their lengths and dicts' key
        sets are held too (a list the loop appends to that no step code names is its
        bookkeeping, and is not). ``named_private``: private keys the step's code names, held
        too (a class's ``_SCALE`` read as ``self._SCALE``: kept as traced, silently)."""
        room = [HELD_PER_HOLDER] if room is None else room
        sized = slack <= 0 or (slack < 1 and isinstance(holder, list))  # (``w[i]``: ``i`` may be -1)
        if id(holder) in seen:
            return
        if isinstance(holder, (list, tuple)) and len(holder) > LONG_LIST:
            if _number_list(holder):  # (class weights for many classes: one value, compared by content)
                seen.add(id(holder))
                found.append((HeldValue(label, functools.partial(_read_prefix, locate, len(holder)),
                                        functools.partial(_write_prefix, locate)), list(holder)))
                room[0] -= 1
                if sized:
                    counted(label, holder, locate)
            return
        if names is None and not every_field and _the_loops(holder):
            loops.append((label, holder, locate, depth, lists))  # (its names are known once all code is walked)
            return
        seen.add(id(holder))
        if names is None and _user_object(holder):  # (its class's attributes and methods the step's code names)
            objects.append((label, holder, lists))
        private = (names or (_behind_properties(type(holder)) if hasattr(holder, "__dict__")
                             and not isinstance(holder, (type, torch.nn.Module)) else frozenset())) | named_private
        if names is not None and not _loops_class(type(holder)) and _reads_built_names(type(holder), names):
            names = None  # (its code reads fields by names built at run time: every field)
            private = frozenset(k for k in getattr(holder, "__dict__", ()) if isinstance(k, str))
        for key, shown, value in _entries(holder, private):
            if room[0] <= 0:
                return
            if (names is not None and isinstance(key, str) and key not in names) or _metadata(holder, key):
                continue

            def at(m, key=key):
                return _get(locate(m), key)

            by_length = lists and isinstance(value, (set, collections.deque)) and counter(f"{label}{shown}", value, at)
            # (below it by a key or attribute: as the step's code uses that name, ``cfg["tags"][-1]``;
            # by an index, one subscript further down than the holder)
            inner = slack_of(key) if isinstance(key, str) else slack - 1
            if isinstance(value, _FUNCTIONS) and not isinstance(holder, type):  # (``OPS['mul']``: what it reads)
                helper(f"{label}{shown}", value, 0)
            if _guarded(value):  # (a set's content after its length: a count that moves is named as one)
                def write(m, value, key=key):
                    h = locate(m)
                    if h is not _MISSING and value is not _MISSING:
                        _put_back(h, key, value)
                if value is None and _unset_dtype(holder, key):  # (save_pretrained's, read as unset)
                    at = functools.partial(_read_unset_dtype, at, parameter_dtypes())
                elif isinstance(value, torch.dtype) and _unset_dtype(holder, key):  # (save_pretrained names it)
                    at, value = functools.partial(_read_dtype_name, at), _dtype_name(value)
                found.append((HeldValue(f"{label}{shown}", at, write), _snapshot(value)))
                room[0] -= 1
            elif not generator(f"{label}{shown}", value) and depth < NESTED_HOLDERS and _is_holder(value) \
                    and not isinstance(holder, type):
                holder_fields(f"{label}{shown}", value, at, depth + 1, lists, names, room, inner)
            elif lists and not by_length:
                counter(f"{label}{shown}", value, at)
            elif inner <= 0 and isinstance(value, collections.deque):
                sequence(f"{label}{shown}", value, at)
        if (lists or sized) and isinstance(holder, list):  # (sized only for held_values: slack is infinite else)
            counted(label, holder, locate)
        elif sized and isinstance(holder, dict):
            keyed(label, holder, locate)

    def keyed(label: str, holder: dict, locate: Callable[[torch.nn.Module], object]) -> None:
        """A dict's key set (its length where it has more than ``KEYED_DICT`` keys or keys that
        are not plain values), for ``held_values``: a key added after tracing is refused."""
        if len(holder) <= KEYED_DICT and all(_recordable(k) for k in holder):
            found.append((HeldValue(f"the keys of {label}", lambda m: frozenset(h) if isinstance(h := locate(m), dict)
                                    else _MISSING, lambda m, v: None), frozenset(holder)))
        else:
            found.append((HeldValue(f"len({label})", lambda m: len(h) if isinstance(h := locate(m), dict)
                                    else _MISSING, lambda m, v: None), len(holder)))

    def sequence(label: str, value: collections.deque, locate: Callable[[torch.nn.Module], object]) -> None:
        """A deque of plain values the step's code names, by content (``q[-1]`` after
        ``q.append``), for ``held_values``; its length where it holds anything else."""
        if len(value) <= SMALL_ARRAY and all(_recordable(v) for v in value):
            found.append((HeldValue(label, lambda m: tuple(h) if isinstance(h := locate(m), collections.deque)
                                    else _MISSING, lambda m, v: None), tuple(value)))
        else:
            counted(label, value, locate)

    def counter(label: str, value: object, locate: Callable[[torch.nn.Module], object]) -> bool:
        """A deque or set (its length) or an ``itertools.count`` (its state shows only in its
        repr), for ``PythonState``; False for anything else."""
        if isinstance(value, (set, collections.deque)):
            counted(label, value, locate)
        elif isinstance(value, itertools.count):
            found.append((HeldValue(label, lambda m: repr(locate(m)), lambda m, v: None), repr(value)))
        else:
            return False
        return True

    def counted(label: str, holder: object, locate: Callable[[torch.nn.Module], object]) -> None:
        """The length of a list, deque or set that holds no tensor (a stash the step's trace
        filled is warned about where it is found instead), for ``PythonState``: a forward that
        adds to one at every call is a counter."""
        if any(isinstance(v, torch.Tensor) for v in holder):
            return

        def write_length(m, value):
            h = locate(m)
            if isinstance(value, int) and isinstance(h, list):
                _put(h, _LENGTH, value)
            elif isinstance(value, int) and isinstance(h, collections.deque):
                while len(h) > value:
                    h.pop()
        def stash(m):  # (filled with tensors by the trace: warned about, not a counter to trace again)
            h = locate(m)
            return isinstance(h, (list, set, collections.deque)) and any(isinstance(v, torch.Tensor) for v in h)

        found.append((HeldValue(f"len({label})", lambda m: len(h) if isinstance(h := locate(m), (list, set,
                      collections.deque)) else _MISSING, write_length, stash), len(holder)))

    def callable_object(label: str, value: object, locate: Callable[[torch.nn.Module], object]) -> bool:
        """A callable object of the user's (a focal loss, a schedule): a holder for the names its
        ``__call__`` holds."""
        call = _function_of(getattr(type(value), "__call__", None))
        if isinstance(value, (torch.nn.Module, type, *_FUNCTIONS)) or not hasattr(value, "__dict__") \
                or call is None or not _user_class(type(value)):
            return False
        names = _reached(type(value), _code_strings(call.__code__))
        strings.update(names)
        holder_fields(label, value, locate, names=names, lists=lengths)
        named_by(f"{label}'s {type(value).__qualname__}", call)
        return True

    def named_by(what: str, fn: object, depth: int = 0) -> None:
        f = _function_of(fn)
        if f is None or id(f.__code__) in seen:
            return
        seen.add(id(f.__code__))
        owner = getattr(fn, "__self__", None)
        if isinstance(fn, types.MethodType) and _user_object(owner):  # (a bound method: its object's fields)
            holder_fields(f"{what}'s {type(owner).__qualname__}", owner, lambda m, o=owner: o,
                          names=_reached(type(owner), _code_strings(f.__code__)))
        if isinstance(fn, functools.partial):  # (its arguments are the step's values too)
            for i, value in enumerate(fn.args):
                if _holds_values(value, model) and not _guarded(value):
                    holder_fields(f"{what}'s argument {i}", value, lambda m, v=value: v)
            for key, value in fn.keywords.items():
                label = f"{what}'s keyword {key!r}"
                if _guarded(value):
                    found.append((HeldValue(label, lambda m, k=key, p=fn: p.keywords.get(k, _MISSING),
                                            lambda m, v, k=key, p=fn: _put_back(p.keywords, k, v)), _snapshot(value)))
                elif _holds_values(value, model):
                    holder_fields(label, value, lambda m, v=value: v)
        if f.__dict__ and _user_module(f.__module__):  # (``scale.factor = 2.0``, read as ``scale.factor``)
            holder_fields(what, f, lambda m, f=f: f, lists=lengths)
        code, functions = f.__code__, []
        if not lengths:  # (code found here that ``_step_depths`` did not reach: a callable object's)
            _merge_depths(depths, code)
        defaults = f.__defaults__ or ()  # (``lambda m, x, cfg=cfg: ...``: a holder given as a default)
        for name, value in (*zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults),
                            *(f.__kwdefaults__ or {}).items()):
            if isinstance(value, types.FunctionType) and depth < USER_DEPTH and _user_module(value.__module__):
                named_by(f"{what}'s default {name!r}", value, depth + 1)  # (``def loss_fn(m, x, y, h=helper)``)
            elif not _guarded(value) and _holds_values(value, model):
                holder_fields(f"{what}'s default {name!r}", value, lambda m, v=value: v, slack=slack_of(name))
            elif isinstance(value, collections.deque) and slack_of(name) <= 0:
                sequence(f"{what}'s default {name!r}", value, lambda m, v=value: v)
        if not _code_names(code).isdisjoint(("environ", "getenv")):
            environment(what, _code_constants(code))
        for kind, name, value, read, write in function_names(fn):
            label = f"{what}'s {kind} {name!r}"
            if isinstance(value, types.ModuleType):
                user_module(f"{what}'s module {value.__name__}", value, read, _code_strings(code), depth)
                continue
            if isinstance(value, type) and issubclass(value, torch.autograd.Function) and _user_class(value):
                functions.append((label, value))  # (its code runs in the step: walked after its fields)
            # (a global or closure deque, set or itertools.count, for PythonState: a step adding to
            # one at every call is a counter, as one of the model's is; a list's length below)
            by_length = lengths and isinstance(value, (set, collections.deque, itertools.count)) \
                and counter(label, value, lambda m, v=value: v)
            if iterators is not None and _iterator(value):
                iterators.append((label, read, write))
                continue
            if isinstance(value, contextvars.ContextVar):  # (``SCALE.get()``: the value set in this context)
                now = _context_value(value)
                if now is _MISSING or _guarded(now):
                    found.append((HeldValue(f"{label}.get()", lambda m, v=value: _context_value(v),
                                            lambda m, before, v=value: before is not _MISSING and v.set(before)),
                                  _snapshot(now)))
                continue
            if _guarded(value) and not (kind == "global" and name.startswith("__")):
                found.append((HeldValue(label, lambda m, r=read: r(), lambda m, v, r=read, w=write: _in_place(r(), v)
                                        or w(_snapshot(v))), _snapshot(value)))
                helper(label, value, depth)  # (a helper it calls reads a global too)
            elif by_length or generator(label, value) or callable_object(label, value, lambda m, v=value: v):
                continue
            elif helper(label, value, depth):  # (an ``lru_cache``d helper: the function it wraps)
                continue
            elif _holds_values(value, model):  # (a class's private constants its code names: ``Consts._EPS``)
                holder_fields(label, value, lambda m, r=read: r(), lists=lengths, slack=slack_of(name),
                              named_private=_code_strings(code) if isinstance(value, type) else frozenset())
            elif isinstance(value, collections.deque) and slack_of(name) <= 0:
                sequence(label, value, lambda m, r=read: r())
        for label, cls in functions:
            for key in ("forward", "setup_context", "backward", "jvp"):
                member = _member_function(vars(cls).get(key))
                if member is not None:
                    named_by(f"{label}.{key}", member, depth)

    def helper(label: str, value: object, depth: int) -> bool:
        """Walk the user's function that ``value`` is or wraps (a function, a partial, a
        ``functools.lru_cache`` or ``wraps`` wrapper) as the step's code: what it names, its
        attributes, a partial's arguments. False where ``value`` is none of these."""
        inner = _function_of(value) if callable(value) and not isinstance(value, (type, torch.nn.Module)) else None
        if inner is None or depth >= USER_DEPTH or not _user_module(inner.__module__):
            return False
        if caches is not None and callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info") \
                and all(c is not value for c in caches):
            caches.append(value)
        named_by(label, value, depth + 1)
        return True

    def user_module(label: str, module: types.ModuleType, read: Callable[[], object], names: frozenset[str],
                    depth: int) -> None:
        """The fields of a Python module of the user's (``import myconf``: not the standard
        library's or an installed package's) that the code naming it names (``names``)."""
        if _installed(module.__name__) or not _user_module(module.__name__) \
                or module.__name__.partition(".")[0] == "remat":
            return
        fields = vars(module)
        for key in sorted(names & fields.keys()):
            value = fields[key]
            if key.startswith("_") or (id(module), key) in module_fields or isinstance(value, types.ModuleType):
                continue
            module_fields.add((id(module), key))
            where = f"{label}.{key}"

            def at(m, r=read, key=key):
                return getattr(h, key, _MISSING) if isinstance(h := r(), types.ModuleType) else _MISSING

            if _guarded(value):
                found.append((HeldValue(where, at, lambda m, v, r=read, key=key: _put_back(r(), key, v)),
                              _snapshot(value)))
                helper(where, value, depth)
            elif not (generator(where, value) or callable_object(where, value, at)) and _holds_values(value, model):
                if isinstance(value, type) and issubclass(value, torch.autograd.Function):
                    continue
                holder_fields(where, value, at, lists=lengths, slack=slack_of(key))

    def environment(what: str, strings: frozenset[str]) -> None:
        """The environment variables a function that reads ``os.environ`` (or ``os.getenv``) names
        in its string constants: those set now, and those unset that look like one (``BETA``)."""
        for key in sorted(strings):
            if key in environ_keys or not (key in os.environ or (key.isidentifier() and key.isupper())):
                continue
            environ_keys.add(key)
            found.append((HeldValue(f"{what}'s os.environ[{key!r}]", lambda m, k=key: os.environ.get(k, _MISSING),
                                    lambda m, v, k=key: os.environ.pop(k, None) if v is _MISSING
                                    else os.environ.__setitem__(k, v)), os.environ.get(key, _MISSING)))

    module_fields: set[tuple[int, str]] = set()
    environ_keys: set[str] = set()
    modules = list(model.named_modules())
    named = _NamedBy(model, loss_fn)
    classes = {type(module) for _, module in modules}
    hooks = [hook for _, m in modules for hook in _hooks_of(m)]
    # (how the step's code uses each name, for the lists and dicts whose lengths and keys it may
    # read; none for PythonState, which holds the lengths of lists as counters)
    depths = {} if lengths else _step_depths(named, classes, loss_fn, hooks)
    for name, module in modules:
        for key, value in vars(module).items():
            if iterators is not None and _iterator(value):  # (its own attributes, private ones too)
                iterators.append((f"{_where(name, module)} attribute {key!r}", lambda m=module, k=key: vars(m).get(k),
                                  lambda v, m=module, k=key: vars(m).__setitem__(k, v)))
                continue
            where = f"model.{name}.{key}" if name else f"model.{key}"
            if generator(where, value) or (key.startswith("_") and not named.private(module, key)):
                continue
            locate = lambda m, n=name, k=key: getattr(_submodule(m, n), k, _MISSING)  # noqa: E731
            if _held_class(value):  # (its class attributes and its bases': ``Config.temp``)
                for base in value.__mro__:
                    if _held_class(base):
                        holder_fields(where if base is value else f"{where}'s base {base.__qualname__}", base,
                                      locate if base is value else lambda m, b=base: b, lists=lengths)
                continue
            if _is_holder(value) and not _metadata(module, key):
                # (a list or dict the step's code names: its length and keys too; one it does not
                # name, such as a history the loop appends to, only its entries)
                holder_fields(where, value, locate, lists=lengths, slack=slack_of(key))
                continue
            if slack_of(key) <= 0 and isinstance(value, collections.deque):
                sequence(where, value, locate)
                continue
            by_length = lengths and counter(where, value, locate)  # (before a set's content, as above)
            if (_small_array(value) or _scalar_set(value)) and key in named.names(type(module)):
                # (only where the step's code names it: an array or a set the loop keeps beside the
                # model, such as a log of losses or ids already seen, is its bookkeeping)
                found.append((HeldValue(where, locate, lambda m, v, n=name, k=key: _put_back(_submodule(m, n), k, v)),
                              _snapshot(value)))
            elif not by_length and not callable_object(where, value, locate) and _plain(value) \
                    and key in named.names(type(module)):  # (one the step's code calls, not the loop's)
                helper(where, value, -1)  # (``self.lam = lambda t: t * G['w']``: what it names)
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        for base in cls.__mro__:
            if _user_class(base) and base is not object:
                holder_fields(f"class {base.__qualname__}", base, lambda m, b=base: b, named_private=named.names(cls))
                for key, value in vars(base).items():  # (a descriptor of the user's the step reads: ``self.d``)
                    get = getattr(type(value), "__get__", None)
                    if key in named.names(cls) and _user_object(value) and _user_function(get):
                        where = f"class {base.__qualname__}.{key}"
                        holder_fields(where, value, lambda m, v=value: v)
                        named_by(f"{where}'s __get__", get)
        if _user_class(cls):
            named_by(f"{cls.__qualname__}.forward", cls.forward)
            for owner, key, fn in user_members(cls):  # (the helper methods forward calls: self.scale(x))
                if key != "forward" and _stepped(named, cls, key):
                    named_by(f"{owner}.{key}", fn)
    if loss_fn is not None:
        named_by("loss_fn", loss_fn)
        found_object = _loss_object(loss_fn)
        if found_object is not None and id(found_object[0]) not in in_model:
            # a loss function that is an object, or a method of one: the fields its code can read
            # (not its bookkeeping, such as a meter the loop updates between steps), and what
            # that code names
            owner, fn, label = found_object
            names = _reached(type(owner), _code_strings(fn.__code__))
            strings.update(names)
            holder_fields(label, owner, lambda m, o=owner: o, names=names, lists=lengths)
            if _user_module(fn.__module__) and label == "loss_fn":
                named_by(f"loss_fn's {type(owner).__qualname__}", fn)
    for name, module in modules:  # (the user's hooks are the step's code too: a scale a hook's closure reads)
        for hook in _hooks_of(module):
            fn = _function_of(hook)
            if fn is not None and _user_module(fn.__module__):
                named_by(f"a hook of {_where(name, module)}", hook)
            elif fn is None:  # (an object of the user's class: ``ScaleHook().k``)
                callable_object(f"a hook of {_where(name, module)}", hook, lambda m, h=hook: h)
    if loops or objects:
        step_names = named.roots | strings
        for label, holder, locate, depth, lists in loops:
            holder_fields(label, holder, locate, depth, lists,
                          names=_reached(type(holder), step_names, own=True, readers=True))
            if _user_object(holder):
                objects.append((label, holder, lists))
        done: set[tuple[int, str]] = set()
        while objects:  # (a method the step calls, ``self.holder.scale(h)``, not one the loop calls, ``log``)
            label, holder, lists = objects.pop()
            reached = _reached(type(holder), step_names)
            for base in type(holder).__mro__:
                if _held_class(base):
                    holder_fields(f"class {base.__qualname__}", base, lambda m, b=base: b, lists=lists, names=reached)
            for owner, key, fn in user_members(type(holder)):
                if key in reached and (id(type(holder)), key) not in done:
                    done.add((id(type(holder)), key))
                    named_by(f"{label}'s {owner}.{key}", fn)
    return found, generators


def _submodule(model: torch.nn.Module, name: str) -> object:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return _MISSING


T = TypeVar("T")


def _scalar_attributes(model: torch.nn.Module, loss_fn: object = None) -> dict[tuple[str, str], object]:
    """Every module's attributes holding numbers, strings, bools or None (or tuples of them),
    private ones included, by (module name, attribute); and those of ``loss_fn`` where it is a
    function (``loss_fn.calls += 1``), under the name ``LOSS_FN``."""
    out = {(name, key): value for name, module in model.named_modules(remove_duplicate=False)
           for key, value in vars(module).items() if _recordable(value)}
    if isinstance(loss_fn, types.FunctionType):
        out.update({(LOSS_FN, key): value for key, value in vars(loss_fn).items() if _recordable(value)})
    return out


#: The name ``PythonState`` gives ``loss_fn`` among the modules whose attributes it compares.
LOSS_FN = "<loss_fn>"


#: What a module registers in dicts of its own: ``PythonState`` restores them after a trace.
_REGISTERS = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True)
class PythonState:
    """The Python state a training step's code may change while traced (see the module)."""

    attributes: dict[tuple[str, str], object]
    python_random: object
    numpy_random: tuple
    held: tuple[tuple[HeldValue, object], ...] = ()
    loss_fn: object = None
    #: (label, generator, its state) of the random generators the model and ``loss_fn`` own
    generators: tuple[tuple[str, object, object], ...] = ()
    #: (module name, module, what it registers: _parameters, _buffers or _modules, a copy)
    registered: tuple[tuple[str, torch.nn.Module, str, dict], ...] = ()
    #: (label, read, write) of the iterators that a module holds or that are globals or closure
    #: variables the step's functions name (``_walk``): refused while the step is traced
    iterators: tuple[tuple[str, Callable[[], object], Callable[[object], None]], ...] = ()
    #: the ``functools.lru_cache`` wrappers of the user's that the step's code reaches: emptied
    #: before and after the trace, which would fill them with its stand-ins (a causal mask
    #: cached as a fake tensor failed the next eager forward) or read a tensor cached before
    caches: tuple[object, ...] = ()

    @classmethod
    def of(cls, model: torch.nn.Module, loss_fn: object = None) -> PythonState:
        iterators: list[tuple[str, Callable[[], object], Callable[[object], None]]] = []
        caches: list[object] = []
        held, generators = _walk(model, loss_fn, lengths=True, every_field=True, iterators=iterators, caches=caches)
        registered = tuple((name, module, kind, dict(module.__dict__.get(kind, {})))
                           for name, module in model.named_modules(remove_duplicate=False) for kind in _REGISTERS)
        unrepeatable = next((label for label, g in generators if isinstance(g, random.SystemRandom)), None)
        if unrepeatable is not None:
            raise TraceError(f"{unrepeatable} is a random.SystemRandom, whose draws can neither be repeated nor "
                             f"seen: remat cannot tell whether the step draws from it, and a traced step would "
                             f"reuse what it drew once; draw with torch instead (torch.rand, torch.randint), or "
                             f"keep it outside the model and loss_fn")
        return cls(_scalar_attributes(model, loss_fn), random.getstate(), np.random.get_state(), tuple(held), loss_fn,
                   tuple((label, g, _generator_state(g)) for label, g in generators), registered, tuple(iterators),
                   tuple(caches))

    def registrations(self) -> list[tuple[str, torch.nn.Module, str, str]]:
        """(module name, module, kind, key) of each parameter, buffer or submodule the modules
        registered (or replaced) since: a forward that builds one at its first call (a rotary
        embedding's cos/sin cache, a lazily made parameter) built it from the trace's stand-ins."""
        return [(name, module, kind, key) for name, module, kind, before in self.registered
                for key, value in module.__dict__.get(kind, {}).items() if before.get(key, _MISSING) is not value]

    def held_changes(self, model: torch.nn.Module, stashes: bool = True) -> list[tuple[HeldValue, object, object]]:
        """(value, before, now) for each ``HeldValue`` that differs; ``stashes=False``: not the
        lengths of lists (deques, sets) that now hold tensors (``HeldValue.stash``)."""
        return [(h, before, now) for h, before in self.held if not _same(now := h.read(model), before)
                and (stashes or h.stash is None or not h.stash(model))]

    def changes(self, model: torch.nn.Module) -> list[tuple[str, str, object, object]]:
        """(module name, attribute, value before, value now) for each attribute that differs;
        ``_MISSING`` for one absent on either side."""
        now = _scalar_attributes(model, self.loss_fn)
        modules: dict[str, object] = dict(model.named_modules(remove_duplicate=False))
        modules[LOSS_FN] = self.loss_fn
        for (name, key) in self.attributes.keys() - now.keys():  # gone, or no longer a scalar
            module = modules.get(name)
            now[(name, key)] = module.__dict__.get(key, _MISSING) if module is not None else _MISSING
        return [(name, key, self.attributes.get((name, key), _MISSING), value)
                for (name, key), value in now.items() if not _same(self.attributes.get((name, key), _MISSING), value)]

    def drew(self) -> str | None:
        """Which generator outside torch was drawn from since, if one was: a global one, or
        one the model or ``loss_fn`` owns."""
        if random.getstate() != self.python_random:
            return "Python's random module"
        state = np.random.get_state()
        if any(not np.array_equal(a, b) for a, b in zip(state, self.numpy_random, strict=True)):
            return "numpy's global generator (np.random)"
        for label, g, before in self.generators:
            if not _same_state(_generator_state(g), before):
                kind = "random.Random" if isinstance(g, random.Random) else f"numpy.random.{type(g).__name__}"
                return f"a generator of its own, {label} ({kind})"
        return None

    def restore(self, model: torch.nn.Module) -> None:
        """Put the attributes, the registered tensors and modules, and the generators back as
        they were."""
        for _, module, kind, before in self.registered:
            now = module.__dict__.get(kind)
            if isinstance(now, dict):
                now.clear()
                now.update(before)
        modules: dict[str, object] = dict(model.named_modules(remove_duplicate=False))
        modules[LOSS_FN] = self.loss_fn
        for name, key, before, _ in self.changes(model):
            module = modules.get(name)
            if module is None:
                continue
            if before is _MISSING:
                module.__dict__.pop(key, None)
            else:
                module.__dict__[key] = before
        for held, before, _ in self.held_changes(model):
            held.write(model, before)
        random.setstate(self.python_random)
        np.random.set_state(self.numpy_random)
        for _, g, before in self.generators:
            _set_generator_state(g, before)

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
        if not self.changes(model) and not self.held_changes(model, stashes=False):
            return None
        settled = PythonState.of(model, self.loss_fn)
        try:
            result = again()
        except BaseException:
            self.restore(model)
            raise
        moving = settled.changes(model)
        moving_held = settled.held_changes(model, stashes=False)
        drew = settled.drew()
        if not moving and not moving_held and drew is None:
            return result
        self.restore(model)
        if drew is not None:
            raise TraceError(f"the training step draws from {drew} while it runs (in the model's forward or "
                             f"in loss_fn); draw with torch instead (torch.rand, torch.randint)")
        if not moving:
            held, second, third = moving_held[0]
            first = next(v for h, v in self.held if h.label == held.label)  # (settled's are rebuilt)
            raise _moving(held.label, (first, second, third),
                          "a tensor buffer the forward updates in place, or change it outside the step between "
                          "steps and pass it in the batch, as a tensor")
        modules = dict(model.named_modules(remove_duplicate=False))
        name, key, second, third = moving[0]
        first = self.attributes.get((name, key), _MISSING)
        attribute = key.lstrip("_")
        where = (f"loss_fn ({getattr(self.loss_fn, '__qualname__', 'a function')})" if name == LOSS_FN
                 else _where(name, modules.get(name)))
        raise _moving(f"{where} attribute {key!r}", (first, second, third),
                      f"a tensor buffer the forward updates in place (self.register_buffer({attribute!r}, "
                      f"torch.zeros(())), then self.{attribute}.add_(1)), or change it outside the model between "
                      f"steps")


def registered_while_traced(found: list[tuple[str, torch.nn.Module, str, str]]) -> TraceError:
    """The refusal of a step whose forward registered ``found`` (``PythonState.registrations``)."""
    name, module, kind, key = found[0]
    what = {"_parameters": "parameter", "_buffers": "buffer", "_modules": "submodule"}[kind]
    return TraceError(
        f"{_where(name, module)} registers {what} {key!r} while the step runs (a forward that builds it at its "
        f"first call): remat traces the step with stand-ins for every tensor, so what the trace builds is not "
        f"the model's; run the model once before remat.optimize (with torch.no_grad(): model(*example_batch)), "
        f"so that it exists, then optimize")


def _moving(what: str, values: tuple[object, object, object], keep: str) -> TraceError:
    shown = " -> ".join("(unset)" if v is _MISSING else repr(v) for v in values)
    return TraceError(
        f"{what} changes each time the step runs ({shown} over two traces): a traced step runs no Python, so "
        f"it would keep one value while eager PyTorch changes it at every step; keep such state in {keep}"
    )
