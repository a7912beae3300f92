"""What a training step does to the tensors it is given, as eager PyTorch does it: the gradients
of batch tensors that require grad (a leaf's ``.grad``; a tensor computed outside the step passes
its gradient on into the graph that made it), parameters and batch tensors the forward modifies
in place; and ``check_step`` comparing all of them."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import verify
from remat.cost import CostModel
from remat.errors import TraceError
from remat.optimize import PlanFileError, StalePlanError, TrainingStep
from remat.trace import OutputRole, OutputSlot
from remat.verify import check_step

torch.set_num_threads(1)


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


def _mlp(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 3))


def _equal_grads(a: nn.Module, b: nn.Module) -> None:
    for (k, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), k
        assert p.grad is None or torch.equal(p.grad, q.grad), k


def _recomputing_step(model, batch, loss_fn=_loss):
    """A plan that recomputes something (the gradients must not depend on the plan)."""
    step = remat.optimize(model, batch, loss_fn, budget=10**9, method="recompute_all", cost_model=CostModel.ESTIMATE)
    assert step.report.recomputed_nodes > 0
    return step


# ---------------------------------------------------------------------------- input gradients
def test_a_leaf_input_that_requires_grad_gets_eagers_gradient_and_accumulates():
    eager, planned = _mlp(), _mlp()
    x, y = torch.randn(32, 16, requires_grad=True), torch.randint(0, 3, (32,))
    step = _recomputing_step(planned, (x, y))
    xe, xp = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    for _ in range(2):  # no zero_grad: the second call adds to x.grad, as backward does
        want = _loss(eager, xe, y)
        want.backward()
        assert torch.equal(step(xp, y), want.detach())
        assert xp.grad is not None and torch.equal(xp.grad, xe.grad)
        assert xp.grad.stride() == xe.grad.stride()
        _equal_grads(eager, planned)
    assert y.grad is None


def test_an_input_computed_outside_the_step_passes_its_gradient_on_like_backward():
    """An encoder run outside the step: eager's loss.backward() reaches its parameters through
    the step's input; so does the planned step, over two optimizer steps."""
    torch.manual_seed(1)
    enc_e, z, y = nn.Sequential(nn.Linear(8, 16), nn.Tanh()), torch.randn(32, 8), torch.randint(0, 3, (32,))
    head_e = _mlp()
    enc_p, head_p = copy.deepcopy(enc_e), copy.deepcopy(head_e)
    example = enc_p(z)
    assert example.grad_fn is not None
    step = _recomputing_step(head_p, (example, y))
    opt_e = torch.optim.Adam([*enc_e.parameters(), *head_e.parameters()], lr=1e-2)
    opt_p = torch.optim.Adam([*enc_p.parameters(), *head_p.parameters()], lr=1e-2)
    for _ in range(2):
        opt_e.zero_grad()
        opt_p.zero_grad()
        want = _loss(head_e, enc_e(z), y)
        want.backward()
        assert torch.equal(step(enc_p(z), y), want.detach())
        _equal_grads(enc_e, enc_p)
        _equal_grads(head_e, head_p)
        assert all(p.grad is not None for p in enc_p.parameters())
        opt_e.step()
        opt_p.step()
    for a, b in zip([*enc_e.parameters(), *head_e.parameters()], [*enc_p.parameters(), *head_p.parameters()]):
        assert torch.equal(a, b)


class _FrozenEncoder(nn.Module):
    """An encoder whose parameters are frozen, a trainable head: the input's gradient passes
    through the frozen layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())
        self.head = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))
        self.enc.requires_grad_(False)

    def forward(self, x):
        return self.head(self.enc(x))


@pytest.mark.parametrize("frozen", ["encoder", "whole model"])
def test_an_input_through_frozen_parameters_gets_eagers_gradient(frozen):
    eager = _FrozenEncoder()
    if frozen == "whole model":  # (only the input's gradient is computed)
        eager.requires_grad_(False)
    planned = copy.deepcopy(eager)
    x, y = torch.randn(32, 16, requires_grad=True), torch.randint(0, 3, (32,))
    step = remat.optimize(planned, (x, y), _loss, budget="100%", method="checkpoint_all", cost_model=None)
    xe, xp = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    want = _loss(eager, xe, y)
    want.backward()
    assert torch.equal(step(xp, y), want.detach())
    assert torch.equal(xp.grad, xe.grad)
    _equal_grads(eager, planned)
    assert all(p.grad is None for p in planned.enc.parameters())


def test_a_batch_that_requires_grad_elsewhere_than_the_example_is_refused_before_anything_runs():
    model = _mlp()
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    step = remat.optimize(model, (x.requires_grad_(), y), _loss, budget="100%", method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError) as info:
        step(x.detach(), y)
    assert str(info.value) == (
        "batch[0] does not require grad but the step was traced with an example batch[0] that does, so the step "
        "computes its gradient: pass a batch[0] that requires grad, or trace (or optimize) again with an example "
        "batch whose batch[0] does not")
    other = remat.optimize(model, (x.detach(), y), _loss, budget="100%", method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError) as info:
        other(x.detach().requires_grad_(), y)
    assert str(info.value) == (
        "batch[0] requires grad but the step was traced with an example batch[0] that does not, so the step does "
        "not compute its gradient: trace (or optimize) again with an example batch whose batch[0] requires grad")
    assert all(p.grad is None for p in model.parameters())


def test_check_step_compares_the_gradients_of_inputs_that_require_grad(monkeypatch):
    model = _mlp()
    x, y = torch.randn(32, 16, requires_grad=True), torch.randint(0, 3, (32,))
    step = _recomputing_step(model, (x, y))
    agreement = check_step(step, _loss, x, y)
    assert agreement.bitwise, agreement.mismatches
    assert x.grad is None and all(p.grad is None for p in model.parameters())  # (each step ran on copies)
    _nudge_planned(monkeypatch, "batch_grads", "batch[0]")
    agreement = check_step(step, _loss, x, y)
    assert not agreement.bitwise and len(agreement.mismatches) == 1
    assert agreement.mismatches[0].startswith("grad batch[0]: max |diff| ")


def test_a_saved_plan_keeps_which_inputs_require_grad(tmp_path):
    model = _mlp()
    x, y = torch.randn(32, 16, requires_grad=True), torch.randint(0, 3, (32,))
    step = _recomputing_step(model, (x, y))
    path = tmp_path / "plan.json"
    step.save(path)
    record = json.loads(path.read_text())
    assert record["batch_requires_grad"] == [True, False]
    loaded_model = _mlp()
    loaded = TrainingStep.load(path, loaded_model, (x, y), _loss)
    xp = x.detach().clone().requires_grad_()
    loaded(xp, y)
    eager, xe = _mlp(), x.detach().clone().requires_grad_()
    _loss(eager, xe, y).backward()
    assert torch.equal(xp.grad, xe.grad)
    _equal_grads(eager, loaded_model)
    with pytest.raises(StalePlanError) as info:
        TrainingStep.load(path, _mlp(), (x.detach(), y), _loss)
    assert str(info.value) == (
        f"saved plan {str(path)!r} was made with an example batch whose batch[0] requires grad, but this example "
        f"batch's batch[0] does not (the step computes the gradients of the batch tensors that required grad when "
        f"it was planned): load it with an example batch whose batch[0] requires grad, or run optimize() again "
        f"with this one")
    # a file saved before the field was recorded: loads alike, and another example is still refused
    older = tmp_path / "older.json"
    older.write_text(json.dumps({k: v for k, v in record.items() if k != "batch_requires_grad"}))
    assert TrainingStep.load(older, _mlp(), (x, y), _loss).planned.plan == step.planned.plan
    with pytest.raises(StalePlanError, match="which batch tensors require grad changed"):
        TrainingStep.load(older, _mlp(), (x.detach(), y), _loss)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(json.dumps({**record, "batch_requires_grad": "yes"}))
    with pytest.raises(PlanFileError, match="field 'batch_requires_grad' is not a list of booleans"):
        TrainingStep.load(corrupt, _mlp(), (x, y), _loss)


# ---------------------------------------------------------------------------- parameters modified in place
class _MaxNorm(nn.Module):
    """Embeddings with ``max_norm``: the forward renormalizes rows of their weights in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(50, 8, max_norm=1.0)
        self.bag = nn.EmbeddingBag(50, 8, mode="mean", max_norm=0.5)
        self.mlp = nn.Sequential(nn.Linear(16 * 8 + 8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, ids, bag_ids, offsets):
        return self.mlp(torch.cat([self.emb(ids).flatten(1), self.bag(bag_ids, offsets)], 1))


def _max_norm_batch():
    torch.manual_seed(4)
    return torch.randint(0, 50, (8, 16)), torch.randint(0, 50, (40,)), torch.arange(0, 40, 5), torch.randint(0, 3, (8,))


def _max_norm_loss(m, ids, bag_ids, offsets, y):
    return F.cross_entropy(m(ids, bag_ids, offsets), y)


def test_parameters_the_forward_renormalizes_in_place_train_like_eager():
    eager, planned, batch = _MaxNorm(), _MaxNorm(), _max_norm_batch()
    before = eager.emb.weight.detach().clone()
    step = _recomputing_step(planned, batch, _max_norm_loss)
    assert sorted(s.key for s in step.traced.outputs if s.role is OutputRole.UPDATE) == ["bag.weight", "emb.weight"]
    opt_e, opt_p = torch.optim.Adam(eager.parameters(), lr=1e-2), torch.optim.Adam(planned.parameters(), lr=1e-2)
    for _ in range(2):
        opt_e.zero_grad()
        opt_p.zero_grad()
        want = _max_norm_loss(eager, *batch)
        want.backward()
        assert torch.equal(step(*batch), want.detach())
        _equal_grads(eager, planned)
        for (k, p), q in zip(eager.named_parameters(), planned.parameters()):
            assert torch.equal(p, q), k
        opt_e.step()
        opt_p.step()
    for (k, p), q in zip(eager.named_parameters(), planned.parameters()):
        assert torch.equal(p, q), k
    assert not torch.equal(before, eager.emb.weight)  # (the renormalization changed something)


def test_check_step_and_planned_step_apply_and_compare_parameters_modified_in_place(monkeypatch):
    model, batch = _MaxNorm(), _max_norm_batch()
    step = _recomputing_step(model, batch, _max_norm_loss)
    before = copy.deepcopy(model.state_dict())
    state, _ = verify.planned_step(model, batch, step.traced, step.planned)
    want = verify.eager_step(model, batch, _max_norm_loss)[0]
    assert sorted(state.params) == sorted(want.params) == ["bag.weight", "emb.weight"]
    assert all(torch.equal(state.params[k], want.params[k]) for k in state.params)
    agreement = check_step(step, _max_norm_loss, *batch)
    assert agreement.bitwise, agreement.mismatches
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    planned = verify._planned
    _nudge_planned(monkeypatch, "params", "bag.weight")
    agreement = check_step(step, _max_norm_loss, *batch)
    assert len(agreement.mismatches) == 1 and agreement.mismatches[0].startswith("param bag.weight: max |diff| ")

    def not_applied(*args, **kwargs):  # (a step leaving the weight as it was: compared with that)
        state, result = planned(*args, **kwargs)
        del state.params["bag.weight"]
        return state, result

    monkeypatch.setattr(verify, "_planned", not_applied)
    agreement = check_step(step, _max_norm_loss, *batch)
    assert len(agreement.mismatches) == 1 and agreement.mismatches[0].startswith("param bag.weight: max |diff| ")


def test_an_update_the_step_cannot_apply_is_refused_before_anything_is_written():
    model, batch = _MaxNorm(), _max_norm_batch()
    step = remat.optimize(model, batch, _max_norm_loss, budget="100%", method="checkpoint_all", cost_model=None)
    step.traced = dataclasses.replace(step.traced, outputs=tuple(
        OutputSlot(s.role, "gone.weight", s.fx_name) if s.key == "emb.weight" and s.role is OutputRole.UPDATE else s
        for s in step.traced.outputs))
    before = copy.deepcopy(model.state_dict())
    message = ("the traced step modifies 'gone.weight' in place, which is no parameter, buffer or batch tensor of "
               "this model; remat cannot apply that update, and nothing was written: register the tensor as a "
               "buffer (module.register_buffer) or do not modify it in place, and trace (or optimize) again")
    with pytest.raises(TraceError, match=re.escape(message)):
        step(*batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(TraceError, match=re.escape(message)):
        verify.planned_step(model, batch, step.traced, step.planned)


# ---------------------------------------------------------------------------- inputs modified in place
class _Doubling(nn.Module):
    """A forward that modifies its input in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, x):
        x.mul_(2.0)
        return self.net(x)


def test_an_input_the_forward_modifies_in_place_is_modified_as_in_eager_and_checked(monkeypatch):
    model = _Doubling()
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    step = _recomputing_step(model, (x.clone(), y))
    given = x.clone()
    agreement = check_step(step, _loss, x, y)
    assert agreement.bitwise, agreement.mismatches  # each step doubled its own copy of x, once
    assert torch.equal(x, given) and x._version == 0  # the caller's batch is left as it was
    xe, xp, eager = x.clone(), x.clone(), copy.deepcopy(model)
    want = _loss(eager, xe, y)
    want.backward()
    assert torch.equal(step(xp, y), want.detach())
    assert torch.equal(xp, xe) and torch.equal(xe, 2 * x)
    _equal_grads(eager, model)
    planned = verify._planned

    def nudged(*args, **kwargs):
        state, result = planned(*args, **kwargs)
        state.batch["batch[0]"] = state.batch["batch[0]"] + 1
        return state, result

    monkeypatch.setattr(verify, "_planned", nudged)
    agreement = check_step(step, _loss, x, y)
    assert agreement.mismatches == ("batch[0]: max |diff| 1",)


def _nudge_planned(monkeypatch, field: str, key: str) -> None:
    """Every planned run's ``StepState.<field>[key]`` one ulp up: a difference check_step must name."""
    planned = verify._planned

    def nudged(*args, **kwargs):
        state, result = planned(*args, **kwargs)
        t = getattr(state, field)[key]
        getattr(state, field)[key] = torch.nextafter(t, torch.full_like(t, math.inf))
        return state, result

    monkeypatch.setattr(verify, "_planned", nudged)


# ---------------------------------------------------------------------------- one gradient, two parameters
class _TwoEmbeddings(nn.Module):
    """Two parameters added whole (no broadcast): the step computes one gradient for both."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.pos = nn.Parameter(torch.randn(8, 16))
        self.typ = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return torch.tanh(self.lin(x) + self.pos + self.typ)


def _squares(m, x):
    return (m(x) ** 2).sum()


def test_parameters_with_one_gradient_get_tensors_of_their_own():
    """Sharing the step's one tensor as both .grad made accumulation and clipping count it
    twice (both grads ended as g1 + 2 g2), silently."""
    eager, planned = _TwoEmbeddings(), _TwoEmbeddings()
    step = remat.optimize(planned, (torch.randn(8, 16),), _squares, budget="100%", method="checkpoint_all")
    torch.manual_seed(1)
    batches = [torch.randn(8, 16) for _ in range(2)]
    for x in batches:  # two micro-batches, no zero_grad: the second adds to the first
        _squares(eager, x).backward()
        step(x)
    assert planned.pos.grad.untyped_storage().data_ptr() != planned.typ.grad.untyped_storage().data_ptr()
    _equal_grads(eager, planned)
    for m in (eager, planned):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    _equal_grads(eager, planned)


# ---------------------------------------------------------------------------- hooks on parameters
def test_hooks_on_parameters_run_as_in_eager():
    """A traced step computes gradients without autograd, so hooks registered on parameters did
    not run: a hook halving a gradient was ignored, and a post-accumulate hook (an optimizer
    stepping in the backward) never fired, silently."""
    eager, planned = _mlp(), _mlp()
    x, y = torch.randn(32, 16), torch.randint(0, 3, (32,))
    step = _recomputing_step(planned, (x, y))
    fired = {"eager": [], "planned": []}
    for model, name in ((eager, "eager"), (planned, "planned")):
        model[0].weight.register_hook(lambda g: g * 0.5)
        model[2].bias.register_hook(lambda g: g.add_(1.0))  # in place, returning None
        model[4].weight.register_post_accumulate_grad_hook(lambda p, name=name: fired[name].append(p.grad.clone()))
    assert check_step(step, _loss, x, y).bitwise
    for _ in range(2):
        _loss(eager, x, y).backward()
        step(x, y)
    _equal_grads(eager, planned)
    assert len(fired["planned"]) == len(fired["eager"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(fired["planned"], fired["eager"]))


class _Tied(nn.Module):
    """An embedding shared with the output head (its gradient has two parts) and a BatchNorm
    whose running statistics the forward updates."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.norm = nn.Embedding(20, 16), nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, ids):
        h = self.norm(torch.tanh(self.mix(self.emb(ids))).transpose(1, 2)).transpose(1, 2)
        return h @ self.emb.weight.t()


def _lm(m, ids):
    return F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("build", [_mlp, _Tied], ids=["mlp", "tied"])
def test_parameter_hooks_run_in_eagers_order_one_parameter_at_a_time(build):
    """An optimizer stepping in the backward (a post-accumulate hook per parameter) whose lr
    reads another parameter, and a tensor hook reading another parameter's .grad: the step ran
    every hook after every gradient, in the parameters' order (the first layer's first), where
    eager runs each as its gradient is done (the head's first), so every parameter but one
    ended other than eager's, silently. Each hook also sees the running statistics the forward
    updated, as in eager."""
    torch.manual_seed(0)
    eager = build()
    planned = copy.deepcopy(eager)
    if build is _mlp:
        batch, loss_fn, head = (torch.randn(32, 16), torch.randint(0, 3, (32,))), _loss, lambda m: m[4].weight
    else:
        batch, loss_fn, head = (torch.randint(0, 20, (4, 6)),), _lm, lambda m: m.mix.weight
    step = _recomputing_step(planned, batch) if build is _mlp else remat.optimize(
        planned, batch, loss_fn, budget="100%", method="checkpoint_all", cost_model=None)
    seen = {"eager": [], "planned": []}
    for model, name in ((eager, "eager"), (planned, "planned")):
        names = {p: n for n, p in model.named_parameters()}

        def reads_another(grad, model=model, name=name):
            seen[name].append(head(model).grad is not None)

        def steps(p, model=model, name=name, names=names):
            seen[name].append(names[p])
            stats = model.norm.running_mean.sum() if build is _Tied else 0.0
            with torch.no_grad():
                p.add_(p.grad, alpha=-0.1 / (1.0 + float(head(model).norm()) + float(stats)))
            p.grad = None

        for p in model.parameters():
            p.register_hook(reads_another)
            p.register_post_accumulate_grad_hook(steps)
    for _ in range(2):
        loss_fn(eager, *batch).backward()
        step(*batch)
    assert seen["planned"] == seen["eager"] and len(seen["eager"]) == 4 * len(list(eager.parameters()))
    for (key, p), q in zip(eager.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), key
    assert step.traced.grad_order[0] != next(iter(dict(planned.named_parameters())))  # (the head's first)


def test_a_step_under_inference_mode_or_no_grad_is_refused_and_writes_nothing():
    """Eager's backward raises under ``torch.inference_mode()``; the step ran and left every
    ``.grad`` an inference tensor, so the next step failed accumulating into it."""
    import remat
    from remat.errors import TraceError

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    step = remat.optimize(model, x, lambda m, x: m(x).square().mean(), budget=1.0, method="checkpoint_all",
                          cost_model=None)
    with torch.inference_mode(), pytest.raises(TraceError, match=r"under torch.inference_mode\(\), where eager "
                                                                  r"PyTorch's backward raises"):
        step(x)
    assert all(p.grad is None for p in model.parameters())
    # under no_grad the step trained all the same, where eager's backward raises
    for off in (torch.no_grad, lambda: torch.set_grad_enabled(False)):
        with off(), pytest.raises(TraceError, match=r"with gradients off \(under torch.no_grad\(\) or "
                                                    r"torch.set_grad_enabled\(False\)\), where eager PyTorch's "
                                                    r"backward raises"):
            step(x)
        assert all(p.grad is None for p in model.parameters())
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        model(x).square().mean().backward()  # (what eager does there)
    step(x)
    step(x)  # accumulates, as after any step
    assert all(p.grad is not None and not p.grad.is_inference() for p in model.parameters())


def test_gradients_hooks_replace_are_freed_at_once():
    """The step held every gradient it computed until its end, so the new gradients hooks return
    (``g.clamp(...)``) came on top of all of them: three 1 MiB layers measured 3.0 MB (49%) over
    the predicted peak. Now each is freed when its hook's result takes its place, as eager
    frees it: at most one gradient more than the prediction, the one a hook is making."""
    from remat.memory import MemoryMethod, measure_peak

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)], nn.Linear(512, 10))
    x, y = torch.randn(8, 512), torch.randint(0, 10, (8,))
    step = remat.optimize(model, (x, y), _loss, budget="100%", method="checkpoint_all")
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    resident = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x, y])
    report = measure_peak(lambda: step(x, y), method=MemoryMethod.PROFILER, resident_bytes=resident)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert report.peak_bytes <= step.report.predicted_peak_bytes + largest, (report.peak_bytes, largest)
    assert all(p.grad.abs().max() <= 0.01 for p in model.parameters())


def test_a_parameter_that_is_a_strided_view_gets_autograds_gradient_layout():
    """autograd gives a parameter's own strides to its .grad only where the parameter is dense
    (a transposed weight); ``w[:, ::2]``'s gradient is contiguous. The step copied it into
    (1024, 2) strides, a storage twice the gradient's, over the budget."""
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 10))
        m.w = nn.Parameter(torch.randn(64, 128)[:, ::2])
        m.t = nn.Parameter(torch.randn(64, 64).t())  # (dense, transposed: keeps its strides)
        return m

    def loss(m, x, y):
        return F.cross_entropy(m(torch.tanh(x @ m.w @ m.t)), y)

    eager, planned = build(), build()
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    step = remat.optimize(planned, (x, y), loss, budget="100%", method="checkpoint_all")
    loss(eager, x, y).backward()
    step(x, y)
    for name in ("w", "t"):
        e, p = getattr(eager, name).grad, getattr(planned, name).grad
        assert p.stride() == e.stride() and p.untyped_storage().nbytes() == e.untyped_storage().nbytes(), name
        assert torch.equal(p, e)
    assert planned.w.grad.stride() == (64, 1) and planned.t.grad.stride() == (1, 64)
    # the fixed bytes are the storages' (w's base, 4 B beyond its last element, was left out:
    # a plan at 100% measured 4 B over its budget)
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in [*planned.parameters(), x, y]}
    assert step.traced.graph.fixed_bytes == sum(storages.values())
