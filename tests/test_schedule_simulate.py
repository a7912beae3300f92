"""Lowering schedules to plans and replaying plans: hand-checked values and every violation."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import Graph, Node, NodeKind, Plan, Schedule, ScheduleError, Step, StepKind, simulate
from remat.builders import chain_graph, random_training_graph
from remat.schedule import plan_from_order

C, Fr = StepKind.COMPUTE, StepKind.FREE


def steps(*pairs):
    return Plan(tuple(Step(C if k == "c" else Fr, i) for k, i in pairs))


def test_checkpoint_all_chain3_by_hand():
    # f0 f1 f2 loss g2 g1 g0 with unit sizes: after computing g2 (node 4) the live set is
    # {0,1,2,3,4} = 5 bytes, the peak; then 2 and 3 die, and so on. Cost: 7 nodes once.
    g = chain_graph(3, bytes_per_node=1)
    plan = Schedule.from_compute(g, np.eye(g.n, dtype=bool)).lower(g)
    assert [str(s) for s in plan.steps] == [
        "compute(0)", "compute(1)", "compute(2)", "compute(3)", "compute(4)", "free(2)", "free(3)",
        "compute(5)", "free(1)", "free(4)", "compute(6)", "free(0)", "free(5)",
    ]
    sim = simulate(g, plan)
    assert sim.ok and sim.peak_bytes == 5 and sim.total_cost == 7.0
    assert sim.timeline_bytes == (1, 2, 3, 4, 5, 4, 3, 4, 3, 2, 3, 2, 1)
    assert sim.peak_step == 4
    assert sim.compute_counts == (1,) * 7


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_checkpoint_all_chain_peak_is_n_plus_2(n):
    g = chain_graph(n, bytes_per_node=1, fixed_bytes=10)
    sim = simulate(g, Schedule.from_compute(g, np.eye(g.n, dtype=bool)).lower(g))
    assert sim.peak_bytes == 10 + n + 2 and sim.total_cost == 2 * n + 1


def test_keep_nothing_recomputes_prefixes():
    # Keeping nothing, stage t recomputes every forward node it needs: stage t < 3 recomputes
    # 0..t-1 (t nodes), stage 3 (loss) 3, stage 4 needs 2,3 -> 4, stage 5 needs 1,4 -> 5,
    # stage 6 needs 0,5 -> 6. Total 0+1+2+3+4+5+6 recomputations + 7 = 28.
    g = chain_graph(3, bytes_per_node=1)
    s = Schedule.from_kept(g, np.zeros((g.n, g.n), dtype=bool))
    assert s.R.sum() == 28
    sim = simulate(g, s.lower(g))
    assert sim.ok and sim.total_cost == 28.0 and sim.peak_bytes == 5


def test_from_kept_keeps_outputs_and_non_recomputables():
    nodes = (
        Node("x", NodeKind.FORWARD, (), 2, 1.0),
        Node("drop", NodeKind.FORWARD, (0,), 2, 1.0, recomputable=False),
        Node("loss", NodeKind.LOSS, (1,), 1, 1.0),
        Node("g", NodeKind.BACKWARD, (1, 2), 2, 1.0),
        Node("g0", NodeKind.BACKWARD, (0, 3), 2, 1.0),
    )
    g = Graph(nodes=nodes, fixed_bytes=0, outputs=(2, 4))
    s = Schedule.from_kept(g, np.zeros((5, 5), dtype=bool))
    sim = simulate(g, s.lower(g))
    assert sim.ok
    assert sim.compute_counts[1] == 1  # never recomputed
    assert sim.compute_counts[0] == 3  # stage 0, again for drop (stage 1), again for g0
    assert s.S[3:, 2].all()  # the loss (an output) stays live


def test_from_compute_liveness_matches_plan():
    g = random_training_graph(8, seed=2)
    rng = np.random.default_rng(0)
    keep = np.tril(rng.random((g.n, g.n)) < 0.3, -1)
    s = Schedule.from_kept(g, keep)
    plan = s.lower(g)
    live, stage, k = set(), 0, 0
    stages = [t for t in range(g.n) for _ in range(int(s.R[t, : t + 1].sum()))]
    for step in plan.steps:
        if step.kind is C:
            while stage < stages[k]:
                stage += 1
                assert set(np.flatnonzero(s.S[stage])) == live
            live.add(step.node)
            k += 1
        else:
            live.discard(step.node)


def test_schedule_matrices_are_read_only_copies():
    R = np.eye(3, dtype=bool)
    s = Schedule(R=R, S=np.zeros((3, 3), dtype=bool))
    R[0, 0] = False
    assert s.R[0, 0]
    with pytest.raises(ValueError):
        s.R[1, 1] = False


@pytest.mark.parametrize(
    "R, S, message",
    [(np.ones((2, 3)), np.ones((2, 3)), "R must be a square matrix"),
     (np.eye(3), np.eye(2), r"S has shape \(2, 2\) but the graph has 3 nodes")],
)
def test_schedule_shape_errors(R, S, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule(R=R, S=S)


def test_schedule_for_other_graph_is_rejected():
    s = Schedule.from_compute(chain_graph(2), np.eye(5, dtype=bool))
    with pytest.raises(ScheduleError, match="schedule is for 5 nodes but graph 'chain3' has 7; solve again"):
        s.lower(chain_graph(3))
    with pytest.raises(ScheduleError, match=r"keep matrix has shape \(2, 2\); expected \(5, 5\)"):
        Schedule.from_kept(chain_graph(2), np.zeros((2, 2)))


def test_plan_from_order_frees_superseded_instances():
    g = chain_graph(2, bytes_per_node=1)  # f0 f1 loss g1 g0
    plan = plan_from_order(g, [0, 1, 2, 3, 0, 4])
    sim = simulate(g, plan)
    assert sim.ok
    assert sim.compute_counts == (2, 1, 1, 1, 1)
    # the first instance of f0 dies after f1 reads it; the second lives until g0
    assert [str(s) for s in plan.steps][:3] == ["compute(0)", "compute(1)", "free(0)"]


# ---------------------------------------------------------------- violations, one per rule
G = chain_graph(2, bytes_per_node=1)


@pytest.mark.parametrize(
    "plan, message",
    [
        (steps(("c", 1)), "step 0 computes node 1 ('f1') but its input node 0 ('f0') is not live; compute the input first"),
        (steps(("c", 0), ("c", 0)), "step 1 computes node 0 ('f0') while its output is still live; free it first"),
        (steps(("f", 0)), "step 0 frees node 0 ('f0'), which is not live"),
        (steps(("c", 9)), "step 0 names node 9, which is not in graph 'chain2' (0..4)"),
        (steps(("c", 0)), "output node 4 ('grad_f0') is not live at the end of the plan; never free an output"),
    ],
)
def test_each_violation_is_reported(plan, message):
    sim = simulate(G, plan)
    assert not sim.ok
    assert any(message in v.message for v in sim.violations)
    with pytest.raises(ScheduleError, match="plan is invalid"):
        sim.raise_if_invalid()


def test_non_recomputable_cannot_run_twice():
    nodes = (Node("r", NodeKind.FORWARD, (), 1, 1.0, recomputable=False), Node("l", NodeKind.LOSS, (0,), 1, 1.0))
    g = Graph(nodes=nodes, fixed_bytes=0, outputs=(1,))
    sim = simulate(g, steps(("c", 0), ("f", 0), ("c", 0), ("c", 1)))
    assert [v.message for v in sim.violations] == [
        "step 2 recomputes node 0 ('r'), which must run once per step (not recomputable); keep its output instead"
    ]


def test_many_violations_are_summarised():
    sim = simulate(G, steps(*[("f", 0)] * 7))
    with pytest.raises(ScheduleError, match=r"\(and 3 more\)"):
        sim.raise_if_invalid()


def test_empty_plan():
    sim = simulate(G, Plan(()))
    assert sim.peak_bytes == 0 and sim.peak_step == -1 and not sim.ok


def test_solve_rejects_unknown_methods_options_and_budgets():
    from remat import solve

    g = chain_graph(3)
    with pytest.raises(ValueError, match="unknown method 'magic'; choose one of: .*checkpoint_all"):
        solve(g, 2**30, method="magic")
    with pytest.raises(ValueError, match="method 'chen_sqrtn' has no option 'varaint'; its options are: variant"):
        solve(g, 2**30, method="chen_sqrtn", varaint="auto")
    with pytest.raises(ValueError, match="method 'checkpoint_all' has no option 'x'; its options are: none"):
        solve(g, 2**30, method="checkpoint_all", x=1)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            solve(g, bad, method="checkpoint_all")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 12), seed=st.integers(0, 10_000), keep_p=st.floats(0.0, 1.0))
def test_fast_peak_and_cost_equal_the_simulator_with_scratch_and_kept_bytes(n: int, seed: int, keep_p: float) -> None:
    from remat.coarsen import coarsen
    from remat.schedule import least_compute, order_peak_and_cost, stage_order

    # grouped graphs carry scratch (temp) and kept bytes; random keep matrices recompute
    graph = coarsen(random_training_graph(n, seed), max_nodes=max(3, n)).coarse
    keep = np.random.default_rng(seed).random((graph.n, graph.n)) < keep_p
    _, nodes = stage_order(least_compute(graph, keep))
    sim = simulate(graph, plan_from_order(graph, nodes.tolist()))
    assert sim.ok
    assert order_peak_and_cost(graph, nodes.tolist()) == (sim.peak_bytes, sim.total_cost)
