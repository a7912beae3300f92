"""Turning a failure inside tracing into a ``TraceError`` that names the user's line, and
refusing the modules whose traced form would not compute what eager PyTorch computes."""

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


# ---------------------------------------------------------------------------- recurrent modules
class RnnWatch:
    """Watches the ``nn.RNN``/``nn.GRU``/``nn.LSTM`` modules a trace calls and refuses, with a
    ``TraceError`` naming the module and a remedy, the two cases whose traced step would not be
    eager PyTorch's:

    * dropout between layers in training: PyTorch's traced RNN (its decomposition into cells)
      leaves that dropout out, so the traced step computes other gradients, silently;
    * oneDNN's fused CPU LSTM (``aten.mkldnn_rnn_layer``): its traced form has no workspace,
      which its backward needs, so the step cannot run.

    Use as a context manager around tracing, then ``check_graph`` the traced module.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.names = {id(m): name for name, m in model.named_modules() if isinstance(m, torch.nn.RNNBase)}
        self.called: dict[str, torch.nn.RNNBase] = {}
        self.handles: list = []

    def __enter__(self) -> RnnWatch:
        for m in self.model.modules():
            if id(m) in self.names:
                self.handles.append(m.register_forward_pre_hook(self._called))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _called(self, module: torch.nn.RNNBase, args: object) -> None:
        name = self.names[id(module)]
        self.called[name] = module
        if module.training and module.dropout > 0 and module.num_layers > 1:
            kind = type(module).__name__
            raise TraceError(
                f"{_describe_module(self.model, name)} applies dropout={module.dropout} between its "
                f"{module.num_layers} layers in training, but PyTorch's traced {kind} leaves that dropout "
                f"out, so remat's step would compute other gradients than eager PyTorch; set dropout=0 "
                f"and put an nn.Dropout between single-layer {kind} modules, or call .eval() on this "
                f"module if it should not drop anything"
            )

    def check_graph(self, gm: torch.fx.GraphModule) -> None:
        """Refuse a traced step that runs oneDNN's fused LSTM kernel."""
        fused = next((n for n in gm.graph.nodes if n.op == "call_function" and "mkldnn_rnn" in str(n.target)), None)
        if fused is None:
            return
        lstms = [name for name, m in self.called.items() if isinstance(m, torch.nn.LSTM)] or list(self.called)
        where = ", ".join(_describe_module(self.model, name) for name in lstms) or f"model {type(self.model).__name__}"
        raise TraceError(
            f"{where} runs oneDNN's fused CPU LSTM kernel ({fused.target}), whose traced form loses "
            f"the workspace its backward reads, so the traced step cannot run; trace with oneDNN off "
            f"for this step: `with torch.backends.mkldnn.flags(enabled=False): step = remat.optimize(...)` "
            f"(the LSTM then traces to plain matrix products, equal to eager PyTorch under the same flag)"
        )
