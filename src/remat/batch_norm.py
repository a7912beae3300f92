"""Batch norms that run eager PyTorch's kernels in a traced step.

Tracing turns a training-mode batch norm into ``_native_batch_norm_legit_functional`` and its
backward into ``native_batch_norm_backward``: PyTorch's native kernels, whatever the device.
Eager PyTorch on a CUDA device with cuDNN on runs cuDNN's batch norm instead
(``cudnn_batch_norm``), whose reductions round differently, so the traced step's gradients would
not be eager's (measured on a GPU: ResNet50's first convolution's weight gradient 39% apart in
norm).

``use_eager_kernels`` rewrites each such forward/backward pair into
``_batch_norm_with_update_functional`` and ``batch_norm_backward``: the ops that pick their
backend the way eager's batch norm does (``torch._C._select_batch_norm_backend``: cuDNN on CUDA
when it is on and the norm is affine with ``eps`` at least 1e-5, the native kernels otherwise)
and pass cuDNN's reserve space from the forward to the backward. On a CPU both ops run the same
native kernels as before, bitwise.

Rewritten: a batch norm in training mode with a weight: with running statistics (every
``nn.BatchNorm*`` by default) or without them (``track_running_stats=False``, and instance
norms, which trace to a batch norm over the reshaped input). The latter traces to
``_native_batch_norm_legit.no_stats``; eager's ops need running statistics, so it is given new
ones (zeros and ones, a few bytes per channel) whose update nothing reads: the normalization
uses the batch's statistics either way. Measured on an H100, the rewritten forward and backward
are bitwise eager's cuDNN kernels, while the native ones differ by 1e-6.

Left as traced: a norm in eval mode (``_native_batch_norm_legit_no_training``), whose native
forward measured bitwise cuDNN's on an H100 (eager's eval-mode backward is PyTorch's native one
anyway), and a norm without weight, which eager runs natively too.
``remat.trace_errors.BatchNormWatch`` refuses what is left on the native kernels and eager
would run with cuDNN.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves, tree_map

from remat.graph import NodeKind

_aten = torch.ops.aten
NATIVE_FORWARD = _aten._native_batch_norm_legit_functional.default
NATIVE_NO_STATS = _aten._native_batch_norm_legit.no_stats
NATIVE_EVAL = _aten._native_batch_norm_legit_no_training.default
NATIVE_BACKWARD = _aten.native_batch_norm_backward.default
EAGER_FORWARD = _aten._batch_norm_with_update_functional.default
EAGER_BACKWARD = _aten.batch_norm_backward.default
# outputs: native (out, save_mean, save_rstd, new_running_mean, new_running_var), no_stats the first three;
#          eager  (out, save_mean, save_rstd, reserve, new_running_mean, new_running_var)
_OUTPUT_INDEX = {0: 0, 1: 1, 2: 2, 3: 4, 4: 5}
_RESERVE = 3
_PASS_THROUGH = frozenset({_aten.clone.default, _aten.detach.default, _aten.alias.default})


def _source(n: object) -> object:
    """The node ``n`` copies or aliases, through clones and detaches."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _PASS_THROUGH:
        n = n.args[0]
    return n


def _statistic(n: object) -> tuple[fx.Node, int] | None:
    """(forward node, output index) when ``n`` is an output of a native batch-norm forward."""
    n = _source(n)
    if isinstance(n, fx.Node) and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        if n.args[0].target in (NATIVE_FORWARD, NATIVE_NO_STATS):
            return n.args[0], n.args[1]
    return None


def use_eager_kernels(gm: fx.GraphModule, kinds: dict[str, NodeKind]) -> list[str]:
    """Rewrite, in place, every training-mode batch norm with a weight (with running statistics
    or without) whose backward nodes can all be matched to it (through their saved mean and inverse std)
    to the ops eager PyTorch's kernels run behind; ``kinds`` gets the kind of each node added.
    Returns the names of the rewritten forward nodes. Call ``gm.recompile()`` afterwards."""
    backwards: dict[fx.Node, list[fx.Node]] = {}
    unmatched: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is NATIVE_BACKWARD:
            mean, rstd = _statistic(n.args[5]), _statistic(n.args[6])
            if mean is None or rstd is None or mean[0] is not rstd[0] or (mean[1], rstd[1]) != (1, 2):
                for stat in (mean, rstd):  # a backward of unknown origin: leave its forward alone
                    if stat is not None:
                        unmatched.add(stat[0])
                continue
            backwards.setdefault(mean[0], []).append(n)
    rewritten = []
    for fwd in list(gm.graph.nodes):
        if fwd.op != "call_function" or fwd.target not in (NATIVE_FORWARD, NATIVE_NO_STATS) or fwd in unmatched:
            continue
        if fwd.target is NATIVE_FORWARD:
            x, weight, bias, running_mean, running_var, training, momentum, eps = fwd.args
        else:
            (x, weight, bias, training, momentum, eps), running_mean, running_var = fwd.args, None, None
        if not training or weight is None:
            continue
        if any(u.target is not operator.getitem for u in fwd.users):
            continue
        with gm.graph.inserting_before(fwd):
            if running_mean is None:  # statistics for eager's op to update; nothing reads them
                running_mean, running_var = (_new_statistic(gm, weight, fill, kinds, fwd) for fill in (0.0, 1.0))
            eager = gm.graph.call_function(EAGER_FORWARD, (x, weight, bias, running_mean, running_var, momentum, eps))
        kinds[eager.name] = kinds.get(fwd.name, NodeKind.FORWARD)
        _set_fake_value(eager)
        for get in list(fwd.users):
            get.args = (eager, _OUTPUT_INDEX[get.args[1]])
            _set_fake_value(get)
        gm.graph.erase_node(fwd)
        if backwards.get(fwd):
            with gm.graph.inserting_after(eager):
                reserve = gm.graph.call_function(operator.getitem, (eager, _RESERVE))
            kinds[reserve.name] = kinds[eager.name]
            _set_fake_value(reserve)
            for bwd in backwards[fwd]:
                grad, inp, w, rm, rv, mean, rstd, _train, bwd_eps, mask = bwd.args
                with gm.graph.inserting_before(bwd):
                    new = gm.graph.call_function(EAGER_BACKWARD, (grad, inp, w, rm, rv, mean, rstd, True, bwd_eps, mask, reserve))
                kinds[new.name] = kinds.get(bwd.name, NodeKind.BACKWARD)
                _set_fake_value(new)
                bwd.replace_all_uses_with(new)
                for get in new.users:
                    _set_fake_value(get)
                gm.graph.erase_node(bwd)
        rewritten.append(eager.name)
    return rewritten


def _new_statistic(gm: fx.GraphModule, weight: fx.Node, fill: float, kinds: dict[str, NodeKind],
                   fwd: fx.Node) -> fx.Node:
    """A new per-channel tensor filled with ``fill``, shaped, typed and placed as ``weight``."""
    w = weight.meta["val"]
    node = gm.graph.call_function(_aten.full.default, ([w.shape[0]], fill),
                                  {"dtype": w.dtype, "device": w.device, "pin_memory": False})
    kinds[node.name] = kinds.get(fwd.name, NodeKind.FORWARD)
    mode = detect_fake_mode([w])  # the call has no tensor input to find the trace's fake mode by
    if mode is not None:
        with mode:
            node.meta["val"] = node.target(*node.args, **node.kwargs)
    return node


def _set_fake_value(n: fx.Node) -> None:
    """Give a node the trace added its fake value (``meta["val"]``), as the tracer gives the
    others, from its inputs' (nothing when they have none)."""
    args = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, n.args)
    if n.target is operator.getitem:
        if isinstance(args[0], (tuple, list)):
            n.meta["val"] = args[0][args[1]]
        return
    mode = detect_fake_mode(tree_leaves(args))
    if mode is not None:
        with mode:
            n.meta["val"] = n.target(*args)
