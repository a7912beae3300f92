"""bench/vs_pytorch.py keeps its results per variant: a run measures only what it selects and
what is not stored yet, and leaves every other stored entry as it was. No timing runs here:
variants are stand-ins on a tiny model, or entries written by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from remat.sweep import ResultStore
from scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def vs():
    return load_script("bench/vs_pytorch.py", "bench_vs_pytorch")


def args_for(vs, *argv):
    args = vs.build_parser().parse_args(list(argv))
    args.variants = None if args.variants is None else set(args.variants.split(","))
    args.rounds = 1
    return args


def tiny_workload(vs, label="tiny"):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    return vs.Workload(label, {"width": 8, "batch": 4}, model, batch,
                       lambda m, x, y: torch.nn.functional.mse_loss(m(x), y), [])


def fake_result(v, **extra):
    return {"name": v.name, "family": v.family, "setting": v.setting, "peak_bytes": 1000, "step_s": 1.0,
            "grad_max_abs_diff": 0.0, "measured": "2026-01-01 00:00", "command": "old run", **extra}


@pytest.fixture
def stored(vs, tmp_path):
    """A results file with every variant of 'tiny' measured, one of another model, and one of
    an older remat version."""
    args = args_for(vs)
    w = tiny_workload(vs)
    store = ResultStore(tmp_path / "vs.json")
    for v in vs.variants(args, w):
        store.put(vs.variant_key(w, v, args), fake_result(v))
    for v in vs.at_competitor_peaks(store, w, args):
        store.put(vs.variant_key(w, v, args), fake_result(v))
    other = vs.Workload("other", {"width": 1}, None, (), None, [])
    eager = vs.Variant("eager", "eager")
    store.put(vs.variant_key(other, eager, args), fake_result(eager, command="other model"))
    old = {**vs.variant_key(w, eager, args), "code_version": "0.0.1"}
    store.put(old, fake_result(eager, command="older remat"))
    return store.path, w


def entries(path: Path) -> dict[str, dict]:
    return {json.dumps(e["key"], sort_keys=True): e["result"] for e in json.loads(path.read_text())["results"]}


def test_nothing_stored_is_measured_again(vs, stored, capsys):
    path, w = stored
    args = args_for(vs)
    store = ResultStore(path)
    assert vs.pending(store, w, vs.variants(args, w), args) == []
    before = path.read_text()
    vs.measure_model(w, args, store, {"started": "now", "command": "this run"})
    assert "nothing to measure: every selected variant is stored (--fresh measures them again)" in capsys.readouterr().out
    assert path.read_text() == before
    # another thread count, method or time limit is another key: measured
    assert len(vs.pending(store, w, vs.variants(args, w), args_for(vs, "--threads", "2"))) == len(vs.variants(args, w))
    remat_only = vs.pending(store, w, vs.variants(args, w), args_for(vs, "--time-limit-s", "30"))
    assert remat_only and all(v.family == "remat" for v in remat_only)


def test_selection_fresh_and_unfinished_entries(vs, stored):
    path, w = stored
    store = ResultStore(path)
    args = args_for(vs, "--variants", "aot,eager", "--fresh")
    assert [v.name for v in vs.pending(store, w, vs.variants(args, w), args)] == [
        "eager", "aot_eager budget 1", "aot_eager budget 0.5", "aot_eager budget 0.1"]
    args = args_for(vs, "--variants", "checkpoint every block")
    v = next(v for v in vs.variants(args, w) if v.name == "checkpoint every block")
    unfinished = {k: x for k, x in fake_result(v).items() if k != "step_s"}  # interrupted before timing
    store.put(vs.variant_key(w, v, args), unfinished)
    assert [p.name for p in vs.pending(store, w, vs.variants(args, w), args)] == ["checkpoint every block"]


def test_a_run_of_some_variants_leaves_every_other_entry_untouched(vs, stored, monkeypatch):
    path, w = stored
    before = entries(path)
    args = args_for(vs, "--variants", "checkpoint,eager", "--fresh")

    def stand_in(v, w, model, args):  # every variant runs the plain step: no compiling, no solving
        return lambda *b: w.loss_fn(model, *b)

    monkeypatch.setattr(vs, "prepare", stand_in)
    monkeypatch.setattr(vs, "_partition_facts", lambda v: None)
    vs.measure_model(w, args, ResultStore(path), {"started": "2026-02-02 02:02", "command": "this run"})
    after = entries(path)
    changed = {k for k in after if after[k] != before.get(k)}
    names = {after[k]["name"] for k in changed}
    # the selected variants, and remat at the re-measured competitors' new peaks (new budgets: new keys)
    assert {"eager", "checkpoint every block", "checkpoint every other block"} <= names
    assert all(n in ("eager", "checkpoint every block", "checkpoint every other block") or "'s peak" in n for n in names)
    assert all(after[k]["command"] == "this run" and after[k]["step_s"] > 0 for k in changed)
    assert set(before) <= set(after)  # nothing removed: other models, other versions, other variants
    for k in set(before) - changed:
        assert after[k] == before[k]


def test_remat_runs_at_the_peaks_of_stored_competitors(vs, stored):
    path, w = stored
    args = args_for(vs)
    store = ResultStore(path)
    v = next(v for v in vs.variants(args, w) if v.name == "selective checkpointing (save matmuls)")
    store.put(vs.variant_key(w, v, args), fake_result(v, peak_bytes=777))
    wrong = next(v for v in vs.variants(args, w) if v.name == "aot_eager budget 0.1")
    store.put(vs.variant_key(w, wrong, args), fake_result(wrong, grad_max_abs_diff=0.5))
    followers = {f.name: f.setting for f in vs.at_competitor_peaks(store, w, args)}
    assert followers["remat milp at selective checkpointing (save matmuls)'s peak"] == 777
    assert "remat milp at aot_eager budget 0.1's peak" not in followers  # wrong gradients: no match sought
    assert all(f.startswith("remat milp at") for f in followers)


def test_the_report_shows_the_latest_entry_of_each_variant_and_says_when_runs_mix(vs, stored):
    path, w = stored
    args = args_for(vs)
    store = ResultStore(path)
    eager = vs.Variant("eager", "eager")
    store.put({**vs.variant_key(w, eager, args), "threads": 2},
              fake_result(eager, measured="2026-03-03 03:03", command="newer run", peak_bytes=2000))
    view = vs.models_view(json.loads(path.read_text()))
    assert list(view) == ["tiny", "other"]
    assert view["tiny"]["variants"]["eager"]["command"] == "newer run"
    text = vs.markdown(json.loads(path.read_text()))
    assert "### tiny" in text and "step times compare best within one run" in text


def test_a_file_of_the_older_layout_is_upgraded_and_renders_the_same(vs, tmp_path):
    legacy = {
        "meta": {"command": "python bench/vs_pytorch.py", "threads": 1, "rounds": 5},
        "models": {"tiny": {"config": {"width": 8}, "command": "python bench/vs_pytorch.py --time-limit-s 30",
                            "measured": "2026-01-01 00:00", "method": "milp",
                            "variants": {"eager": fake_result(vs.Variant("eager", "eager")),
                                         "remat milp 60%": fake_result(vs.Variant("remat milp 60%", "remat", 0.6),
                                                                       peak_bytes=600, step_s=1.1)}}},
    }
    for record in legacy["models"].values():
        for v in record["variants"].values():
            del v["measured"], v["command"]
    path = tmp_path / "vs.json"
    path.write_text(json.dumps(legacy))
    store = vs.open_results(path)
    assert len(store) == 2
    (key, result), _ = store.select(variant="remat milp 60%") + store.select(variant="eager")
    assert key["planner"] == {"method": "milp", "time_limit_s": 30.0} and key["config"] == {"width": 8}
    assert result["measured"] == "2026-01-01 00:00"
    upgraded = vs.markdown(json.loads(path.read_text()))
    assert upgraded == vs.markdown(copy.deepcopy(legacy))
    assert "### tiny" in upgraded and "remat milp 60%" in upgraded
