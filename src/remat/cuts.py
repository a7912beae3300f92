"""Light cuts of a pass: where a network's blocks begin and end, found from the graph.

A *cut* is a position in the order of one pass (forward or backward); the values *crossing*
it are those the pass computed at or before it and reads after it. Where the bytes crossing
are a local minimum, the cut lies between two blocks: the residual stream of a transformer or
the output of a ResNet block in the forward pass, their gradients in the backward pass (plus
small values every block reads, such as an attention mask).

Chen's articulation points miss these cuts whenever such a shared value, or a value only the
other pass reads, hangs off the chain. The ``segments`` method keeps what crosses some of
them and recomputes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.graph import Graph, NodeKind

#: Tiers: the cuts no heavier than these quantiles of the cuts' crossing bytes.
TIER_QUANTILES = (0.25, 0.5, 1.0)


@dataclass(frozen=True)
class Cut:
    """The cut after node ``node`` of a pass: ``crossing`` are the values of the pass computed
    at or before it that the pass reads after it (``bytes`` in all)."""

    node: int
    crossing: tuple[int, ...]
    bytes: int


def pass_cuts(graph: Graph, kind: NodeKind = NodeKind.FORWARD) -> tuple[Cut, ...]:
    """Every cut of the pass made of the nodes of ``kind``, one after each of its nodes.

    >>> from remat.builders import chain_graph
    >>> [(c.node, c.crossing) for c in pass_cuts(chain_graph(3, bytes_per_node=1))]
    [(0, (0,)), (1, (1,)), (2, ())]
    """
    ids = graph.ids_of_kind(kind)
    pos = {i: p for p, i in enumerate(ids)}
    last = [max((pos[u] for u in graph.users[i] if u in pos), default=-1) for i in ids]
    ending: dict[int, list[int]] = {}  # position -> the values it reads for the last time
    live: set[int] = set()
    cuts: list[Cut] = []
    for p, i in enumerate(ids):
        if last[p] > p:
            live.add(i)
            ending.setdefault(last[p], []).append(i)
        live.difference_update(ending.pop(p, ()))
        crossing = tuple(sorted(live))
        cuts.append(Cut(i, crossing, sum(graph.nodes[j].out_bytes for j in crossing)))
    return tuple(cuts)


def light_cuts(graph: Graph, kind: NodeKind = NodeKind.FORWARD) -> tuple[Cut, ...]:
    """The cuts of a pass whose crossing bytes are a local minimum of its order (the last
    position of a flat minimum; the first and last positions excluded), in order.

    Two residual blocks ``h1 = h0 + y(x(h0))``, ``h2 = h1 + y(x(h1))``: the cut after h1.

    >>> from remat.builders import training_graph
    >>> deps = [(), (0,), (1,), (0, 2), (3,), (4,), (3, 5), (6,)]
    >>> g = training_graph(deps, [1, 4, 4, 1, 4, 4, 1, 1], [1.0] * 8, name="residual")
    >>> [(c.node, c.crossing) for c in light_cuts(g)]
    [(3, (3,))]
    """
    cuts = pass_cuts(graph, kind)
    return tuple(
        cuts[p] for p in range(1, len(cuts) - 1)
        if cuts[p].bytes <= cuts[p - 1].bytes and cuts[p].bytes < cuts[p + 1].bytes
    )


def block_cuts(graph: Graph, kind: NodeKind = NodeKind.FORWARD, *, at_most: int | None = None) -> tuple[Cut, ...]:
    """The block boundaries of a pass: its light cuts, or, when none stands out (a uniform
    chain, whose every inner cut is equally light), every cut of it but the last, every k-th
    of them when there are more than ``at_most``.

    >>> from remat.builders import chain_graph
    >>> [c.node for c in block_cuts(chain_graph(9, bytes_per_node=1), at_most=4)]
    [0, 2, 4, 6]
    """
    cuts = light_cuts(graph, kind)
    if cuts:
        return cuts
    cuts = pass_cuts(graph, kind)[:-1]
    if at_most is not None and len(cuts) > at_most:
        cuts = cuts[::-(-len(cuts) // at_most)]
    return cuts


def cut_tiers(cuts: tuple[Cut, ...]) -> list[tuple[Cut, ...]]:
    """The cuts no heavier than each of ``TIER_QUANTILES`` of their bytes, distinct tiers only,
    lightest first.

    >>> cuts = tuple(Cut(i, (i,), b) for i, b in enumerate([4, 1, 1, 9]))
    >>> [[c.node for c in tier] for tier in cut_tiers(cuts)]
    [[1, 2], [0, 1, 2], [0, 1, 2, 3]]
    """
    if not cuts:
        return []
    sizes = np.array([c.bytes for c in cuts])
    tiers: list[tuple[Cut, ...]] = []
    for q in TIER_QUANTILES:
        limit = np.quantile(sizes, q, method="higher")
        tier = tuple(c for c in cuts if c.bytes <= limit)
        if tier and tier not in tiers:
            tiers.append(tier)
    return tiers
