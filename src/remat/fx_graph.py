"""From a traced fx graph to a ``Graph``: the passes the tracer and the compiler backend share.

Memory follows storages, not nodes: a node owns the bytes of the storages it creates; a view
(or any output sharing an existing storage) owns none and makes its users depend on the
storage's owner, so a plan keeps the owner alive exactly as long as torch would. Small
outputs of multi-output ops are cloned apart so that a large sibling is not held to the end.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from remat.graph import Graph, Node, NodeKind


def is_random(n: fx.Node) -> bool:
    return n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


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


def split_multi_outputs(gm: fx.GraphModule, kinds: dict[str, NodeKind]) -> None:
    """Clone small outputs of multi-output ops that outlive a larger sibling.

    A plan frees a node's outputs together, so batch norm's saved statistics (needed in the
    backward) would keep its large normalized output alive all step, and a weight gradient
    would keep the input gradient of ``convolution_backward`` alive to the end. An explicit
    clone of the small long-lived output lets the op's node be freed after the large one's
    last use. Rule: clone an output when it is smaller than the outputs that die before it.
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
        for g in gets:
            dies_before = sum(b for h, (l, b) in info.items() if l < info[g][0])
            if info[g][1] < dies_before:
                with gm.graph.inserting_after(g):  # before every user of g
                    c = gm.graph.call_function(torch.ops.aten.clone.default, (g,))
                g.replace_all_uses_with(c, delete_user_cb=lambda user: user is not c)
                kinds[c.name] = kinds.get(x.name, NodeKind.FORWARD)


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
    for i, n in enumerate(compute):
        fresh, mine = 0, set()
        for t in _tensors(n.meta.get("val")):
            key = _storage_key(t)
            if key not in owner:
                owner[key] = i
                fresh += t.untyped_storage().nbytes()
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
        nodes.append(Node(n.name, kind, tuple(sorted(deps)), fresh, 0.0, recomputable=replay_rng or not rand))
        owners.append(tuple(sorted(mine)))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs: set[int] = set()
    for a in out_node.all_input_nodes:
        if a in ids:
            outputs.add(ids[a])
            outputs.update(owners[ids[a]])
    graph = Graph(nodes=tuple(nodes), fixed_bytes=fixed_bytes, outputs=tuple(sorted(outputs)), name=name)
    return graph, tuple(n.name for n in compute), tuple(owners), tuple(random_nodes)


# ---------------------------------------------------------------------------- error translation
