"""The comparison against eager PyTorch detects every kind of difference."""

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
