"""remat.sweep: keyed, resumable JSON results (ResultStore, result_key) and atomic writes."""

import enum
import json
import time

import pytest

import remat
from remat.sweep import RESULTS_SCHEMA, ResultStore, record_key, result_key, save_json


def key(**extra):
    return result_key(fingerprint="f00d", method="milp", options={"time_limit_s": 60}, **extra)


def test_key_names_what_produced_the_result():
    k = key(budget_bytes=1000)
    assert k == {"budget_bytes": 1000, "code_version": remat.__version__, "fingerprint": "f00d", "method": "milp",
                 "options": {"time_limit_s": 60}, "schema": RESULTS_SCHEMA}
    assert key(budget_bytes=1000) == k  # stable
    assert key(budget_bytes=1001) != k
    assert result_key(fingerprint="f00d", method="milp", options={"time_limit_s": 30}, budget_bytes=1000) != k
    assert key(budget_bytes=1000, code_version="9.9") != k
    assert key(budget_bytes=1000, schema=RESULTS_SCHEMA + 1) != k


def test_record_key_for_results_that_are_not_one_graphs():
    k = record_key(model="gpt2", variant="eager", threads=1)
    assert k == {"code_version": remat.__version__, "model": "gpt2", "schema": RESULTS_SCHEMA, "threads": 1,
                 "variant": "eager"}
    assert record_key(model="gpt2", variant="eager", threads=1, schema=7)["schema"] == 7


def test_key_makes_enums_tuples_and_paths_plain(tmp_path):
    class Mode(enum.Enum):
        FAST = "fast"

    k = key(mode=Mode.FAST, shape=(2, 3), where=tmp_path)
    assert k["mode"] == "fast" and k["shape"] == [2, 3] and k["where"] == str(tmp_path)
    json.dumps(k)


@pytest.mark.parametrize("value, message", [(object(), "field 'thing' is an object"), (float("nan"), "finite")])
def test_key_refuses_what_json_cannot_hold(value, message):
    with pytest.raises(TypeError, match=message):
        key(thing=value)


def test_store_resumes_from_the_file(tmp_path):
    path = tmp_path / "r.json"
    store = ResultStore(path)
    assert len(store) == 0 and store.get(key(budget_bytes=1)) is None
    store.put(key(budget_bytes=1), {"overhead": 1.5})
    store.put(key(budget_bytes=2), {"overhead": 1.0})
    again = ResultStore(path)
    assert key(budget_bytes=1) in again and again.get(key(budget_bytes=2)) == {"overhead": 1.0}
    assert [k["budget_bytes"] for k, _ in again.select(method="milp")] == [1, 2]
    assert again.select(method="chen_sqrtn") == []
    data = json.loads(path.read_text())
    assert data["format"] == "remat.results" and data["results"][0]["key"]["fingerprint"] == "f00d"


def test_put_keeps_what_another_writer_stored_meanwhile(tmp_path):
    path = tmp_path / "r.json"
    first, second = ResultStore(path), ResultStore(path)
    first.put(key(budget_bytes=1), {"by": "first"})
    second.put(key(budget_bytes=2), {"by": "second"})
    first.put(key(budget_bytes=3), {"by": "first"})
    final = ResultStore(path)
    assert [r["by"] for _, r in final.select()] == ["first", "second", "first"]


def test_results_of_other_code_versions_stay_untouched(tmp_path):
    path = tmp_path / "r.json"
    old = key(budget_bytes=1, code_version="0.0.1")
    ResultStore(path).put(old, {"overhead": 2.0})
    store = ResultStore(path)
    assert key(budget_bytes=1) not in store  # not reused...
    store.put(key(budget_bytes=1), {"overhead": 1.9})
    assert ResultStore(path).get(old) == {"overhead": 2.0}  # ...and not wiped


def test_meta_is_kept(tmp_path):
    path = tmp_path / "r.json"
    store = ResultStore(path)
    store.meta["graph"] = "chain8"
    store.put(key(), {})
    assert ResultStore(path).meta == {"graph": "chain8"}


@pytest.mark.parametrize("content, message", [("{", "not readable JSON"), ('{"points": []}', "not a remat results file")])
def test_store_refuses_a_file_it_did_not_write(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        ResultStore(path)


def test_save_json_is_atomic_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "x.json"
    save_json({"a": 1}, path)
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_docstring_examples_run():
    import doctest

    import remat.sweep

    failures, tried = doctest.testmod(remat.sweep)
    assert tried >= 4 and failures == 0


def test_a_benchmark_record_states_the_machines_speed():
    """Wall times, and what a time limit finds, depend on the machine: a record carries the time
    of a fixed Python loop, so that runs on two machines can be compared."""
    from remat.sweep import environment, python_loop_ms

    env = environment()
    assert env["python_loop_ms"] > 0 and env["cpu_count"] >= 1 and env["torch"] == __import__("torch").__version__
    assert isinstance(python_loop_ms(), float)


def test_a_sweep_where_no_method_plans_is_drawn_without_an_empty_legend(tmp_path):
    """matplotlib warned "No artists with labels found to put in legend" for such a sweep."""
    import warnings

    from remat.plotting import plot_overhead
    from remat.sweep import SweepPoint

    points = [SweepPoint("checkpoint_all", 10, 0.1, None, min_budget_bytes=100)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_overhead(points, tmp_path / "p.png", title="nothing fits")
    assert path.stat().st_size > 0


def _put_many(path: str, tag: str, count: int, go) -> None:
    store = ResultStore(path)
    store.meta.setdefault("graphs", {})[tag] = {"name": tag}
    go.wait()  # (both start writing at once)
    for k in range(count):
        store.put({"writer": tag, "k": k}, {"value": k, "padding": "x" * 200})
    store.save()


def test_two_processes_writing_one_results_file_lose_nothing(tmp_path):
    """Each write reads the file again and writes it under a lock. Without: two sweeps sharing
    --out kept 397 of their 400 results and one of their graphs' records; here, 252 of 300
    results and one writer's record."""
    import multiprocessing

    path = str(tmp_path / "shared.json")
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    writers = [context.Process(target=_put_many, args=(path, tag, 150, go)) for tag in ("a", "b")]
    for w in writers:
        w.start()
    time.sleep(2)  # (both have read the file: spawned interpreters take a second to start)
    go.set()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    store = ResultStore(path)
    assert len(store) == 300
    assert all(len(store.select(writer=tag)) == 150 for tag in ("a", "b"))
    assert set(store.meta["graphs"]) == {"a", "b"}
