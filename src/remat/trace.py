"""Trace one training step (forward, loss and backward) into a ``Graph`` and the fx code behind it.

The step is traced as one functional, aten-level fx graph: ``torch.func.functional_call`` with
parameters, buffers and the batch as inputs, ``torch.autograd.grad`` of the loss, ``make_fx``
with fake tensors under the python dispatcher (so batch norm shows its running-stat update and
dropout is one ``native_dropout``; where that would differ from eager PyTorch,
``remat.eager_ops`` keeps eager's ops), then a second pass of
``functionalize(remove="mutations")``; batch norms are then rewritten to the ops eager's kernels
run behind (``remat.batch_norm``).
Mutated buffers (batch-norm running stats), parameters (an embedding's ``max_norm``
renormalization) and batch tensors come out as extra outputs holding the new values; whoever
runs the step copies them into those tensors once, after the step (``TracedStep.update_targets``).
Batch tensors that require grad in the example batch get their gradient computed too (as
``loss.backward()`` gives them one).

Memory follows storages, not nodes: a node owns the bytes of the storages it creates; a view
(or any output sharing an existing storage) owns none and makes its users depend on the
storage's owner, so a plan keeps the owner alive exactly as long as torch would (the passes
that build the ``Graph`` live in ``fx_graph.py``; error translation in ``trace_errors.py``).

The loss contract: ``loss_fn(model, *batch) -> scalar tensor``. The loss function calls the
model itself, so any signature works (keyword arguments, several calls, labels inside).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.fx.experimental.proxy_tensor as proxy_tensor
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_leaves

from remat import cost as cost_mod
from remat.batch_norm import use_eager_kernels as use_eager_batch_norm_kernels
from remat.collector import older_objects_frozen
from remat.eager_ops import (
    BranchPoint,
    autocast_cache,
    fake_kernel,
    recording_branches,
    recording_checkpoint_writes,
    recording_reentrant_blocks,
    refuse_leaves_shared_across_reentrant_blocks,
    traced_reentrant_blocks,
    tracing_as_eager,
    untraced,
)
from remat.errors import TraceError, a_type
from remat.fx_graph import build_graph, dead_code_elimination, split_multi_outputs, with_scratch
from remat.scratch import ScratchModel, node_scratch
from remat.graph import Graph, NodeKind
from remat.guards import (ModelView, ModuleState, OutsideReads, PythonState, _iterator, _where, module_state,
                          registered_while_traced)
from remat.trace_errors import (BatchNormWatch, RegisteredTensors, RngWatch, RnnWatch, check_default_generator,
                                _describe_module, check_dense, explain_trace_failure, refuse_exact_tensor_classes,
                                warn_of_stored_trace_tensors)

LossFn = Callable[..., torch.Tensor]
log = logging.getLogger("remat.trace")


class InputRole(enum.Enum):
    PARAM = "param"  # a parameter (trainable or frozen)
    BUFFER = "buffer"
    INPUT = "input"  # one tensor of the batch
    CONSTANT = "constant"  # a tensor the model creates from Python data (lifted by make_fx)


class OutputRole(enum.Enum):
    LOSS = "loss"
    GRAD = "grad"  # the gradient of one trainable parameter
    INPUT_GRAD = "input_grad"  # the gradient of one batch tensor that requires grad ("batch[i]")
    UPDATE = "update"  # the new value of a parameter, buffer or batch tensor the step mutates


@dataclasses.dataclass(frozen=True)
class InputSlot:
    """One placeholder of the traced module: ``key`` is the parameter or buffer name as in
    ``model.named_parameters()``, ``batch[i]`` or the constant's attribute name."""

    role: InputRole
    key: str
    fx_name: str


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    """One output of the traced module. ``fx_name`` is None for the gradient of a parameter
    the loss does not use (its ``.grad`` stays untouched, as with ``loss.backward()``)."""

    role: OutputRole
    key: str
    fx_name: str | None


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One batch tensor as traced: ``requires_grad`` says whether the step computes its
    gradient; ``stride`` is its layout (``layout_of``), the strides of dimensions of size one
    left out (0), as they never address a second element."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad, layout_of(t))


def layout_of(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides where they matter: 0 for a dimension of size one (or for any, when ``t``
    is empty)."""
    if t.numel() == 0:
        return (0,) * t.dim()
    return tuple(st if n > 1 else 0 for n, st in zip(t.shape, t.stride()))


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    """What one run of a traced step returns, by name: ``grads`` by parameter name,
    ``input_grads`` by batch position (``"batch[0]"``: the batch tensors that require grad; None
    where the loss does not depend on one), ``updates`` by the name of the tensor they replace
    (a parameter's, a buffer's or ``"batch[i]"``)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    updates: dict[str, torch.Tensor]
    input_grads: dict[str, torch.Tensor | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class TracedStep:
    """A traced training step: its ``Graph`` and the map back to torch.

    ``module(*flat_inputs)`` runs the whole step eagerly and returns one value per ``outputs``
    slot. Graph node ``i`` is fx node ``node_names[i]``. ``storage_owners[i]`` are the graph
    nodes owning the storages node i's outputs live in (i itself for storages it creates;
    empty for views of parameters or inputs).
    """

    graph: Graph
    module: fx.GraphModule
    node_names: tuple[str, ...]
    inputs: tuple[InputSlot, ...]
    outputs: tuple[OutputSlot, ...]
    constants: tuple[torch.Tensor, ...]
    storage_owners: tuple[tuple[int, ...], ...]
    random_nodes: tuple[int, ...]
    batch_spec: tuple[TensorSpec, ...]
    #: the model's Python state the step was traced with (``guards``: attributes, train or eval
    #: mode, hooks, requires_grad, each parameter's and buffer's layout, the ambient autocast),
    #: checked before every run
    module_state: ModuleState
    #: the checks of the batch's values that pick the program eager runs (``BranchPoint``:
    #: transformers' "can this attention mask be skipped?", "one sequence per row?"), in the
    #: order the step meets them, each with the answer this step was traced with
    branch_points: tuple[BranchPoint, ...] = ()
    #: the keys of a dict batch, in the order of the step's batch tensors (None: a tuple batch);
    #: ``flat_inputs`` and ``answers_for`` then take dicts with these keys, in any order
    batch_keys: tuple[str, ...] | None = None
    #: the trainable parameters whose gradients the step computes, in the order eager's
    #: backward finishes them (recorded by hooks while the step is traced): the order the step
    #: accumulates them into ``.grad`` and runs their hooks in, one parameter at a time, so a hook
    #: sees the values and ``.grad`` eager's would
    grad_order: tuple[str, ...] = ()

    @property
    def branch_answers(self) -> tuple[bool, ...]:
        """The answers of ``branch_points`` this step was traced with."""
        return tuple(p.answer for p in self.branch_points)

    def answers_for(self, batch: Sequence[torch.Tensor]) -> tuple[bool, ...]:
        """What eager PyTorch answers at each of ``branch_points`` for ``batch``: the step runs
        eager's program for ``batch`` if these are ``branch_answers``."""
        batch = self.batch_tensors(batch)
        return tuple(p.answer_for(batch) for p in self.branch_points)

    def batch_tensors(self, batch: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
                      ) -> tuple[torch.Tensor, ...]:
        """``batch`` as the step's tuple of tensors: a dict batch (of a step traced with one) in
        the order of ``batch_keys``; ``TraceError`` names a batch of the other kind."""
        if self.batch_keys is None:
            return _as_batch(batch)
        if not isinstance(batch, Mapping):
            raise TraceError(
                f"the batch is {a_type(batch)}, but this step was traced with a dict batch (keys "
                f"{keys_shown(self.batch_keys)}); pass one such dict"
            )
        return tensors_of(batch, self.batch_keys)

    def fx_node(self, i: int) -> fx.Node:
        return self._fx_nodes[i]

    @functools.cached_property
    def _fx_nodes(self) -> tuple[fx.Node, ...]:
        by_name = {n.name: n for n in self.module.graph.nodes}
        return tuple(by_name[name] for name in self.node_names)

    def is_alias(self, i: int) -> bool:
        """Node i allocates nothing: every output shares a storage created elsewhere."""
        return i not in self.storage_owners[i] and self.graph.nodes[i].out_bytes == 0

    def measurements(self) -> dict[str, list]:
        """What was measured about each node rather than read from the trace: its cost and its
        kernel scratch bytes (JSON data, for a saved plan to carry)."""
        return {"node_costs": [n.cost for n in self.graph.nodes], "temp_bytes": [n.temp_bytes for n in self.graph.nodes]}

    def with_measurements(self, node_costs: Sequence[float], temp_bytes: Sequence[int]) -> TracedStep:
        """The same step with each node's cost and scratch bytes replaced (``measurements()``
        of an earlier trace); ``ValueError`` names a list of the wrong length or an entry of the
        wrong kind."""
        n = self.graph.n
        for label, values, ok in (
            ("node_costs", node_costs, lambda c: isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0),
            ("temp_bytes", temp_bytes, lambda b: isinstance(b, int) and not isinstance(b, bool) and b >= 0),
        ):
            if not isinstance(values, (list, tuple)) or len(values) != n:
                raise ValueError(f"{label} must list one value per node ({n}), not {type(values).__name__} of {len(values) if isinstance(values, (list, tuple)) else '?'}")
            bad = next((k for k, v in enumerate(values) if not ok(v)), None)
            if bad is not None:
                raise ValueError(f"{label}[{bad}] = {values[bad]!r} is not a non-negative number")
        nodes = tuple(dataclasses.replace(node, cost=float(c), temp_bytes=int(b)) for node, c, b in zip(self.graph.nodes, node_costs, temp_bytes))
        graph = Graph(nodes=nodes, fixed_bytes=self.graph.fixed_bytes, outputs=self.graph.outputs, name=self.graph.name)
        return dataclasses.replace(self, graph=graph)

    def flat_inputs(self, model: torch.nn.Module, batch: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
                    view: ModelView | None = None) -> list[torch.Tensor]:
        """The placeholder values for one step: the model's current parameters and buffers
        (detached, sharing storage, so buffer updates land in the model), the batch (a dict for
        a step traced with one), the constants. ``view``: the model's tensors by name, when the
        caller has read them."""
        batch = self.batch_tensors(batch)
        view = view if view is not None else ModelView(model)
        self.module_state.check(model, view)  # (first: a model converted, model.double(), is named as such)
        with named_by_key(self.batch_keys):
            check_batch(self.batch_spec, batch)
        sources = (view.parameters, view.buffers, batch)
        constants = iter(self.constants)
        flat = [next(constants) if source is None else sources[source][key].detach() for source, key in self._input_sources]
        self._check_no_shared_update(flat)
        return flat

    @functools.cached_property
    def _input_sources(self) -> tuple[tuple[int | None, str | int], ...]:
        """Where each input's value comes from: (0, name) a parameter, (1, name) a buffer,
        (2, position) a batch tensor, (None, name) the next constant."""
        source = {InputRole.PARAM: 0, InputRole.BUFFER: 1, InputRole.INPUT: 2}
        return tuple((source.get(slot.role), batch_index(slot.key) if slot.role is InputRole.INPUT else slot.key)
                     for slot in self.inputs)

    def _check_no_shared_update(self, flat: Sequence[torch.Tensor]) -> None:
        """Refuse inputs where a tensor the step modifies in place shares memory with another
        input (an autoencoder's batch ``(x, x)`` whose forward centres ``x`` in place): eager
        sees the change through the other, the traced step reads each input as it was handed
        (loss 9.8 against eager's 1.0, silently)."""
        updated = self._updated_inputs
        if not updated:
            return
        storage_of = [None if slot.role is InputRole.CONSTANT or t.is_meta else t.untyped_storage().data_ptr()
                      for slot, t in zip(self.inputs, flat)]
        watched = {storage_of[k] for k in updated} - {None}
        by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for slot, t, storage in zip(self.inputs, flat, storage_of):
            if storage in watched:
                by_storage.setdefault(storage, []).append((slot.key, t))
        updated = {self.inputs[k].key for k in updated}
        for sharing in by_storage.values():
            for key, t in sharing:
                other = next((k for k, u in sharing if k != key and _overlap(t, u)), None) if key in updated else None
                if other is not None:
                    copy = other if other.startswith("batch[") else key
                    raise TraceError(
                        f"{_input_name(key)} and {_input_name(other)} share memory, and the step modifies "
                        f"{_input_name(key)} in place, which eager PyTorch shows through both and the traced "
                        f"step does not (it reads each input as it was handed): pass tensors that do not share "
                        f"memory ({copy}.clone(), which keeps its values)"
                    )

    @functools.cached_property
    def _updated_inputs(self) -> tuple[int, ...]:
        """The positions of the inputs the step modifies in place (an update output names them)."""
        updated = {s.key for s in self.outputs if s.role is OutputRole.UPDATE}
        return tuple(k for k, slot in enumerate(self.inputs) if slot.key in updated)

    @functools.cached_property
    def _input_roles(self) -> dict[str, InputRole]:
        return {s.key: s.role for s in self.inputs}

    def update_targets(self, model: torch.nn.Module, batch: Sequence[torch.Tensor],
                       view: ModelView | None = None) -> dict[str, torch.Tensor]:
        """The tensor each update output of the step is copied into, by its key: the model's
        parameter or buffer of that name, or the batch tensor. Raises ``TraceError`` for a key
        that names none of them, so a caller resolves them all before writing anything.
        ``view``: the model's tensors by name, when the caller has read them."""
        role_of = self._input_roles
        view = view if view is not None else ModelView(model)
        params, buffers = view.parameters, view.buffers
        targets = {}
        for slot in self.outputs:
            if slot.role is not OutputRole.UPDATE:
                continue
            role = role_of.get(slot.key)
            if role is InputRole.PARAM and slot.key in params:
                targets[slot.key] = params[slot.key]
            elif role is InputRole.BUFFER and slot.key in buffers:
                targets[slot.key] = buffers[slot.key]
            elif role is InputRole.INPUT and 0 <= batch_index(slot.key) < len(batch):
                targets[slot.key] = batch[batch_index(slot.key)]
            else:
                what = "a tensor the model creates or keeps outside its parameters and buffers" if role is InputRole.CONSTANT \
                    else "no parameter, buffer or batch tensor of this model"
                raise TraceError(
                    f"the traced step modifies {slot.key!r} in place, which is {what}; remat cannot "
                    f"apply that update, and nothing was written: register the tensor as a buffer "
                    f"(module.register_buffer) or do not modify it in place, and trace (or optimize) again"
                )
        return targets

    def unpack(self, values: Sequence[torch.Tensor | None]) -> StepOutputs:
        loss, grads, updates, input_grads = None, {}, {}, {}
        for slot, value in zip(self.outputs, values, strict=True):
            if slot.role is OutputRole.LOSS:
                loss = value
            elif slot.role is OutputRole.GRAD:
                grads[slot.key] = value
            elif slot.role is OutputRole.INPUT_GRAD:
                input_grads[slot.key] = value
            else:
                updates[slot.key] = value
        assert loss is not None
        return StepOutputs(loss=loss, grads=grads, updates=updates, input_grads=input_grads)


def trace(
    model: torch.nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    *,
    cost_model: cost_mod.CostModel | None = cost_mod.CostModel.PROFILE,
    name: str | None = None,
    replay_rng: bool = True,
    scratch: ScratchModel | None = None,
    allow_native_batch_norm: bool = False,
    branches: Sequence[bool] | None = None,
) -> TracedStep:
    """Trace ``loss_fn(model, *example_inputs)`` and its backward into a ``TracedStep``.

    A batch that is a dict of tensors (as a Hugging Face ``DataLoader`` yields it) is taken
    whole: ``loss_fn(model, batch)`` reads the dict, the step's batch tensors are its values in
    its keys' order (``TracedStep.batch_keys``), and ``flat_inputs`` takes such dicts.

    ``cost_model`` picks how node costs (microseconds) are found; None leaves every cost 0
    (structure only, e.g. to check a saved plan). With ``replay_rng`` (default) random ops are
    recomputable and a recomputation replays the generator state; otherwise they must run once.
    ``scratch`` picks how each node's kernel scratch memory (its ``temp_bytes``) is found
    (``remat.scratch``); by default it is measured when costs are profiled, estimated by
    per-op rules otherwise, and not modelled for a model on the meta device (it runs nowhere).
    Batch norms in training mode run the kernels eager PyTorch runs (cuDNN's on a CUDA device,
    ``remat.batch_norm``); one in eval mode or without running statistics that eager would run
    with cuDNN is refused with a ``TraceError`` naming the module, since the traced step would
    run PyTorch's native kernels, which round differently; ``allow_native_batch_norm=True``
    accepts them (``remat.trace_errors``).

    Where library code checks the batch's values to pick the program eager runs (transformers'
    "can this attention mask be skipped?", ``eager_ops.BranchPoint``), the step takes eager's
    branch for ``example_inputs``, or ``branches``, the answers to take in the order the checks
    come (checks beyond them take eager's); ``TracedStep.branch_points`` lists them.

    A batch tensor that requires grad (``requires_grad=True``, or a tensor computed outside the
    step with a ``grad_fn``) gets its gradient computed as ``loss.backward()`` would
    (``OutputRole.INPUT_GRAD``); the traced step then takes only batches whose tensors require
    grad where the example's did (``check_batch``).

    >>> import torch
    >>> m = torch.nn.Linear(4, 2)
    >>> t = trace(m, (torch.randn(3, 4),), lambda m, x: m(x).square().mean(), cost_model=None)
    >>> [s.key for s in t.outputs]
    ['loss', 'weight', 'bias']

    A training step computes gradients, so it is traced with autograd on, as under
    ``torch.no_grad()`` too (there, the loss had no ``grad_fn`` and the step was refused as if
    ``loss_fn`` did not call the model); under ``torch.inference_mode()`` it is refused.
    """
    if torch.is_inference_mode_enabled():
        raise TraceError(
            "a training step cannot be traced under torch.inference_mode(): its tensors cannot take part in "
            "autograd, and a training step computes gradients; call remat.optimize (or trace) outside "
            "inference_mode"
        )
    check_arguments(model, loss_fn, order="remat.trace(model, example_batch, loss_fn)")
    example_inputs, loss_fn, keys = keyword_batch(example_inputs, loss_fn)
    with older_objects_frozen(), torch.enable_grad(), named_by_key(keys):  # (tracing makes short-lived objects too)
        traced = _trace(model, example_inputs, loss_fn, cost_model, name, replay_rng, scratch, allow_native_batch_norm,
                        branches)
    return traced if keys is None else dataclasses.replace(traced, batch_keys=keys)


def _trace(model: torch.nn.Module, example_inputs: torch.Tensor | Sequence[torch.Tensor], loss_fn: LossFn,
           cost_model: cost_mod.CostModel | None, name: str | None, replay_rng: bool, scratch: ScratchModel | None,
           allow_native_batch_norm: bool, branches: Sequence[bool] | None = None) -> TracedStep:
    batch = _as_batch(example_inputs)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    lazy = next((k for k, t in [*params.items(), *buffers.items()]
                 if isinstance(t, torch.nn.parameter.UninitializedTensorMixin)), None)
    if lazy is not None:
        raise TraceError(
            f"{lazy!r} is not initialized yet (a lazy module, such as nn.LazyLinear, sets its shape at its first "
            f"call): run the model once before remat.optimize (with torch.no_grad(): model(*example_batch)), "
            f"then optimize")
    refuse_exact_tensor_classes(model, loss_fn)
    trainable = [k for k, p in params.items() if p.requires_grad]
    frozen = [k for k, p in params.items() if not p.requires_grad]
    grad_inputs = [i for i, t in enumerate(batch) if t.requires_grad]
    if not trainable and not grad_inputs:
        raise TraceError(
            f"model {type(model).__name__} has no trainable parameter (requires_grad=True) and "
            f"no batch tensor requires grad; there is no gradient to compute"
        )
    keys = trainable + frozen + list(buffers)
    slot_keys = keys + [f"batch[{i}]" for i in range(len(batch))]  # (the graph's placeholders, in order)
    flat = [*(params[k].detach() for k in trainable + frozen), *(buffers[k].detach() for k in buffers),
            *(t.detach() for t in batch)]
    on_meta = any(t.device.type == "meta" for t in flat)
    if on_meta and cost_model is cost_mod.CostModel.PROFILE:
        raise TraceError(
            "the model or batch is on the meta device, which has no data to time; pass "
            "cost_model=CostModel.ESTIMATE (or None)"
        )
    scratch = _scratch_model(scratch, cost_model, on_meta)
    fake_mode = FakeTensorMode()
    fakes = [_fake_input(fake_mode, t) for t in flat]
    kinds_by_name: dict[str, NodeKind] = {}
    stashed: list[str] = []  # tensors the forward stored on its modules (``_module_attributes_kept``)
    before = PythonState.of(model, loss_fn)
    real_batch = None if on_meta else tuple(t.detach() for t in batch)
    with RnnWatch(model) as rnns, BatchNormWatch(model, allow=allow_native_batch_norm) as norms, RngWatch() as rng, \
            recording_branches(real_batch, len(params) + len(buffers), branches) as branch_points, \
            OutsideReads() as reads, _iterators_refused(before.iterators), _emptied(before.caches):
        finished: list[int] = []  # (indices into trainable, in the order the backward finished them)
        try:
            gm = _trace_functional(model, loss_fn, trainable, frozen, list(buffers), grad_inputs, fakes, kinds_by_name,
                                   stashed, finished)
        except BaseException:  # a refused trace changes nothing of the user's Python state
            found = before.registrations()
            before.restore(model)
            if found:  # (what the trace registered made it fail: say that)
                raise registered_while_traced(found) from None
            raise
        found = before.registrations()
        if found:
            before.restore(model)
            raise registered_while_traced(found)

        def again() -> fx.GraphModule:
            kinds_by_name.clear()
            stashed.clear()
            branch_points.clear()
            reads.clear()
            finished.clear()
            return _trace_functional(model, loss_fn, trainable, frozen, list(buffers), grad_inputs, fakes,
                                     kinds_by_name, stashed, finished)

        first = gm
        gm = before.settle(model, again) or gm  # (traced again where the first trace set a flag)
        initialized = _written_inputs(first, slot_keys) - _written_inputs(gm, slot_keys)
        if initialized:  # the first call wrote them (a flag set once): eager's first step would too
            before.restore(model)
            raise TraceError(
                f"the forward writes {', '.join(sorted(initialized))} in place at its first call only (it sets a "
                f"flag then, such as an ActNorm's data-dependent initialization): the traced step is taken from "
                f"the state after that call, so the model would never be initialized as eager initializes it; "
                f"run the model once before remat.optimize (with torch.no_grad(): model(*example_batch)), then "
                f"optimize")
        rng.check()
        branch_points = tuple(branch_points)
    warn_of_stored_trace_tensors(model, loss_fn, stashed)
    rnns.check_graph(gm)
    check_dense(gm, model)
    check_default_generator(gm, model)

    roles = [InputRole.PARAM] * len(params) + [InputRole.BUFFER] * len(buffers) + [InputRole.INPUT] * len(batch)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [InputSlot(r, k, p.name) for r, k, p in zip(roles, slot_keys, placeholders, strict=True)]
    constants = _lift_constants(gm, inputs)
    outputs = _output_slots(gm, trainable, [f"batch[{i}]" for i in grad_inputs], inputs)
    dead_code_elimination(gm)
    use_eager_batch_norm_kernels(gm, kinds_by_name)
    norms.check_graph(gm)
    split_multi_outputs(gm, kinds_by_name)
    outputs = _rename_outputs(gm, outputs)
    gm.graph.lint()
    gm.recompile()
    KernelDtypeProp(gm, fake_mode).propagate(*fakes, *constants)

    graph, node_names, owners, random_nodes = build_graph(
        gm, kinds_by_name, name or type(model).__name__, replay_rng=replay_rng
    )
    resident = _storages_bytes(flat)
    if resident > graph.fixed_bytes:  # (a strided view's fake storage spans its elements, not its base's tail)
        graph = dataclasses.replace(graph, fixed_bytes=resident)
    aliases = frozenset(nm for i, nm in enumerate(node_names) if i not in owners[i] and graph.nodes[i].out_bytes == 0)
    graph = with_scratch(graph, node_names, node_scratch(gm, [*flat, *constants], scratch, skip=aliases))
    traced = TracedStep(
        graph=graph,
        module=gm,
        node_names=node_names,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        constants=tuple(constants),
        storage_owners=owners,
        random_nodes=random_nodes,
        batch_spec=tuple(TensorSpec.of(t) for t in batch),
        module_state=module_state(model, loss_fn, reads.held(model, loss_fn), rnns.onednn_off),
        branch_points=branch_points,
        grad_order=tuple(dict.fromkeys(trainable[i] for i in finished)),
    )
    traced.flat_inputs(model, batch)  # (the example as a step would take it: a batch (x, x) that it modifies is refused)
    if cost_model is not None:
        # (meta models are only estimated, from the fake tensors' metadata)
        zero = frozenset(name for i, name in enumerate(node_names) if traced.is_alias(i))
        costs = cost_mod.node_costs(gm, [*flat, *constants], cost_model, zero_cost=zero)
        traced = dataclasses.replace(traced, graph=graph.with_costs([costs[name] for name in node_names]))
    return traced


def _scratch_model(scratch: ScratchModel | None, cost_model: cost_mod.CostModel | None, on_meta: bool) -> ScratchModel:
    if scratch is None:
        if on_meta:
            return ScratchModel.NONE
        return ScratchModel.MEASURE if cost_model is cost_mod.CostModel.PROFILE else ScratchModel.ESTIMATE
    if not isinstance(scratch, ScratchModel):
        raise TraceError(f"scratch={scratch!r} is not a ScratchModel; use ScratchModel.MEASURE, ESTIMATE or NONE")
    if on_meta and scratch is ScratchModel.MEASURE:
        raise TraceError(
            "the model or batch is on the meta device, which has no data to run; scratch memory "
            "cannot be measured there: pass scratch=ScratchModel.ESTIMATE (or NONE)"
        )
    return scratch


# ---------------------------------------------------------------------------- dict batches
class KeywordBatch:
    """``loss_fn`` of a batch that is a dict of tensors (as a Hugging Face ``DataLoader`` yields
    it), called as the traced step calls it: with the tensors in the order of ``keys``, which it
    gathers back into a dict. ``__wrapped__``: the user's function, whose globals and closure
    variables the guards read (``guards.function_names``)."""

    def __init__(self, loss_fn: LossFn, keys: tuple[str, ...]) -> None:
        self.__wrapped__ = loss_fn
        self.keys = keys

    def __call__(self, model: torch.nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
        return self.__wrapped__(model, dict(zip(self.keys, tensors, strict=True)))


def keyword_batch(example: object, loss_fn: LossFn, keys: tuple[str, ...] | None = None
                  ) -> tuple[object, LossFn, tuple[str, ...] | None]:
    """(batch, loss_fn, keys): a dict batch as its tensors (in ``keys``' order, by default its
    own), ``loss_fn`` taking them (``KeywordBatch``), and its keys; anything else as it is."""
    if wrapped_dict(example):
        raise TraceError(
            f"the batch is {a_type(example)} holding one dict (keys {keys_shown(tuple(example[0]))}), and a dict "
            f"batch is taken as it is: pass the dict itself (remat.optimize(model, batch, loss_fn, ...), "
            f"remat.trace(model, batch, loss_fn)), with loss_fn(model, batch) reading the dict"
        )
    if not isinstance(example, Mapping):
        return example, loss_fn, None
    own = tuple(example)
    if keys is None or set(keys) != set(own):
        keys = own
    return tensors_of(example, keys), KeywordBatch(loss_fn, keys), keys


def wrapped_dict(batch: object) -> bool:
    """Is ``batch`` a dict in a tuple or list of one (``(batch,)``), where the dict itself was meant?"""
    return isinstance(batch, (tuple, list)) and len(batch) == 1 and isinstance(batch[0], Mapping)


#: a batch tensor named by position in a message: ``batch[1]``
_BATCH_POSITION = re.compile(r"\bbatch\[(\d+)\]")


@contextlib.contextmanager
def named_by_key(keys: tuple[str, ...] | None,
                 kinds: tuple[type[Exception], ...] = (TraceError,)) -> Iterator[None]:
    """Re-raise an error of ``kinds`` (each made from its message alone) that names a dict
    batch's tensor by its position in the step's tuple (``batch[1]``, remedy ``pass
    batch[1].to(torch.int64)``) naming it by key (``batch['labels']``), as the user wrote the
    batch; the same type, and cause."""
    try:
        yield
    except kinds as exc:
        text = str(exc)
        keyed = text if keys is None else _BATCH_POSITION.sub(
            lambda m: f"batch[{keys[int(m[1])]!r}]" if int(m[1]) < len(keys) else m[0], text)
        if keyed == text:
            raise
        raise type(exc)(keyed) from exc.__cause__


def tensors_of(batch: Mapping, keys: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors of a dict batch in the order of ``keys``, or ``TraceError`` naming what differs."""
    if set(batch) != set(keys):
        missing, extra = [k for k in keys if k not in batch], [k for k in batch if k not in keys]
        raise TraceError(
            f"the batch has keys {keys_shown(tuple(batch))}, but the step was traced with keys {keys_shown(keys)}"
            f"{f' (missing {keys_shown(tuple(missing))})' if missing else ''}"
            f"{f' (not traced: {keys_shown(tuple(extra))})' if extra else ''}; pass batches with the example's keys"
        )
    for key in keys:
        if not isinstance(key, str) or not isinstance(batch[key], torch.Tensor):
            what = f"key {key!r}" if not isinstance(key, str) else f"batch[{key!r}] is {a_type(batch[key])}"
            raise TraceError(
                f"a dict batch holds tensors under string keys, and {what}; drop the other fields from the batch "
                f"(such as raw text) or pass them to loss_fn another way (functools.partial)"
            )
    return tuple(batch[key] for key in keys)


def keys_shown(keys: tuple[object, ...]) -> str:
    return ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


# ---------------------------------------------------------------------------- batch checks
def batch_index(key: str) -> int:
    """``3`` for the slot key ``"batch[3]"``."""
    return int(key[len("batch[") : -1])


def check_arguments(model: object, loss_fn: object,
                    order: str = "remat.optimize(model, example_batch, loss_fn, budget=...)") -> None:
    """Refuse (``TraceError``) a model that is not an ``nn.Module`` remat can trace, or a
    ``loss_fn`` that is not callable, before anything else reads them; ``order``: the call whose
    order of arguments the message gives."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TraceError(
            f"the model is a TorchScript module ({type(model).__name__}, from torch.jit.script or torch.jit.trace), "
            f"whose Python forward remat cannot trace; pass the nn.Module it was made from"
        )
    if not isinstance(model, torch.nn.Module):
        swapped = " (model and loss_fn swapped?)" if isinstance(loss_fn, torch.nn.Module) else ""
        raise TraceError(
            f"the model is {a_type(model)}, not a torch.nn.Module{swapped}; pass the module itself (a state_dict: "
            f"load it into its module first), in the order {order}"
        )
    if not callable(loss_fn):
        raise TraceError(
            f"loss_fn is {a_type(loss_fn)}, not a function; pass a function loss_fn(model, *batch) that returns the "
            f"scalar loss, in the order {order}"
        )


def _as_batch(example_inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, Mapping):
        raise TraceError(
            f"the batch is {a_type(example_inputs)} (keys {keys_shown(tuple(example_inputs))}), but this step was "
            f"traced with a tuple of tensors; pass the tensors in the order the example batch had them"
        )
    if not isinstance(example_inputs, (torch.Tensor, tuple, list)):
        raise TraceError(
            f"the batch is {'None' if example_inputs is None else a_type(example_inputs)}; pass one example batch: a tensor, or a tuple or list of tensors "
            f"(as a DataLoader yields them)"
        )
    batch = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise TraceError(
                f"batch[{i}] is {a_type(t)}, not a tensor; pass the batch as a tuple of "
                f"tensors and bake other arguments into loss_fn (e.g. with functools.partial)"
            )
    return batch


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two tensors of one storage span common bytes?"""
    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        if t.numel() == 0:
            return start, start
        last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return start, start + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _input_name(key: str) -> str:
    return key if key.startswith("batch[") else f"the model's {key!r}"


def check_batch(spec: Sequence[TensorSpec], batch: Sequence[torch.Tensor]) -> None:
    """Raise ``TraceError`` unless ``batch`` has the traced shapes, dtypes and devices, and its
    tensors require grad where the traced example's did (the step computes the gradients of
    those, and of no other)."""
    if len(batch) != len(spec):
        raise TraceError(f"the batch has {len(batch)} tensors but the step was traced with {len(spec)}")
    for i, (s, t) in enumerate(zip(spec, batch)):
        if (tuple(t.shape), t.dtype, t.device) != (s.shape, s.dtype, s.device):
            differ = [what for what, now, then in (("shape", tuple(t.shape), s.shape), ("dtype", t.dtype, s.dtype),
                                                    ("device", t.device, s.device)) if now != then]
            remedy = (f"pass batch[{i}].to({s.dtype}) or " if differ == ["dtype"] else
                      f"pass batch[{i}].to({str(s.device)!r}) or " if differ == ["device"] else "")
            raise TraceError(
                f"batch[{i}] has shape {tuple(t.shape)}, {t.dtype} on {t.device} but the step was "
                f"traced with shape {s.shape}, {s.dtype} on {s.device}; a plan is made for its example's "
                f"{' and '.join(differ)} (its kernels, its memory): {remedy}trace (or optimize) again with an "
                f"example of this {' and '.join(differ)}"
            )
        if layout_of(t) != s.stride:
            traced_contiguous = s.stride == layout_of(torch.empty(s.shape, device="meta"))
            raise TraceError(
                f"batch[{i}] has strides {tuple(t.stride())} but the step was traced with an example batch[{i}] "
                f"of strides {s.stride} (its layout: views, in-place writes and gradients' layouts follow it, "
                f"so another layout computes something else); pass "
                + (f"batch[{i}].contiguous()" if traced_contiguous else f"a batch[{i}] of the example's layout")
                + " or trace (or optimize) again with an example of this layout"
            )
        if t.requires_grad != s.requires_grad:
            raise TraceError(
                f"batch[{i}] requires grad but the step was traced with an example batch[{i}] that "
                f"does not, so the step does not compute its gradient: trace (or optimize) again with "
                f"an example batch whose batch[{i}] requires grad"
                if t.requires_grad else
                f"batch[{i}] does not require grad but the step was traced with an example batch[{i}] "
                f"that does, so the step computes its gradient: pass a batch[{i}] that requires grad, "
                f"or trace (or optimize) again with an example batch whose batch[{i}] does not"
            )


# ---------------------------------------------------------------------------- tracing passes
def _fake_input(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """The fake tensor a placeholder is traced with. Meta tensors become fake CPU tensors:
    on the meta device some composite ops (``nll_loss``) bypass autograd under the python
    dispatcher and the backward silently vanishes; fake CPU tensors allocate nothing either."""
    if t.device.type != "meta":
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


class _Wrapper(torch.nn.Module):
    """Lets ``functional_call`` swap the model's tensors while the user's loss_fn calls it."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: torch.Tensor) -> object:
        handed = RegisteredTensors(self.model)
        loss = self.loss_fn(self.model, *batch)
        handed.check(self.model)
        return loss


def _last_node_name() -> str | None:
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return None
    last = next(iter(reversed(mode.tracer.graph.nodes)), None)  # an iterable, not an iterator, before 2.13
    return None if last is None else last.name


def _check_loss(loss: object) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TraceError(
            f"loss_fn returned {a_type(loss)}, not a tensor; it must return the loss as "
            f"a scalar tensor, e.g. `lambda model, x, y: F.cross_entropy(model(x), y)`"
        )
    if loss.numel() != 1:
        raise TraceError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; the loss must be a scalar: "
            f"reduce it with .mean() or .sum()"
        )
    if not loss.dtype.is_floating_point:
        raise TraceError(f"loss_fn returned a {loss.dtype} tensor; the loss must be floating point")
    if not loss.requires_grad:
        blocks = [b.name for b in traced_reentrant_blocks() if not b.grads]
        raise TraceError(
            "the loss does not depend on any trainable parameter (it has no grad_fn); " + (
                f"torch.utils.checkpoint({blocks[0]}, use_reentrant=True) got no input that requires grad, so, as in "
                f"eager PyTorch, nothing computed inside it gets a gradient: pass use_reentrant=False, which "
                f"computes the gradients of the parameters inside" if blocks else
                "check that loss_fn calls the model it is given and does not detach its output")
        )


def _refuse_checkpoint_writes(model: torch.nn.Module, writes: list[tuple[str, tuple[str, ...]]],
                              what: dict[str, tuple[str, str]]) -> None:
    """Refuse a ``torch.utils.checkpoint`` whose function modifies a buffer, a parameter or a
    batch tensor in place (``eager_ops.recording_checkpoint_writes``): eager PyTorch's backward
    runs the function again and modifies it a second time (a batch norm in training mode inside
    a checkpoint: ``num_batches_tracked`` 2 after one step, the running statistics updated
    twice), which the traced step, where the checkpoint is a plain call, would not, silently."""
    for function, placeholders in writes:
        shown = [what.get(p, ("tensor", p)) for p in placeholders]
        kind, key = shown[0]
        owner, _, attribute = key.rpartition(".")
        try:
            module = model.get_submodule(owner) if kind in ("parameter", "buffer") else None
        except AttributeError:
            module = None
        where = (f"{kind} {attribute!r} of {_where(owner, module)}" if module is not None
                 else f"the batch tensor {key}" if kind == "batch" else f"{kind} {key!r}")
        raise TraceError(
            f"torch.utils.checkpoint({function}) modifies {where} in place"
            f"{f' (and {len(shown) - 1} more)' if len(shown) > 1 else ''}: eager PyTorch's backward runs the "
            f"checkpointed function again and modifies it a second time (a batch norm in training mode updates its "
            f"running statistics twice), which remat's step, which runs the function once, does not reproduce; take "
            f"the module out of the checkpointed function (remat decides what to recompute itself, and updates "
            f"it once, as a model without checkpointing does), or call it in eval mode"
        )


def _trace_functional(model, loss_fn, trainable, frozen, buffer_keys, grad_inputs, flat, kinds_by_name, stashed=None,
                      grad_order=None):
    wrapper = _Wrapper(model, loss_fn)
    n_train, n_frozen, n_buf = len(trainable), len(frozen), len(buffer_keys)
    names = ["model." + k for k in trainable + frozen + buffer_keys]
    marks: dict[str, str | None] = {}
    depth = [0]

    def enter(module, args):
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1
        if depth[0] == 0:  # the end of (the last) model call: what follows is the loss
            marks["forward_end"] = _last_node_name()

    cache_enabled = torch.is_autocast_cache_enabled()  # make_fx turns it off; eager has it as the user set it
    originals = [model.get_parameter(k) for k in trainable + frozen]

    def step(*tensors):
        for t, p in zip(tensors[: n_train + n_frozen], originals):
            _dressed_as(t, p)
        batch = tensors[n_train + n_frozen + n_buf :]
        wrt = [*tensors[:n_train], *(batch[i] for i in grad_inputs)]  # (the batch's as eager: leaves)
        for t in wrt:
            t.requires_grad_(True)
        if grad_order is not None:  # (the order eager's backward finishes the parameters' gradients in)
            for i, t in enumerate(wrt[:n_train]):
                t.register_hook(lambda grad, i=i: grad_order.append(i))
        state = dict(zip(names, tensors[: n_train + n_frozen + n_buf]))
        with autocast_cache(cache_enabled), _refusing_backward():
            loss = torch.func.functional_call(wrapper, state, tuple(batch))
        _check_loss(loss)
        marks["backward_start"] = _last_node_name()
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        if all(g is None for g in grads):
            raise TraceError(
                "autograd produced no gradient for any trainable parameter although the loss "
                "requires grad; check that the loss is computed from the model's output"
            )
        return (loss, *grads)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        with enable_python_dispatcher(), tracing_as_eager(), _module_attributes_kept(model, stashed), \
                _fake_tensor_errors_unlogged():
            # detached aliases per pass: pass 1 marks its inputs requires_grad
            with recording_reentrant_blocks() as blocks, recording_checkpoint_writes() as writes:
                first = proxy_tensor.make_fx(step, tracing_mode="fake")(*(t.detach() for t in flat))
            phase_of = _phases(first, marks)
            placeholders = [n.name for n in first.graph.nodes if n.op == "placeholder"]
            kinds = ["parameter"] * (n_train + n_frozen) + ["buffer"] * n_buf
            _refuse_checkpoint_writes(model, writes, dict(zip(placeholders, [
                *zip(kinds, (k.removeprefix("model.") for k in names)),
                *(("batch", f"batch[{i}]") for i in range(len(placeholders) - len(names)))])))
            leaves = {placeholders[i]: f"parameter {trainable[i]!r}" for i in range(n_train)}
            leaves.update({placeholders[n_train + n_frozen + n_buf + i]: f"batch input {i}" for i in grad_inputs})
            refuse_leaves_shared_across_reentrant_blocks(
                first, blocks, leaves, {name for name, kind in phase_of.items() if kind is NodeKind.BACKWARD})
            carrier = _PhaseCarrier(first, phase_of, kinds_by_name)
            return proxy_tensor.make_fx(
                torch.func.functionalize(carrier.run, remove="mutations"), tracing_mode="fake"
            )(*(t.detach() for t in flat))
    except TraceError:
        raise
    except Exception as exc:  # translate torch's failure into one naming the construct and module
        raise explain_trace_failure(exc, model, loss_fn) from exc
    finally:
        for h in handles:
            h.remove()


def _dressed_as(stand_in: torch.Tensor, parameter: torch.Tensor) -> None:
    """Give a parameter's stand-in what the user's code may ask of the parameter: to be one
    (``isinstance(w, nn.Parameter)``, true of a tensor marked ``_is_param``) and its Python
    attributes (``w.scale``, a tag ``getattr(w, 'no_decay', False)``). A forward branching on
    them took the other branch while traced, and the step computed another loss from the
    first step on, silently."""
    if isinstance(parameter, torch.nn.Parameter):
        stand_in._is_param = True
    for key, value in vars(parameter).items():
        setattr(stand_in, key, value)


def _storages_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of the distinct storages of ``tensors`` (the parameters, buffers and batch)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage._cdata, storage.nbytes())
    return sum(seen.values())


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _fake_tensor_errors_unlogged() -> Iterator[None]:
    """Fake tensors log a failing op's whole traceback (twenty lines, before remat's own error,
    which names the op, the module and the line): not while a step is traced."""
    logger, quiet = logging.getLogger("torch._subclasses.fake_tensor"), _DropRecords()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextlib.contextmanager
def _refusing_backward() -> Iterator[None]:
    """Refuse ``backward()`` called while the model and ``loss_fn`` run (``loss.backward()``
    inside ``loss_fn``): eager's gradients would be those of that call added to those of the
    step's own backward, the traced step's only the latter (half of eager's, silently, for a
    ``loss_fn`` that called ``loss.backward()`` and returned ``loss``). ``torch.autograd.grad``
    (a gradient penalty) is not affected."""
    real = torch.autograd.backward

    def refused(*args: object, **kwargs: object) -> None:
        raise TraceError(
            "backward() was called while the model and loss_fn ran (loss.backward() inside loss_fn?): the step "
            "runs the backward pass itself, so return the loss from loss_fn without calling backward() on it "
            "(for a gradient the loss itself needs, such as a gradient penalty, use torch.autograd.grad)")

    torch.autograd.backward = refused
    try:
        yield
    finally:
        torch.autograd.backward = real


def _phases(gm: fx.GraphModule, marks: dict[str, str | None]) -> dict[str, NodeKind]:
    """Node kinds in the first trace: up to the end of the model call FORWARD, then LOSS,
    then BACKWARD (everything ``autograd.grad`` recorded)."""
    backward_start = marks.get("backward_start")
    forward_end = marks.get("forward_end") or backward_start
    kind, phase_of = NodeKind.FORWARD, {}
    for n in gm.graph.nodes:
        phase_of[n.name] = kind
        if n.name == forward_end and kind is NodeKind.FORWARD:
            kind = NodeKind.LOSS
        if n.name == backward_start:
            kind = NodeKind.BACKWARD
    return phase_of


class _PhaseCarrier(fx.Interpreter):
    """Replays the first trace under functionalization and labels every node the second
    trace records with the kind of the first-trace node that produced it."""

    def __init__(self, gm: fx.GraphModule, phase_of: dict[str, NodeKind], out: dict[str, NodeKind]) -> None:
        super().__init__(gm)
        self.phase_of = phase_of
        self.out = out

    def run_node(self, n: fx.Node) -> object:
        graph = proxy_tensor.get_proxy_mode().tracer.graph
        before = len(graph.nodes)
        result = super().run_node(n)
        added = len(graph.nodes) - before
        for new in itertools.islice(reversed(graph.nodes), max(added, 0)):
            self.out.setdefault(new.name, self.phase_of.get(n.name, NodeKind.BACKWARD))
        return result


# ---------------------------------------------------------------------------- graph rewrites
def _one_row(t: torch.Tensor) -> torch.Tensor:
    """A real tensor of ``t``'s dtype and device, one row of it (its first dimension 1)."""
    return torch.zeros([1, *t.shape[1:]] if t.dim() else [], dtype=t.dtype, device=t.device)


def _same(t: object) -> object:
    """A real tensor of ``t``'s shape, dtype and device (other arguments as they are)."""
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if isinstance(t, torch.Tensor) else t


def _one_row_probe(args: tuple, rows: tuple[int, ...] = (0,)) -> tuple:
    """A norm's arguments for a probe of its kernel: one row of the arguments at ``rows`` (its
    input; in a backward, the gradient and the input too), the others as they are."""
    return tuple(_one_row(a) if k in rows else _same(a) for k, a in enumerate(args))


_aten = torch.ops.aten
#: Ops whose kernels copy their first argument's whole storage (``clone_preserve_strides``).
_PRESERVING_STRIDES = frozenset({_aten.copy.default, _aten.slice_scatter.default, _aten.select_scatter.default,
                                 _aten.diagonal_scatter.default, _aten.as_strided_scatter.default})
#: Ops whose kernels allocate their output like their input, then resize it.
_OUTPUT_LIKE_INPUT = frozenset({_aten.im2col.default, _aten.col2im.default})
_STATISTICS = (1, 2)
_GRADIENTS = (0, 1, 2)


def _group_norm_probe(a: tuple) -> tuple:
    """native_group_norm(x, weight, bias, N, C, HxW, groups, eps): one sample, one position."""
    return (torch.zeros([1, a[4], 1], dtype=a[0].dtype, device=a[0].device), _same(a[1]), _same(a[2]), 1, a[4], 1,
            a[6], a[7])


def _group_norm_backward_probe(a: tuple) -> tuple:
    """native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, groups, mask): one
    sample, one position."""
    def sample(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
        return torch.zeros(shape, dtype=t.dtype, device=t.device)

    return (sample(a[0], [1, a[6], 1]), sample(a[1], [1, a[6], 1]), sample(a[2], [1, a[8]]), sample(a[3], [1, a[8]]),
            _same(a[4]), 1, a[6], 1, a[8], a[9])


#: Norms whose outputs PyTorch's fake kernels type otherwise than the device's kernels: per op,
#: its arguments for a one-row probe of the kernel and the outputs whose dtype the probe gives
#: (``KernelDtypeProp``). The forwards' statistics (mean and rstd; batch norm's saved mean and
#: inverse std) get a half-precision input's dtype, where the CPU kernels compute them in
#: float32 when the weight is float32; the backwards, reading those float32 statistics, type
#: the input's gradient float32 where the kernels give the input's dtype.
_NORM_PROBES: dict[object, tuple[Callable[[tuple], tuple], tuple[int, ...]]] = {
    _aten.native_layer_norm.default: (_one_row_probe, _STATISTICS),
    _aten.native_group_norm.default: (_group_norm_probe, _STATISTICS),
    **dict.fromkeys((_aten._batch_norm_with_update_functional.default, _aten._batch_norm_with_update.default,
                     _aten._native_batch_norm_legit_functional.default, _aten._native_batch_norm_legit.default,
                     _aten.native_batch_norm.default), (_one_row_probe, _STATISTICS)),
    # native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, mask)
    _aten.native_layer_norm_backward.default: (lambda a: _one_row_probe(a, rows=(0, 1, 3, 4)), _GRADIENTS),
    _aten.native_group_norm_backward.default: (_group_norm_backward_probe, _GRADIENTS),
    **dict.fromkeys((_aten.native_batch_norm_backward.default, _aten.batch_norm_backward.default),
                    (lambda a: _one_row_probe(a, rows=(0, 1)), _GRADIENTS)),
}


@contextlib.contextmanager
def _module_attributes_kept(model: torch.nn.Module, stashed: list[str] | None = None) -> Iterator[None]:
    """Every tensor a module's forward stores on it while traced (a recurrent state kept as an
    attribute, as RecurrentGemma's ``recurrent_states``; an output kept for logging,
    ``self.last = out.detach()``) is a fake tensor of the trace: afterwards each such attribute
    gets its value from before tracing back (or goes, if it had none), and ``stashed`` gets
    ``"module 'path' (Type) attribute 'name'"`` for it (the caller warns: ``step()`` will never
    set it). Left there, it was a fake tensor with a ``grad_fn`` on the user's model, which
    ``copy.deepcopy`` (and so ``check_step``) refused. Parameters and buffers are put back too:
    with a submodule registered under two names (``self.alias = self.mid``), ``functional_call``
    swaps its tensors in twice and back once, and left the user's model with fake parameters. A
    recurrent module's ``_flat_weights`` (the list its kernel reads, refreshed when a weight is
    swapped in) is rebuilt from the real weights: it kept the fakes, which ``gru._flat_weights[0]``
    handed the user and the stash warning reported."""
    paths = {id(m): path for path, m in model.named_modules()}
    before = [(m, dict(m.__dict__)) for m in model.modules()]
    registered = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        yield
    finally:
        for module, parameters, buffers in registered:
            for table, was in ((module._parameters, parameters), (module._buffers, buffers)):
                for name, value in was.items():
                    if table.get(name, _ABSENT) is not value:
                        table[name] = value
            if isinstance(module, torch.nn.RNNBase):  # (its list of weights, which the swap refreshed with fakes)
                module._init_flat_weights()
        for module, attributes in before:
            for name, value in list(module.__dict__.items()):
                if isinstance(value, torch.Tensor) and attributes.get(name, _ABSENT) is not value:
                    if stashed is not None:
                        stashed.append(f"{_describe_module(model, paths.get(id(module), ''))} attribute {name!r}")
                    if name in attributes:
                        setattr(module, name, attributes[name])
                    else:
                        delattr(module, name)


_ABSENT = object()


class KernelDtypeProp(FakeTensorProp):
    """``FakeTensorProp`` whose norm statistics have the dtype the device's kernel gives them.

    PyTorch's fake kernels of layer, group and batch norm give a half-precision input's
    statistics (mean and rstd; batch norm's saved mean and inverse std) the input's dtype; the
    CPU kernels compute them in float32 whenever the weight is float32 (a bfloat16 activation
    under autocast meeting a float32 norm), twice the bytes. Counted at the fake dtype, a planned
    step's measured peak exceeded its prediction, and its budget, by a few KiB (ALBERT under
    bfloat16 autocast: 0.3%; MobileViT's batch norms: 0.05%). Each such node's true dtypes are
    read off the kernel itself, run once on the device on one row of its input with the same
    dtypes (cached); the nodes reading the statistics (their clones, the backward) follow. The
    norms' backwards are probed too: reading float32 statistics, the fake group-norm backward
    typed the input's gradient float32 where the kernel gives the input's dtype, and a plan
    recomputing everything measured 10% below its prediction. A trace on the meta device keeps
    the fake dtypes: no kernel there says what the real device would do."""

    _probed: dict[tuple, tuple[torch.dtype | None, ...]] = {}

    def call_function(self, target, args, kwargs):
        kernel = fake_kernel(target)  # (traced with it: ``eager_ops.tracing_as_eager``)
        result = kernel(self._mode, *args, **kwargs) if kernel is not None else super().call_function(target, args, kwargs)
        if target in _PRESERVING_STRIDES:
            return self._copy_like_the_kernel(args[0], result)
        if target in _OUTPUT_LIKE_INPUT:
            return self._at_least_the_input(args[0], result)
        if target not in _NORM_PROBES or kwargs or not isinstance(result, tuple):
            return result
        outputs = _NORM_PROBES[target][1]
        if len(result) <= max(outputs):
            return result
        dtypes = self._kernel_dtypes(target, args)
        if dtypes is None or all(d is None or result[k] is None or result[k].dtype == d for k, d in zip(outputs, dtypes)):
            return result
        fixed = list(result)
        with self._mode:
            for k, d in zip(outputs, dtypes):
                if d is not None and isinstance(result[k], torch.Tensor) and result[k].dtype != d:
                    fixed[k] = torch.empty_like(result[k], dtype=d)
        return tuple(fixed)

    def _copy_like_the_kernel(self, dst: object, result: object) -> object:
        """``aten.copy(dst, src)`` (functionalization's form of ``dst.copy_(src)``) and the
        ``*_scatter`` ops (of ``dst[i] = src`` and the like) copy all of ``dst``'s storage and
        return the copy with ``dst``'s sizes, strides and offset (ATen's
        ``clone_preserve_strides``); the fake kernels allocate ``dst``'s elements alone. For
        ``shifted[:, 1:] = ids[:, :-1]`` (BART's decoder inputs) that was one row short; for
        BEiT's relative position index, a scatter into one row of a matrix, 1/17 of it."""
        if not (isinstance(dst, torch.Tensor) and isinstance(result, torch.Tensor)) or dst.device.type == "meta":
            return result
        nbytes = dst.untyped_storage().nbytes()
        if nbytes == result.untyped_storage().nbytes() or torch._debug_has_internal_overlap(dst) == 1:
            return result  # (1: MemOverlap::Yes, where ATen clones plainly)
        return self._with_storage(dst, nbytes, result)

    def _at_least_the_input(self, x: object, result: object) -> object:
        """``im2col`` and ``col2im`` (``nn.Unfold``, ``nn.Fold`` and their backwards) allocate their
        output like their input and resize it, so its storage keeps the input's bytes when the
        output is smaller; the fake kernels allocate the output's own. ConvBERT's span convolution
        (an unfold over 9 positions) was counted at 1/9 of what its backward's ``col2im`` holds."""
        if not (isinstance(x, torch.Tensor) and isinstance(result, torch.Tensor)) or x.device.type == "meta":
            return result
        nbytes = x.numel() * x.element_size()
        if result.untyped_storage().nbytes() >= nbytes:
            return result
        return self._with_storage(result, nbytes, result)

    def _with_storage(self, like: torch.Tensor, nbytes: int, result: torch.Tensor) -> torch.Tensor:
        """A fake tensor with ``like``'s dtype, sizes, strides and offset on a storage of
        ``nbytes`` (``result``, the fake kernel's, where they do not divide evenly)."""
        if nbytes % like.element_size():
            return result
        with self._mode:
            whole = torch.empty(nbytes // like.element_size(), dtype=like.dtype, device=like.device)
            return whole.as_strided(like.shape, like.stride(), like.storage_offset())

    @classmethod
    def _kernel_dtypes(cls, target, args) -> tuple[torch.dtype | None, ...] | None:
        """The dtypes the device's kernel gives ``target``'s probed outputs (None for an output
        it does not compute), or None when they cannot be known."""
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.device.type == "meta":
            return None
        build, outputs = _NORM_PROBES[target]
        key = (target, *((a.dtype, a.device, tuple(a.shape)) if isinstance(a, torch.Tensor)
                         else a if isinstance(a, (int, float, bool, type(None))) else tuple(a) for a in args))
        if key not in cls._probed:  # (the probe is built on a miss alone: it allocates real tensors)
            try:
                with untraced():
                    out = target(*build(args))
            except Exception as exc:  # noqa: BLE001 - an unusual call: its fake dtypes stay
                log.debug("trace: probing %s for its outputs' dtypes failed (%s)", target, exc)
                return None
            cls._probed[key] = tuple(out[k].dtype if isinstance(out[k], torch.Tensor) else None for k in outputs)
        return cls._probed[key]


def _lift_constants(gm: fx.GraphModule, inputs: list[InputSlot]) -> list[torch.Tensor]:
    """Turn ``get_attr`` tensor constants into trailing placeholders (role CONSTANT), so every
    tensor a step reads is an input whose bytes count in ``fixed_bytes``."""
    constants = []
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    last_placeholder = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for attr in attrs:
        value = getattr(gm, attr.target)
        with gm.graph.inserting_after(last_placeholder):
            ph = gm.graph.placeholder(f"const_{attr.target.lstrip('_')}")
        ph.meta.update(attr.meta)
        attr.replace_all_uses_with(ph)
        gm.graph.erase_node(attr)
        delattr(gm, attr.target)
        last_placeholder = ph
        constants.append(value)
        inputs.append(InputSlot(InputRole.CONSTANT, attr.target, ph.name))
    return constants


class _RefusedIterator:
    """Stands in for an iterator a module holds, or a global or closure variable the step's code
    names, while the step is traced: advancing it refuses the step (before it takes a value, so
    the iterator is as it was)."""

    def __init__(self, what: str, inner: object) -> None:
        self._what, self._inner = what, inner

    def __iter__(self) -> _RefusedIterator:
        return self

    def __next__(self):
        raise TraceError(
            f"{self._what} is an iterator the step advances (next()): a traced step runs no Python, so every "
            f"step would reuse the value it gave when traced, while eager PyTorch takes the next one at each step; "
            f"advance it outside the model and loss_fn and pass the value in the batch, as a tensor")

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __repr__(self) -> str:  # (an ``itertools.count``'s state shows in its repr: compared as a counter)
        return repr(self._inner)


@contextlib.contextmanager
def _iterators_refused(named: Sequence[tuple[str, Callable[[], object], Callable[[object], None]]]):
    """Every iterator of ``named`` (``PythonState.iterators``: those a module holds as an
    attribute, an ``itertools.cycle`` of temperatures or a generator, and the globals and
    closure variables the step's functions name) replaced by a ``_RefusedIterator`` while the
    block runs, and put back after it: a traced step advanced by ``next()`` kept its first
    value at every step, silently."""
    put = []
    for label, read, write in named:
        value = read()
        if _iterator(value):
            put.append((read, write, value))
            write(_RefusedIterator(label, value))
    try:
        yield
    finally:
        for read, write, value in put:
            if isinstance(read(), _RefusedIterator):
                write(value)


@contextlib.contextmanager
def _emptied(caches: Sequence[object]):
    """Empty each ``functools.lru_cache`` of ``caches`` (``PythonState.caches``) before the block
    and after it: the trace would otherwise read a tensor cached by an eager call before it (a
    tensor that is no input of the step) and leave its own stand-ins cached for the next eager
    call (a causal mask cached as a fake tensor failed the user's evaluation pass). An
    ``lru_cache`` returns what its function computes, so emptying it changes no result."""
    for cache in caches:
        cache.cache_clear()
    try:
        yield
    finally:
        for cache in caches:
            cache.cache_clear()


def _input_writes(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``copy_`` nodes through which a functionalized graph writes an input in place (into
    its placeholder)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
            and n.args[0].op == "placeholder"]


def _written_inputs(gm: fx.GraphModule, slot_keys: list[str]) -> set[str]:
    """The inputs (parameters, buffers, batch tensors: ``slot_keys``, in placeholder order) a
    traced graph writes in place."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    key = dict(zip(placeholders, slot_keys))
    return {key[n.args[0].name] for n in _input_writes(gm) if n.args[0].name in key}


def _output_slots(gm: fx.GraphModule, trainable: list[str], grad_inputs: list[str],
                  inputs: list[InputSlot]) -> list[OutputSlot]:
    """Name the outputs (the loss, the trainable parameters' gradients, the gradients of the
    batch tensors ``grad_inputs`` names) and move input mutations (``copy_`` into a placeholder
    at the end) to extra outputs, so the graph is functional and recomputing never sees a
    mutated input."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    values = _output_values(gm)
    slot_of = {s.fx_name: s for s in inputs}
    slots = [OutputSlot(OutputRole.LOSS, "loss", values[0].name)]
    roles = [OutputRole.GRAD] * len(trainable) + [OutputRole.INPUT_GRAD] * len(grad_inputs)
    slots += [OutputSlot(r, k, v.name if v is not None else None)
              for r, k, v in zip(roles, trainable + grad_inputs, values[1:], strict=True)]
    for n in _input_writes(gm):
        target, source = n.args[0], n.args[1]
        slots.append(OutputSlot(OutputRole.UPDATE, slot_of[target.name].key, source.name))
        values.append(source)
        gm.graph.erase_node(n)
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            raise TraceError(
                f"op {n.target} (node {n.name!r}) still mutates a tensor after functionalization; "
                f"remat plans functional graphs only: replace the in-place op in the model"
            )
    out_node.args = (tuple(values),)
    return slots


def _output_values(gm: fx.GraphModule) -> list[fx.Node | None]:
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    return list(tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))


def _rename_outputs(gm: fx.GraphModule, slots: list[OutputSlot]) -> list[OutputSlot]:
    """Slots naming the fx nodes the output node reads now (rewrites replace some)."""
    values = _output_values(gm)
    return [OutputSlot(s.role, s.key, None if v is None else v.name) for s, v in zip(slots, values, strict=True)]
