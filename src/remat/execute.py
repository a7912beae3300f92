"""Run a plan on real tensors: ``build_module(traced, plan)`` compiles a ``Plan`` into a
program that computes, recomputes and frees exactly where the plan says.

The program is a flat list of instructions over an environment with one slot per placeholder
and per graph node. ``Compute(i)`` runs node i's aten op on the live values of its inputs;
``Free(i)`` drops the slot, so torch releases the storage at the very step the simulator
does. Nothing is solved here: the plan is checked by ``simulate`` and run as given.

Two things need care beyond running ops in order:

* Random ops. A node that the plan computes more than once saves the generator state before
  its first run and replays it around every recomputation (restoring the live state after),
  so recomputation draws the same numbers and the stream continues exactly as in eager
  PyTorch. First computations of random nodes must follow trace order for the same reason.
* Views. A view owns no bytes but pins its base's storage. If a plan frees a storage's owner
  while keeping a view of it (to recompute the owner later), holding the old view would pin
  the old storage and exceed the simulated memory. So freeing an owner also drops the views
  of it, and a dropped view that is read later is re-derived from the owner's live instance
  (views are free: no data moves), which keeps memory exactly as simulated.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import keyword
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from remat.errors import ScheduleError
from remat.graph import Graph
from remat.schedule import Plan, StepKind
from remat.simulate import SimResult, simulate
from remat.trace import TracedStep


class Op(enum.IntEnum):
    RUN = 0  # compute a node
    RUN_SAVE_RNG = 1  # compute a random node that will be recomputed: save the generator first
    RUN_REPLAY_RNG = 2  # recompute a random node with its saved generator state
    RELEASE = 3  # drop a slot


@dataclass(frozen=True)
class Instruction:
    """One step of the compiled program. ``node`` is the graph node (-1: none); ``rebuild``
    marks a view re-derived by execute, not a step of the plan."""

    op: Op
    node: int
    rebuild: bool = False


Getter = Callable[[list], object]


def _compile_value(value: object, slot_of: dict[fx.Node, int]) -> Getter:
    if isinstance(value, fx.Node):
        slot = slot_of[value]
        return lambda env: env[slot]
    if isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
        parts = [_compile_value(v, slot_of) for v in value]
        kind = type(value)
        return lambda env: kind(p(env) for p in parts)
    return lambda env: value


def _compile_call(node: fx.Node, slot_of: dict[fx.Node, int]) -> Callable[[list], tuple[list, dict]]:
    arg_getters = [_compile_value(a, slot_of) for a in node.args]
    kw_getters = {k: _compile_value(v, slot_of) for k, v in node.kwargs.items()}
    if not kw_getters:
        return lambda env: ([g(env) for g in arg_getters], {})
    return lambda env: ([g(env) for g in arg_getters], {k: g(env) for k, g in kw_getters.items()})


class _Rng:
    """Save and restore the generator a random op draws from (per device type).

    A state is kept as Python bytes, not as a tensor: it is the generator's bookkeeping (5 KiB
    on CPU, 16 bytes on CUDA, host memory either way), and as a tensor it would sit in the
    allocator the plan's budget is about, from the op's first run to its last replay.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.index = device.index

    def get(self) -> bytes:
        state = torch.cuda.get_rng_state(self.index or 0) if self.cuda else torch.get_rng_state()
        return state.numpy().tobytes()

    def set(self, state: bytes) -> None:
        tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        if self.cuda:
            torch.cuda.set_rng_state(tensor, self.index or 0)
        else:
            torch.set_rng_state(tensor)


class PlannedStep:
    """A plan compiled against a traced step: call it with the traced module's flat inputs
    (``traced.flat_inputs(model, batch)``); it returns the same outputs as
    ``traced.module(*flat_inputs)`` (loss, gradients, buffer updates), computed in plan order
    under ``torch.no_grad()``.

    ``sim`` is the simulator's account of the plan; ``rebuilt_views`` counts view
    re-derivations execute added (they move no data and allocate nothing).
    """

    def __init__(self, traced: TracedStep, plan: Plan, sim: SimResult, program: tuple[Instruction, ...]) -> None:
        self.traced = traced
        self.plan = plan
        self.sim = sim
        self.program = program
        gm = traced.module
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._n_inputs = len(placeholders)
        slot_of = {n: k for k, n in enumerate(placeholders)}
        fx_nodes = [traced.fx_node(i) for i in range(traced.graph.n)]
        for i, n in enumerate(fx_nodes):
            slot_of[n] = self._n_inputs + i
        self._n_slots = self._n_inputs + len(fx_nodes)
        rng_index = {node: k for k, node in enumerate(traced.random_nodes)}
        compiled = []
        calls: dict[int, Callable] = {}
        for ins in program:
            slot = self._n_inputs + ins.node
            if ins.op is Op.RELEASE:
                compiled.append((Op.RELEASE, slot, None, None, -1, None))
                continue
            if ins.node not in calls:
                calls[ins.node] = _compile_call(fx_nodes[ins.node], slot_of)
            rng = _Rng(_device_of(fx_nodes[ins.node])) if ins.op is not Op.RUN else None
            target = fx_nodes[ins.node].target
            compiled.append((ins.op, slot, target, calls[ins.node], rng_index.get(ins.node, -1), rng))
        self._compiled = tuple(compiled)
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        self._out_slots = tuple(None if v is None else slot_of[v] for v in _flat_outputs(out_node))
        self.rebuilt_views = sum(1 for ins in program if ins.rebuild and ins.op is not Op.RELEASE)
        self._slot_of = slot_of
        self._fx_nodes = fx_nodes

    def __call__(self, *flat_inputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return self.run(flat_inputs)

    def run(self, flat_inputs: Sequence[torch.Tensor],
            observe: Callable[[int, object], None] | None = None) -> tuple[torch.Tensor | None, ...]:
        """Run the plan on ``flat_inputs``; ``observe(node, output)``, when given, is called after
        each node runs (every computation, recomputations included), with what it returned.

        Without ``observe`` the program runs as Python code generated for it (``source``: one
        line per instruction, each value a local variable), which spends a fraction of the
        host time per op that stepping through the instructions does; with it, the
        instructions are stepped through. Both run the same ops on the same values in the same
        order, and free each value at the same instruction."""
        if len(flat_inputs) != self._n_inputs:
            raise ScheduleError(
                f"planned step takes {self._n_inputs} inputs (parameters, buffers, batch, "
                f"constants: traced.flat_inputs(model, batch)); got {len(flat_inputs)}"
            )
        if observe is None:
            with torch.no_grad():
                return self._generated(*flat_inputs)
        return self.interpret(flat_inputs, observe)

    def interpret(self, flat_inputs: Sequence[torch.Tensor],
                  observe: Callable[[int, object], None] | None = None) -> tuple[torch.Tensor | None, ...]:
        """``run``, stepping through the instructions (see ``run``)."""
        env: list = [None] * self._n_slots
        env[: self._n_inputs] = flat_inputs
        saved_rng: list = [None] * len(self.traced.random_nodes)
        with torch.no_grad():
            for op, slot, fn, call, rng_slot, rng in self._compiled:
                if op is Op.RELEASE:
                    env[slot] = None
                    continue
                args, kwargs = call(env)
                if op is Op.RUN:
                    env[slot] = fn(*args, **kwargs)
                elif op is Op.RUN_SAVE_RNG:
                    saved_rng[rng_slot] = rng.get()
                    env[slot] = fn(*args, **kwargs)
                else:
                    live_state = rng.get()
                    rng.set(saved_rng[rng_slot])
                    env[slot] = fn(*args, **kwargs)
                    rng.set(live_state)
                if observe is not None:
                    observe(slot - self._n_inputs, env[slot])
                # Drop the argument lists now: held until the next instruction they would pin
                # storages the plan has already freed.
                args = kwargs = None
        return tuple(None if s is None else env[s] for s in self._out_slots)

    @functools.cached_property
    def source(self) -> str:
        """The Python code ``run`` executes (see ``_generate``)."""
        return self._generation[0]

    @functools.cached_property
    def _generated(self) -> Callable[..., tuple[torch.Tensor | None, ...]]:
        code, names = self._generation
        namespace = dict(names)
        exec(compile(code, f"<remat plan of {self.traced.graph.name}>", "exec"), namespace)
        return namespace["planned_step"]

    @functools.cached_property
    def _generation(self) -> tuple[str, dict[str, object]]:
        return _generate(self._compiled, self._n_inputs, self._out_slots, self._fx_nodes, self._slot_of)

    def describe(self) -> str:
        """The program as text, one instruction a line (rebuilt views marked)."""
        lines = []
        for ins in self.program:
            name = self.traced.node_names[ins.node]
            if ins.op is Op.RELEASE:
                lines.append(f"del {name}")
            else:
                target = self.traced.fx_node(ins.node).target
                tag = {Op.RUN_SAVE_RNG: "  # save rng", Op.RUN_REPLAY_RNG: "  # replay rng"}.get(ins.op, "")
                lines.append(f"{name} = {target}(...){tag}{'  # view rebuilt' if ins.rebuild else ''}")
        return "\n".join(lines)


def _generate(compiled: Sequence[tuple], n_inputs: int, out_slots: Sequence[int | None], fx_nodes: Sequence[fx.Node],
              slot_of: dict[fx.Node, int]) -> tuple[str, dict[str, object]]:
    """Python source of one function running ``compiled`` (``PlannedStep._compiled``), and the
    names it reads: ``planned_step(*flat_inputs)`` returns the step's outputs. Slot k is the
    local ``v{k}``; a node's op is called through the C++ operator an aten ``OpOverload`` wraps
    (what its ``__call__`` calls); arguments that are not values are module names bound to the
    very objects the instructions pass (``K{k}``), except ints, bools and None, which are written
    out. Freeing a slot sets its local to None, as the instructions clear its entry."""
    names: dict[str, object] = {}
    constant_names: dict[int, str] = {}

    def constant(value: object) -> str:
        if value is None or isinstance(value, bool) or type(value) is int:
            return repr(value)
        name = constant_names.get(id(value))
        if name is None:
            name = constant_names[id(value)] = f"K{len(constant_names)}"
            names[name] = value
        return name

    def render(value: object) -> str:
        if isinstance(value, fx.Node):
            return f"v{slot_of[value]}"
        if isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
            parts = ", ".join(render(v) for v in value)
            if isinstance(value, list):
                return f"[{parts}]"
            parts = f"({parts}{',' if len(value) == 1 else ''})"
            return parts if type(value) is tuple else f"{constant(type(value))}({parts})"
        return constant(value)

    calls: dict[int, str] = {}

    def call(slot: int, target: object) -> str:
        if slot not in calls:
            node = fx_nodes[slot - n_inputs]
            fn = f"F{slot}"
            names[fn] = target._op if isinstance(target, torch._ops.OpOverload) else target
            args = [render(a) for a in node.args]
            if all(k.isidentifier() and not keyword.iskeyword(k) for k in node.kwargs):
                args += [f"{k}={render(v)}" for k, v in node.kwargs.items()]
            elif node.kwargs:
                args.append("**{" + ", ".join(f"{k!r}: {render(v)}" for k, v in node.kwargs.items()) + "}")
            calls[slot] = f"{fn}({', '.join(args)})"
        return calls[slot]

    lines = ["def planned_step(" + "".join(f"v{k}, " for k in range(n_inputs)) + "):"]
    for op, slot, target, _, rng_slot, rng in compiled:
        if op is Op.RELEASE:
            lines.append(f"    v{slot} = None")
            continue
        if op is Op.RUN:
            lines.append(f"    v{slot} = {call(slot, target)}")
            continue
        generator = f"R{slot}"
        names[generator] = rng
        if op is Op.RUN_SAVE_RNG:
            lines += [f"    S{rng_slot} = {generator}.get()", f"    v{slot} = {call(slot, target)}"]
        else:
            lines += [f"    live = {generator}.get()", f"    {generator}.set(S{rng_slot})",
                      f"    v{slot} = {call(slot, target)}", f"    {generator}.set(live)"]
    outputs = ", ".join("None" if s is None else f"v{s}" for s in out_slots)
    lines.append(f"    return ({outputs}{',' if len(out_slots) == 1 else ''})")
    return "\n".join(lines) + "\n", names


def _flat_outputs(out_node: fx.Node) -> list[fx.Node | None]:
    from torch.utils._pytree import tree_leaves

    return list(tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))


def _device_of(n: fx.Node) -> torch.device:
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(n.meta.get("val")):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


@dataclass(frozen=True)
class PlanFacts:
    """What the simulator states about a plan compiled for a traced step: peaks in bytes
    (kernel scratch included), costs in the graph's unit, the structural fingerprint. A
    report built from these is true by construction; ``contradictions`` lists where a stated
    report (a saved file's) says otherwise."""

    predicted_peak_bytes: int
    fixed_bytes: int
    checkpoint_all_peak_bytes: int
    cost_us: float
    checkpoint_all_cost_us: float
    overhead: float
    recomputed_nodes: int
    n_nodes: int
    fingerprint: str

    @classmethod
    def of(cls, planned: PlannedStep) -> PlanFacts:
        import numpy as np

        from remat.schedule import Schedule

        graph = planned.traced.graph
        everything_once = simulate(graph, Schedule.from_compute(graph, np.eye(graph.n, dtype=bool)).lower(graph))
        return cls(
            predicted_peak_bytes=planned.sim.peak_bytes,
            fixed_bytes=graph.fixed_bytes,
            checkpoint_all_peak_bytes=everything_once.peak_bytes,
            cost_us=planned.sim.total_cost,
            checkpoint_all_cost_us=graph.total_cost,
            overhead=planned.sim.total_cost / graph.total_cost if graph.total_cost > 0 else 1.0,
            recomputed_nodes=int(sum(c > 1 for c in planned.sim.compute_counts)),
            n_nodes=graph.n,
            fingerprint=graph.fingerprint(costs=False),
        )

    def contradictions(self, stated: dict[str, object]) -> list[str]:
        """``"field: the file promises X, the plan simulates to Y"`` for every fact ``stated``
        gives differently (numbers to a relative 1e-9)."""
        found = []
        for key, fact in dataclasses.asdict(self).items():
            if key not in stated:
                continue
            value = stated[key]
            if isinstance(fact, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                same = value == fact
            else:
                same = math.isclose(float(value), float(fact), rel_tol=1e-9, abs_tol=1e-12)
            if not same:
                unit = " B" if key.endswith("_bytes") else ""
                found.append(f"{key}: the file promises {value!r}{unit}, the plan simulates to {fact!r}{unit}")
        return found


def build_module(traced: TracedStep, plan: Plan) -> PlannedStep:
    """Compile ``plan`` for ``traced``; raise ``ScheduleError`` if the simulator rejects it or
    it draws random numbers in a different order than eager PyTorch would.

    >>> import torch, numpy as np
    >>> from remat.trace import trace
    >>> from remat.schedule import Schedule
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> x = torch.randn(2, 4)
    >>> t = trace(m, (x,), lambda m, x: m(x).sum(), cost_model=None)
    >>> step = build_module(t, Schedule.from_kept(t.graph, np.zeros((t.graph.n,) * 2)).lower(t.graph))
    >>> loss = step(*t.flat_inputs(m, (x,)))[0]
    >>> torch.equal(loss, m(x).sum())
    True
    """
    graph = traced.graph
    sim = simulate(graph, plan)
    sim.raise_if_invalid()
    check_random_order(traced.graph, traced.random_nodes, plan)
    return PlannedStep(traced, plan, sim, _compile_program(traced, plan, sim))


def check_random_order(graph: Graph, random_nodes: Iterable[int], plan: Plan) -> None:
    """Refuse a plan whose random ops first run out of trace order: each draws from the global
    generator, so only the trace order gives eager PyTorch's numbers."""
    seen: set[int] = set()
    first = []
    randoms = set(random_nodes)
    for i in plan.compute_order:
        if i in randoms and i not in seen:
            seen.add(i)
            first.append(i)
    if first != sorted(first):
        k = next(k for k in range(len(first)) if first[k] != sorted(first)[k])
        raise ScheduleError(
            f"plan first computes random {graph.describe(first[k])} before "
            f"{graph.describe(sorted(first)[k])}; random ops must first run in trace order "
            f"so that they draw the same numbers as eager PyTorch (recomputations may go anywhere)"
        )


def pins_kept(graph: Graph, owner: int, view: int) -> bool:
    """``view`` is a step output viewing what ``owner`` keeps for good (its ``kept_bytes``):
    freeing the owner's other outputs must not drop it."""
    return bool(graph.nodes[owner].kept_bytes) and view in graph.output_set


def _compile_program(traced: TracedStep, plan: Plan, sim: SimResult) -> tuple[Instruction, ...]:
    graph = traced.graph
    n = graph.n
    alias = [traced.is_alias(i) for i in range(n)]
    aliases_of: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        if alias[v]:
            for o in traced.storage_owners[v]:
                aliases_of[o].append(v)
    ids = {name: i for i, name in enumerate(traced.node_names)}
    inputs = [[ids[a.name] for a in traced.fx_node(i).all_input_nodes if a.name in ids] for i in range(n)]
    random_set = set(traced.random_nodes)
    recomputed = {i for i in random_set if sim.compute_counts[i] > 1}
    plan_live = [False] * n
    phys_live = [False] * n
    computed = [0] * n
    program: list[Instruction] = []

    def ensure(i: int, temps: list[int]) -> None:
        """Make node i's value physically present; views dropped with their owner are
        re-derived from the owner's live instance."""
        if phys_live[i]:
            return
        if not alias[i]:
            raise ScheduleError(f"internal: {graph.describe(i)} is needed but holds no value")
        for a in inputs[i]:
            ensure(a, temps)
        program.append(Instruction(Op.RUN, i, rebuild=True))
        phys_live[i] = True
        if not plan_live[i]:
            temps.append(i)

    for step in plan.steps:
        i = step.node
        if step.kind is StepKind.COMPUTE:
            temps: list[int] = []
            for a in inputs[i]:
                ensure(a, temps)
            if i in recomputed:
                op = Op.RUN_SAVE_RNG if computed[i] == 0 else Op.RUN_REPLAY_RNG
            else:
                op = Op.RUN
            program.append(Instruction(op, i))
            computed[i] += 1
            plan_live[i] = phys_live[i] = True
            for t in reversed(temps):
                program.append(Instruction(Op.RELEASE, t, rebuild=True))
                phys_live[t] = False
        else:
            if phys_live[i]:
                program.append(Instruction(Op.RELEASE, i))
            plan_live[i] = phys_live[i] = False
            if not alias[i]:
                for v in aliases_of[i]:
                    if phys_live[v] and not pins_kept(graph, i, v):
                        program.append(Instruction(Op.RELEASE, v, rebuild=True))
                        phys_live[v] = False
    temps = []
    for o in graph.outputs:  # an output view dropped with an earlier instance of its owner
        ensure(o, temps)
    return tuple(program)


def grad_through_hooks(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as the hooks registered on ``param`` (``param.register_hook``) leave it, in the
    order they were registered, as autograd runs them before accumulating: a traced step
    computes gradients without autograd, so it runs them itself (they used to be skipped, and a
    hook halving a gradient was silently ignored)."""
    for hook in list((getattr(param, "_backward_hooks", None) or {}).values()):
        out = hook(grad)
        if out is not None:
            grad = out
    return grad
