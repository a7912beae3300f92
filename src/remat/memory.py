"""Measure the real peak memory of a function call, comparable to the simulator's peak.

On CPU the default is ``torch.profiler``'s allocation events, replayed in order: they see
every allocation, kernel scratch space included, which is what the simulator models with
each node's ``temp_bytes``. ``MemoryMethod.DISPATCH`` is a ``TorchDispatchMode`` that records
each new storage an op returns (outputs sharing a storage with an input are views and are
skipped) and subtracts it when a weak reference on the storage says it was freed: exact and
repeatable for op outputs, blind to scratch space. ``cross_check`` runs both. On CUDA the
caching allocator's own counters are used.

Every report includes the bytes resident before the call (the storages of the arguments:
parameters, buffers, batch), the same quantity a traced ``Graph`` calls ``fixed_bytes``, so
``report.peak_bytes`` compares directly with ``simulate(...).peak_bytes``.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Kineto's log level that silences its USDT lines (above its highest level).
KINETO_QUIET_LEVEL = "6"


class MemoryMethod(enum.Enum):
    DISPATCH = "dispatch"  # storages returned by aten ops (exact for outputs; no scratch)
    PROFILER = "profiler"  # torch.profiler allocation events, scratch included (CPU default)
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

    ``method`` defaults to ``PROFILER`` on CPU and ``CUDA_ALLOCATOR`` on CUDA (picked from the
    first tensor argument). ``resident_bytes`` defaults to the argument storages' bytes.

    >>> import torch
    >>> x = torch.zeros(1000)
    >>> r = measure_peak(lambda x: (x + 1) * 2, x, method=MemoryMethod.DISPATCH)
    >>> r.resident_bytes, r.dynamic_peak_bytes, r.end_bytes
    (4000, 8000, 4000)
    """
    device = _device_of(args)
    if method is None:
        method = MemoryMethod.CUDA_ALLOCATOR if device.type == "cuda" else MemoryMethod.PROFILER
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


def profiled_events(fn: Callable[[], object], mark: str | None = None
                    ) -> tuple[list[tuple[int, int]], dict[str, tuple[int, int]]]:
    """Call ``fn()`` under ``torch.profiler`` and return its CPU allocation events as
    ``(time_ns, bytes)`` in time order (frees are negative) and, when ``mark`` is given, the
    ``(start_ns, end_ns)`` of every ``record_function`` range whose name starts with it, by the
    rest of its name."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints "USDT: ... profiler_start/stop" lines at its default log level; a level
    # above its highest prints nothing. Read when the profiler starts; a level the user set wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    cpu = torch.autograd.DeviceType.CPU
    memory, ranges = [], {}
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name == "[memory]":
            if e.device_type() == cpu:
                memory.append((e.start_ns(), e.nbytes()))
        elif mark is not None and name.startswith(mark):
            ranges[name[len(mark):]] = (e.start_ns(), e.start_ns() + e.duration_ns())
    memory.sort(key=lambda event: event[0])
    return memory, ranges


def _profiler_peak(fn: Callable[..., object], args: tuple) -> tuple[int, int]:
    memory, _ = profiled_events(lambda: fn(*args))
    live = peak = 0
    for _, nbytes in memory:
        live += nbytes
        peak = max(peak, live)
    # The profiler stops before the call's result is dropped, so ``live`` is what it left.
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


def region_eager_peak(fn: Callable[..., object], inputs: list) -> MemoryReport:
    """Peak memory of one eager training step of the compiled region ``fn`` (a graph that
    ``torch.compile`` captured) on ``inputs``: its forward, then autograd's backward. A region
    that computes a loss (a scalar output that requires grad) is a training step by itself:
    the backward starts from its scalar outputs, and the outputs they were computed from are
    dropped after the forward, as a training loop drops the logits it does not use. The loss
    of every other output is computed outside (all of them where none is a scalar, and logits
    returned beside a scalar they do not feed, such as a mixture of experts' auxiliary loss):
    the backward starts from them too, with a gradient of ones, the outputs held until it ends.

    Parameters take part through detached aliases (their ``.grad`` is untouched), except those
    the region modifies in place (an embedding's ``max_norm`` renormalizes its weight), which
    are cloned, as is every other tensor, so parameters and buffers the region updates stay as
    they were (found by running the region's forward on fake copies, ``_mutated_inputs``; a
    region that cannot run so has every input cloned); the random generators are restored. The
    resident bytes are those of the region's inputs."""
    try:
        mutated = _mutated_inputs(fn, inputs)
    except Exception:  # (a value read in Python, a value-sized op: no fake run) every tensor may be
        mutated = set(range(len(inputs)))  # modified: all are cloned, which the peak does not count
    args = []
    for k, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            args.append(t)
        elif (isinstance(t, torch.nn.Parameter) or t.requires_grad) and k not in mutated:
            args.append(t.detach().requires_grad_(t.requires_grad))
        elif t.requires_grad:
            args.append(t.detach().clone().requires_grad_(True))
        else:
            args.append(t.clone())

    def step() -> None:
        with torch.enable_grad():
            outputs = _backward_roots([o for o in tree_leaves(fn(*args)) if isinstance(o, torch.Tensor)
                                       and o.requires_grad])
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    anchor = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), torch.empty(0))
    with torch.random.fork_rng(devices=_cuda_devices(args)):
        # the anchor tensor only tells measure_peak the device
        return measure_peak(lambda _: step(), anchor, resident_bytes=resident_bytes_of(inputs))


def _backward_roots(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where an eager step's backward starts among a region's ``outputs`` that require grad (see
    ``region_eager_peak``): its scalars, and every other output no scalar was computed from. A
    scalar beside the logits is not always their loss: the backward from an auxiliary loss
    alone left out the logits' and understated the peak (a "100%" budget came out 17% under
    the eager peak and was infeasible)."""
    losses = [o for o in outputs if o.numel() == 1]
    if not losses:
        return outputs
    seen, todo = set(), [o.grad_fn for o in losses if o.grad_fn is not None]
    while todo:  # the autograd nodes the scalars were computed through
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return losses + [o for o in outputs if o.numel() != 1 and (o.grad_fn is None or o.grad_fn not in seen)]


def _mutated_inputs(fn: Callable[..., object], inputs: list) -> set[int]:
    """The positions of the tensors among ``inputs`` that ``fn``'s forward modifies in place:
    ``fn`` runs on fake copies of them (no data, no kernels), and an in-place op bumps a copy's
    version counter as it would the tensor's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    before = [f._version if isinstance(f, torch.Tensor) else None for f in fakes]
    # (fx prints the generated code's traceback before raising: the caller handles the failure)
    with torch.random.fork_rng(devices=_cuda_devices(inputs)), torch.enable_grad(), mode, \
            contextlib.redirect_stderr(io.StringIO()):
        fn(*fakes)
    return {k for k, (f, v) in enumerate(zip(fakes, before)) if isinstance(f, torch.Tensor) and f._version != v}


def _cuda_devices(values: list) -> list[int]:
    return sorted({t.device.index or 0 for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.is_cuda})
