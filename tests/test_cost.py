"""Cost models: profiled and estimated node costs in microseconds, cached, views free."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat import cost
from remat.cost import CostModel, MachineRates, estimate, machine_rates, node_costs, profile
from remat.trace import trace
from torch_helpers import traced, workload

RATES = MachineRates(device="cpu", matmul_flops_per_us=1e4, bytes_per_us=1e4, op_overhead_us=1.0)


def _gm(side: int = 64):
    return make_fx(lambda x: (x @ x).relu().t(), tracing_mode="fake")(torch.randn(side, side))


def test_profile_times_every_op_and_leaves_views_free():
    w = workload("mlp", 64)
    t = trace(w.model, w.batch, w.loss_fn, cost_model=CostModel.PROFILE)
    for i, node in enumerate(t.graph.nodes):
        if t.is_alias(i):
            assert node.cost == 0.0, node.name
        else:
            assert node.cost > 0.0, node.name


def test_profile_restores_random_state_and_threads_and_caches(tmp_path):
    gm = make_fx(lambda x: torch.nn.functional.dropout(x @ x, 0.5) + 1)(torch.randn(16, 16))
    x = torch.randn(16, 16)
    torch.manual_seed(3)
    before_state, before_threads = torch.get_rng_state(), torch.get_num_threads()
    path = tmp_path / "costs.json"
    first = profile(gm, [x], threads=1, cache_path=path)
    assert torch.equal(torch.get_rng_state(), before_state)
    assert torch.get_num_threads() == before_threads
    assert all(c > 0 for c in first.values())
    # a second run hits the in-process cache: identical numbers
    assert profile(gm, [x], threads=1, cache_path=path) == first
    # the disk cache holds the same numbers for a fresh process
    stored = json.loads(path.read_text())
    assert set(first.values()) <= set(stored.values())
    cost._PROFILE_CACHE.clear()
    cost._LOADED_FILES.clear()
    assert profile(gm, [x], threads=1, cache_path=path) == first


def test_estimate_is_a_roofline_and_deterministic():
    gm = _gm(64)
    c = estimate(gm, rates=RATES)
    assert c == estimate(gm, rates=RATES)
    flops_mm = 2 * 64**3
    bytes_mm = 3 * 64 * 64 * 4
    assert c["mm"] == pytest.approx(max(flops_mm / 1e4, bytes_mm / 1e4) + 1.0)
    assert c["relu"] == pytest.approx(2 * 64 * 64 * 4 / 1e4 + 1.0)  # no flop formula: bandwidth
    assert estimate(gm, rates=RATES, zero_cost={"t"})["t"] == 0.0


def test_machine_rates_are_measured_once_and_cached(tmp_path):
    path = tmp_path / "rates.json"
    cost._RATES.clear()
    rates = machine_rates("cpu", cache_path=path)
    assert rates.matmul_flops_per_us > 0 and rates.bytes_per_us > 0 and rates.op_overhead_us > 0
    assert machine_rates("cpu") is rates
    cost._RATES.clear()
    assert machine_rates("cpu", cache_path=path) == rates  # read back from the file


def test_node_costs_dispatches_on_the_enum():
    gm = _gm(16)
    assert set(node_costs(gm, [torch.randn(16, 16)], CostModel.ESTIMATE)) == {"mm", "relu", "t"}
    with pytest.raises(ValueError, match="not a CostModel"):
        node_costs(gm, [], "profile")


def test_traced_costs_rank_matmuls_above_views():
    t = traced("gpt2-tiny", 2)
    by_name = {n.name: n.cost for n in t.graph.nodes}
    assert by_name["mm"] > by_name["view"] == 0.0
    assert all(c >= 0 for c in by_name.values())
    assert t.graph.total_cost > 0
