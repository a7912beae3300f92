"""Schedules (which node is computed in which stage, what is kept) and the plans they lower to.

A ``Schedule`` is Checkmate's pair of boolean matrices. Stage ``t`` ends by computing node
``t`` (stages advance the frontier); within a stage nodes run in id order. ``R[t, i]``: node
i is computed in stage t. ``S[t, i]``: node i's output is live at the start of stage t
(kept from stage t-1).

A ``Plan`` is the flat program that runs: ``Compute(i)`` and ``Free(i)`` steps. ``lower()``
turns the compute matrix into a plan that frees every value right after its last use, which is
the least memory any program with that compute order can use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from remat.errors import ScheduleError
from remat.graph import Graph


class StepKind(enum.Enum):
    COMPUTE = "compute"
    FREE = "free"


@dataclass(frozen=True)
class Step:
    kind: StepKind
    node: int

    def __str__(self) -> str:
        return f"{self.kind.value}({self.node})"


@dataclass(frozen=True)
class Plan:
    """The program a schedule lowers to: what ``execute`` runs and ``simulate`` replays."""

    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))

    @property
    def compute_order(self) -> tuple[int, ...]:
        return tuple(s.node for s in self.steps if s.kind is StepKind.COMPUTE)

    def compute_counts(self, n: int) -> np.ndarray:
        """How often each of ``n`` nodes is computed."""
        return np.bincount(np.asarray(self.compute_order, dtype=np.int64), minlength=n)

    def __len__(self) -> int:
        return len(self.steps)


def _frozen_bool(matrix: np.ndarray, name: str, n: int | None) -> np.ndarray:
    arr = np.array(matrix, dtype=bool, copy=True)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ScheduleError(f"{name} must be a square matrix, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ScheduleError(f"{name} has shape {arr.shape} but the graph has {n} nodes")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Schedule:
    """Checkmate's (R, S) matrices, both ``n x n`` and boolean (read-only copies are kept).

    >>> from remat.builders import chain_graph
    >>> g = chain_graph(2, bytes_per_node=1)
    >>> s = Schedule.from_compute(g, np.eye(g.n, dtype=bool))
    >>> [str(step) for step in s.lower(g).steps][:3]
    ['compute(0)', 'compute(1)', 'compute(2)']
    """

    R: np.ndarray
    S: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "R", _frozen_bool(self.R, "R", None))
        object.__setattr__(self, "S", _frozen_bool(self.S, "S", self.R.shape[0]))

    @property
    def n(self) -> int:
        return int(self.R.shape[0])

    def check_shape(self, graph: Graph) -> None:
        if self.n != graph.n:
            raise ScheduleError(
                f"schedule is for {self.n} nodes but graph {graph.name!r} has {graph.n}; "
                f"solve again for this graph"
            )

    def cost(self, graph: Graph) -> float:
        """Total compute cost: every R entry times its node's cost."""
        self.check_shape(graph)
        return float(self.R.sum(axis=0) @ np.asarray(graph.costs, dtype=float))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_compute(cls, graph: Graph, R: np.ndarray) -> Schedule:
        """A schedule from its compute matrix alone; S becomes the exact liveness under
        free-after-last-use (what ``lower()`` will do)."""
        R = _frozen_bool(R, "R", graph.n)
        S = _liveness(graph, R)
        return cls(R=R, S=S)

    @classmethod
    def from_order(cls, graph: Graph, stages: np.ndarray | list[int], nodes: np.ndarray | list[int]) -> Schedule:
        """The schedule that computes ``nodes[k]`` in stage ``stages[k]`` (the compute matrix
        of a plan given as its computations)."""
        R = np.zeros((graph.n, graph.n), dtype=bool)
        R[np.asarray(stages, dtype=np.int64), np.asarray(nodes, dtype=np.int64)] = True
        return cls.from_compute(graph, R)

    @classmethod
    def from_kept(cls, graph: Graph, keep: np.ndarray) -> Schedule:
        """The cheapest schedule that keeps the values marked in ``keep`` (``keep[t, i]``: i
        is live at the start of stage t) and recomputes everything else it needs.

        This is Checkmate's least-R completion: in each stage, walk back from node t and
        compute every dependency that is neither kept nor already computed in the stage.
        Outputs and values that must not be recomputed are kept from their computation on,
        whatever ``keep`` says (the plan still frees them after their last use). Every node i
        is computed in stage i, so a kept value always exists.
        """
        return cls.from_compute(graph, least_compute(graph, keep))

    # ------------------------------------------------------------------ lowering
    def lower(self, graph: Graph) -> Plan:
        """The plan: run each stage's computes in id order; free each value right after its
        last use (the last instance of an output is never freed)."""
        self.check_shape(graph)
        return plan_from_order(graph, compute_order(self.R))


def compute_order(R: np.ndarray) -> list[int]:
    """The computations of compute matrix ``R``: stage by stage, each stage in id order."""
    return np.nonzero(np.tril(R))[1].tolist()


def stage_order(R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The computations of compute matrix ``R`` as (stages, nodes), in the order they run."""
    return np.nonzero(np.tril(R))


def order_peak_and_cost(graph: Graph, order: list[int] | tuple[int, ...]) -> tuple[int, float]:
    """Peak bytes and total cost of ``plan_from_order(graph, order)``, without building the
    plan: what methods that measure many candidate plans need. For an order whose every input
    is live when read it equals ``simulate``'s peak and cost (a property test checks it); the
    plan a method returns is still replayed by ``simulate``.
    """
    order = np.asarray(order, dtype=np.int64)
    if not order.size:
        return graph.fixed_bytes, 0.0
    costs = graph.node_arrays[3]
    peak = max(graph.fixed_bytes, int(np.max(order_memory(graph, order))))
    return peak, float(np.cumsum(costs[order])[-1])  # summed in order, as simulate does


def order_memory(graph: Graph, order: np.ndarray) -> np.ndarray:
    """Memory while each position of ``order`` runs: what is live right after it computes
    (before its frees) plus its scratch. Its maximum is ``order_peak_and_cost``'s peak."""
    sizes, kept, temp, _costs = graph.node_arrays
    free_at = order_frees(graph, order)
    freed = np.bincount(free_at[free_at >= 0], weights=sizes[order[free_at >= 0]], minlength=order.size)
    first = np.zeros(order.size, dtype=bool)
    first[np.unique(order, return_index=True)[1]] = True
    allocated = sizes[order] + np.where(first, kept[order], 0)
    after = graph.fixed_bytes + np.cumsum(allocated) - np.concatenate(([0], np.cumsum(freed)[:-1])).astype(np.int64)
    return after + temp[order]


def order_reads(graph: Graph, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every read of the compute order ``order``, by reader: the reader's position, the value
    read and the position of the instance it reads (the value's latest computation before the
    reader; -1 where it has none)."""
    m = order.size
    indptr, indices = graph.deps_csr
    counts = indptr[order + 1] - indptr[order]
    reader = np.repeat(np.arange(m), counts)
    first_dep = np.repeat(indptr[order] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    value = indices[first_dep + np.arange(reader.size)]
    occurrences = np.sort(order * m + np.arange(m))
    at = np.searchsorted(occurrences, value * m + reader, side="left") - 1
    seen = at >= 0
    seen[seen] = occurrences[at[seen]] // m == value[seen]
    instance = np.where(seen, occurrences[np.maximum(at, 0)] % m, -1)
    return reader, value, instance


def order_frees(graph: Graph, order: np.ndarray,
                reads: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """``_free_positions`` with numpy: for each position, the position of the last read of the
    instance computed there before its node is computed again (its own position if never
    read), -1 for the last instance of an output. ``reads``: ``order_reads(graph, order)``,
    if the caller has it."""
    reader, _value, instance = order_reads(graph, order) if reads is None else reads
    free_at = np.arange(order.size)
    seen = instance >= 0
    np.maximum.at(free_at, instance[seen], reader[seen])
    outputs = np.asarray(graph.outputs, dtype=np.int64)
    if outputs.size:  # the last instance of an output lives to the end
        last = np.full(graph.n, -1, dtype=np.int64)
        last[order] = np.arange(order.size)  # later positions overwrite earlier ones
        last_out = last[outputs]
        free_at[last_out[last_out >= 0]] = -1
    return free_at


def least_compute(graph: Graph, keep: np.ndarray) -> np.ndarray:
    """The compute matrix of ``Schedule.from_kept(graph, keep)`` (see there), without the
    liveness matrix: what a method that measures many plans needs."""
    n = graph.n
    keep = np.array(keep, dtype=bool, copy=True)
    if keep.shape != (n, n):
        raise ScheduleError(f"keep matrix has shape {keep.shape}; expected ({n}, {n})")
    keep &= np.tri(n, n, -1, dtype=bool)  # only earlier nodes can be kept into a stage
    for i, node in enumerate(graph.nodes):
        if i in graph.output_set or not node.recomputable:
            keep[i + 1 :, i] = True
    R = np.zeros((n, n), dtype=bool)
    for t in range(n):
        need = [t]
        R[t, t] = True
        while need:
            j = need.pop()
            for d in graph.nodes[j].deps:
                if not keep[t, d] and not R[t, d]:
                    R[t, d] = True
                    need.append(d)
    return R


def plan_from_order(graph: Graph, order: list[int] | tuple[int, ...]) -> Plan:
    """Turn a sequence of node computations into a plan that frees at last use.

    An instance of a value lives from its computation to the last computation that reads it
    before the value is computed again; an output's last instance lives to the end. A
    computation whose input was never computed is kept as is: ``simulate`` reports it.
    """
    free_at = _free_positions(graph, order)
    frees_after: dict[int, list[int]] = {}
    for inst, p in enumerate(free_at):
        if p >= 0:
            frees_after.setdefault(p, []).append(order[inst])
    steps: list[Step] = []
    compute, free = StepKind.COMPUTE, StepKind.FREE
    for p, node in enumerate(order):
        steps.append(Step(compute, node))
        for freed in sorted(frees_after.get(p, ())):
            steps.append(Step(free, freed))
    return Plan(tuple(steps))


def _free_positions(graph: Graph, order: list[int] | tuple[int, ...]) -> list[int]:
    """For the instance computed at each position of ``order``: the position after which it is
    freed (its last reader before the value is computed again, or its own position), or -1
    for the last instance of an output, which is never freed."""
    return order_frees(graph, np.asarray(order, dtype=np.int64)).tolist() if len(order) else []


def _liveness(graph: Graph, R: np.ndarray) -> np.ndarray:
    """S[t, i] = value i is live at the start of stage t under ``Schedule.lower``: an instance
    computed in stage a and freed in stage b is live at the start of stages a+1..b."""
    n = graph.n
    S = np.zeros((n, n), dtype=bool)
    stages, order = np.nonzero(np.tril(R))
    order = order.tolist()
    stages = stages.tolist()
    for inst, p in enumerate(_free_positions(graph, order)):
        end = n - 1 if p < 0 else stages[p]
        if end > stages[inst]:
            S[stages[inst] + 1 : end + 1, order[inst]] = True
    return S
