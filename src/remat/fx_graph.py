"""From a traced fx graph to a ``Graph``: the passes the tracer and the compiler backend share.

Memory follows storages, not nodes: a node owns the bytes of the storages it creates; a view
(or any output sharing an existing storage) owns none and makes its users depend on the
storage's owner, so a plan keeps the owner alive exactly as long as torch would. Small
outputs of multi-output ops are cloned apart so that a large sibling is not held to the end.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from remat.graph import Graph, Node, NodeKind


def is_random(n: fx.Node) -> bool:
    return n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


def explicit_generator(n: fx.Node, gm: fx.GraphModule | None = None) -> object | None:
    """The generator node ``n`` is handed (``torch.rand(..., generator=g)``), None where it draws
    from the device's default one. A ``get_attr`` argument is resolved in ``gm`` where given;
    otherwise, or where it does not resolve, the fx node itself stands for the generator.
    remat replays only default generators' states, so such an op cannot be recomputed."""
    if n.op != "call_function":
        return None
    for a in (*n.args, *n.kwargs.values()):
        if isinstance(a, fx.Node) and a.op == "get_attr" and gm is not None:
            value = _attribute(gm, str(a.target))
            if isinstance(value, torch.Generator):
                return value
        elif isinstance(a, torch.Generator):
            return a
    return n.kwargs.get("generator")


def _attribute(root: object, dotted: str) -> object | None:
    for part in dotted.split("."):
        root = getattr(root, part, None)
    return root


#: torch.distributed's functional collectives (what dynamo traces ``all_gather``,
#: ``reduce_scatter``, ``all_reduce`` and their ``wait_tensor`` into).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def is_collective(n: fx.Node) -> bool:
    """A collective runs once per step on every rank, in the same order: never recomputed
    (a rank that recomputed one alone would wait forever for the others)."""
    return n.op == "call_function" and getattr(n.target, "namespace", None) in COLLECTIVE_NAMESPACES


def _returns_its_input(n: fx.Node) -> bool:
    """``wait_tensor`` hands back the very tensor it waits for, though its fake value has a
    storage of its own: it owns no bytes."""
    return n.op == "call_function" and str(n.target) == "_c10d_functional.wait_tensor.default"


def dead_code_elimination(gm: fx.GraphModule) -> None:
    """Remove unused nodes, except random ones: dropping one would shift every later random
    number and the step would no longer match eager PyTorch."""
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and not n.users and not is_random(n):
            gm.graph.erase_node(n)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def non_strided_layout(n: fx.Node) -> torch.layout | None:
    """The layout of the first tensor node ``n`` makes that is not dense (strided), or None. A
    sparse tensor (the gradient of an embedding with ``sparse=True``) has no storage whose bytes
    ``build_graph`` could count, so both routes refuse such a graph before building it, each
    naming the remedy in its own terms."""
    return next((t.layout for t in _tensors(n.meta.get("val")) if t.layout is not torch.strided), None)


def split_multi_outputs(gm: fx.GraphModule, kinds: dict[str, NodeKind]) -> None:
    """Clone small outputs of multi-output ops that outlive a larger sibling.

    A plan frees a node's outputs together, so batch norm's saved statistics (needed in the
    backward) would keep its large normalized output alive all step, dropout's mask its output
    and a weight gradient the input gradient of ``convolution_backward`` to the end. An explicit
    clone of the small long-lived output lets the op's node be freed with the large one, except
    what a backward op returns from the step (a weight gradient): ``build_graph`` counts that as
    the op's ``kept_bytes``, so the op's other outputs are freed without a copy.

    The clone is made as late as it can be: right after the last reader of the outputs that
    are not cloned (``_when_the_op_dies`` chooses which), so the readers after it read the
    clone and the op is freed there. Eager PyTorch holds each output until its own last reader
    and makes no copy; the plan holds the copy beside the original for that one step, where
    the original's other outputs, dead in eager, still count (the prediction is then above the
    measured step, never below). Made right after the op, the copy was held beside the original
    through the whole forward pass: a dropout's mask twice from the forward pass to the
    backward of the layer after it. An output the forward returns (a loss, a running
    statistic) is cloned right after the op, where ``_worth_cloning`` finds it frees more than
    it holds, and so is one with a view taken before that reader and read after it (the view
    would pin the op).
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    last_use: dict[int, int] = {}
    for n in nodes:
        at = end if n.op == "output" else pos[n]
        for a in n.all_input_nodes:
            for t in _tensors(a.meta.get("val")):
                last_use[_storage_key(t)] = max(last_use.get(_storage_key(t), 0), at)
    for x in nodes:
        if x.op != "call_function" or not isinstance(x.meta.get("val"), (tuple, list)):
            continue
        gets = [u for u in x.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)]
        if len(gets) < 2:
            continue
        info = {  # getitem -> (last use of its storage, its bytes)
            g: (last_use.get(_storage_key(g.meta["val"]), pos[g]), g.meta["val"].untyped_storage().nbytes())
            for g in gets
        }
        if kinds.get(x.name, NodeKind.BACKWARD) is NodeKind.BACKWARD:
            # returned by a backward op: ``build_graph`` makes it the op's kept bytes
            info = {g: v for g, v in info.items() if v[0] != end}
        late = {g: v for g, v in info.items() if v[0] != end}
        for g in (g for g in info if g not in late):  # returned by the forward: its copy is made there
            if _worth_cloning(info, g, born=pos[x]):
                _clone_after(gm, g, g, kinds.get(x.name, NodeKind.FORWARD), kinds)
            else:
                late = {}  # the op lives to the end anyway
        dies = _when_the_op_dies(late, born=pos[x]) if late else end
        for g, (last, _) in late.items():
            if last <= dies:
                continue
            if _viewed_past(g, nodes[dies], pos):  # a view of it would pin the op past its reader
                if _worth_cloning(info, g, born=pos[x]):
                    _clone_after(gm, g, g, kinds.get(x.name, NodeKind.FORWARD), kinds)
                continue
            _clone_after(gm, g, nodes[dies], kinds.get(nodes[dies].name, NodeKind.FORWARD), kinds, pos=pos)


def _clone_after(gm: fx.GraphModule, g: fx.Node, at: fx.Node, kind: NodeKind, kinds: dict, *,
                 pos: dict | None = None) -> None:
    """Clone ``g`` right after ``at``, of kind ``kind``; its readers after ``at`` (every one
    when ``pos``, the nodes' positions, is not given) read the clone."""
    with gm.graph.inserting_after(at):
        c = gm.graph.call_function(torch.ops.aten.clone.default, (g,))
    if pos is None:
        g.replace_all_uses_with(c, delete_user_cb=lambda user: user is not c)
    else:
        g.replace_all_uses_with(c, delete_user_cb=lambda user: user is not c and pos.get(user, -1) > pos[at])
    kinds[c.name] = kind


def _when_the_op_dies(info: dict, *, born: int) -> int:
    """The position of the last reader of a multi-output op's outputs that are not cloned
    (``info``: output -> (last use, bytes)): the one that holds the fewest bytes x positions,
    counting every output until then and each cloned one from then to its own last use (the
    fewest clones where that ties)."""
    best, best_cost = None, None
    total = sum(b for _, b in info.values())
    for dies in sorted({last for last, _ in info.values()}, reverse=True):
        cost = total * (dies - born) + sum(b * (last - dies) for last, b in info.values() if last > dies)
        if best_cost is None or cost < best_cost:
            best, best_cost = dies, cost
    return best


def _viewed_past(g: fx.Node, reader: fx.Node, pos: dict) -> bool:
    """Whether a view of ``g`` taken before ``reader`` (a node sharing its storage) is read at
    or after it: a clone made there would not free the op, which the view pins."""
    key = _storage_key(g.meta["val"])
    todo = [u for u in g.users if pos[u] <= pos[reader]]
    seen = set()
    while todo:
        u = todo.pop()
        if u in seen or key not in {_storage_key(t) for t in _tensors(u.meta.get("val"))}:
            continue
        seen.add(u)
        for w in u.users:
            if pos.get(w, len(pos)) > pos[reader]:
                return True
            todo.append(w)
    return False


def _worth_cloning(info: dict, g: object, *, born: int) -> bool:
    """Clone output ``g`` right after its op (``info``: output -> (last use, bytes), positions in
    the graph) when it is smaller than the outputs that die before it and the bytes x time it
    frees beat the bytes x time the copy adds. Freed: the outputs that die before it, no longer
    held until it dies. Added: the copy, held while the node is alive anyway."""
    last, nbytes = info[g]
    earlier = [(l, b) for l, b in info.values() if l < last]
    if not earlier:
        return False
    freed = sum(b * (last - l) for l, b in earlier)
    return nbytes < sum(b for _, b in earlier) and freed > nbytes * (max(l for l, _ in earlier) - born)


def build_graph(gm: fx.GraphModule, kinds: dict[str, NodeKind], name: str, *, replay_rng: bool):
    owner: dict[int, int] = {}  # storage -> owning graph node, -1 for placeholders
    fixed_bytes = 0
    for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
        for t in _tensors(ph.meta.get("val")):
            key = _storage_key(t)
            if key not in owner:
                owner[key] = -1
                fixed_bytes += t.untyped_storage().nbytes()
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    ids = {n: i for i, n in enumerate(compute)}
    nodes, owners, random_nodes = [], [], []
    fresh_storages: list[dict[int, int]] = []  # node -> the storages it creates, and their bytes
    for i, n in enumerate(compute):
        created, mine = {}, set()
        if _returns_its_input(n) and isinstance(n.args[0], fx.Node):
            waited = _tensors(n.args[0].meta.get("val"))
            for out, src in zip(_tensors(n.meta.get("val")), waited):
                if _storage_key(src) in owner:
                    owner[_storage_key(out)] = owner[_storage_key(src)]
        for t in _tensors(n.meta.get("val")):
            key = _storage_key(t)
            if key not in owner:
                owner[key] = i
                created[key] = t.untyped_storage().nbytes()
            if owner[key] >= 0:
                mine.add(owner[key])
        deps: set[int] = set()
        for a in n.all_input_nodes:
            if a in ids:
                deps.add(ids[a])
                deps.update(owners[ids[a]])
        deps.discard(i)
        rand = is_random(n)
        if rand:
            random_nodes.append(i)
        kind = kinds.get(n.name, NodeKind.BACKWARD)
        nodes.append(Node(n.name, kind, tuple(sorted(deps)), sum(created.values()), 0.0, recomputable=replay_rng or not rand))
        owners.append(tuple(sorted(mine)))
        fresh_storages.append(created)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    returned = {_storage_key(t) for a in out_node.all_input_nodes for t in _tensors(a.meta.get("val"))}
    outputs: set[int] = set()
    for a in out_node.all_input_nodes:
        if a in ids:
            outputs.add(ids[a])
            outputs.update(owners[ids[a]])
    direct = {ids[a] for a in out_node.all_input_nodes if a in ids}
    for o in sorted(outputs - direct):
        # a backward op returning some storages and dropping others (a weight gradient next to
        # the input gradient of ``convolution_backward``): the returned ones are its kept bytes,
        # the others are freed at their last use, as torch frees them
        kept = sum(b for key, b in fresh_storages[o].items() if key in returned)
        if nodes[o].kind is NodeKind.BACKWARD and 0 < kept < nodes[o].out_bytes:
            nodes[o] = dataclasses.replace(nodes[o], out_bytes=nodes[o].out_bytes - kept, kept_bytes=kept, recomputable=False)
            outputs.discard(o)
    graph = Graph(nodes=tuple(nodes), fixed_bytes=fixed_bytes, outputs=tuple(sorted(outputs)), name=name)
    return graph, tuple(n.name for n in compute), tuple(owners), tuple(random_nodes)


def with_scratch(graph: Graph, node_names: tuple[str, ...], scratch: dict[str, int]) -> Graph:
    """``graph`` with each node's ``temp_bytes`` set to the kernel scratch of its fx node
    (``scratch`` by fx node name; see ``remat.scratch``)."""
    nodes = tuple(dataclasses.replace(n, temp_bytes=int(scratch.get(name, 0))) for n, name in zip(graph.nodes, node_names, strict=True))
    return Graph(nodes=nodes, fixed_bytes=graph.fixed_bytes, outputs=graph.outputs, name=graph.name)
