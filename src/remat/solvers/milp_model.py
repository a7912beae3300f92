"""The rematerialization MILP as plain arrays: one model that every backend solves.

Variables (Checkmate's, with fewer of them):

- ``R[t, i]``: node i is computed in stage t; ``S[t, i]``: i's output is live at the start of
  stage t. Entries that cannot matter are constants, not variables (see ``_possible``).
- ``A[t, i, a]`` (continuous in [0, 1]): i's output is still live right after the a-th
  *candidate* of i in stage t has run, where the candidates are i itself and the users of i
  that are <= t. A is a change of variables of Checkmate's FREE: FREE[t, i, c_a] =
  A[t, i, a-1] - A[t, i, a]. Only lower bounds are needed (A >= S[t+1, i] and A >= R[t, c_b]
  for every later candidate b) because A only ever adds memory: the solver sets it to the
  exact OR, which is 0/1 when R and S are. Writing the OR as a chain ``A[a] >= A[a+1]``,
  ``A[a] >= R[t, c_{a+1}]`` is the convex hull of "freed after the last use", whereas
  Checkmate's big-M linearization of FREE lets the LP free a fractional value several times.
- ``U[t, k]`` (continuous): memory right after node k is computed in stage t, only where
  ``R[t, k]`` can be 1 (other instants cannot be peaks); ``U <= budget`` is a variable bound.

Memory is in units of the gcd of the graph's output sizes, so every memory quantity is an
exact integer and the budget row is ``floor((budget - fixed) / unit)``: no rounding. When
that would make one value more than ``MAX_SIZE_UNITS`` units (a batch of 256 images has
gigabyte activations and a gcd of a few bytes), the unit grows and sizes round up: the model
then counts at most one unit too many per live value, never too few, so its plans still fit.

Dominance rows (option ``dominance``, default on) make S exactly the liveness of R: a value
is live at the start of a stage (or computed in it) only if a user reads it in that stage or
it is kept into the next one. Every plan that breaks them has a counterpart that obeys them
at no more cost and no more memory, so they cut off no optimum; they remove the solver's
freedom to keep dead values, which otherwise multiplies equivalent solutions.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from remat.graph import Graph
from remat.schedule import Schedule
from remat.solvers.base import row_activity

#: Markers in ``MilpModel.r_col`` / ``s_col`` for entries fixed by the formulation.
FIXED_ZERO = -1
FIXED_ONE = -2

#: How far an integer variable may sit from 0 or 1 and still be read as a binary.
BINARY_TOLERANCE = 1e-6


class ModelObjective(enum.Enum):
    COST = "cost"  # least total compute cost within the budget
    PEAK = "peak"  # least peak memory (gives the smallest feasible budget)


class Definition(enum.Enum):
    """How a derived column follows from others (to complete a MIP start)."""

    MAX = "max"  # the largest of some columns or FIXED_* constants (an OR)
    SUM = "sum"  # a weighted sum of columns; column -1 is the constant 1


@dataclass(frozen=True)
class MilpModel:
    """A mixed-integer program ``min cost.x  s.t.  row_lower <= A x <= row_upper``.

    Rows are CSR (``row_start``, ``row_index``, ``row_value``). Memory quantities are in
    units of ``bytes_unit`` and exclude ``graph.fixed_bytes``. ``infeasible_reason`` is set
    when building alone proved that no plan fits (a constant row already over the budget).
    """

    graph: Graph
    objective_kind: ModelObjective
    budget_bytes: int | None
    bytes_unit: int
    size_units: tuple[int, ...]  # out_bytes of each node in units (rounded up)
    temp_units: tuple[int, ...]  # temp_bytes of each node in units (rounded up)
    kept_units: tuple[int, ...]  # kept_bytes of each node in units (rounded up)
    exact_units: bool  # every size is a whole number of units (no rounding)
    col_lower: np.ndarray
    col_upper: np.ndarray
    col_integer: np.ndarray
    col_cost: np.ndarray
    cost_offset: float
    row_start: np.ndarray
    row_index: np.ndarray
    row_value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    r_col: np.ndarray
    s_col: np.ndarray
    peak_col: int | None
    definitions: tuple[tuple, ...]
    infeasible_reason: str | None
    rounded_down: bool = False  # sizes rounded down: a relaxation of the graph (``build_model``)

    @property
    def bounds_graph(self) -> bool:
        """Whether the model's relaxations bound the graph's plans: its sizes are exact, or
        rounded down."""
        return self.exact_units or self.rounded_down

    @property
    def n_cols(self) -> int:
        return int(self.col_lower.size)

    @property
    def n_rows(self) -> int:
        return int(self.row_lower.size)

    @property
    def n_integer(self) -> int:
        return int(self.col_integer.sum())

    @property
    def n_nonzeros(self) -> int:
        return int(self.row_value.size)

    def r_values(self, x: np.ndarray) -> np.ndarray:
        """The float matrix R of solution ``x`` (constants filled in)."""
        return _matrix(self.r_col, x)

    def s_values(self, x: np.ndarray) -> np.ndarray:
        """The float matrix S of solution ``x`` (constants filled in)."""
        return _matrix(self.s_col, x)

    def objective_value(self, x: np.ndarray) -> float:
        return float(self.cost_offset + self.col_cost @ x)

    def max_violation(self, x: np.ndarray) -> float:
        """Largest bound or row violation of ``x`` (0.0 for a feasible point)."""
        activity = row_activity(self.row_start, self.row_index, self.row_value, x)
        worst = 0.0
        if self.n_rows:
            worst = max(worst, float(np.max(self.row_lower - activity, initial=0.0)))
            worst = max(worst, float(np.max(activity - self.row_upper, initial=0.0)))
        worst = max(worst, float(np.max(self.col_lower - x, initial=0.0)))
        worst = max(worst, float(np.max(x - self.col_upper, initial=0.0)))
        return worst

    def start_from(self, schedule: Schedule) -> tuple[np.ndarray | None, str]:
        """A complete assignment for a known plan (a MIP start), or None and the reason.

        S is taken as the liveness of R (what the plan really keeps), A and U follow from
        their definitions; the point is then checked against every row.
        """
        R = np.asarray(schedule.R, dtype=bool)
        S = Schedule.from_compute(self.graph, R).S
        x = np.zeros(self.n_cols)
        for name, matrix, cols in (("R", R, self.r_col), ("S", S, self.s_col)):
            if np.any(matrix & (cols == FIXED_ZERO)) or np.any(~matrix & (cols == FIXED_ONE)):
                return None, f"the plan sets an entry of {name} that the formulation fixes"
            var = cols >= 0
            x[cols[var]] = matrix[var]
        for kind, col, terms in self.definitions:
            if kind is Definition.MAX:  # terms are columns or the FIXED_* constants
                x[col] = max((x[c] if c >= 0 else float(c == FIXED_ONE)) for c in terms)
            else:  # terms are (column, coefficient); column -1 is the constant
                x[col] = sum(v * (x[c] if c >= 0 else 1.0) for c, v in terms)
        violation = self.max_violation(x)
        if violation > 1e-6:
            return None, f"the plan violates a row of the model by {violation:g}"
        return x, "ok"

    def decode(self, x: np.ndarray) -> Schedule:
        """The schedule of a solution: R read with ``BINARY_TOLERANCE``, S = liveness of R.

        Raises ``ValueError`` if an R or S variable is not within tolerance of a binary, or if
        the solution keeps less than the plan needs (its memory would not be an upper bound).
        """
        R = self.r_values(x)
        S = self.s_values(x)
        for name, values in (("R", R), ("S", S)):
            off = np.abs(values - np.round(values))
            if off.max(initial=0.0) > BINARY_TOLERANCE:
                t, i = np.unravel_index(int(off.argmax()), off.shape)
                raise ValueError(
                    f"{name}[{t}, {i}] = {values[t, i]!r} is not within {BINARY_TOLERANCE} of 0 or 1"
                )
        schedule = Schedule.from_compute(self.graph, R > 0.5)
        short = schedule.S & ~(S > 0.5)
        if short.any():
            t, i = np.argwhere(short)[0]
            raise ValueError(f"the plan needs {self.graph.describe(int(i))} live at stage {t} but S[{t}, {i}] = 0")
        return schedule


def _matrix(cols: np.ndarray, x: np.ndarray) -> np.ndarray:
    out = np.where(cols == FIXED_ONE, 1.0, 0.0)
    var = cols >= 0
    out[var] = x[cols[var]]
    return out


# ---------------------------------------------------------------------------- building
#: Largest size of one value in model units; beyond it the unit grows past the gcd.
MAX_SIZE_UNITS = 2**20


def bytes_unit_of(graph: Graph) -> int:
    """The gcd of all output and scratch sizes (memory in this unit is an exact integer),
    or, if the largest size would exceed ``MAX_SIZE_UNITS`` units, the unit that makes it
    that many (sizes then round up).

    >>> from remat.graph import Graph, Node, NodeKind
    >>> def two(a, b):
    ...     return Graph(nodes=(Node("a", NodeKind.FORWARD, (), a, 1.0), Node("b", NodeKind.LOSS, (0,), b, 1.0)),
    ...                  fixed_bytes=0, outputs=(1,))
    >>> bytes_unit_of(two(6, 12)), bytes_unit_of(two(2**30, 3))
    (6, 1024)
    """
    unit = 0
    largest = 0
    for node in graph.nodes:
        for nbytes in (node.out_bytes, node.temp_bytes, node.kept_bytes):
            unit = math.gcd(unit, int(nbytes))
        largest = max(largest, node.out_bytes, node.temp_bytes, node.kept_bytes)
    unit = max(unit, 1)
    if largest // unit > MAX_SIZE_UNITS:
        unit = -(-largest // MAX_SIZE_UNITS)
    return unit


def units_are_exact(graph: Graph, unit: int | None = None) -> bool:
    """Whether every size of ``graph`` is a whole number of its model's memory units
    (``bytes_unit_of``): then the model counts memory exactly and its relaxation bounds the
    graph's plans; otherwise sizes round up and it bounds nothing."""
    unit = bytes_unit_of(graph) if unit is None else unit
    return all(b % unit == 0 for node in graph.nodes for b in (node.out_bytes, node.temp_bytes, node.kept_bytes))


def _units(nbytes: int, unit: int) -> int:
    return -(-int(nbytes) // unit)


def peak_lower_bound_bytes(graph: Graph) -> int:
    """A peak no plan can beat: computing node t needs t, its inputs, its scratch space and
    every earlier output live at once."""
    outputs = graph.output_set
    best = 0
    kept = 0
    for t, node in enumerate(graph.nodes):
        kept += node.kept_bytes
        live = {t, *node.deps, *(o for o in outputs if o < t)}
        best = max(best, sum(graph.out_bytes[i] for i in live) + node.temp_bytes + kept)
    return graph.fixed_bytes + best


def _possible(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """Which R[t, j] and S[t, i] can be 1 in a plan without useless work.

    R[t, j] (j < t) matters only if a user of j computed in stage t reads it or it is kept
    into stage t+1; S[t, i] only if a user computed in stage t reads it or it is kept on.
    Outputs are computed once and kept (R fixed 0, S fixed 1 after their stage);
    non-recomputable nodes are computed only in their own stage.
    """
    n = graph.n
    users = graph.users
    outputs = graph.output_set
    pos_r = np.zeros((n, n), dtype=bool)
    pos_s = np.zeros((n, n), dtype=bool)
    for t in range(n - 1, -1, -1):
        pos_r[t, t] = True
        kept_next = pos_s[t + 1] if t + 1 < n else np.zeros(n, dtype=bool)
        for j in range(t - 1, -1, -1):
            if j in outputs or not graph.nodes[j].recomputable:
                continue
            pos_r[t, j] = kept_next[j] or any(pos_r[t, u] for u in users[j] if u <= t)
        for i in range(t):
            pos_s[t, i] = i in outputs or kept_next[i] or any(pos_r[t, u] for u in users[i] if u <= t)
    return pos_r, pos_s


class _Builder:
    """Accumulates columns and rows; terms are ``(col, coef)`` with col -1 for a constant."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.cost: list[float] = []
        self.starts: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.definitions: list[tuple] = []
        self.infeasible: str | None = None
        self.integer_live = False

    def col(self, lower: float, upper: float, integer: bool, cost: float = 0.0) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        self.cost.append(cost)
        return len(self.lower) - 1

    def row(self, terms: dict[int, float], lo: float, hi: float, what: str) -> None:
        """Add ``lo <= sum(terms) <= hi``; the key -1 holds the constant part."""
        const = terms.pop(-1, 0.0)
        terms = {c: v for c, v in terms.items() if v != 0.0}
        lo, hi = lo - const, hi - const
        if not terms:
            if lo > 1e-9 or hi < -1e-9:
                self.infeasible = self.infeasible or what
            return
        for c, v in terms.items():
            self.index.append(c)
            self.value.append(v)
        self.starts.append(len(self.index))
        self.row_lo.append(lo)
        self.row_hi.append(hi)


def _add(acc: dict[int, float], col: int, coef: float) -> None:
    """Add ``coef * col`` to a linear expression; col FIXED_ONE is the constant 1."""
    if col == FIXED_ZERO or coef == 0.0:
        return
    key = -1 if col == FIXED_ONE else col
    acc[key] = acc.get(key, 0.0) + coef


def _or_col(b: _Builder, x: int, y: int) -> int:
    """A column >= max(x, y) (exactly the OR at the optimum), simplified for constants."""
    if x == FIXED_ONE or y == FIXED_ONE:
        return FIXED_ONE
    if x == FIXED_ZERO or x == y:
        return y
    if y == FIXED_ZERO:
        return x
    a = b.col(0.0, 1.0, b.integer_live)
    b.row({a: 1.0, x: -1.0}, 0.0, math.inf, "or")
    b.row({a: 1.0, y: -1.0}, 0.0, math.inf, "or")
    b.definitions.append((Definition.MAX, a, (x, y)))
    return a


def build_model(
    graph: Graph,
    budget_bytes: int | None,
    objective: ModelObjective = ModelObjective.COST,
    *,
    dominance: bool = True,
    peak_upper_bytes: int | None = None,
    explicit_memory: bool = False,
    integer_live: bool = False,
    round_down: bool = False,
) -> MilpModel:
    """Build the MILP for ``graph`` under ``budget_bytes`` (COST) or without one (PEAK).

    Where sizes are not whole units (``units_are_exact``) they round up: every plan of the
    model fits the graph, and the model is stricter than it. ``round_down`` rounds them down
    instead: every plan that fits the graph is a plan of the model (a live set's bytes fit,
    so its rounded-down units, a whole number, fit the budget's units rounded down), so its
    relaxations bound the graph's plans, while its plans must be measured before they run.

    For PEAK, ``peak_upper_bytes`` (the peak of a known plan) bounds the peak variable.
    Two variants kept for measuring, off by default because neither helped HiGHS:
    ``explicit_memory`` writes each instant's whole live set as one knapsack row instead of
    the U recurrence (O(n^3) nonzeros), ``integer_live`` declares the A columns integer.

    >>> from remat.builders import chain_graph
    >>> m = build_model(chain_graph(2, bytes_per_node=1), 4)
    >>> m.n_integer > 0, m.infeasible_reason is None
    (True, True)
    """
    if round_down and objective is not ModelObjective.COST:
        raise ValueError("round_down is for COST models (a PEAK model's bounds assume sizes rounded up)")
    n, users, outputs = graph.n, graph.users, graph.output_set
    unit = bytes_unit_of(graph)
    units = (lambda nbytes: int(nbytes) // unit) if round_down else (lambda nbytes: _units(nbytes, unit))
    size = [units(b) for b in graph.out_bytes]
    temp = [units(node.temp_bytes) for node in graph.nodes]
    kept = [units(node.kept_bytes) for node in graph.nodes]
    exact_units = units_are_exact(graph, unit)
    cost = graph.costs
    pos_r, pos_s = _possible(graph)
    b = _Builder()
    r_col = np.full((n, n), FIXED_ZERO, dtype=np.int64)
    s_col = np.full((n, n), FIXED_ZERO, dtype=np.int64)
    offset = 0.0
    for t in range(n):
        for i in range(t + 1):
            if i == t:
                r_col[t, t] = FIXED_ONE
                offset += cost[t]
            elif pos_r[t, i]:
                r_col[t, i] = b.col(0.0, 1.0, True, cost[i] if objective is ModelObjective.COST else 0.0)
            if i < t and pos_s[t, i]:
                s_col[t, i] = FIXED_ONE if i in outputs else b.col(0.0, 1.0, True)
    if objective is not ModelObjective.COST:
        offset = 0.0

    def s_next(t: int, i: int) -> int:
        if t + 1 < n:
            return int(s_col[t + 1, i])
        return FIXED_ONE if i in outputs else FIXED_ZERO

    b.integer_live = integer_live
    _structure_rows(graph, b, r_col, s_col, s_next, dominance)
    cap = math.inf
    if objective is ModelObjective.COST:
        if budget_bytes is None:
            raise ValueError("a COST model needs budget_bytes")
        cap = math.floor((budget_bytes - graph.fixed_bytes) / unit)
    peak_col = None
    if objective is ModelObjective.PEAK:
        lo = math.ceil((peak_lower_bound_bytes(graph) - graph.fixed_bytes) / unit)
        # with rounded sizes a known plan counts up to one unit more per live value
        slack = 0 if exact_units else n
        hi = math.inf if peak_upper_bytes is None else math.floor((peak_upper_bytes - graph.fixed_bytes) / unit) + slack
        peak_col = b.col(float(lo), float(hi), False, 1.0)
    instants: list[int] = []
    for t in range(n):
        instants += _memory_rows(graph, b, t, size, temp, kept, r_col, s_col, s_next, cap, peak_col, explicit_memory)
    if peak_col is not None:
        b.definitions.append((Definition.MAX, peak_col, tuple(instants) or (FIXED_ZERO,)))
    if cap < 0:
        b.infeasible = b.infeasible or "fixed_bytes alone exceed the budget"
    return MilpModel(
        graph=graph,
        objective_kind=objective,
        budget_bytes=budget_bytes,
        bytes_unit=unit,
        size_units=tuple(size),
        temp_units=tuple(temp),
        kept_units=tuple(kept),
        exact_units=exact_units,
        col_lower=np.asarray(b.lower, dtype=float),
        col_upper=np.asarray(b.upper, dtype=float),
        col_integer=np.asarray(b.integer, dtype=bool),
        col_cost=np.asarray(b.cost, dtype=float),
        cost_offset=offset,
        row_start=np.asarray(b.starts, dtype=np.int64),
        row_index=np.asarray(b.index, dtype=np.int64),
        row_value=np.asarray(b.value, dtype=float),
        row_lower=np.asarray(b.row_lo, dtype=float),
        row_upper=np.asarray(b.row_hi, dtype=float),
        r_col=r_col,
        s_col=s_col,
        peak_col=peak_col,
        definitions=tuple(b.definitions),
        rounded_down=round_down and not exact_units,
        infeasible_reason=b.infeasible,
    )


def _structure_rows(graph, b: _Builder, r_col, s_col, s_next, dominance: bool) -> None:
    """Dependencies, keeping, at-most-one-instance and (optionally) dominance rows."""
    n, users, outputs = graph.n, graph.users, graph.output_set
    for t in range(n):
        for j in range(t + 1):
            if r_col[t, j] == FIXED_ZERO:
                continue
            for d in graph.nodes[j].deps:  # an input is live when its user runs
                acc: dict[int, float] = {}
                _add(acc, int(r_col[t, j]), 1.0)
                _add(acc, int(r_col[t, d]), -1.0)
                _add(acc, int(s_col[t, d]), -1.0)
                b.row(acc, -math.inf, 0.0, f"stage {t}: input {d} of {j}")
        for i in range(t):
            r, s = int(r_col[t, i]), int(s_col[t, i])
            if r >= 0 and s >= 0:  # never two instances of one value
                b.row({r: 1.0, s: 1.0}, -math.inf, 1.0, "one instance")
            nxt = s_next(t, i)
            if t + 1 < n and nxt >= 0:  # a value kept into t+1 was live in t or computed in t
                acc = {}
                _add(acc, nxt, 1.0)
                _add(acc, r, -1.0)
                _add(acc, s, -1.0)
                b.row(acc, -math.inf, 0.0, f"stage {t}: keep {i}")
            if dominance and i not in outputs and (r >= 0 or s >= 0):
                acc = {}
                _add(acc, r, 1.0)
                _add(acc, s, 1.0)
                for u in users[i]:
                    if u <= t:
                        _add(acc, int(r_col[t, u]), -1.0)
                _add(acc, nxt, -1.0)
                b.row(acc, -math.inf, 0.0, f"stage {t}: useless {i}")


def _memory_rows(graph, b: _Builder, t: int, size, temp, kept, r_col, s_col, s_next, cap: float, peak_col,
                 explicit: bool) -> list[int]:
    """U columns and rows for stage t; returns the U columns (one per possible instant)."""
    users = graph.users
    present = {}  # i -> (r, s) columns for i < t
    live_after: dict[int, list[int]] = {}  # i -> A column per candidate of i in stage t
    cand_pos: dict[int, dict[int, int]] = {}
    for i in range(t):
        r, s = int(r_col[t, i]), int(s_col[t, i])
        present[i] = (r, s)
        cands = [i] + [u for u in users[i] if u <= t]
        cand_pos[i] = {c: a for a, c in enumerate(cands)}
        if r == FIXED_ZERO and s == FIXED_ZERO:
            live_after[i] = [FIXED_ZERO] * len(cands)
            continue
        chain = [s_next(t, i)]
        for c in reversed(cands[1:]):
            chain.append(_or_col(b, chain[-1], int(r_col[t, c])))
        live_after[i] = chain[::-1]
    # memory right after computing node 0 of stage t
    running: dict[int, float] = {}
    # kept bytes of nodes computed in earlier stages (they run once, in their own stage)
    _add(running, FIXED_ONE, float(sum(kept[:t])))
    if t == 0:
        _add(running, FIXED_ONE, size[0] + kept[0])
    else:
        _add(running, present[0][0], size[0])
        _add(running, present[0][1], size[0])
        for i in range(1, t):
            _add(running, int(s_col[t, i]), size[i])
    instants: list[int] = []
    for k in range(t + 1):
        if k > 0:  # move from just after k-1 (before its frees) to just after k
            _add(running, int(r_col[t, k]), size[k])
            if k == t:
                _add(running, FIXED_ONE, kept[k])
            p = k - 1
            _add(running, live_after[p][0], size[p])
            _add(running, present[p][0], -size[p])
            _add(running, present[p][1], -size[p])
            for i in graph.nodes[p].deps:
                a = cand_pos[i][p]
                _add(running, live_after[i][a], size[i])
                _add(running, live_after[i][a - 1], -size[i])
        if r_col[t, k] == FIXED_ZERO:
            continue  # no computation here: not a peak candidate
        scratch: dict[int, float] = {}  # node k's scratch space, held only while it runs
        _add(scratch, int(r_col[t, k]), temp[k])
        const = running.get(-1, 0.0)
        if all(c == -1 for c in running):
            if const + scratch.get(-1, 0.0) > cap:  # nothing to decide: the budget is too small outright
                b.infeasible = b.infeasible or f"stage {t}: computing node {k} needs {const} units over {cap}"
            if peak_col is None:
                continue
        if explicit:  # the whole live set in one knapsack row (lets the solver find covers)
            row = dict(running)
            for c, v in scratch.items():
                row[c] = row.get(c, 0.0) + v
            if peak_col is not None:
                row[peak_col] = -1.0
            b.row(row, -math.inf, 0.0 if peak_col is not None else cap, f"stage {t}: memory at {k}")
            continue
        u = b.col(0.0, cap, False)
        terms = dict(running)
        b.definitions.append((Definition.SUM, u, tuple(terms.items())))
        row = {c: -v for c, v in terms.items() if c != -1}
        row[u] = 1.0
        row[-1] = -const
        b.row(row, 0.0, 0.0, f"stage {t}: memory at {k}")
        top = u
        if scratch:  # memory while k runs: U plus its scratch, under the same cap
            top = b.col(0.0, cap, False)
            with_scratch = {u: 1.0, **scratch}
            b.definitions.append((Definition.SUM, top, tuple(with_scratch.items())))
            row = {c: -v for c, v in with_scratch.items()}
            row[top] = 1.0
            b.row(row, 0.0, 0.0, f"stage {t}: memory while {k} runs")
        if peak_col is not None:
            b.row({top: 1.0, peak_col: -1.0}, -math.inf, 0.0, "peak")
        instants.append(top)
        running = {u: 1.0}
    return instants
