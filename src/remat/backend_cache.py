"""The backend's plan cache: solved plans by graph fingerprint, budget, method and options.

A record is JSON data (no pickle): the plan's compute order (values are freed at their last
use, so the order is the whole plan) and what the solve reported. Records live in this
process's memory and, when a directory is given, in ``<directory>/<key>.json``, so neither a
recompile nor a restart solves the same graph again. A file whose record is not one (not
JSON, a field missing or of the wrong type, an unknown status) is discarded with a warning
naming it, and so is a record that does not replay on the graph it is looked up for; the
graph is then planned again and the file rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

from remat.files import write_atomically
from remat.graph import Graph
from remat.schedule import Plan, plan_from_order
from remat.simulate import simulate

log = logging.getLogger("remat.backend")

CACHE_FORMAT = "remat.backend_plan"
CACHE_VERSION = 1

_MEMORY: dict[str, dict] = {}

#: Every field of a record and the JSON types it may have (None only where listed).
FIELDS: dict[str, tuple[type, ...]] = {
    "fingerprint": (str,),
    "budget_bytes": (int,),
    "method": (str,),
    "note": (str, type(None)),
    "n_nodes": (int,),
    "solved_nodes": (int,),
    "compute_order": (list,),
    "predicted_peak_bytes": (int,),
    "overhead": (float, int),
    "status": (str,),
    "solve_s": (float, int),
}
#: Fields a record may lack (those stored before they existed), with their JSON types.
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {
    "lower_bound": (float, int, type(None)),  # as a multiple of computing every node once
}


def record_problem(record: object) -> str | None:
    """What makes ``record`` unusable as a plan record, or None if it is one."""
    from remat.solvers import SolveStatus, methods

    if not isinstance(record, dict) or record.get("format") != CACHE_FORMAT or record.get("version") != CACHE_VERSION:
        return f"not a version-{CACHE_VERSION} remat backend plan"
    for key, kinds in [*FIELDS.items(), *OPTIONAL_FIELDS.items()]:
        if key not in record:
            if key in OPTIONAL_FIELDS:
                continue
            return f"field {key!r} is missing"
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            return f"field {key!r} is {value!r}, not a {names}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"field {key!r} is {value!r}, not a finite number"
    if record["status"] not in {s.value for s in SolveStatus}:
        return f"field 'status' is {record['status']!r}, not one of {', '.join(s.value for s in SolveStatus)}"
    if record["method"] not in methods():
        return f"field 'method' is {record['method']!r}, not a remat method"
    if record["overhead"] < 1 - 1e-9 or record["solve_s"] < 0:
        return f"field 'overhead' ({record['overhead']!r}) or 'solve_s' ({record['solve_s']!r}) is out of range"
    bound = record.get("lower_bound")
    if bound is not None and not 1 - 1e-9 <= bound <= record["overhead"] * (1 + 1e-9):
        return f"field 'lower_bound' ({bound!r}) is out of range: below 1 or above the plan's overhead"
    return None


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/remat/plans`` (``~/.cache/remat/plans`` by default, and where
    ``XDG_CACHE_HOME`` is not an absolute path, which the XDG specification says to ignore: a
    relative one put the cache under whatever directory the process ran in)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "remat" / "plans"


def cache_key(fingerprint: str, budget_bytes: int, method: str, options: dict[str, object]) -> str:
    """The key of one planning problem (the graph's structure, not its profiled costs)."""
    payload = [CACHE_VERSION, fingerprint, int(budget_bytes), method, sorted((k, repr(v)) for k, v in options.items())]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def where(key: str, directory: Path | None) -> str:
    """The file of ``key`` under ``directory`` (or where an in-memory record lives)."""
    return str(directory / f"{key}.json") if directory is not None else f"in-memory plan {key[:12]}"


def load(key: str, directory: Path | None) -> dict | None:
    """The record under ``key`` (memory first, then disk), or None."""
    if key in _MEMORY:
        return _MEMORY[key]
    if directory is None:
        return None
    path = directory / f"{key}.json"
    try:
        with open(path) as f:
            record = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # (none cached; a folder that cannot be one: store says so)
        return None
    except (OSError, ValueError) as exc:
        log.warning("discarding the cached plan %s: unreadable (%s); planning the graph again", path, exc)
        return None
    problem = record_problem(record)
    if problem is not None:
        log.warning("discarding the cached plan %s: %s; planning the graph again", path, problem)
        return None
    _MEMORY[key] = record
    return record


def store(key: str, record: dict, directory: Path | None) -> None:
    """Keep ``record`` in memory and, atomically, on disk (a failed write only warns)."""
    record = {"format": CACHE_FORMAT, "version": CACHE_VERSION, **record}
    _MEMORY[key] = record
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(directory / f"{key}.json", json.dumps(record, separators=(",", ":")))
    except OSError as exc:
        log.warning("could not write the plan cache under %s: %s", directory, exc)


def clear_memory() -> None:
    """Forget the plans cached in this process (files stay)."""
    _MEMORY.clear()


def replay(graph: Graph, record: dict, budget_bytes: int) -> Plan | None:
    """The plan of ``record`` if it is valid on ``graph`` and fits ``budget_bytes``, else None."""
    return replayed(graph, record, budget_bytes)[0]


def replayed(graph: Graph, record: dict, budget_bytes: int) -> tuple[Plan | None, str]:
    """``replay``'s plan, and where there is none, why (for the warning that discards it)."""
    order = record.get("compute_order")
    n = graph.n
    if record.get("n_nodes") != n:
        return None, f"it was made for a graph of {record.get('n_nodes')!r} nodes, not {n}"
    if not isinstance(order, list) or not order:
        return None, "its compute_order is not a list of nodes"
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in order):
        return None, f"its compute_order names nodes that are not among the graph's {n}"
    plan = plan_from_order(graph, order)
    sim = simulate(graph, plan)
    if not sim.ok:
        return None, "its compute order is not a plan of this graph (a value is read before it is computed)"
    if sim.peak_bytes > budget_bytes:
        return None, f"its plan peaks at {sim.peak_bytes} B here, over the budget of {budget_bytes} B"
    return plan, ""


# ---------------------------------------------------------------------------- least-peak plans
#: How many graph structures' least-peak plans the command line keeps on disk (the most recent).
LEAST_PEAK_FILES = 16
LEAST_PEAK_FORMAT = "remat.least_peak_plan"


def least_peak_dir() -> Path:
    """``$XDG_CACHE_HOME/remat/least-peak``, beside the backend's plans (``default_cache_dir``)."""
    return default_cache_dir().parent / "least-peak"


def estimate_rates_file() -> Path:
    """``$XDG_CACHE_HOME/remat/rates/cpu-<threads>threads-torch<version>.json``: where the
    command line keeps the machine rates of estimated costs (``cost.machine_rates``), so that
    every run on this machine prices a graph alike (measured per process, the rates moved by
    a few percent from run to run, and with them every absolute cost)."""
    import torch

    name = f"cpu-{torch.get_num_threads()}threads-torch{torch.__version__}.json"
    return default_cache_dir().parent / "rates" / name.replace("+", "_")


def load_least_peak(directory: Path) -> int:
    """Hand the least-peak plans kept under ``directory`` to the planner (the most recent
    ``LEAST_PEAK_FILES``), so that the smallest budget an earlier process stated for a graph
    plans in this one: that budget comes from time-limited searches, which a later call with
    the same time limit may not repeat (a 30-node graph's stated 61 MiB was refused at the next
    call, which found 63 MiB). A plan is measured and simulated on the graph before it is used
    (``milp._replays``); an unreadable file is skipped. Returns how many were read."""
    from remat.solvers.prepared import add_least_peak_record

    try:
        files = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime)[-LEAST_PEAK_FILES:]
    except OSError:
        return 0
    read = 0
    for path in files:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("format") == LEAST_PEAK_FORMAT \
                and add_least_peak_record(path.stem, record):
            read += 1
    return read


def store_least_peak(directory: Path, known: dict[str, dict] | None = None) -> None:
    """Write the planner's least-peak plans that are new or lower than ``known`` (what
    ``least_peak_records`` gave before) under ``directory``, atomically (a failed write only
    warns), and drop the oldest files beyond ``LEAST_PEAK_FILES``."""
    from remat.solvers.prepared import least_peak_records

    known = known or {}
    try:
        for key, record in least_peak_records().items():
            if key in known and known[key]["peak_bytes"] <= record["peak_bytes"]:
                continue
            directory.mkdir(parents=True, exist_ok=True)
            write_atomically(directory / f"{key}.json",
                             json.dumps({"format": LEAST_PEAK_FORMAT, **record}, separators=(",", ":")))
        files = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in files[:-LEAST_PEAK_FILES]:
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not keep the least-peak plans under %s: %s", directory, exc)
