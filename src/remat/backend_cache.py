"""The backend's plan cache: solved plans by graph fingerprint, budget, method and options.

A record is JSON data (no pickle): the plan's compute order (values are freed at their last
use, so the order is the whole plan) and what the solve reported. Records live in this
process's memory and, when a directory is given, in ``<directory>/<key>.json``, so neither a
recompile nor a restart solves the same graph again. A record that does not replay on the
graph it is looked up for (a corrupt or foreign file) is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from remat.graph import Graph
from remat.schedule import Plan, plan_from_order
from remat.simulate import simulate

log = logging.getLogger("remat.backend")

CACHE_FORMAT = "remat.backend_plan"
CACHE_VERSION = 1

_MEMORY: dict[str, dict] = {}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/remat/plans`` (``~/.cache/remat/plans`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "remat" / "plans"


def cache_key(fingerprint: str, budget_bytes: int, method: str, options: dict[str, object]) -> str:
    """The key of one planning problem (the graph's structure, not its profiled costs)."""
    payload = [CACHE_VERSION, fingerprint, int(budget_bytes), method, sorted((k, repr(v)) for k, v in options.items())]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


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
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable cached plan %s: %s", path, exc)
        return None
    if not isinstance(record, dict) or record.get("format") != CACHE_FORMAT or record.get("version") != CACHE_VERSION:
        log.warning("ignoring %s: not a version-%d remat backend plan", path, CACHE_VERSION)
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
        tmp = directory / f"{key}.json.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f, separators=(",", ":"))
        os.replace(tmp, directory / f"{key}.json")
    except OSError as exc:
        log.warning("could not write the plan cache under %s: %s", directory, exc)


def clear_memory() -> None:
    """Forget the plans cached in this process (files stay)."""
    _MEMORY.clear()


def replay(graph: Graph, record: dict, budget_bytes: int) -> Plan | None:
    """The plan of ``record`` if it is valid on ``graph`` and fits ``budget_bytes``, else None."""
    order = record.get("compute_order")
    n = graph.n
    if record.get("n_nodes") != n or not isinstance(order, list) or not order:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in order):
        return None
    plan = plan_from_order(graph, order)
    sim = simulate(graph, plan)
    if not sim.ok or sim.peak_bytes > budget_bytes:
        return None
    return plan
