"""Kernel scratch memory: what an op allocates and frees again while it runs, beyond its outputs.

A node's ``temp_bytes`` (``graph.Node``) is this scratch: the simulator and the MILP hold it on
top of everything live while the node is computed. Many kernels need it: CPU dropout draws its
random numbers into a buffer the size of its input before it makes the mask; its backward
converts the mask into a temporary of the gradient's size; convolutions reorder or unfold their
operands. An allocation tracker that only sees op outputs cannot see any of it, yet it is real
memory at the peak (without it, a plan of the small CNN made for 311,610 B measured 322,184 B).

``ScratchModel.MEASURE`` runs the graph once on real inputs and reads each op's allocations:
on CPU the ``torch.profiler`` memory events inside the op (its peak minus what it still holds
when it returns, which is its outputs), on CUDA the caching allocator's peak statistics of
requested bytes (not of its blocks, whose sizes depend on what it had cached). It is
what ``CostModel.PROFILE`` uses. ``ScratchModel.ESTIMATE`` reads ``SCRATCH_RULES``: one rule
per op, written from what was measured on CPU kernels (the table says how close each rule
came). ``ScratchModel.NONE`` models no scratch at all.

Scratch depends on the kernel a shape selects and on the thread count (a few KiB), so a
measurement holds for the device and thread count it was taken at.
"""

from __future__ import annotations

import bisect
import enum
import logging
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

log = logging.getLogger("remat.scratch")

#: Prefix of the profiler ranges that mark one node's op.
_MARK = "remat::scratch::"


class ScratchModel(enum.Enum):
    MEASURE = "measure"  # run every op once on real tensors and read its allocations
    ESTIMATE = "estimate"  # per-op rules over the fake-tensor metadata (SCRATCH_RULES)
    NONE = "none"  # no scratch memory


def node_scratch(
    gm: fx.GraphModule,
    flat_inputs: Sequence[torch.Tensor],
    model: ScratchModel,
    *,
    skip: Iterable[str] = (),
    threads: int | None = None,
) -> dict[str, int]:
    """Scratch bytes of every ``call_function`` node of ``gm`` by node name (``skip``: nodes
    that allocate nothing, such as views, get 0)."""
    if model is ScratchModel.MEASURE:
        return measure(gm, flat_inputs, skip=skip, threads=threads)
    if model is ScratchModel.ESTIMATE:
        return estimate(gm, skip=skip)
    if model is ScratchModel.NONE:
        return {n.name: 0 for n in gm.graph.nodes if n.op == "call_function"}
    raise ValueError(f"scratch model {model!r} is not a ScratchModel; use ScratchModel.MEASURE, ESTIMATE or NONE")


# ---------------------------------------------------------------------------- measuring
class _Probe(fx.Interpreter):
    """Runs the graph and brackets every op worth measuring with a marker (CPU: a profiler
    range; CUDA: allocator statistics read around the call)."""

    def __init__(self, gm: fx.GraphModule, skip: frozenset[str], cuda: torch.device | None) -> None:
        super().__init__(gm)
        self.skip = skip
        self.cuda = cuda
        self.node: fx.Node | None = None
        self.cuda_scratch: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> object:
        self.node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        name = self.node.name
        if name in self.skip or not isinstance(target, torch._ops.OpOverload):
            return target(*args, **kwargs)
        if self.cuda is None:
            with torch.profiler.record_function(_MARK + name):
                return target(*args, **kwargs)
        torch.cuda.synchronize(self.cuda)
        before, _ = _requested_bytes(self.cuda)
        torch.cuda.reset_peak_memory_stats(self.cuda)
        result = target(*args, **kwargs)
        torch.cuda.synchronize(self.cuda)
        current, peak = _requested_bytes(self.cuda)
        self.cuda_scratch[name] = max(0, (peak - before) - max(current - before, 0))
        return result


def _requested_bytes(device: torch.device) -> tuple[int, int]:
    """The bytes the CUDA caching allocator's callers asked for, now and at the peak.

    Not its allocated bytes: a request served from a cached block too small to split counts
    that whole block (1.27 MiB asked, 2 MiB counted), so what an op seemed to allocate
    depended on what the allocator had cached before it ran, and one model traced twice in
    one process measured different scratch (FCN8 on an H200: 12 convolutions off by up to
    770 KiB) and stated a smallest budget a second trace could not meet. Outputs are counted
    as their tensors' bytes too.
    """
    stats = torch.cuda.memory_stats(device)
    if "requested_bytes.all.current" in stats:
        return stats["requested_bytes.all.current"], stats["requested_bytes.all.peak"]
    return stats["allocated_bytes.all.current"], stats["allocated_bytes.all.peak"]


def measure(
    gm: fx.GraphModule, flat_inputs: Sequence[torch.Tensor], *, skip: Iterable[str] = (), threads: int | None = None
) -> dict[str, int]:
    """Run ``gm`` once on ``flat_inputs`` (under ``torch.no_grad``, at ``threads`` threads) and
    return each op's scratch: the most it had allocated while running minus what it still
    held when it returned. The random state and thread count are restored afterwards.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> x = torch.randn(256, 256)
    >>> gm = make_fx(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0])(x)
    >>> measure(gm, [x])["native_dropout"] == x.numel() * 4   # its random draws, as floats
    True
    """
    from remat.memory import profiled_events

    device = next((t.device for t in tree_leaves(list(flat_inputs)) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    cuda = device if device.type == "cuda" else None
    probe = _Probe(gm, frozenset(skip), cuda)
    saved_threads = torch.get_num_threads()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        torch.set_num_threads(threads or saved_threads)
        with torch.no_grad():
            if cuda is not None:
                probe.run(*flat_inputs)
            else:
                memory, ranges = profiled_events(lambda: probe.run(*flat_inputs), _MARK)
    finally:
        torch.set_num_threads(saved_threads)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
    scratch = {n.name: 0 for n in gm.graph.nodes if n.op == "call_function"}
    if cuda is not None:
        scratch.update(probe.cuda_scratch)
        return scratch
    starts = [t for t, _ in memory]
    for name, (begin, end) in ranges.items():
        live = peak = 0
        for _, nbytes in memory[bisect.bisect_left(starts, begin) : bisect.bisect_right(starts, end)]:
            live += nbytes
            peak = max(peak, live)
        scratch[name] = max(0, peak - max(live, 0))
    return scratch


# ---------------------------------------------------------------------------- estimating
def _val(a: object) -> object:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _nbytes(t: object) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _noncontiguous_bytes(*tensors: object) -> int:
    """What making the non-contiguous ones contiguous copies."""
    return sum(_nbytes(t) for t in tensors if isinstance(t, torch.Tensor) and not t.is_contiguous())


def _columns_bytes(inp: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> int:
    """One sample's unfolded input (im2col): what the non-oneDNN convolution kernels build; in
    bfloat16 and float16 every sample's at once (a bfloat16 convolution of 4 samples measured
    4,718,592 B of scratch, four samples' columns, where one sample's were counted: plans made
    with estimated scratch measured up to 43% over their budget under bfloat16 autocast)."""
    if inp.dim() < 3:
        return 0
    one = inp.shape[1] * math.prod(weight.shape[2:]) * math.prod(out.shape[2:]) * out.element_size()
    return one * inp.shape[0] if out.dtype in (torch.bfloat16, torch.float16) else one


def _dropout(args: list) -> int:
    train = args[2] if len(args) > 2 else None
    return 0 if train is False else _nbytes(args[0])


def _safe_softmax(args: list) -> int:
    x, dim = args[0], args[1] if len(args) > 1 else -1
    rows = x.numel() // max(1, x.shape[dim]) if x.dim() else 1
    return x.numel() + rows  # a bool per element (masked?) and per row (all masked?)


def _layer_norm_backward(args: list) -> int:
    grad, inp, shape, weight = args[0], args[1], args[2], args[5] if len(args) > 5 else None
    accumulators = 2 * math.prod(shape) * 4 if weight is None else 2 * _nbytes(weight)
    return accumulators + _noncontiguous_bytes(grad, inp)


def _batch_norm_stats(args: list) -> int:
    x = args[0]
    return 2 * (x.shape[1] if x.dim() > 1 else 1) * 4  # float mean and variance accumulators


def _convolution(args: list, out: torch.Tensor) -> int:
    inp, weight = args[0], args[1]
    return _nbytes(inp) + 2 * _nbytes(weight) + _nbytes(out) + _columns_bytes(inp, weight, out)


def _convolution_backward(args: list) -> int:
    grad, inp, weight = args[0], args[1], args[2]
    return 2 * (_nbytes(grad) + _nbytes(inp) + _nbytes(weight)) + _columns_bytes(inp, weight, grad)


def _embedding_backward(args: list) -> int:
    return args[1].numel() * 8  # the indices, sorted as int64


#: The upsampling ops (forward; both overloads: output size, or scale factors).
UPSAMPLE_OPS = tuple(
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
                 "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
                 "upsample_bicubic2d", "upsample_trilinear3d")
    for overload in ("default", "vec")
)

#: Their backward ops, and the other ops whose kernels copy a non-contiguous operand first.
CONTIGUOUS_OPS = tuple(
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
                 "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
                 "_upsample_nearest_exact3d_backward", "upsample_linear1d_backward", "upsample_bilinear2d_backward",
                 "upsample_bicubic2d_backward", "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward",
                 "_upsample_bicubic2d_aa_backward", "col2im", "_fft_r2c", "_fft_c2r", "_fft_c2c")
    for overload in ("default", "vec") if hasattr(getattr(torch.ops.aten, name), overload)
)

#: The elementwise losses whose kernels compute the unreduced loss before reducing it.
REDUCED_LOSS_OPS = (torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
                    torch.ops.aten.huber_loss.default)


def _reduced_loss(args: list) -> int:
    reduction = args[2] if len(args) > 2 else 1  # (0: none, 1: mean, 2: sum)
    return 0 if reduction == 0 else _nbytes(args[0])


def _multinomial(args: list, out: torch.Tensor) -> int:
    probs, replacement = args[0], len(args) > 2 and bool(args[2])
    rows = probs.shape[0] if probs.dim() > 1 else 1
    return 64 * rows + 256 if replacement else _nbytes(probs) + _nbytes(out)


def _promoted_copies(args: list, out: object) -> int:
    """A pointwise op given operands of several dtypes (``x * mask`` with a bool mask, a float
    compared with an int64 tensor) copies each operand whose dtype is not the promoted one into
    that dtype first (``where``'s condition aside)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len({t.dtype for t in tensors}) < 2:
        return 0
    if len(tensors) == 3 and tensors[0] is args[0] and tensors[0].dtype == torch.bool:  # where(condition, a, b)
        tensors = tensors[1:]
    if len(tensors) != 2:
        return 0
    common = torch.result_type(*tensors)  # (a 0-dim operand of the same kind promotes nothing)
    size = torch.empty((), dtype=common, device="meta").element_size()
    return sum(t.numel() * size for t in tensors if t.dtype != common)


#: Scratch bytes of an op on CPU, from its argument and output fake tensors. Each rule is what
#: torch 2.13's CPU kernel was measured to allocate (``measure``) on BERT, GPT-2, ConvNext,
#: ResNet-50, MobileNet and small CNNs, exact to a few bytes unless noted:
#:
#: - ``native_dropout``: its random draws, the size of the input (then turned into the mask).
#: - ``native_dropout_backward``: the mask converted to the gradient's dtype.
#: - ``_safe_softmax``: a bool per element and per row (rows that are masked out entirely).
#: - ``native_layer_norm``: a contiguous copy of a non-contiguous input (channels-last
#:   ConvNext blocks); its backward: two float accumulators of the normalized size, plus
#:   contiguous copies.
#: - batch norm (native or ``remat.batch_norm``'s eager ops): its backward, a temporary of the
#:   input's size; its forward, two float accumulators per channel.
#: - ``convolution`` and its backward: the kernel depends on the shapes (oneDNN reorders its
#:   operands and result, the fallback unfolds one sample at a time, depthwise kernels unfold
#:   every channel), so the rule is a cover of all of them: operands, result (the weight
#:   twice) and one unfolded sample; the backward counts its operands twice. It was never
#:   below what was measured on those models, and 1.1-4x above it where the kernel needed
#:   scratch; kernels that needed none (1x1 convolutions through oneDNN) are over-estimated
#:   by all of it. Measure (``CostModel.PROFILE`` or ``ScratchModel.MEASURE``) to plan tight.
#: - upsampling (nearest, linear, cubic): the kernel may run on channels-last copies of its input
#:   and output (small images: on ``(1, 512, 26, 38)`` it allocated both, 5x the input; on
#:   ``(1, 512, 52, 76)`` nothing), so the rule is the cover, input and output; the backward
#:   allocated nothing given a contiguous gradient (``CONTIGUOUS_OPS`` below).
#: - ``embedding``: a contiguous copy of non-contiguous indices (an expanded ``token_type_ids``);
#:   its backward sorts the indices as int64.
#: - ``CONTIGUOUS_OPS`` (the upsampling backwards, ``col2im``, the FFTs): a contiguous copy of
#:   a non-contiguous operand, such as the gradient of a transposed output (``F.unfold``
#:   feeding a ``Linear``: 4.7 MB for ``col2im``) or of a sum (an expanded tensor); given
#:   contiguous operands they allocated nothing. (The FFTs copied an expanded gradient but
#:   read a transposed one in place: the rule counts both.)
#: - ``im2col``: the size of its input (twice that for a non-contiguous one); the antialiased upsamplings: about half their input
#:   plus their weights (the rule: the input).
#: - ``mse_loss``, ``smooth_l1_loss``, ``huber_loss`` reduced: the unreduced loss, the size of
#:   the input.
#: - ``affine_grid_generator``: its base grid, 1.5 times its output.
#: - ``multinomial``: without replacement, up to a copy of the probabilities (on 32-320
#:   categories; on 32, 128 bytes in all; the rule: the probabilities and the output); with
#:   it, up to 40 bytes per row and 256 (the rule: 64 per row and 256).
#:
#: - pointwise ops given operands of several dtypes (``_promoted_copies``): a copy of each operand
#:   not of the promoted dtype, in that dtype (``x * mask``, a bool mask: the mask as floats).
#:
#: Every other op: 0 (elementwise ops of one dtype, matmuls, reductions and views measured
#: nothing but the 8-16 bytes of a wrapped Python scalar).
SCRATCH_RULES: dict[object, Callable[[list, object], int]] = {
    torch.ops.aten.native_dropout.default: lambda a, out: _dropout(a),
    torch.ops.aten.native_dropout_backward.default: lambda a, out: _nbytes(a[0]),
    torch.ops.aten._safe_softmax.default: lambda a, out: _safe_softmax(a),
    torch.ops.aten.native_layer_norm.default: lambda a, out: _noncontiguous_bytes(a[0]),
    torch.ops.aten.native_layer_norm_backward.default: lambda a, out: _layer_norm_backward(a),
    torch.ops.aten.native_batch_norm_backward.default: lambda a, out: _nbytes(a[1]),
    torch.ops.aten.batch_norm_backward.default: lambda a, out: _nbytes(a[1]),
    torch.ops.aten._batch_norm_with_update_functional.default: lambda a, out: _batch_norm_stats(a),
    torch.ops.aten._native_batch_norm_legit_functional.default: lambda a, out: _batch_norm_stats(a),
    torch.ops.aten._native_batch_norm_legit.default: lambda a, out: _batch_norm_stats(a),
    torch.ops.aten._native_batch_norm_legit_no_training.default: lambda a, out: 0,
    torch.ops.aten.convolution.default: lambda a, out: _convolution(a, out),
    torch.ops.aten.convolution_backward.default: lambda a, out: _convolution_backward(a),
    torch.ops.aten.embedding.default: lambda a, out: _noncontiguous_bytes(a[1]),
    **{op: (lambda a, out: _nbytes(a[0]) + _nbytes(out)) for op in UPSAMPLE_OPS},
    torch.ops.aten.embedding_dense_backward.default: lambda a, out: _embedding_backward(a),
    **{op: (lambda a, out: _noncontiguous_bytes(*a)) for op in CONTIGUOUS_OPS},
    torch.ops.aten.im2col.default: lambda a, out: _nbytes(a[0]) + _noncontiguous_bytes(a[0]),
    torch.ops.aten._upsample_bilinear2d_aa.default: lambda a, out: _nbytes(a[0]),
    torch.ops.aten._upsample_bicubic2d_aa.default: lambda a, out: _nbytes(a[0]),
    **{op: (lambda a, out: _reduced_loss(a)) for op in REDUCED_LOSS_OPS},
    torch.ops.aten.affine_grid_generator.default: lambda a, out: 3 * _nbytes(out) // 2,
    torch.ops.aten.multinomial.default: lambda a, out: _multinomial(a, out),
}


def estimate(gm: fx.GraphModule, *, skip: Iterable[str] = ()) -> dict[str, int]:
    """Scratch bytes of every node from ``SCRATCH_RULES`` (no run). The rules describe CPU
    kernels: nodes on another device get 0.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0], tracing_mode="fake")(torch.randn(64, 64))
    >>> estimate(gm)["native_dropout"]
    16384
    """
    skipped = frozenset(skip)
    scratch: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        rule = SCRATCH_RULES.get(n.target)
        if rule is None and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags:
            rule = _promoted_copies
        out = n.meta.get("val")
        devices = {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        if n.name in skipped or devices != {"cpu"}:
            scratch[n.name] = 0
            continue
        small = SMALL_SCRATCH if _makes_small_tensors(n) else 0
        if rule is None:
            scratch[n.name] = small
            continue
        args = [_val(a) if not isinstance(a, (list, tuple)) else [_val(x) for x in a] for a in n.args]
        try:
            scratch[n.name] = int(rule(args, out)) + small
        except Exception as exc:  # a rule that does not fit an unusual overload: no estimate
            log.debug("scratch rule for %s (%s) failed: %s", n.name, n.target, exc)
            scratch[n.name] = small
    return scratch


#: What a kernel allocates beside its output for a Python number among its arguments (it is
#: wrapped in a 0-dim tensor: 8 B, measured on ``add`` of batch norm's counter) or for a
#: reduction's result (``mean``, ``div`` by the count: 12 B measured). Counted as nothing, the
#: smallest budget of a CNN planned with estimated scratch measured 12 B over.
SMALL_SCRATCH = 16
_AVERAGES = frozenset({"mean", "var", "std", "var_mean", "std_mean"})
_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "rsub", "pow", "remainder", "fmod", "true_divide",
                         "floor_divide", "native_dropout_backward"})  # (the last: its scale, 12 B measured)


def _makes_small_tensors(n: fx.Node) -> bool:
    """Does ``n``'s kernel wrap a Python number in a tensor (arithmetic with one: ``add(t, 1)``,
    ``div(t, 64)``), or average (a sum divided by the count)?"""
    target = n.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target.__name__.split(".")[0]
    return name in _AVERAGES or (name in _ARITHMETIC and any(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in n.args))
