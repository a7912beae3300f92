"""The paper benchmarks: built-in paper workloads, the budget sweep (every method, resumable),
the maximum-batch search (exact on known answers, resumable), `remat bench` and the reports."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from remat.builders import chain_graph, unet_graph
from remat.cli import main
from remat.models import get_workload, names
from scripts import ROOT, load_script

BENCH = Path(__file__).resolve().parents[1] / "bench"
FAST = "checkpoint_all,chen_sqrtn,chen_greedy,griewank,lp_round,milp"


def _load(name: str):
    return load_script(f"bench/{name}.py", f"bench_{name}")


sweep_mod = _load("budget_sweep")
batch_mod = _load("max_batch")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quiet(_: str) -> None:
    pass


# ---------------------------------------------------------------------------- workloads
def test_paper_models_and_gpt2_sizes_are_built_in_workloads():
    expected = {"vgg16", "vgg19", "resnet50", "mobilenet", "vgg-unet", "fcn8", "segnet", "gpt2-small", "gpt2-medium"}
    assert expected <= set(names())
    assert {"mlp", "cnn", "gpt2-tiny"} <= set(names())
    assert list(names()) == sorted(names())


def test_paper_scale_workloads_build_on_meta_without_allocating():
    with torch.device("meta"):
        unet = get_workload("vgg-unet", 32)
        small = get_workload("gpt2-small", 8)
        medium = get_workload("gpt2-medium", 2)
    assert all(t.is_meta for t in [*unet.model.parameters(), *unet.batch])
    assert tuple(unet.batch[0].shape) == (32, 3, 416, 608) and tuple(unet.batch[1].shape) == (32, 208, 304)
    # GPT-2's published sizes with tied embeddings and 1024 positions: 124M and 355M parameters.
    assert sum(p.numel() for p in small.model.parameters()) == 124_439_808
    assert sum(p.numel() for p in medium.model.parameters()) == 354_823_168
    assert tuple(small.batch[0].shape) == (8, 512) and small.batch[0].is_meta
    assert small.model.training


def test_paper_workload_on_cpu_is_a_real_batch():
    w = get_workload("mobilenet", 2)
    images, labels = w.batch
    assert images.device.type == "cpu" and tuple(images.shape) == (2, 3, 224, 224)
    assert labels.dtype == torch.long and int(labels.max()) < 1000


def test_trace_on_meta_prices_a_paper_scale_step():
    traced = sweep_mod.trace_on_meta("vgg-unet", 32)
    g = traced.graph
    params = 12_330_835 * 4
    images = 32 * 3 * 416 * 608 * 4
    assert g.fixed_bytes >= params + images  # parameters, batch-norm buffers, images, labels
    assert g.total_cost > 0 and g.n > 100


# ---------------------------------------------------------------------------- budget sweep
GRAPHS = {"chain": lambda batch: chain_graph(5), "unet": lambda batch: unet_graph(2)}


class Counting:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _sweep(tmp_path, monkeypatch, fractions, trace=None):
    solver = Counting(sweep_mod.run_point)
    monkeypatch.setattr(sweep_mod, "run_point", solver)
    trace = trace or Counting(lambda model, batch: GRAPHS[model](batch))
    results = sweep_mod.run({"chain": 1, "unet": 1}, fractions, FAST.split(","), 5.0, tmp_path / "sweep.json",
                            trace_fn=trace, plots=tmp_path, log=quiet)
    return results, solver, trace


@pytest.fixture
def swept(tmp_path, monkeypatch):
    results, solver, trace = _sweep(tmp_path, monkeypatch, [1.0, 0.6])
    return tmp_path, results, solver, trace


def test_sweep_records_every_method_at_every_budget(swept):
    tmp_path, results, solver, trace = swept
    assert solver.calls == 2 * 2 * 6 and trace.calls == 2
    on_disk = json.loads((tmp_path / "sweep.json").read_text())
    assert on_disk["points"] == results["points"]
    cells = {(p["model"], p["fraction"], p["method"]): p for p in on_disk["points"]}
    assert len(cells) == 24
    for (model, fraction, method), p in cells.items():
        assert p["status"] in ("optimal", "feasible", "time_limit", "infeasible", "not applicable", "no plan")
        assert p["budget_bytes"] == int(fraction * on_disk["models"][f"{model}@1"]["checkpoint_all_peak_bytes"])
        if p.get("overhead") is not None:
            assert p["peak_bytes"] <= p["budget_bytes"] and p["overhead"] >= 1.0 - 1e-9
            assert p["n_nodes"] >= p["n_nodes_solved"] > 0
        if p["status"] == "infeasible":
            assert p["min_budget_bytes"] > p["budget_bytes"]
    assert cells[("chain", 1.0, "checkpoint_all")]["overhead"] == 1.0
    assert cells[("chain", 0.6, "griewank")].get("overhead") is not None  # a chain: revolve applies
    assert cells[("unet", 0.6, "griewank")]["status"] == "not applicable"
    assert cells[("chain", 0.6, "checkpoint_all")]["status"] == "infeasible"
    assert cells[("chain", 0.6, "milp")]["time_limit_s"] == 5.0
    assert (tmp_path / "sweep_chain.png").exists() and (tmp_path / "sweep_unet.png").exists()
    assert sweep_mod.check(on_disk)["violations"] == []


def test_sweep_resumes_without_recomputing(swept, monkeypatch):
    tmp_path, first, _, _ = swept
    # a rerun traces each model once (are the stored points of this graph?) and solves nothing
    again, solver, trace = _sweep(tmp_path, monkeypatch, [1.0, 0.6])
    assert solver.calls == 0 and trace.calls == 2
    assert again["points"] == first["points"]
    more, solver, trace = _sweep(tmp_path, monkeypatch, [1.0, 0.8, 0.6])
    assert solver.calls == 2 * 6 and trace.calls == 2  # only the new fraction
    assert len(more["points"]) == 36


def test_sweep_measures_again_what_another_graph_or_other_code_produced(swept, monkeypatch):
    tmp_path, first, _, _ = swept
    # the chain's trace changes (another graph): its points are measured again, the U-Net's kept
    changed = Counting(lambda model, batch: chain_graph(3) if model == "chain" else GRAPHS[model](batch))
    again, solver, _ = _sweep(tmp_path, monkeypatch, [1.0, 0.6], trace=changed)
    assert solver.calls == 2 * 6 and len(again["points"]) == 24
    chain_points = [p for p in again["points"] if p["model"] == "chain"]
    assert {p["fingerprint"] for p in chain_points} == {chain_graph(3).fingerprint()}
    assert all(p["n_nodes"] == chain_graph(3).n for p in chain_points)
    # other planning code: everything again
    monkeypatch.setattr(sweep_mod, "planner_version", lambda: "another")
    again, solver, _ = _sweep(tmp_path, monkeypatch, [1.0, 0.6], trace=changed)
    assert solver.calls == 24 and {p["planner"] for p in again["points"]} == {"another"}


def test_sweep_passes_time_limit_and_extra_options_per_method(tmp_path, monkeypatch):
    seen = []

    def fake_point(graph, info, method, fraction, options):
        seen.append((method, dict(options)))
        return {"model": info["model"], "batch": info["batch"], "method": method, "fraction": fraction,
                "budget_bytes": 1, "status": "no plan", "note": "fake"}

    monkeypatch.setattr(sweep_mod, "run_point", fake_point)
    sweep_mod.run({"chain": 1}, [1.0], ["chen_sqrtn", "milp", "lp_round"], 7.0, tmp_path / "s.json",
                  options={"milp": {"max_nodes": 50}}, trace_fn=lambda m, b: chain_graph(3), log=quiet)
    assert dict(seen) == {"chen_sqrtn": {}, "milp": {"time_limit_s": 7.0, "max_nodes": 50},
                          "lp_round": {"time_limit_s": 7.0}}


def test_sweep_markdown_has_a_table_per_model_plot_links_times_and_the_check(swept):
    _, results, _, _ = swept
    text = sweep_mod.markdown(results)
    assert "### chain, batch 1" in text and "### unet, batch 1" in text
    assert "| budget | GiB | checkpoint_all | chen_sqrtn | chen_greedy | griewank | lp_round | milp |" in text
    assert "| 100% |" in text and "| 60% |" in text and "n/a" in text and "infeasible (needs" in text
    assert "sweep_chain.png)" in text and "Solve time" in text
    assert "CostModel.ESTIMATE" in text and "cannot be profiled" in text
    assert "**Check:** milp is never worse than any baseline" in text


def test_sweep_check_flags_a_milp_worse_than_a_baseline():
    def pt(method, overhead, status="optimal", gap=None):
        return {"model": "m", "batch": 1, "method": method, "fraction": 0.5, "overhead": overhead,
                "status": status, "gap": gap}

    worse = {"points": [pt("chen_greedy", 1.10), pt("milp", 1.20, "time_limit", 0.3)]}
    verdict = sweep_mod.check(worse)
    assert verdict["compared"] == 1 and len(verdict["violations"]) == 1
    assert verdict["timed_out"] == [("m", 1, 0.5, 0.3)]
    fine = {"points": [pt("chen_greedy", 1.10), pt("milp", 1.10)]}
    assert sweep_mod.check(fine)["violations"] == []
    missing = {"points": [pt("chen_greedy", 1.10), {**pt("milp", None, "infeasible")}]}
    assert len(sweep_mod.check(missing)["violations"]) == 1
    text = sweep_mod.markdown({"meta": {"time_limit_s": 1}, "models": {}, "points": worse["points"]})
    assert "milp is worse than a baseline" in text and "gap" in text
    # a plan returned before the limit, above its bound: counted with its gap, not as a fallback
    early = {"points": [pt("chen_greedy", 1.10), pt("milp", 1.05, "feasible", 0.0123)]}
    verdict = sweep_mod.check(early)
    assert verdict["short"] == [("m", 1, 0.5, 0.0123)] and verdict["timed_out"] == []
    text = sweep_mod.markdown({"meta": {"time_limit_s": 1}, "models": {}, "points": early["points"]})
    assert "At 1 budget(s) milp returned a plan above its lower bound before the time limit" in text
    assert "m 50%: 1.23%" in text and "grouped MILP" not in text


def test_sweep_models_take_a_batch_each_as_the_help_shows_them():
    assert sweep_mod.select_models("mlp:4,cnn", {"cnn": 8}, None) == {"mlp": 4, "cnn": 8}
    assert sweep_mod.select_models("mlp:4,cnn", {"cnn": 8}, 2) == {"mlp": 4, "cnn": 2}
    assert sweep_mod.select_models(None, {"cnn": 8}, None) == {"cnn": 8}


@pytest.mark.parametrize("text, want", [("1.0,0.6", [1.0, 0.6]), ("100%, 50%", [1.0, 0.5])])
def test_sweep_budget_parsing(text, want):
    assert sweep_mod.parse_fractions(text) == want


@pytest.mark.parametrize("text, message", [("0", "must be positive"), ("x", "not understood"), (",", "no budget"),
                                           ("150%", "percentage in (0%, 100%]"), ("1", "is a size in bytes")])
def test_sweep_budget_parsing_errors(text, message):
    with pytest.raises(ValueError, match=re_escape(message)):
        sweep_mod.parse_fractions(text)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ---------------------------------------------------------------------------- max-batch search
@pytest.mark.parametrize("start", [1, 5, 64, 1000])
@pytest.mark.parametrize("answer", [1, 2, 3, 37, 64, 100, 255])
def test_search_finds_the_exact_largest_batch(answer, start):
    asked = []

    def fits(b):
        asked.append(b)
        return b <= answer

    found = batch_mod.largest_fitting(fits, start=start, high=256)
    assert found.max_batch == answer and not found.capped
    assert len(asked) == len(set(asked)) == len(found.evaluations)  # each batch asked once
    assert len(asked) <= 2 * math.ceil(math.log2(256)) + 2
    assert all(ok == (b <= answer) for b, ok in found.evaluations)


def test_search_limits():
    nothing = batch_mod.largest_fitting(lambda b: False, start=16, high=256)
    assert nothing.max_batch == 0 and not nothing.capped and nothing.evaluations[-1] == (1, False)
    everything = batch_mod.largest_fitting(lambda b: True, start=3, high=100)
    assert everything.max_batch == 100 and everything.capped
    assert [b for b, _ in everything.evaluations] == [3, 6, 12, 24, 48, 96, 100]
    assert batch_mod.largest_fitting(lambda b: b <= 7, start=10, low=5, high=8).max_batch == 7
    assert batch_mod.largest_fitting(lambda b: b <= 4, start=10, low=5, high=8).max_batch == 4  # low - 1: none
    with pytest.raises(ValueError, match="low <= high"):
        batch_mod.largest_fitting(lambda b: True, low=9, high=8)


def _scaled_chain(model: str, batch: int):
    # Activations grow with the batch, a fixed part does not: like a real step.
    return chain_graph(6, bytes_per_node=1000 * batch, fixed_bytes=5000)


def test_max_batch_run_matches_brute_force_and_resumes(tmp_path):
    memory = 100_000
    methods = ["checkpoint_all", "chen_sqrtn", "griewank", "milp"]
    graphs = batch_mod.Graphs(Counting(_scaled_chain))
    out = tmp_path / "mb.json"
    results = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory, max_batch=64, graphs=graphs,
                            pin_rates=False, log=quiet)
    for method in methods:
        brute = [b for b in range(1, 65)
                 if batch_mod.evaluate(_scaled_chain("chain", b), method, memory, {"time_limit_s": 5.0}
                                       if method == "milp" else {})["fits"]]
        want = max(brute, default=0)
        assert brute == list(range(1, want + 1)), method  # the predicate is monotone here
        entry = results["runs"][f"chain/{method}"]
        assert entry["status"] == "done" and entry["max_batch"] == want, method
        assert entry["n_solves"] == len(entry["evaluations"]) > 0
        assert entry["at_max"]["batch"] == want and entry["at_max"]["peak_bytes"] <= memory
    ckpt = results["runs"]["chain/checkpoint_all"]["max_batch"]
    assert results["runs"]["chain/milp"]["max_batch"] >= ckpt >= 1
    assert json.loads(out.read_text())["runs"] == results["runs"]
    # A rerun solves nothing; an unfinished entry reuses the evaluations it has.
    tracer = Counting(_scaled_chain)
    again = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory, max_batch=64,
                          graphs=batch_mod.Graphs(tracer), pin_rates=False, log=quiet)
    assert tracer.calls == 0 and again["runs"] == results["runs"]
    data = json.loads(out.read_text())
    del data["runs"]["chain/chen_sqrtn"]["status"]
    out.write_text(json.dumps(data))
    tracer = Counting(_scaled_chain)
    resumed = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory, max_batch=64,
                            graphs=batch_mod.Graphs(tracer), pin_rates=False, log=quiet)
    assert tracer.calls == 0  # the search retraces its steps through the stored evaluations
    assert resumed["runs"]["chain/chen_sqrtn"] == results["runs"]["chain/chen_sqrtn"]
    # Half an unfinished search: only the batches it had not tried are solved.
    data = json.loads(out.read_text())
    entry = data["runs"]["chain/milp"]
    del entry["status"]
    kept = entry["evaluations"][: len(entry["evaluations"]) // 2]
    entry["evaluations"] = kept
    out.write_text(json.dumps(data))
    tracer = Counting(_scaled_chain)
    resumed = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory, max_batch=64,
                            graphs=batch_mod.Graphs(tracer), pin_rates=False, log=quiet)
    redone = resumed["runs"]["chain/milp"]
    assert redone["max_batch"] == results["runs"]["chain/milp"]["max_batch"]
    assert tracer.calls == len(redone["evaluations"]) - len(kept) > 0
    assert [e["batch"] for e in redone["evaluations"]] == [e["batch"] for e in results["runs"]["chain/milp"]["evaluations"]]


def test_max_batch_searches_again_what_other_code_or_options_found(tmp_path, monkeypatch):
    memory, methods = 100_000, ["checkpoint_all", "chen_sqrtn"]
    out = tmp_path / "mb.json"
    first = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory, max_batch=64,
                          graphs=batch_mod.Graphs(_scaled_chain), pin_rates=False, log=quiet)
    assert all(e["planner"] == batch_mod.planner_version() for e in first["runs"].values())
    # another memory size: searched again
    tracer = Counting(_scaled_chain)
    again = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory // 2, max_batch=64,
                          graphs=batch_mod.Graphs(tracer), pin_rates=False, log=quiet)
    assert tracer.calls > 0 and all(e["memory_bytes"] == memory // 2 for e in again["runs"].values())
    # other planning code: searched again, every evaluation made by this code
    monkeypatch.setattr(batch_mod, "planner_version", lambda: "another")
    tracer = Counting(_scaled_chain)
    again = batch_mod.run(["chain"], methods, 5.0, out, memory_bytes=memory // 2, max_batch=64,
                          graphs=batch_mod.Graphs(tracer), pin_rates=False, log=quiet)
    assert tracer.calls > 0 and {e["planner"] for e in again["runs"].values()} == {"another"}
    assert all(ev["fingerprint"] for e in again["runs"].values() for ev in e["evaluations"])


def test_max_batch_not_applicable_and_cost_limit(tmp_path):
    results = batch_mod.run(["unet"], ["griewank"], 5.0, tmp_path / "mb.json", memory_bytes=10**12, max_batch=8,
                            graphs=batch_mod.Graphs(lambda m, b: unet_graph(2)), pin_rates=False, log=quiet)
    assert results["runs"]["unet/griewank"]["status"] == "not applicable"
    g = chain_graph(4)
    assert batch_mod.cost_limit(g) == g.total_cost + 4  # every forward node (cost 1) once more
    record = batch_mod.evaluate(g, "checkpoint_all", 10**12, {})
    assert record["fits"] and record["overhead"] == 1.0 and record["limit_overhead"] == pytest.approx(13 / 9)


def test_max_batch_markdown_sets_ours_beside_the_paper():
    runs = {
        "vgg19/checkpoint_all": {"model": "vgg19", "method": "checkpoint_all", "status": "done", "max_batch": 150,
                                 "published": {"value": 167, "at_least": False}, "n_solves": 12,
                                 "solve_s_total": 0.5, "trace_s_total": 20.0,
                                 "at_max": {"n_nodes": 238, "n_nodes_solved": 147, "solver_status": "optimal"}},
        "fcn8/milp": {"model": "fcn8", "method": "milp", "status": "done", "max_batch": 70, "capped": False,
                      "published": {"value": 60, "at_least": True}, "n_solves": 9, "solve_s_total": 300.0,
                      "trace_s_total": 9.0, "at_max": {"n_nodes": 300, "n_nodes_solved": 120,
                                                       "solver_status": "time_limit", "gap": 0.05}},
        "fcn8/griewank": {"model": "fcn8", "method": "griewank", "status": "not applicable", "max_batch": None,
                          "published": None, "n_solves": 1, "solve_s_total": 0.0, "trace_s_total": 1.0,
                          "at_max": None},
    }
    text = batch_mod.markdown({"meta": {"time_limit_s": 60, "memory_bytes": batch_mod.MEMORY_BYTES}, "runs": runs})
    assert "## Maximum batch size in 16 GB" in text
    assert "| vgg19 | 150 (paper 167) |" in text
    assert "70 (paper ≥ 60)" in text and "n/a" in text
    assert "time_limit (gap 5.0%)" in text
    assert "Keras layer-level" in text and "torch.fx" in text


def test_published_numbers_are_the_papers():
    assert batch_mod.PUBLISHED["vgg19"] == {"checkpoint_all": (167, False), "chen_sqrtn": (197, False),
                                             "chen_greedy": (266, False), "milp": (289, False)}
    assert {m: v["milp"] for m, v in batch_mod.PUBLISHED.items()} == {
        "vgg19": (289, False), "vgg-unet": (57, False), "fcn8": (60, True), "segnet": (62, True),
        "resnet50": (193, True), "mobilenet": (1105, True)}
    assert batch_mod.MEMORY_BYTES == 16 * 10**9


# ---------------------------------------------------------------------------- remat bench
def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench"], "say which benchmark to run"),
        (["bench", "nope"], "invalid choice: 'nope'"),
        (["bench", "sweep", "--models", "nosuch"], "unknown model 'nosuch'"),
        (["bench", "sweep", "--models", "mlp"], "no default batch size here; give it as mlp:BATCH or give --batch"),
        (["bench", "sweep", "--models", "mlp:0"], "'mlp:0': the batch size after ':' must be a positive integer"),
        (["bench", "sweep", "--budgets", "0"], "budget '0' must be positive"),
        (["bench", "sweep", "--methods", "magic"], "unknown method 'magic'"),
        (["bench", "sweep", "--options", "{bad"], "--options is not JSON"),
        (["bench", "sweep", "--time-limit", "0"], "argument --time-limit: time limit 0 s must be a positive"),
        (["bench", "max-batch", "--memory", "60%"], "percentage"),
        (["bench", "max-batch", "--models", "vgg19,resnet9000"], "unknown model 'resnet9000'"),
        (["bench", "max-batch", "--max-batch", "0"], "--max-batch 0 must be at least 1"),
    ],
)
def test_bench_usage_errors_exit_2_with_a_clear_message(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    if len(argv) > 1 and argv[1] in ("sweep", "max-batch"):
        assert f"remat bench {argv[1]}: error" in err


def test_bench_help_exits_0(capsys):
    code, out, _ = run_cli(capsys, "bench", "max-batch", "--help")
    assert code == 0 and "--memory" in out


def test_bench_outside_a_source_checkout_says_so(capsys, monkeypatch, tmp_path):
    import remat.cli as cli

    monkeypatch.setattr(cli, "_bench_dir", lambda: tmp_path)
    monkeypatch.delitem(sys.modules, "bench_budget_sweep", raising=False)
    code, _, err = run_cli(capsys, "bench", "sweep")
    assert code == 2 and "source checkout" in err


def test_bench_sweep_runs_the_script_then_the_report(capsys, monkeypatch, tmp_path):
    import remat.cli as cli

    reports = Counting(lambda: None)
    monkeypatch.setattr(cli, "_regenerate_report", reports)
    out = tmp_path / "s.json"
    argv = ["bench", "sweep", "--models", "mlp", "--batch", "2", "--budgets", "1.0",
            "--methods", "checkpoint_all,chen_sqrtn", "--out", str(out)]
    code, stdout, _ = run_cli(capsys, *argv)
    assert code == 0 and reports.calls == 1
    assert {p["method"] for p in json.loads(out.read_text())["points"]} == {"checkpoint_all", "chen_sqrtn"}
    assert "### mlp, batch 2" in stdout
    code, _, _ = run_cli(capsys, *argv, "--no-report")
    assert code == 0 and reports.calls == 1


def test_report_lists_the_new_sections():
    report = _load("report")
    assert "budget_sweep" in report.SECTIONS and "max_batch" in report.SECTIONS


def test_bench_reports_a_failed_report_after_writing_results(capsys, monkeypatch, tmp_path):
    import remat.cli as cli

    def broken():
        raise TypeError("a section's JSON is half written")

    monkeypatch.setattr(cli, "_regenerate_report", broken)
    out = tmp_path / "s.json"
    code, _, err = run_cli(capsys, "bench", "sweep", "--models", "mlp", "--batch", "2", "--budgets", "1.0",
                           "--methods", "checkpoint_all", "--out", str(out))
    assert code == 1 and out.exists()
    assert "BENCHMARKS.md could not be regenerated" in err and "half written" in err


# ---------------------------------------------------------------------------- spot checks
spot_mod = _load("spot_checks")


def test_spot_checks_render_and_flag_a_miss():
    run = {"budget_bytes": 80, "status": "optimal", "predicted_peak_bytes": 100 * 2**20, "measured_peak_bytes": 101 * 2**20,
           "peak_error": 0.01, "overhead": 1.05, "bitwise_equal": True, "note": ""}
    results = {"meta": {}, "models": {"vgg16@2": {"checkpoint_all_peak_bytes": 100, "runs": [run]}}}
    text = spot_mod.markdown(results)
    assert "| vgg16@2 | 80% | optimal | 100.0 | 101.0 | +1.000% | 1.050x | yes |" in text
    assert "within the 2% bar" in text and "in every run" in text
    bad = {**run, "measured_peak_bytes": 110 * 2**20, "peak_error": 0.1, "bitwise_equal": False}
    text = spot_mod.markdown({"meta": {}, "models": {"vgg16@2": {"checkpoint_all_peak_bytes": 100, "runs": [bad]}}})
    assert "OVER the 2% bar" in text and "NOT every run" in text and "| NO |" in text


def test_spot_checks_name_unknown_models(capsys):
    with pytest.raises(SystemExit):
        spot_mod.main(["--models", "vgg17"])
    assert "unknown model(s) vgg17; choose from vgg16" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the planner at scale
scaling_mod = _load("solver_scaling")


def _small_traced(workload: str):
    from remat.cost import CostModel
    from remat.trace import trace

    w = get_workload("cnn", 4)
    return trace(w.model, w.batch, w.loss_fn, cost_model=CostModel.ESTIMATE, name=workload)


def test_scaling_records_every_level_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling_mod, "trace_workload", _small_traced)
    out = tmp_path / "scaling.json"
    results = scaling_mod.run(["gpt2-2L"], 20.0, out, fresh=False)
    record = json.loads(out.read_text())["workloads"]["gpt2-2L"]
    assert [c["level"] for c in record["cells"]] == list(scaling_mod.LEVELS)
    smallest = next(c for c in record["cells"] if c["level"] == "min")
    near = record["cells"][-1]
    assert near["level"] == "min+5%" and near["budget_bytes"] == int(scaling_mod.NEAR_FLOOR * smallest["budget_bytes"])
    assert "error" not in smallest and not smallest.get("infeasible"), smallest
    for cell in record["cells"]:
        assert "error" not in cell, cell
        if cell.get("infeasible"):  # below the smallest budget, which the last level plans
            assert cell["min_budget_bytes"] == smallest["budget_bytes"] > cell["budget_bytes"]
            continue
        assert cell["peak_bytes"] <= cell["budget_bytes"]
        assert 1.0 <= cell["bound"] <= cell["overhead"] + 1e-9
        assert cell["baseline_overhead"] is None or cell["overhead"] <= cell["baseline_overhead"] + 1e-9
    text = scaling_mod.markdown(results)
    assert "| gpt2-2L |" in text and "Goals:" in text and "Never worse than the best baseline: met" in text
    assert all(c.get("infeasible") is None or "infeasible (needs" in text for c in record["cells"])
    # a rerun with the same code and options measures nothing again
    monkeypatch.setattr(scaling_mod, "measure", lambda *a: pytest.fail("a stored workload was measured again"))
    scaling_mod.run(["gpt2-2L"], 20.0, out, fresh=False)


def test_scaling_checks_name_every_goal_missed():
    cell = {"level": "80%", "budget_bytes": 10, "fraction": 0.8, "status": "feasible", "overhead": 1.2,
            "bound": 1.1, "gap": 1 - 1.1 / 1.2, "peak_bytes": 9, "wall_s": 75.0, "baseline": "segments",
            "baseline_overhead": 1.15}
    further = dict(cell, level="60%", wall_s=9.0, gap=0.01, overhead=1.1, bound=1.089, baseline_overhead=None)
    smallest = dict(further, level="min", wall_s=70.0)
    near = dict(further, level="min+5%", wall_s=40.0)
    results = {"workloads": {"resnet50": {"cells": [cell, further, smallest, near]}}}
    lines = "\n".join(scaling_mod.checks(results))
    assert "not met** at resnet50 80% (8.3%)" in lines
    assert "Never worse than the best baseline: **not met** at resnet50 80%" in lines
    assert "First budget within 60 s, tracing included: **not met** for resnet50 (75 s)" in lines
    assert "Each further budget within 5 s: **not met** at resnet50 60% (9.00 s) of 80/60/40%." in lines
    # the smallest budget's cell (its search included) is stated, not counted against that goal
    assert "min (70.0 s)" not in lines and "Their wall times: resnet50 70.0 s." in lines
    assert "min+5% (40.00 s)" not in lines and "in the same way: resnet50 40.0 s." in lines


def test_scaling_cli_refuses_unknown_workloads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        scaling_mod.main(["--workloads", "gpt2-3L"])
    assert exit_info.value.code == 2 and "unknown workload gpt2-3L" in capsys.readouterr().err


def test_the_report_answers_help_without_writing(capsys, monkeypatch, tmp_path):
    """``python bench/report.py --help`` rewrote BENCHMARKS.md instead of printing its usage."""
    report = _load("report")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    with pytest.raises(SystemExit) as done:
        report.main(["--help"])
    assert done.value.code == 0 and "usage: report.py" in capsys.readouterr().out.replace("\n", " ")
    assert not (tmp_path / "BENCHMARKS.md").exists()
    with pytest.raises(SystemExit) as done:
        report.main(["--nope"])
    assert done.value.code == 2 and not (tmp_path / "BENCHMARKS.md").exists()


# ---------------------------------------------------------------------------- bench/step_overhead.py
def test_step_overhead_refuses_bad_usage_in_one_line(capsys):
    overhead = _load("step_overhead")
    for argv, message in ((["--models", "resnet9000"], "unknown model(s) resnet9000"),
                          (["--models", ","], "unknown model(s) (none given)"),
                          (["--rounds", "1"], "--rounds must be at least 3")):
        with pytest.raises(SystemExit) as done:
            overhead.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and message in err[-1], (argv, err)


def test_step_overhead_measures_every_variant_against_eager_and_renders_them(monkeypatch, tmp_path):
    overhead = _load("step_overhead")
    monkeypatch.setattr(overhead, "PLOT", tmp_path / "plot.png")
    row = overhead.measure("gpt2-tiny", rounds=3)
    assert set(row["plans"]) == set(overhead.BUDGETS)
    assert set(row["variants"]) == {f"{v} {b}" for v in overhead.VARIANTS for b in overhead.BUDGETS}
    for budget, plan in row["plans"].items():
        assert plan["instructions"] >= plan["nodes"] and (plan["recomputed_nodes"] > 0) == (budget != "100%")
        for variant in overhead.VARIANTS:
            v = row["variants"][f"{variant} {budget}"]
            assert v["ms"] > 0 and v["vs_eager"] == pytest.approx(v["ms"] / row["eager_ms"], rel=1e-2)
    results = {"meta": {"threads": 1, "rounds": 3, "measured": "today"}, "models": [row]}
    text = overhead.markdown(results)
    assert text.count("| gpt2-tiny |") == len(overhead.BUDGETS) and "step_overhead.png" in text
    overhead.plot(results)
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_step_overhead_run_of_one_model_keeps_the_others_rows_with_their_run(monkeypatch, tmp_path, capsys):
    """``--models gpt2-tiny`` replaced the whole file: residual-cnn's stored row was lost."""
    import remat.sweep

    overhead = _load("step_overhead")
    stored = json.loads((ROOT / "bench" / "results" / "step_overhead.json").read_text())  # (rows name no run)
    by_model = {row["model"]: row for row in stored["models"]}
    assert set(by_model) == set(overhead.MODELS)
    out = tmp_path / "step_overhead.json"
    # (stored out of MODELS' order; the run's rows go back in it)
    out.write_text(json.dumps({"meta": stored["meta"], "models": stored["models"][::-1]}))
    monkeypatch.setattr(overhead, "RESULTS", out)
    monkeypatch.setattr(overhead, "PLOT", tmp_path / "plot.png")
    monkeypatch.setattr(remat.sweep, "environment", lambda: {"torch": "now"})
    measured = []
    monkeypatch.setattr(overhead, "measure",
                        lambda name, rounds: measured.append(name) or {**by_model[name], "eager_ms": 123.0})
    assert overhead.main(["--models", "gpt2-tiny", "--rounds", "3"]) == 0
    assert measured == ["gpt2-tiny"]
    results = json.loads(out.read_text())
    assert [row["model"] for row in results["models"]] == list(overhead.MODELS)
    cnn, gpt2 = (next(r for r in results["models"] if r["model"] == m) for m in ("residual-cnn", "gpt2-tiny"))
    assert {k: v for k, v in cnn.items() if k != "run"} == by_model["residual-cnn"]
    assert cnn["run"] == stored["meta"]  # (measured by the run that wrote the file, not by this one)
    assert gpt2["eager_ms"] == 123.0 and gpt2["run"]["rounds"] == 3 and gpt2["run"]["environment"] == {"torch": "now"}
    assert gpt2["run"]["command"] == "python bench/step_overhead.py --models gpt2-tiny --rounds 3"
    # the file's meta: only what both runs share (here: the thread count)
    assert results["meta"] == {"threads": 1}
    text = overhead.markdown(results)
    assert "`python bench/step_overhead.py` for `residual-cnn` (CPU, 1 thread, median of 40 interleaved rounds" in text
    assert "`python bench/step_overhead.py --models gpt2-tiny --rounds 3` for `gpt2-tiny` (CPU, 1 thread, median of 3 " in text
    assert text.count("| residual-cnn |") == text.count("| gpt2-tiny |") == len(overhead.BUDGETS)
    assert "| 123.00 |" in text
    # a run of every model again: one run, the whole meta
    assert overhead.main(["--rounds", "3"]) == 0
    results = json.loads(out.read_text())
    assert measured == ["gpt2-tiny", "residual-cnn", "gpt2-tiny"]
    assert results["meta"] == results["models"][0]["run"] == results["models"][1]["run"]
    assert overhead.markdown(results).count("Command: `python bench/step_overhead.py --rounds 3`; CPU, 1 thread") == 1
    capsys.readouterr()


# ---------------------------------------------------------------------------- bench/busy_cpu.py
def test_busy_cpu_refuses_bad_usage_in_one_line(capsys):
    busy = _load("busy_cpu")
    for argv, message in ((["--models", "resnet9000"], "unknown model(s) resnet9000"),
                          (["--models", ","], "unknown model(s) (none given)"),
                          (["--threads", "1"], "--threads at least 2 (one thread cannot stall)"),
                          (["--rounds", "0"], "argument --rounds: 0 must be at least 1"),
                          (["--busy", "0"], "argument --busy: 0 must be at least 1"),
                          (["--budgets", "0.5,1.5"], "--budgets '0.5,1.5': budget '1.5'"),
                          (["--budgets", "half"], "--budgets 'half': budget 'half' is not understood")):
        with pytest.raises(SystemExit) as done:
            busy.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and message in err[-1], (argv, err)


def test_busy_cpu_rank_correlation_and_load():
    busy = _load("busy_cpu")
    assert busy.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert busy.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert busy.spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)  # ties share their rank
    with busy.Load(2) as load:
        assert all(p.poll() is None for p in load.procs)
    assert all(p.returncode is not None for p in load.procs)


def test_busy_cpu_prices_every_profiles_plan_with_the_quiet_costs():
    busy = _load("busy_cpu")
    row = busy.measure("gpt2-tiny", 2, rounds=1, busy=1, threads=2, fractions=[0.9, 0.05], time_limit_s=2.0)
    assert set(row["profiles"]) == set(busy.CONDITIONS)
    quiet = row["profiles"]["quiet"]
    # one quiet round is the reference itself
    assert quiet[0]["total_vs_quiet"] == pytest.approx(1.0) and quiet[0]["rank_correlation"] == pytest.approx(1.0)
    assert not row["profiles"]["busy, unchecked"][0]["warned"]  # (the check off: it cannot warn)
    high, floor = row["budgets"]
    assert high["budget_fraction"] == pytest.approx(0.9, abs=1e-6)
    assert floor["budget_fraction"] > 0.05  # infeasible: 10% above the smallest budget instead
    for point in (high, floor):
        assert set(point["conditions"]) == set(busy.CONDITIONS)
        c = point["conditions"]["quiet"]  # its plan is priced with its own costs
        assert c["overhead_quiet"] == pytest.approx(c["overhead_own"]) and c["overhead_quiet"][0] >= 1.0
        for c in point["conditions"].values():
            assert len(c["overhead_quiet"]) == 1 and c["overhead_quiet"][0] >= 1.0
    text = busy.markdown({"meta": {"rounds": 1, "busy": 1, "threads": 2, "cpus": 2}, "models": [row]})
    assert text.count("| gpt2-tiny (") == len(busy.CONDITIONS) and text.count("| gpt2-tiny |") == 2 * len(busy.CONDITIONS)


# ---------------------------------------------------------------------------- bench/floor_anatomy.py
def test_floor_anatomy_refuses_bad_usage_in_one_line(capsys, monkeypatch, tmp_path):
    anatomy = _load("floor_anatomy")
    scaling = tmp_path / "solver_scaling.json"
    scaling.write_text(json.dumps({"workloads": {"gpt2-2L": {}}}))
    monkeypatch.setattr(anatomy, "SCALING", scaling)
    for argv, message in ((["--workload", "resnet50"], "reads GPT-2 traces only"),
                          (["--workload", "gpt2-4L"], "gpt2-4L is not in solver_scaling.json"),
                          (["--nope"], "unrecognized arguments")):
        with pytest.raises(SystemExit) as done:
            anatomy.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and message in err[-1], (argv, err)
    monkeypatch.setattr(anatomy, "SCALING", tmp_path / "missing.json")
    with pytest.raises(SystemExit) as done:
        anatomy.main([])
    assert done.value.code == 2 and "run bench/solver_scaling.py first" in capsys.readouterr().err


def test_floor_anatomy_prices_the_plan_its_program_describes(monkeypatch, tmp_path):
    """On the 2-layer GPT-2 at its smallest budget the bound's program, solved exactly, describes
    a plan that fits and costs the program's optimum (within 0.01%): that plan is optimal, and
    the program's value is below the planner's plan."""
    from remat.coarsen import fold_aliases
    from remat.planning import plan_graph
    from remat.solvers.bounds import InstantBounds

    anatomy = _load("floor_anatomy")
    folded = fold_aliases(scaling_mod.trace_workload("gpt2-2L").graph).coarse
    budget = InstantBounds(folded).min_budget_bytes  # (below it no plan fits; here a plan does)
    plan = plan_graph(folded, budget, method="milp", time_limit_s=20.0).result
    record = {"cells": [{"level": "min", "budget_bytes": budget, "overhead": plan.cost / folded.total_cost,
                         "bound": plan.lower_bound / folded.total_cost}]}
    scaling = tmp_path / "solver_scaling.json"
    scaling.write_text(json.dumps({"workloads": {"gpt2-2L": record}}))
    monkeypatch.setattr(anatomy, "SCALING", scaling)
    out = tmp_path / "anatomy.json"
    assert anatomy.main(["--workload", "gpt2-2L", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    program, described = result["program"], result["described"]
    assert program["solved"] and described["ok"]
    assert described["peak_mib"] <= described["budget_mib"] + 1e-9
    assert program["overhead"] - 1e-9 <= described["overhead"] <= program["overhead"] * (1 + 1e-4)
    assert program["overhead"] <= result["plan"] + 1e-9  # the program bounds every plan, the planner's too
    assert "It fits, within 0.01% of the program's optimum, which no plan beats." in anatomy.markdown(result)


def test_floor_anatomy_markdown_names_what_does_not_fit():
    anatomy = _load("floor_anatomy")
    result = {"workload": "gpt2-48L", "budget_bytes": 100 * 2**20, "plan": 1.84, "bound": 1.69,
              "program": {"first": "loss_grad", "deadline": "head_grad", "overhead": 1.6888, "solved": True, "s": 4.7,
                          "held_mib": 99.0, "room_mib": 99.5, "held_kinds": {"add": 45, "clone_default": 45}},
              "described": {"ok": True, "overhead": 1.6891, "peak_mib": 140.0, "budget_mib": 100.0,
                            "restart_peak_mib": 130.0, "windows_over_mib": [2.0, -1.0, 40.0],
                            "window_layers": [2, 1, 0]},
              "fitted": {"ok": True, "overhead": 1.87, "peak_mib": 130.0, "window_extra": [0.002, 0.0, 0.007],
                         "windows_not_fitted": [0]}}
    text = anatomy.markdown(result)
    assert "45 `add`, 45 `clone_default`" in text
    assert "+30.0 MiB while the forward pass runs again, and 2 of 3 layers' backward windows" in text
    assert "by up to 40.0 MiB (layer 0," in text and "1 windows still over (layers 0)" in text
