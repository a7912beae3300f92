"""Measure the real peak memory of a function call, comparable to the simulator's peak.

On CPU the default is exact and repeatable: a ``TorchDispatchMode`` sees every aten op the
call runs, records each new storage an op returns (outputs sharing a storage with an input
are views and are skipped) and subtracts it when a weak reference on the storage says it was
freed. It counts what the simulator counts (op outputs) and nothing else: not kernel scratch
space, not allocator rounding. ``torch.profiler``'s memory events see every allocation,
scratch included; ``cross_check`` runs both so the two can be compared. On CUDA the caching
allocator's own counters are used.

Every report includes the bytes resident before the call (the storages of the arguments:
parameters, buffers, batch), the same quantity a traced ``Graph`` calls ``fixed_bytes``, so
``report.peak_bytes`` compares directly with ``simulate(...).peak_bytes``.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class MemoryMethod(enum.Enum):
    DISPATCH = "dispatch"  # storages returned by aten ops (CPU default; exact)
    PROFILER = "profiler"  # torch.profiler allocation events (includes scratch memory)
    CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated


@dataclass(frozen=True)
class MemoryReport:
    """``peak_bytes = resident_bytes + dynamic_peak_bytes``. ``end_bytes``: what the call
    allocated and still holds when it returns (its outputs)."""

    peak_bytes: int
    resident_bytes: int
    dynamic_peak_bytes: int
    end_bytes: int
    method: MemoryMethod
    device: str


def resident_bytes_of(*values: object) -> int:
    """Bytes of the distinct storages of every tensor in ``values`` (nested containers too)."""
    seen: dict[int, int] = {}
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class _StorageTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.tracked: dict[int, int] = {}

    def _free(self, key: int, nbytes: int) -> None:
        if self.tracked.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.tracked:
                continue
            nbytes = storage.nbytes()
            self.tracked[key] = nbytes
            self.live_bytes += nbytes
            weakref.finalize(storage, self._free, key, nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def _device_of(args: tuple) -> torch.device:
    for t in tree_leaves(args):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def measure_peak(
    fn: Callable[..., object],
    *args: object,
    method: MemoryMethod | None = None,
    resident_bytes: int | None = None,
) -> MemoryReport:
    """Call ``fn(*args)`` once and report its peak memory.

    ``method`` defaults to ``DISPATCH`` on CPU and ``CUDA_ALLOCATOR`` on CUDA (picked from the
    first tensor argument). ``resident_bytes`` defaults to the argument storages' bytes.

    >>> import torch
    >>> x = torch.zeros(1000)
    >>> r = measure_peak(lambda x: (x + 1) * 2, x)
    >>> r.resident_bytes, r.dynamic_peak_bytes, r.end_bytes
    (4000, 8000, 4000)
    """
    device = _device_of(args)
    if method is None:
        method = MemoryMethod.CUDA_ALLOCATOR if device.type == "cuda" else MemoryMethod.DISPATCH
    resident = resident_bytes_of(args) if resident_bytes is None else int(resident_bytes)
    if method is MemoryMethod.DISPATCH:
        dynamic, end = _dispatch_peak(fn, args)
    elif method is MemoryMethod.PROFILER:
        dynamic, end = _profiler_peak(fn, args)
    elif method is MemoryMethod.CUDA_ALLOCATOR:
        dynamic, end = _cuda_peak(fn, args, device)
    else:
        raise ValueError(f"method {method!r} is not a MemoryMethod")
    return MemoryReport(resident + dynamic, resident, dynamic, end, method, str(device))


def cross_check(fn: Callable[..., object], *args: object) -> tuple[MemoryReport, MemoryReport]:
    """Run ``fn(*args)`` twice on CPU, measured by the dispatch tracker and by the profiler.
    Make the two runs comparable (reset random state, buffers) inside ``fn`` if it matters."""
    return measure_peak(fn, *args, method=MemoryMethod.DISPATCH), measure_peak(fn, *args, method=MemoryMethod.PROFILER)


def _dispatch_peak(fn: Callable[..., object], args: tuple) -> tuple[int, int]:
    tracker = _StorageTracker()
    with tracker:
        result = fn(*args)
    end = tracker.live_bytes
    del result
    return tracker.peak_bytes, end


def _profiler_peak(fn: Callable[..., object], args: tuple) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    del result
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    # The profiler stops before ``result`` is dropped, so ``live`` is what the call left.
    return peak, live


def _cuda_peak(fn: Callable[..., object], args: tuple, device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn(*args)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    end = torch.cuda.memory_allocated(device) - base
    del result
    return peak, end
