"""remat.trace_errors: what cannot be traced is refused with a message naming it and a remedy.
Sparse tensors in a training step are refused by name (remat plans dense tensors, whose bytes
it counts; a sparse embedding gradient failed deep inside the graph builder); the message of an
error tracing met reads whole."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import verify
from remat.errors import TraceError


@pytest.mark.parametrize("kind", ["embedding", "embedding_bag"])
def test_a_sparse_embedding_is_refused_with_the_module_and_the_setting_named(kind):
    torch.manual_seed(0)
    table = nn.Embedding(100, 16, sparse=True) if kind == "embedding" else nn.EmbeddingBag(100, 16, sparse=True)
    model = nn.Sequential(table, nn.Linear(16, 3))
    ids, y = torch.randint(0, 100, (8, 4)), torch.randint(0, 3, (8,))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x).reshape(8, -1, 3).mean(1), y)  # noqa: E731
    loss_fn(model, ids, y).backward()  # (eager trains it)
    kind_name = type(table).__name__
    with pytest.raises(TraceError, match=f"module '0' \\({kind_name}\\) has sparse=True, so it makes a "
                                         "torch.sparse_coo tensor in the training step \\(node .*\\); remat plans "
                                         "dense tensors only.*set sparse=False"):
        remat.optimize(model, (ids, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    table.sparse = False  # the remedy plans
    step = remat.optimize(model, (ids, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    from remat.verify import check_step

    assert check_step(step, loss_fn, ids, y).bitwise


def test_a_sparse_tensor_made_outside_a_module_is_refused_with_the_node_named():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(100, 16))
    model = nn.ParameterList([weight])
    ids = torch.randint(0, 100, (8, 4))
    loss_fn = lambda m, ids: F.embedding(ids, m[0], sparse=True).square().mean()  # noqa: E731
    with pytest.raises(TraceError, match="model ParameterList makes a torch.sparse_coo tensor in the training step "
                                         "\\(node .*\\); remat plans dense tensors only.*compute it with dense"):
        remat.optimize(model, (ids,), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)


def test_an_error_eager_also_raises_is_quoted_to_a_word_boundary_without_generated_code_lines():
    """Autograd's in-place error (eager raises it too) was cut mid-word at 300 characters and
    placed at ``<string>:1``, a line of generated code, not the user's."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            h = self.linear(x).relu()
            h.mul_(2.0)  # relu's backward reads its output
            return h

    model, x = InPlace(), torch.randn(4, 8)
    loss_fn = eval("lambda m, x: m(x).sum()")  # (defined in generated code, as ``<string>``)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_fn(model, x).backward()  # eager fails the same way
    with pytest.raises(TraceError) as caught:
        remat.optimize(model, (x,), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    message = str(caught.value)
    assert "modified by an inplace operation" in message and "<string>" not in message
    assert "check that loss_fn(model, *batch) runs eagerly" in message


def test_a_long_first_line_is_cut_at_a_word_boundary():
    from remat.trace_errors import _first_line

    words = " ".join(f"word{i}" for i in range(200))
    cut = _first_line(RuntimeError(words + "\nsecond line"))
    assert cut.endswith(" ...") and len(cut) <= 404 and words.startswith(cut[:-4])
    assert cut[:-4].split(" ")[-1] in words.split(" ")  # a whole word
    assert _first_line(RuntimeError("short.\nmore")) == "short" and _first_line(RuntimeError("")) == ""


def test_an_input_computed_outside_and_modified_in_place_is_refused_with_the_clone_named():
    """Eager lets the forward modify a batch tensor with a grad_fn in place; remat traces batch
    tensors as leaves, where autograd refuses it, and the message quoted only autograd's words."""

    class Doubling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 3)

        def forward(self, x):
            x.mul_(2.0)
            return self.linear(x)

    torch.manual_seed(0)
    model, encoder = Doubling(), nn.Linear(4, 8)
    x = encoder(torch.randn(5, 4))  # (a grad_fn: eager allows the in-place change)
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    loss_fn(model, x.clone()).backward()
    with pytest.raises(TraceError, match="an in-place operation on a tensor that requires grad and has no history.*"
                                         "clone it before modifying it \\(x = x.clone\\(\\)\\)"):
        remat.optimize(model, (x,), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)


class _OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x):
        h = self.lin(x).relu()
        return h * (torch.rand(h.shape, generator=self.gen) > 0.3)


def test_a_random_op_with_a_generator_of_its_own_is_refused_and_the_generator_left_untouched():
    """remat replays the default generator where a plan recomputes a random op: a mask drawn
    from the model's own generator came out another mask when recomputed (gradients 5e-3 off),
    and profiling drew from it too."""
    model = _OwnGenerator()
    state = model.gen.get_state().clone()
    with pytest.raises(TraceError, match=r"node rand \(aten.rand.generator\) draws from a torch.Generator of its "
                                         r"own \(gen of the model\).*drop generator=\.\.\., seed it with torch.manual_seed"):
        remat.optimize(model, (torch.randn(4, 8),), lambda m, x: m(x).sum(), budget=1.0, method="checkpoint_all")
    assert torch.equal(model.gen.get_state(), state)
    nested = nn.Sequential(nn.Identity(), model)  # named by its path in the model
    with pytest.raises(TraceError, match=r"own \(1\.gen of the model\)"):
        remat.optimize(nested, (torch.randn(4, 8),), lambda m, x: m(x).sum(), budget=1.0, method="checkpoint_all")


class _LogSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(20, 12)

    def forward(self, x):
        return self.lin(x).log_softmax(-1)


_WEIGHTS = torch.linspace(0.5, 2.0, 12)


def _ctc(m, x, t):
    return F.ctc_loss(m(x), t, torch.full((4,), 40), torch.tensor([10, 5, 8, 3]))


def _closure_weights(m, x, t):
    return F.nll_loss(m(x).flatten(0, 1), t.flatten(), weight=_WEIGHTS)


def _logs(m, x, t):
    loss = F.nll_loss(m(x).flatten(0, 1), t.flatten())
    print(loss.item())
    return loss


@pytest.mark.parametrize("loss_fn, targets, message", [
    (_ctc, torch.randint(1, 12, (4, 10)),
     r"op aten._ctc_loss.Tensor, which sizes its working tensors by the values of its inputs .* in loss_fn at "
     r"test_trace_errors.py:\d+ .*no fixed-shape form of it exists in PyTorch.*train this model without remat"),
    (_closure_weights, torch.randint(0, 12, (40, 4)),
     r"reached aten.nll_loss_forward.default in loss_fn at .*loss_fn uses a tensor that is neither the model's nor "
     r"the batch's .*pass it in the batch"),
    (_logs, torch.randint(0, 12, (40, 4)),
     r"a tensor's value read in Python .* in loss_fn at test_trace_errors.py:\d+ `print\(loss.item\(\)\)`.*to log "
     r"the loss, read the tensor step\(batch\) returns"),
])
def test_a_failure_in_loss_fn_is_placed_in_loss_fn_with_a_remedy_that_applies(loss_fn, targets, message):
    """loss_fn takes the model as its first argument, so its frame was taken for one of the
    model's methods ("in the model (M)"); and ctc_loss was told to use torch.where."""
    with pytest.raises(TraceError, match=message):
        remat.optimize(_LogSoftmax(), (torch.randn(40, 4, 20), targets), loss_fn, budget=1.0,
                       method="checkpoint_all", cost_model=None)


def _passes_through(f):
    import functools

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


class _Decorated(nn.Module):
    """A forward behind a decorator, as transformers' are."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @_passes_through
    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            return h
        return -h


def test_a_failure_in_a_decorated_forward_names_its_module():
    model = nn.Sequential(_Decorated())
    with pytest.raises(TraceError, match=r"in module '0' \(_Decorated\) at test_trace_errors.py:\d+ `if h.sum\(\) > 0:`"):
        remat.optimize(model, (torch.randn(2, 4),), lambda m, x: m(x).sum(), budget=1.0, method="checkpoint_all",
                       cost_model=None)


class _RunningMean(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 4)
        self.register_buffer("ema", torch.zeros(64))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        out = self.b(h - self.ema)
        new = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        if self.how == "rebind":
            self.ema = new
        elif self.how == "data":
            self.ema.data = new
        elif self.how == "weight data":
            self.a.weight.data = self.a.weight.data * 0.5
        else:  # the remedy the refusal names
            with torch.no_grad():
                self.ema.copy_(new)
        return out


@pytest.mark.parametrize("how, message", [
    ("rebind", r"the model \(_RunningMean\) rebinds its buffer 'ema' \(self.ema = ...\)"),
    ("data", r"the model \(_RunningMean\) replaces the data of its buffer 'ema' \(self.ema.data = ...\)"),
    ("weight data", r"module 'a' \(Linear\) replaces the data of its parameter 'weight' \(self.weight.data = ...\)"),
])
def test_a_parameter_or_buffer_replaced_in_forward_is_refused_and_the_update_in_place_trains_like_eager(how, message):
    """A traced step reads the tensors it is handed and writes back what it modified in place: a
    buffer rebound in forward (a running average) stayed at zero, a weight halved by ``.data =``
    was not, while eager carried both into the next step (gradients 0.04 off, silently)."""
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    x, y = torch.randn(512, 8), torch.randint(0, 4, (512,))
    model = _RunningMean(how)
    weight = model.a.weight.detach().clone()
    with pytest.raises(TraceError, match=message + r" in the training step.*update it in place under torch.no_grad"):
        remat.optimize(model, (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    assert torch.equal(model.ema, torch.zeros(64)) and torch.equal(model.a.weight, weight)  # left as it was
    torch.manual_seed(0)
    eager, planned = _RunningMean("in place"), _RunningMean("in place")
    planned.load_state_dict(eager.state_dict())
    step = remat.optimize(planned, (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    for _ in range(3):
        eager.zero_grad()
        planned.zero_grad()
        want = loss_fn(eager, x, y)
        want.backward()
        assert torch.equal(step(x, y), want)
        assert torch.equal(planned.ema, eager.ema) and eager.ema.abs().sum() > 0
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(planned.parameters(), eager.parameters()))


class _CentringAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 3), nn.Linear(3, 8)

    def forward(self, x):
        x.sub_(x.mean(0))  # centres its input in place
        return self.dec(torch.tanh(self.enc(x)))


def test_a_batch_tensor_modified_in_place_that_shares_memory_with_another_input_is_refused():
    """Eager sees an in-place change to ``x`` through every tensor sharing its memory (the
    target of an autoencoder's batch ``(x, x)``); the traced step read the target as it was
    handed (loss 9.8 against eager's 1.0, silently)."""
    loss_fn = lambda m, x, target: F.mse_loss(m(x), target)  # noqa: E731
    torch.manual_seed(0)
    model = _CentringAutoencoder()
    example = torch.randn(16, 8) + 3
    step = remat.optimize(model, (example, example.clone()), loss_fn, budget=1.0, method="checkpoint_all",
                          cost_model=None)
    base = torch.randn(17 * 8) + 3
    x = base[:128].view(16, 8)
    kept = base.clone()
    for target in (x, x.view(-1).view(16, 8), base[8:].view(16, 8)):  # itself, a view, an overlapping view
        with pytest.raises(TraceError, match=r"batch\[0\] and batch\[1\] share memory, and the step modifies "
                                             r"batch\[0\] in place.*pass tensors that do not share memory "
                                             r"\(batch\[1\].clone\(\), which keeps its values\)"):
            step(x, target)
    assert torch.equal(base, kept)  # nothing ran
    eager = _CentringAutoencoder()
    eager.load_state_dict(model.state_dict())
    want = loss_fn(eager, x.clone(), x.clone())
    assert torch.equal(step(x.clone(), x.clone()), want)  # the remedy: as eager with a target of its own
    halves = torch.randn(256) + 3  # two halves of one storage overlap nowhere: not refused
    want = loss_fn(eager, halves[:128].clone().view(16, 8), halves[128:].view(16, 8))
    assert torch.equal(step(halves[:128].view(16, 8), halves[128:].view(16, 8)), want)
    # such an example batch is refused by optimize itself, before planning, and left as it was
    kept = example.clone()
    with pytest.raises(TraceError, match=r"batch\[0\] and batch\[1\] share memory, and the step modifies "
                                         r"batch\[0\] in place"):
        remat.optimize(_CentringAutoencoder(), (example, example), loss_fn, budget=1.0, method="checkpoint_all",
                       cost_model=None)
    assert torch.equal(example, kept)


class _CheckpointedDropout(nn.Module):
    def __init__(self, reentrant, dropout):
        super().__init__()
        self.reentrant, self.dropout = reentrant, dropout
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

    def block(self, h):
        return F.dropout(torch.tanh(self.a(h)), self.dropout, training=True)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.b(checkpoint(self.block, x, use_reentrant=self.reentrant, preserve_rng_state=False))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_that_does_not_preserve_the_random_state_around_dropout_is_refused(reentrant):
    """Eager's backward recomputes such a block with a new dropout mask; traced as a plain call,
    the step kept the first mask (gradients 0.08 apart, silently). Without random ops inside,
    the setting changes nothing and the step traces."""
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    x = torch.randn(16, 8, requires_grad=reentrant)  # (a reentrant checkpoint needs an input requiring grad)
    batch = (x, torch.randint(0, 4, (16,)))
    with pytest.raises(TraceError, match=r"torch.utils.checkpoint\(_CheckpointedDropout.block, preserve_rng_state="
                                         r"False\) draws random numbers \(aten.native_dropout.default\).*pass "
                                         r"preserve_rng_state=True"):
        remat.optimize(_CheckpointedDropout(reentrant, 0.5), batch, loss_fn, budget=1.0, method="checkpoint_all",
                       cost_model=None)
    step = remat.optimize(_CheckpointedDropout(reentrant, 0.0), batch, loss_fn, budget=1.0,
                          method="checkpoint_all", cost_model=None)
    assert torch.isfinite(step(*batch))


class _CheckpointedNorm(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(16, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.body, self.stem(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_whose_function_updates_buffers_is_refused_naming_the_module(reentrant):
    """A batch norm in training mode inside torch.utils.checkpoint: eager's backward runs the
    block again and updates the running statistics a second time (``num_batches_tracked`` 2
    after one step); traced as a plain call, the step updated them once (running_var 0.08 from
    eager's), silently. In eval mode the norm updates nothing and the step traces and runs as
    eager does."""
    torch.manual_seed(0)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    with pytest.raises(TraceError, match=r"torch.utils.checkpoint\(Sequential\) modifies buffer 'num_batches_tracked' "
                                         r"of module 'body.1' \(BatchNorm1d\) in place \(and 2 more\): eager PyTorch's "
                                         r"backward runs the checkpointed function again .*take the module out of the "
                                         r"checkpointed function"):
        remat.optimize(_CheckpointedNorm(reentrant), batch, loss_fn, budget=1.0, method="checkpoint_all",
                       cost_model=None)
    model = _CheckpointedNorm(reentrant)
    model.body[1].eval()
    step = remat.optimize(model, batch, loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    assert verify.check_step(step, loss_fn, *batch).bitwise


class _AllCheckpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.body, x, use_reentrant=self.reentrant)


def test_a_reentrant_checkpoint_of_the_whole_model_on_a_batch_not_requiring_grad_is_refused_with_its_remedy():
    """As in eager PyTorch, nothing inside a reentrant checkpoint none of whose inputs requires
    grad gets a gradient; when that is the whole model the loss has none, and the message said
    only to check that loss_fn does not detach its output. It names the checkpoint and the
    remedy, which traces."""
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"), pytest.raises(
            TraceError, match=r"no grad_fn\); torch.utils.checkpoint\(Sequential, use_reentrant=True\) got no input "
                              r"that requires grad.*pass use_reentrant=False"):
        remat.optimize(_AllCheckpointed(True), x, loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    step = remat.optimize(_AllCheckpointed(False), x, loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    assert verify.check_step(step, loss_fn, x).bitwise


class _Reseeding(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "manual_seed":
            torch.manual_seed(42)  # the same noise at every step
        elif self.how == "fork_rng":
            with torch.random.fork_rng():  # noise that leaves the global stream alone
                h = h + 0.1 * torch.randn_like(h)
        elif self.how == "generator":
            torch.default_generator.manual_seed(7)  # (a method, not a function remat can watch)
        return self.b(F.dropout(h, 0.3))


@pytest.mark.parametrize("how, message", [
    ("manual_seed", r"calls torch.manual_seed at test_trace_errors.py:\d+ `torch.manual_seed\(42\)"),
    ("fork_rng", r"calls torch.random.fork_rng at "),
    ("generator", r"changes torch's default random generator \(its state differs after the trace\)"),
])
def test_a_step_that_seeds_or_restores_the_generator_is_refused_and_the_generator_left_as_it_was(how, message):
    """Seeding or restoring torch's generator is a Python call no trace records: the traced step
    drew on from its starting state where eager reseeded (loss 0.036 apart, gradients 0.03 off,
    another generator state after the step), silently."""
    torch.manual_seed(3)
    model, batch = _Reseeding(how), (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    state = torch.get_rng_state()
    importlib.import_module("torch._dynamo")  # (its first import wraps torch.manual_seed)

    functions = (torch.manual_seed, torch.random.fork_rng, torch.set_rng_state)
    with pytest.raises(TraceError, match=r"the training step " + message + r".*seed outside the step"):
        remat.optimize(model, batch, lambda m, x, y: F.cross_entropy(m(x), y), budget=1.0,
                       method="checkpoint_all", cost_model=None)
    assert torch.equal(torch.get_rng_state(), state)
    assert (torch.manual_seed, torch.random.fork_rng, torch.set_rng_state) == functions  # put back


def test_a_value_read_inside_a_library_function_names_the_function():
    """``F.gaussian_nll_loss`` checks its variances' values: the refusal pointed at the user's
    line alone, which reads no value itself."""
    def loss_fn(m, x, y):
        out = m(x)
        return F.gaussian_nll_loss(out, y, torch.ones_like(out))

    with pytest.raises(TraceError, match=r"in loss_fn at test_trace_errors.py:\d+ `return F.gaussian_nll_loss\(.*\)` "
                                         r"\(inside torch.nn.functional.gaussian_nll_loss\)"):
        remat.optimize(nn.Linear(8, 4), (torch.randn(16, 8), torch.randn(16, 4)), loss_fn, budget=1.0,
                       method="checkpoint_all", cost_model=None)


METRICS: dict = {}


def test_a_tensor_the_step_stores_outside_the_model_is_warned_about():
    """A metric ``loss_fn`` stores for logging, or a forward hook's stash, stayed the trace's
    fake tensor, never updated by ``step()`` (reading it failed with an error about fake
    tensors), with no word of why."""
    import warnings

    stash = []
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    handle = model[0].register_forward_hook(lambda mod, args, out: stash.append(out))

    def loss_fn(m, x, y):
        out = m(x)
        METRICS["acc"] = (out.argmax(1) == y).float().mean()
        return F.cross_entropy(out, y)

    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.warns(UserWarning, match=r"loss_fn's global 'METRICS'\['acc'\], a forward hook of module '0' \(Linear\)'s "
                                         r"closure variable 'stash'\[0\] hold tensors the training step made while it "
                                         r"was traced; .*step\(\) will never update them"):
        remat.optimize(model, batch, loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    handle.remove()
    METRICS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a step that stores nothing is not warned about
        remat.optimize(model, batch, lambda m, x, y: F.cross_entropy(m(x), y), budget=1.0, method="checkpoint_all",
                       cost_model=None)


class _CollectsItsOutputs(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 4))
        self.outputs = []

    def forward(self, x):
        out = super().forward(x)
        self.outputs.append(out)
        return out


def test_a_list_of_the_model_the_forward_appends_tensors_to_is_warned_about_not_refused():
    """A model collecting its outputs in a list of its own was not warned about (the list kept
    the trace's tensors, step() never appended); nor is it a counter, as a list of numbers is."""
    model = _CollectsItsOutputs()
    with pytest.warns(UserWarning, match=r"model.outputs\[0\].* the training step made while it was traced"):
        step = remat.optimize(model, torch.randn(4, 8), lambda m, x: m(x).sum(), budget=1.0,
                              method="checkpoint_all", cost_model=None)
    model.outputs.clear()
    step(torch.randn(4, 8))
    assert model.outputs == []


STASHED: list = []
LOGGED: dict = {}


class _StashesInGlobals(nn.Module):
    """A forward stashing an activation in a module-level list, and a helper method logging
    one in a module-level dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x).tanh()
        STASHED.append(h)
        self.log(h)
        return self.c(h)

    def log(self, h):
        LOGGED["h"] = h.detach()


def test_a_tensor_the_forward_stores_in_a_global_is_warned_about():
    """Activations a forward stashed in a global list or dict stayed the trace's fake tensors
    (reading one failed), with no warning: only what ``loss_fn`` names was looked at."""
    STASHED.clear()
    LOGGED.clear()
    with pytest.warns(UserWarning, match=r"_StashesInGlobals.forward's global 'STASHED'\[0\], "
                                         r"_StashesInGlobals.log's global 'LOGGED'\['h'\] hold tensors the training "
                                         r"step made while it was traced; .*step\(\) will never update them"):
        remat.optimize(_StashesInGlobals(), (torch.randn(4, 8), torch.randint(0, 4, (4,))),
                       lambda m, x, y: F.cross_entropy(m(x), y), budget=1.0, method="checkpoint_all", cost_model=None)
    STASHED.clear()
    LOGGED.clear()


class _KeepsItsOutput(nn.Sequential):
    def forward(self, x):
        out = super().forward(x)
        self.last = out.detach()  # for logging, as a user might
        return out


def test_a_tensor_the_forward_stores_on_a_module_is_warned_about_and_left_as_it_was():
    """``self.last = out.detach()`` in forward: tracing puts the attribute back as it was
    (unset), and step() never sets it, so reading it failed later with no word of why."""
    model = _KeepsItsOutput(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    with pytest.warns(UserWarning, match=r"the model \(_KeepsItsOutput\) attribute 'last' holds a tensor the "
                                         r"training step made while it was traced; .*step\(\) will never update it "
                                         r".*a module attribute keeps what it held before tracing, or stays unset"):
        step = remat.optimize(model, batch, lambda m, x, y: F.cross_entropy(m(x), y), budget=1.0,
                              method="checkpoint_all", cost_model=None)
    assert "last" not in vars(model)
    step(batch)
    assert "last" not in vars(model)


class _ReshapesAndScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = x.contiguous().mul_(2)  # an alias of a contiguous x: eager writes into it, not into a copy
        return self.lin(h.reshape(-1, 8) + x.reshape(-1, 8))


def test_a_batch_of_another_layout_is_refused_and_one_differing_only_in_size_one_dimensions_runs():
    """The layout of the example is built into the step (views, in-place writes, gradients'
    layouts): a transposed batch of the same shape made the step write into the caller's tensor
    where eager wrote into a copy, a loss 0.10 apart, silently (or a view failed in the step)."""
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    torch.manual_seed(0)
    model = _ReshapesAndScales()
    step = remat.optimize(model, (torch.randn(4, 1, 8),), loss_fn, budget=1.0, method="checkpoint_all",
                          cost_model=None)
    transposed = torch.randn(1, 8, 4).permute(2, 0, 1)  # shape (4, 1, 8), strides (1, 32, 4)
    kept = transposed.clone()
    with pytest.raises(TraceError, match=r"batch\[0\] has strides \(1, 32, 4\) but the step was traced with an "
                                         r"example batch\[0\] of strides \(8, 0, 1\).*pass batch\[0\].contiguous\(\)"):
        step(transposed)
    assert torch.equal(transposed, kept)
    assert verify.check_step(step, loss_fn, transposed.contiguous()).bitwise
    same = torch.randn(4, 8).as_strided((4, 1, 8), (8, 1, 1))  # only the size-1 dimension's stride differs
    assert verify.check_step(step, loss_fn, same).bitwise


@pytest.mark.parametrize("where", ["loss_fn", "forward"])
def test_backward_called_inside_the_step_is_refused_and_a_gradient_penalty_is_not(where):
    # eager's gradients are that backward's plus the step's own: a traced step had half of them
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            out = self.fc(x)
            if where == "forward":
                out.sum().backward(retain_graph=True)
            return out

    def calls_backward(m, x, y):
        loss = F.cross_entropy(m(x), y)
        if where == "loss_fn":
            loss.backward(retain_graph=True)
        return loss

    model = Inner()
    with pytest.raises(TraceError, match=r"backward\(\) was called while the model and loss_fn ran.*return the loss "
                                         r"from loss_fn without calling backward\(\).*torch\.autograd\.grad"):
        remat.optimize(model, (x, y), calls_backward, budget=1.0, method="checkpoint_all", cost_model=None)
    assert torch.autograd.backward.__name__ == "backward"  # (put back)
    where = "neither"

    def penalty(m, x, y):  # autograd.grad inside the step is the step's own, and plans
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(m(x), y)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + g.pow(2).sum()

    step = remat.optimize(model, (x, y), penalty, budget=1.0, method="checkpoint_all", cost_model=None)
    assert verify.check_step(step, penalty, x, y).bitwise


def test_a_recurrent_modules_weights_list_is_its_parameters_after_tracing_and_not_warned_about():
    # functional_call's swap refreshed nn.GRU's _flat_weights with fake tensors, which stayed there
    import warnings

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(16, 32, batch_first=True)  # (a multiple of 32: bitwise on every CPU)
            self.out = nn.Linear(32, 3)

        def forward(self, x):
            h, _ = self.gru(x)
            return self.out(h[:, -1])

    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(4, 5, 16), torch.randint(0, 3, (4,))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no stash warning about _flat_weights)
        step = remat.optimize(model, (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    gru = model.gru
    assert all(a is b for a, b in zip(gru._flat_weights, [gru.weight_ih_l0, gru.weight_hh_l0, gru.bias_ih_l0,
                                                          gru.bias_hh_l0]))
    assert float(gru._flat_weights[0].sum()) == float(gru.weight_ih_l0.sum())  # (a fake one raised)
    assert verify.check_step(step, loss_fn, x, y).bitwise


def test_a_plain_tensor_deciding_a_branch_gets_the_remedy_that_plans():
    # "register it (register_buffer)" led to a second refusal (a value read); float(tensor) plans
    class Gate(nn.Module):
        def __init__(self, as_number):
            super().__init__()
            self.fc, self.threshold, self.as_number = nn.Linear(6, 3), torch.tensor(0.5), as_number

        def forward(self, x):
            h = self.fc(x)
            if (float(self.threshold) if self.as_number else self.threshold) > 0.3:
                h = h * 2
            return h

    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    with pytest.raises(TraceError, match=r"its value decides a Python branch.*read it as a number \(float\(tensor\)"):
        remat.optimize(Gate(False), (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    model = Gate(True)
    step = remat.optimize(model, (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    assert verify.check_step(step, loss_fn, x, y).bitwise
    model.threshold = torch.tensor(0.1)  # (the other branch: the step refuses to run the old one)
    with pytest.raises(TraceError, match="threshold"):
        step(x, y)


def test_an_in_place_transpose_of_a_view_names_the_out_of_place_form():
    # eager runs it; PyTorch's tracing gives its backward a gradient of the wrong shape (torch
    # 2.13); the message said to check that the step runs eagerly, which it does
    class Net(nn.Module):
        def __init__(self, in_place):
            super().__init__()
            self.l1, self.l2, self.in_place = nn.Linear(8, 8), nn.Linear(8, 3), in_place

        def forward(self, x):
            h = self.l1(x).view(x.shape[0], 2, 4)
            if self.in_place:
                h.transpose_(1, 2)
            else:
                h = h.transpose(1, 2)
            h.mul_(2.0)
            return self.l2(h.transpose(1, 2).reshape(x.shape[0], 8))

    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    loss_fn(Net(True), x, y).backward()  # (eager runs it)
    try:
        traced = remat.optimize(Net(True), (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    except TraceError as exc:
        assert "use the out-of-place form (h = h.transpose(1, 2))" in str(exc)
        assert "runs eagerly and uses only traceable" not in str(exc)
    else:  # (a PyTorch that traces it must then train as eager)
        assert verify.check_step(traced, loss_fn, x, y).bitwise
    step = remat.optimize(Net(False), (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    assert verify.check_step(step, loss_fn, x, y).bitwise


def test_a_failing_op_is_not_logged_by_fake_tensors_before_the_error(caplog):
    """A shape mismatch printed twenty lines of fake_tensor's log (a traceback) before remat's
    own error, which names the op's message, the module and the line."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(17, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with caplog.at_level("DEBUG"), pytest.raises(TraceError, match=r"same reduction dim.* in module '1' \(Linear\)"):
        remat.optimize(model, (x, y), lambda m, x, y: F.cross_entropy(m(x), y), budget=1.0,
                       method="checkpoint_all", cost_model=None)
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses.fake_tensor")]


class _Branched(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(16, 32), nn.Linear(32, 4), how

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "cond":
            h = torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t * -1, (h,))
        else:
            h = h * torch.rand(h.shape, generator=torch.default_generator)
        return self.b(h)


@pytest.mark.parametrize(("how", "said"), [
    ("cond", "the training step runs code torch.compile captures (torch.cond, torch.while_loop"),
    ("default", "is given generator=torch.default_generator"),
])
def test_refusals_that_blamed_the_wrong_thing_name_what_the_step_does(how, said):
    """torch.cond was refused as the user's call of torch.random.set_rng_state (dynamo's own);
    the default generator passed explicitly as 'a torch.Generator of its own'."""
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with pytest.raises(TraceError) as info:
        remat.optimize(_Branched(how), (x, y), lambda m, x, y: F.mse_loss(m(x), y), "100%")
    assert said in str(info.value) and "set_rng_state" not in str(info.value) and "of its own" not in str(info.value)


def test_an_unseeded_numpy_generator_made_in_the_forward_is_refused_and_a_seeded_one_is_not():
    """np.random.default_rng() draws fresh numbers from the system at every call; the traced step
    reused the first draw (losses constant where eager's varied)."""
    import numpy as np

    class Jitter(nn.Module):
        def __init__(self, seed) -> None:
            super().__init__()
            self.a, self.seed = nn.Linear(8, 2), seed

        def forward(self, x):
            return self.a(x) * float(np.random.default_rng(self.seed).uniform(0.5, 1.5))

    x, y = torch.randn(4, 8), torch.randn(4, 2)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    with pytest.raises(TraceError, match=r"makes an unseeded numpy generator \(np\.random\.default_rng\(\) at "):
        remat.optimize(Jitter(None), (x, y), loss_fn, "100%")
    assert np.random.default_rng.__module__.startswith("numpy")  # (put back)
    step = remat.optimize(Jitter(7), (x, y), loss_fn, "100%")  # the same numbers at every call, as in eager
    assert verify.check_step(step, loss_fn, (x, y)).bitwise


def test_a_lazy_module_not_yet_initialized_is_refused_with_the_remedy():
    """An uninitialized nn.LazyLinear gave PyTorch's own ValueError."""
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(4, 16), torch.randn(4, 2)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)  # noqa: E731
    with pytest.raises(TraceError, match=r"'0\.weight' is not initialized yet \(a lazy module"):
        remat.optimize(model, (x, y), loss_fn, "100%")
    with torch.no_grad():
        model(x)
    assert verify.check_step(remat.optimize(model, (x, y), loss_fn, "100%"), loss_fn, (x, y)).bitwise


@torch.jit.script
def _scripted_branch(h: torch.Tensor) -> torch.Tensor:
    if bool(h.sum() > 0):
        return h * 2.0
    return h * -1.0


def test_a_failing_torchscript_function_is_named_with_its_line():
    """The message said only that an operation failed in the TorchScript interpreter; the line
    it failed at was in the cause, dropped."""

    class Scripted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 2)

        def forward(self, x):
            return _scripted_branch(self.a(x))

    with pytest.raises(TraceError) as info:
        remat.optimize(Scripted(), (torch.randn(4, 8), torch.randn(4, 2)), lambda m, x, y: F.mse_loss(m(x), y), "100%")
    assert "a TorchScript function failed while traced, at test_trace_errors.py:" in str(info.value)
    assert "in _scripted_branch `if bool(h.sum() > 0):`" in str(info.value) and "drop @torch.jit.script" in str(info.value)


# ---------------------------------------------------------------------------- exact tensor classes
class _ExactClass(nn.Module):
    """A forward that doubles its input only when it is a plain torch.Tensor: eager doubles it,
    the trace's stand-ins are not torch.Tensor, so the traced step never did (loss 0.45 against
    eager's 1.90, from the first step)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if type(x) is torch.Tensor:
            x = x * 2
        return self.a(x)


def _scaled_if_parameter(w):
    return w * 2 if w.__class__ == nn.Parameter else w


class _ViaHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return F.linear(x, _scaled_if_parameter(self.a.weight))


class _ByName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if type(x).__name__ in ("Tensor", "Parameter"):
            x = x + 1
        return self.a(x)


class _Address(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if x.data_ptr() % 64 == 0:
            x = x * 2
        return self.a(x)


@pytest.mark.parametrize("model, text, what", [
    (_ExactClass, "type(x) is torch.Tensor", "asks a tensor's exact class"),
    (_ViaHelper, "w.__class__ == nn.Parameter", "asks a tensor's exact class"),
    (_ByName, "type(x).__name__ in (\"Tensor\", \"Parameter\")", "asks a tensor's exact class"),
    (_Address, "x.data_ptr()", "reads a tensor's address"),
])
def test_code_asking_a_tensors_exact_class_or_address_is_refused_with_its_line(model, text, what):
    """Such code takes another branch on the trace's stand-in tensors than in eager PyTorch, and
    every step ran that branch, silently."""
    import inspect

    torch.manual_seed(0)
    m, x = model(), torch.randn(4, 8)
    loss_fn = lambda mod, b: mod(b).pow(2).mean()  # noqa: E731
    with pytest.raises(TraceError) as refused:
        remat.optimize(m, x, loss_fn, budget="100%")
    message = str(refused.value)
    code = (_scaled_if_parameter if model is _ViaHelper else model.forward).__code__
    line = next(k for k, source in enumerate(inspect.getsource(code).splitlines()) if text in source) + code.co_firstlineno
    shown = f"{os.path.basename(code.co_filename)}:{line} `{inspect.getsource(code).splitlines()[line - code.co_firstlineno].strip()}`"
    assert f"{code.co_qualname} at {shown} {what} ({text})" in message, message
    assert ("isinstance(x, torch.Tensor)" if "class" in what else "compare tensors by their values") in message


def test_a_loss_fn_asking_a_tensors_exact_class_is_refused():
    model, x = nn.Linear(8, 8), torch.randn(4, 8)

    def loss_fn(m, b):
        out = m(b)
        return out.pow(2).mean() if type(out) == torch.Tensor else out.abs().mean()

    with pytest.raises(TraceError, match=r"loss_fn at test_trace_errors\.py:\d+ `return out.pow\(2\).mean\(\) if type\(out\) == "
                                         r"torch.Tensor else out.abs\(\).mean\(\)` asks a tensor's exact class "
                                         r"\(type\(out\) == torch.Tensor\)"):
        remat.optimize(model, x, loss_fn, budget="100%")


def test_asking_a_class_that_is_not_a_tensors_or_with_isinstance_traces_bitwise():
    """``isinstance``, and ``type()`` compared with other classes, mean the same on the stand-ins:
    they are not refused, and the step equals eager PyTorch."""

    class Checks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.scale = 2

        def forward(self, x):
            if isinstance(x, torch.Tensor) and type(self.scale) is int and type(self.a) == nn.Linear:
                x = x * self.scale
            return self.a(x)

    torch.manual_seed(0)
    model, x = Checks(), torch.randn(4, 8)
    loss_fn = lambda mod, b: mod(b).pow(2).mean()  # noqa: E731
    step = remat.optimize(model, x, loss_fn, budget="100%")
    assert verify.check_step(step, loss_fn, x).bitwise
