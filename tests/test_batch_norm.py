"""remat.batch_norm: training-mode batch norms traced to the ops eager PyTorch's kernels run behind.

On a CUDA device these ops run cuDNN's kernels, as eager does (measured on a GPU: ResNet50's
gradients bitwise eager's); on a CPU they run the same native kernels as the ops they replace,
so here the rewrite must change nothing a step computes, recomputed or not."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import verify
from remat.batch_norm import EAGER_BACKWARD, EAGER_FORWARD, NATIVE_BACKWARD, NATIVE_FORWARD, use_eager_kernels
from remat.execute import build_module
from remat.graph import NodeKind
from remat.trace import trace


class _Shared(nn.Module):
    """One batch norm called twice (two forward nodes and two backward nodes share its buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.norm(F.relu(self.norm(self.conv(x))))


def _cases():
    image = torch.randn(4, 3, 6, 6)
    yield "2d", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), image, 1
    yield "1d over a sequence", nn.Sequential(nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5, momentum=0.3)), torch.randn(4, 3, 9), 1
    yield "1d over features", nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)), torch.randn(8, 6), 1
    yield "3d", nn.Sequential(nn.Conv3d(2, 3, 2), nn.BatchNorm3d(3, eps=1e-3)), torch.randn(2, 2, 4, 4, 4), 1
    yield "shared module", _Shared(), image, 2
    yield "channels last", nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), image.to(
        memory_format=torch.channels_last), 1
    yield "no affine (left native)", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False)), image, 0
    yield "no running stats", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)), image, 1
    yield "instance norm", nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True)), image, 1
    yield "no running stats, channels last", nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)), image.to(memory_format=torch.channels_last), 1
    yield "eval mode (left native)", nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval(), image, 0


def _loss(m, x):
    return m(x).sin().mean()


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_rewritten_steps_equal_eager_bitwise_when_every_node_is_recomputed(case):
    _name, model, x, rewritten = case
    torch.manual_seed(0)
    t = trace(model, (x,), _loss, cost_model=None)
    targets = [t.fx_node(i).target for i in range(t.graph.n)]
    assert targets.count(EAGER_FORWARD) == rewritten and targets.count(EAGER_BACKWARD) == rewritten
    if rewritten:
        assert NATIVE_FORWARD not in targets and NATIVE_BACKWARD not in targets
    want, _ = verify.eager_step(model, (x,), _loss)
    for method in ("checkpoint_all", "recompute_all"):
        step = build_module(t, remat.solve(t.graph, 10**15, method=method).plan)
        got, _ = verify.planned_step(model, (x,), t, step)
        agreement = verify.compare(got, want)
        assert agreement.bitwise, (method, agreement)


def _native_trace(model, x, monkeypatch):
    """The step traced without the rewrite (PyTorch's native batch-norm ops)."""
    monkeypatch.setattr(importlib.import_module("remat.trace"), "use_eager_batch_norm_kernels", lambda gm, kinds: [])
    t = trace(model, (x,), _loss, cost_model=None)
    monkeypatch.undo()
    return t


class _NoStats(nn.Module):
    """A norm without running statistics and an instance norm (a batch norm over the reshaped
    input once traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.batch, self.instance = nn.BatchNorm2d(4, track_running_stats=False), nn.InstanceNorm2d(4, affine=True)

    def forward(self, x):
        return self.instance(F.relu(self.batch(self.conv(x))))


@pytest.mark.parametrize("make", [_Shared, _NoStats], ids=["running statistics", "no running statistics"])
def test_the_rewrite_changes_no_value_of_a_native_graph(monkeypatch, make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(4, 3, 6, 6)
    native = _native_trace(model, x, monkeypatch)
    flat = native.flat_inputs(model, (x,))
    want = native.module(*flat)
    gm, kinds = copy.deepcopy(native.module), {}
    names = use_eager_kernels(gm, kinds)
    gm.recompile()
    assert len(names) == 2 and all(kinds[n] is NodeKind.FORWARD for n in names)
    assert sum(k is NodeKind.BACKWARD for k in kinds.values()) == 2
    new_statistics = [n for n in gm.graph.nodes if n.target is torch.ops.aten.full.default]
    assert len(new_statistics) == (4 if make is _NoStats else 0)
    for n in new_statistics:  # read by eager's forward alone; its updated copies are read by nothing
        assert [u.target for u in n.users] == [EAGER_FORWARD] and kinds[n.name] is NodeKind.FORWARD
        assert {g.args[1] for g in next(iter(n.users)).users} == {0, 1, 2, 3}
    got = gm(*flat)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for n in gm.graph.nodes:  # every new node carries a fake value, as traced nodes do
        if n.op == "call_function" and (n.name in kinds or n.target in (EAGER_FORWARD, EAGER_BACKWARD)):
            assert "val" in n.meta, n.name


def test_a_backward_whose_statistics_cannot_be_traced_to_its_forward_leaves_the_norm_native(monkeypatch):
    """A backward node reading statistics the pass cannot follow back to one forward node
    (here: a copy through an op it does not look through) keeps that forward native, so the
    reserve space never misses its backward."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), torch.randn(4, 3, 6, 6)
    gm = copy.deepcopy(_native_trace(model, x, monkeypatch).module)
    backward = next(n for n in gm.graph.nodes if n.target is NATIVE_BACKWARD)
    with gm.graph.inserting_before(backward):
        moved = gm.graph.call_function(torch.ops.aten.mul.Tensor, (backward.args[5], 1.0))
    backward.args = (*backward.args[:5], moved, *backward.args[6:])
    assert use_eager_kernels(gm, {}) == []
    assert [n.target for n in gm.graph.nodes if n.target in (NATIVE_FORWARD, NATIVE_BACKWARD)] == [
        NATIVE_FORWARD, NATIVE_BACKWARD]


class _NormAcrossChannels(nn.Module):
    """A batch norm over the features of a (batch, time, features) input, as PatchTST's: the
    input transposed for the norm and back, then a linear layer."""

    def __init__(self, channels_last: bool = False) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.bn1 = nn.BatchNorm1d(16)
        self.bn2 = nn.BatchNorm2d(16)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.bn1(x.transpose(1, 2)).transpose(1, 2))  # (B, T, C)
        image = h.transpose(1, 2).unsqueeze(-1).expand(-1, -1, -1, 2)  # (B, C, T, 2)
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        return self.bn2(image).flatten(1)


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_norm_of_a_transposed_input_has_the_cpu_kernels_layout(channels_last):
    """The CPU kernels give a batch norm's output (and its input's gradient) the layout the
    input suggests, contiguous unless channels-last; PyTorch's fake kernels keep the input's
    strides. Traced with those, the linear after the norm was a ``view`` of what looked
    contiguous, and the planned step failed on the kernel's real output ("view size is not
    compatible"). Now the steps run, bitwise eager's, with the bytes the kernels allocate."""
    torch.manual_seed(0)
    model, x = _NormAcrossChannels(channels_last).train(), torch.randn(6, 8, 16)

    def loss_fn(m, x):
        return m(x).square().mean()

    t = trace(model, (x,), loss_fn, cost_model=None)
    want, _ = verify.eager_step(model, (x,), loss_fn)
    for method in ("checkpoint_all", "recompute_all"):
        step = build_module(t, remat.solve(t.graph, 10**15, method=method).plan)
        got, _ = verify.planned_step(model, (x,), t, step)
        assert verify.compare(got, want).bitwise
    step = remat.optimize(model, (x,), loss_fn, budget=1.0, method="recompute_all", cost_model=None)
    assert verify.check_counted_bytes(step, x) == []
