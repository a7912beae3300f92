"""optimize(): a TrainingStep that trains exactly like eager PyTorch, reports its plan, saves
and reloads without solving, and fails clearly. Also: resolving workloads by name or spec."""

from __future__ import annotations

import copy
import importlib
import json
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.cost import CostModel
from remat.errors import InfeasibleBudgetError, MethodError, RematError, TraceError
from remat.models import Workload, WorkloadError, get_workload, load_factory, names
from remat.optimize import PlanFileError, StalePlanError, TrainingStep, optimize
from remat.units import BudgetError
from remat.solvers import SolveStatus
from remat.verify import check_step
from torch_helpers import workload

optimize_mod = importlib.import_module("remat.optimize")  # `import remat.optimize as m` gives the function

#: the method the training tests plan with: the MILP when present, else a baseline
METHOD = "chen_greedy"


def _train(model, step_fn, batch, make_opt, steps=10, seed=0):
    opt = make_opt(model.parameters())
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(step_fn(model, batch))
        opt.step()
    return losses


def _eager(w):
    def run(model, batch):
        loss = w.loss_fn(model, *batch)
        loss.backward()
        return loss.detach()

    return run


@pytest.mark.parametrize(
    "name,batch_size,make_opt",
    [
        ("cnn", 4, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        ("gpt2-tiny", 2, lambda p: torch.optim.Adam(p, lr=1e-3)),
    ],
)
def test_ten_optimizer_steps_match_eager_exactly(name, batch_size, make_opt):
    w = workload(name, batch_size)
    eager_model, planned_model = copy.deepcopy(w.model), copy.deepcopy(w.model)
    step = optimize(planned_model, w.batch, w.loss_fn, "90%", method=METHOD, cost_model=CostModel.ESTIMATE)
    assert step.report.recomputed_nodes > 0  # the plan really recomputes
    want = _train(eager_model, _eager(w), w.batch, make_opt)
    got = _train(planned_model, lambda m, b: step(*b), w.batch, make_opt)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (k, p), q in zip(eager_model.named_parameters(), planned_model.parameters()):
        assert torch.equal(p, q), k
    for (k, b), c in zip(eager_model.named_buffers(), planned_model.buffers()):
        assert torch.equal(b, c), k


def test_loss_scaling_with_a_grad_scaler_matches_eager_exactly_through_overflows_and_growth():
    """The README's recipe for float16 training: the scale goes in as a batch tensor, so the
    step's backward starts from it as ``scaler.scale(loss).backward()`` does, whatever it is at
    each step. Skipped steps (gradients overflowing float16) and growth included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))

    def loss_fn(m, x, y, scale):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        return loss * scale

    one = torch.ones(())
    eager_model, planned_model = copy.deepcopy(model), copy.deepcopy(model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=2) for _ in range(2)]
    step = optimize(planned_model, (x, y, scalers[1].scale(one)), loss_fn, "80%", method=METHOD,
                    cost_model=CostModel.ESTIMATE)
    assert step.report.recomputed_nodes > 0

    def eager_step(m, scaler):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        scaled = scaler.scale(loss)
        scaled.backward()
        return scaled.detach()

    runs = []
    for m, scaler, call in [(eager_model, scalers[0], eager_step),
                            (planned_model, scalers[1], lambda m, s: step(x, y, s.scale(one)))]:
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        torch.manual_seed(1)
        losses, scales = [], []
        for _ in range(12):
            opt.zero_grad()
            losses.append(call(m, scaler))
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((losses, scales))
    (want, scales), (got, got_scales) = runs
    assert got_scales == scales
    assert min(scales) < 2.0**30 and any(b > a for a, b in zip(scales, scales[1:]))  # backed off, then grew
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (k, p), q in zip(eager_model.named_parameters(), planned_model.parameters()):
        assert torch.equal(p, q), k


def test_gradients_accumulate_like_backward_and_follow_the_layout_contract():
    w = workload("mlp", 256)
    eager_model, planned_model = copy.deepcopy(w.model), copy.deepcopy(w.model)
    step = optimize(planned_model, w.batch, w.loss_fn, 10**9, method="checkpoint_all", cost_model=None)
    for _ in range(2):  # no zero_grad: the second call adds to .grad
        w.loss_fn(eager_model, *w.batch).backward()
        step(*w.batch)
    for p, q in zip(eager_model.parameters(), planned_model.parameters()):
        assert torch.equal(p.grad, q.grad)
        assert q.grad.stride() == q.stride()


_LINEAR = torch.nn.Linear(16, 4)
_LOSS = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
_XY = (torch.randn(8, 16), torch.randint(0, 4, (8,)))


@pytest.mark.parametrize("args, message", [
    ((lambda x: _LINEAR(x), _XY, _LOSS), r"the model is a function, not a torch.nn.Module; pass the module itself .*in "
                                         r"the order remat.optimize\(model, example_batch, loss_fn, budget=...\)"),
    ((_LINEAR.state_dict(), _XY, _LOSS), r"the model is an OrderedDict, not a torch.nn.Module; .*a state_dict: load it "
                                         r"into its module first"),
    ((_LOSS, _XY, _LINEAR), r"the model is a function, not a torch.nn.Module \(model and loss_fn swapped\?\)"),
    ((_LINEAR, _XY, "cross_entropy"), r"loss_fn is a str, not a function; pass a function loss_fn\(model, \*batch\)"),
    ((_LINEAR, None, _LOSS), r"the batch is None; pass one example batch: a tensor, or a tuple or list of tensors"),
    ((torch.jit.script(torch.nn.Sequential(torch.nn.Linear(16, 4))), _XY, _LOSS),
     r"the model is a TorchScript module \(RecursiveScriptModule, from torch.jit.script or torch.jit.trace\), whose "
     r"Python forward remat cannot trace; pass the nn.Module it was made from"),
], ids=["function", "state_dict", "swapped", "loss-not-callable", "no-batch", "torchscript"])
def test_arguments_of_the_wrong_kind_are_refused_naming_them(args, message, tmp_path):
    with pytest.raises(TraceError, match=message):
        optimize(*args, budget=1.0, method="checkpoint_all", cost_model=None)
    if isinstance(args[1], tuple):  # (loading a plan checks the model and loss_fn first, the same way, in its order)
        message = message.replace(r"remat.optimize\(model, example_batch, loss_fn, budget=...\)",
                                  r"remat.TrainingStep.load\(path, model, example_batch, loss_fn\)")
        with pytest.raises(TraceError, match=message):
            TrainingStep.load(tmp_path / "plan.json", args[0], args[1], args[2])


def test_load_with_the_model_first_is_refused_giving_loads_own_order(tmp_path):
    order = r"in the order remat.TrainingStep.load\(path, model, example_batch, loss_fn\)"
    with pytest.raises(TraceError, match=r"the path is a Linear, not a file path \(path and model swapped\?\); pass the "
                                         r"file step.save\(\) wrote, " + order):
        TrainingStep.load(_LINEAR, tmp_path / "plan.json", _XY, _LOSS)
    with pytest.raises(TraceError, match=r"loss_fn is a tuple, not a function; .*" + order):
        TrainingStep.load(tmp_path / "plan.json", _LINEAR, _LOSS, _XY)


def test_report_describes_the_plan():
    w = workload("cnn", 4)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "90%", method="chen_greedy", cost_model=CostModel.ESTIMATE)
    r = step.report
    assert r.method == "chen_greedy" and r.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    assert r.predicted_peak_bytes <= r.budget_bytes == int(0.9 * r.checkpoint_all_peak_bytes)
    assert r.fixed_bytes < r.predicted_peak_bytes and r.overhead >= 1.0 and r.n_nodes == step.traced.graph.n
    assert "chen_greedy" in str(r) and "overhead" in str(r)


def test_a_method_that_refuses_the_graph_says_which_graph_it_counted():
    """griewank counts the nodes of the graph it plans (views folded), the report the traced
    graph's: the message names both, so the two numbers do not contradict each other."""
    w = workload("mlp", 4)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, 1.0, method="checkpoint_all", cost_model=None)
    with pytest.raises(remat.UnsupportedGraphError, match=r"it has (\d+) nodes, .* \(nodes counted after folding "
                                                          rf"zero-byte views into the values they alias: \1, of the "
                                                          rf"graph's {step.report.n_nodes}\)$"):
        optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, 1.0, method="griewank", cost_model=None)


@pytest.mark.skipif("milp" not in remat.methods(), reason="MILP solver not built yet")
def test_optimize_with_the_milp_on_a_small_model():
    w = workload("cnn", 4)
    model = copy.deepcopy(w.model)
    step = optimize(model, w.batch, w.loss_fn, "90%", cost_model=CostModel.ESTIMATE, time_limit_s=30)
    assert step.report.method == "milp" and step.report.predicted_peak_bytes <= step.report.budget_bytes
    greedy = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "90%", method="chen_greedy", cost_model=CostModel.ESTIMATE)
    assert step.report.cost_us <= greedy.report.cost_us * (1 + 1e-6)  # never worse than a baseline
    eager = copy.deepcopy(w.model)
    loss = w.loss_fn(eager, *w.batch)
    loss.backward()
    assert torch.equal(step(*w.batch), loss.detach())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))
    assert all(torch.equal(b, c) for b, c in zip(eager.buffers(), model.buffers()))


# ---------------------------------------------------------------------------- errors
def test_budget_below_the_minimum_is_infeasible_with_the_least_budget():
    w = workload("cnn", 4)
    with pytest.raises(InfeasibleBudgetError) as info:
        optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, 1000, method="chen_greedy", cost_model=None)
    err = info.value
    assert err.budget_bytes == 1000 and err.min_budget_bytes > 1000
    assert f"({err.min_budget_bytes} B)" in str(err) and "raise the budget" in str(err)


def test_model_without_scalar_loss_is_a_trace_error():
    with pytest.raises(TraceError, match="the loss must be a scalar"):
        optimize(torch.nn.Linear(3, 2), (torch.randn(4, 3),), lambda m, x: m(x), 10**9, method="checkpoint_all")


def test_step_refuses_a_batch_of_another_shape_or_dtype_naming_what_differs():
    w = workload("mlp", 256)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, 10**9, method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError, match=r"a plan is made for its example's shape .*again with an example of this "
                                         r"shape$"):
        step(*(x[:5] for x in w.batch))
    x, y = w.batch
    with pytest.raises(TraceError, match=r"batch\[0\] has shape .*torch.float64.*a plan is made for its example's "
                                         r"dtype \(its kernels, its memory\): pass batch\[0\].to\(torch.float32\) or"):
        step(x.double(), y)


def test_step_takes_the_batch_as_one_tuple_or_list_or_as_tensors():
    w = workload("mlp", 256)
    eager = copy.deepcopy(w.model)
    want = w.loss_fn(eager, *w.batch)
    want.backward()
    for call in (lambda s: s(w.batch), lambda s: s(list(w.batch)), lambda s: s(*w.batch)):
        model = copy.deepcopy(w.model)
        step = optimize(model, list(w.batch), w.loss_fn, budget_bytes=10**9, method="checkpoint_all", cost_model=None)
        assert torch.equal(call(step), want.detach())
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda b: ((b,),), r"got 1 argument\(s\): a tuple, but this step was traced with a batch of 2 tensor\(s\)"),
        (lambda b: (b[0],), r"got 1 argument\(s\): a tensor of shape \(256, 32\).*call step\(\(x, y\)\) or step\(x, y\)"),
        (lambda b: ({"x": b[0]},), "got a dict \\(keys 'x'\\), but this step was traced with a batch of 2 tensor\\(s\\), "
                                   "not a dict"),
        (lambda b: (), "got no batch"),
    ],
)
def test_step_called_wrongly_says_what_to_write(args, message):
    w = workload("mlp", 256)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, 10**9, method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError, match=message):
        step(*args(w.batch))


def test_a_fraction_budget_is_a_fraction():
    w = workload("mlp", 256)
    by_fraction = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, 0.9, method="chen_greedy", cost_model=None)
    by_percent = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "90%", method="chen_greedy", cost_model=None)
    report = by_fraction.report
    assert report.budget_bytes == by_percent.report.budget_bytes == int(0.9 * report.checkpoint_all_peak_bytes)
    assert report.predicted_peak_bytes <= report.budget_bytes


def _must_not_trace(model, *batch):
    raise AssertionError("the budget is checked before tracing")


@pytest.mark.parametrize(
    "budget, kwargs, message",
    [
        (None, {}, "give exactly one of budget="),
        ("60%", {"budget_bytes": 100}, "give exactly one of budget="),
        (None, {"budget_bytes": "60%"}, "budget_bytes='60%' must be an int number of bytes"),
        ("150%", {}, r"percentage in \(0%, 100%\]"),
        ("1e400", {}, "not a finite number"),
        (math.nan, {}, r"must be in \(0, 1\]"),
        (1.5, {}, r"must be in \(0, 1\]"),
        ("60%", {"time_limit_s": 0}, "time limit 0 s must be a positive"),
        ("60%", {"time_limit_s": -1}, "time limit -1 s must be a positive"),
        ("60%", {"time_limit_s": math.nan}, "time limit nan s must be a positive"),
    ],
)
def test_bad_budgets_and_time_limits_fail_at_the_call(budget, kwargs, message):
    with pytest.raises(BudgetError, match=message):
        optimize(torch.nn.Linear(3, 1), (torch.randn(2, 3),), _must_not_trace, budget, cost_model=None, **kwargs)


# ---------------------------------------------------------------------------- save / load
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    w = workload("cnn", 4)
    step = optimize(copy.deepcopy(w.model), w.batch, w.loss_fn, "90%", method="chen_greedy", cost_model=CostModel.ESTIMATE)
    path = tmp_path_factory.mktemp("plans") / "cnn.json"
    step.save(path)
    return w, step, path


def test_saved_plan_reloads_without_solving(saved, monkeypatch):
    w, step, path = saved
    record = json.loads(path.read_text())
    assert record["format"] == "remat.training_step" and record["compute_order"] == list(step.plan.compute_order)

    def no_solving(*args, **kwargs):
        raise AssertionError("load must not solve")

    monkeypatch.setattr(optimize_mod, "plan_graph", no_solving)
    model = copy.deepcopy(w.model)
    loaded = TrainingStep.load(path, model, w.batch, w.loss_fn, budget_bytes=step.report.budget_bytes)
    assert loaded.report == step.report
    assert loaded.planned.plan == step.planned.plan
    eager = copy.deepcopy(w.model)
    loss = w.loss_fn(eager, *w.batch)
    loss.backward()
    assert torch.equal(loaded(*w.batch), loss.detach())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))


def test_saving_to_a_folder_or_into_a_missing_one_is_refused_and_leaves_nothing(saved, tmp_path):
    _, step, _ = saved
    with pytest.raises(PlanFileError, match=r"cannot save the plan to .*: it is a folder, not a file; pass a file path "
                                            r"such as .*plan.json"):
        step.save(tmp_path)
    with pytest.raises(PlanFileError, match=r"folder .*missing' does not exist; create it"):
        step.save(tmp_path / "missing" / "plan.json")
    assert list(tmp_path.iterdir()) == [] and list(tmp_path.parent.glob(f".{tmp_path.name}.*.tmp")) == []


def test_stale_plan_is_refused(saved):
    w, step, path = saved
    other = get_workload("mlp", 4)
    with pytest.raises(StalePlanError, match="made for a different training step.*run optimize\\(\\) again"):
        TrainingStep.load(path, other.model, other.batch, other.loss_fn)
    smaller_batch = tuple(x[:2] for x in w.batch)
    with pytest.raises(StalePlanError, match="different training step"):
        TrainingStep.load(path, copy.deepcopy(w.model), smaller_batch, w.loss_fn)
    with pytest.raises(StalePlanError, match=f"made for budget {step.report.budget_bytes} B, not 123 B"):
        TrainingStep.load(path, copy.deepcopy(w.model), w.batch, w.loss_fn, budget_bytes=123)


def test_a_stale_plan_names_the_first_operation_that_differs(tmp_path):
    """The refusal listed every possible cause; it now names where the two steps part: an
    operation of another size (a layer made wider) or another operation (ReLU for GELU)."""
    import torch.nn.functional as F
    from torch import nn

    def model(width=64, act=nn.ReLU):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, width), act(), nn.Linear(width, 10))

    batch = (torch.randn(512, 32), torch.randint(0, 10, (512,)))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    path = tmp_path / "plan.json"
    optimize(model(), batch, loss_fn, 1.0, method="checkpoint_all", cost_model=None).save(path)
    with pytest.raises(StalePlanError, match=r"the first operation that differs is operation 1: the saved step "
                                             r"computed 'addmm' \(128.00 KiB\) there, this one 'addmm' \(160.00 KiB, "
                                             r"float32 \(512, 80\)\)"):
        TrainingStep.load(path, model(80), batch, loss_fn)
    with pytest.raises(StalePlanError, match=r"operation 2: the saved step computed 'relu' \(128.00 KiB\) there, "
                                             r"this one 'gelu'"):
        TrainingStep.load(path, model(act=nn.GELU), batch, loss_fn)
    record = json.loads(path.read_text())
    del record["nodes"]  # (a file saved before the operations were)
    path.write_text(json.dumps(record))
    with pytest.raises(StalePlanError, match=r"this model traces to \w+, \d+ nodes\): the model, batch shape"):
        TrainingStep.load(path, model(80), batch, loss_fn)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda text, rec: "{not json", "not readable JSON"),
        (lambda text, rec: text[: len(text) // 2], "not readable JSON"),
        (lambda text, rec: json.dumps({"hello": 1}), "not a remat plan file"),
        (lambda text, rec: json.dumps({**rec, "compute_order": "x"}), "field 'compute_order' is missing or not a list"),
        (lambda text, rec: json.dumps({**rec, "compute_order": []}), "compute order names node None"),
        (lambda text, rec: json.dumps({**rec, "compute_order": rec["compute_order"] + [10**6]}), "names node 1000000, outside"),
        (lambda text, rec: json.dumps({**rec, "compute_order": rec["compute_order"][1:]}), "does not replay"),
        (lambda text, rec: json.dumps({**rec, "report": {**rec["report"], "predicted_peak_bytes": 1}}), "promises 1 B"),
        (lambda text, rec: json.dumps({**rec, "version": 99}), "format version 99"),
    ],
)
def test_corrupt_plan_file_is_refused(saved, tmp_path, mutate, message):
    w, _, path = saved
    text = path.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(mutate(text, json.loads(text)))
    with pytest.raises(PlanFileError, match=message) as info:
        TrainingStep.load(bad, copy.deepcopy(w.model), w.batch, w.loss_fn)
    assert isinstance(info.value, RematError)


def test_missing_plan_file(tmp_path):
    w = workload("mlp", 256)
    with pytest.raises(PlanFileError, match="no saved plan at"):
        TrainingStep.load(tmp_path / "nope.json", w.model, w.batch, w.loss_fn)
    with pytest.raises(PlanFileError, match="is a folder, not a saved plan; pass the file step.save\\(\\) wrote"):
        TrainingStep.load(tmp_path, w.model, w.batch, w.loss_fn)


# ---------------------------------------------------------------------------- workloads
def test_builtin_workloads():
    assert names() == ("cnn", "fcn8", "gpt2-medium", "gpt2-small", "gpt2-tiny", "mlp", "mobilenet", "resnet50",
                       "segnet", "vgg-unet", "vgg16", "vgg19")
    w = get_workload("gpt2-tiny", 2)
    config = w.model.config
    assert config.n_layer == 2 and config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    assert w.model.lm_head.weight is w.model.transformer.wte.weight
    # same seed, same weights and batch
    again = get_workload("gpt2-tiny", 2)
    assert torch.equal(w.batch[0], again.batch[0])
    assert all(torch.equal(p, q) for p, q in zip(w.model.parameters(), again.model.parameters()))


def test_user_factory_and_bad_specs(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(
        textwrap.dedent(
            """
            import torch
            from remat.models import Workload

            def tiny(batch_size):
                model = torch.nn.Linear(3, 1)
                return Workload("tiny", model, (torch.randn(batch_size, 3),), lambda m, x: m(x).sum())

            def wrong(batch_size):
                return (1, 2)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    w = get_workload("my_factories:tiny", 5)
    assert isinstance(w, Workload) and w.batch[0].shape == (5, 3)
    assert load_factory("my_factories:tiny")(2).name == "tiny"
    with pytest.raises(WorkloadError, match="not of the form 'package.module:function'"):
        load_factory("my_factories.tiny")
    with pytest.raises(WorkloadError, match="module 'no_such_module_xyz' cannot be imported"):
        get_workload("no_such_module_xyz:make", 2)
    with pytest.raises(WorkloadError, match="has no attribute 'missing'.*def missing\\(batch_size: int\\)"):
        get_workload("my_factories:missing", 2)
    with pytest.raises(WorkloadError, match="returned a tuple; it must return a remat.models.Workload"):
        get_workload("my_factories:wrong", 2)
    with pytest.raises(WorkloadError, match="'NOT_CALLABLE' is an int, not a function"):
        get_workload("my_factories:NOT_CALLABLE", 2)
    with pytest.raises(WorkloadError, match="unknown workload 'resnet'; use one of cnn, fcn8, .*, vgg19 or a factory spec"):
        get_workload("resnet", 2)
    with pytest.raises(WorkloadError, match="batch_size=0 must be a positive int"):
        get_workload("mlp", 0)


def test_optimize_under_no_grad_traces_the_training_step_and_under_inference_mode_is_refused():
    """Under no_grad the loss had no grad_fn, and the step was refused as if loss_fn did not call
    the model; a training step computes gradients, so it is traced with autograd on."""
    w = workload("mlp", 64)
    model = copy.deepcopy(w.model)
    with torch.no_grad():
        step = optimize(model, w.batch, w.loss_fn, 10**9, method="checkpoint_all", cost_model=None)
    assert torch.is_grad_enabled()  # (restored on leaving the block)
    assert check_step(step, w.loss_fn, *w.batch).bitwise
    with torch.inference_mode(), pytest.raises(TraceError, match=r"cannot be traced under torch.inference_mode\(\).*"
                                                                 r"call remat.optimize \(or trace\) outside"):
        optimize(model, w.batch, w.loss_fn, 10**9, method="checkpoint_all", cost_model=None)


@pytest.mark.parametrize("method, options, message", [
    ("revolve", {}, r"unknown method 'revolve' \(did you mean 'griewank'\?\); choose one of: .*griewank"),
    ("mlip", {}, r"unknown method 'mlip' \(did you mean 'milp'\?\)"),
    ("descent", {"time_limit_s": 30}, r"method 'descent' has no option 'time_limit_s'; its options are: .*; and "
                                      r"every method's: reduce, max_nodes"),
    ("milp", {"threads": 0}, r"threads"),
    ("milp", {"backend": "nope"}, r"unknown MILP backend 'nope'"),
])
def test_a_method_or_option_it_does_not_take_is_refused_before_tracing(method, options, message):
    calls = []

    def loss_fn(m, x):
        calls.append(1)
        return m(x).square().mean()

    with pytest.raises(MethodError, match=message):
        optimize(torch.nn.Linear(3, 2), (torch.randn(4, 3),), loss_fn, 10**9, method=method, **options)
    assert not calls  # nothing was traced


# ---------------------------------------------------------------------------- dict batches
class _KeywordModel(torch.nn.Module):
    """Called as Hugging Face models are: ``model(**batch)``, returning an object with ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.drop, self.head = torch.nn.Embedding(50, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 50)

    def forward(self, input_ids, attention_mask, labels):
        h = self.drop(self.emb(input_ids).tanh()) * attention_mask[..., None]
        loss = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return type("Output", (), {"loss": loss})()


LABEL_WEIGHT = {"w": 1.0}


def _keyword_loss(model, batch):
    return model(**batch).loss * LABEL_WEIGHT["w"]


def _keyword_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (4, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(4, 16), "labels": ids.roll(1, 1)}


def test_a_dict_batch_trains_as_eager_and_is_taken_by_key():
    """A Hugging Face DataLoader yields dicts, and the loss reads ``model(**batch).loss``: the
    step takes such dicts whole (their keys in any order), bitwise eager's over three AdamW steps."""
    torch.manual_seed(0)
    model = _KeywordModel()
    eager_model, planned_model = copy.deepcopy(model), copy.deepcopy(model)
    step = optimize(planned_model, _keyword_batch(), _keyword_loss, "90%", method=METHOD, cost_model=CostModel.ESTIMATE)
    assert step.batch_keys == ("input_ids", "attention_mask", "labels") and step.report.recomputed_nodes > 0
    batches = [_keyword_batch(1), dict(reversed(list(_keyword_batch(2).items()))), _keyword_batch(3)]
    for label, m, run in [("eager", eager_model, lambda b: _keyword_loss(eager_model, b).backward()),
                          ("planned", planned_model, step)]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        torch.manual_seed(7)
        for b in batches:
            opt.zero_grad()
            run(b)
            opt.step()
    for (k, p), q in zip(eager_model.named_parameters(), planned_model.parameters()):
        assert torch.equal(p, q), k
    assert check_step(step, _keyword_loss, _keyword_batch(4)).bitwise


@pytest.mark.parametrize("call, message", [
    (lambda step, b: step({k: v for k, v in b.items() if k != "labels"}),
     r"the batch has keys 'input_ids', 'attention_mask', but the step was traced with keys 'input_ids', "
     r"'attention_mask', 'labels' \(missing 'labels'\); pass batches with the example's keys"),
    (lambda step, b: step({**b, "text": torch.zeros(1)}), r"\(not traced: 'text'\)"),
    (lambda step, b: step(b["input_ids"], b["attention_mask"], b["labels"]),
     r"step\(\) got 3 argument\(s\): a tensor of shape \(4, 16\).*but this step was traced with a dict batch \(keys 'input_ids', 'attention_mask', "
     r"'labels'\); pass one such dict"),
    (lambda step, b: step({**b, "labels": b["labels"].tolist()}), r"a dict batch holds tensors under string keys, and "
                                                                  r"batch\['labels'\] is a list"),
])
def test_a_dict_batch_that_does_not_match_is_refused_naming_the_keys(call, message):
    step = optimize(_KeywordModel(), _keyword_batch(), _keyword_loss, 1.0, method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError, match=message):
        call(step, _keyword_batch(1))
    plain = optimize(torch.nn.Linear(16, 4), torch.randn(2, 16), lambda m, x: m(x).sum(), 1.0,
                     method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError, match=r"step\(\) got a dict \(keys 'x'\), but this step was traced with a batch of "
                                         r"1 tensor\(s\), not a dict"):
        plain({"x": torch.randn(2, 16)})


def test_a_dict_batch_tensor_is_named_by_its_key_at_step_time_and_at_optimize_time():
    """The step takes a dict's tensors as a tuple in its keys' order; a message names them as the
    user wrote the batch, ``batch['labels']``, not ``batch[2]``, remedies included."""
    step = optimize(_KeywordModel(), _keyword_batch(), _keyword_loss, 1.0, method="checkpoint_all", cost_model=None)
    b = _keyword_batch(1)
    with pytest.raises(TraceError, match=r"^batch\['labels'\] has shape \(4, 16\), torch.float32 .* pass "
                                         r"batch\['labels'\].to\(torch.int64\) or trace"):
        step({**b, "labels": b["labels"].float()})
    with pytest.raises(TraceError, match=r"^batch\['input_ids'\] has shape \(2, 16\), torch.int64 on cpu but the step "
                                         r"was traced with shape \(4, 16\)"):
        step({**b, "input_ids": b["input_ids"][:2]})
    with pytest.raises(TraceError, match=r"^batch\['labels'\] has shape .* pass batch\['labels'\].to\(torch.int64\)"):
        check_step(step, _keyword_loss, {**b, "labels": b["labels"].float()})  # (before eager runs it)

    class InPlace(torch.nn.Linear):
        def forward(self, a, b):
            return super().forward(a.mul_(2) + b).sum()

    x = torch.randn(2, 4)
    with pytest.raises(TraceError, match=r"^batch\['a'\] and batch\['b'\] share memory, and the step modifies "
                                         r"batch\['a'\] in place.*\(batch\['b'\].clone\(\), which keeps its values\)"):
        optimize(InPlace(4, 4), {"a": x, "b": x}, lambda m, batch: m(**batch), 1.0, method="checkpoint_all", cost_model=None)


def test_a_dict_in_a_tuple_of_one_is_told_to_be_passed_itself():
    with pytest.raises(TraceError, match=r"the batch is a tuple holding one dict \(keys 'input_ids', 'attention_mask', "
                                         r"'labels'\), and a dict batch is taken as it is: pass the dict itself "
                                         r"\(remat.optimize\(model, batch, loss_fn, ...\), remat.trace\(model, batch, "
                                         r"loss_fn\)\), with loss_fn\(model, batch\) reading the dict"):
        optimize(_KeywordModel(), (_keyword_batch(),), _keyword_loss, 1.0, method="checkpoint_all", cost_model=None)
    step = optimize(_KeywordModel(), _keyword_batch(), _keyword_loss, 1.0, method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError, match=r"step\(\) got a list holding one dict \(keys 'input_ids', 'attention_mask', "
                                         r"'labels'\); pass the dict itself, step\(batch\)"):
        step([_keyword_batch(1)])


def test_remat_trace_takes_a_dict_batch_and_its_step_takes_dicts():
    """The low-level API: ``remat.trace`` takes a dict batch whole as ``optimize`` does, and the
    traced step's ``flat_inputs`` takes dicts with its keys in any order (a planned step run on
    them gives eager's loss and gradients, bitwise); a batch of the other kind, or with other
    keys or dtypes, is refused naming it by key."""
    from remat.execute import build_module
    from remat.planning import plan_graph

    torch.manual_seed(0)
    model = _KeywordModel()
    traced = remat.trace(model, _keyword_batch(), _keyword_loss, cost_model=CostModel.ESTIMATE)
    assert traced.batch_keys == ("input_ids", "attention_mask", "labels")
    planned = build_module(traced, plan_graph(traced.graph, 2**40, "checkpoint_all").plan)
    batch = dict(reversed(list(_keyword_batch(1).items())))
    eager = copy.deepcopy(model)
    torch.manual_seed(1)
    outputs = planned(*traced.flat_inputs(model, batch))
    torch.manual_seed(1)
    loss = _keyword_loss(eager, _keyword_batch(1))
    loss.backward()
    assert torch.equal(outputs[0], loss.detach())
    grads = {slot.key: out for slot, out in zip(traced.outputs, outputs) if slot.key != "loss"}
    assert grads and all(torch.equal(grads[k], p.grad) for k, p in eager.named_parameters() if k in grads)
    with pytest.raises(TraceError, match=r"the batch is a tuple, but this step was traced with a dict batch \(keys "
                                         r"'input_ids', 'attention_mask', 'labels'\); pass one such dict"):
        traced.flat_inputs(model, tuple(_keyword_batch(1).values()))
    with pytest.raises(TraceError, match=r"the batch has keys 'input_ids', 'labels', but the step was traced with keys "
                                         r"'input_ids', 'attention_mask', 'labels' \(missing 'attention_mask'\)"):
        traced.flat_inputs(model, {k: v for k, v in _keyword_batch(1).items() if k != "attention_mask"})
    with pytest.raises(TraceError, match=r"pass batch\['attention_mask'\].to\(torch.float32\)"):
        traced.flat_inputs(model, {**_keyword_batch(1), "attention_mask": torch.ones(4, 16, dtype=torch.float64)})
    tupled = remat.trace(model, tuple(_keyword_batch().values()),
                         lambda m, ids, mask, labels: m(input_ids=ids, attention_mask=mask, labels=labels).loss,
                         cost_model=None)
    assert tupled.batch_keys is None
    with pytest.raises(TraceError, match=r"the batch is a dict \(keys 'input_ids', 'attention_mask', 'labels'\), but "
                                         r"this step was traced with a tuple of tensors"):
        tupled.flat_inputs(model, _keyword_batch(1))


def test_a_dict_batch_step_saves_and_loads_and_keeps_the_guards_of_its_loss(tmp_path):
    torch.manual_seed(0)
    model = _KeywordModel()
    step = optimize(model, _keyword_batch(), _keyword_loss, "90%", method=METHOD, cost_model=CostModel.ESTIMATE)
    path = tmp_path / "plan.json"
    step.save(path)
    shuffled = dict(reversed(list(_keyword_batch().items())))
    loaded = TrainingStep.load(path, model, shuffled, _keyword_loss)
    assert loaded.batch_keys == step.batch_keys and loaded.plan.compute_order == step.plan.compute_order
    assert check_step(loaded, _keyword_loss, _keyword_batch(5)).bitwise
    b = _keyword_batch()
    with pytest.raises(StalePlanError, match=r"made for a batch given as a dict with keys 'input_ids', 'attention_mask', "
                                             r"'labels', and this example batch is a tuple of tensors"):
        TrainingStep.load(path, model, (b["input_ids"], b["attention_mask"], b["labels"]),
                          lambda m, i, a, l: m(i, a, l).loss)
    record = json.loads(path.read_text())
    record["batch_keys"] = ["input_ids", "input_ids"]
    path.write_text(json.dumps(record))
    with pytest.raises(PlanFileError, match="field 'batch_keys' is not a list of distinct strings"):
        TrainingStep.load(path, model, b, _keyword_loss)
    LABEL_WEIGHT["w"] = 2.0  # (read by the user's loss_fn: guarded through the dict wrapper)
    try:
        with pytest.raises(TraceError, match=r"loss_fn's global 'LABEL_WEIGHT'\['w'\] is now 2.0 but was 1.0"):
            step(b)
    finally:
        LABEL_WEIGHT["w"] = 1.0


def test_a_bare_number_string_budget_is_bytes_and_the_error_says_so():
    """budget="60" is 60 bytes (as documented); the refusal says how to ask for 60%."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    with pytest.raises(remat.InfeasibleBudgetError, match=r"budget='60' is read as 60 bytes; for 60% of the "
                                                          r"checkpoint-all peak write budget='60%'"):
        remat.optimize(m, (x, y), lambda m, x, y: F.cross_entropy(m(x), y), budget="60", cost_model=None)


def test_a_step_called_with_keywords_says_how_to_pass_a_dict_batch():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    batch = {"x": torch.randn(8, 8), "y": torch.randint(0, 4, (8,))}
    step = remat.optimize(m, batch, lambda m, b: F.cross_entropy(m(b["x"]), b["y"]), budget=1.0, cost_model=None)
    with pytest.raises(TraceError, match=r"step\(\) got keyword arguments \(x, y\); pass the batch as it was given to "
                                         r"optimize: step\(batch\) for a dict batch"):
        step(**batch)
    assert torch.equal(step(batch), F.cross_entropy(m(batch["x"]), batch["y"]))
