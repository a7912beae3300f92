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
