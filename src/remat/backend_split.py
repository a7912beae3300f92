"""Lower a plan over a joint graph to AOTAutograd's forward and backward graphs.

The plan's stages up to the last forward node form the forward graph; the rest form the
backward graph. What is live where the two meet is saved for the backward (the forward
graph returns it after its own outputs, AOTAutograd's convention); forward nodes the plan
computes again in backward stages are duplicated into the backward graph, in the plan's
order. Torch frees every value after its last use in each graph (the backward runs with the
boxed calling convention, so saved values die there too), which is the plan's own rule.

Three things need care beyond copying nodes in plan order:

* Views. A view owns no bytes but pins its base. When the plan frees or recomputes a base,
  the views of its old instance are dropped and re-derived from the live instance when read
  again (no data moves), so no stale view keeps an old storage alive. A view crosses to the
  backward only while its base does.
* Random ops. A random node the plan computes more than once runs first under
  ``run_and_save_rng_state``; its recomputations run under ``run_with_rng_state`` with that
  state (saved for the backward when needed), so they draw the same numbers and leave the
  generator where it was: gradients equal eager PyTorch's.
* Tangents. Their marker nodes become the backward graph's tangent placeholders.
"""

from __future__ import annotations

import copy
import enum
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.descriptors import (
    SavedForBackwardsAOTOutput,
    SavedForBackwardsNoVcCheckAOTOutput,
)

from remat.backend_joint import JointStep, UnsupportedJointGraph, tangent_marker
from remat.errors import ScheduleError
from remat.execute import check_random_order, pins_kept
from remat.schedule import Plan, StepKind
from remat.simulate import SimResult


class Side(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, eq=False)
class Split:
    """The two graphs of a plan. ``saved`` names the values the forward hands to the
    backward; ``backward_recomputes`` counts forward-node computations in the backward."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[str, ...]
    backward_recomputes: int
    cut_step: int


def cut_index(step: JointStep, plan: Plan) -> int:
    """The plan step where the backward graph starts: right after the first computation of
    the last forward node and the frees that follow it."""
    if step.n_forward == 0:
        return 0
    last = step.n_forward - 1
    steps = plan.steps
    k = next((k for k, s in enumerate(steps) if s.kind is StepKind.COMPUTE and s.node == last), None)
    if k is None:
        raise ScheduleError(f"the plan never computes the last forward {step.graph.describe(last)}")
    k += 1
    while k < len(steps) and steps[k].kind is StepKind.FREE:
        k += 1
    return k


def _check_order(step: JointStep, plan: Plan, cut: int) -> None:
    for s in plan.steps[:cut]:
        if s.kind is StepKind.COMPUTE and s.node in step.tangent_dependent:
            raise ScheduleError(
                f"the plan computes {step.graph.describe(s.node)}, which reads a tangent, before the "
                f"forward ends; plans must be frontier-advancing over the forward-first order"
            )
    check_random_order(step.graph, step.random_nodes, plan)


class _Builder:
    def __init__(self, step: JointStep, sim: SimResult) -> None:
        self.step = step
        n = step.graph.n
        self.replayed = {i for i in step.random_nodes if sim.compute_counts[i] > 1}
        self.runs = [0] * n
        self.aliases_of: list[list[int]] = [[] for _ in range(n)]
        for v in range(n):
            if step.is_alias(v):
                for o in step.storage_owners[v]:
                    self.aliases_of[o].append(v)
        joint_meta = {p.name: p.meta for p in step.joint_placeholders}
        self.graphs = {Side.FORWARD: fx.Graph(), Side.BACKWARD: fx.Graph()}
        self.env: dict[Side, dict[int, fx.Node]] = {Side.FORWARD: {}, Side.BACKWARD: {}}
        self.state: dict[Side, dict[int, fx.Node]] = {Side.FORWARD: {}, Side.BACKWARD: {}}
        self.placeholders: dict[Side, dict[fx.Node, fx.Node]] = {Side.FORWARD: {}, Side.BACKWARD: {}}
        for p in step.primals:
            ph = self.graphs[Side.FORWARD].placeholder(p.name)
            ph.meta = copy.copy(joint_meta[p.name])
            self.placeholders[Side.FORWARD][p] = ph
        for t in step.tangents:
            ph = self.graphs[Side.BACKWARD].placeholder(t.name)
            ph.meta = copy.copy(joint_meta[t.name])
            self.placeholders[Side.BACKWARD][t] = ph
        self.first_tangent = self.placeholders[Side.BACKWARD][step.tangents[0]]
        self.constant_of = dict(step.constants)
        self.mutations_start: fx.Node | None = None  # set once the forward part is built
        self.backward_instances: set[int] = set()
        self.saved: list[tuple[fx.Node, fx.Node]] = []  # (forward value, backward placeholder)
        self.saved_by_key: dict[object, fx.Node] = {}
        self.saved_by_value: dict[fx.Node, fx.Node] = {}
        self.backward_recomputes: list[fx.Node] = []  # forward nodes computed in the backward

    # ------------------------------------------------------------------ values
    def value(self, side: Side, a: fx.Node) -> fx.Node:
        """The node of graph ``side`` holding planning node ``a``'s live value."""
        if a.op == "placeholder":
            ph = self.placeholders[side].get(a)
            if ph is not None:
                return ph
            if a.name in self.constant_of:
                ph = self.placeholders[side][a] = self.graphs[side].get_attr(self.constant_of[a.name])
                ph.meta = copy.copy(a.meta)
                return ph
            if side is Side.FORWARD:
                raise ScheduleError(f"the forward graph would read tangent {a.name}")
            fw_ph = self.placeholders[Side.FORWARD][a]
            if a.name in self.step.mutated_inputs:
                return self._save_old_value(fw_ph)
            return self._save(("input", a.name), fw_ph)
        i = self.step.node_id(a)
        env = self.env[side]
        if i in env:
            return env[i]
        alias = self.step.is_alias(i)
        if side is Side.FORWARD:
            if alias:
                return self._derive(side, i)
            raise ScheduleError(f"{self.step.graph.describe(i)} is read in the forward graph but holds no value")
        if alias:
            owners = self.step.storage_owners[i]
            fresh = any(o in self.backward_instances for o in owners)
            if owners and not fresh and isinstance(a.meta.get("val"), torch.Tensor):
                return self._save(("node", i), self.value(Side.FORWARD, a))
            return self._derive(side, i)
        if i in self.backward_instances:
            raise ScheduleError(f"{self.step.graph.describe(i)} is read in the backward graph after the plan freed it")
        return self._save(("node", i), self.value(Side.FORWARD, a))

    def end_forward(self) -> None:
        """Close the forward part: the input mutations run here, after every forward read
        (later forward nodes, e.g. views for saving, are inserted before them)."""
        fw = self.graphs[Side.FORWARD]
        by_name = {a.name: p for a, p in self.placeholders[Side.FORWARD].items()}
        for name, src in self.step.mutations:
            node = fw.call_function(torch.ops.aten.copy_.default, (by_name[name], self.value(Side.FORWARD, src)))
            node.meta["val"] = by_name[name].meta.get("val")
            self.mutations_start = self.mutations_start or node

    def _save_old_value(self, fw_ph: fx.Node) -> fx.Node:
        """An input overwritten after the forward (batch norm's running statistics) reaches the
        backward as a copy taken before the overwrite."""
        key = ("old input", fw_ph.name)
        if key not in self.saved_by_key:
            fw = self.graphs[Side.FORWARD]
            if self.mutations_start is None:  # AOTAutograd's runtime overwrites it after the graph
                old = fw.call_function(torch.ops.aten.clone.default, (fw_ph,))
            else:
                with fw.inserting_before(self.mutations_start):
                    old = fw.call_function(torch.ops.aten.clone.default, (fw_ph,))
            old.meta = copy.copy(fw_ph.meta)
            self._save(key, old)
        return self.saved_by_key[key]

    def _save(self, key: object, fw_value: fx.Node) -> fx.Node:
        if key in self.saved_by_key:
            return self.saved_by_key[key]
        if fw_value in self.saved_by_value:  # one forward value, reached by two paths
            self.saved_by_key[key] = self.saved_by_value[fw_value]
            return self.saved_by_key[key]
        if not isinstance(fw_value.meta.get("val"), torch.Tensor):
            raise UnsupportedJointGraph(f"value {fw_value.name!r} must cross to the backward but is not a tensor")
        with self.graphs[Side.BACKWARD].inserting_before(self.first_tangent):
            ph = self.graphs[Side.BACKWARD].placeholder(fw_value.name)
        # A node of the backward may hold the name already (the placeholder is then renamed):
        # the argument must carry the new name too, or fx's code binds `renamed = name` and a
        # later placeholder named `name` may overwrite the argument first.
        ph.target = ph.name
        ph.meta = copy.copy(fw_value.meta)
        self.saved.append((fw_value, ph))
        self.saved_by_key[key] = self.saved_by_value[fw_value] = ph
        return ph

    def _derive(self, side: Side, i: int) -> fx.Node:
        node = self.step.fx_node(i)
        new = self.graphs[side].node_copy(node, lambda a: self.value(side, a))
        self.env[side][i] = new
        return new

    def _state(self, side: Side, i: int) -> fx.Node:
        if i in self.state[side]:
            return self.state[side][i]
        if side is Side.FORWARD:
            raise ScheduleError(f"random {self.step.graph.describe(i)} is replayed before its first run")
        return self._save(("rng", i), self.state[Side.FORWARD][i])

    # ------------------------------------------------------------------ plan steps
    def compute(self, side: Side, i: int) -> None:
        node = self.step.fx_node(i)
        g = self.graphs[side]
        if node.target is tangent_marker:
            out = self.value(side, node.args[0])
        elif self.step.is_alias(i):
            # a view is taken where it is read: from the live instance of its base, or (in the
            # backward, while the base is the forward's) saved from the forward like the base
            self.env[side].pop(i, None)
            out = self.value(side, node)
        elif i in self.replayed:
            args = fx.node.map_arg(node.args, lambda a: self.value(side, a))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: self.value(side, a))
            if self.runs[i] == 0:
                pair = g.call_function(torch._prims.rng_prims.run_and_save_rng_state, (node.target, *args), kwargs)
                state = g.call_function(operator.getitem, (pair, 0))
                state.meta["val"] = _fake_rng_state(node)
                pair.meta["val"] = (state.meta["val"], node.meta["val"])
                out = g.call_function(operator.getitem, (pair, 1))
                self.state[side][i] = state
            else:
                st = self._state(side, i)
                out = g.call_function(torch._prims.rng_prims.run_with_rng_state, (st, node.target, *args), kwargs)
            out.meta = copy.copy(node.meta)
        else:
            out = g.node_copy(node, lambda a: self.value(side, a))
        self.runs[i] += 1
        self.env[side][i] = out
        for v in self.aliases_of[i]:  # views of the old instance must not pin it
            self.env[side].pop(v, None)
        if side is Side.BACKWARD:
            self.backward_instances.add(i)
            if i < self.step.n_forward and not self.step.is_alias(i):
                self.backward_recomputes.append(out)

    def free(self, side: Side, i: int) -> None:
        self.env[side].pop(i, None)
        if not self.step.is_alias(i):
            for v in self.aliases_of[i]:
                if not pins_kept(self.step.graph, i, v):
                    self.env[side].pop(v, None)


def _fake_rng_state(node: fx.Node) -> torch.Tensor:
    import torch.utils._pytree as pytree

    val = next(t for t in pytree.tree_leaves(node.meta["val"]) if isinstance(t, torch.Tensor))
    real = torch.cuda.get_rng_state(val.device) if val.device.type == "cuda" else torch.get_rng_state()
    return val.fake_mode.from_tensor(real)


def split(step: JointStep, joint: fx.GraphModule, plan: Plan, sim: SimResult) -> Split:
    """The forward and backward ``GraphModule`` that run ``plan`` (checked by ``simulate``)."""
    sim.raise_if_invalid()
    cut = cut_index(step, plan)
    _check_order(step, plan, cut)
    b = _Builder(step, sim)
    for k, s in enumerate(plan.steps):
        side = Side.FORWARD if k < cut else Side.BACKWARD
        if k == cut:
            b.end_forward()
        if s.kind is StepKind.COMPUTE:
            b.compute(side, s.node)
        else:
            b.free(side, s.node)
    if cut == len(plan.steps):
        b.end_forward()
    fw_graph, bw_graph = b.graphs[Side.FORWARD], b.graphs[Side.BACKWARD]
    out = bw_graph.output(tuple(b.value(Side.BACKWARD, o) if isinstance(o, fx.Node) else o for o in step.bwd_outputs))
    out.meta["desc"] = list(step.bwd_output_descs)
    # Frontier-advancing stages compute every node in its own stage, even where nothing reads
    # it before the plan frees it: torch need not run those. Random ops stay (they advance
    # the generator), and so does a first run that saves its generator state.
    bw_graph.eliminate_dead_code(is_impure_node=_impure)
    # what no remaining backward node reads need not be saved
    for _, ph in [pair for pair in b.saved if not pair[1].users]:
        bw_graph.erase_node(ph)
    # AOTAutograd's convention: values saved without a version-counter check come last
    saved = sorted((pair for pair in b.saved if pair[1].graph is bw_graph and not pair[1]._erased),
                   key=lambda pair: bool(pair[0].meta.get("saved_tensor_with_no_vc_check", False)))
    for _, ph in saved:
        b.first_tangent.prepend(ph)
    n_vc = sum(1 for fw, _ in saved if not fw.meta.get("saved_tensor_with_no_vc_check", False))
    fw_outs = [b.value(Side.FORWARD, o) if isinstance(o, fx.Node) else o for o in step.fwd_outputs]
    out = fw_graph.output(tuple(fw_outs) + tuple(fw for fw, _ in saved))
    out.meta["desc"] = list(step.fwd_output_descs) + [
        SavedForBackwardsAOTOutput(k) if k < n_vc else SavedForBackwardsNoVcCheckAOTOutput(k) for k in range(len(saved))
    ]
    fw_graph.eliminate_dead_code(is_impure_node=_impure)
    for n in bw_graph.nodes:
        if n.op == "call_function":
            n.meta["autograd_backward"] = True
    fw_graph.lint()
    bw_graph.lint()
    return Split(
        forward=fx.GraphModule(joint, fw_graph),
        backward=fx.GraphModule(joint, bw_graph),
        saved=tuple(fw.name for fw, _ in saved),
        backward_recomputes=sum(1 for n in b.backward_recomputes if not n._erased),
        cut_step=cut,
    )


def _impure(n: fx.Node) -> bool:
    return n.is_impure() or n.target is torch._prims.rng_prims.run_and_save_rng_state
