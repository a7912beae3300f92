"""The comparison against eager PyTorch detects every kind of difference."""

import math
from dataclasses import replace

import torch

from remat.verify import StepState, compare


def state(loss=1.0, grad=(1.0, 2.0), buf=(0.0,), rng=(1,), extra_grad=False):
    grads = {"w": torch.tensor(grad)}
    if extra_grad:
        grads["b"] = torch.tensor([0.0])
    return StepState(torch.tensor(loss), grads, {"running_mean": torch.tensor(buf)}, torch.tensor(rng, dtype=torch.uint8))


def test_identical_steps_agree_bitwise():
    a = compare(state(), state())
    assert a.bitwise and a.max_abs_diff == 0.0 and a.mismatches == ()


def test_each_difference_is_named():
    a = compare(state(loss=1.5, grad=(1.0, 2.25), buf=(1.0,), rng=(2,), extra_grad=True), state())
    assert not a.bitwise
    text = "\n".join(a.mismatches)
    for label in ("loss: max |diff| 0.5", "grad w: max |diff| 0.25", "grad b: present in one step only",
                  "buffer running_mean", "random generator state"):
        assert label in text
    assert a.max_abs_diff == 1.0


def test_parameters_and_batch_tensors_modified_in_place_and_input_gradients_are_compared():
    def with_io(param=1.0, x=2.0, grad=3.0):
        return replace(state(), params={"emb.weight": torch.tensor([param])}, batch={"batch[1]": torch.tensor([x])},
                       batch_grads={"batch[0]": torch.tensor([grad]), "batch[2]": None})

    assert compare(with_io(), with_io()).bitwise
    a = compare(with_io(param=1.5, x=2.25, grad=3.125), with_io())
    assert a.mismatches == ("grad batch[0]: max |diff| 0.125", "param emb.weight: max |diff| 0.5",
                            "batch[1]: max |diff| 0.25")
    assert compare(replace(with_io(), batch_grads={"batch[0]": None, "batch[2]": None}), with_io()).mismatches == (
        "grad batch[0]: present in one step only",)


def test_shape_mismatch():
    a = compare(state(grad=(1.0,)), state())
    assert a.mismatches == ("grad w: shape (1,) vs (2,)",)


def test_check_step_compares_a_planned_step_with_eager_and_leaves_the_model_alone():
    import copy

    import remat
    from remat.verify import check_step

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 12 * 12, 3))
    x, y = torch.randn(2, 3, 12, 12), torch.tensor([0, 2])
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    step = remat.optimize(model, (x, y), loss_fn, budget=0.85, method="milp", cost_model=remat.CostModel.ESTIMATE)
    assert step.report.overhead > 1.0  # something is recomputed
    before = copy.deepcopy(model.state_dict())
    agreement = check_step(step, loss_fn, x, y)
    assert agreement.bitwise, agreement.mismatches
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    # another loss than the planned one: every difference is named
    other = check_step(step, lambda m, x, y: 2 * loss_fn(m, x, y), (x, y))
    assert not other.bitwise and "loss: max |diff|" in other.mismatches[0]


class _Gather(torch.nn.Module):
    """Rows of a weight picked by repeated ids: the gradient adds rows up with ``index_put``
    (``accumulate``), which on a CPU with several threads adds in the order the threads get
    there, so eager PyTorch's own gradient changes from run to run in the last bits."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 32, 16))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x, ids):
        return self.head(torch.bmm(self.w[ids], x.unsqueeze(-1)).squeeze(-1).relu())


def test_check_step_names_what_eager_does_not_reproduce_itself(monkeypatch):
    """A difference in a tensor eager computes differently run to run is eager's; one anywhere
    else is not. Eager's nondeterminism is made certain here (a kernel's thread order is not)."""
    import remat
    from remat import verify

    torch.manual_seed(0)
    model, x, ids = _Gather(), torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss_fn = lambda m, x, ids: m(x, ids).square().mean()  # noqa: E731
    step = remat.optimize(model, (x, ids), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    first = verify.check_step(step, loss_fn, x, ids)  # (eager's gradient of w may differ from run to run here)
    assert first.bitwise or first.matches_where_eager_is_deterministic
    real_eager, runs = verify._eager, []

    def eager_off_in_the_last_bits(*args):  # (every eager run, measured or not)
        state, result = real_eager(*args)
        runs.append(1)
        if len(runs) % 2 == 0:  # every other eager run, as a thread-order kernel may
            state.grads["w"] = torch.nextafter(state.grads["w"], torch.full_like(state.grads["w"], math.inf))
        return state, result

    # the planned step off where eager is off run to run: eager's own difference
    monkeypatch.setattr(verify, "_eager", eager_off_in_the_last_bits)
    planned = verify._planned  # (every planned run, measured or not)
    monkeypatch.setattr(verify, "_planned", lambda *a, **k: _nudged(planned(*a, **k), "w"))
    runs.clear()
    agreement = verify.check_step(step, loss_fn, x, ids)
    assert not agreement.bitwise and agreement.eager_nondeterministic == ("grad w",)
    assert agreement.eager_self_diff > 0 and agreement.matches_where_eager_is_deterministic
    # off where eager reproduces itself: the plan's
    monkeypatch.setattr(verify, "_planned", lambda *a, **k: _nudged(planned(*a, **k), "head.bias"))
    runs.clear()
    agreement = verify.check_step(step, loss_fn, x, ids)
    assert agreement.mismatches[0].startswith("grad head.bias")
    assert not agreement.matches_where_eager_is_deterministic


def test_check_step_measures_no_peak_and_eager_step_does(monkeypatch):
    """``check_step`` compares states and reads no peak, so none of its runs is profiled, the
    reruns of eager included; ``eager_step`` and ``planned_step``, which return peaks, measure."""
    import remat
    from remat import memory, verify

    torch.manual_seed(0)
    nn = torch.nn
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)
    calls = {"eager": 0, "profiled": 0}
    eager_calls = []

    def traced(m, x):
        return m(x).square().mean()

    def loss_fn(m, x):  # (the same loss, counting its eager runs: a step that counted would be refused)
        eager_calls.append(None)
        return traced(m, x)

    def counted() -> dict:
        return {**calls, "eager": len(eager_calls)}

    step = remat.optimize(model, x, traced, budget=1.0, method="checkpoint_all", cost_model=None)
    real_profiler_peak = memory._profiler_peak

    def profiler_peak(*args):
        calls["profiled"] += 1
        return real_profiler_peak(*args)

    monkeypatch.setattr(memory, "_profiler_peak", profiler_peak)
    calls.update(profiled=0)  # (tracing called the loss)
    eager_calls.clear()
    _, report = verify.eager_step(model, (x,), loss_fn)
    assert counted() == {"eager": 1, "profiled": 1} and report.dynamic_peak_bytes > 0  # eager_step measures
    _, report = verify.planned_step(model, (x,), step.traced, step.planned)
    assert calls["profiled"] == 2 and report.dynamic_peak_bytes > 0  # so does planned_step
    planned = verify._planned
    monkeypatch.setattr(verify, "_planned", lambda *a, **k: _nudged(planned(*a, **k), "0.weight"))
    calls.update(profiled=0)
    eager_calls.clear()
    agreement = verify.check_step(step, loss_fn, x, eager_repeats=3)
    assert not agreement.bitwise and agreement.mismatches[0].startswith("grad 0.weight")
    assert agreement.eager_nondeterministic == () and agreement.eager_self_diff == 0.0
    assert counted() == {"eager": 4, "profiled": 0}  # eager ran 1 + 3 times, none of them profiled


def _nudged(result, name):
    state, memory = result
    state.grads[name] = torch.nextafter(state.grads[name], torch.full_like(state.grads[name], -math.inf))
    return state, memory


def test_check_step_copies_a_model_holding_a_computed_weight_and_leaves_it_as_it_was():
    """The legacy ``torch.nn.utils.weight_norm`` keeps the weight it computes before each forward
    as a plain attribute with a ``grad_fn``, which ``copy.deepcopy`` refuses (PyTorch's raw
    error came out of ``check_step``); the copies get it detached and recompute it."""
    import warnings

    import torch.nn.functional as F

    import remat
    from remat.verify import check_step

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (deprecated in favour of parametrizations.weight_norm)
        model = torch.nn.Sequential(torch.nn.utils.weight_norm(torch.nn.Linear(16, 32)), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = remat.optimize(model, (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    weight = model[0].weight
    result = check_step(step, loss_fn, x, y)
    assert result.bitwise, result.mismatches
    assert model[0].weight is weight and weight.grad_fn is not None


def test_check_step_and_check_counted_bytes_refuse_arguments_in_the_wrong_order():
    import pytest

    import remat
    from remat.errors import TraceError
    from remat.verify import check_counted_bytes, check_step

    model, x, y = torch.nn.Linear(4, 2), torch.randn(3, 4), torch.randn(3, 2)
    loss_fn = lambda m, x, y: (m(x) - y).square().mean()  # noqa: E731
    step = remat.optimize(model, (x, y), loss_fn, budget=1.0, method="checkpoint_all", cost_model=None)
    with pytest.raises(TraceError, match=r"check_step's first argument is a function, not the TrainingStep "
                                         r"remat.optimize returns \(step and loss_fn swapped\?\); call "
                                         r"check_step\(step, loss_fn, \*batch\)"):
        check_step(loss_fn, step, x, y)
    with pytest.raises(TraceError, match=r"check_step's loss_fn is a tensor of shape \(3, 4\), not a callable \(loss_fn "
                                         r"left out\?\); call check_step\(step, loss_fn, \*batch\)"):
        check_step(step, x, y)
    with pytest.raises(TraceError, match=r"check_counted_bytes takes the batch only, not loss_fn, and its first batch "
                                         r"argument is a function; call check_counted_bytes\(step, \*batch\)"):
        check_counted_bytes(step, loss_fn, x, y)
    assert check_step(step, loss_fn, x, y).bitwise and check_counted_bytes(step, x, y) == []
