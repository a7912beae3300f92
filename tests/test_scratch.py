"""Kernel scratch memory: measured per op, estimated by rule, planned for, and the measured
(profiler) peak of every executed plan stays within its budget and the prediction."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import remat
from remat.cost import CostModel
from remat.errors import InfeasibleBudgetError, TraceError
from remat.execute import build_module
from remat.memory import MemoryMethod, measure_peak
from remat.planning import plan_graph
from remat.scratch import SCRATCH_RULES, ScratchModel, estimate, measure, node_scratch
from remat.trace import trace
from torch_helpers import PEAK_RTOL, planned_step, traced, workload


def _dropout_graph(side: int = 128):
    x = torch.randn(side, side)

    def step(x):
        out, mask = torch.ops.aten.native_dropout(x, 0.5, True)
        return torch.ops.aten.native_dropout_backward(out, mask, 2.0)

    return make_fx(step)(x), x


def test_measured_scratch_is_what_the_kernel_allocates_beyond_its_outputs():
    gm, x = _dropout_graph()
    scratch = measure(gm, [x])
    # CPU dropout draws its random numbers as floats before making the mask; its backward
    # converts the mask to the gradient's dtype
    assert scratch["native_dropout"] == x.numel() * 4
    assert x.numel() * 4 <= scratch["native_dropout_backward"] <= x.numel() * 4 + 16
    assert scratch["getitem"] == 0  # not an op


def test_measuring_restores_the_random_state_and_is_repeatable():
    gm, x = _dropout_graph(64)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = measure(gm, [x])
    assert torch.equal(torch.get_rng_state(), state)
    assert measure(gm, [x]) == first


class _CachingAllocatorStats:
    """The CUDA caching allocator's statistics around one op, as ``torch.cuda.memory_stats``
    reports them: the op asks for 4096 B of scratch and keeps a 256 B output; the blocks
    counted as allocated are larger by ``slack`` bytes, which depends on what the allocator had
    cached before (a block too small to split is counted whole)."""

    def __init__(self, slack: int) -> None:
        self.slack, self.ran = slack, False

    def reset_peak(self, device=None) -> None:
        self.ran = True

    def stats(self, device=None) -> dict[str, int]:
        if not self.ran:
            return {"requested_bytes.all.current": 1000, "requested_bytes.all.peak": 1000,
                    "allocated_bytes.all.current": 1024, "allocated_bytes.all.peak": 1024}
        self.ran = False
        return {"requested_bytes.all.current": 1256, "requested_bytes.all.peak": 1256 + 4096,
                "allocated_bytes.all.current": 1536 + self.slack, "allocated_bytes.all.peak": 1536 + 4096 + 2 * self.slack}


@pytest.mark.parametrize("slack", [0, 786_432])
def test_cuda_scratch_is_what_the_op_asked_for_whatever_the_allocator_had_cached(monkeypatch, slack):
    """On CUDA, scratch was the allocator's allocated bytes, which count whole cached blocks: the
    same FCN8 measured differently in its first trace than in later ones (on an H200, 12
    convolutions up to 770 KiB apart), and the smallest budget one trace stated was refused on
    the next. It is now the bytes the op's kernels asked for."""
    from remat.scratch import _Probe

    fake = _CachingAllocatorStats(slack)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak)
    monkeypatch.setattr(torch.cuda, "memory_stats", fake.stats)
    gm = make_fx(lambda x: torch.ops.aten.native_dropout(x, 0.5, True)[0])(torch.randn(16))
    probe = _Probe(gm, frozenset(), torch.device("cuda", 0))
    probe.run(torch.randn(16))
    assert probe.cuda_scratch == {"native_dropout": 4096}


def test_estimate_rules_match_the_measurement_on_dropout_and_skip_other_devices():
    gm, x = _dropout_graph()
    assert estimate(gm)["native_dropout"] == measure(gm, [x])["native_dropout"]
    assert estimate(gm, skip={"native_dropout"})["native_dropout"] == 0
    assert torch.ops.aten.convolution.default in SCRATCH_RULES
    assert node_scratch(gm, [x], ScratchModel.NONE) == {n: 0 for n in estimate(gm)}
    with pytest.raises(ValueError, match="not a ScratchModel"):
        node_scratch(gm, [x], "measure")


def _with_grad(f, transposed):
    """``f`` and its backward, the output's gradient contiguous or (``transposed``) not, as the
    gradient of an output a ``Linear`` reads transposed is."""
    def step(x):
        x = x.detach().requires_grad_(True)
        y = f(x)
        seed = torch.full(y.shape[::-1], 2.0).permute(*reversed(range(y.dim()))) if transposed else torch.ones_like(y)
        return y, torch.autograd.grad(y, x, seed)[0]

    return step


def _ops_that_copy():
    torch.manual_seed(0)
    image, flat = torch.randn(4, 8, 24, 40), torch.randn(160, 32)
    mask, ints = torch.rand(160, 32) > 0.5, torch.randint(0, 3, (160, 32))
    interpolate = torch.nn.functional.interpolate
    cases = {
        "unfold": (lambda x: torch.nn.functional.unfold(x, 3, padding=1), image),
        "fold": (lambda x: torch.nn.functional.fold(x, (24, 40), 3, padding=1), torch.randn(4, 72, 960)),
        "bicubic": (lambda x: interpolate(x, scale_factor=2, mode="bicubic"), image),
        "nearest": (lambda x: interpolate(x, scale_factor=2, mode="nearest"), image),
        "antialiased": (lambda x: interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True), image),
        "fft": (lambda x: torch.fft.irfft(torch.fft.rfft(x), n=40), image),
        "affine_grid": (lambda t: torch.nn.functional.affine_grid(t, [4, 8, 24, 40], align_corners=False),
                        torch.randn(4, 2, 3)),
    }
    graphs = [(f"{name} {how}", make_fx(_with_grad(f, how == "transposed"), tracing_mode=mode)(x), [x])
              for name, (f, x) in cases.items() for how in ("contiguous", "transposed") for mode in ("fake", "real")]
    plain = {
        "mse_loss": (lambda x, t: torch.nn.functional.mse_loss(x, t), (flat, flat + 1)),
        "huber_loss": (lambda x, t: torch.nn.functional.huber_loss(x, t, reduction="sum"), (flat, flat + 1)),
        "mse_loss unreduced": (lambda x, t: torch.nn.functional.mse_loss(x, t, reduction="none"), (flat, flat + 1)),
        "multinomial": (lambda p: torch.multinomial(p, 5), (flat.abs(),)),
        "multinomial with replacement": (lambda p: torch.multinomial(p, 100, replacement=True), (flat.abs(),)),
        "float * bool": (lambda x, m: x * m, (flat, mask)),
        "float * broadcast bool": (lambda x, m: x * m, (flat, mask[:, :1])),
        "float == int64": (lambda x, i: x == i, (flat, ints)),
        "where(bool, float, half)": (lambda m, x, h: torch.where(m, x, h), (mask, flat, flat.half())),
        "float * 0-dim float64": (lambda x: x * torch.tensor(3.0, dtype=torch.float64), (flat,)),
        "float * float": (lambda x: x * x, (flat,)),
    }
    graphs += [(name, make_fx(f, tracing_mode=mode)(*xs), list(xs))
               for name, (f, xs) in plain.items() for mode in ("fake", "real")]
    return [(graphs[i][0], graphs[i][1], graphs[i + 1][1], graphs[i][2]) for i in range(0, len(graphs), 2)]


@pytest.mark.parametrize("name, estimated, measured, inputs", _ops_that_copy(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_estimated_scratch_covers_what_kernels_allocate_for_copies_and_promotions(name, estimated, measured, inputs):
    """Ops whose CPU kernels copy: a non-contiguous gradient made contiguous (``col2im`` of
    ``F.unfold`` feeding a ``Linear``, 4.7 MB counted as 0 before: measured peaks 47% above the
    prediction), ``im2col``'s input, reduced losses' unreduced values, an operand of a mixed-dtype
    pointwise op (a bool mask multiplied into floats) promoted. The estimate is at least the
    measurement (a few bytes of wrapped scalars aside), and at most twice it where the rule is
    exact rather than a cover of several kernels (upsampling forward, the FFTs, ``multinomial``)."""
    want = measure(measured, inputs)
    got = estimate(estimated)
    assert set(got) == set(want)
    cover = name.split()[0] in ("bicubic", "nearest", "antialiased", "fft", "multinomial")
    for node, value in want.items():
        assert value - 64 <= got[node], (node, got[node], value)
        assert cover or got[node] <= 2 * value + 64, (node, got[node], value)
    assert sum(want.values()) > 0 or name in ("float * float", "mse_loss unreduced"), name


def test_traced_nodes_carry_their_scratch_as_temp_bytes():
    w = workload("gpt2-tiny", 2)
    measured = trace(w.model, w.batch, w.loss_fn, cost_model=None, scratch=ScratchModel.MEASURE).graph
    estimated = trace(w.model, w.batch, w.loss_fn, cost_model=None).graph  # no costs: estimated
    none = trace(w.model, w.batch, w.loss_fn, cost_model=None, scratch=ScratchModel.NONE).graph
    dropout = [i for i, n in enumerate(measured.nodes) if n.name.startswith("native_dropout") and "backward" not in n.name]
    assert dropout and all(measured.nodes[i].temp_bytes > 0 for i in dropout)
    assert [n.temp_bytes for n in estimated.nodes] != [0] * estimated.n
    for i in dropout:  # the rule is exact for dropout
        assert estimated.nodes[i].temp_bytes == measured.nodes[i].temp_bytes
    assert all(n.temp_bytes == 0 for n in none.nodes)
    # scratch is part of the structure a plan is keyed by
    assert measured.fingerprint(costs=False) != none.fingerprint(costs=False)


def test_scratch_model_errors_name_the_remedy():
    w = workload("mlp", 8)
    with pytest.raises(TraceError, match="scratch='measure' is not a ScratchModel; use ScratchModel.MEASURE"):
        trace(w.model, w.batch, w.loss_fn, cost_model=None, scratch="measure")
    with torch.device("meta"):
        meta = remat.models.get_workload("mlp", 8)
    with pytest.raises(TraceError, match="meta device.*cannot be measured there: pass scratch=ScratchModel.ESTIMATE"):
        trace(meta.model, meta.batch, meta.loss_fn, cost_model=CostModel.ESTIMATE, scratch=ScratchModel.MEASURE)
    # on the meta device nothing runs: no scratch is modelled unless asked for
    g = trace(meta.model, meta.batch, meta.loss_fn, cost_model=CostModel.ESTIMATE).graph
    assert all(n.temp_bytes == 0 for n in g.nodes)


def _plans_between(t, fractions):
    graph = t.graph
    top = plan_graph(graph, 2**60, "checkpoint_all").sim.peak_bytes
    for fraction in fractions:
        budget = int(fraction * top)
        for method in ("chen_greedy", "segments", "checkpoint_all"):
            try:
                yield f"{method}@{fraction:.0%}", budget, plan_graph(graph, budget, method)
            except InfeasibleBudgetError:
                continue


@pytest.mark.parametrize("name,batch_size,fractions,scratch_at_peak",
                         [("gpt2-tiny", 4, (1.0, 0.85, 0.7), False), ("cnn", 8, (1.0, 0.95, 0.9), True)])
def test_profiler_measured_peak_stays_within_the_budget_and_the_prediction(name, batch_size, fractions, scratch_at_peak):
    """The profiler sees kernel scratch (dropout's random draws, convolution reorders); without
    it in the model, plans made for a budget measured above it."""
    w, t = workload(name, batch_size), traced(name, batch_size)
    ran, unseen_by_outputs = 0, 0
    for label, budget, planned in _plans_between(t, fractions):
        step = build_module(t, planned.plan)
        _, report = planned_step(w, t, step)
        assert report.method is MemoryMethod.PROFILER
        assert report.peak_bytes <= budget, f"{name} {label}: measured {report.peak_bytes} B over the budget {budget} B"
        error = abs(report.peak_bytes - planned.sim.peak_bytes) / planned.sim.peak_bytes
        assert error <= PEAK_RTOL, f"{name} {label}: measured {report.peak_bytes} B, predicted {planned.sim.peak_bytes} B"
        outputs_only = measure_peak(step, *t.flat_inputs(w.model, w.batch), method=MemoryMethod.DISPATCH)
        unseen_by_outputs += outputs_only.peak_bytes < report.peak_bytes
        ran += 1
    assert ran >= 4
    if scratch_at_peak:  # convolutions' scratch sets the peak of some of these plans
        assert unseen_by_outputs, "no plan peaked in kernel scratch: the test does not test it"


def test_estimated_scratch_of_reduced_precision_convolutions_covers_every_sample():
    """bfloat16 CPU convolutions unfold every sample at once (4,718,592 B measured for 4
    samples, 1,970,688 B estimated from one): plans made with estimated scratch under bfloat16
    autocast measured up to 43% over their budget."""
    conv = torch.nn.Conv2d(16, 16, 3, padding=1).to(torch.bfloat16)

    def step(x, w, b):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y = torch.nn.functional.conv2d(x, w, b, padding=1)
        return y, torch.autograd.grad(y.float().sum(), (x, w))

    x = torch.randn(4, 16, 64, 64, dtype=torch.bfloat16)
    inputs = [x, conv.weight.detach(), conv.bias.detach()]
    want = measure(make_fx(step, tracing_mode="real")(*inputs), inputs)
    got = estimate(make_fx(step, tracing_mode="fake")(*inputs))
    convolutions = [node for node in want if node.startswith("convolution")]
    one_sample = 16 * 9 * 64 * 64 * 2  # (its unfolded input)
    # where oneDNN computes bfloat16 itself (AVX512-BF16 CPUs) the kernel unfolds less: 1,608,068 B
    every_sample = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert convolutions and max(want[node] for node in convolutions) > (4 if every_sample else 1) * one_sample * 0.9
    for node in convolutions:
        assert got[node] >= want[node], (node, got[node], want[node])


def test_estimated_scratch_counts_the_small_tensors_kernels_make():
    """A Python number a kernel wraps in a tensor (batch norm's counter + 1, a division by a
    count, dropout's backward scale) and an average's result: 8-12 B each, counted as nothing,
    put the smallest budget of a CNN planned with estimated scratch 12 B over."""
    def step(x, counter):
        x = x.detach().requires_grad_(True)
        y, mask = torch.ops.aten.native_dropout(x, 0.2, True)
        z = (y / 64).mean()
        back = torch.ops.aten.native_dropout_backward(torch.ones_like(y), mask, 1.25)
        return z, back, counter + 1

    inputs = [torch.randn(64, 64), torch.tensor(3)]
    torch.manual_seed(0)
    want = measure(make_fx(step, tracing_mode="real")(*inputs), inputs)
    got = estimate(make_fx(step, tracing_mode="fake")(*inputs))
    small = [node for node in want if node.split("_")[0] in ("add", "div", "mean") or node.startswith(
        "native_dropout_backward")]
    assert len(small) >= 4 and any(want[node] for node in small)
    for node in small:
        assert got[node] >= want[node], (node, got[node], want[node])
