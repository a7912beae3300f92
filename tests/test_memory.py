"""Measuring peak memory: exact on hand-computed cases, repeatable, agrees with the profiler,
and agrees with the simulator on executed plans."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.execute import build_module
from remat.memory import MemoryMethod, cross_check, measure_peak, resident_bytes_of
from torch_helpers import WORKLOADS, assert_peak_matches, planned_step, traced, workload

KB4 = 4000  # bytes of 1000 float32


def test_counts_outputs_and_frees_exactly():
    x = torch.zeros(1000)

    def fn(x):
        a = x + 1  # +4000
        b = a * 2  # +4000 -> 8000 peak
        del a  # -4000
        c = b.sum()  # +4 (scalar)
        return b, c

    r = measure_peak(fn, x, method=MemoryMethod.DISPATCH)
    assert (r.resident_bytes, r.dynamic_peak_bytes, r.end_bytes) == (KB4, 2 * KB4, KB4 + 4)
    assert r.peak_bytes == 3 * KB4
    assert r.method is MemoryMethod.DISPATCH and r.device == "cpu"


def test_views_and_in_place_results_are_not_new_memory():
    x = torch.zeros(10, 100)

    def fn(x):
        v = x.view(-1).t()  # a view: no new storage
        y = x.add_(1)  # returns x itself
        return v, y, x.detach()

    r = measure_peak(fn, x, method=MemoryMethod.DISPATCH)
    assert r.dynamic_peak_bytes == 0 and r.end_bytes == 0


def test_repeatable_and_resident_bytes_deduplicate_shared_storage():
    base = torch.zeros(1000)
    assert resident_bytes_of(base, base[:10], [base.view(10, 100)]) == KB4
    dispatch = MemoryMethod.DISPATCH
    peaks = {measure_peak(lambda t: (t * 2).exp(), base, method=dispatch).peak_bytes for _ in range(3)}
    assert peaks == {3 * KB4}
    assert measure_peak(lambda t: t * 2, base, resident_bytes=0, method=dispatch).peak_bytes == KB4
    # the profiler is repeatable too; it also sees the wrapped Python scalar (a few bytes)
    profiled = {measure_peak(lambda t: (t * 2).exp(), base).peak_bytes for _ in range(3)}
    assert len(profiled) == 1 and 3 * KB4 <= profiled.pop() <= 3 * KB4 + 16


def test_the_default_on_cpu_is_the_profiler_which_sees_kernel_scratch():
    x = torch.randn(1000)
    dropout = lambda t: torch.ops.aten.native_dropout(t, 0.5, True)  # noqa: E731
    profiled = measure_peak(dropout, x)
    outputs_only = measure_peak(dropout, x, method=MemoryMethod.DISPATCH)
    assert profiled.method is MemoryMethod.PROFILER
    # output and mask; dropout's random draws (a float per element) only the profiler sees
    assert outputs_only.dynamic_peak_bytes == KB4 + 1000
    assert profiled.dynamic_peak_bytes == outputs_only.dynamic_peak_bytes + KB4
    assert profiled.end_bytes == outputs_only.end_bytes


def test_profiler_agrees_with_the_dispatch_tracker_on_a_training_step():
    w, t = workload("cnn", 4), traced("cnn", 4)
    step = build_module(t, remat.solve(t.graph, 10**15, method="chen_greedy").plan)

    def run(*flat):
        torch.manual_seed(0)
        return step(*flat)

    dispatch, profiler = cross_check(run, *t.flat_inputs(w.model, w.batch))
    assert dispatch.method is MemoryMethod.DISPATCH and profiler.method is MemoryMethod.PROFILER
    assert dispatch.resident_bytes == profiler.resident_bytes == t.graph.fixed_bytes
    # the profiler also sees kernel scratch space, so it can only be a little higher
    assert dispatch.peak_bytes <= profiler.peak_bytes <= 1.15 * dispatch.peak_bytes
    assert dispatch.end_bytes == profiler.end_bytes


@pytest.mark.parametrize("name,batch_size", WORKLOADS)
def test_measured_peak_equals_simulated_peak(name, batch_size):
    w, t = workload(name, batch_size), traced(name, batch_size)
    for method in ("checkpoint_all", "chen_sqrtn"):
        step = build_module(t, remat.solve(t.graph, 10**15, method=method).plan)
        _, report = planned_step(w, t, step)
        assert report.resident_bytes == t.graph.fixed_bytes
        assert report.method is MemoryMethod.PROFILER
        assert_peak_matches(step, report, f"{name} {method} (memory test)")
        # exact, not just within tolerance: outputs and measured kernel scratch are what the
        # simulator counts
        assert report.peak_bytes == step.sim.peak_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_measurement():
    x = torch.zeros(1 << 20, device="cuda")
    r = measure_peak(lambda t: (t + 1) * 2, x)
    assert r.method is MemoryMethod.CUDA_ALLOCATOR
    assert r.dynamic_peak_bytes >= 2 * x.numel() * 4


def test_profiled_measurements_print_nothing():
    """Kineto printed "USDT: ... profiler_start/stop" on the user's terminal each time remat
    measured with the profiler (optimize, the backend): remat quiets it unless the user set a
    log level."""
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom remat.memory import MemoryMethod, measure_peak\n"
            "m = torch.nn.Linear(8, 8); x = torch.randn(4, 8)\n"
            "r = measure_peak(lambda *a: m(x).sum().backward(), *m.parameters(), x, method=MemoryMethod.PROFILER)\n"
            "print('peak', r.peak_bytes > 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "peak True"
    assert "USDT" not in done.stdout + done.stderr


class _MixedPrecisionNorms(torch.nn.Module):
    """Under bfloat16 autocast on a CPU, a linear layer or convolution hands bfloat16 to a norm
    whose weight stays float32: the CPU kernels compute its statistics in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.ln = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)
        self.conv, self.gn = torch.nn.Conv1d(8, 8, 3, padding=1), torch.nn.GroupNorm(4, 8)
        self.conv2, self.bn = torch.nn.Conv1d(8, 8, 3, padding=1), torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = self.ln(self.lin(x))  # (batch, 8, 32)
        h = self.gn(self.conv(h))
        h = self.bn(self.conv2(h))
        return self.head(h).float()


@pytest.mark.parametrize("autocast", [True, False])
def test_mixed_precision_norm_statistics_count_at_the_kernels_dtype(autocast):
    """PyTorch's fake kernels give such statistics bfloat16; counted so, a planned step measured
    above its prediction (and its budget) by half their bytes. Traced, they are float32 as the
    kernels make them, and the measured peak is the simulated one exactly."""
    from remat import verify
    from remat.scratch import ScratchModel
    from remat.trace import trace

    torch.manual_seed(0)
    model, x = _MixedPrecisionNorms(), torch.randn(64, 8, 16)

    def loss_fn(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return m(x).square().mean()

    t = trace(model, (x,), loss_fn, cost_model=None, scratch=ScratchModel.MEASURE)
    aten = torch.ops.aten
    norms = (aten.native_layer_norm.default, aten.native_group_norm.default, aten._batch_norm_with_update_functional.default)
    stats = [n for n in t.module.graph.nodes if n.op == "call_function" and n.target in norms]
    assert len(stats) == 3 and all(s.meta["val"][i].dtype == torch.float32 for s in stats for i in (1, 2))
    for method in ("checkpoint_all", "chen_sqrtn", "recompute_all"):  # (the first two measured 1-2% above before)
        step = build_module(t, remat.solve(t.graph, 10**15, method=method).plan)
        _, report = verify.planned_step(model, (x,), t, step)
        assert report.peak_bytes == step.sim.peak_bytes, method


class _ShiftRight(torch.nn.Module):
    """Decoder inputs shifted right, as BART builds them: ``copy`` into a slice of new zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[1:] = ids[:-1]
        shifted[1:][0] = 3  # one row of a view (BEiT's relative position index): a scatter
        return self.lin(self.emb(shifted))


class _Unfolds(torch.nn.Module):
    """ConvBERT's span convolution (an unfold over 9 positions: ``col2im`` in its backward, which
    holds the unfolded size) and a strided unfold (``im2col`` smaller than its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.span = torch.nn.Unfold(kernel_size=[9, 1], padding=[4, 0])
        self.strided = torch.nn.Unfold(kernel_size=1, stride=2)

    def forward(self, x):  # (batch, positions, channels)
        h = self.lin(x).transpose(1, 2).unsqueeze(-1)  # (batch, channels, positions, 1)
        return self.span(h).sum() + self.strided(h.reshape(x.shape[0], 8, 4, -1)).sum()


def _fakes_against_kernels(model, batch, loss_fn) -> list[str]:
    """``check_counted_bytes`` of a plan that recomputes everything (every node runs, most of
    them several times)."""
    from remat.verify import check_counted_bytes

    step = remat.optimize(model, batch, loss_fn, budget=1 << 40, method="recompute_all", cost_model=None)
    return check_counted_bytes(step, *batch)


def test_every_output_is_counted_at_the_kernels_dtype_and_storage_size():
    """The fake kernels' outputs are what the simulator counts. Two were off: a norm backward
    reading float32 statistics typed a bfloat16 input's gradient float32 (a plan recomputing
    everything measured 10% below its prediction), and the functional ``copy`` behind
    ``x[1:] = y`` and the scatter behind ``x[1:][0] = v`` allocated the slice, where the kernels
    copy the whole storage, and ``col2im`` and ``im2col`` allocated their output, where the
    kernels resize a tensor shaped like their input (each counted below what the step holds)."""
    torch.manual_seed(0)

    def norms_loss(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).square().mean()

    assert _fakes_against_kernels(_MixedPrecisionNorms(), (torch.randn(64, 8, 16),), norms_loss) == []
    ids = torch.randint(0, 16, (64, 2))
    assert _fakes_against_kernels(_ShiftRight(), (ids,), lambda m, ids: m(ids).square().mean()) == []
    assert _fakes_against_kernels(_Unfolds(), (torch.randn(2, 16, 8),), lambda m, x: m(x).square()) == []


def test_check_counted_bytes_names_each_output_counted_otherwise(monkeypatch):
    """With the count of im2col and col2im as their fake kernels give it (the outputs' own
    bytes), the check reports both, once each though recompute-all runs them several times."""
    import importlib

    monkeypatch.setattr(importlib.import_module("remat.trace"), "_OUTPUT_LIKE_INPUT", frozenset())
    wrong = _fakes_against_kernels(_Unfolds(), (torch.randn(2, 16, 8),), lambda m, x: m(x).square())
    assert [w.split(" (")[1].split(")")[0] for w in wrong] == ["aten.im2col.default", "aten.col2im.default"]
    assert wrong[0].endswith("): torch.float32, 1024 B; counted torch.float32, 256 B")
    assert wrong[1].endswith("): torch.float32, 9216 B; counted torch.float32, 1024 B")
