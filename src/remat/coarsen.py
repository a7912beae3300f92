"""Graph reduction: fold zero-byte aliases into the value they alias (exact), then, when the
graph is still too large for the MILP, group runs of neighbouring operations (bounded).

About 40% of the nodes of a traced transformer step are views (``view``, ``t``,
``transpose``, ``getitem``...). They own no bytes and cost next to nothing, but every node
costs the MILP O(n) variables. A zero-byte node with a single dependency can always be
computed right after that dependency and kept exactly as long as it: its memory is zero, so
merging it into its dependency's group changes no peak, and computing the whole group
together changes no cost. The reduction is therefore exact: a plan for the coarse graph
expands to a plan for the original graph with the same total cost and no higher a peak.

Grouping (``group`` / ``coarsen(graph, max_nodes=...)``) is not exact: it merges runs of
consecutive operations of the same kind into one node that is computed, kept and freed as a
whole, the granularity of the layer-level graphs of the Checkmate paper. A grouped node's
output is what its members pass out of the group; the values used only inside it become its
``temp_bytes``, held while it runs. Every plan of the grouped graph is still a plan of the
original graph with the same cost and no higher a peak, but the grouped graph has fewer
plans, so its optimum can cost more than the original graph's.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from remat.graph import Graph, Node, NodeKind
from remat.schedule import Plan, plan_from_order


@dataclass(frozen=True)
class Coarsening:
    """A coarse graph and the map back. ``groups[c]`` are the original node ids of coarse
    node c, in the order they are computed (the owning node first)."""

    fine: Graph
    coarse: Graph
    groups: tuple[tuple[int, ...], ...]
    exact: bool = True

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


def coarsen(graph: Graph, max_nodes: int | None = None) -> Coarsening:
    """Fold aliases (``fold_aliases``, exact); then, if the result has more than ``max_nodes``
    nodes, ``group`` it down to at most that many where it can (not exact).

    >>> from remat.builders import chain_graph
    >>> c = coarsen(chain_graph(20), max_nodes=15)
    >>> c.coarse.n <= 15, c.exact, c.fine.n
    (True, False, 41)
    """
    folded = fold_aliases(graph)
    return folded if max_nodes is None else group_folded(folded, max_nodes)


def group_folded(folded: Coarsening, max_nodes: int) -> Coarsening:
    """``group`` the coarse graph of ``folded`` (the result of ``fold_aliases``) down to
    ``max_nodes`` nodes, as a coarsening of ``folded.fine``; ``folded`` itself if it is small
    enough already or nothing merges."""
    if folded.coarse.n <= max_nodes:
        return folded
    grouped = group(folded.coarse, max_nodes)
    if grouped.exact:
        return folded
    members = tuple(tuple(i for j in g for i in folded.groups[j]) for g in grouped.groups)
    return Coarsening(fine=folded.fine, coarse=grouped.coarse, groups=members, exact=False)


def fold_aliases(graph: Graph) -> Coarsening:
    """Merge every zero-byte node with exactly one dependency into its dependency's group.

    Computed once per graph object: planning folds the graph it is given for every budget,
    and the same folded graph then keeps its fingerprint, which planning's caches key on
    (hashing a 5,700-node graph takes 0.4 s).

    >>> from remat.graph import NodeKind
    >>> F = NodeKind.FORWARD
    >>> g = Graph(nodes=(Node("a", F, (), 8, 1.0), Node("view_a", F, (0,), 0, 0.0),
    ...                  Node("b", NodeKind.LOSS, (1,), 4, 1.0)), fixed_bytes=0, outputs=(2,))
    >>> c = fold_aliases(g)
    >>> c.coarse.n, c.groups
    (2, ((0, 1), (2,)))
    >>> fold_aliases(g) is c
    True
    """
    # (kept in the frozen graph's own __dict__, as its cached properties are)
    folded = graph.__dict__.get("_aliases_folded")
    if folded is None:
        folded = graph.__dict__["_aliases_folded"] = _fold_aliases(graph)
    return folded


def _fold_aliases(graph: Graph) -> Coarsening:
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
                temp_bytes=base.temp_bytes,  # the members besides ``base`` hold no bytes
                kept_bytes=sum(graph.nodes[i].kept_bytes for i in group),
            )
        )
        # a zero-byte view of what a node keeps for good (its kept bytes) does not make it an output
        if any(i in fine_outputs and (graph.nodes[i].out_bytes or not base.kept_bytes) for i in group):
            outputs.append(c)
    coarse = Graph(nodes=tuple(nodes), fixed_bytes=graph.fixed_bytes, outputs=tuple(outputs), name=graph.name)
    return Coarsening(fine=graph, coarse=coarse, groups=tuple(tuple(members[r]) for r in roots))


#: How much a merge's lifetime extension weighs against its compute and bytes shares. Values
#: of a group are freed together, when the last of them is no longer read, so merging values
#: whose last reads are far apart holds the early ones longer. At 4, the grouped graph of a
#: GPT-2 step (312 nodes to 150) keeps its checkpoint-all peak within 0.1% of the full
#: graph's (1.17x when only compute and bytes count) and Chen-greedy's smallest budget at
#: 0.55 of that peak (0.60).
LIFETIME_WEIGHT = 4.0


#: A forward-pass step output read only after the forward pass, if at all (batch-norm
#: statistics), moves to the end of the forward pass, where such outputs group together, if
#: the inputs it would keep alive longer (those nothing reads after the forward pass anyway)
#: hold at most this share of the largest value.
DEFER_INPUT_SHARE = 1e-3


def group(graph: Graph, max_nodes: int) -> Coarsening:
    """Merge runs of consecutive nodes until at most ``max_nodes`` remain (or nothing more can
    merge). Not exact: see the module docstring.

    Step outputs of the forward pass that only the backward pass reads, if anything (batch-norm
    statistics), first move to the end of the forward pass when that keeps next to nothing
    alive longer. Two neighbouring groups then merge only if they have the same kind and
    nothing but sinks lies between them, so a group is convex (no path leaves it and comes
    back) and the grouped graph is a DAG; the sinks skipped over are computed after it. In the
    forward pass, outputs merge only with outputs and recomputable nodes only with recomputable
    ones. Merges whose group needs more bytes at once (its own and its inputs') than the
    hungriest single node come last, only if ``max_nodes`` is not reached without them. In the
    backward pass, a step output (a parameter gradient) may join its neighbours: its bytes
    become the group's ``kept_bytes`` and the group runs once. The pair merged next is the one whose merge costs
    the least: its share of the graph's compute, of its bytes, and (weighted by
    ``LIFETIME_WEIGHT``) of the bytes x time its values gain by being freed together.

    >>> from remat.builders import chain_graph
    >>> g = group(chain_graph(4), 4)
    >>> g.coarse.n, [len(m) for m in g.groups], g.coarse.nodes[-1].kept_bytes > 0
    (4, [2, 2, 1, 4], True)
    """
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes!r} must be a positive int (the most nodes the reduced graph may have)")
    n, users, outputs = graph.n, graph.users, graph.output_set
    sink = [not users[i] for i in range(n)]
    order, deferred = _deferred_order(graph, sink)
    pos = {i: p for p, i in enumerate(order)}
    backward = NodeKind.BACKWARD

    def movable(i: int) -> bool:
        if i not in outputs:
            return not sink[i]
        return i in deferred or (sink[i] and graph.nodes[i].kind is backward)

    items = [i for i in order if movable(i)]
    # groups as a doubly linked list over ``items``; a group is named by its first item index
    members: dict[int, list[int]] = {a: [i] for a, i in enumerate(items)}
    nxt = {a: a + 1 for a in range(len(items) - 1)}
    prv = {a + 1: a for a in range(len(items) - 1)}
    version = {a: 0 for a in members}

    def working_set(unit: list[int], own_bytes: int) -> int:
        """Bytes live while ``unit`` runs as one node: its own (``footprint``) and its inputs'."""
        inside = set(unit)
        inputs = {d for i in unit for d in graph.nodes[i].deps if d not in inside}
        return own_bytes + sum(graph.out_bytes[d] for d in inputs)

    # merges that need more memory at once than the hungriest single node already does raise
    # the grouped graph's smallest feasible budget: they come last, only if still needed
    ceiling = max((working_set([i], sum(footprint(graph, [i]))) for i in range(n)), default=0)

    def same_run(a: int, b: int) -> bool:
        i, j = members[a][-1], members[b][0]
        x, y = graph.nodes[i], graph.nodes[j]
        if x.kind is not y.kind:
            return False
        if x.kind is not backward and ((i in outputs) != (j in outputs) or x.recomputable != y.recomputable):
            return False
        return all(sink[order[k]] for k in range(pos[i] + 1, pos[j]))

    heap: list[tuple[float, int, int, int, int]] = []
    total_cost = graph.total_cost or 1.0
    total_bytes = sum(node.out_bytes + node.temp_bytes + node.kept_bytes for node in graph.nodes) or 1
    # each value's last reader (outputs: the end), and bytes x lifetime under checkpoint-all
    last = [max(pos[u] for u in users[i]) if users[i] and i not in outputs else n for i in range(n)]
    total_lifetime = sum(graph.nodes[i].out_bytes * (last[i] - pos[i]) for i in range(n)) or 1

    def score(unit: list[int], own_bytes: int) -> float:
        """What merging into ``unit`` costs the plans: its share of compute (recomputed as one),
        of bytes (kept as one) and of the lifetime its values gain by being freed together."""
        inside = set(unit)
        leaving = [i for i in unit if not _internal(graph, i, inside) and i not in outputs]
        end = max((last[i] for i in leaving), default=0)
        extension = sum(graph.nodes[i].out_bytes * (end - last[i]) for i in leaving)
        share = sum(graph.nodes[i].cost for i in unit) / total_cost
        return share + own_bytes / total_bytes + LIFETIME_WEIGHT * extension / total_lifetime

    def push(a: int) -> None:
        b = nxt.get(a)
        if b is None or not same_run(a, b):
            return
        unit = members[a] + members[b]
        own_bytes = sum(footprint(graph, unit))
        if working_set(unit, own_bytes) <= ceiling:
            heapq.heappush(heap, (score(unit, own_bytes), pos[members[a][0]], a, version[a], version[b]))

    for a in range(len(items) - 1):
        push(a)
    count = n
    while count > max_nodes and (heap or ceiling < math.inf):
        if not heap:  # every merge left would raise the ceiling: allow them after all
            ceiling = math.inf
            for a in list(members):
                push(a)
            continue
        _, _, a, va, vb = heapq.heappop(heap)
        b = nxt.get(a)
        if a not in members or b is None or version[a] != va or version[b] != vb:
            continue  # stale: one side has merged since
        members[a] += members.pop(b)
        version[a] += 1
        version.pop(b)
        c = nxt.pop(b, None)
        prv.pop(b, None)
        if c is None:
            nxt.pop(a, None)
        else:
            nxt[a], prv[c] = c, a
        count -= 1
        push(a)
        if a in prv:
            push(prv[a])
    if count == n:
        return Coarsening(fine=graph, coarse=graph, groups=tuple((i,) for i in range(n)))
    grouped = {i for m in members.values() for i in m}
    units = sorted([*members.values(), *([i] for i in range(n) if i not in grouped)], key=lambda m: pos[m[0]])
    return _quotient(graph, units)


def _deferred_order(graph: Graph, sink: list[bool]) -> tuple[list[int], frozenset[int]]:
    """A topological order with the forward pass's outputs that nothing in the forward pass
    reads moved to its end (before the first non-forward node), where that keeps next to
    nothing alive longer."""
    outputs, users = graph.output_set, graph.users
    largest = max(graph.out_bytes, default=0)
    forward = NodeKind.FORWARD
    end = next((i for i, node in enumerate(graph.nodes) if node.kind is not forward), graph.n)

    def held_anyway(d: int, i: int) -> bool:  # d is read after the forward pass regardless
        return d in outputs or any(u >= end for u in users[d] if u != i)

    def deferred(i: int) -> bool:
        node = graph.nodes[i]
        if node.kind is not forward or i not in outputs or any(u < end for u in users[i]):
            return False
        extended = sum(graph.out_bytes[d] for d in node.deps if not held_anyway(d, i))
        return extended <= DEFER_INPUT_SHARE * largest

    moved = [i for i in range(graph.n) if deferred(i)]
    moved_set = frozenset(moved)
    rest = [i for i in range(graph.n) if i not in moved_set]
    cut = next((k for k, i in enumerate(rest) if graph.nodes[i].kind is not forward), len(rest))
    return rest[:cut] + moved + rest[cut:], moved_set


def _internal(graph: Graph, i: int, inside) -> bool:
    """Node i's value is read only inside the unit ``inside`` (and is not a step output)."""
    users = graph.users[i]
    return bool(users) and i not in graph.output_set and all(u in inside for u in users)


def footprint(graph: Graph, unit: list[int]) -> tuple[int, int, int]:
    """``(out_bytes, temp_bytes, kept_bytes)`` of ``unit`` (a convex run of nodes in a
    topological order) computed as one node: what leaves it to be freed later, the most its
    internal values add while it runs, and the step outputs among its members."""
    users, outputs = graph.users, graph.output_set
    at = {i: pos for pos, i in enumerate(unit)}
    frees: dict[int, int] = {}
    inner = set()
    for i in unit:
        if _internal(graph, i, at):
            inner.add(i)
            last = max(at[u] for u in users[i])
            frees[last] = frees.get(last, 0) + graph.nodes[i].out_bytes
    out_bytes, kept_bytes, live, peak = 0, 0, 0, 0
    for pos, i in enumerate(unit):
        node = graph.nodes[i]
        if i in outputs:
            kept_bytes += node.out_bytes
        elif i not in inner:
            out_bytes += node.out_bytes
        kept_bytes += node.kept_bytes
        live += node.out_bytes + node.kept_bytes
        peak = max(peak, live + node.temp_bytes)
        live -= frees.get(pos, 0)
    return out_bytes, max(0, peak - out_bytes - kept_bytes), kept_bytes


def _quotient(graph: Graph, units: list[list[int]]) -> Coarsening:
    """The graph whose nodes are ``units`` (each a convex run of nodes in a topological order,
    listed in such an order). A unit of one node is that node; in a larger unit, step outputs
    become ``kept_bytes`` (a unit made only of outputs stays an output)."""
    owner = [0] * graph.n
    for c, unit in enumerate(units):
        for i in unit:
            owner[i] = c
    outputs = graph.output_set
    nodes: list[Node] = []
    coarse_outputs: list[int] = []
    for c, unit in enumerate(units):
        deps = tuple(sorted({owner[d] for i in unit for d in graph.nodes[i].deps} - {c}))
        first = graph.nodes[unit[0]]
        all_outputs = all(i in outputs for i in unit)
        if all_outputs:
            coarse_outputs.append(c)
        if len(unit) == 1:
            nodes.append(dataclasses.replace(first, deps=deps))
            continue
        out_b, temp_b, kept_b = footprint(graph, unit)
        if all_outputs:  # kept for good as the coarse graph's output, not as kept bytes
            out_b, kept_b = out_b + kept_b, 0
        nodes.append(Node(
            name=f"{first.name}+{len(unit) - 1}",
            kind=first.kind,
            deps=deps,
            out_bytes=out_b,
            cost=sum(graph.nodes[i].cost for i in unit),
            recomputable=kept_b == 0 and all(graph.nodes[i].recomputable for i in unit),
            temp_bytes=temp_b,
            kept_bytes=kept_b,
        ))
    coarse = Graph(nodes=tuple(nodes), fixed_bytes=graph.fixed_bytes, outputs=tuple(coarse_outputs), name=graph.name)
    return Coarsening(fine=graph, coarse=coarse, groups=tuple(tuple(u) for u in units), exact=False)
