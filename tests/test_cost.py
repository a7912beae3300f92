"""Cost models: profiled and estimated node costs in microseconds, cached, views free."""

from __future__ import annotations

import json
import time

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


def _stalling_clock(monkeypatch, *, many_us: float, one_us: float) -> list[int]:
    """Make every timing report ``many_us`` on more than one thread and ``one_us`` on one, as
    an oversubscribed CPU (``many_us`` much larger) or a quiet one does; returns a list that
    records the thread count of every timing."""
    threads: list[int] = []

    def fake(fn, repeats, device, *, warm=True):
        fn()
        threads.append(torch.get_num_threads())
        return [many_us if torch.get_num_threads() > 1 else one_us] * repeats

    monkeypatch.setattr(cost, "_samples_us", fake)
    return threads


def _profiled_under(monkeypatch, caplog, *, many_us: float, one_us: float):
    """Profile a three-op graph on two threads under ``_stalling_clock``: (costs, the thread
    count of every timing, the warnings logged)."""
    gm = make_fx(lambda x: (x @ x).relu() + 1)(torch.randn(16, 16))
    cost._PROFILE_CACHE.clear()
    timings = _stalling_clock(monkeypatch, many_us=many_us, one_us=one_us)
    with caplog.at_level("WARNING", logger="remat.cost"):
        costs = profile(gm, [torch.randn(16, 16)], threads=2)
    cost._PROFILE_CACHE.clear()
    return costs, timings, [r.getMessage() for r in caplog.records]


def test_an_oversubscribed_cpu_is_timed_on_one_thread_too(monkeypatch, caplog):
    # Multi-threaded kernels waiting 16 ms for a thread that is not running: every op's cost
    # would be 16 ms. Found by the check, the one-thread timing is kept, and a warning says so.
    costs, timings, warnings = _profiled_under(monkeypatch, caplog, many_us=16000.0, one_us=10.0)
    assert costs == {"mm": 10.0, "relu": 10.0, "add": 10.0}
    assert 1 in timings and 2 in timings
    [message] = [m for m in warnings if "oversubscribed" in m]
    assert "2-thread matmul ran 1600x slower than on one thread" in message
    assert "3 ops were also timed on one thread" in message
    assert "CostModel.ESTIMATE" in message and "torch.set_num_threads" in message
    # (ESTIMATE's rates are measured per process too: the remedy names how to keep them fixed)
    assert "machine_rates(cache_path=...)" in message and "do not depend on the load" not in message


def test_a_quiet_cpu_keeps_its_thread_count_timing_and_says_nothing(monkeypatch, caplog):
    costs, timings, warnings = _profiled_under(monkeypatch, caplog, many_us=6.0, one_us=10.0)
    assert costs == {"mm": 6.0, "relu": 6.0, "add": 6.0}
    assert timings.count(1) == 1  # the check's reference op only, once (within CONTENTION_CHECK_S)
    assert not warnings


def test_contention_once_found_stays_and_one_thread_checks_nothing(monkeypatch):
    clock = {"many": 16000.0, "checks": 0}

    def fake(fn, repeats, device, *, warm=True):
        clock["checks"] += torch.get_num_threads() > 1
        return [clock["many"] if torch.get_num_threads() > 1 else 10.0] * repeats

    monkeypatch.setattr(cost, "_samples_us", fake)
    c = cost.Contention(torch.device("cpu"), 2, check_s=0.0)
    with _threads(2):
        assert c.busy() and c.ratio == 1600.0
        clock["many"] = 5.0  # the load left for a moment: still busy, and nothing is timed again
        assert c.busy() and c.worst == 1600.0 and clock["checks"] == 1
    assert not cost.Contention(torch.device("cpu"), 1).busy()
    assert not cost.Contention(torch.device("meta"), 2).busy()


def test_an_op_long_enough_to_have_stalled_has_the_check_run_early(monkeypatch):
    clock = {"many": 5.0}
    monkeypatch.setattr(cost, "_samples_us",
                        lambda fn, r, d, *, warm=True: [clock["many"] if torch.get_num_threads() > 1 else 10.0] * r)
    c = cost.Contention(torch.device("cpu"), 2, check_s=3600.0)
    with _threads(2):
        assert not c.busy()  # the first check: quiet
        clock["many"] = 16000.0  # the load starts
        assert not c.busy()  # the next regular check is an hour away
        assert not c.busy(suspect=True)  # a suspect op: not within CONTENTION_SUSPECT_GAP_S of the last check
        time.sleep(cost.CONTENTION_SUSPECT_GAP_S * 1.2)
        assert c.busy(suspect=True) and c.ratio == 1600.0


class _threads:
    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.saved)


def test_machine_rates_on_an_oversubscribed_cpu_are_one_threads(monkeypatch):
    _stalling_clock(monkeypatch, many_us=16000.0, one_us=100.0)
    monkeypatch.setattr(cost, "_RATES", {})
    with _threads(2):
        rates = machine_rates("cpu")
    assert rates.matmul_flops_per_us == 2 * cost.RATE_MATMUL_SIDE**3 / 100.0
    assert rates.bytes_per_us == 2 * cost.RATE_COPY_BYTES / 100.0


def test_contention_counts_one_stalled_call_and_not_a_hiccup(monkeypatch):
    # stalls come and go between calls: one of five is enough; a quiet machine's hiccup is not
    for many, busy in (([5.0] * 4 + [16000.0]), True), (([5.0] * 4 + [25.0]), False):
        monkeypatch.setattr(cost, "_samples_us",
                            lambda fn, r, d, *, warm=True, many=many: many if torch.get_num_threads() > 1 else [10.0] * r)
        with _threads(2):
            assert cost.Contention(torch.device("cpu"), 2).busy() is busy


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[1, 2]", "expected a JSON object of devices"),
        ("{not json", "ignoring unreadable rate cache"),
        ('{"cpu": {"device": "cpu", "matmul_flops_per_us": -5, "bytes_per_us": 1, "op_overhead_us": 1}}',
         "matmul_flops_per_us is -5, not a positive number"),
        ('{"cpu": {"device": "cpu", "matmul_flops_per_us": "fast", "bytes_per_us": 1, "op_overhead_us": 1}}',
         "matmul_flops_per_us is 'fast'"),
        ('{"cpu": {"device": "cpu", "matmul_flops_per_us": 1, "bytes_per_us": 1}}', "expected an object with"),
        ('{"cpu": {"device": "cuda", "matmul_flops_per_us": 1, "bytes_per_us": 1, "op_overhead_us": 1}}',
         "'device': 'cpu'"),
    ],
)
def test_a_damaged_rate_cache_is_measured_again_and_rewritten(tmp_path, caplog, content, problem):
    path = tmp_path / "rates.json"
    path.write_text(content)
    cost._RATES.clear()
    with caplog.at_level("WARNING", logger="remat.cost"):
        rates = machine_rates("cpu", cache_path=path)
    assert problem in caplog.text and "measuring" in caplog.text
    assert rates.matmul_flops_per_us > 0 and rates.bytes_per_us > 0 and rates.op_overhead_us > 0
    assert json.loads(path.read_text())["cpu"]["matmul_flops_per_us"] == rates.matmul_flops_per_us
    cost._RATES.clear()


def test_rates_that_cannot_be_kept_only_warn(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cost._RATES.clear()
    with caplog.at_level("WARNING", logger="remat.cost"):
        rates = machine_rates("cpu", cache_path=blocker / "rates.json")  # (a folder that is a file)
    assert rates.op_overhead_us > 0 and "could not keep the machine rates" in caplog.text
    cost._RATES.clear()
