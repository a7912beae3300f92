"""Thin adapters that hand a ``MilpModel`` to a solver: HiGHS, OR-Tools CP-SAT, Gurobi.

Each adapter only translates arrays, settings and the MIP start, and reports back a
``BackendResult`` in model units; decoding and checking the plan is the caller's job.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import logging
import math
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from remat.errors import SolverError
from remat.solvers.milp_model import MilpModel

log = logging.getLogger("remat.solve")

#: Seconds between progress lines while a solver runs.
PROGRESS_EVERY_S = 5.0

#: CP-SAT needs integer objective coefficients; non-integer costs are scaled so that the
#: largest becomes about this many units (then rounded to the nearest integer).
CPSAT_COST_RESOLUTION = 1_000_000


class MilpBackend(enum.Enum):
    HIGHS = "highs"
    CPSAT = "cpsat"
    GUROBI = "gurobi"

    @classmethod
    def parse(cls, value: object) -> MilpBackend:
        """Accept a ``MilpBackend`` or its name ("highs", "cpsat", "gurobi")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.strip().lower() in (member.value, member.name.lower()):
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown MILP backend {value!r}; choose one of {choices} (or a MilpBackend)")


class BackendStatus(enum.Enum):
    OPTIMAL = "optimal"  # solved to the requested gap
    FEASIBLE = "feasible"  # stopped by the time limit with an incumbent
    NO_SOLUTION = "no_solution"  # stopped by the time limit without one
    INFEASIBLE = "infeasible"


@dataclass(frozen=True)
class SolverSettings:
    """How long and how exactly to solve; ``threads`` is fixed so timings compare."""

    time_limit_s: float = 60.0
    mip_gap: float = 1e-4
    mip_abs_gap: float = 1e-6
    threads: int = 2
    relax: bool = False  # solve the LP relaxation (integrality dropped)
    label: str = "milp"
    quiet: bool = False  # an internal solve (a block's for the chain's menus): its troubles are logged at info


class RelaxationTimeout(SolverError):
    """The LP relaxation hit its time limit: no bound and no fractional solution to round."""


@dataclass(frozen=True)
class BackendResult:
    status: BackendStatus
    x: np.ndarray | None
    objective: float | None  # in model units (cost, or peak units for a PEAK model)
    bound: float | None
    solve_s: float
    nodes: int | None = None
    iterations: int | None = None


_MODULE = {MilpBackend.HIGHS: "highspy", MilpBackend.CPSAT: "ortools", MilpBackend.GUROBI: "gurobipy"}

#: Seconds a solver subprocess may take beyond its time limit (start-up, model transfer).
SUBPROCESS_GRACE_S = 120.0


def backend_available(backend: MilpBackend) -> None:
    """Raise ``SolverError`` with the install command if the backend is not installed.

    Checked without importing: importing ortools would make highspy unusable here (below).
    """
    module = _MODULE[backend]
    if importlib.util.find_spec(module) is None:
        raise SolverError(
            f"MILP backend {backend.value!r} needs the Python package {module!r}, which is not "
            f"installed; run `pip install {module}` (a license is needed for Gurobi) or choose "
            f"backend='highs'"
        ) from None


def run_backend(
    model: MilpModel, backend: MilpBackend, settings: SolverSettings, start: np.ndarray | None = None
) -> BackendResult:
    """Solve ``model`` with ``backend``; ``start`` is a complete feasible assignment or None."""
    backend_available(backend)
    log.info(
        "%s: %s on %s: %d columns (%d integer), %d rows, %d nonzeros, limit %.0f s%s",
        settings.label, backend.value, model.graph.name, model.n_cols, model.n_integer,
        model.n_rows, model.n_nonzeros, settings.time_limit_s, ", LP relaxation" if settings.relax else "",
    )
    if _in_process(backend):
        result = _RUNNERS[backend](model, settings, start)
    else:
        result = _run_isolated(backend, model, settings, start)
    log.info(
        "%s: %s finished: %s, objective %s, bound %s, %.2f s",
        settings.label, backend.value, result.status.value, result.objective, result.bound, result.solve_s,
    )
    return result


# highspy and ortools each ship their own libhighs.so.1 (different HiGHS versions, same
# soname): whichever is imported second in a process fails with an undefined symbol. CP-SAT
# therefore always runs in a spawned subprocess, and HiGHS does too if ortools got here first.
def _in_process(backend: MilpBackend) -> bool:
    if backend is MilpBackend.CPSAT:
        return False
    if backend is MilpBackend.HIGHS:
        try:
            import highspy  # noqa: F401
        except ImportError:
            return False
    return True


def _run_isolated(
    backend: MilpBackend, model: MilpModel, settings: SolverSettings, start: np.ndarray | None
) -> BackendResult:
    """Run one backend in a fresh interpreter; its log records are replayed here as they come.

    A plain subprocess rather than multiprocessing: spawn would re-import the caller's
    ``__main__``, which breaks scripts without a ``__main__`` guard.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", "from remat.solvers.milp_backends import _child_main; _child_main()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    messages: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_frames, args=(proc.stdout, messages), daemon=True)
    reader.start()
    deadline = time.monotonic() + settings.time_limit_s + SUBPROCESS_GRACE_S
    try:
        proc.stdin.write(pickle.dumps((backend, model, settings, start, log.getEffectiveLevel())))
        proc.stdin.close()
        while True:
            try:
                kind, payload = messages.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise SolverError(
                        f"the {backend.value} subprocess ran {SUBPROCESS_GRACE_S:.0f} s past its time "
                        f"limit on graph {model.graph.name!r} and was stopped"
                    ) from None
                continue
            if kind == "log":
                logging.getLogger(payload.name).handle(payload)
            elif kind == "error":
                raise payload
            elif kind == "eof":
                raise SolverError(
                    f"the {backend.value} subprocess died (exit code {proc.wait()}) on graph "
                    f"{model.graph.name!r} without an answer; try backend='highs'"
                )
            else:
                return payload
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _read_frames(stream, messages: queue.Queue) -> None:
    while True:
        header = stream.read(8)
        if len(header) < 8:
            messages.put(("eof", None))
            return
        messages.put(pickle.loads(stream.read(int.from_bytes(header, "little"))))


def _child_main() -> None:
    """Entry point of the solver subprocess: a pickled job on stdin, framed pickles out."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a solver prints goes to stderr, never into the frames
    lock = threading.Lock()

    def send(message: tuple) -> None:
        blob = pickle.dumps(message)
        with lock:
            out.write(len(blob).to_bytes(8, "little") + blob)
            out.flush()

    class _Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            record.msg, record.args, record.exc_info = record.getMessage(), None, None
            send(("log", record))

    backend, model, settings, start, level = pickle.loads(sys.stdin.buffer.read())
    child_log = logging.getLogger("remat.solve")
    child_log.handlers[:] = [_Forward()]
    child_log.setLevel(level)
    child_log.propagate = False
    try:
        send(("result", _RUNNERS[backend](model, settings, start)))
    except Exception as exc:  # noqa: BLE001 - handed to the parent, which re-raises it
        send(("error", exc if isinstance(exc, SolverError) else SolverError(f"{backend.value}: {exc!r}")))


class Progress:
    """Throttled progress logging shared by the adapters."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.last_s = -math.inf

    def incumbent(self, objective: float, bound: float, elapsed_s: float) -> None:
        log.info("%s: incumbent %.6g, bound %.6g at %.1f s", self.label, objective, bound, elapsed_s)
        self.last_s = elapsed_s

    def tick(self, objective: float, bound: float, elapsed_s: float) -> None:
        if elapsed_s - self.last_s >= PROGRESS_EVERY_S:
            log.info("%s: incumbent %.6g, bound %.6g at %.1f s", self.label, objective, bound, elapsed_s)
            self.last_s = elapsed_s


# ---------------------------------------------------------------------------- HiGHS
#: HiGHS' dual simplex fails ("excessive dual values") on costs of 1e7 us, as a batch of 256
#: VGG16 images has: objectives are scaled by a power of two (exact in floating point) so the
#: largest coefficient is at most this, and results are scaled back.
HIGHS_MAX_COST = 1e3


def objective_scale(costs: np.ndarray) -> float:
    """The power of two that brings the largest |cost| down to at most ``HIGHS_MAX_COST``.

    >>> objective_scale(np.array([4.0, 2e7]))
    3.0517578125e-05
    >>> objective_scale(np.array([0.5, 3.0]))
    1.0
    """
    top = float(np.max(np.abs(costs), initial=0.0))
    if top <= HIGHS_MAX_COST:
        return 1.0
    return 2.0 ** -math.ceil(math.log2(top / HIGHS_MAX_COST))


_highs_banner_done = False
_highs_banner_lock = threading.Lock()


def quiet_highs():
    """A ``highspy.Highs`` with its output off and no MIP restarts. HiGHS prints a banner to the
    process's stdout when the first instance is built, before any option can be set: that one is
    built with file descriptor 1 pointed at /dev/null, so remat's own output (tables, JSON on
    stdout) stays clean. A MIP that HiGHS 1.16 restarts after its root node ("inactive integer
    columns, restarting") can run on without end, past its time limit and deaf to
    ``cancelSolve``: a 1,900-column bound MIP of U-Net b32 at its smallest budget, given 1.4 s,
    ran for minutes (with one thread or two); without the restart it is solved in 1.0 s."""
    import highspy

    global _highs_banner_done
    with _highs_banner_lock:
        if not _highs_banner_done:
            sys.stdout.flush()
            saved = os.dup(1)
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    h = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
            _highs_banner_done = True
        else:
            h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_allow_restart", False)
    return h


def run_highs(h) -> None:
    """``h.run()`` on a ``highspy.Highs``, whatever thread count earlier runs used.

    HiGHS keeps one thread pool per process, sized by the first run; a run asking for another
    size is refused until the pool is rebuilt.
    """
    import highspy

    if h.run() == highspy.HighsStatus.kError and h.getModelStatus() == highspy.HighsModelStatus.kNotset:
        highspy.Highs.resetGlobalScheduler(True)
        h.run()


def _run_highs(model: MilpModel, settings: SolverSettings, start: np.ndarray | None) -> BackendResult:
    started = time.perf_counter()
    result = _run_highs_once(model, settings, start)
    if start is not None and result.x is not None and result.objective is not None and not settings.relax:
        actual = model.objective_value(result.x)
        if abs(actual - result.objective) > 1e-6 * max(1.0, abs(actual)):
            # HiGHS 1.16, given a start, was seen to report an improved objective (even "optimal")
            # with the start's values as the solution, so its bound cannot be trusted either; on
            # the retention model's MIPs only with presolve (see retention._run): solve again from
            # the start without presolve, then from scratch if that disagrees too, with the time
            # left (handled here: nothing for the user to act on)
            for retry_start, presolve in ((start, False), (None, True)):
                log.info("%s: HiGHS reported objective %g for a solution whose objective is %g; solving again %s",
                         settings.label, result.objective, actual,
                         "from the start without presolve" if retry_start is not None else "without the start")
                left = max(settings.time_limit_s - (time.perf_counter() - started), 1.0)
                result = _run_highs_once(model, dataclasses.replace(settings, time_limit_s=left), retry_start,
                                         presolve=presolve)
                if retry_start is None or result.x is None or result.objective is None:
                    break
                actual = model.objective_value(result.x)
                if abs(actual - result.objective) <= 1e-6 * max(1.0, abs(actual)):
                    break
    return result


def _run_highs_once(model: MilpModel, settings: SolverSettings, start: np.ndarray | None,
                    presolve: bool = True) -> BackendResult:
    import highspy

    h = quiet_highs()
    if not presolve:
        h.setOptionValue("presolve", "off")
    h.setOptionValue("time_limit", float(settings.time_limit_s))
    h.setOptionValue("mip_rel_gap", float(settings.mip_gap))
    h.setOptionValue("mip_abs_gap", float(settings.mip_abs_gap))
    h.setOptionValue("threads", int(settings.threads))
    # Memory rows carry byte counts up to ~1e8: keep integrality tight so that a rounded
    # solution cannot creep over the budget (the simulator checks it anyway).
    h.setOptionValue("mip_feasibility_tolerance", 1e-7)
    # Scaling by largest entries ("max value 0") keeps the byte-sized memory rows of U-Nets
    # tractable for simplex: their LP relaxation at 159 nodes took 10 s instead of > 120 s.
    h.setOptionValue("simplex_scale_strategy", 4)
    lp = highspy.HighsLp()
    lp.num_col_ = model.n_cols
    lp.num_row_ = model.n_rows
    scale = objective_scale(model.col_cost)
    lp.col_cost_ = model.col_cost * scale
    lp.col_lower_ = model.col_lower
    lp.col_upper_ = np.where(np.isinf(model.col_upper), highspy.kHighsInf, model.col_upper)
    lp.row_lower_ = np.where(np.isinf(model.row_lower), -highspy.kHighsInf, model.row_lower)
    lp.row_upper_ = np.where(np.isinf(model.row_upper), highspy.kHighsInf, model.row_upper)
    lp.offset_ = model.cost_offset * scale
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = model.row_start.astype(np.int32)
    lp.a_matrix_.index_ = model.row_index.astype(np.int32)
    lp.a_matrix_.value_ = model.row_value
    lp.a_matrix_.num_col_ = model.n_cols
    lp.a_matrix_.num_row_ = model.n_rows
    if not settings.relax:
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if integer else highspy.HighsVarType.kContinuous
            for integer in model.col_integer
        ]
    status = h.passModel(lp)
    if status == highspy.HighsStatus.kError:
        raise SolverError(f"HiGHS rejected the model for graph {model.graph.name!r} (a bug in remat)")
    if start is not None and not settings.relax:
        h.setSolution(model.n_cols, np.arange(model.n_cols, dtype=np.int32), np.asarray(start, dtype=float))
    progress = Progress(settings.label)
    if not settings.relax:
        def on_improve(event) -> None:
            out = event.data_out
            progress.incumbent(out.objective_function_value / scale, out.mip_dual_bound / scale, out.running_time)

        def on_log(event) -> None:
            out = event.data_out
            progress.tick(out.mip_primal_bound / scale, out.mip_dual_bound / scale, out.running_time)

        h.cbMipImprovingSolution.subscribe(on_improve)
        h.cbMipLogging.subscribe(on_log)
    started = time.perf_counter()
    run_highs(h)
    elapsed = time.perf_counter() - started
    model_status = h.getModelStatus()
    info = h.getInfo()
    has_x = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value, dtype=float) if has_x else None
    S = highspy.HighsModelStatus
    if model_status == S.kInfeasible:
        return BackendResult(BackendStatus.INFEASIBLE, None, None, None, elapsed)
    if settings.relax:
        if model_status == S.kTimeLimit:
            raise RelaxationTimeout(
                f"the LP relaxation of graph {model.graph.name!r} ({model.n_cols} variables) did not finish "
                f"within {settings.time_limit_s:g} s; raise time_limit_s"
            )
        if model_status != S.kOptimal:
            raise SolverError(f"HiGHS could not solve the LP relaxation: {h.modelStatusToString(model_status)}")
        obj = h.getObjectiveValue() / scale
        return BackendResult(BackendStatus.OPTIMAL, x, obj, obj, elapsed, iterations=info.simplex_iteration_count)
    bound = float(info.mip_dual_bound) / scale if math.isfinite(info.mip_dual_bound) else None
    nodes = int(info.mip_node_count)
    if model_status == S.kOptimal and x is not None:
        return BackendResult(BackendStatus.OPTIMAL, x, h.getObjectiveValue() / scale, bound, elapsed, nodes)
    if model_status in (S.kTimeLimit, S.kInterrupt, S.kSolutionLimit, S.kIterationLimit, S.kOptimal):
        if x is not None:
            return BackendResult(BackendStatus.FEASIBLE, x, h.getObjectiveValue() / scale, bound, elapsed, nodes)
        return BackendResult(BackendStatus.NO_SOLUTION, None, None, bound, elapsed, nodes)
    raise SolverError(
        f"HiGHS stopped with status {h.modelStatusToString(model_status)!r} on graph "
        f"{model.graph.name!r}; try backend='cpsat' or a longer time_limit_s"
    )


# ---------------------------------------------------------------------------- CP-SAT
def cpsat_cost_scale(costs: np.ndarray) -> tuple[float, bool]:
    """The factor that makes objective coefficients integers, and whether it is exact.

    Integer costs are used as they are; otherwise they are scaled so that the largest is
    ``CPSAT_COST_RESOLUTION`` and rounded to the nearest integer (a relative error of at
    most 0.5 / CPSAT_COST_RESOLUTION per term; CP-SAT then optimizes the rounded costs).
    """
    costs = np.abs(np.asarray(costs, dtype=float))
    if costs.size == 0 or np.all(costs == np.round(costs)):
        return 1.0, True
    scale = CPSAT_COST_RESOLUTION / float(costs.max())
    return scale, bool(np.all(costs * scale == np.round(costs * scale)))


def _run_cpsat(model: MilpModel, settings: SolverSettings, start: np.ndarray | None) -> BackendResult:
    from ortools.sat.python import cp_model

    if settings.relax:
        raise SolverError("CP-SAT has no LP relaxation; use backend='highs' for lp_round")
    m = cp_model.CpModel()
    finite_top = int(sum(model.size_units) + sum(model.kept_units) + max(model.temp_units, default=0)) + 1
    xs = []
    for lo, hi in zip(model.col_lower, model.col_upper):
        # Continuous columns of the model are 0/1 ORs or integer memory sums at the optimum.
        top = finite_top if not math.isfinite(hi) else min(math.floor(hi + 1e-9), finite_top)
        xs.append(m.NewIntVar(int(math.ceil(lo - 1e-9)), int(top), ""))
    for r in range(model.n_rows):
        a, b = model.row_start[r], model.row_start[r + 1]
        coefs = model.row_value[a:b]
        icoefs = [int(v) for v in np.round(coefs)]
        if np.any(np.abs(coefs - np.round(coefs)) > 1e-9):
            raise SolverError("CP-SAT needs integer row coefficients (a bug in remat's model)")
        expr = cp_model.LinearExpr.WeightedSum([xs[c] for c in model.row_index[a:b]], icoefs)
        lo, hi = model.row_lower[r], model.row_upper[r]
        m.AddLinearConstraint(
            expr,
            int(math.ceil(lo - 1e-9)) if math.isfinite(lo) else cp_model.INT_MIN,
            int(math.floor(hi + 1e-9)) if math.isfinite(hi) else cp_model.INT_MAX,
        )
    scale, _exact = cpsat_cost_scale(model.col_cost)
    obj = [int(round(c * scale)) for c in model.col_cost]
    nz = [i for i, c in enumerate(obj) if c != 0]
    m.Minimize(cp_model.LinearExpr.WeightedSum([xs[i] for i in nz], [obj[i] for i in nz]))
    if start is not None:
        for var, value in zip(xs, start):
            m.AddHint(var, int(round(value)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(settings.time_limit_s)
    solver.parameters.num_workers = int(settings.threads)
    solver.parameters.relative_gap_limit = float(settings.mip_gap)
    solver.parameters.absolute_gap_limit = max(float(settings.mip_abs_gap) * scale, 0.0)
    progress = Progress(settings.label)
    offset = model.cost_offset

    class _OnSolution(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            progress.incumbent(
                self.ObjectiveValue() / scale + offset, self.BestObjectiveBound() / scale + offset, self.WallTime()
            )

    started = time.perf_counter()
    status = solver.Solve(m, _OnSolution())
    elapsed = time.perf_counter() - started
    if status == cp_model.INFEASIBLE:
        return BackendResult(BackendStatus.INFEASIBLE, None, None, None, elapsed)
    bound = solver.BestObjectiveBound() / scale + offset
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        x = np.asarray(solver.ResponseProto().solution, dtype=float)
        objective = model.objective_value(x)
        kind = BackendStatus.OPTIMAL if status == cp_model.OPTIMAL else BackendStatus.FEASIBLE
        return BackendResult(kind, x, objective, bound, elapsed, int(solver.NumBranches()))
    if status == cp_model.UNKNOWN:
        return BackendResult(BackendStatus.NO_SOLUTION, None, None, bound, elapsed)
    raise SolverError(f"CP-SAT stopped with status {solver.StatusName(status)!r} on graph {model.graph.name!r}")


# ---------------------------------------------------------------------------- Gurobi
def _run_gurobi(model: MilpModel, settings: SolverSettings, start: np.ndarray | None) -> BackendResult:
    import gurobipy as gp
    from gurobipy import GRB

    env = gp.Env(params={"OutputFlag": 0})
    m = gp.Model(env=env)
    vtype = [GRB.CONTINUOUS if settings.relax or not integer else GRB.BINARY for integer in model.col_integer]
    xs = m.addVars(model.n_cols, lb=model.col_lower.tolist(),
                   ub=[GRB.INFINITY if math.isinf(u) else u for u in model.col_upper], vtype=vtype)
    for r in range(model.n_rows):
        a, b = model.row_start[r], model.row_start[r + 1]
        expr = gp.LinExpr(model.row_value[a:b].tolist(), [xs[int(c)] for c in model.row_index[a:b]])
        lo, hi = model.row_lower[r], model.row_upper[r]
        if lo == hi:
            m.addLConstr(expr, GRB.EQUAL, lo)
        else:
            if math.isfinite(hi):
                m.addLConstr(expr, GRB.LESS_EQUAL, hi)
            if math.isfinite(lo):
                m.addLConstr(expr, GRB.GREATER_EQUAL, lo)
    m.setObjective(gp.LinExpr(model.col_cost.tolist(), [xs[i] for i in range(model.n_cols)]) + model.cost_offset)
    m.Params.TimeLimit = float(settings.time_limit_s)
    m.Params.MIPGap = float(settings.mip_gap)
    m.Params.MIPGapAbs = float(settings.mip_abs_gap)
    m.Params.Threads = int(settings.threads)
    if start is not None and not settings.relax:
        for i in range(model.n_cols):
            xs[i].Start = float(start[i])
    progress = Progress(settings.label)

    def callback(mdl, where) -> None:
        if where == GRB.Callback.MIPSOL:
            progress.incumbent(mdl.cbGet(GRB.Callback.MIPSOL_OBJ), mdl.cbGet(GRB.Callback.MIPSOL_OBJBND),
                               mdl.cbGet(GRB.Callback.RUNTIME))

    started = time.perf_counter()
    m.optimize(None if settings.relax else callback)
    elapsed = time.perf_counter() - started
    if m.Status in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
        return BackendResult(BackendStatus.INFEASIBLE, None, None, None, elapsed)
    has_x = m.SolCount > 0
    x = np.array([xs[i].X for i in range(model.n_cols)]) if has_x else None
    bound = m.ObjVal if settings.relax and has_x else (m.ObjBound if not settings.relax else None)
    if m.Status == GRB.OPTIMAL and has_x:
        return BackendResult(BackendStatus.OPTIMAL, x, m.ObjVal, bound, elapsed)
    if has_x:
        return BackendResult(BackendStatus.FEASIBLE, x, m.ObjVal, bound, elapsed)
    return BackendResult(BackendStatus.NO_SOLUTION, None, None, bound, elapsed)


_RUNNERS = {MilpBackend.HIGHS: _run_highs, MilpBackend.CPSAT: _run_cpsat, MilpBackend.GUROBI: _run_gurobi}
