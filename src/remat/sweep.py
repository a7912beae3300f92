"""Solve one graph with several methods over a range of budgets.

Pure computation: returns records; printing, plotting and files are the caller's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from remat.errors import InfeasibleBudgetError, UnsupportedGraphError, a_type
from remat.files import write_atomically
from remat.graph import Graph
from remat.solvers import solve

log = logging.getLogger("remat.sweep")
T = TypeVar("T")


@dataclass(frozen=True)
class SweepPoint:
    """One (method, budget) cell. ``result`` is the summary of the plan, or None when the
    method has no plan at this budget (``min_budget_bytes`` then says what it needs)."""

    method: str
    budget_bytes: int
    budget_fraction: float
    result: dict[str, object] | None
    min_budget_bytes: int | None = None
    skipped: str | None = None
    #: read back from a results file rather than solved (not saved)
    read_back: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "method": self.method,
            "budget_bytes": self.budget_bytes,
            "budget_fraction": self.budget_fraction,
            "result": self.result,
            "min_budget_bytes": self.min_budget_bytes,
            "skipped": self.skipped,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, object]) -> SweepPoint:
        """The point ``to_json`` wrote; ``ValueError`` says what a damaged record lacks."""
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def byte_count(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        if not isinstance(record, Mapping):
            raise ValueError("the stored point is not a JSON object")
        result = record.get("result")
        problems = []
        if not isinstance(record.get("method"), str):
            problems.append("no method name")
        if not isinstance(record.get("budget_bytes"), int) or not number(record.get("budget_fraction")):
            problems.append("no budget")
        if result is not None and (not isinstance(result, Mapping) or not number(result.get("overhead"))
                                   or not isinstance(result.get("status"), str)):
            problems.append("a result without an overhead and a status")
        elif result is not None:
            budget = record.get("budget_bytes")
            peak = result.get("peak_bytes")
            if not byte_count(peak) or (isinstance(budget, int) and peak > budget):
                problems.append(f"a peak ({peak!r}) that is not a number of bytes within the budget")
            for name in ("cost", "overhead"):
                if not number(result.get(name)) or not 0 < result[name] < math.inf:
                    problems.append(f"a {name} ({result.get(name)!r}) that is not a positive number")
            for name in ("lower_bound", "gap"):
                if result.get(name) is not None and not number(result.get(name)):
                    problems.append(f"a {name} ({result.get(name)!r}) that is not a number")
        least = record.get("min_budget_bytes")
        if least is not None and not byte_count(least):
            problems.append("a smallest budget that is not a number of bytes")
        if problems:
            raise ValueError("the stored point has " + " and ".join(problems))
        return cls(record["method"], record["budget_bytes"], record["budget_fraction"], result,
                   min_budget_bytes=record.get("min_budget_bytes"), skipped=record.get("skipped"))


def checkpoint_all_peak(graph: Graph) -> int:
    """Peak bytes of keeping everything: the reference that percentage budgets refer to."""
    from remat.units import MAX_BUDGET_BYTES

    return solve(graph, MAX_BUDGET_BYTES, method="checkpoint_all").peak_bytes


def budget_grid(graph: Graph, fractions: Sequence[float]) -> list[int]:
    """Budgets at the given fractions of the checkpoint-all peak (rounded down to bytes)."""
    ref = checkpoint_all_peak(graph)
    return [max(1, int(f * ref)) for f in fractions]


def sweep(
    graph: Graph,
    methods: Sequence[str],
    budgets_bytes: Iterable[int],
    *,
    options: dict[str, dict[str, object]] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    store: ResultStore | None = None,
) -> list[SweepPoint]:
    """Solve ``graph`` with every method at every budget.

    ``options[method]`` are keyword options for that method (e.g. ``time_limit_s``).
    ``on_point`` is called after each cell (for progress bars). With a ``store``, each cell is
    written to it as soon as it is solved, and a cell the store already holds for the same
    graph fingerprint, method, options, budget and remat version is read back, not solved:
    an interrupted sweep resumes where it stopped.

    Each solve runs in a worker thread while this thread waits, so Ctrl-C
    (``KeyboardInterrupt``) stops the sweep at once, even inside a solver's C code; the
    abandoned solve is left to finish in the background (``solves_running()`` says whether
    one is), and every cell solved before it is in the store.

    >>> from remat.builders import chain_graph
    >>> pts = sweep(chain_graph(6), ["checkpoint_all", "chen_sqrtn"], [2**40])
    >>> [p.result["overhead"] >= 1.0 for p in pts]
    [True, True]
    """
    ref = checkpoint_all_peak(graph)
    fingerprint = graph.fingerprint() if store is not None else ""
    points: list[SweepPoint] = []
    opts = options or {}
    for budget in budgets_bytes:
        for method in methods:
            method_options = opts.get(method, {})
            key = None
            if store is not None:
                key = result_key(fingerprint=fingerprint, method=method, options=method_options, budget_bytes=int(budget))
                stored = store.get(key)
                if stored is not None:
                    try:
                        point = dataclasses.replace(SweepPoint.from_json(stored), read_back=True)
                    except ValueError as exc:  # a damaged entry: solved again, and replaced
                        log.warning("results file %s: the entry of %s at %d B is damaged (%s); solving it again",
                                    os.fspath(store.path), method, int(budget), exc)
                    else:
                        points.append(point)
                        if on_point is not None:
                            on_point(point)
                        continue
            point = run_interruptibly(lambda: _solve_point(graph, method, int(budget), ref, method_options))
            if store is not None:
                store.put(key, point.to_json())
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


_running: list[threading.Thread] = []


def solves_running() -> bool:
    """Whether a solve abandoned by Ctrl-C is still running in a worker thread (a process
    that wants to exit at once then ends with ``os._exit``: solver threads in C code cannot be
    stopped from Python)."""
    _running[:] = [t for t in _running if t.is_alive()]
    return bool(_running)


def run_interruptibly(fn: Callable[[], T]) -> T:
    """``fn()`` in a daemon thread while this thread waits in short joins, so that Ctrl-C
    (``KeyboardInterrupt``) is raised here at once even while ``fn`` runs native code (HiGHS
    releases the interpreter lock while it solves). ``fn`` is then abandoned, not stopped.

    >>> run_interruptibly(lambda: 6 * 7)
    42
    """
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=work, name="remat-sweep-solve", daemon=True)
    _running.append(worker)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
    _running.remove(worker)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _solve_point(graph: Graph, method: str, budget: int, ref: int, options: dict[str, object]) -> SweepPoint:
    fraction = budget / ref
    try:
        result = solve(graph, budget, method=method, **options)
    except InfeasibleBudgetError as exc:
        return SweepPoint(method, budget, fraction, None, min_budget_bytes=exc.min_budget_bytes)
    except UnsupportedGraphError as exc:
        log.info("%s skipped on %s: %s", method, graph.name, exc)
        return SweepPoint(method, budget, fraction, None, skipped=str(exc))
    return SweepPoint(method, budget, fraction, result.summary())


def parse_solver_options(text: str | None) -> dict[str, dict[str, object]]:
    """Per-method solver options from JSON text (``{"milp": {"threads": 2}}``); empty if none.

    Raises ``ValueError`` naming the problem and showing the expected form.

    >>> parse_solver_options('{"milp": {"max_nodes": 100}}')
    {'milp': {'max_nodes': 100}}
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--options is not JSON ({exc.msg}); e.g. '{{\"milp\": {{\"threads\": 2}}}}'") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError("--options must map method names to option objects, e.g. '{\"milp\": {\"threads\": 2}}'")
    return value


def save_json(value: object, path: Path) -> None:
    """Write ``value`` as JSON to ``path`` atomically (a reader never sees half a file), so a
    long benchmark can be interrupted at any time and resume from what it wrote."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(value, indent=1, sort_keys=True))


# ---------------------------------------------------------------------------- keyed results
#: Version of what a stored result means; part of every key. Bump it when a result's fields
#: or their meaning change without a new release, so stale results are measured again.
RESULTS_SCHEMA = 1
RESULTS_FORMAT = "remat.results"


def result_key(
    *,
    fingerprint: str,
    method: str,
    options: Mapping[str, object] | None = None,
    code_version: str | None = None,
    schema: int = RESULTS_SCHEMA,
    **fields: object,
) -> dict[str, object]:
    """The identity of one result: what produced it. Two results with equal keys are
    interchangeable; a result whose key differs in anything (the graph's fingerprint, the
    method, an option, remat's version, the schema) is not reused.

    ``fields`` add what else decides the result (``budget_bytes=...``, ``model=...``).
    ``code_version`` defaults to ``remat.__version__``. Values must be JSON scalars, lists or
    dicts (enums become their value, tuples lists, paths strings).

    >>> result_key(fingerprint="ab12", method="milp", options={"time_limit_s": 60}, budget_bytes=1000,
    ...            code_version="0.1.0")
    {'budget_bytes': 1000, 'code_version': '0.1.0', 'fingerprint': 'ab12', 'method': 'milp', 'options': {'time_limit_s': 60}, 'schema': 1}
    """
    return record_key(fingerprint=fingerprint, method=method, options=dict(options or {}), code_version=code_version,
                      schema=schema, **fields)


def record_key(*, code_version: str | None = None, schema: int = RESULTS_SCHEMA, **fields: object) -> dict[str, object]:
    """A result key from any fields that identify what produced a result (for results that are
    not one graph's, e.g. a measured training step: model configuration, variant, budget),
    plus ``code_version`` (default ``remat.__version__``) and ``schema``.

    >>> record_key(model="gpt2-4L", variant="eager", code_version="0.1.0")
    {'code_version': '0.1.0', 'model': 'gpt2-4L', 'schema': 1, 'variant': 'eager'}
    """
    if code_version is None:
        from remat import __version__ as code_version
    key = {**fields, "code_version": code_version, "schema": schema}
    return {name: _plain(value, name) for name, value in sorted(key.items())}


def _plain(value: object, where: str) -> object:
    """``value`` as plain JSON data, or TypeError naming the field that is not."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"result key field {where!r} is {value!r}; keys need finite numbers")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    raise TypeError(
        f"result key field {where!r} is {a_type(value)} ({value!r}), which JSON cannot hold; pass "
        f"a string, number, list or dict that identifies it"
    )


def _canonical(key: Mapping[str, object]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class ResultStore:
    """Keyed, resumable results in one JSON file: each result is stored with the key of what
    produced it (see ``result_key``). ``put`` rewrites the file atomically at once, merged with
    what is on disk, so an interrupted run keeps every result it finished, a rerun skips them,
    and a run that measures only some keys leaves every other stored result untouched (also
    those written meanwhile by another process, and those of other code versions).

    >>> import tempfile
    >>> from remat.builders import chain_graph
    >>> g = chain_graph(8)
    >>> path = Path(tempfile.mkdtemp()) / "results.json"
    >>> store = ResultStore(path)
    >>> key = result_key(fingerprint=g.fingerprint(), method="chen_sqrtn", budget_bytes=2**30)
    >>> key in store
    False
    >>> store.put(key, {"overhead": 1.25})
    >>> ResultStore(path).get(key)                    # a rerun finds it and skips the work
    {'overhead': 1.25}
    >>> len(ResultStore(path).select(method="chen_sqrtn"))
    1

    The file: ``{"format": "remat.results", "meta": {...}, "results": [{"key": {...},
    "result": {...}}, ...]}``, readable without remat.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.meta: dict[str, object] = {}
        self._entries: dict[str, dict[str, object]] = {}
        self._mine: dict[str, dict[str, object]] = {}  # put by this object: they win over the file's
        self._reload()

    def _reload(self) -> None:
        if not self.path.exists() or (self.path.is_file() and self.path.stat().st_size == 0):
            return  # (an empty file, made with touch: no results yet)
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"results file {os.fspath(self.path)!r} is not readable JSON ({exc}); move it away or pass "
                f"another path"
            ) from None
        if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT or not isinstance(data.get("results"), list):
            raise ValueError(
                f"{os.fspath(self.path)!r} is not a remat results file (no format {RESULTS_FORMAT!r} with a "
                f"'results' list); move it away or pass another path"
            )
        meta = data.get("meta")
        self.meta = _merged(meta if isinstance(meta, dict) else {}, self.meta)
        entries = {_canonical(e["key"]): e for e in data["results"] if isinstance(e, dict) and isinstance(e.get("key"), dict)}
        self._entries = {**entries, **self._mine}

    def __contains__(self, key: Mapping[str, object]) -> bool:
        return _canonical(key) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Mapping[str, object]) -> dict[str, object] | None:
        """The result stored under ``key``, or None."""
        entry = self._entries.get(_canonical(key))
        return None if entry is None else entry.get("result")

    def select(self, **fields: object) -> list[tuple[dict[str, object], dict[str, object]]]:
        """``(key, result)`` of every stored result whose key has these field values, in the
        order they were stored."""
        want = {name: _plain(value, name) for name, value in fields.items()}
        return [(e["key"], e.get("result")) for e in self._entries.values()
                if all(e["key"].get(name) == value for name, value in want.items())]

    def put(self, key: Mapping[str, object], result: Mapping[str, object]) -> None:
        """Store ``result`` under ``key`` (replacing one with the same key) and write the file."""
        self._mine[_canonical(key)] = {"key": dict(key), "result": dict(result)}
        self.save()

    def save(self) -> None:
        """Write the file (atomically) with every stored result and ``meta``, merged with what
        another process wrote since it was read (read again and written under a lock on the
        file's folder, so that two processes writing the same file lose nothing: two sweeps
        sharing one file kept 397 of their 400 results, and one of their graphs' records, when
        each read and wrote it unlocked)."""
        with _folder_locked(self.path.parent):
            self._reload()
            self._entries.update(self._mine)
            save_json({"format": RESULTS_FORMAT, "meta": self.meta, "results": list(self._entries.values())},
                      self.path)


def _merged(theirs: dict, mine: dict) -> dict:
    """``mine`` over ``theirs``, one level deep (a record per graph kept from both)."""
    out = dict(theirs)
    for key, value in mine.items():
        out[key] = {**theirs[key], **value} if isinstance(value, dict) and isinstance(theirs.get(key), dict) else value
    return out


@contextlib.contextmanager
def _folder_locked(folder: Path):
    """An exclusive lock on ``folder`` for as long as the block runs (where the system has
    ``flock``; elsewhere, none)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - (not a POSIX system)
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


# ---------------------------------------------------------------------------- benchmark helpers
#: Machine rates of the ESTIMATE cost model, measured once and kept next to a benchmark's
#: results, so that a resumed run (another process) prices every node as the first one did.
ESTIMATE_RATES_FILE = "estimate_rates.json"


def seeded_step(fn: Callable[..., object], model, batch: Sequence[object], seed: int):
    """One training step of a benchmark variant: clear ``model``'s gradients, seed torch's
    random numbers, ``fn(*batch).backward()``; the loss, detached."""
    import torch

    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = fn(*batch)
    loss.backward()
    return loss.detach()


def pin_estimate_rates(folder: Path) -> dict[str, object]:
    """Measure the ESTIMATE cost model's machine rates, or read them from
    ``folder/ESTIMATE_RATES_FILE``, and make this process use them; returns them as a record."""
    from remat.cost import machine_rates

    folder.mkdir(parents=True, exist_ok=True)
    rates = machine_rates("cpu", cache_path=folder / ESTIMATE_RATES_FILE)
    return {"device": rates.device, "matmul_flops_per_us": rates.matmul_flops_per_us,
            "bytes_per_us": rates.bytes_per_us, "op_overhead_us": rates.op_overhead_us}


def trace_on_meta(model: str, batch: int):
    """The traced training step of built-in workload ``model`` at ``batch``, built and traced on
    the meta device (nothing allocated), node costs from ``CostModel.ESTIMATE``."""
    import torch

    from remat.cost import CostModel
    from remat.models import get_workload
    from remat.trace import trace

    with torch.device("meta"):
        w = get_workload(model, batch)
    return trace(w.model, w.batch, w.loss_fn, cost_model=CostModel.ESTIMATE, name=model)


def environment() -> dict[str, object]:
    """What a benchmark record says about the machine and the libraries it ran on."""
    import os
    import platform

    import torch

    env: dict[str, object] = {"torch": torch.__version__, "cpu_count": os.cpu_count(),
                              "machine": platform.platform(), "python": platform.python_version()}
    try:
        from remat.solvers.milp_backends import quiet_highs

        h = quiet_highs()
        env["highspy"] = f"{h.versionMajor()}.{h.versionMinor()}.{h.versionPatch()}"
    except Exception:  # noqa: BLE001 - the version is a courtesy
        pass
    env["python_loop_ms"] = python_loop_ms()
    return env


def python_loop_ms() -> float:
    """The median time of a fixed pure-Python loop (dicts, sorting, arithmetic: the kind of work
    the planner does between solver calls), in milliseconds: a machine's speed, so that wall
    times of runs on different machines can be compared (a run with twice the time here found
    less in the same time limit)."""
    import statistics
    import time

    def loop() -> int:
        table: dict[int, int] = {}
        for i in range(200_000):
            table[i % 1009] = table.get(i % 1009, 0) + i * 3 % 7
        return sum(sorted(table.values(), reverse=True)[:10])

    times = []
    for _ in range(5):
        start = time.perf_counter()
        loop()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 1)
