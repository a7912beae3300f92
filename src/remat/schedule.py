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
    current: dict[int, int] = {}  # node -> position of its live instance
    free_at: dict[int, int] = {}  # instance position -> position after which it is freed
    instance_node: dict[int, int] = {}
    last_instance: dict[int, int] = {}
    for p, node in enumerate(order):
        for d in graph.nodes[node].deps:
            if d in current:
                free_at[current[d]] = p
        current[node] = p
        instance_node[p] = node
        free_at[p] = p
        last_instance[node] = p
    frees_after: dict[int, list[int]] = {}
    for inst, p in free_at.items():
        node = instance_node[inst]
        if node in graph.output_set and last_instance[node] == inst:
            continue
        frees_after.setdefault(p, []).append(node)
    steps: list[Step] = []
    for p, node in enumerate(order):
        steps.append(Step(StepKind.COMPUTE, node))
        for freed in sorted(frees_after.get(p, ())):
            steps.append(Step(StepKind.FREE, freed))
    return Plan(tuple(steps))


def _liveness(graph: Graph, R: np.ndarray) -> np.ndarray:
    """S[t, i] = value i is live at the start of stage t under ``Schedule.lower``."""
    n = graph.n
    S = np.zeros((n, n), dtype=bool)
    stage_of_compute = np.nonzero(np.tril(R))[0].tolist()
    plan = Schedule(R=R, S=np.zeros_like(R)).lower(graph)
    live: set[int] = set()
    stage, k = 0, 0
    for step in plan.steps:
        if step.kind is StepKind.COMPUTE:
            while stage < stage_of_compute[k]:
                stage += 1
                S[stage, sorted(live)] = True
            live.add(step.node)
            k += 1
        else:
            live.discard(step.node)
    while stage < n - 1:
        stage += 1
        S[stage, sorted(live)] = True
    return S
