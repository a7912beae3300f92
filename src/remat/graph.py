"""The graph of one training step: nodes in topological order, their sizes and costs.

A ``Graph`` is immutable and always valid: the constructor runs ``validate()``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property

from remat.errors import GraphError


class NodeKind(enum.Enum):
    """Which part of the training step a node belongs to."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Node:
    """One operation of the step.

    ``deps`` are the ids of the nodes whose outputs must be live while this node is computed
    (for a view, its base is a dependency too: views own no bytes but keep their base alive).
    ``out_bytes`` is what computing the node allocates; ``cost`` is its compute cost in the
    graph's one cost unit (microseconds for traced graphs). ``recomputable`` is False for
    operations that must run exactly once per step. ``temp_bytes`` is scratch memory held
    only while the node is being computed, on top of its output (a traced op's kernel
    scratch, see ``remat.scratch``; a grouped node of a coarse graph holds its members'
    internal values there). ``kept_bytes``
    are allocated with the output but never freed: the step outputs (gradients) a grouped node
    computes along with values that are freed; a node with kept bytes runs once.
    """

    name: str
    kind: NodeKind
    deps: tuple[int, ...]
    out_bytes: int
    cost: float
    recomputable: bool = True
    temp_bytes: int = 0
    kept_bytes: int = 0


@dataclass(frozen=True)
class Graph:
    """A training step as a DAG whose node ids ``0..n-1`` are a topological order.

    ``fixed_bytes`` is memory resident all step long that no node allocates (parameters,
    buffers, inputs). ``outputs`` are the nodes whose values must be live when the step ends
    (the loss and the gradients); once computed they are never freed.

    >>> g = Graph(nodes=(Node("x", NodeKind.FORWARD, (), 4, 1.0),
    ...                  Node("loss", NodeKind.LOSS, (0,), 4, 1.0)), fixed_bytes=0, outputs=(1,))
    >>> g.n, g.users[0]
    (2, (1,))
    """

    nodes: tuple[Node, ...]
    fixed_bytes: int
    outputs: tuple[int, ...]
    name: str = "graph"

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "outputs", tuple(int(o) for o in self.outputs))
        self.validate()

    # ------------------------------------------------------------------ invariants
    def validate(self) -> None:
        """Check every invariant; raise ``GraphError`` naming the offending node."""
        if not self.nodes:
            raise GraphError(f"graph {self.name!r} has no nodes; a training step has at least a loss")
        if not isinstance(self.fixed_bytes, int) or self.fixed_bytes < 0:
            raise GraphError(
                f"graph {self.name!r}: fixed_bytes={self.fixed_bytes!r} must be a non-negative int"
            )
        seen_names: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            where = f"graph {self.name!r}, node {i} ({node.name!r})"
            if not isinstance(node, Node):
                raise GraphError(f"graph {self.name!r}, node {i}: expected a Node, got {type(node).__name__}")
            if node.name in seen_names:
                raise GraphError(
                    f"{where}: name already used by node {seen_names[node.name]}; names must be unique"
                )
            seen_names[node.name] = i
            if not isinstance(node.kind, NodeKind):
                raise GraphError(f"{where}: kind {node.kind!r} is not a NodeKind")
            if not isinstance(node.out_bytes, int) or node.out_bytes < 0:
                raise GraphError(f"{where}: out_bytes={node.out_bytes!r} must be a non-negative int")
            if not isinstance(node.temp_bytes, int) or node.temp_bytes < 0:
                raise GraphError(f"{where}: temp_bytes={node.temp_bytes!r} must be a non-negative int")
            if not isinstance(node.kept_bytes, int) or node.kept_bytes < 0:
                raise GraphError(f"{where}: kept_bytes={node.kept_bytes!r} must be a non-negative int")
            if node.kept_bytes and node.recomputable:
                raise GraphError(
                    f"{where}: has kept_bytes={node.kept_bytes} (step outputs it allocates once) but is "
                    f"recomputable; such a node must run once: set recomputable=False"
                )
            if not isinstance(node.cost, (int, float)) or not math.isfinite(node.cost) or node.cost < 0:
                raise GraphError(f"{where}: cost={node.cost!r} must be a finite number >= 0")
            if len(set(node.deps)) != len(node.deps):
                raise GraphError(f"{where}: deps {node.deps} list a node twice")
            for d in node.deps:
                if not isinstance(d, int) or d < 0 or d >= i:
                    raise GraphError(
                        f"{where}: dependency {d!r} is not an earlier node; ids must be a "
                        f"topological order (every dependency id < the node's id)"
                    )
        if len(set(self.outputs)) != len(self.outputs):
            raise GraphError(f"graph {self.name!r}: outputs {self.outputs} list a node twice")
        for o in self.outputs:
            if o < 0 or o >= len(self.nodes):
                raise GraphError(f"graph {self.name!r}: output {o} is not a node id (0..{len(self.nodes) - 1})")

    # ------------------------------------------------------------------ derived views
    @property
    def n(self) -> int:
        return len(self.nodes)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """``users[i]``: the nodes that read node i's output, ascending."""
        acc: list[list[int]] = [[] for _ in self.nodes]
        for j, node in enumerate(self.nodes):
            for d in node.deps:
                acc[d].append(j)
        return tuple(tuple(u) for u in acc)

    @cached_property
    def out_bytes(self) -> tuple[int, ...]:
        return tuple(node.out_bytes for node in self.nodes)

    @cached_property
    def costs(self) -> tuple[float, ...]:
        return tuple(float(node.cost) for node in self.nodes)

    @cached_property
    def total_cost(self) -> float:
        """Cost of computing every node once: the cost of the checkpoint-all plan."""
        return float(sum(self.costs))

    @cached_property
    def node_arrays(self) -> tuple:
        """``(out_bytes, kept_bytes, temp_bytes, costs)`` as numpy arrays (int64, int64, int64,
        float64): what vectorized accounting reads."""
        import numpy as np

        return (np.asarray(self.out_bytes, dtype=np.int64),
                np.asarray([n.kept_bytes for n in self.nodes], dtype=np.int64),
                np.asarray([n.temp_bytes for n in self.nodes], dtype=np.int64),
                np.asarray(self.costs, dtype=np.float64))

    @cached_property
    def deps_csr(self) -> tuple:
        """The dependencies as compressed rows: node i's are ``indices[indptr[i]:indptr[i+1]]``."""
        import numpy as np

        counts = [len(n.deps) for n in self.nodes]
        indptr = np.zeros(self.n + 1, dtype=np.int64)
        indptr[1:] = np.cumsum(counts)
        indices = np.fromiter((d for n in self.nodes for d in n.deps), dtype=np.int64, count=int(indptr[-1]))
        return indptr, indices

    @cached_property
    def output_set(self) -> frozenset[int]:
        return frozenset(self.outputs)

    def ids_of_kind(self, kind: NodeKind) -> tuple[int, ...]:
        return tuple(i for i, node in enumerate(self.nodes) if node.kind is kind)

    def describe(self, i: int) -> str:
        """``"node 3 ('relu_1')"``: how errors name a node."""
        return f"node {i} ({self.nodes[i].name!r})"

    # ------------------------------------------------------------------ identity
    def fingerprint(self, *, costs: bool = True) -> str:
        """A stable hex digest of the graph's structure, sizes and (optionally) costs.

        Leave out costs to key caches on structure alone: profiled costs vary run to run.
        Computed once per graph (planning caches key on it).
        """
        return self._fingerprint_with_costs if costs else self._fingerprint_of_structure

    @cached_property
    def _fingerprint_with_costs(self) -> str:
        return self._digest(costs=True)

    @cached_property
    def _fingerprint_of_structure(self) -> str:
        return self._digest(costs=False)

    def _digest(self, *, costs: bool) -> str:
        payload = {
            "fixed_bytes": self.fixed_bytes,
            "outputs": list(self.outputs),
            "nodes": [
                [n.name, n.kind.value, list(n.deps), n.out_bytes, n.recomputable]
                + ([float(n.cost).hex()] if costs else [])
                + ([n.temp_bytes] if n.temp_bytes else [])
                + ([["kept", n.kept_bytes]] if n.kept_bytes else [])
                for n in self.nodes
            ],
        }
        blob = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def with_costs(self, costs: tuple[float, ...] | list[float]) -> Graph:
        """The same graph with new per-node costs (e.g. from a different cost model)."""
        if len(costs) != self.n:
            raise GraphError(f"graph {self.name!r}: got {len(costs)} costs for {self.n} nodes")
        nodes = tuple(dataclasses.replace(n, cost=float(c)) for n, c in zip(self.nodes, costs))
        return Graph(nodes=nodes, fixed_bytes=self.fixed_bytes, outputs=self.outputs, name=self.name)
