"""Exact graph reduction: fold zero-byte aliases into the value they alias.

About 40% of the nodes of a traced transformer step are views (``view``, ``t``,
``transpose``, ``getitem``...). They own no bytes and cost next to nothing, but every node
costs the MILP O(n) variables. A zero-byte node with a single dependency can always be
computed right after that dependency and kept exactly as long as it: its memory is zero, so
merging it into its dependency's group changes no peak, and computing the whole group
together changes no cost. The reduction is therefore exact: a plan for the coarse graph
expands to a plan for the original graph with the same total cost and no higher a peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.graph import Graph, Node
from remat.schedule import Plan, plan_from_order


@dataclass(frozen=True)
class Coarsening:
    """A coarse graph and the map back. ``groups[c]`` are the original node ids of coarse
    node c, in the order they are computed (the owning node first)."""

    fine: Graph
    coarse: Graph
    groups: tuple[tuple[int, ...], ...]

    @property
    def group_of(self) -> tuple[int, ...]:
        owner = [0] * self.fine.n
        for c, members in enumerate(self.groups):
            for i in members:
                owner[i] = c
        return tuple(owner)

    def expand(self, plan: Plan) -> Plan:
        """The original-graph plan of a coarse plan: each coarse compute runs its members in
        order, and every value is freed at its own last use. Same cost; a peak no higher
        than the coarse plan's (members outside the owner hold no bytes)."""
        order = [i for c in plan.compute_order for i in self.groups[c]]
        return plan_from_order(self.fine, order)


def coarsen(graph: Graph) -> Coarsening:
    """Merge every zero-byte node with exactly one dependency into its dependency's group.

    >>> from remat.graph import NodeKind
    >>> F = NodeKind.FORWARD
    >>> g = Graph(nodes=(Node("a", F, (), 8, 1.0), Node("view_a", F, (0,), 0, 0.0),
    ...                  Node("b", NodeKind.LOSS, (1,), 4, 1.0)), fixed_bytes=0, outputs=(2,))
    >>> c = coarsen(g)
    >>> c.coarse.n, c.groups
    (2, ((0, 1), (2,)))
    """
    root = list(range(graph.n))
    for i, node in enumerate(graph.nodes):
        if node.out_bytes == 0 and len(node.deps) == 1:
            root[i] = root[node.deps[0]]
    members: dict[int, list[int]] = {}
    for i in range(graph.n):
        members.setdefault(root[i], []).append(i)
    roots = sorted(members)
    coarse_id = {r: c for c, r in enumerate(roots)}
    fine_outputs = graph.output_set
    nodes: list[Node] = []
    outputs: list[int] = []
    for c, r in enumerate(roots):
        group = members[r]
        deps = sorted({coarse_id[root[d]] for i in group for d in graph.nodes[i].deps} - {c})
        base = graph.nodes[r]
        nodes.append(
            Node(
                name=base.name,
                kind=base.kind,
                deps=tuple(deps),
                out_bytes=sum(graph.nodes[i].out_bytes for i in group),
                cost=sum(graph.nodes[i].cost for i in group),
                recomputable=all(graph.nodes[i].recomputable for i in group),
            )
        )
        if any(i in fine_outputs for i in group):
            outputs.append(c)
    coarse = Graph(nodes=tuple(nodes), fixed_bytes=graph.fixed_bytes, outputs=tuple(outputs), name=graph.name)
    return Coarsening(fine=graph, coarse=coarse, groups=tuple(tuple(members[r]) for r in roots))
