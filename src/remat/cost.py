"""Cost models: how long each node of a traced step takes, in microseconds.

``CostModel.PROFILE`` (the default) times every node on the device it runs on, with real
inputs: one warm-up call then the median of ``PROFILE_REPEATS`` calls at a fixed thread count.
Timings are cached by (op, argument shapes/strides/dtypes and constants, device, threads) in
the process and, when given a ``cache_path``, in a JSON file.

On a CPU with more threads than it can run at once (other processes busy on its cores), a
multi-threaded op waits at every parallel region for a thread that is not running: a matmul
of 15 us took 16 ms, and a whole step's timings summed to tens or hundreds of times their quiet
value, with the cheap serial ops untouched, so the plan weighed recomputations by noise.
``Contention`` checks for this while profiling (a parallel reference op on the profile's
threads against one thread, at the first op, every ``CONTENTION_CHECK_S`` and after an op long
enough to have stalled); once it is found, every op after is also timed on one thread and the
faster median is kept (on a quiet machine the op's own threads are the faster), and a warning
says so once per profile. ``bench/busy_cpu.py`` measures it.

``CostModel.ESTIMATE`` needs no real run: a roofline over the FLOPs torch's flop counter
assigns to the op and the bytes it reads and writes, against machine rates measured once per
device (``machine_rates``), plus a fixed per-op dispatch overhead. It ranks ops well enough to
plan with and is deterministic once the rates are known.

Views and other nodes that only alias existing storage cost 0: they move no data.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

log = logging.getLogger("remat.cost")

#: Timed calls per node after one warm-up call; the median is kept (per-node coefficient of
#: variation was about 0.09 on CPU, so five calls settle the median well enough).
PROFILE_REPEATS = 5
#: Matrix side used to measure the matmul rate: large enough to reach the kernel's steady
#: rate, small enough to measure in milliseconds on two cores.
RATE_MATMUL_SIDE = 512
#: Bytes copied to measure memory bandwidth: well beyond the last-level cache.
RATE_COPY_BYTES = 32 * 2**20
#: Timed calls per machine-rate measurement (median kept).
RATE_REPEATS = 7
#: The CPU is taken as oversubscribed when the slowest of ``CONTENTION_CALLS`` calls of the
#: reference op on the profile's threads is this many times slower than its median on one
#: thread (on a quiet machine about 0.5-1x on two threads; a stall, 10-100x). The slowest, not
#: the median: stalls come and go between calls, and a check whose median missed them was
#: followed by ops that had stalled.
CONTENTION_RATIO = 3.0
CONTENTION_CALLS = 5
#: Seconds of profiling between two checks for oversubscription.
CONTENTION_CHECK_S = 0.5
#: An op whose median on the profile's threads is at least this long (a wait for a thread
#: that is not running lasts about a scheduler time slice, milliseconds) has the check run
#: at once, at most every ``CONTENTION_SUSPECT_GAP_S`` seconds; so stalls are found where
#: they start, not up to ``CONTENTION_CHECK_S`` later.
CONTENTION_SUSPECT_US = 1000.0
CONTENTION_SUSPECT_GAP_S = 0.05
#: Side of the check's reference matmul at two threads (about 1 ms on one thread); it grows
#: with the cube root of the thread count, so that each thread keeps as much work.
CONTENTION_SIDE = 192


class CostModel(enum.Enum):
    PROFILE = "profile"  # time every node on the device
    ESTIMATE = "estimate"  # roofline over FLOPs and bytes moved


@dataclass(frozen=True)
class MachineRates:
    """What ``ESTIMATE`` divides by: measured, not assumed."""

    device: str
    matmul_flops_per_us: float
    bytes_per_us: float
    op_overhead_us: float


def node_costs(
    gm: fx.GraphModule,
    flat_inputs: Sequence[torch.Tensor],
    model: CostModel,
    *,
    zero_cost: Iterable[str] = (),
    cache_path: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Cost in microseconds of every ``call_function`` node of ``gm``, by node name."""
    if model is CostModel.PROFILE:
        return profile(gm, flat_inputs, zero_cost=zero_cost, cache_path=cache_path)
    if model is CostModel.ESTIMATE:
        return estimate(gm, zero_cost=zero_cost, cache_path=cache_path)
    raise ValueError(f"cost model {model!r} is not a CostModel; use CostModel.PROFILE or CostModel.ESTIMATE")


# ---------------------------------------------------------------------------- profiling
_PROFILE_CACHE: dict[str, float] = {}
_LOADED_FILES: set[str] = set()


def _describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}"
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return repr(value)


def _op_key(n: fx.Node, args: tuple, kwargs: dict, device: str, threads: int) -> str:
    payload = [str(n.target), _describe(list(args)), _describe(sorted(kwargs.items())), device, threads]
    return json.dumps(payload, separators=(",", ":"))


def _device_of(values: Iterable[object]) -> torch.device:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_cache(path: str | os.PathLike | None, store: dict) -> None:
    if path is None or str(path) in _LOADED_FILES or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            store.update({k: float(v) for k, v in json.load(f).items()})
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring unreadable cost cache %s: %s", path, exc)
    _LOADED_FILES.add(str(path))


def _save_cache(path: str | os.PathLike | None, store: dict) -> None:
    if path is None:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(store, f)
    os.replace(tmp, path)


def _samples_us(fn, repeats: int, device: torch.device, *, warm: bool = True) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn`` in microseconds (after one warm-up call)."""
    if warm:
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter_ns()
        fn()
        _sync(device)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def _median_us(fn, repeats: int, device: torch.device, *, warm: bool = True) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` in microseconds (after one warm-up call)."""
    return statistics.median(_samples_us(fn, repeats, device, warm=warm))


def _one_thread_us(fn, repeats: int, device: torch.device, *, warm: bool = True) -> float:
    """``_median_us`` with one intra-op thread (the caller's count restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_us(fn, repeats, device, warm=warm)
    finally:
        torch.set_num_threads(threads)


class Contention:
    """Whether the CPU runs fewer threads than the profile asks for, checked as it goes.

    ``busy()`` times a parallel reference matmul on the current thread count (the slowest of
    ``CONTENTION_CALLS`` calls) and on one thread (the median), at most every
    ``CONTENTION_CHECK_S`` seconds (``busy(suspect=True)``, for an op that took long enough to
    have stalled: every ``CONTENTION_SUSPECT_GAP_S``); ``ratio`` is the latest quotient
    (threads over one thread) and ``worst`` the largest. Once found
    busy it stays busy: the load comes and goes faster than the checks (under a steady load
    of 1.7 other processes on two cores, ops timed between two checks that found the CPU
    free had stalled 17 ms), so a profile that met it once takes the one-thread timing for
    every op after. With one thread, or on another device, nothing is checked and nothing is
    busy.
    """

    def __init__(self, device: torch.device, threads: int, *, check_s: float = CONTENTION_CHECK_S) -> None:
        self.active = device.type == "cpu" and threads > 1
        self.check_s = check_s
        self.ratio = self.worst = 0.0
        self._last = -math.inf
        self._busy = False
        if self.active:
            side = CONTENTION_SIDE * max(1, round((threads / 2) ** (1 / 3)))
            self._a = torch.randn(side, side, generator=torch.Generator().manual_seed(0))

    def busy(self, *, suspect: bool = False) -> bool:
        if not self.active or self._busy:
            return self._busy
        now = time.perf_counter()
        if now - self._last >= (min(self.check_s, CONTENTION_SUSPECT_GAP_S) if suspect else self.check_s):
            with torch.no_grad():
                mm = lambda: torch.mm(self._a, self._a)  # noqa: E731
                many = max(_samples_us(mm, CONTENTION_CALLS, torch.device("cpu")))
                one = _one_thread_us(mm, 3, torch.device("cpu"))
            self.ratio = many / one
            self.worst = max(self.worst, self.ratio)
            self._busy = self.worst > CONTENTION_RATIO
            self._last = time.perf_counter()
        return self._busy


class _Timer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, zero_cost: frozenset[str], repeats: int, threads: int) -> None:
        super().__init__(gm)
        self.zero_cost = zero_cost
        self.repeats = repeats
        self.threads = threads
        self.costs: dict[str, float] = {}
        self.node: fx.Node | None = None
        self.contention: Contention | None = None
        #: Ops also timed on one thread because the CPU was found oversubscribed.
        self.retimed = 0

    def run_node(self, n: fx.Node) -> object:
        self.node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        n = self.node
        result = target(*args, **kwargs)
        if n.name in self.zero_cost or not isinstance(target, torch._ops.OpOverload):
            self.costs[n.name] = 0.0
            return result
        device = _device_of(tree_leaves((args, kwargs)))
        key = _op_key(n, args, kwargs, str(device), self.threads)
        if key not in _PROFILE_CACHE:
            run = lambda: target(*args, **kwargs)  # noqa: E731
            if self.contention is None:
                self.contention = Contention(device, self.threads)
            busy = self.contention.busy()
            us = _median_us(run, self.repeats, device, warm=False)  # (the interpreter's call warmed it)
            if not busy and us >= CONTENTION_SUSPECT_US:
                busy = self.contention.busy(suspect=True)
            if busy:
                us = min(us, _one_thread_us(run, self.repeats, device))
                self.retimed += 1
            _PROFILE_CACHE[key] = us
        self.costs[n.name] = _PROFILE_CACHE[key]
        return result


def profile(
    gm: fx.GraphModule,
    flat_inputs: Sequence[torch.Tensor],
    *,
    zero_cost: Iterable[str] = (),
    repeats: int = PROFILE_REPEATS,
    threads: int | None = None,
    cache_path: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Time every node of ``gm`` run on ``flat_inputs`` (median of ``repeats`` calls, in
    microseconds). The global random state and thread count are restored afterwards, so
    profiling does not disturb the caller's random stream.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: (x @ x).relu())(torch.randn(8, 8))
    >>> sorted(profile(gm, [torch.randn(8, 8)]))
    ['mm', 'relu']
    """
    threads = threads or torch.get_num_threads()
    _load_cache(cache_path, _PROFILE_CACHE)
    saved_threads = torch.get_num_threads()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    timer = _Timer(gm, frozenset(zero_cost), repeats, threads)
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            timer.run(*flat_inputs)
    finally:
        torch.set_num_threads(saved_threads)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
    if timer.retimed:
        log.warning(
            "the CPU is oversubscribed: a %d-thread matmul ran %.0fx slower than on one thread (other processes "
            "are busy on its cores), so %d ops were also timed on one thread and the faster kept; plan on a quiet "
            "machine, with fewer threads (torch.set_num_threads), or with cost_model=CostModel.ESTIMATE, which "
            "measures a few machine rates once instead of timing every op (less exposed to the load; "
            "remat.cost.machine_rates(cache_path=...) keeps them the same across processes)", threads,
            timer.contention.worst, timer.retimed)
    _save_cache(cache_path, _PROFILE_CACHE)
    return timer.costs


# ---------------------------------------------------------------------------- estimating
_RATES: dict[str, MachineRates] = {}


def machine_rates(device: str | torch.device = "cpu", *, cache_path: str | os.PathLike | None = None) -> MachineRates:
    """Measure (once per device and process) the matmul rate, copy bandwidth and per-op
    overhead that ``estimate`` uses. With ``cache_path``, rates are read from / written to a
    JSON file so that estimates are identical across processes."""
    dev = torch.device(device)
    key = str(dev)
    if key in _RATES:
        return _RATES[key]
    stored: dict[str, dict] = {}
    if cache_path is not None and os.path.exists(cache_path):
        try:
            with open(cache_path) as f:
                stored = json.load(f)
            if not isinstance(stored, dict):
                raise ValueError(f"expected a JSON object of devices, found {type(stored).__name__}")
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable rate cache %s: %s; measuring the rates again", cache_path, exc)
            stored = {}
        if key in stored:
            rates, problem = _rates_from(stored[key], key)
            if rates is not None:
                _RATES[key] = rates
                return rates
            log.warning("ignoring the %s rates in %s: %s; measuring them again", key, cache_path, problem)
    # On a CPU the faster of the thread count's and one thread's time is kept: on a quiet
    # machine that is the thread count's, on an oversubscribed one (see ``Contention``) its
    # parallel kernels wait for threads that are not running and one thread is the truer rate.
    def best(fn) -> float:
        us = _median_us(fn, RATE_REPEATS, dev)
        if dev.type == "cpu" and torch.get_num_threads() > 1:
            us = min(us, _one_thread_us(fn, RATE_REPEATS, dev))
        return us

    with torch.no_grad():
        a = torch.randn(RATE_MATMUL_SIDE, RATE_MATMUL_SIDE, device=dev)
        mm_us = best(lambda: torch.mm(a, a))
        x = torch.empty(RATE_COPY_BYTES // 4, device=dev)
        copy_us = best(lambda: x.clone())
        s = torch.ones(1, device=dev)
        overhead_us = _median_us(lambda: torch.ops.aten.add.Tensor(s, s), RATE_REPEATS * 3, dev)
    rates = MachineRates(
        device=key,
        matmul_flops_per_us=2 * RATE_MATMUL_SIDE**3 / mm_us,
        bytes_per_us=2 * RATE_COPY_BYTES / copy_us,  # a copy reads and writes every byte
        op_overhead_us=overhead_us,
    )
    _RATES[key] = rates
    if cache_path is not None:
        stored[key] = asdict(rates)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
            _save_cache(cache_path, stored)
        except OSError as exc:  # (the rates hold for this process; the next one measures its own)
            log.warning("could not keep the machine rates in %s: %s", cache_path, exc)
    return rates


def _rates_from(record: object, key: str) -> tuple[MachineRates | None, str]:
    """The rates a cache file holds for device ``key``, or None and what is wrong with them."""
    fields = ("matmul_flops_per_us", "bytes_per_us", "op_overhead_us")
    if not isinstance(record, dict) or record.get("device") != key or set(record) != {"device", *fields}:
        return None, f"expected an object with 'device': {key!r} and the numbers {', '.join(fields)}"
    for name in fields:
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            return None, f"{name} is {value!r}, not a positive number"
    return MachineRates(key, *(float(record[name]) for name in fields)), ""


def _flops(n: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(getattr(n.target, "overloadpacket", None))
    if formula is None:
        return 0.0
    args, kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
    try:
        return float(formula(*args, **kwargs, out_val=n.meta.get("val")))
    except Exception as exc:  # a formula that rejects its arguments: fall back to bandwidth
        log.debug("flop formula for %s failed: %s", n.target, exc)
        return 0.0


def _bytes_moved(n: fx.Node) -> int:
    read: dict[int, int] = {}
    for a in n.all_input_nodes:
        for t in tree_leaves(a.meta.get("val")):
            if isinstance(t, torch.Tensor):
                read[id(t)] = t.numel() * t.element_size()
    written = sum(t.numel() * t.element_size() for t in tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor))
    return sum(read.values()) + written


def estimate(
    gm: fx.GraphModule,
    *,
    zero_cost: Iterable[str] = (),
    rates: MachineRates | None = None,
    cache_path: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Roofline cost of every node from its fake-tensor metadata (no real run):
    ``max(flops / matmul rate, bytes / bandwidth) + per-op overhead`` in microseconds.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: (x @ x).relu(), tracing_mode="fake")(torch.randn(64, 64))
    >>> c = estimate(gm)
    >>> c["mm"] > 0 and c["relu"] > 0
    True
    """
    zero = frozenset(zero_cost)
    costs: dict[str, float] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.name in zero or not isinstance(n.target, torch._ops.OpOverload):
            costs[n.name] = 0.0
            continue
        r = rates or machine_rates(_device_of(tree_leaves(n.meta.get("val"))), cache_path=cache_path)
        roofline = max(_flops(n) / r.matmul_flops_per_us, _bytes_moved(n) / r.bytes_per_us)
        costs[n.name] = float(roofline + r.op_overhead_us) if math.isfinite(roofline) else r.op_overhead_us
    return costs
