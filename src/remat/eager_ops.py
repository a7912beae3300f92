"""Tracing a step so that it runs what eager PyTorch runs.

``trace`` records the step with ``make_fx`` under the python dispatcher, which applies PyTorch's
Python decompositions (written for compilers) and turns autocast's cast cache off. Where that
would make the traced step compute something else than eager PyTorch, this module restores
eager's behaviour while tracing:

* **Upsampling** (``upsample_*``): decomposed, it became indexing and, backward, an accumulating
  ``index_put`` (same values on a CPU; on a GPU the two upsampling models, VGG-U-Net and SegNet,
  ran 1.5-1.9x eager with it). Its decompositions are suspended, so it traces as itself.
* **Dropout in half precision off CUDA**: eager PyTorch draws a noise tensor in the input's
  dtype, divides it by ``1 - p`` and multiplies (``at::_dropout``); the decomposition calls
  ``native_dropout``, which scales in float, so a bfloat16 or float16 step rounded differently
  whenever ``1 / (1 - p)`` is not exact there (p = 0.1: about 1e-3 on a gradient). Such a call
  traces to eager's arithmetic, its noise drawn in eager's element order (``_noise_like``); on
  CUDA (eager's fused ``native_dropout``) and in float32 and float64 (bitwise equal) the
  decomposition stays.
* **Autocast's cast cache**: eager casts a parameter once per autocast region and reuses the
  copy, so the gradients of its uses add up in the low precision before one cast back; traced
  with the cache off, each use cast on its own and the gradients added up in float32. The cache
  is on while the step runs (as the user had it), so the trace shares the cast as eager does.
* **The model's own activation checkpointing** (``torch.utils.checkpoint``, as Hugging Face's
  ``gradient_checkpointing_enable()`` uses it): it recomputes a block in the backward pass, out
  of the trace's reach (the non-reentrant kind met the real parameters there and failed; the
  reentrant kind cut the trace). A checkpointed call traces as a plain call: the recomputation
  gives the values the first computation gave, so the gradients are eager's, and remat's plan
  decides what to recompute (a reentrant one's inputs enter through a view each, so that their
  gradients are summed in eager's order: the block's uses first; a parameter read inside a
  reentrant call and outside it, whose gradient eager accumulates in parts, is refused). One exception keeps eager's behaviour: a reentrant checkpoint
  none of whose tensor inputs requires grad gives the parameters inside it no gradient in eager
  PyTorch (with a warning), so it traces under ``no_grad`` to the same effect. A checkpoint with
  ``preserve_rng_state=False`` around random ops is refused: eager's recomputation draws other
  numbers (another dropout mask), which a plain call does not.
* **Branches on values that depend on no input** (transformers' packed-sequence check): model
  code that tests a tensor's values takes its general branch when the tensor is being traced,
  since a traced step must serve every batch. Where the tensor depends on no input of the step
  (transformers' default position ids, ``arange(sequence)``), its value is the same in every
  step, so it is computed for real (``constant_value``) and the branch eager PyTorch takes is
  taken. transformers' ``find_packed_sequence_indices`` is such a check: traced, every causal
  language model built its attention mask explicitly instead of passing ``is_causal=True`` to
  SDPA, and its gradients differed from eager's in the last bits (Mistral with
  ``use_cache=False``: 7e-9 in float32, 1e-4 under bfloat16 autocast).
  transformers' check whether an attention mask can be skipped is answered the same way when
  the mask depends on no input. When the checked tensor is computed from the batch (an
  ``attention_mask`` or ``position_ids`` the batch carries), the check is answered for the
  example batch and recorded as a ``BranchPoint``, which the step answers again for each batch
  it runs.
  PyTorch's ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` make the same kind of check
  when ``is_causal`` is not given: is the mask causal? With the tutorials' mask,
  ``generate_square_subsequent_mask(n)``, which depends on no input, eager says yes and runs
  SDPA with ``is_causal=True``; the step was refused instead, and now does as eager does.
* **Grouped matrix products on the CPU** (``aten._grouped_mm``, what transformers' mixture-of-
  experts layers call by default, ``experts_implementation="grouped_mm"``): PyTorch's fake
  kernel is the CUDA kernel's, which takes bfloat16 alone, while the CPU kernel eager runs
  takes float32 too; so a float32 Mixtral or Qwen2-MoE ran eagerly and could not be traced.
  While tracing, a CPU (or meta) call gets the CPU kernel's output (``_cpu_grouped_mm``:
  contiguous, of the inputs' dtype or ``out_dtype``); the traced step runs the same kernel as
  eager. Other devices keep PyTorch's fake kernel.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch._C import DispatchKey
from torch.fx.experimental import proxy_tensor

from remat.errors import TraceError
from remat.fx_graph import is_random
from remat.scratch import UPSAMPLE_OPS

#: Ops whose Python decompositions are suspended while tracing: they trace as themselves.
#: Upsampling's decomposition is slower than eager's kernels and, for bilinear, rounds
#: differently; the margin losses' are other functions: ``multilabel_margin_loss`` gave 7.50
#: where eager gives 1.78 (targets ending in -1), ``multi_margin_loss`` a loss 1 ulp apart.
EAGER_KERNEL_OPS = (*UPSAMPLE_OPS, torch.ops.aten.multilabel_margin_loss_forward.default,
                    torch.ops.aten.multi_margin_loss.default)
#: The python dispatcher's keys at which PyTorch registers those decompositions.
_DECOMPOSING_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
#: Devices on which eager PyTorch's dropout calls the fused ``native_dropout`` kernel.
_FUSED_DROPOUT_DEVICES = frozenset({"cuda", "xpu", "lazy", "privateuseone"})
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _eager_dropout(decomposed: Callable) -> Callable:
    """``aten.dropout`` as eager PyTorch computes it where that is not ``decomposed``'s
    ``native_dropout``: half precision off the fused devices (``at::_dropout``)."""

    def dropout(x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
        if (train and 0 < p < 1 and x.numel() > 0 and x.dtype in _HALF_DTYPES
                and x.device.type not in _FUSED_DROPOUT_DEVICES):
            noise = _noise_like(x, 1 - p)
            noise.div_(1 - p)
            return x * noise
        return decomposed(x, p, train)

    return dropout


def _noise_like(x: torch.Tensor, keep: float) -> torch.Tensor:
    """Eager dropout's noise for ``x``: ``torch.empty_like(x).bernoulli_(keep)``, drawn as eager
    draws it. Eager draws in place, in memory order; functionalized, the draw becomes the
    out-of-place ``bernoulli``, whose result is contiguous, so for a transposed ``x`` (attention's
    output) the draws landed on other elements. So the draw goes into a contiguous tensor holding
    ``empty_like(x)``'s memory order, then permuted to its layout."""
    like = torch.empty_like(x)
    order = sorted(range(like.dim()), key=lambda d: (like.stride(d), like.size(d)), reverse=True)
    base = torch.empty([like.size(d) for d in order], dtype=x.dtype, device=x.device).bernoulli_(keep)
    return base.permute([order.index(d) for d in range(like.dim())])


@contextlib.contextmanager
def _replaced_py_kernels(replacements: dict[torch._ops.OpOverload, Callable | None]) -> Iterator[None]:
    """While in use, each op's Python kernels at ``_DECOMPOSING_KEYS`` are removed (None) or
    replaced by ``replacement(original)``; restored afterwards, whatever happens."""
    saved = []
    try:
        for op, replacement in replacements.items():
            for key in _DECOMPOSING_KEYS:
                if key in op.py_kernels:
                    original = op.py_kernels.pop(key)
                    saved.append((op, key, original))
                    if replacement is not None:
                        op.py_kernels[key] = replacement(original)
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, original in saved:
            op.py_kernels[key] = original
        for op in replacements:
            op._dispatch_cache.clear()


class _PlainReentrantCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` while tracing.

    Eager's reentrant checkpoint is one autograd node: its backward runs the block's own
    backward and hands each input one gradient, the sum of the block's uses of it, which the
    engine then adds to the input's uses outside. A plain call summed all of them in one go, in
    another order: ``h + checkpoint(blocks, h)`` whose blocks are residual themselves (``x +
    f(x)``) gave gradients 1e-10 from eager's. So each input that requires grad enters the block
    through a view of its own, where the block's uses are summed first, as in eager."""

    @staticmethod
    def apply(function: Callable, preserve_rng_state: bool, *args: object) -> object:
        start = _traced_count()
        grads = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if grads:
            args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
            inner = _traced_count()
            result = function(*args)
        else:
            warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=3)
            inner = _traced_count()
            with torch.no_grad():  # as eager: no input requires grad, so nothing inside gets a gradient
                result = function(*args)
        if _reentrant_blocks is not None:
            _reentrant_blocks.append(ReentrantBlock(_name_of(function), _traced_names(inner), grads))
        if not preserve_rng_state:
            _refuse_random_since(start, function)
        _record_writes_since(start, function)
        return result


@dataclass(frozen=True)
class ReentrantBlock:
    """One call of a reentrant checkpoint while tracing: the function's name, the names of the
    nodes its computation traced (not the views its inputs enter through), and whether it
    computed gradients (some tensor input required grad)."""

    name: str
    nodes: frozenset[str]
    grads: bool


#: The reentrant checkpoint calls of the trace being recorded (``recording_reentrant_blocks``).
_reentrant_blocks: list[ReentrantBlock] | None = None


def traced_reentrant_blocks() -> list[ReentrantBlock]:
    """The reentrant checkpoint calls recorded so far (none outside ``recording_reentrant_blocks``)."""
    return list(_reentrant_blocks or ())


@contextlib.contextmanager
def recording_reentrant_blocks() -> Iterator[list[ReentrantBlock]]:
    """While in use, each reentrant checkpoint call traced is appended to the list it yields."""
    global _reentrant_blocks
    saved, _reentrant_blocks = _reentrant_blocks, []
    try:
        yield _reentrant_blocks
    finally:
        _reentrant_blocks = saved


def refuse_leaves_shared_across_reentrant_blocks(gm: torch.fx.GraphModule, blocks: list[ReentrantBlock],
                                                 leaves: dict[str, str], backward: set[str]) -> None:
    """Refuse a parameter (or batch input) that requires grad and is read by the forward pass
    both inside a reentrant checkpoint and outside it, or inside two of its calls.

    Eager PyTorch's reentrant checkpoint runs the block's backward in an engine of its own,
    which adds the block's gradient of such a tensor into its ``.grad`` there and then: the
    gradient is accumulated once per place (the uses outside, then each call), where a traced
    step adds all its uses together, in another order (last bits apart; a block reading a
    weight twice inside and twice outside measured 5e-10). Tensors passed to the checkpoint
    as arguments are not affected (their gradient is handed back to the outer backward, as
    traced). ``leaves``: placeholder name -> what it is (a parameter's name); ``backward``: the
    names of the nodes the backward pass traced."""
    if not blocks:
        return
    by_size = sorted(blocks, key=lambda b: len(b.nodes))  # the innermost call holding a node first
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name not in leaves:
            continue
        places: dict[int, str] = {}
        for user in node.users:
            if user.name in backward:
                continue
            block = next((b for b in by_size if user.name in b.nodes), None)
            if block is not None and not block.grads:
                continue  # (under no_grad, as eager: no gradient from there)
            places.setdefault(-1 if block is None else id(block), "outside" if block is None else block.name)
        if len(places) >= 2:
            where = sorted(set(places.values()))
            raise TraceError(
                f"{leaves[node.name]} is read both inside a reentrant torch.utils.checkpoint "
                f"({', '.join(w for w in where if w != 'outside')}) and "
                f"{'outside it' if 'outside' in where else 'in another call of it'}: eager PyTorch adds the "
                f"block's gradient of it into its .grad separately, in an order a traced step does not "
                f"reproduce bit for bit; use torch.utils.checkpoint(..., use_reentrant=False), which remat traces "
                f"exactly, or pass the tensor to the checkpointed function as an argument"
            )


def _name_of(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def _traced_names(start: int) -> frozenset[str]:
    """The names of the nodes traced since node ``start``."""
    mode = proxy_tensor.get_proxy_mode()
    return frozenset() if mode is None else frozenset(n.name for n in list(mode.tracer.graph.nodes)[start:])


def _plain_checkpoint_generator(fn: Callable, preserve_rng_state: bool = True, *args: object,
                                **kwargs: object) -> Iterator[None]:
    """Stands in for ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``: what
    ``checkpoint`` runs before (the first ``next``) and after the function: nothing."""
    start = _traced_count()
    yield
    if not preserve_rng_state:
        _refuse_random_since(start, fn)
    _record_writes_since(start, fn)


#: (checkpointed function's name, names of the step's inputs it modified in place) of each
#: checkpoint call of the trace being recorded (``recording_checkpoint_writes``)
_checkpoint_writes: list[tuple[str, tuple[str, ...]]] | None = None


@contextlib.contextmanager
def recording_checkpoint_writes() -> Iterator[list[tuple[str, tuple[str, ...]]]]:
    """While in use, each checkpoint call traced that modifies an input of the step in place (a
    batch norm's running statistics, a counter buffer) is appended to the list it yields, as
    (the function's name, the placeholders it modified). Eager PyTorch's backward runs such a
    block again and modifies them a second time (a batch norm's ``num_batches_tracked`` counts
    2 per step, its running statistics take the batch's twice), which a plain call does not."""
    global _checkpoint_writes
    saved, _checkpoint_writes = _checkpoint_writes, []
    try:
        yield _checkpoint_writes
    finally:
        _checkpoint_writes = saved


def _record_writes_since(start: int, function: Callable) -> None:
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or _checkpoint_writes is None:
        return
    written: list[str] = []
    for node in list(mode.tracer.graph.nodes)[start:]:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, node.args):
            if (arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node)
                    and value.op == "placeholder" and value.name not in written):
                written.append(value.name)
    if written:
        _checkpoint_writes.append((_name_of(function), tuple(written)))


def _traced_count() -> int:
    mode = proxy_tensor.get_proxy_mode()
    return len(mode.tracer.graph.nodes) if mode is not None else 0


def _refuse_random_since(start: int, function: Callable) -> None:
    """Refuse random ops traced since node ``start`` inside a checkpoint that does not preserve
    the random state: eager's backward recomputes them with other numbers (a new dropout mask,
    and the generator advanced further), which a traced checkpoint, a plain call, does not (the
    gradients were 0.08 apart, silently)."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return
    drawn = [n for n in list(mode.tracer.graph.nodes)[start:] if is_random(n)]
    if drawn:
        name = _name_of(function)
        raise TraceError(
            f"torch.utils.checkpoint({name}, preserve_rng_state=False) draws random numbers ({drawn[0].target}): "
            f"eager PyTorch's backward recomputes them with other numbers (another dropout mask), which "
            f"remat's plan does not reproduce; pass preserve_rng_state=True (checkpoint's default), with which "
            f"the recomputation draws the same numbers and remat's gradients are eager's"
        )


@contextlib.contextmanager
def _replaced_attributes(module: object, replacements: dict[str, Callable[[object], object]]) -> Iterator[None]:
    """While in use, each attribute ``name`` of ``module`` that exists is ``replacement(original)``;
    restored afterwards, whatever happens."""
    saved = {name: getattr(module, name) for name in replacements if hasattr(module, name)}
    try:
        for name, original in saved.items():
            setattr(module, name, replacements[name](original))
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


def _plain_checkpoints() -> contextlib.AbstractContextManager[None]:
    """``torch.utils.checkpoint.checkpoint`` calls the function plainly while in use. The module's
    helpers are replaced, not ``checkpoint`` itself, which models bind at import."""
    import torch.utils.checkpoint as checkpoint_module

    return _replaced_attributes(checkpoint_module, {
        "CheckpointFunction": lambda _original: _PlainReentrantCheckpoint,
        "_checkpoint_without_reentrant_generator": lambda _original: _plain_checkpoint_generator})


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """While in use, the trace's modes are set aside: tensors made are real, nothing is recorded."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), unset_fake_temporarily(), torch.no_grad():
        yield


#: Ops whose value is a fill of a shape their tensor input only lends (with its dtype and device):
#: what each fills with. ``torch.ones_like(ids)`` depends on no value of the batch.
_FILLED_LIKE: dict[object, Callable[[torch.fx.Node], object]] = {
    torch.ops.aten.ones_like.default: lambda node: 1,
    torch.ops.aten.zeros_like.default: lambda node: 0,
    torch.ops.aten.full_like.default: lambda node: node.args[1],
    torch.ops.aten.new_ones.default: lambda node: 1,
    torch.ops.aten.new_zeros.default: lambda node: 0,
    torch.ops.aten.new_full.default: lambda node: node.args[2],
}


def _ancestry(target: torch.fx.Node, inputs: bool) -> set[torch.fx.Node] | None:
    """The nodes of ``target``'s graph that compute it, ``target`` included, stopping at a fill
    (``_FILLED_LIKE``: its input lends only its shape); None when one is an input of the step
    (a placeholder; allowed with ``inputs``), a random draw or anything but an op, or when an op
    wrote to one of them, itself or through a view (a copy of these nodes would not replay it)."""
    needed: set[torch.fx.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        if node.op == "call_function" and node.target in _FILLED_LIKE and isinstance(node.meta.get("val"), torch.Tensor):
            needed.add(node)  # (its input lends only its shape, dtype and device, fixed in a traced step)
            continue
        if node.op == "call_function" and node.target is not operator.getitem:
            op = node.target
            if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in op.tags:
                return None
        elif node.op == "placeholder" and inputs:
            needed.add(node)
            continue
        elif node.op not in ("get_attr", "call_function"):
            return None  # an input of the step (a placeholder), or something else
        needed.add(node)
        stack.extend(node.all_input_nodes)
    aliases = set(needed)
    for node in target.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        reads = node.all_input_nodes
        if op._schema.is_mutable and any(a in aliases for a in reads):
            return None
        if reads and reads[0] in aliases and any(r.alias_info is not None for r in op._schema.returns):
            aliases.add(node)
    return needed


def _copied(target: torch.fx.Node, needed: set[torch.fx.Node], root: torch.nn.Module) -> torch.fx.GraphModule:
    """A module computing ``target`` from the ``needed`` nodes of its graph (``_ancestry``): its
    inputs are their placeholders, in the graph's order; a fill is made from its shape alone, and
    a tensor the trace made on the meta device is made on the CPU."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in target.graph.nodes:
        if node in needed and node.target in _FILLED_LIKE:
            like = node.meta["val"]
            device = torch.device("cpu") if like.device.type == "meta" else like.device
            copies[node] = graph.call_function(torch.ops.aten.full.default, (list(like.shape), _FILLED_LIKE[node.target](node)),
                                               {"dtype": like.dtype, "device": device})
        elif node in needed:
            copies[node] = graph.node_copy(node, copies.__getitem__)
            if node.kwargs.get("device") == torch.device("meta"):
                copies[node].kwargs = {**node.kwargs, "device": torch.device("cpu")}
    graph.output(copies[target])
    return torch.fx.GraphModule(root, graph)


def constant_value(t: object) -> torch.Tensor | None:
    """The value of ``t``, a tensor of the step ``make_fx`` is tracing, computed for real when it
    depends on no input of the step (only on constants and shapes, like ``torch.arange(n)`` or
    ``torch.ones_like(ids)``, whose input lends only its shape, fixed in a traced step); None
    when it depends on an input, a parameter, a random draw or a tensor some op wrote to, or is
    not being traced. A value traced on the meta device is computed on the CPU."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor) or not proxy_tensor.has_proxy_slot(t, mode.tracer):
        return None
    target = proxy_tensor.get_proxy_slot(t, mode.tracer).proxy.node
    needed = _ancestry(target, inputs=False)
    if needed is None:
        return None
    try:
        with untraced():
            value = _copied(target, needed, mode.tracer.root)()
    except Exception:  # noqa: BLE001 - (a constant stored on the meta device, say): the traced branch stays
        return None
    return value if isinstance(value, torch.Tensor) and value.device.type != "meta" else None


@dataclass(frozen=True, eq=False)
class BranchPoint:
    """A check of library code whose answer depends on the batch's values and picks the program
    eager PyTorch runs (transformers' "can this attention mask be skipped?" and "one sequence
    per row?", see ``_eager_mask_check`` and ``_eager_packed_check``): the traced step took the
    branch ``answer``; ``answer_for(batch)`` is what eager answers for another batch, computed
    from the batch tensors ``batch_indices`` by ``program`` (the ops the trace computed the
    checked tensor with) and the check itself."""

    #: the library's check, as it was before tracing replaced it
    check: Callable[..., object]
    #: the checked tensor from the batch tensors ``batch_indices``
    program: torch.fx.GraphModule
    batch_indices: tuple[int, ...]
    #: the check's other arguments, Python values fixed in the traced step
    args: tuple[object, ...]
    kwargs: dict[str, object]
    answer: bool

    @property
    def name(self) -> str:
        return getattr(self.check, "__name__", "check")

    def answer_for(self, batch: Sequence[torch.Tensor]) -> bool:
        with torch.no_grad():
            checked = self.program(*(batch[i].detach() for i in self.batch_indices))
            return bool(self.check(checked, *self.args, **self.kwargs))


@dataclass
class _BranchRecorder:
    """While a step is traced: the batch's real tensors (None on the meta device) and the
    position of its first tensor among the step's inputs; the answers to take (``forced``, by
    order of the checks), else eager's for this batch; and the checks met so far."""

    batch: tuple[torch.Tensor, ...] | None
    first_input: int
    forced: tuple[bool, ...] | None
    points: list[BranchPoint]

    def record(self, check: Callable[..., object], t: torch.Tensor, args: tuple, kwargs: dict) -> BranchPoint | None:
        """The branch to take at a check of ``t``, which depends on the batch; None where the
        traced, general branch must stay (``t`` computed from parameters or by random ops, the
        batch on the meta device, a tensor among the other arguments)."""
        mode = proxy_tensor.get_proxy_mode()
        if (mode is None or not proxy_tensor.has_proxy_slot(t, mode.tracer)
                or any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))):
            return None
        target = proxy_tensor.get_proxy_slot(t, mode.tracer).proxy.node
        needed = _ancestry(target, inputs=True)
        if needed is None:
            return None
        position = {n: k for k, n in enumerate(n for n in target.graph.nodes if n.op == "placeholder")}
        read = [position[n] - self.first_input for n in target.graph.nodes if n in needed and n.op == "placeholder"]
        if any(i < 0 for i in read):  # (a parameter or buffer: the check would follow training)
            return None
        program = _copied(target, needed, mode.tracer.root)
        k = len(self.points)
        if self.forced is not None and k < len(self.forced):
            answer = self.forced[k]
        elif self.batch is None:  # (a step traced on the meta device runs nowhere)
            answer = False
        else:
            try:
                with untraced():
                    answer = bool(check(program(*(self.batch[i] for i in read)), *args, **kwargs))
            except Exception:  # noqa: BLE001 - (the copied ops cannot run outside the trace): the general branch stays
                return None
        point = BranchPoint(check, program, tuple(read), tuple(args), dict(kwargs), answer)
        self.points.append(point)
        return point


_RECORDER: list[_BranchRecorder] = []


@contextlib.contextmanager
def recording_branches(batch: tuple[torch.Tensor, ...] | None, first_input: int,
                       forced: Sequence[bool] | None = None) -> Iterator[list[BranchPoint]]:
    """While in use, a check of the batch's values that picks eager's program (``BranchPoint``)
    takes the branch eager takes for ``batch`` (the example's real tensors; None on the meta
    device, where the general branch stays), or the ``forced`` answers in order, and is listed
    in the list yielded."""
    recorder = _BranchRecorder(batch, first_input, None if forced is None else tuple(forced), [])
    _RECORDER.append(recorder)
    try:
        yield recorder.points
    finally:
        _RECORDER.remove(recorder)


def _eager_packed_check(original: Callable) -> Callable:
    """transformers' ``find_packed_sequence_indices`` taking eager's branch: for position ids that
    depend on no input (see the module), computed once; for position ids the batch carries,
    answered for the example batch and recorded (``BranchPoint``: "one sequence per row?"), so
    that each batch runs eager's program. Eager builds no packed-sequence mask when every row
    holds one sequence (SDPA runs causal) and one otherwise; the traced, general branch, which
    builds it from the position ids, stays where the position ids cannot be computed from the
    batch alone."""

    def one_sequence_per_row(position_ids: torch.Tensor, *args: object, **kwargs: object) -> bool:
        return original(position_ids, *args, **kwargs) is None

    one_sequence_per_row.__name__ = getattr(original, "__name__", "find_packed_sequence_indices")

    def find_packed_sequence_indices(position_ids: torch.Tensor, *args: object, **kwargs: object) -> object:
        value = constant_value(position_ids)
        if value is not None:
            with untraced():
                packed = original(value, *args, **kwargs)
            if packed is None:  # one sequence per row: eager skips the packed-sequence mask
                return None
        elif isinstance(position_ids, torch.Tensor) and _RECORDER:
            point = _RECORDER[-1].record(one_sequence_per_row, position_ids, args, kwargs)
            if point is not None and point.answer:
                return None
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


def _eager_mask_check(original: Callable) -> Callable:
    """transformers' checks whether an attention mask can be skipped (``_ignore_causal_mask_sdpa``,
    ``_ignore_bidirectional_mask_sdpa``: no token masked), answered as eager answers them. Eager
    then runs SDPA with ``is_causal=True`` (or no mask) instead of adding the mask to the scores,
    which rounds otherwise (Llama in float32: 5e-9; under bfloat16 autocast 4e-4 on a gradient).

    A padding mask that depends on no input (a model that builds ``torch.ones`` itself, as
    Perceiver does, or one built from the batch's shape, ``torch.ones_like(input_ids)``) is
    computed and answered once. One computed from the batch's values (an ``attention_mask`` the
    batch carries) is answered for the example batch while tracing, and the check is recorded
    (``BranchPoint``): a step checks each batch as eager would and runs the program traced for
    its answers (``TrainingStep``). Where the mask cannot be computed from the batch alone (it
    reads a parameter or a random draw) the traced, general branch stays, with a warning: eager
    skips the mask in every step whose batch masks no token, where the traced step's gradients
    agree with eager's to rounding, not bit for bit. A step traced on the meta device, which
    runs nowhere, keeps the general branch without one."""

    def check(padding_mask: object = None, *args: object, **kwargs: object) -> object:
        value = constant_value(padding_mask) if isinstance(padding_mask, torch.Tensor) else None
        if value is not None and not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            with untraced():
                return original(value, *args, **kwargs)
        if isinstance(padding_mask, torch.Tensor) and _RECORDER:
            point = _RECORDER[-1].record(original, padding_mask, args, kwargs)
            if point is not None:
                return point.answer
        if isinstance(padding_mask, torch.Tensor):
            warnings.warn(
                f"the attention mask reaching transformers' {getattr(original, '__name__', 'mask check')} is not "
                f"computed from the batch alone, so the traced step always applies it; eager PyTorch skips a mask "
                f"that masks no token, so in steps whose batch pads nothing the gradients agree with eager's to "
                f"rounding, not bit for bit; pass the mask in the batch, or attention_mask=None when nothing is "
                f"padded",
                stacklevel=2,
            )
        return original(padding_mask, *args, **kwargs)

    return check


def _eager_causal_check(original: Callable) -> Callable:
    """torch's ``_detect_is_causal_mask`` (how ``nn.TransformerEncoder`` and
    ``nn.TransformerDecoder`` decide, when ``is_causal`` is not given, whether a mask is causal,
    by comparing its values with a causal mask) answered as eager answers it when the mask depends
    on no input, as ``nn.Transformer.generate_square_subsequent_mask(n)`` does, PyTorch's
    tutorials' pattern: traced, the comparison's value could not be read and the step was
    refused. Eager then drops the mask for SDPA's ``is_causal=True``, which the step does too. A
    mask that depends on an input keeps the traced check (refused, naming ``is_causal`` as the
    remedy)."""

    def detect(mask: object = None, is_causal: bool | None = None, size: int | None = None) -> bool:
        value = constant_value(mask) if is_causal is None else None
        if value is not None:
            with untraced():
                return original(value, is_causal, size)
        return original(mask, is_causal, size)

    return detect


@contextlib.contextmanager
def _torch_as_eager() -> Iterator[None]:
    """While in use, torch's own checks of values that depend on no input are answered as eager
    answers them (``_eager_causal_check``)."""
    import torch.nn.modules.transformer as transformer_module

    with _replaced_attributes(transformer_module, {"_detect_is_causal_mask": _eager_causal_check}):
        yield


@contextlib.contextmanager
def _transformers_as_eager() -> Iterator[None]:
    """While in use, transformers' checks of values that depend on no input are answered as eager
    answers them, and its method caches (``compile_compatible_method_lru_cache``: BEiT's relative
    position index, DETR's and SAM's position embeddings) are bypassed as under
    ``torch.compile``: filled while tracing, they kept the trace's fake tensors, which the next
    trace (another fake mode) and every later eager call then got back. Nothing happens unless
    the model's code has imported transformers."""
    with _replaced_attributes(sys.modules.get("transformers.masking_utils"),
                              {"find_packed_sequence_indices": _eager_packed_check,
                               "_ignore_causal_mask_sdpa": _eager_mask_check,
                               "_ignore_bidirectional_mask_sdpa": _eager_mask_check}), \
            _replaced_attributes(sys.modules.get("transformers.pytorch_utils"),
                                 {"is_torchdynamo_compiling": lambda _original: _always}):
        yield


def _always() -> bool:
    return True


def _under_fake_mode(mode: object) -> tuple[Callable[..., object], contextlib.AbstractContextManager]:
    """What a fake kernel of ``_FAKE_KERNELS`` needs from the fake mode ``mode`` it is called
    for: PyTorch's own fake kernel of an op (``pytorchs(op, *args, **kwargs)``) and a context in
    which tensors are allocated as the mode's fake tensors. Called by the mode's dispatch, the
    kernel reaches it through ``mode.__torch_dispatch__`` and allocates under ``mode``; called
    while the mode is already the active dispatch mode (propagating values again, as
    ``KernelDtypeProp`` does), it calls the op itself and allocates as it is."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    active = _get_current_dispatch_mode() is mode

    def pytorchs(op: torch._ops.OpOverload, /, *args: object, **kwargs: object) -> object:
        if active:
            return op(*args, **kwargs)
        return mode.__torch_dispatch__(op, (), args, kwargs)  # type: ignore[attr-defined]

    return pytorchs, contextlib.nullcontext() if active else mode  # type: ignore[return-value]


def _on_cpu(t: object) -> bool:
    """Whether ``t`` is a tensor on the CPU, or on the meta device, which stands in for the CPU
    while tracing: where the CPU kernels' outputs are what the fake kernels below give."""
    return isinstance(t, torch.Tensor) and t.device.type in ("cpu", "meta")


def _cpu_grouped_mm(mode: object, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm`` under the fake mode while tracing: on the CPU (and the meta device,
    which stands in for it) the output the CPU kernel allocates, contiguous, whatever the
    inputs' floating-point dtype; elsewhere PyTorch's own fake kernel. Shapes as the kernel's:
    2-D x 3-D (a token-sorted batch against per-expert weights) gives one row per token, 2-D x
    2-D (a weight gradient) one matrix per group, 3-D x 3-D a batched product."""
    pytorchs, allocating = _under_fake_mode(mode)
    if not _on_cpu(mat_a):
        return pytorchs(torch.ops.aten._grouped_mm.default, mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = [offs.size(0) if offs is not None else 1, mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    with allocating:
        return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _cpu_layout(op: torch._ops.OpOverload, input_index: int) -> Callable:
    """A fake kernel for ``op`` whose first output has the layout the CPU kernel gives it: the
    memory format its input (argument ``input_index``) suggests, contiguous unless that is
    channels-last. PyTorch's fake kernels of the batch norms keep the input's strides, so a
    norm of a transposed input (``bn(x.transpose(1, 2)).transpose(1, 2)``, PatchTST's) looked
    contiguous once transposed back, the next ``linear`` was traced as a ``view``, and the
    traced step failed on the CPU kernel's contiguous output ("view size is not compatible").
    Other devices keep PyTorch's fake kernel."""
    from torch._prims_common import suggest_memory_format

    def kernel(mode: object, *args: object, **kwargs: object) -> object:
        pytorchs, allocating = _under_fake_mode(mode)
        out = pytorchs(op, *args, **kwargs)
        x = args[input_index]
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not (_on_cpu(x) and isinstance(first, torch.Tensor)):
            return out
        layout = suggest_memory_format(x)
        if first.is_contiguous(memory_format=layout):
            return out
        with allocating:
            fixed = torch.empty(first.shape, dtype=first.dtype, device=first.device, memory_format=layout)
        return (fixed, *out[1:]) if isinstance(out, (tuple, list)) else fixed

    return kernel


def _with_storage(out: torch.Tensor, elements: int) -> torch.Tensor:
    """A tensor like ``out`` (shape, strides, dtype, device) over a storage of ``elements``
    elements from its start: what a kernel returns that allocates more than it shows. Call it
    where ``out``'s kind of tensor is made (under the fake mode while tracing)."""
    whole = torch.empty(elements, dtype=out.dtype, device=out.device)
    return whole.as_strided(out.shape, out.stride(), 0)


def _cpu_loss_storage(op: torch._ops.OpOverload, reduction_index: int) -> Callable:
    """A fake kernel for a loss whose CPU kernel reduces in place: with ``reduction`` mean or
    sum, ``mse_loss``, ``smooth_l1_loss``, ``soft_margin_loss`` and ``binary_cross_entropy``
    return a 0-d tensor over the storage of the whole unreduced loss (the broadcast inputs'
    size), which lives as long as the loss does. PyTorch's fake kernels give it a storage of
    one element, so a plan counted 4 bytes for it: an autoencoder trained with ``mse_loss``
    measured 16% above its budget. Other devices keep PyTorch's fake kernel."""

    def kernel(mode: object, *args: object, **kwargs: object) -> object:
        pytorchs, allocating = _under_fake_mode(mode)
        out = pytorchs(op, *args, **kwargs)
        x, target = args[0], args[1]
        reduction = kwargs.get("reduction", args[reduction_index] if len(args) > reduction_index else 1)
        if (reduction == 0 or not isinstance(out, torch.Tensor) or out.dim() != 0
                or not (_on_cpu(x) and isinstance(target, torch.Tensor))):
            return out
        with allocating:
            return _with_storage(out, torch.broadcast_shapes(x.shape, target.shape).numel())

    return kernel


def _cpu_embedding_bag(op: torch._ops.OpOverload) -> Callable:
    """A fake kernel for ``_embedding_bag`` whose outputs have the CPU kernel's storages: its
    ``offset2bag``, where it has one (mean and max mode, and sum mode with a ``padding_idx``),
    holds one element more than it shows, and with ``include_last_offset`` so does ``bag_size``
    (8 bytes each, which ``check_counted_bytes`` reported; sum with a padding index measured 8 B
    over its budget). Other devices keep PyTorch's fake kernel."""
    names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
             "include_last_offset")

    def kernel(mode: object, *args: object, **kwargs: object) -> object:
        pytorchs, allocating = _under_fake_mode(mode)
        out = pytorchs(op, *args, **kwargs)
        given = dict(zip(names, args), **kwargs)
        if not _on_cpu(given["weight"]):
            return out
        out = list(out)
        with allocating:
            if out[1].numel():
                out[1] = _with_storage(out[1], out[1].numel() + 1)
            if given.get("include_last_offset", False):
                out[2] = _with_storage(out[2], out[2].numel() + 1)
        return tuple(out)

    return kernel


#: Fake kernels that stand in for PyTorch's while tracing (``_fake_kernels``): per overload
#: (``name.overload``), what makes the kernel from the op.
_FAKE_KERNELS: dict[str, Callable[[torch._ops.OpOverload], Callable]] = {
    "_grouped_mm.default": lambda op: _cpu_grouped_mm,
    **{name: (lambda op: _cpu_layout(op, 0)) for name in (
        "_native_batch_norm_legit_functional.default", "_native_batch_norm_legit.default",
        "_native_batch_norm_legit.no_stats", "_native_batch_norm_legit_no_training.default",
        "_batch_norm_with_update_functional.default", "_batch_norm_with_update.default",
        "native_batch_norm.default")},
    **{name: (lambda op: _cpu_layout(op, 1)) for name in (
        "native_batch_norm_backward.default", "batch_norm_backward.default")},
    **{name: (lambda op, index=index: _cpu_loss_storage(op, index)) for name, index in (
        ("mse_loss.default", 2), ("smooth_l1_loss.default", 2), ("soft_margin_loss.default", 2),
        ("binary_cross_entropy.default", 3))},
    **{name: _cpu_embedding_bag for name in ("_embedding_bag.default", "_embedding_bag_forward_only.default")},
}
_MADE: dict[torch._ops.OpOverload, Callable] = {}


def fake_kernel(target: object) -> Callable | None:
    """The fake kernel of ``_FAKE_KERNELS`` for op ``target`` (an aten overload), or None."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    if target not in _MADE:
        make = _FAKE_KERNELS.get(f"{target._opname}.{target._overloadname}")
        if make is None:
            return None
        _MADE[target] = make(target)
    return _MADE[target]


@contextlib.contextmanager
def _fake_kernels() -> Iterator[None]:
    """While in use, the ops of ``_FAKE_KERNELS`` that this PyTorch has get those fake kernels
    (under the python dispatcher, for ``FakeTensorMode``); restored afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved = []
    try:
        for name in _FAKE_KERNELS:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
            kernel = fake_kernel(op)
            if kernel is None:
                continue
            saved.append((op, op.python_key_table.get(FakeTensorMode)))
            op.python_key_table[FakeTensorMode] = kernel
            op._dispatch_cache.clear()
        yield
    finally:
        for op, original in saved:
            if original is None:
                op.python_key_table.pop(FakeTensorMode, None)
            else:
                op.python_key_table[FakeTensorMode] = original
            op._dispatch_cache.clear()


@contextlib.contextmanager
def tracing_as_eager() -> Iterator[None]:
    """Around ``make_fx`` under the python dispatcher: upsampling traces as itself, half-precision
    dropout off CUDA as eager's arithmetic, checkpointed calls as plain calls, torch's and
    transformers' checks of values that depend on no input as eager answers them, CPU grouped
    products with the CPU kernel's output."""
    replacements: dict[torch._ops.OpOverload, Callable | None] = dict.fromkeys(EAGER_KERNEL_OPS)
    replacements[torch.ops.aten.dropout.default] = _eager_dropout
    with _replaced_py_kernels(replacements), _fake_kernels(), _plain_checkpoints(), _torch_as_eager(), \
            _transformers_as_eager():
        yield


@contextlib.contextmanager
def autocast_cache(enabled: bool) -> Iterator[None]:
    """Inside the function ``make_fx`` traces (which turns the cache off): autocast's cast cache
    as the user had it (``torch.is_autocast_cache_enabled()`` before tracing)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)
        # the cache empties when the outermost autocast region exits; inside a caller's region
        # it would keep the trace's fake casts, whose addresses real tensors may later reuse
        torch.clear_autocast_cache()
