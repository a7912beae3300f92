"""Turning a failure inside tracing into a ``TraceError`` that names the user's line."""

from __future__ import annotations

import os
import traceback

import torch

from remat.errors import TraceError

_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)), "site-packages")
# nn.Module's call plumbing: a frame there names the module being called, not the one failing
_MODULE_MACHINERY = frozenset({"_call_impl", "_wrapped_call_impl", "__call__"})


def explain_trace_failure(exc: BaseException, model: torch.nn.Module) -> TraceError:
    """A ``TraceError`` naming the construct torch could not trace, the module it sits in
    (innermost ``forward`` of ``model`` on the stack) and a remedy."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    chain, cause = [], exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    modules = {id(m): name for name, m in model.named_modules()}
    module_desc, user_line = None, None
    for e in chain:
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            code = frame.f_code
            obj = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            filename = code.co_filename
            if obj is not None and id(obj) in modules and code.co_name not in _MODULE_MACHINERY:
                module_desc = _describe_module(model, modules[id(obj)])
            if not any(d in filename for d in _LIBRARY_DIRS):
                code = _source_line(filename, lineno)
                user_line = f"{os.path.basename(filename)}:{lineno}" + (f" `{code}`" if code else "")
    where = module_desc or f"loss_fn or model {type(model).__name__}"
    if user_line:
        where += f" at {user_line}"
    op = next((str(getattr(e, "func", "")) for e in chain if getattr(e, "func", None) is not None), None)
    if any(isinstance(e, DataDependentOutputException) for e in chain) or "data-dependent" in str(exc).lower():
        what = (
            f"a tensor's value read in Python ({op or 'aten._local_scalar_dense'}: .item(), "
            f"bool(tensor), `if tensor ...:`, int(tensor))"
        )
        remedy = (
            "control flow and shapes must not depend on tensor values; use torch.where or "
            "arithmetic masks instead of Python branches, and keep values as tensors"
        )
    elif any(isinstance(e, DynamicOutputShapeException) for e in chain):
        what = f"op {op} whose output shape depends on tensor values (nonzero, unique, boolean masks)"
        remedy = "use a fixed-shape formulation (torch.where, multiplying by a mask) instead"
    elif "fake impl" in str(exc) or "register_fake" in str(exc):
        what = f"an op with no fake-tensor implementation ({_first_line(exc)})"
        remedy = "register one with torch.library.register_fake (or @op.register_fake) so it can be traced"
    elif any(isinstance(e, UnsupportedOperatorException) for e in chain):
        what = f"op {op}, which has no fake-tensor (meta) implementation"
        remedy = "replace the op, or register a fake implementation for it (torch.library.register_fake)"
    else:
        what = f"{type(exc).__name__}: {_first_line(exc)}"
        remedy = "check that loss_fn(model, *batch) runs eagerly and uses only traceable tensor operations"
    return TraceError(f"cannot trace the training step: {what} in {where}; {remedy}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300].rstrip(".") if text else ""


def _source_line(filename: str, lineno: int) -> str | None:
    import linecache

    line = linecache.getline(filename, lineno).strip()
    return line or None


def _describe_module(model: torch.nn.Module, name: str) -> str:
    module = model.get_submodule(name)
    return f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(model).__name__})"
