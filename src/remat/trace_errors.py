"""Turning a failure inside tracing into a ``TraceError`` that names the user's line, and
refusing the modules whose traced form would not compute what eager PyTorch computes."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import platform
import re
import sys
import textwrap
import traceback
import warnings
from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_leaves

from remat.errors import TraceError
from remat.fx_graph import explicit_generator, non_strided_layout

_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)), "site-packages")
# nn.Module's call plumbing: a frame there names the module being called, not the one failing
_MODULE_MACHINERY = frozenset({"_call_impl", "_wrapped_call_impl", "__call__"})


def explain_trace_failure(exc: BaseException, model: torch.nn.Module, loss_fn: object = None) -> TraceError:
    """A ``TraceError`` naming the construct torch could not trace, where it sits (the innermost
    method of one of ``model``'s modules on the stack, or ``loss_fn`` when the failure is in its
    own code) and a remedy."""
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
    module_desc, module, user_line = None, None, None
    user_source = ""  # the code of the user's line
    in_loss_fn = False  # the innermost frame of the user's code is loss_fn's own
    loss_code = getattr(loss_fn, "__code__", None)
    module_names: frozenset[str] = frozenset()  # the names the module's failing method uses
    custom_backward = None  # the autograd.Function whose backward was running, if one was
    callee = None  # the library function the user's line called, where the failure is inside it
    validating = False  # a torch.distributions argument check was running
    for e in chain:
        for frame, lineno in traceback.walk_tb(e.__traceback__):
            code = frame.f_code
            validating = validating or (code.co_filename.endswith(_DISTRIBUTION_BASE)  # its checks
                                        and (code.co_name == "__init__" or code.co_name.startswith("_validate")))
            ctx = frame.f_locals.get("ctx")
            if custom_backward is None and code.co_name == "backward" and ctx is not None:
                custom_backward = getattr(getattr(ctx, "_forward_cls", None), "__name__", None) or type(ctx).__name__
            obj = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            filename = code.co_filename
            if code is loss_code:
                module_desc, module, in_loss_fn = None, None, True
            elif (obj is not None and id(obj) in modules and code.co_name not in _MODULE_MACHINERY
                  and _is_method_of(code, obj)):  # (not a function given the model, as loss_fn is)
                module_desc, module, in_loss_fn = _describe_module(model, modules[id(obj)]), obj, False
                module_names = frozenset(code.co_names)
            if not any(d in filename for d in _LIBRARY_DIRS):
                if filename.startswith("<") and _source_line(filename, lineno) is None:
                    continue  # generated code (``<string>``): no line to show
                user_line = _line_shown(filename, lineno)
                user_source = _source_line(filename, lineno) or ""
                callee = None
            elif user_line is not None and callee is None:
                callee = _public_function(frame)
    where = module_desc or ("loss_fn" if in_loss_fn else f"loss_fn or model {type(model).__name__}")
    if user_line:
        where += f" at {user_line}"
        if callee:
            where += f" (inside {callee})"
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
        if in_loss_fn:
            remedy += ("; to log the loss, read the tensor step(batch) returns (loss.item() after the "
                       "step), not the loss inside loss_fn")
        # LayerDrop only where the failing method reads its setting (a module, or a config its
        # submodules share, may set it while something else reads a value)
        drops = (_layer_drop_settings(module) if module is not None and module.training
                 and module_names & set(_LAYER_DROP_NAMES) else [])
        if drops:
            remedy = (
                f"it sets {', '.join(drops)}: in training it skips a layer whenever a random number falls "
                "below that probability, a Python branch on a random value that a traced step cannot take "
                "anew each step; set it to 0.0 to train with remat, which then runs every layer "
                "(transformers models read it from model.config at every step)"
            )
        elif validating:
            remedy = (
                "torch.distributions checks its arguments' values (validate_args) on every call, a read a "
                "traced step cannot make; turn the checks off for training with remat: "
                "torch.distributions.Distribution.set_default_validate_args(False)"
            )
        elif isinstance(module, _CAUSAL_CHECKERS):
            flag = "tgt_is_causal" if isinstance(module, torch.nn.TransformerDecoder) else "is_causal"
            remedy = (
                f"given a mask and no {flag}, {type(module).__name__} compares the mask's values with a causal "
                f"mask to choose its attention kernel, a read a traced step cannot make for a mask computed from "
                f"the batch; pass {flag}=True if the mask is causal (False if not), or build the mask from "
                f"shapes alone (nn.Transformer.generate_square_subsequent_mask(n)), whose check remat answers "
                f"as eager does"
            )
        elif isinstance(module, _BATCH_NORMS) and module.momentum is None:
            remedy = (
                "this batch norm has momentum=None (a cumulative average), which reads its "
                "num_batches_tracked counter as a Python number on every step, so a traced step "
                "would keep the first step's factor; give it a fixed momentum (e.g. momentum=0.1)"
            )
    elif any(isinstance(e, DynamicOutputShapeException) for e in chain) and op is not None and any(
            name in op for name in _SIZED_BY_VALUES):
        what = f"op {op}, which sizes its working tensors by the values of its inputs (the target lengths)"
        remedy = ("no fixed-shape form of it exists in PyTorch, so one traced step cannot serve every batch; "
                  "remat cannot plan a step that calls it: train this model without remat (or with "
                  "torch.utils.checkpoint)")
    elif any(isinstance(e, DynamicOutputShapeException) for e in chain):
        what = f"op {op} whose output shape depends on tensor values (nonzero, unique, boolean masks)"
        remedy = "use a fixed-shape formulation (torch.where, multiplying by a mask) instead"
        experts = _experts_implementation(module)
        if experts is not None:
            remedy = (
                f"this mixture-of-experts layer runs transformers' experts_implementation={experts!r}, a loop over "
                "the experts each batch routes tokens to (which ones, and how many tokens each, depend on the "
                "values); transformers' \"grouped_mm\" (its default) and \"batched_mm\" compute the same with "
                "fixed shapes, and remat plans them: model.set_experts_implementation(\"grouped_mm\")"
            )
    elif "leaf Variable that requires grad is being used in an in-place operation" in str(exc):
        what = "an in-place operation on a tensor that requires grad and has no history (a leaf)"
        remedy = (
            "eager PyTorch refuses that too for a parameter or a leaf batch tensor; but remat traces every batch "
            "tensor as a leaf, so a batch tensor computed outside the step (one with a grad_fn, which eager lets "
            "the forward modify in place) is refused here: clone it before modifying it (x = x.clone())"
        )
    elif "fake impl" in str(exc) or "register_fake" in str(exc):
        what = f"an op with no fake-tensor implementation ({_first_line(exc)})"
        remedy = "register one with torch.library.register_fake (or @op.register_fake) so it can be traced"
    elif any(isinstance(e, UnsupportedOperatorException) for e in chain):
        what = f"op {op}, which has no fake-tensor (meta) implementation"
        remedy = "replace the op, or register a fake implementation for it (torch.library.register_fake)"
    elif "convert all Tensors to FakeTensors" in str(exc):
        found = re.search(r"Found in ([\w.]+)\(", str(exc))
        what = (f"a real tensor that is not an input of the traced step (not a registered parameter or buffer "
                f"of the model, nor a batch tensor) reached {op or (found.group(1) if found else 'an op')}")
        if custom_backward is not None:
            remedy = (
                f"the backward of the custom torch.autograd.Function {custom_backward} calls the model's modules again "
                f"(as reversible layers and hand-written recomputation do), after the forward that remat traces "
                f"with the model's parameters; remat cannot trace such a backward: recompute with "
                f"torch.utils.checkpoint instead (remat traces it as plain calls and plans the recomputation "
                f"itself), or train this model without remat"
            )
        elif in_loss_fn:
            remedy = (
                "loss_fn uses a tensor that is neither the model's nor the batch's (from a closure or a global, "
                "such as class weights); pass it in the batch, or register it on the model (register_buffer) "
                "and read it there, so that remat traces it as an input of the step"
            )
        elif _BRANCH.search(user_source):
            remedy = (
                "the model reads a tensor that is not registered on it (a plain tensor attribute such as "
                "self.threshold = torch.tensor(0.5), one kept in a list, dict or closure, or a global), and here its "
                "value decides a Python branch, which a traced step cannot take anew from a tensor (registered as "
                "a buffer, it would be refused as a value read); read it as a number (float(tensor), or keep a "
                "Python float), which remat records and checks before each step, refusing a step after it changes"
            )
        else:
            remedy = (
                "the model reads a tensor that is not registered on it (a plain tensor attribute such as "
                "self.scale = torch.tensor(2.0), one kept in a list, dict or closure, a global, or another model's "
                "parameter); register it (register_buffer, an nn.Parameter attribute or an nn.ModuleList) so that "
                "remat traces it as an input of the step"
            )
    elif "returned an invalid gradient" in str(exc):
        # (torch 2.13: ``h.transpose_(1, 2); h.mul_(2.0)`` on a view; torch.compile fails the same way)
        what = f"{type(exc).__name__}: {_first_line(exc)}"
        remedy = ("a backward that runs eagerly went wrong while traced: PyTorch's tracing mishandles an in-place "
                  "view op (transpose_, t_, swapdims_, squeeze_, unsqueeze_, as_strided_) on a view followed by "
                  "another in-place op, and torch.compile fails on it the same way; use the out-of-place form "
                  "(h = h.transpose(1, 2))")
    elif (script := _torchscript_line(chain)) is not None:
        what = f"a TorchScript function failed while traced, at {script}"
        remedy = ("a scripted function runs as one call that remat cannot look into, and one that reads a tensor's "
                  "value (bool(), .item(), `if tensor`) cannot be traced at all; call its Python source instead "
                  "of the scripted function (drop @torch.jit.script), writing a branch on a tensor with torch.where")
    else:
        what = f"{type(exc).__name__}: {_first_line(exc)}"
        remedy = "check that loss_fn(model, *batch) runs eagerly and uses only traceable tensor operations"
    return TraceError(f"cannot trace the training step: {what} in {where}; {remedy}")


def _torchscript_line(chain: Sequence[BaseException]) -> str | None:
    """``file.py:4 `the line``` where a TorchScript function failed, from the innermost frame of
    its traceback in an error's message (the line marked ``<--- HERE``), or None."""
    for exc in chain:
        text = str(exc)
        if "Traceback of TorchScript" not in text:
            continue
        frames = list(re.finditer(r'File "([^"]+)", line (\d+), in (\w+)', text))
        if not frames:
            continue
        last = frames[-1]
        lines = text[last.end():].splitlines()
        marked = next((k for k, line in enumerate(lines) if "<--- HERE" in line), None)
        code = lines[marked - 1].strip() if marked is not None and marked > 0 else ""
        return (f"{os.path.basename(last.group(1))}:{last.group(2)} in {last.group(3)}"
                + (f" `{code}`" if code else ""))
    return None


_DISTRIBUTION_BASE = os.path.join("torch", "distributions", "distribution.py")

#: Attributes of a module, or of its ``config``, that are a LayerDrop probability (transformers'
#: speech encoders default to 0.1; fairseq-style models name it the same way).
_LAYER_DROP_NAMES = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "layer_drop")


def _experts_implementation(module: torch.nn.Module | None) -> str | None:
    """The experts implementation a transformers mixture-of-experts module runs, when it is one
    of the data-dependent ones (the per-expert loop, ``"eager"``); None otherwise, and for every
    other module (transformers sets the setting on every model's config, experts or not: the
    module must be an experts class, which transformers' ``use_experts_implementation`` marks)."""
    if not hasattr(module, "_is_expert_parallel"):
        return None
    config = getattr(module, "config", None)
    name = getattr(config, "_experts_implementation", None)
    if not isinstance(name, str) or name in ("grouped_mm", "batched_mm"):
        return None
    return name


def _layer_drop_settings(module: torch.nn.Module) -> list[str]:
    """``"name=p"`` for each LayerDrop probability above 0 that ``module`` or its config sets."""
    found: dict[str, float] = {}
    for owner, prefix in ((module, ""), (getattr(module, "config", None), "config.")):
        for name in _LAYER_DROP_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found.setdefault(f"{prefix}{name}", float(value))
    return [f"{name}={value:g}" for name, value in found.items()]


def _first_line(exc: BaseException, limit: int = 400) -> str:
    """The first line of ``exc``'s message, cut at a word boundary with "..." past ``limit``."""
    text = str(exc).strip()
    line = text.splitlines()[0].rstrip(".") if text else ""
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


#: a line of Python whose value decides a branch: ``if``, ``elif``, ``while``, ``assert`` or a
#: conditional expression
_BRANCH = re.compile(r"^\s*(if|elif|while|assert)\b|\bif\b.+\belse\b")


def _source_line(filename: str, lineno: int) -> str | None:
    import linecache

    line = linecache.getline(filename, lineno).strip()
    return line or None


#: ops whose outputs are sized by their inputs' values with no fixed-shape alternative: the
#: "use torch.where" remedy does not apply to them
_SIZED_BY_VALUES = ("aten._ctc_loss", "aten.ctc_loss")


def _is_method_of(code: object, obj: object) -> bool:
    """Whether ``code`` is (by name) a method of ``obj``'s class or a base's: ``forward`` and
    what it calls on ``self``, decorated or not, but not a function that takes the model as its
    first argument (a ``loss_fn`` given the model)."""
    name = getattr(code, "co_name", None)
    return isinstance(name, str) and name.isidentifier() and callable(getattr(type(obj), name, None))


#: Libraries whose functions a message names when a failure is inside one the user's line called
_NAMED_LIBRARIES = ("torch.nn.functional", "torch.distributions.", "transformers.loss.")


def _public_function(frame: object) -> str | None:
    """``module.function`` of a library frame the user's code called (``F.gaussian_nll_loss``
    checks its variances' values), or None for PyTorch's machinery."""
    module = frame.f_globals.get("__name__", "")
    name = frame.f_code.co_name
    if name.startswith("_") or not any(module == lib or module.startswith(lib) for lib in _NAMED_LIBRARIES):
        return None
    return f"{module}.{name}"


def _describe_module(model: torch.nn.Module, name: str) -> str:
    module = model.get_submodule(name)
    return f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(model).__name__})"


# ---------------------------------------------------------------------------- recurrent modules
_RECURRENT = (torch.nn.RNNBase, torch.nn.GRUCell)
_SIMD_BYTES = {"AVX2": 32, "AVX512": 64}  # one register of ATen's vectorized CPU kernels


def gru_rounding_block(device: torch.device, dtype: torch.dtype) -> int | None:
    """Elements per block of ATen's vectorized elementwise loops (two registers) for ``dtype``
    on this CPU: a GRU whose hidden size is not a multiple of it rounds its gates differently
    in eager PyTorch and in a traced step. None where no such difference arises: not a CPU,
    or an x86 CPU running unvectorized (``DEFAULT``) kernels."""
    if device.type != "cpu" or not dtype.is_floating_point:
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return None
    register = _SIMD_BYTES.get(capability, 64)  # other vector units: assume the widest
    return max(1, 2 * register // dtype.itemsize)


def eager_runs_onednn_lstm(module: torch.nn.Module, args: tuple, *, enabled: bool | None = None) -> bool:
    """Whether eager PyTorch runs this call of ``module`` through oneDNN's fused CPU LSTM kernel
    (``aten.mkldnn_rnn_layer``): an ``nn.LSTM`` without projections, called on a padded (not
    packed) non-empty CPU input with CPU weights and states, oneDNN built in and enabled, in
    float32 (bfloat16 where the CPU supports oneDNN's, float16 only without grad) -- what
    ``at::native::lstm`` checks before its cell loop. ``nn.GRU`` and ``nn.RNN`` have no such
    kernel. ``enabled``: the oneDNN flag to assume (default: its current value)."""
    if not isinstance(module, torch.nn.LSTM) or module.proj_size > 0 or not args:
        return False
    if enabled is None:
        enabled = torch.backends.mkldnn.enabled
    if not (torch.backends.mkldnn.is_available() and enabled):
        return False
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.numel() == 0:  # (a PackedSequence takes the cell loop)
        return False
    if any(t.device.type != "cpu" for t in tree_leaves((x, module._flat_weights, args[1:]))
           if isinstance(t, torch.Tensor)):
        return False
    if x.dtype == torch.float32:
        return True
    if x.dtype == torch.bfloat16:
        check = "_is_mkldnn_bf16_supported"
    elif x.dtype == torch.float16 and not torch.is_grad_enabled():
        check = "_is_mkldnn_fp16_supported"
    else:
        return False
    supported = getattr(torch.ops.mkldnn, check, None)
    return supported is not None and bool(supported())


def _onednn_lstm_error(where: str, kernel: str) -> TraceError:
    return TraceError(
        f"{where} runs oneDNN's fused CPU LSTM kernel ({kernel}) in eager PyTorch, which a traced "
        f"step cannot reproduce: traced through it, the step loses the workspace the kernel's "
        f"backward reads and cannot run; traced around it, the LSTM becomes plain matrix products, "
        f"which round differently from the fused kernel (in the last bits), so remat's gradients "
        f"would not be eager's. Trace with oneDNN off for this step: `with "
        f"torch.backends.mkldnn.flags(enabled=False): step = remat.optimize(...)`. The LSTM then "
        f"traces to plain matrix products: the step's gradients are eager PyTorch's with oneDNN off, "
        f"so compare it with, and switch to it from, eager training under the same flag"
    )


class _ModuleWatch:
    """While in use as a context manager, calls ``self._called(module, args)`` before every
    call of a module of ``model`` that is one of ``kinds`` (named in ``self.names``); nothing
    when not ``active``."""

    def __init__(self, model: torch.nn.Module, kinds: tuple[type, ...], active: bool = True) -> None:
        self.model, self.active = model, active
        self.names = {id(m): name for name, m in model.named_modules() if isinstance(m, kinds)}
        self.handles: list = []

    def __enter__(self):
        if self.active:
            self.handles += [m.register_forward_pre_hook(self._called) for m in self.model.modules()
                             if id(m) in self.names]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _called(self, module: torch.nn.Module, args: tuple) -> None:
        raise NotImplementedError


class RnnWatch(_ModuleWatch):
    """Watches the ``nn.RNN``/``nn.GRU``/``nn.LSTM`` modules a trace calls and refuses, with a
    ``TraceError`` naming the module and a remedy, the cases whose traced step would not be
    eager PyTorch's:

    * dropout between layers in training: PyTorch's traced RNN (its decomposition into cells)
      leaves that dropout out, so the traced step computes other gradients, silently;
    * oneDNN's fused CPU LSTM (``aten.mkldnn_rnn_layer``), wherever eager PyTorch runs it
      (``eager_runs_onednn_lstm``): traced through it, the step has no workspace, which the
      kernel's backward needs, and cannot run; traced around it (an LSTM whose input the step
      computes, as after an embedding, traces to its cell loop), the matrix products round
      differently from the fused kernel, so the gradients were eager's only to the last bits
      (1e-9 in float32), silently;
    * a GRU on a vectorizing CPU whose ``hidden_size`` is not a multiple of the elementwise
      kernels' block (two SIMD registers): eager PyTorch's GRU cell applies ``sigmoid_`` in place
      to strided views of its gates, so each row's last ``hidden_size % block`` elements take
      the scalar code path, while the traced step (functionalized: out of place, contiguous)
      computes them vectorized; the two round differently (a few ulps), so gradients would not
      be bitwise eager's.

    Use as a context manager around tracing, then ``check_graph`` the traced module.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, _RECURRENT)
        self.called: dict[str, torch.nn.Module] = {}
        #: the LSTMs (described) that eager PyTorch would run through oneDNN's fused kernel were
        #: the oneDNN flag on, which it is not while tracing: the step is eager's under the same
        #: flag only (``guards.ModuleState.onednn_off``)
        self.onednn_off: list[str] = []

    def _called(self, module: torch.nn.RNNBase | torch.nn.GRUCell, args: tuple) -> None:
        name = self.names[id(module)]
        self.called[name] = module
        if isinstance(module, torch.nn.RNNBase) and module.training and module.dropout > 0 and module.num_layers > 1:
            kind = type(module).__name__
            raise TraceError(
                f"{_describe_module(self.model, name)} applies dropout={module.dropout} between its "
                f"{module.num_layers} layers in training, but PyTorch's traced {kind} leaves that dropout "
                f"out, so remat's step would compute other gradients than eager PyTorch; set dropout=0 "
                f"and put an nn.Dropout between single-layer {kind} modules, or call .eval() on this "
                f"module if it should not drop anything"
            )
        if isinstance(module, (torch.nn.GRU, torch.nn.GRUCell)) and args:
            x = args[0].data if isinstance(args[0], torch.nn.utils.rnn.PackedSequence) else args[0]
            block = gru_rounding_block(x.device, x.dtype) if isinstance(x, torch.Tensor) else None
            if block is not None and module.hidden_size % block:
                raise TraceError(
                    f"{_describe_module(self.model, name)} has hidden_size={module.hidden_size}, not a "
                    f"multiple of {block}: on this CPU ({torch.backends.cpu.get_cpu_capability()} kernels) "
                    f"eager PyTorch's GRU cell computes the last {module.hidden_size % block} gate values "
                    f"of each row with scalar code, which rounds differently from the traced step's "
                    f"vectorized kernels, so remat's gradients would not be bitwise eager's; use a "
                    f"hidden_size that is a multiple of {block}, or set the environment variable "
                    f"ATEN_CPU_CAPABILITY=default before torch is imported (unvectorized kernels: eager "
                    f"and traced then agree)"
                )
        if eager_runs_onednn_lstm(module, args, enabled=True):
            where = _describe_module(self.model, name)
            if torch.backends.mkldnn.enabled:
                raise _onednn_lstm_error(where, "aten.mkldnn_rnn_layer")
            if where not in self.onednn_off:
                self.onednn_off.append(where)

    def check_graph(self, gm: torch.fx.GraphModule) -> None:
        """Refuse a traced step that runs oneDNN's fused LSTM kernel (where a call was not refused
        already: its inputs did not tell)."""
        fused = next((n for n in gm.graph.nodes if n.op == "call_function" and "mkldnn_rnn" in str(n.target)), None)
        if fused is None:
            return
        lstms = [name for name, m in self.called.items() if isinstance(m, torch.nn.LSTM)] or list(self.called)
        where = ", ".join(_describe_module(self.model, name) for name in lstms) or f"model {type(self.model).__name__}"
        raise _onednn_lstm_error(where, str(fused.target))


def check_dense(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Refuse a traced step with a tensor that is not dense (strided): a sparse gradient, as
    ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` give, has no storage
    whose bytes remat can count and plan, nor a traced form the step could return as eager
    PyTorch does. Names the node, and the modules set to produce it."""
    for n in gm.graph.nodes:
        layout = non_strided_layout(n)
        if layout is None:
            continue
        sparse = [name for name, m in model.named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
        where = (", ".join(_describe_module(model, name) for name in sparse) + " has sparse=True, so it makes"
                 if sparse else f"model {type(model).__name__} makes")
        remedy = ("set sparse=False (its gradient is then dense; every optimizer but SparseAdam takes it)"
                  if sparse else "compute it with dense tensors")
        raise TraceError(
            f"{where} a {layout} tensor in the training step (node {n.name}, {n.target}); remat plans "
            f"dense tensors only, whose bytes it counts: {remedy}"
        )


#: torch's functions that seed, set or save-and-restore a random generator, by the name a
#: message shows: (module, attribute)
_RNG_SETTERS = (
    ("torch.manual_seed", torch, "manual_seed"), ("torch.seed", torch, "seed"),
    ("torch.set_rng_state", torch, "set_rng_state"), ("torch.random.manual_seed", torch.random, "manual_seed"),
    ("torch.random.seed", torch.random, "seed"), ("torch.random.set_rng_state", torch.random, "set_rng_state"),
    ("torch.random.fork_rng", torch.random, "fork_rng"), ("torch.cuda.manual_seed", torch.cuda, "manual_seed"),
    ("torch.cuda.manual_seed_all", torch.cuda, "manual_seed_all"),
    ("torch.cuda.set_rng_state", torch.cuda, "set_rng_state"),
    ("torch.cuda.set_rng_state_all", torch.cuda, "set_rng_state_all"),
)


class RngWatch:
    """Refuses a training step that seeds or restores torch's random generators while it runs
    (``torch.manual_seed(42)`` in ``forward`` for the same noise every step, ``fork_rng`` around
    noise that should not disturb the rest): those are Python calls, not operations a trace
    records, so the traced step would draw on from the step's starting state where eager
    reseeds (a loss 0.036 apart, gradients 0.03 off and the generator's state after the step
    another, silently). While in use the functions raise ``TraceError`` naming the call and the
    user's line; ``check`` afterwards refuses a trace that changed the CPU generator's state by
    other means (``torch.default_generator.manual_seed``)."""

    def __enter__(self) -> RngWatch:
        importlib.import_module("torch._dynamo")  # (its import wraps torch.manual_seed: the wrapper goes back)

        self.state = torch.get_rng_state()
        self.saved = []
        for name, module, attr in _RNG_SETTERS:
            if hasattr(module, attr):
                self.saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, functools.partial(_refuse_rng_call, name))
        import numpy as np

        self.saved.append((np.random, "default_rng", np.random.default_rng))
        np.random.default_rng = functools.partial(_unseeded_numpy_generator, np.random.default_rng)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, attr, original in self.saved:
            setattr(module, attr, original)

    def check(self) -> None:
        if not torch.equal(torch.get_rng_state(), self.state):
            torch.default_generator.set_state(self.state)  # (torch.set_rng_state is the watch's here)
            raise _rng_error("changes torch's default random generator (its state differs after the trace)")


def _unseeded_numpy_generator(default_rng, seed=None, *args: object, **kwargs: object):
    """``np.random.default_rng`` while a step is traced: seeded, as it is; without a seed (fresh
    numbers from the system at every call, which a traced step would draw once), refused."""
    if seed is None:
        frame = sys._getframe(1)
        raise TraceError(
            f"the training step makes an unseeded numpy generator (np.random.default_rng() at "
            f"{_line_shown(frame.f_code.co_filename, frame.f_lineno)}) while it runs: a traced step runs no Python, "
            f"so every step would reuse the numbers it drew once; draw with torch instead (torch.rand, "
            f"torch.randint: remat replays torch's generator), or draw outside the step and pass the values in the "
            f"batch")
    return default_rng(seed, *args, **kwargs)


def _refuse_rng_call(name: str, *args: object, **kwargs: object) -> None:
    frame = sys._getframe(1)
    if f"{os.sep}torch{os.sep}_dynamo{os.sep}" in frame.f_code.co_filename:  # (not the user's call: dynamo's)
        raise TraceError(
            "the training step runs code torch.compile captures (torch.cond, torch.while_loop, a function under "
            "torch.compile or torch.compiler) while it is traced, which remat cannot trace; write the branch with "
            "torch.where, or compile the whole step with remat.backend instead")
    raise _rng_error(f"calls {name} at {_line_shown(frame.f_code.co_filename, frame.f_lineno)}")


def _line_shown(filename: str, lineno: int) -> str:
    """``file.py:12 `the code``` as a message shows a line of the user's code (the code where
    the file can be read)."""
    code = _source_line(filename, lineno)
    return f"{os.path.basename(filename)}:{lineno}" + (f" `{code}`" if code else "")


def _rng_error(what: str) -> TraceError:
    return TraceError(
        f"the training step {what} while it runs (in the model's forward or in loss_fn): a traced step "
        f"runs no Python, so it would not seed or restore the generator, and its random ops would draw "
        f"other numbers than eager PyTorch's; seed outside the step, before calling it (remat replays "
        f"torch's generator from there)"
    )


def warn_of_stored_trace_tensors(model: torch.nn.Module, loss_fn: object, stashed: Sequence[str] = ()) -> None:
    """Warn where the step's Python stored a tensor of the trace outside the model: a metric
    ``loss_fn`` keeps for logging (``metrics["acc"] = ...``), a forward hook's stash, an
    activation the user's module classes' code appends to a global list or logs in a global
    dict (the globals and closure variables of ``forward`` and their other methods). A traced
    step runs no Python, so those stay the trace's fake tensors, never updated (reading one
    fails with an error about fake tensors). ``stashed``: module attributes the forward set to a
    tensor (``self.last = out.detach()``), which tracing put back as they were, so step() never
    sets them. Gradients are unaffected, so this warns."""
    from torch._subclasses.fake_tensor import FakeTensor

    from remat.guards import _MODULE_INTERNALS, function_names, user_members

    found: list[str] = list(dict.fromkeys(stashed))
    looked: set[int] = set()  # (a global several functions name is looked into once)

    def look(label: str, value: object, depth: int = 0) -> None:
        if depth == 0:
            if id(value) in looked:
                return
            looked.add(id(value))
        if isinstance(value, FakeTensor):
            found.append(label)
        elif depth == 0 and isinstance(value, dict):
            for k, v in list(value.items())[:256]:
                look(f"{label}[{k!r}]", v, 1)
        elif depth == 0 and isinstance(value, (list, tuple)):
            for k, v in enumerate(value[:256]):
                look(f"{label}[{k}]", v, 1)

    def scan(what: str, fn: object) -> None:
        for kind, name, value, _read, _write in function_names(fn):
            look(f"{what}'s {kind} {name!r}", value)

    scan("loss_fn", loss_fn)
    for path, module in model.named_modules():
        for table in ("_forward_hooks", "_forward_pre_hooks"):
            for hook in getattr(module, table, {}).values():
                scan(f"a forward hook of {_describe_module(model, path)}", hook)
        for key, value in vars(module).items():  # (a list the forward appends its outputs to)
            if isinstance(value, (list, tuple, dict)) and key not in _MODULE_INTERNALS:
                look(f"model.{path}.{key}" if path else f"model.{key}", value)
    # the globals and closure variables the user's module classes' code names (a forward appending
    # its activations to a module-level list, a helper method logging one in a global dict)
    classes = {type(module) for module in model.modules()}
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        for owner, key, fn in user_members(cls):
            scan(f"{owner}.{key}", fn)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        warnings.warn(
            f"{shown} {'holds a tensor' if len(found) == 1 else 'hold tensors'} the training step made while "
            f"it was traced; a traced step runs no Python, so step() will never update "
            f"{'it' if len(found) == 1 else 'them'} (value-less tensors of the trace; a module attribute keeps "
            f"what it held before tracing, or stays unset): compute such values outside the step (step() "
            f"returns the loss); gradients are not affected",
            stacklevel=_outside_remat(),
        )


def _outside_remat() -> int:
    """The ``stacklevel`` of the innermost caller outside remat's package (for warnings)."""
    frame, level = sys._getframe(1), 1
    package = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class RegisteredTensors:
    """The parameters and buffers of a model as the training step was handed them, to check
    after ``loss_fn`` ran that the step changed them in place only. A traced step reads the
    tensors it is given and writes back what it modified in place; a forward that rebinds a
    buffer (``self.ema = 0.9 * self.ema + ...``) or replaces a tensor's data
    (``self.weight.data = ...``) leaves eager's model with the new tensor and the traced step
    with the old one (a running average stayed at zero, a weight halved by hand was not:
    gradients 0.04 off, silently)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.entries = [(path, kind, table, attr, t, _storage_key(t))
                        for path, m in model.named_modules()
                        for kind, table in (("parameter", m._parameters), ("buffer", m._buffers))
                        for attr, t in table.items() if t is not None]

    def check(self, model: torch.nn.Module) -> None:
        for path, kind, table, attr, t, key in self.entries:
            if table.get(attr) is not t:
                how = f"rebinds its {kind} {attr!r} (self.{attr} = ...)"
            elif _storage_key(t) != key:
                how = f"replaces the data of its {kind} {attr!r} (self.{attr}.data = ...)"
            else:
                continue
            raise TraceError(
                f"{_describe_module(model, path)} {how} in the training step; a traced step keeps the "
                f"tensor it was given, so the new value would be lost where eager PyTorch carries it into "
                f"the next step: update it in place under torch.no_grad() (self.{attr}.copy_(new_value)), "
                f"which remat traces and writes back"
            )


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: nothing to compare)
        return None


def check_default_generator(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Refuse a random op that draws from a ``torch.Generator`` of the user's own
    (``torch.rand(..., generator=self.gen)``): remat replays the default generator's state
    where a plan recomputes a random op, and a private generator's draws would differ (a
    dropout mask recomputed for the backward came out another mask: gradients 5e-3 off,
    silently). Names the node, and the module attribute holding the generator where one does."""
    for n in gm.graph.nodes:
        gen = explicit_generator(n, gm)
        if gen is None:
            continue
        holders = [f"{name + '.' if name else ''}{attr}" for name, m in model.named_modules()
                   for attr, value in vars(m).items() if _same_generator(value, gen)]
        where = f" ({', '.join(holders)} of the model)" if holders else ""
        if not holders and _same_generator(torch.default_generator, gen):
            raise TraceError(
                f"node {n.name} ({n.target}) is given generator=torch.default_generator: remat replays the default "
                f"generator for random ops that name no generator, and a traced generator argument is a copy of "
                f"it, which a recomputation would not follow; drop generator=... (the op then draws from the "
                f"default generator, as it does now)")
        raise TraceError(
            f"node {n.name} ({n.target}) draws from a torch.Generator of its own{where}; remat replays "
            f"torch's default generator where a plan recomputes a random op, so a recomputation would "
            f"draw other numbers than eager's: draw from the default generator (drop generator=..., "
            f"seed it with torch.manual_seed)"
        )


def _same_generator(value: object, gen: object) -> bool:
    """Is ``value`` the generator the traced graph holds? Tracing hands the graph a copy, so a
    generator of the same device and state counts (tracing draws nothing from the user's)."""
    if not isinstance(value, torch.Generator) or not isinstance(gen, torch.Generator):
        return False
    return value is gen or (value.device == gen.device and torch.equal(value.get_state(), gen.get_state()))


# ---------------------------------------------------------------------------- batch norm on CUDA
_BATCH_NORMS = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)
#: Modules that read an attention mask's values to tell whether it is causal when not told.
_CAUSAL_CHECKERS = (torch.nn.TransformerEncoder, torch.nn.TransformerDecoder, torch.nn.Transformer)
#: the smallest eps for which ATen hands a batch norm to cuDNN (CUDNN_BN_MIN_EPSILON)
CUDNN_MIN_EPS = 1e-5
#: how a refusal tells the user to accept the traced kernels
ALLOW_OPTION = "allow_native_batch_norm=True"


def cudnn_active(device: torch.device) -> bool:
    """Whether eager PyTorch may run cuDNN's kernels for tensors on ``device``."""
    return device.type == "cuda" and torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()


def runs_cudnn_in_eager(node: torch.fx.Node) -> bool:
    """Whether eager PyTorch would run the batch norm of forward node ``node`` with cuDNN: ATen's
    choice of backend (on CUDA with cuDNN on: affine, ``eps`` at least cuDNN's least, 3 or more
    dimensions), taken broadly so that no such case is missed."""
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(x, torch.Tensor) or not cudnn_active(x.device):
        return False
    affine = node.args[1] is not None and node.args[2] is not None
    return affine and node.args[-1] >= CUDNN_MIN_EPS and x.dim() >= 3


class BatchNormWatch(_ModuleWatch):
    """Refuses, with a ``TraceError`` naming the module, a batch norm that eager PyTorch runs
    with cuDNN but the traced step would not. ``remat.batch_norm`` rewrites a training-mode
    batch norm (with running statistics or without: ``track_running_stats=False``, instance
    norm) to the ops eager's kernels run behind, and an eval-mode norm's native kernels measured
    bitwise cuDNN's; what is left is a training-mode norm the rewrite could not take (a backward
    it could not match to its forward), which PyTorch's native kernels would run (as under
    ``torch.compile``), reducing in another order than cuDNN's, so the traced step's gradients
    would not be eager's (on a GPU, ResNet50's first convolution's weight gradient came out 39%
    apart in norm). ``allow``: accept the native kernels instead.

    Use as a context manager around tracing (it records the order in which batch-norm modules
    are called, to name them), then ``check_graph`` the traced module after the rewrite."""

    def __init__(self, model: torch.nn.Module, allow: bool = False) -> None:
        super().__init__(model, _BATCH_NORMS, active=not allow)
        self.order: list[str] = []  # the batch-norm modules called while tracing, in order

    def _called(self, module: torch.nn.Module, args: tuple) -> None:
        self.order.append(self.names[id(module)])

    def check_graph(self, gm: torch.fx.GraphModule) -> None:
        """Raise for the forward batch-norm nodes left on PyTorch's native kernels that eager
        PyTorch would run with cuDNN, naming their modules (each module call traces to one
        forward node, in order) or, with ``F.batch_norm`` called directly, the first node."""
        from remat.batch_norm import EAGER_FORWARD, NATIVE_EVAL

        if not self.active:  # allowed
            return
        forward = [n for n in gm.graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)
                   and "backward" not in str(n.target)]
        native = [i for i, n in enumerate(forward)
                  if n.target not in (EAGER_FORWARD, NATIVE_EVAL) and runs_cudnn_in_eager(n)]
        if not native:
            return
        if len(forward) == len(self.order):
            names = list(dict.fromkeys(self.order[i] for i in native))
            more = len(names) - 1
            what = _describe_module(self.model, names[0]) + (
                f" and {more} more batch-norm module{'s' if more > 1 else ''}" if more else "")
            verb = "run" if more else "runs"
        else:
            node = forward[native[0]]
            what = f"a batch norm ({node.target} at node {node.name!r}) in model {type(self.model).__name__}"
            verb = "runs"
        raise TraceError(
            f"{what} {verb} on CUDA with cuDNN on, where eager PyTorch uses cuDNN's batch-norm kernels, "
            f"but remat could not trace {'them' if verb == 'run' else 'it'} to the ops those kernels run "
            f"behind (a backward it could not match to its forward), so the traced step would run "
            f"PyTorch's native ones (as torch.compile does), which round differently, and remat's "
            f"gradients would not be eager's. Pass {ALLOW_OPTION} to accept the native kernels (torch.compile's "
            f"numerics); or trace and train under `torch.backends.cudnn.flags(enabled=False)` "
            f"(eager then runs the native kernels too, and remat equals it bitwise; convolutions get "
            f"slower); or compile the model with remat.backend"
        )


#: Names of tensor classes that code compares a tensor's exact class with.
_TENSOR_CLASSES = frozenset({"Tensor", "Parameter", "FloatTensor", "LongTensor", "BoolTensor"})
#: Comparisons that ask for an exact class (``isinstance`` asks for a class or its subclasses).
_CLASS_OPS = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def refuse_exact_tensor_classes(model: torch.nn.Module, loss_fn: object) -> None:
    """Refuse a step whose own code asks a tensor's exact class (``type(x) is torch.Tensor``,
    ``x.__class__ == nn.Parameter``, ``type(x).__name__ == "Tensor"``) or its address
    (``x.data_ptr()``): remat traces with stand-in tensors of another class and without
    storage, so such code takes another branch while traced than it does in eager PyTorch, and
    every step would run that branch, silently. Only the user's own code is read (the
    functions ``guards.step_functions`` finds whose source is at hand), not installed
    packages'."""
    from remat.guards import _installed, step_functions

    for f in step_functions(model, loss_fn):
        if _installed(f.__module__):
            continue
        found = _exact_class_use(f)
        if found is not None:
            line, text, address = found
            where = f"{f.__qualname__} at {_line_shown(f.__code__.co_filename, line)}"
            if address:
                raise TraceError(
                    f"{where} reads a tensor's address ({text}): remat traces the step with stand-in tensors "
                    f"that have no storage, so this code would see other addresses while traced than in eager "
                    f"PyTorch, and every step would run what it decided then; compare tensors by their values "
                    f"(or keep this check out of the model's forward and loss_fn), and optimize again")
            raise TraceError(
                f"{where} asks a tensor's exact class ({text}): remat traces the step with stand-in tensors of "
                f"another class, so this code would take another branch while traced than in eager PyTorch, and "
                f"every step would run that branch; write isinstance(x, torch.Tensor) (an nn.Parameter is a "
                f"torch.Tensor too; isinstance(x, nn.Parameter) for a parameter), and optimize again")


def _exact_class_use(f) -> tuple[int, str, bool] | None:
    """(line, source text, whether it reads an address) of the first place in ``f``'s source that
    asks a tensor's exact class or address (``refuse_exact_tensor_classes``); None if there is
    none or the source is not at hand."""
    try:
        lines, first = inspect.getsourcelines(f)
        source = textwrap.dedent("".join(lines))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    for node in ast.walk(tree):
        address = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "data_ptr"
        exact = isinstance(node, ast.Compare) and any(isinstance(op, _CLASS_OPS) for op in node.ops) and _asks_class(
            [node.left, *node.comparators])
        if address or exact:
            text = ast.get_source_segment(source, node) or "?"
            return first + node.lineno - 1, " ".join(text.split()), address
    return None


def _asks_class(operands: list[ast.expr]) -> bool:
    """Do ``operands`` of one comparison put a value's exact class (``type(x)``, ``x.__class__``)
    beside a tensor class (``torch.Tensor``, ``nn.Parameter``, a tuple of them), or its class's
    name beside a tensor class's name (``type(x).__name__ == "Tensor"``)?"""
    def class_of(e: ast.expr) -> bool:
        return (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "type" and len(e.args) == 1
                and not e.keywords) or (isinstance(e, ast.Attribute) and e.attr == "__class__")

    def tensor_class(e: ast.expr) -> bool:
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(tensor_class(x) for x in e.elts)
        return (isinstance(e, ast.Attribute) and e.attr in _TENSOR_CLASSES) or (
            isinstance(e, ast.Name) and e.id in _TENSOR_CLASSES)

    def name_of_class(e: ast.expr) -> bool:
        return isinstance(e, ast.Attribute) and e.attr in ("__name__", "__qualname__") and class_of(e.value)

    def tensor_name(e: ast.expr) -> bool:
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(tensor_name(x) for x in e.elts)
        return isinstance(e, ast.Constant) and e.value in _TENSOR_CLASSES

    return (any(class_of(e) for e in operands) and any(tensor_class(e) for e in operands)) or (
        any(name_of_class(e) for e in operands) and any(tensor_name(e) for e in operands))
