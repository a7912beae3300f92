"""What dynamo never hands to the backend: a warning for code ``torch.compile`` leaves eager.

Dynamo refuses to capture ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` (unless
``torch._dynamo.config.allow_rnn`` is set): it gives up on the frame that calls one, which then
runs eagerly, and on a model that is nothing but a recurrent layer and a head no backend is
ever called. remat would say nothing and plan nothing. So while a remat backend is alive, a
dynamo compile-end callback looks at the graph breaks that compile recorded, and when one is
an RNN refused for a remat backend it warns with a ``RematFallbackWarning`` naming the module
and records a fallback report on that backend.

This reads dynamo's bookkeeping (its graph-break counters and the frame being compiled); if a
later PyTorch moves it, the watch says nothing rather than fail a compile.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
import warnings
import weakref

import torch

log = logging.getLogger("remat.backend")

#: The graph-break type dynamo records for a recurrent module it refuses to wrap.
RNN_BREAK = "Attempted to wrap RNN, GRU, or LSTM"
_CONTEXT = "Developer debug context:"


class RematFallbackWarning(UserWarning):
    """The backend did not plan a graph with the requested method, or never saw part of the
    model (the message says why and what ran instead)."""


_BACKENDS: weakref.WeakSet = weakref.WeakSet()
_STARTS: list[dict[str, int]] = []
#: The RNN graph-break counts at the end of the last compile: what a compile whose start went
#: unseen (callbacks installed again mid-compile after ``torch._dynamo.reset()``) compares with.
_SEEN: dict[str, int] = {}


def watch(backend: object) -> None:
    """Warn about RNN frames dynamo skips while compiling for ``backend`` (a ``RematBackend``).
    ``torch._dynamo.reset()`` drops compile callbacks: each backend created after it, and each
    backend call, installs them again."""
    _BACKENDS.add(backend)
    install()


def install() -> None:
    try:
        handler = torch._dynamo.callback_handler
        if _on_end not in handler.end_callbacks:
            handler.register_start_callback(_on_start)
            handler.register_end_callback(_on_end)
    except Exception as exc:  # a PyTorch without compile callbacks: nothing to watch with
        log.debug("cannot watch dynamo's graph breaks: %s", exc)


def _rnn_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: v for k, v in counters["unimplemented"].items() if k.startswith(RNN_BREAK)}


def _on_start(args: object) -> None:
    try:
        _STARTS.append(_rnn_breaks())
    except Exception as exc:
        log.debug("dynamo graph-break watch: %s", exc)
        _STARTS.append({})


def _on_end(args: object) -> None:
    before = _STARTS.pop() if _STARTS else dict(_SEEN)
    try:
        now = _rnn_breaks()
        _SEEN.clear()
        _SEEN.update(now)
        new = [k for k, v in now.items() if v > before.get(k, 0)]
        if not new or not _BACKENDS:
            return
        backend, frame_locals = _compiling_for()
        if backend is None:
            return
        for key in new:
            _warn(backend, _module_text(key), frame_locals)
    except Exception as exc:
        log.debug("dynamo graph-break watch: %s", exc)


def _compiling_for() -> tuple[object | None, dict]:
    """The remat backend the frame being compiled is for, and that frame's local variables."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals:
            found = _remat_backend_in(frame.f_locals["compiler_fn"])
            if found is None:
                return None, {}
            frame_locals = frame.f_locals.get("locals")
            return found, frame_locals if isinstance(frame_locals, dict) else {}
        frame = frame.f_back
    return None, {}


def _remat_backend_in(fn: object) -> object | None:
    """The remat backend ``fn`` is or wraps: through dynamo's wrappers (debug wrapper,
    torch.compile's), ``functools.partial``, ``functools.wraps``, and the closure or the module
    globals of a user's own wrapper function (``lambda gm, inputs: be(gm, inputs)``), a few
    levels deep."""
    seen, level = set(), [fn]
    for _ in range(8):
        following = []
        for f in level:
            if id(f) in seen:
                continue
            seen.add(id(f))
            if any(f is b for b in _BACKENDS):
                return f
            following += [getattr(f, name, None) for name in ("_torchdynamo_orig_backend", "compiler_fn", "__wrapped__",
                                                              "func")]
            following += [c.cell_contents for c in (getattr(f, "__closure__", None) or ()) if _filled(c)]
            following += _globals_named(f)
            if isinstance(f, functools.partial):
                following += [*f.args, *f.keywords.values()]
        level = [f for f in following if f is not None and callable(f)]
        if not level:
            break
    return None


def _globals_named(f: object) -> list[object]:
    """The module globals function ``f`` names that may be (or wrap) a backend: remat backends,
    functions and partials (``def wrapper(gm, inputs): return BACKEND(gm, inputs)``)."""
    code, names = getattr(f, "__code__", None), getattr(f, "__globals__", None)
    if code is None or not isinstance(names, dict):
        return []
    values = [names.get(name) for name in code.co_names]
    return [v for v in values if any(v is b for b in _BACKENDS) or isinstance(v, (types.FunctionType, functools.partial))]


def _filled(cell: object) -> bool:
    try:
        cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return False
    return True


def _module_text(key: str) -> str:
    """The module's repr from dynamo's graph-break message."""
    for line in key.splitlines():
        if _CONTEXT in line:
            return line.split(_CONTEXT, 1)[1].strip()
    return "an RNN module"


def _module_names(text: str, frame_locals: dict) -> list[str]:
    """How the frame names the RNN modules whose repr is ``text``: ``''`` for the module
    torch.compile was given, ``'rnn'`` for a submodule of the frame's own module (its first
    argument, or what dynamo's wrapper frame calls ``fn``), ``'encoder.rnn'`` for one of
    another local."""
    names = []
    for k, (var, value) in enumerate(frame_locals.items()):
        if isinstance(value, torch.nn.Module):
            for name, m in value.named_modules():
                if isinstance(m, torch.nn.RNNBase) and str(m) == text:
                    names.append(name if k == 0 or var == "fn" or not name else f"{var}.{name}")
    return names


def _warn(backend: object, text: str, frame_locals: dict) -> None:
    from remat.backend import PartitionReport

    names = _module_names(text, frame_locals)
    if names == [""]:
        module = f"the compiled module ({text})"
    elif names:
        module = f"module {' / '.join(repr(n) for n in names)} ({text})"
    else:
        module = text
    reason = (f"dynamo does not capture {module}: torch.compile runs it and the code around it in the "
              f"same frame eagerly, so remat never plans it")
    warnings.warn(
        f"remat.backend: {reason}; to plan it, trace the whole step with remat.optimize(...) instead of "
        f"torch.compile (torch._dynamo.config.allow_rnn=True makes dynamo capture it, but its traced RNN "
        f"leaves out dropout between layers)",
        RematFallbackWarning,
        stacklevel=2,
    )
    backend.reports.append(PartitionReport(f"graph{len(backend.reports)}", backend.method, fallback=reason, captured=False))
