"""An AOTAutograd joint graph as a remat ``Graph``, for the ``torch.compile`` backend.

AOTAutograd hands a partitioner one functional, aten-level fx graph of forward and backward:
placeholders ``primals_*`` (parameters, buffers, inputs) and ``tangents_*`` (the gradients
flowing into the forward's outputs), and one output tuple whose first ``num_fwd_outputs``
values are the forward's outputs (user outputs, updated buffers) and the rest the input
gradients. ``prepare`` turns it into a planning copy whose node ids are a topological order
with every forward node first:

* forward nodes: the ancestors of the forward outputs (and random ops that depend on no
  tangent, so that the random stream advances as in eager PyTorch);
* one marker node per used tangent, which owns the tangent's bytes (a tangent exists only
  once the backward starts, so it is not ``fixed_bytes``), and cannot be recomputed;
* backward nodes: every other ancestor of the gradients.

Frontier-advancing stages then split exactly where AOTAutograd splits: stages up to the
last forward node run in the forward graph, later stages in the backward graph. Storages,
views and multi-output ops follow the tracer's rules (``fx_graph.build_graph``,
``fx_graph.split_multi_outputs``), so the simulator counts what torch allocates.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput

from remat import fx_graph
from remat.errors import RematError
from remat.graph import Graph, NodeKind

log = logging.getLogger(__name__)


class UnsupportedJointGraph(RematError):
    """A joint graph the backend does not plan; the message is the reason (the backend then
    warns and uses PyTorch's partitioner)."""


def tangent_marker(x: torch.Tensor) -> torch.Tensor:
    """Identity standing for "the tangent arrives here" in planning copies (never in the
    graphs that run)."""
    return x


@dataclass(frozen=True, eq=False)
class JointStep:
    """A joint graph prepared for planning.

    ``module`` is the planning copy; graph node i is its call_function node
    ``node_names[i]``. Ids below ``n_forward`` are forward nodes. ``tangent_dependent``: ids
    that read a tangent directly or indirectly (never computable in the forward).
    ``fwd_outputs``/``bwd_outputs`` are the planning copy's output values (fx nodes, None or
    constants) with AOTAutograd's descriptors. ``constants``: (placeholder name, attribute)
    for tensors the joint graph reads with get_attr. ``mutations``: (primal name, node of its
    new value) for the input mutations the forward ends with. ``mutated_inputs``: every primal
    overwritten after the forward (by those copies or by AOTAutograd's runtime).
    """

    graph: Graph
    module: fx.GraphModule
    node_names: tuple[str, ...]
    storage_owners: tuple[tuple[int, ...], ...]
    random_nodes: tuple[int, ...]
    n_forward: int
    tangent_dependent: frozenset[int]
    primals: tuple[fx.Node, ...]
    tangents: tuple[fx.Node, ...]
    constants: tuple[tuple[str, str], ...]
    mutations: tuple[tuple[str, fx.Node], ...]
    mutated_inputs: frozenset[str]
    fwd_outputs: tuple[object, ...]
    bwd_outputs: tuple[object, ...]
    fwd_output_descs: tuple[object, ...]
    bwd_output_descs: tuple[object, ...]
    joint_placeholders: tuple[fx.Node, ...]
    joint: fx.GraphModule

    def fx_node(self, i: int) -> fx.Node:
        return self._fx_nodes[i]

    def node_id(self, n: fx.Node) -> int | None:
        return self._ids.get(n)

    def is_alias(self, i: int) -> bool:
        """Node i allocates nothing: every output shares a storage created elsewhere."""
        return i not in self.storage_owners[i] and self.graph.nodes[i].out_bytes == 0

    @functools.cached_property
    def _fx_nodes(self) -> tuple[fx.Node, ...]:
        by_name = {n.name: n for n in self.module.graph.nodes}
        return tuple(by_name[name] for name in self.node_names)

    @functools.cached_property
    def _ids(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self._fx_nodes)}


# ---------------------------------------------------------------------------- checks
_HARMLESS_IMPURE = frozenset(
    {
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten._assert_async.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten.sym_constrain_range_for_size.default,
    }
)


def _is_tangent(n: fx.Node) -> bool:
    return n.op == "placeholder" and "tangents" in str(n.target)


def mutated_inputs(joint: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """The placeholders of the inputs the joint graph's forward modifies in place (a buffer
    updated under ``no_grad``, batch norm's running statistics): in the graph (epilogue copies)
    or by AOTAutograd's runtime (forward outputs describing an input mutation)."""
    nodes = list(joint.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    descs = list(out.meta.get("desc") or [])[:num_fwd_outputs]
    mutated_descs = [d.mutated_input for d in descs if isinstance(d, InputMutationAOTOutput)]
    return ({n.args[0].name for n in nodes if _is_epilogue_copy(n)}
            | {p.name for p in nodes if p.op == "placeholder" and p.meta.get("desc") in mutated_descs})


def _is_epilogue_copy(n: fx.Node) -> bool:
    """``copy_(primal, new_value)`` with no user: AOTAutograd keeping an input mutation (batch
    norm's running statistics) in the graph, to run once at the end of the forward."""
    return (
        n.op == "call_function"
        and n.target is torch.ops.aten.copy_.default
        and isinstance(n.args[0], fx.Node)
        and n.args[0].op == "placeholder"
        and not _is_tangent(n.args[0])
        and not n.users
    )


def _check_supported(joint: fx.GraphModule) -> None:
    for n in joint.graph.nodes:
        if n.op == "placeholder":
            target = str(n.target)
            if any(k in target for k in ("fwd_seed", "fwd_base_offset", "bwd_seed", "bwd_base_offset")):
                raise UnsupportedJointGraph(
                    f"the joint graph has functionalized-rng inputs ({n.name}) because "
                    f"torch._functorch.config.functionalize_rng_ops is on; remat replays random ops "
                    f"itself: turn that option off"
                )
        if n.op == "get_attr" and not isinstance(getattr(joint, str(n.target), None), torch.Tensor):
            raise UnsupportedJointGraph(f"node {n.name!r} reads a submodule (get_attr {n.target}: a higher-order op)")
        if n.op == "call_module":
            raise UnsupportedJointGraph(f"node {n.name!r} calls a submodule")
        for t in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                isinstance(t, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))
            ):
                raise UnsupportedJointGraph(
                    f"node {n.name!r} has symbolic (dynamic) shapes, which remat cannot size; shapes "
                    f"become symbolic when dynamo compiles for several sizes (compile with "
                    f"torch.compile(..., dynamic=False), and do not mark_dynamic an input) or when an op's "
                    f"output size depends on values (nonzero, boolean masks: a fixed-shape form such as "
                    f"torch.where plans)"
                )
        layout = fx_graph.non_strided_layout(n)
        if layout is not None:
            raise UnsupportedJointGraph(
                f"node {n.name!r} ({n.target}) makes a {layout} tensor (an embedding with sparse=True "
                f"gives a sparse gradient); remat plans dense tensors only, whose bytes it counts: set "
                f"sparse=False for remat to plan this graph"
            )
        if n.op != "call_function":
            continue
        if "val" not in n.meta:
            raise UnsupportedJointGraph(f"node {n.name!r} ({n.target}) has no fake-tensor metadata to size it")
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable and not _is_epilogue_copy(n):
            raise UnsupportedJointGraph(f"node {n.name!r} runs the mutating op {n.target}; remat plans functional graphs only")
        if n.target is torch.ops.higher_order.run_and_save_rng_state or n.target is torch.ops.higher_order.run_with_rng_state:
            raise UnsupportedJointGraph(f"node {n.name!r} already replays random state ({n.target})")


# ---------------------------------------------------------------------------- preparation
def _closure(roots: list[fx.Node]) -> set[fx.Node]:
    """The call_function nodes among ``roots`` and all their ancestors."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _depends_on(sources: set[fx.Node], nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes (in topological order ``nodes``) that read one of ``sources`` transitively."""
    hit = set(sources)
    for n in nodes:
        if any(a in hit for a in n.all_input_nodes):
            hit.add(n)
    return hit - set(sources)


def _sink_tangent_free(g: fx.Graph, backward: list[fx.Node], markers: set[fx.Node]) -> None:
    """Move each pure backward node that reads no tangent to just before its first reader.

    AOTAutograd puts some of them (``detach`` of what attention saves for its backward) right
    after the forward. The plan's stages follow the node order, so there they would pin every
    layer's saved values from the end of the forward to the start of the backward; next to their
    reader, a plan may recompute those values where they are needed.
    """
    reads_tangent = _depends_on(markers, list(g.nodes))
    for n in reversed(backward):
        if n in reads_tangent or fx_graph.is_random(n) or n.is_impure() or not n.users:
            continue
        order = {m: k for k, m in enumerate(g.nodes)}
        first = min(n.users, key=order.__getitem__)
        if first.op != "output" and order[first] > order[n] + 1:
            first.prepend(n)


def _fake_like(val: torch.Tensor) -> torch.Tensor:
    """A fake tensor with ``val``'s metadata and a storage of its own."""
    with val.fake_mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _storages(value: object) -> set[int]:
    return {t.untyped_storage()._cdata for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}


def _fill_missing_vals(gm: fx.GraphModule) -> None:
    """Fake values for the clones ``fx_graph.split_multi_outputs`` inserted, and new ones for
    the views taken of them.

    A clone replaces an output of a multi-output op in that output's readers, whose fake values
    were propagated before: a view of the clone (the ``detach`` of a group norm's statistics
    that its backward reads, and the ``detach`` of that) still shared the op's storage, so the
    view was counted as pinning the op instead of the clone. A plan could then free the clone
    while the view lived on, and the split found the view's source gone (``ScheduleError``:
    the clone "is read in the backward graph after the plan freed it"). Each such view is
    propagated again from the clone, views of views in turn; readers that allocate their own
    storage keep their values (and the kernels' sizes ``count_as_kernels`` gave them).
    """
    moved: dict[fx.Node, set[int]] = {}  # node given a new value -> the storages its old one shared
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if "val" not in n.meta:  # a clone: its readers' values shared its input's storage
            old = _storages(n.args[0].meta.get("val"))
        else:  # a view of a node given a new value, still sharing that node's old storage
            old = _storages(n.meta["val"])
            if not old or not any(old & moved.get(a, set()) for a in n.all_input_nodes):
                continue
        args = pytree.tree_map_only(fx.Node, lambda a: a.meta["val"], (n.args, n.kwargs))
        fake = next(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)).fake_mode
        with fake:
            n.meta["val"] = n.target(*args[0], **args[1])
        moved[n] = old


def count_as_kernels(joint: fx.GraphModule) -> None:
    """Give the joint graph's nodes the fake values the tracer's final propagation gives
    (``trace.KernelDtypeProp``): where a kernel sizes an output otherwise than its fake kernel
    (mixed-precision norm statistics and gradients, copies and scatters into views, im2col and
    col2im), the value counts what the kernel allocates. Left as AOTAutograd gave them when the
    graph's inputs are not all fake tensors of one mode (symbolic sizes) or the propagation
    fails."""
    from torch._guards import detect_fake_mode

    from remat.trace import KernelDtypeProp

    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    vals = [p.meta.get("val") for p in placeholders]
    mode = detect_fake_mode(vals) if all(isinstance(v, torch.Tensor) for v in vals) else None
    if mode is None:
        return
    before = {n: n.meta["val"] for n in joint.graph.nodes if "val" in n.meta}

    class Prop(KernelDtypeProp):
        def get_attr(self, target, args, kwargs):  # a lifted constant: real, made fake here
            value = super().get_attr(target, args, kwargs)
            return self._mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    try:
        Prop(joint, mode).propagate_dont_convert_inputs(*vals)
    except Exception as exc:  # noqa: BLE001 - keep AOTAutograd's values, all of them
        for n in joint.graph.nodes:
            if n in before:
                n.meta["val"] = before[n]
        log.debug("backend: propagating the kernels' output sizes failed (%s); AOTAutograd's are kept", exc)


def replayable(n: fx.Node) -> bool:
    """Can a recomputation of random node ``n`` replay its generator state? Only ops that
    draw from the device's default generator on CPU or CUDA."""
    if fx_graph.explicit_generator(n) is not None or not isinstance(n.target, torch._ops.OpOverload):
        return False
    devices = {t.device.type for t in pytree.tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor)}
    return devices <= {"cpu", "cuda"} and bool(devices)


def prepare(joint: fx.GraphModule, num_fwd_outputs: int, name: str = "joint") -> JointStep:
    """The planning copy of ``joint`` and its ``Graph`` (all costs 0; the backend sets them).

    Raises ``UnsupportedJointGraph`` naming what the backend cannot plan.
    """
    _check_supported(joint)
    count_as_kernels(joint)
    nodes = list(joint.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    outputs = pytree.arg_tree_leaves(*out_node.args)
    descs = list(out_node.meta.get("desc") or [None] * len(outputs))
    fwd_outs, bwd_outs = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    tangents = [p for p in placeholders if _is_tangent(p)]
    used_tangents = [t for t in tangents if t.users]
    if not used_tangents or not any(isinstance(o, fx.Node) for o in bwd_outs):
        raise UnsupportedJointGraph("the graph has no backward to plan (no gradient reads a tangent)")
    epilogue = [n for n in nodes if _is_epilogue_copy(n)]
    mutated = mutated_inputs(joint, num_fwd_outputs)
    compute = [n for n in nodes if n.op == "call_function" and n not in epilogue]
    tangent_dep = _depends_on(set(tangents), compute)
    if any(c.args[1] in tangent_dep for c in epilogue):
        raise UnsupportedJointGraph("an input mutation depends on the backward (a mutation in a custom backward)")
    random_free = [n for n in compute if fx_graph.is_random(n) and n not in tangent_dep]
    sources = [c.args[1] for c in epilogue]
    forward = _closure([*fwd_outs, *sources, *random_free])
    # outputs of forward multi-output ops that only the backward reads (dropout's mask, batch
    # norm's statistics) are picked in the forward, so that their clones (below) run there and
    # the op's other outputs can be freed before the backward
    forward |= {n for n in compute if n.target is operator.getitem and n.args[0] in forward}
    if forward & tangent_dep:
        bad = next(n for n in compute if n in forward and n in tangent_dep)
        raise UnsupportedJointGraph(f"forward node {bad.name!r} reads a tangent")
    needed = forward | _closure(bwd_outs)
    for n in compute:
        if n not in needed and n.is_impure() and n.target not in _HARMLESS_IMPURE and not fx_graph.is_random(n):
            raise UnsupportedJointGraph(f"node {n.name!r} ({n.target}) has side effects and no use")

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env[p] = g.node_copy(p)
        if _is_tangent(p):  # the marker owns the tangent's bytes, not the placeholder
            env[p].meta = {k: v for k, v in p.meta.items() if k not in ("val", "tensor_meta")}
    constants = []
    for c in (n for n in nodes if n.op == "get_attr"):  # lifted like trace does: fixed bytes
        env[c] = g.placeholder(f"const_{c.name}")
        env[c].meta = dict(c.meta)
        constants.append((env[c].name, str(c.target)))
    kinds: dict[str, NodeKind] = {}
    for n in compute:
        if n in forward:
            env[n] = g.node_copy(n, lambda a: env[a])
            kinds[env[n].name] = NodeKind.FORWARD
    marker_of: dict[fx.Node, fx.Node] = {}
    for t in used_tangents:
        m = g.create_node("call_function", tangent_marker, (env[t],), name=f"{t.name}_arrives")
        m.meta["val"] = _fake_like(t.meta["val"])
        marker_of[t] = m
        kinds[m.name] = NodeKind.BACKWARD
    backward = []
    for n in compute:
        if n in needed and n not in forward:
            env[n] = g.node_copy(n, lambda a: marker_of.get(a) or env[a])
            kinds[env[n].name] = NodeKind.BACKWARD
            backward.append(env[n])
    _sink_tangent_free(g, backward, set(marker_of.values()))
    # mutation sources are outputs of the plan: live until the forward's end copies them
    mapped = [env[o] if isinstance(o, fx.Node) else o for o in [*outputs, *sources]]
    g.output(tuple(mapped))
    gm = fx.GraphModule(joint, g)
    fx_graph.split_multi_outputs(gm, kinds)
    _fill_missing_vals(gm)
    gm.graph.lint()
    gm.recompile()
    graph, node_names, owners, random_nodes = fx_graph.build_graph(gm, kinds, name, replay_rng=True)
    fx_by_name = {n.name: n for n in gm.graph.nodes}
    markers = {m.name for m in marker_of.values()}
    nodes_out = list(graph.nodes)
    # tangents arrive once; some random ops cannot replay; collectives run once on every rank
    for i, nm in enumerate(node_names):
        if nm in markers or (i in random_nodes and not replayable(fx_by_name[nm])) or fx_graph.is_collective(fx_by_name[nm]):
            nodes_out[i] = replace(nodes_out[i], recomputable=False)
    # The caller may modify a forward output in place before the backward runs (eager and
    # torch.compile allow it wherever autograd saved no part of it), and AOTAutograd hands an
    # output that views an intermediate over as a new tensor sharing the storage, so no version
    # counter check would see that change. A forward node reading an output's storage is
    # therefore computed once, in the forward: recomputed in the backward, it read the changed
    # values (gradients 12% off, silently).
    ids = {nm: i for i, nm in enumerate(node_names)}
    visible = {o for v in fwd_outs if isinstance(v, fx.Node) and env[v].name in ids
               for o in owners[ids[env[v].name]]}
    for i, node in enumerate(nodes_out):
        if kinds[node_names[i]] is NodeKind.FORWARD and i not in visible and visible.intersection(node.deps) \
                and i in owners[i]:  # (views derive from their base where read)
            nodes_out[i] = replace(node, recomputable=False)
    graph = Graph(nodes=tuple(nodes_out), fixed_bytes=graph.fixed_bytes, outputs=graph.outputs, name=name)
    n_forward = next((i for i, nm in enumerate(node_names) if kinds[nm] is NodeKind.BACKWARD), len(node_names))
    final_outs = pytree.arg_tree_leaves(*next(n for n in gm.graph.nodes if n.op == "output").args)
    n_out = len(outputs)
    dep = _depends_on({fx_by_name[m] for m in markers}, [fx_by_name[nm] for nm in node_names])
    return JointStep(
        graph=graph,
        module=gm,
        node_names=node_names,
        storage_owners=owners,
        random_nodes=random_nodes,
        n_forward=n_forward,
        tangent_dependent=frozenset({ids[m] for m in markers} | {ids[n.name] for n in dep}),
        primals=tuple(env[p] for p in placeholders if not _is_tangent(p)),
        tangents=tuple(env[t] for t in tangents),
        constants=tuple(constants),
        mutations=tuple((c.args[0].name, src) for c, src in zip(epilogue, final_outs[n_out:])),
        mutated_inputs=frozenset(mutated),
        fwd_outputs=tuple(final_outs[:num_fwd_outputs]),
        bwd_outputs=tuple(final_outs[num_fwd_outputs:n_out]),
        fwd_output_descs=tuple(descs[:num_fwd_outputs]),
        bwd_output_descs=tuple(descs[num_fwd_outputs:]),
        joint_placeholders=tuple(placeholders),
        joint=joint,
    )


def replay_state_bytes(step: JointStep, compute_counts: object) -> int:
    """The bytes of generator states a plan holds in the budgeted memory: a random op the plan
    runs more than once saves its generator's state at its first run and holds it to its last.
    On the CPU that state is a tensor of the CPU generator's size (5,056 B); a CUDA
    generator's state is host memory, outside a CUDA budget. The simulator does not see it,
    so the backend adds it to a plan's peak (uncounted, regions measured 5 KiB per replayed op
    over their budget). A replay also takes the generator's current state aside while it runs:
    one state more, counted as if at the peak."""
    replayed = [i for i in step.random_nodes if compute_counts[i] > 1]
    on_cpu = sum(1 for i in replayed if any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                           for t in pytree.tree_leaves(step.fx_node(i).meta.get("val"))))
    state = torch.get_rng_state()
    return (on_cpu + 1 if on_cpu else 0) * state.numel() * state.element_size()


def most_replay_state_bytes(step: JointStep) -> int:
    """``replay_state_bytes`` of a plan that replays every random op it may recompute: the most
    any plan of the graph holds."""
    return replay_state_bytes(step, [2 if node.recomputable else 1 for node in step.graph.nodes])


# ---------------------------------------------------------------------------- real inputs
def example_inputs(step: JointStep) -> list[torch.Tensor]:
    """Real values for the planning copy's placeholders, to time nodes with: normal floats,
    zero integers (valid indices and labels), false booleans; the graph's own constants."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    fake_of = {p.name: p.meta["val"] for p in step.joint_placeholders}
    constant_of = dict(step.constants)
    values = []
    with unset_fake_temporarily(), torch.utils._mode_utils.no_dispatch():
        gen = torch.Generator().manual_seed(0)
        for p in step.module.graph.find_nodes(op="placeholder"):
            if p.name in constant_of:
                values.append(getattr(step.joint, constant_of[p.name]))
                continue
            val = fake_of[p.name]
            t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
            if val.dtype.is_floating_point or val.dtype.is_complex:
                t.copy_(torch.randn(val.shape, generator=gen, dtype=val.dtype))
            else:
                t.zero_()
            values.append(t)
    return values
