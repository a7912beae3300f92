"""remat under ``torch.distributed``: ranks agree on every plan, and ``optimize`` knows what it
cannot wrap.

With DistributedDataParallel or FSDP2 (``fully_shard``) every rank compiles the same graphs in
the same order, and ``remat.backend`` plans each one on each rank. The plans must agree: the
same memory on every device, and, for graphs that hold collectives, the same program on every
rank. Profiled costs differ from rank to rank and a solver's time limit is not deterministic,
so agreement is not left to chance. For every graph, through the group's key-value store:

1. each rank publishes the graph's structural fingerprint and its budget in bytes (or the
   reason it cannot plan);
2. the group's first rank reads them all and publishes the decision: if every rank has the
   same graph, the plan it loaded from its cache or solved under the smallest budget of the
   group (the others check it on their own graph and keep it in their own cache); if the
   graphs differ (uneven inputs), that each rank plans alone; if a rank cannot plan, or the
   solve fails, the reason, and every rank leaves the graph to PyTorch's partitioner.

No collective runs at compile time (nothing to interleave with the engine's own, no device
needed), and a rank that fails still publishes, so no rank waits for one that gave up.

>>> planning_group(None) is None    # None: plan alone, never talk to other ranks
True
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from remat.errors import RematError

log = logging.getLogger("remat.backend")

#: ``process_group`` value: torch.distributed's default group when it is initialized with more
#: than one rank at compile time.
DEFAULT_GROUP = "default"


class RankDisagreement(RematError):
    """Another rank of the planning group could not plan a graph (the message names the rank and
    its reason); every rank then leaves that graph to PyTorch's partitioner."""


class WrappedModelError(RematError, TypeError):
    """``optimize`` got a model wrapped by a distributed engine it cannot run under."""


# ---------------------------------------------------------------------------- groups
def check_group(process_group: object) -> None:
    """Reject a ``process_group`` argument that can never work (raises ``ValueError``)."""
    if process_group is None or process_group == DEFAULT_GROUP:
        return
    import torch.distributed as dist

    # new_group() hands the ranks outside the group this marker instead of a group
    outside = dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER
    if not outside and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise ValueError(
            f"process_group={process_group!r} is not a torch.distributed ProcessGroup; give a group, "
            f"{DEFAULT_GROUP!r} (the default group) or None (every rank plans alone)"
        )
    if outside or dist.get_rank(process_group) < 0:
        raise ValueError(
            f"process_group: rank {dist.get_rank()} is not a member of the group it was given, so it "
            f"cannot agree on plans with it; pass the group this rank belongs to (e.g. its data-parallel group)"
        )


def planning_group(process_group: object) -> object | None:
    """The group whose ranks must agree on plans, or None when this rank plans alone (no
    torch.distributed, a group of one, or ``process_group=None``)."""
    if process_group is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if process_group == DEFAULT_GROUP else process_group
    return group if dist.get_world_size(group) > 1 else None


# ---------------------------------------------------------------------------- agreement
@dataclass(frozen=True)
class Decision:
    """What the ranks of a group decided for one graph. ``same_graph``: every rank traced the
    same graph; then ``record`` is the plan record that rank ``source_rank`` (global) loaded or
    solved under ``budget_bytes``, the smallest budget of the group, for every rank. Otherwise
    each rank plans its own graph under its own budget. ``ranks``: the group's size; ``rank``:
    this rank (global)."""

    same_graph: bool
    budget_bytes: int
    source_rank: int
    ranks: int
    rank: int
    record: dict | None = None

    @property
    def is_source(self) -> bool:
        return self.rank == self.source_rank


#: Graphs agreed on so far, per group: the sequence number in the keys of the next one. Every
#: rank partitions the same graphs in the same order, so the numbers match across ranks.
_SEQUENCE: dict[object, int] = {}
KEY_PREFIX = "remat/plan"


def plan_together(group: object, fingerprint: str | None, budget_bytes: int | None, error: BaseException | None,
                  plan: Callable[[int], dict] | None) -> Decision:
    """Agree with the other ranks of ``group`` on one graph's budget and plan.

    Every rank of ``group`` must call this once per graph, failed or not (``error``: why this
    rank cannot plan; it is re-raised here after the others are told). The exchange goes through
    the group's key-value store, not through collectives: it needs no device, and it cannot
    interleave with the collectives the engine has in flight. Each rank publishes its
    fingerprint and budget; the group's first rank reads them all, and publishes the decision:
    an error (some rank cannot plan: every rank raises ``RankDisagreement``), different graphs
    (each rank plans alone), or ``plan(smallest budget)``, the plan record it loaded or solved.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(group)
    seq = _SEQUENCE[group] = _SEQUENCE.get(group, -1) + 1
    ranks = dist.get_process_group_ranks(group)
    me, source = dist.get_rank(), ranks[0]
    key = f"{KEY_PREFIX}/{seq}"
    mine = {"rank": me, "fingerprint": fingerprint, "budget_bytes": budget_bytes,
            "error": None if error is None else _text(error)}
    store.set(f"{key}/rank{me}", json.dumps(mine))
    if me == source:
        proposals = [json.loads(store.get(f"{key}/rank{r}")) for r in ranks]
        decision, failure = _decide(proposals, plan if error is None else None)
        store.set(f"{key}/decision", json.dumps(decision))
        if failure is not None:  # the source's own failure, as it was raised
            raise failure
    else:
        decision = json.loads(store.get(f"{key}/decision"))
    if error is not None:
        raise error
    if decision["error"] is not None:
        raise RankDisagreement(decision["error"])
    same = decision["same_graph"]
    if not same:
        log.info("remat.backend: the ranks traced different graphs; each rank plans its own")
    return Decision(same_graph=same, budget_bytes=decision["budget_bytes"] if same else int(budget_bytes),
                    source_rank=source, ranks=len(ranks), rank=me, record=decision["record"])


_SCRATCH_SEQUENCE: dict[object, int] = {}
SCRATCH_KEY_PREFIX = "remat/scratch"


def agree_on_scratch(group: object, scratch: dict[str, int]) -> dict[str, int]:
    """Each node's kernel scratch at its largest over the ranks of ``group``: measured scratch
    differs by a few KiB from rank to rank, and ranks agree on a plan only for the same graph,
    so every rank plans with the same, measured, scratch (never below its own). Every rank of
    ``group`` calls this once per graph, in the same order, before ``plan_together`` (a rank
    that failed before measuring passes ``{}``). Through the group's store, as ``plan_together``."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_process_group_store(group)
    seq = _SCRATCH_SEQUENCE[group] = _SCRATCH_SEQUENCE.get(group, -1) + 1
    me = dist.get_rank()
    key = f"{SCRATCH_KEY_PREFIX}/{seq}"
    store.set(f"{key}/rank{me}", json.dumps(scratch))
    agreed = dict(scratch)
    for rank in dist.get_process_group_ranks(group):
        if rank != me:
            for name, value in json.loads(store.get(f"{key}/rank{rank}")).items():
                if name in agreed:  # (other names: another graph, which plan_together tells apart)
                    agreed[name] = max(agreed[name], int(value))
    return agreed


def _decide(proposals: list[dict], plan: Callable[[int], dict] | None) -> tuple[dict, Exception | None]:
    """The source rank's decision (JSON data) from every rank's proposal, and the exception its
    own solve raised, if any."""
    failed = [p for p in proposals if p["error"] is not None]
    if failed:
        return {"error": f"rank {failed[0]['rank']} cannot plan this graph ({failed[0]['error']}), so no rank "
                         f"plans it"}, None
    if len({p["fingerprint"] for p in proposals}) > 1:
        return {"error": None, "same_graph": False, "budget_bytes": None, "record": None}, None
    budget = min(p["budget_bytes"] for p in proposals)
    try:
        record = plan(budget)
    except Exception as exc:  # every rank hears why, then falls back with the same reason
        return {"error": f"rank {proposals[0]['rank']} could not plan this graph ({_text(exc)})"}, exc
    return {"error": None, "same_graph": True, "budget_bytes": budget, "record": record}, None


def _text(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------- optimize()
def refuse_wrapped(model: torch.nn.Module, caller: str = "optimize()") -> None:
    """Raise ``WrappedModelError`` if ``model`` runs under DDP, FSDP or DTensor parameters.

    ``optimize`` traces one functional step and fills ``.grad`` itself: DDP's gradient
    all-reduce hooks would never fire (each rank would train on its own gradients, silently),
    and FSDP's all-gathers and reduce-scatters run in module hooks that a traced functional
    step bypasses. ``torch.compile`` with ``remat.backend`` keeps those engines' hooks.
    """
    remedy = (
        f"compile the wrapped model instead: torch.compile(model, backend=remat.backend(budget)) plans "
        f"every graph it captures and leaves the engine's communication to the engine; or call {caller} "
        f"on the unwrapped module in a single process"
    )
    engine = _engine_of(model)
    if engine is not None:
        where, what = engine
        raise WrappedModelError(
            f"{caller} got a model {what}{where}: {caller} traces one functional training step and writes "
            f".grad itself, so the engine's gradient communication would not run; {remedy}"
        )


def _engine_of(model: torch.nn.Module) -> tuple[str, str] | None:
    """(where, what) of the first distributed wrapper in ``model``, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    fsdp_classes: tuple[type, ...] = ()
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        fsdp_classes = (FSDPModule, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - builds without FSDP
        pass
    for name, module in model.named_modules():
        where = f" (module {name!r})" if name else ""
        if isinstance(module, DistributedDataParallel):
            return where, "wrapped in DistributedDataParallel"
        if fsdp_classes and isinstance(module, fsdp_classes):
            return where, "sharded with FSDP (fully_shard)"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f" (parameter {name!r})", "with DTensor parameters (sharded by FSDP2 or tensor parallelism)"
    return None
