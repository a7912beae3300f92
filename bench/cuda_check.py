"""One command for a CUDA machine: remat on the paper's models and GPT-2, measured by the CUDA
allocator against remat's prediction, against eager PyTorch and against PyTorch's own memory
savers.

For every model (the Checkmate paper's VGG16, VGG19, ResNet50, MobileNet, VGG-U-Net, FCN8 and
SegNet, and GPT-2 small; batch sizes below), one training step (forward, loss, backward) runs as

* eager PyTorch (the reference; run twice, so that the reference's own run-to-run noise is known);
* ``torch.compile`` with PyTorch's own partitioner and no memory budget: the same captured graph
  remat's backend plans, so what compiling alone changes in the gradients is known;
* ``remat.backend`` at two budgets, fractions of the step's unoptimized peak as remat simulates
  it (method ``milp`` with a bounded time limit);
* ``remat.optimize`` at the same budgets (remat's own tracing and executor, no compiler);
* ``torch.utils.checkpoint`` (non-reentrant) on every block: the elements of the model's block
  lists (GPT-2's layers, the segmentation encoders' stages) or, for a plain ``nn.Sequential``,
  its top-level children;
* ``torch.compile`` with PyTorch's min-cut partitioner at ``activation_memory_budget`` 0.5.
* eager PyTorch and ``remat.optimize`` at the smaller budget with cuDNN off (forward and
  backward), compared with each other;
* eager PyTorch and ``remat.optimize`` at the smaller budget with the loss function's forward
  under ``torch.autocast(dtype=torch.bfloat16)`` (mixed precision, as users train), compared
  with each other.

A budget remat finds infeasible is planned again at the smallest feasible budget it states (the
row says so): that is the budget a user is told to ask for, so it must plan. ``remat.optimize``
runs training-mode batch norms with the kernels eager PyTorch runs (cuDNN's); it refuses a model
with a training-mode batch norm it could not trace to those kernels (one whose backward it could
not match), which eager runs with cuDNN; the row then runs it with ``allow_native_batch_norm=True``
and is compared with the ``torch.compile`` row too (which runs the native kernels). Eval-mode
norms keep the native kernels.

Recorded per variant: the peak memory of one step (``torch.cuda.max_memory_allocated`` above
what was allocated before the step, plus the parameters, buffers and batch, as remat counts
them), remat's predicted peak and their relative difference, the median step time over
``--rounds`` steps against eager, the median time the CPU takes to issue a step (until the
step function returns, before synchronizing: near the step time, the step is bound by the
host, not the GPU; shown as "issued in" on a CUDA run), the caching allocator's calls to the
driver per timed step (``ALLOCATOR_CALLS``; shown when a step makes any, which slows it whatever
its plan computes), and every gradient against eager's: the largest absolute
difference (and as a fraction of the largest eager gradient of its tensor), bitwise equality,
and ``torch.allclose(grad, eager_grad, rtol=RTOL, atol=ATOL_SCALE * max|eager_grad|)`` per
tensor. Compiled variants are compared with the ``torch.compile`` row too. cuDNN's backward
kernels are not deterministic, so eager against itself is recorded, and a difference no larger
than ``NOISE_FACTOR`` times eager's own counts as agreement.

The whole run is sized for one H100 in under 10 minutes: batch sizes below, a solver time
limit, and a deadline (``--deadline-s``) after which the remaining variants are recorded as
skipped; results are written after every variant and a second run resumes where the first
stopped, measuring again the variants that failed (after a fix, say).

A last check, ``gradscaler``, follows the README's float16 recipe: a three-layer MLP with
dropout under ``torch.autocast(dtype=torch.float16)``, the ``torch.amp.GradScaler``'s scale
given to ``remat.optimize``'s step as a batch tensor, eight SGD steps against eager's
``scaler.scale(loss).backward()``, one batch scaled by 10^4 so that float16 overflows and the
scaler backs off and skips that step. Every step's scaled loss, gradients and parameters must
be bitwise eager's and the two scalers' scales equal.

A large workload runs only when named: ``gpt2-48l``, the solver-scaling benchmark's deepest GPT-2
(48 layers of width 256, batch 8 of 256 tokens; 8,625 traced ops), with eager twice,
``remat.optimize`` at the budgets and at the smallest budget remat states for it (``remat.optimize
smallest``: asked for one byte, refused, planned at the budget the refusal names), and
checkpointing every layer (about two minutes on an H200).

    python bench/cuda_check.py                         # on a CUDA machine: every model
    python bench/cuda_check.py --models resnet50,gpt2  # a subset
    python bench/cuda_check.py --models gpt2-48l --budgets 0.5,0.2  # the large workload
    python bench/cuda_check.py --device cpu --quick    # dry run of the same code path on CPU

Writes ``bench/results/cuda_check.json`` (``--out`` for another file; the dry run writes
``cuda_check_quick.json``) and, for the default file, regenerates BENCHMARKS.md with a section
that names the device. Exit status: 0, or 1 when a remat variant failed or its gradients agree
neither with eager's nor (for ``remat.backend``) with ``torch.compile``'s on the same graph;
without CUDA (and without ``--device cpu``) 2, with one line.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "cuda_check.json"
QUICK_RESULTS = HERE / "results" / "cuda_check_quick.json"
#: model -> batch size on one 80 GB GPU: large enough that activations dominate the parameters
#: (so the budgets are feasible), small enough that the whole run stays under 10 minutes.
MODELS = {"vgg16": 64, "vgg19": 64, "resnet50": 64, "mobilenet": 128, "vgg-unet": 8, "fcn8": 8, "segnet": 8,
          "gpt2": 8}
#: The dry run: a paper model on small images and a small GPT-2, each at this batch; the models
#: that run on small images (the others need their paper input).
QUICK_MODELS = {"mobilenet": 2, "gpt2": 8}
#: Large workloads, run only when named: the solver-scaling benchmark's deepest GPT-2 (48 layers of
#: width 256, sequence 256, vocabulary 8192, dropout 0.1; 8,625 traced ops), with the variants of
#: ``LARGE_VARIANTS`` alone: what the planner's plans for thousands of ops measure on a device.
LARGE_MODELS = {"gpt2-48l": 8}
#: The GradScaler check (run by default, after the models): name, batch on a GPU and in the
#: dry run, optimizer steps, and the step whose batch is scaled so that float16 overflows.
GRADSCALER = "gradscaler"
GRADSCALER_BATCH = 512
GRADSCALER_QUICK_BATCH = 64
GRADSCALER_STEPS = 8
GRADSCALER_OVERFLOW_STEP = 3
QUICK_IMAGE_SIDE = 32
QUICK_CAPABLE = ("mobilenet", "resnet50", "gpt2")
BUDGETS = (0.7, 0.5)
AOT_BUDGET = 0.5
#: Gradients match eager's when, per tensor, allclose(rtol=RTOL, atol=ATOL_SCALE * max|eager|).
RTOL = 1e-3
ATOL_SCALE = 1e-4
#: No variant starts after this many seconds, so that the run ends within 10 minutes (the
#: longest variant, remat planning GPT-2 small, takes about a minute); a rerun resumes.
DEADLINE_S = 480.0
#: A gradient difference no larger than this many times eager's against itself is noise.
NOISE_FACTOR = 4.0
#: The row of PyTorch's compiler without a memory budget: the reference of the compiled variants.
COMPILED = "torch.compile"
#: Rows run with cuDNN off (forward and backward): eager PyTorch and remat's traced step then run
#: PyTorch's native kernels, as ``torch.compile`` does.
OFF = ", cuDNN off"
EAGER_OFF = "eager" + OFF
#: Rows run under ``torch.autocast(device, dtype=torch.bfloat16)`` (the loss function's forward;
#: the backward outside it, as users write it); remat traces and plans the autocast step.
AMP = ", bf16 autocast"
EAGER_AMP = "eager" + AMP
#: Eager under autocast against itself: the noise the autocast rows are judged by (bfloat16
#: turns a nondeterministic kernel's last-bit differences into whole bfloat16 steps).
EAGER_AMP_AGAIN = "eager again" + AMP
#: Row suffixes that change how a step runs; each has its own eager row as the reference.
MODES = (OFF, AMP)
#: The remat variant planned at the smallest budget remat states for the step (asked for one byte,
#: refused with ``InfeasibleBudgetError``, planned again at the budget it names).
SMALLEST = "remat.optimize smallest"
#: A measured peak further than this from remat's prediction is flagged in the report.
PEAK_TOLERANCE = 0.05
MIB = 2**20


class NoCudaError(RuntimeError):
    """The check needs a CUDA device and there is none."""


# ---------------------------------------------------------------------------- workloads
@dataclass
class Spec:
    """One model to check: built on ``device`` by ``build() -> (model, batch, loss_fn)``."""

    name: str
    batch_size: int
    build: object
    config: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.batch_size}"


def specs(names: list[str], quick: bool, batch: int | None) -> list[Spec]:
    sizes = QUICK_MODELS if quick else MODELS
    out = []
    for name in names:
        b = batch or sizes.get(name) or {**MODELS, **LARGE_MODELS}[name]
        if name in LARGE_MODELS:
            out.append(Spec(name, b, functools.partial(_gpt2_scaling, b, 48), {"layers": 48, "width": 256}))
        elif name == "gpt2":
            out.append(Spec(name, b, functools.partial(_gpt2, b, quick), {"layers": 2 if quick else 12}))
        else:
            side = QUICK_IMAGE_SIDE if quick else None
            out.append(Spec(name, b, functools.partial(_paper, name, b, side), {"image_side": side or "paper"}))
    return out


def _gpt2(batch: int, quick: bool):
    from remat.models.gpt2 import GPT2_POSITIONS, GPT2_SEQUENCE, GPT2_SMALL, GPT2_VOCAB, gpt2_lm

    if quick:
        w = gpt2_lm(batch, name="gpt2", layers=2, width=64, heads=4, vocab=512, sequence=64)
    else:
        layers, width, heads = GPT2_SMALL
        w = gpt2_lm(batch, name="gpt2", layers=layers, width=width, heads=heads, vocab=GPT2_VOCAB,
                    sequence=GPT2_SEQUENCE, positions=GPT2_POSITIONS)
    return w.model, w.batch, w.loss_fn


def _gpt2_scaling(batch: int, layers: int):
    """The solver-scaling benchmark's GPT-2 of ``layers`` layers (its ``gpt2_config``: width 256,
    4 heads, sequence 256, vocabulary 8192, dropout 0.1)."""
    from remat.models.gpt2 import gpt2_lm

    sys.path.insert(0, str(HERE))
    from solver_scaling import gpt2_config

    cfg = gpt2_config(layers)
    w = gpt2_lm(batch, name=f"gpt2-{layers}L", layers=layers, width=cfg["width"], heads=cfg["heads"],
                vocab=cfg["vocab"], sequence=cfg["sequence"], dropout=cfg["dropout"])
    return w.model, w.batch, w.loss_fn


def _paper(name: str, batch: int, side: int | None):
    """A paper model; ``side``: square images of that side instead of the paper's input
    (classifiers only: the dry run)."""
    import torch

    from remat.models import get_workload
    from remat.models.paper_cnns import cross_entropy_loss

    w = get_workload(name, batch)
    if side is None:
        return w.model, w.batch, w.loss_fn
    with torch.no_grad():
        classes = w.model.eval()(torch.zeros(1, 3, side, side, device=w.batch[0].device)).shape[1]
    w.model.train()
    images = torch.randn(batch, 3, side, side, device=w.batch[0].device)
    return w.model, (images, torch.randint(0, classes, (batch,), device=images.device)), cross_entropy_loss


def block_slots(model) -> list[tuple[object, int]]:
    """(container, index) of every block to checkpoint: the elements of the block lists
    (``nn.ModuleList``, outermost first, not nested in one already taken) or, for a plain
    ``nn.Sequential`` without block lists, its top-level children that hold parameters."""
    from torch import nn

    lists, taken = [], set()
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(t + ".") for t in taken):
            lists.append(module)
            taken.add(name)
    if not lists and isinstance(model, nn.Sequential):
        lists = [model]
    return [(container, i) for container in lists for i, block in enumerate(container)
            if any(True for _ in block.parameters())]


# ---------------------------------------------------------------------------- variants
def variant_names(budgets: list[float], model: str | None = None) -> list[str]:
    """The variants run on ``model`` (every one, or for a model of ``LARGE_MODELS``, eager twice,
    ``remat.optimize`` at the budgets and at the smallest, and checkpointing every block)."""
    if model in LARGE_MODELS:
        return ["eager", "eager again", *(f"remat.optimize {b:.0%}" for b in budgets), SMALLEST,
                "checkpoint every block"]
    return ["eager", "eager again", EAGER_OFF, EAGER_AMP, EAGER_AMP_AGAIN, COMPILED, *(f"remat.backend {b:.0%}" for b in budgets),
            *(f"remat.optimize {b:.0%}" for b in budgets), *(f"remat.optimize {min(budgets):.0%}{m}" for m in MODES),
            "checkpoint every block", f"activation_memory_budget {AOT_BUDGET:g}"]


def own_eager(variant: str) -> str | None:
    """The eager row run the way ``variant`` runs (``EAGER_OFF`` for a row with cuDNN off,
    ``EAGER_AMP`` under autocast), or None for a row run as plain eager runs."""
    return next(("eager" + m for m in MODES if variant.endswith(m)), None)


def budget_of(variant: str) -> float | int:
    """The budget a remat variant's name states: a fraction (``remat.optimize 50%, cuDNN off``:
    0.5), or for ``SMALLEST`` one byte (refused, stating the smallest feasible budget)."""
    if variant == SMALLEST:
        return 1
    return float(variant.split()[1].rstrip(",").rstrip("%")) / 100


def is_compiled(variant: str) -> bool:
    """Runs under ``torch.compile`` (compared with the ``COMPILED`` row too, as a
    ``remat.optimize`` row that ran with native batch norms is)."""
    return variant == COMPILED or variant.startswith(("remat.backend", "activation_memory_budget"))


def prepare(variant: str, model, loss_fn, batch, args: argparse.Namespace, facts: dict, budget: int | None = None,
            allow_native_batch_norm: bool = False):
    """The step function of ``variant`` on ``model`` (a fresh copy): ``fn(*batch) -> loss``.
    ``budget``: bytes instead of the variant's fraction (a remat variant planned again at the
    smallest feasible budget); ``allow_native_batch_norm``: passed to ``remat.optimize``. A
    variant ending in ``OFF`` is its base variant prepared and run with cuDNN off; one ending in
    ``AMP``, its base variant with the loss function under bfloat16 autocast."""
    import torch

    if variant.endswith(AMP):
        return prepare(variant[: -len(AMP)], model, _autocast(loss_fn), batch, args, facts, budget,
                       allow_native_batch_norm)
    if variant.endswith(OFF):
        with torch.backends.cudnn.flags(enabled=False):
            inner = prepare(variant[: -len(OFF)], model, loss_fn, batch, args, facts, budget, allow_native_batch_norm)

        def off(*b):
            with torch.backends.cudnn.flags(enabled=False):
                return _CudnnOff(inner(*b))

        return off

    if variant.startswith("eager"):
        return lambda *b: loss_fn(model, *b)
    torch._dynamo.reset()  # every compiled variant compiles anew, with its own backend
    if variant.startswith("remat"):
        import remat
        from remat.cost import CostModel

        budget = budget if budget is not None else budget_of(variant)
        options = {"time_limit_s": args.time_limit_s} if args.method in ("milp", "lp_round") else {}
        if variant.startswith("remat.optimize"):
            step = remat.optimize(model, batch, loss_fn, budget=budget, method=args.method,
                                  allow_native_batch_norm=allow_native_batch_norm, **options)
            facts["step"] = step
            return lambda *b: _Applied(step(*b))
        backend = remat.backend(budget, method=args.method, cost_model=CostModel.PROFILE, cache_dir=None, **options)
        facts["backend"] = backend
        return torch.compile(lambda *b: loss_fn(model, *b), backend=backend)
    if variant.startswith("checkpoint"):
        slots = block_slots(model)
        if not slots:
            raise ValueError("no blocks to checkpoint in this model")
        for container, i in slots:
            container[i] = _Checkpointed(container[i])
        facts["checkpointed_blocks"] = len(slots)
        return lambda *b: loss_fn(model, *b)
    import torch._functorch.config
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def counted(*a, **k):
        facts["partitions"] = facts.get("partitions", 0) + 1
        return min_cut_rematerialization_partition(*a, **k)

    compiled = torch.compile(lambda *b: loss_fn(model, *b), backend=aot_autograd(
        fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=counted, keep_inference_input_mutations=True))
    memory_budget = 1.0 if variant == COMPILED else AOT_BUDGET

    def step(*b):
        with torch._functorch.config.patch(activation_memory_budget=memory_budget):
            return compiled(*b)

    return step


def _autocast(loss_fn):
    """``loss_fn`` with its forward under bfloat16 autocast on the batch's device."""

    def under_autocast(model, *batch):
        import torch

        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16):
            return loss_fn(model, *batch)

    return under_autocast


class _Applied:
    """What ``remat.optimize``'s step returns, shaped like a loss: its backward already ran."""

    def __init__(self, loss) -> None:
        self.loss = loss

    def backward(self) -> None:
        pass

    def detach(self):
        return self.loss.detach()


class _CudnnOff:
    """A loss whose backward runs with cuDNN off too: the step's caller calls ``backward()``
    after the step function returns, outside the flag the forward ran under (an eager row with
    only its forward off ran cuDNN's backward kernels)."""

    def __init__(self, loss) -> None:
        self.loss = loss

    def backward(self) -> None:
        import torch

        with torch.backends.cudnn.flags(enabled=False):
            self.loss.backward()

    def detach(self):
        return self.loss.detach()


class _Checkpointed:
    """A block run under non-reentrant ``torch.utils.checkpoint``."""

    def __new__(cls, block):
        import torch
        from torch.utils.checkpoint import checkpoint

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.block = block

            def forward(self, *args, **kwargs):
                return checkpoint(self.block, *args, use_reentrant=False, **kwargs)

        return Wrapper()


# ---------------------------------------------------------------------------- measuring
def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: The CUDA caching allocator's counters of calls to the driver (``torch.cuda.memory_stats``): a
#: step that allocates from the driver (``cudaMalloc``) or frees to it (``cudaFree``, which waits
#: for the device) in steady state is slowed by it, whatever its plan computes.
ALLOCATOR_CALLS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def allocator_calls(device) -> dict[str, int] | None:
    """The allocator's ``ALLOCATOR_CALLS`` counters on ``device`` (None off CUDA)."""
    import torch

    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_CALLS}


def compare_grads(grads: list, reference: list) -> dict:
    """Largest |difference|, bitwise equality, and the stated allclose, over paired gradients."""
    import torch

    worst, relative, bitwise, close = 0.0, 0.0, True, True
    for g, ref in zip(grads, reference, strict=True):
        if (g is None) != (ref is None):
            return {"grad_max_abs_diff": math.inf, "grad_max_rel_diff": math.inf, "grads_bitwise": False,
                    "grads_allclose": False}
        if g is None:
            continue
        diff, scale = float((g.float() - ref.float()).abs().max()), float(ref.abs().max())
        worst = max(worst, diff)
        relative = max(relative, diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0))
        bitwise = bitwise and torch.equal(g, ref)
        close = close and torch.allclose(g, ref, rtol=RTOL, atol=ATOL_SCALE * scale)
    return {"grad_max_abs_diff": worst, "grad_max_rel_diff": relative, "grads_bitwise": bitwise,
            "grads_allclose": close}


def measure_variant(spec: Spec, variant: str, base, batch, loss_fn, references: dict[str, list], args) -> dict:
    """Run one variant of one model: first step (compile, plan), gradients, peak memory, step
    time. ``references``: the gradients of the rows measured already (eager's, the compiled
    row's) to compare with."""
    from remat.errors import InfeasibleBudgetError, TraceError
    from remat.memory import MemoryMethod, measure_peak
    from remat.sweep import seeded_step
    from remat.trace_errors import ALLOW_OPTION

    device = batch[0].device
    record: dict = {"variant": variant}
    model, fn, facts, caught, started = None, None, {}, [], time.perf_counter()
    budget, allow = None, False
    for _attempt in range(3):  # again at the smallest feasible budget remat states, or with native batch norms
        model, facts = copy.deepcopy(base), {}
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn = prepare(variant, model, loss_fn, batch, args, facts, budget, allow)
            except InfeasibleBudgetError as exc:  # remat.optimize: refused before running
                if budget is not None or exc.min_budget_bytes is None:
                    raise
                record["infeasible"] = str(exc).splitlines()[0][:300]
                budget = exc.min_budget_bytes
                continue
            except TraceError as exc:  # remat.optimize: cuDNN's batch norm, which a traced step cannot run
                if allow or ALLOW_OPTION not in str(exc):
                    raise
                record["refused"] = str(exc)[:800]
                allow = True
                continue
            seeded_step(fn, model, batch, seed=1)
            synchronize(device)
        least = _smallest_stated(facts)
        if budget is None and least is not None:  # remat.backend: fell back for an infeasible budget
            record["infeasible"] = "; ".join(r.fallback for r in facts["backend"].reports if r.fallback)[:300]
            budget = least
            continue
        break
    if budget is not None:
        record["planned_at_bytes"] = budget
    record["first_step_s"] = round(time.perf_counter() - started, 2)
    grads = [p.grad for p in model.parameters()]
    if "eager" in references:
        record.update(compare_grads(grads, references["eager"]))
    if (is_compiled(variant) and variant != COMPILED or allow) and COMPILED in references:
        record["vs_compiled"] = compare_grads(grads, references[COMPILED])
    own = own_eager(variant)
    if own is not None and variant != own and own in references:
        record["vs_own_eager"] = {"row": own, **compare_grads(grads, references[own])}
    record["warnings"] = sorted({str(w.message)[:300] for w in caught if "remat" in str(w.message)})
    if "backend" in facts:
        reports = facts["backend"].reports
        if not reports:
            raise RuntimeError(f"{variant}: remat's partitioner never ran")
        record["graphs"] = [_report(r) for r in reports]
        planned = [r for r in reports if r.fallback is None]
        record["fell_back"] = len(planned) < len(reports)
        if len(reports) == 1 and planned:
            record["predicted_peak_bytes"] = planned[0].predicted_peak_bytes
            record["budget_bytes"] = planned[0].budget_bytes
    if "step" in facts:
        report = facts["step"].report
        record["graphs"] = [{"graph_name": "step", "method": report.method, "fallback": None,
                             "overhead": report.overhead, "status": report.status.value, "solve_s": report.solve_s,
                             "n_nodes": report.n_nodes, "budget_bytes": report.budget_bytes,
                             "predicted_peak_bytes": report.predicted_peak_bytes}]
        record.update(fell_back=False, predicted_peak_bytes=report.predicted_peak_bytes,
                      budget_bytes=report.budget_bytes)
    if variant.startswith("activation_memory_budget") and not facts.get("partitions"):
        raise RuntimeError(f"{variant}: the min-cut partitioner never ran (a cached graph was reused?)")
    record.update({k: v for k, v in facts.items() if k in ("checkpointed_blocks", "partitions")})
    resident = [*model.parameters(), *model.buffers(), *batch]
    method = MemoryMethod.CUDA_ALLOCATOR if device.type == "cuda" else MemoryMethod.PROFILER
    peak = measure_peak(lambda *a: seeded_step(fn, model, batch, seed=2), *resident, method=method)
    record.update(peak_bytes=peak.peak_bytes, resident_bytes=peak.resident_bytes, memory_method=method.value)
    if record.get("predicted_peak_bytes"):
        record["peak_error"] = peak.peak_bytes / record["predicted_peak_bytes"] - 1
    times, issued = [], []
    before = allocator_calls(device)
    for r in range(args.rounds):
        synchronize(device)
        t0 = time.perf_counter()
        seeded_step(fn, model, batch, seed=3 + r)
        issued.append(time.perf_counter() - t0)  # the CPU's part: until the step returns, unsynchronized
        synchronize(device)
        times.append(time.perf_counter() - t0)
    record.update(step_s=statistics.median(times), step_s_all=[round(t, 5) for t in times],
                  host_s=statistics.median(issued))
    after = allocator_calls(device)
    if before is not None and after is not None:  # the timed steps' calls to the driver, per step
        record["device_allocs_per_step"] = {k: (after[k] - before[k]) / args.rounds for k in after}
    record["_grads"] = grads
    return record


def _smallest_stated(facts: dict) -> int | None:
    """The smallest feasible budget remat's backend stated when every graph fell back for an
    infeasible budget (None otherwise)."""
    reports = facts["backend"].reports if "backend" in facts else []
    least = [r.min_budget_bytes for r in reports if r.fallback is not None]
    if not reports or any(r.fallback is None for r in reports) or not least or None in least:
        return None
    return max(least)


def _report(r) -> dict:
    keys = ("graph_name", "method", "fallback", "note", "budget_bytes", "unoptimized_peak_bytes",
            "predicted_peak_bytes", "overhead", "status", "solve_s", "n_nodes", "backward_recomputes",
            "replayed_random_ops")
    return {k: getattr(r, k) for k in keys}


def check_model(spec: Spec, args, record: dict, save, deadline: float) -> None:
    """Every variant of ``spec`` not measured yet (skipped for time before, or failed), in
    order, saving after each. Eager (and the compiled row, when a compiled variant is pending)
    run again on a resumed run: their gradients are the references."""
    import torch

    done = {name for name, v in record["variants"].items() if "skipped" not in v and "error" not in v}
    names = variant_names(args.budgets, spec.name)
    pending = [v for v in names if v not in done]
    if not pending:
        print(f"{spec.key}: done already", flush=True)
        return
    needed = {"eager"} | ({COMPILED} if any(is_compiled(v) or v.startswith("remat.optimize") for v in pending)
                          else set()) | {own_eager(v) for v in pending if own_eager(v)}
    device = torch.device(args.device)
    with torch.device(device):
        torch.manual_seed(0)
        base, batch, loss_fn = spec.build()
    record.setdefault("config", {**spec.config, "batch": spec.batch_size})
    references: dict[str, list] = {}
    for variant in names:
        if variant not in pending and variant not in needed:
            continue
        if time.monotonic() > deadline and variant in pending:
            record["variants"][variant] = {"variant": variant, "skipped": "over the time budget; run again to resume"}
            print(f"  {spec.key} {variant}: skipped (over the time budget)", flush=True)
            continue
        try:
            result = measure_variant(spec, variant, base, batch, loss_fn, references, args)
        except Exception as exc:  # one variant failing is a finding, not the end of the run
            result = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        grads = result.pop("_grads", None)
        if variant in needed and grads is not None:
            references[variant] = grads
        if variant == "eager" and grads is None:
            raise RuntimeError(f"{spec.key}: eager PyTorch failed: {result.get('error')}")
        if variant in pending:
            record["variants"][variant] = result
            save()
            print(f"  {spec.key} {variant}: {_summary(result)}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_gradscaler(args, results: dict, save, deadline: float) -> None:
    """The README's float16 recipe against eager's ``scaler.scale(loss).backward()``, into
    ``results["gradscaler"]`` (see the module's docstring); measured again only when absent,
    skipped or failed."""
    done = results.get(GRADSCALER)
    if done is not None and "skipped" not in done and "error" not in done:
        print(f"{GRADSCALER}: done already", flush=True)
        return
    if time.monotonic() > deadline:
        results[GRADSCALER] = {"skipped": "over the time budget; run again to resume"}
        print(f"{GRADSCALER}: skipped (over the time budget)", flush=True)
        save()
        return
    try:
        record = gradscaler_steps(args)
    except Exception as exc:  # a finding, reported with the rest
        record = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    results[GRADSCALER] = record
    save()
    print(f"{GRADSCALER}: {_gradscaler_summary(record)}", flush=True)


def gradscaler_steps(args) -> dict:
    """Eight steps of the README's GradScaler recipe, remat's and eager's side by side."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import remat

    device = torch.device(args.device)
    kind = device.type
    batch = args.batch or (GRADSCALER_QUICK_BATCH if args.quick else GRADSCALER_BATCH)
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 1024), nn.GELU(),
                              nn.Linear(1024, 10))
        batches = [(torch.randn(batch, 256) * (1e4 if i == GRADSCALER_OVERFLOW_STEP else 1.0),
                    torch.randint(0, 10, (batch,))) for i in range(GRADSCALER_STEPS)]
        one = torch.ones(())
    eager = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    scalers = [torch.amp.GradScaler(kind, init_scale=2.0**16, growth_interval=2) for _ in range(2)]

    def loss_fn(m, x, y, scale):
        with torch.autocast(kind, dtype=torch.float16):
            loss = F.cross_entropy(m(x), y)
        return loss * scale  # what scaler.scale(loss) computes

    record: dict = {"batch": batch, "method": args.method}
    options = {"time_limit_s": args.time_limit_s} if args.method in ("milp", "lp_round") else {}
    example = (*batches[0], scalers[1].scale(one))
    try:
        step = remat.optimize(model, example, loss_fn, budget=0.6, method=args.method, **options)
    except remat.InfeasibleBudgetError as exc:  # (the parameters dominate: the smallest stated budget)
        record["planned_at_bytes"] = exc.min_budget_bytes
        step = remat.optimize(model, example, loss_fn, budget=exc.min_budget_bytes, method=args.method, **options)
    record["overhead"] = step.report.overhead
    record["predicted_peak_bytes"] = step.report.predicted_peak_bytes
    steps = []
    for i, (x, y) in enumerate(batches):
        for opt in optimizers:
            opt.zero_grad()
        torch.manual_seed(i)
        with torch.autocast(kind, dtype=torch.float16):
            eager_loss = F.cross_entropy(eager(x), y)
        scaled = scalers[0].scale(eager_loss)
        scaled.backward()
        torch.manual_seed(i)
        remat_loss = step(x, y, scalers[1].scale(one))
        grads = all((a.grad is None and b.grad is None) or (a.grad is not None and b.grad is not None
                                                          and torch.equal(a.grad, b.grad))
                    for a, b in zip(eager.parameters(), model.parameters()))
        for scaler, opt in zip(scalers, optimizers):
            scaler.step(opt)
            scaler.update()
        steps.append({"step": i, "scale_eager": scalers[0].get_scale(), "scale_remat": scalers[1].get_scale(),
                      "loss_bitwise": bool(torch.equal(scaled.detach(), remat_loss.detach())), "grads_bitwise": grads,
                      "params_bitwise": all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters()))})
    record["steps"] = steps
    record["bitwise"] = all(r["loss_bitwise"] and r["grads_bitwise"] and r["params_bitwise"] for r in steps)
    record["scales_agree"] = all(r["scale_eager"] == r["scale_remat"] for r in steps)
    before = steps[GRADSCALER_OVERFLOW_STEP - 1]["scale_eager"]
    record["backed_off"] = steps[GRADSCALER_OVERFLOW_STEP]["scale_eager"] < before  # (the overflow was exercised)
    return record


def _gradscaler_summary(r: dict) -> str:
    if "error" in r or "skipped" in r:
        return "ERROR " + r["error"][:200] if "error" in r else r["skipped"]
    scales = " -> ".join(f"{s['scale_remat']:g}" for s in r["steps"])
    return (f"{len(r['steps'])} steps, {'bitwise' if r['bitwise'] else 'NOT BITWISE'}, scales "
            f"{'agree' if r['scales_agree'] else 'DIFFER'} ({scales}), "
            f"{'backed off' if r['backed_off'] else 'no overflow backoff'} at step {GRADSCALER_OVERFLOW_STEP}")


def _summary(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:200]
    text = f"peak {r['peak_bytes'] / MIB:.1f} MiB, step {r['step_s'] * 1e3:.1f} ms"
    if r.get("predicted_peak_bytes"):
        text += f", predicted {r['predicted_peak_bytes'] / MIB:.1f} MiB ({r['peak_error']:+.2%})"
    if "grads_allclose" in r:
        text += f", grads vs eager {_verdict(r)}"
    if "vs_compiled" in r:
        text += f", vs {COMPILED} {_verdict(r['vs_compiled'])}"
    if (own := r.get("vs_own_eager")) is not None:
        text += f", vs {own['row']} {_verdict(own)}"
    if r.get("planned_at_bytes"):
        text += f", planned at the smallest feasible budget {r['planned_at_bytes'] / MIB:.1f} MiB"
    if r.get("fell_back"):
        text += ", fell back"
    return text


def _verdict(c: dict) -> str:
    """'bitwise', 'allclose' or 'DIFFER', with the largest difference (absolute; relative to the
    largest reference gradient of its tensor)."""
    verdict = "bitwise" if c["grads_bitwise"] else ("allclose" if c["grads_allclose"] else "DIFFER")
    if c["grads_bitwise"]:
        return f"{verdict} (0)"
    rel = c.get("grad_max_rel_diff")
    return f"{verdict} ({c['grad_max_abs_diff']:.2g}" + (f"; {rel:.1e} rel)" if rel is not None else ")")


# ---------------------------------------------------------------------------- report
def markdown(results: dict) -> str:
    """The BENCHMARKS.md section: the device, then one table per model."""
    meta = results.get("meta", {})
    lines = [
        f"## CUDA check on {meta.get('device_name', '?')} (`bench/cuda_check.py`)",
        "",
        f"Command: `{meta.get('command', 'python bench/cuda_check.py')}`; device {meta.get('device_name', '?')} "
        f"({meta.get('device', '?')}), PyTorch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}, measured "
        f"{meta.get('measured', '?')}. remat method `{meta.get('method', '?')}` ({meta.get('time_limit_s', '?')} s "
        f"limit), budgets are fractions of each step's unoptimized peak. Peak: the allocator's peak during one step "
        f"above what was allocated before it, plus parameters, buffers and batch ({meta.get('memory_method', '?')}); "
        f"error: measured over remat's predicted peak (flagged beyond {PEAK_TOLERANCE:.0%}). Step: median of "
        f"{meta.get('rounds', '?')} steps. Gradients against eager: allclose with rtol {RTOL:g} and atol "
        f"{ATOL_SCALE:g} x max|eager gradient| per tensor, with the largest difference (absolute; relative to the "
        f"largest eager gradient of its tensor); \"eager again\" is eager against itself. `{COMPILED}`: PyTorch's "
        f"compiler and partitioner with no memory budget, the graph `remat.backend` plans; the compiled rows are "
        f"compared with it too. `remat.optimize`: remat's own tracing and executor, no compiler.",
        "",
    ]
    if results.get("notes"):  # what the run's operator recorded beside the tables (JSON "notes")
        lines += [*(f"- {note}" for note in results["notes"]), ""]
    device_runs = meta.get("device") == "cuda"  # on a GPU the CPU's part of a step can bound it
    for key, record in sorted(results.get("models", {}).items(), key=lambda kv: _model_order(kv[0])):
        variants = dict(sorted(record.get("variants", {}).items(), key=lambda kv: _order(kv[0])))
        eager = variants.get("eager", {})
        lines += [f"### {key}", "", "| variant | peak MiB | vs eager | predicted MiB | error | step ms | vs eager | "
                  "gradients vs eager (max diff) | notes |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for name, v in variants.items():
            if "error" in v or "skipped" in v:
                lines.append(f"| {name} | | | | | | | | {v.get('error') or v.get('skipped')} |"[:400])
                continue
            rel_peak = f"{v['peak_bytes'] / eager['peak_bytes']:.2f}" if eager.get("peak_bytes") else ""
            rel_time = f"{v['step_s'] / eager['step_s']:.2f}" if eager.get("step_s") else ""
            predicted = f"{v['predicted_peak_bytes'] / MIB:.1f}" if v.get("predicted_peak_bytes") else ""
            error = ""
            if v.get("peak_error") is not None:
                error = f"{v['peak_error']:+.2%}" + (" ⚠" if abs(v["peak_error"]) > PEAK_TOLERANCE else "")
            grads = _verdict(v) if "grads_allclose" in v else ""
            notes = []
            if "vs_compiled" in v:
                notes.append(f"vs {COMPILED}: {_verdict(v['vs_compiled'])}")
            if (own := v.get("vs_own_eager")) is not None:
                notes.append(f"vs {own['row']}: {_verdict(own)}")
            if v.get("refused"):
                notes.append("refused by default (cuDNN batch norm); run with allow_native_batch_norm=True")
            if v.get("planned_at_bytes"):
                notes.append(f"budget infeasible, planned at the smallest stated: {v['planned_at_bytes'] / MIB:.1f} MiB")
            if v.get("fell_back"):
                notes.append("fell back: " + "; ".join(g["fallback"] for g in v["graphs"] if g["fallback"])[:160])
            for g in v.get("graphs", []):
                if g.get("overhead") is not None:
                    notes.append(f"{g['method']} overhead {g['overhead']:.3f}x")
            if len(v.get("graphs", [])) > 1:
                notes.append(f"{len(v['graphs'])} graphs")
            if v.get("checkpointed_blocks"):
                notes.append(f"{v['checkpointed_blocks']} blocks")
            if v.get("host_s") is not None and device_runs:
                notes.append(f"issued in {v['host_s'] * 1e3:.1f} ms")
            calls = v.get("device_allocs_per_step") or {}
            if calls.get("num_device_alloc") or calls.get("num_device_free"):
                notes.append(f"{calls.get('num_device_alloc', 0):g} cudaMalloc and {calls.get('num_device_free', 0):g} "
                             "cudaFree a step")
            if v.get("graphs") or v.get("partitions"):
                notes.append(f"first step {v['first_step_s']:.0f} s ({'trace' if 'optimize' in name else 'compile'} "
                             "and plan)")
            lines.append(f"| {name} | {v['peak_bytes'] / MIB:.1f} | {rel_peak} | {predicted} | {error} | "
                         f"{v['step_s'] * 1e3:.1f} | {rel_time} | {grads} | {'; '.join(notes)} |")
        lines.append("")
    if GRADSCALER in results:
        lines += gradscaler_markdown(results[GRADSCALER])
    lines += [summary(results), ""]
    return "\n".join(lines)


def gradscaler_markdown(r: dict) -> list[str]:
    """The GradScaler check's table: per step, both scalers' scales and what is bitwise."""
    lines = [f"### {GRADSCALER}: float16 autocast with torch.amp.GradScaler", ""]
    if "error" in r or "skipped" in r:
        return lines + [r.get("error") or r["skipped"], ""]
    at = (f"planned at the smallest budget remat states, {r['planned_at_bytes'] / MIB:.1f} MiB"
          if r.get("planned_at_bytes") else "planned at 60% of its peak")
    lines += [f"The README's recipe on a three-layer MLP with dropout (batch {r['batch']}, `{r['method']}`, {at}, "
              f"{r['overhead']:.3f}x): the scaler's scale given to the step as a batch tensor, against eager's "
              f"`scaler.scale(loss).backward()`; SGD; batch {GRADSCALER_OVERFLOW_STEP} is scaled by 10^4 so that "
              f"float16 overflows. {_gradscaler_summary(r)}.", "",
              "| step | scale (eager) | scale (remat) | scaled loss | gradients | parameters after the step |",
              "|---:|---:|---:|---|---|---|"]
    for s in r["steps"]:
        lines.append(f"| {s['step']} | {s['scale_eager']:g} | {s['scale_remat']:g} | "
                     + " | ".join("bitwise" if s[k] else "DIFFER" for k in ("loss_bitwise", "grads_bitwise",
                                                                            "params_bitwise")) + " |")
    return lines + [""]


def _model_order(key: str) -> tuple:
    """Tables in the order of ``MODELS`` (the JSON keeps its keys sorted), then by batch."""
    name, _, batch = key.partition("@")
    names = [*MODELS, *LARGE_MODELS]
    return (names.index(name) if name in names else len(names), name, int(batch) if batch.isdigit() else 0)


def _order(variant: str) -> tuple:
    """Table order: eager, eager again, torch.compile, remat.backend and then remat.optimize from
    the largest budget down, checkpoint, min-cut."""
    for rank, prefix in ((6, "remat.backend"), (7, "remat.optimize")):
        if variant.startswith(prefix):
            size = 0.0 if variant == SMALLEST else budget_of(variant)
            return rank, -size, next((i + 1 for i, m in enumerate(MODES) if variant.endswith(m)), 0)
    kinds = ("eager", "eager again", EAGER_OFF, EAGER_AMP, EAGER_AMP_AGAIN, COMPILED, "", "", "checkpoint every block")
    return (kinds.index(variant) if variant in kinds else len(kinds), 0, 0)


def agrees(c: dict, noise: float) -> bool:
    """Gradients that agree with a reference: allclose, or no farther from it than
    ``NOISE_FACTOR`` times eager's difference from itself (``noise``)."""
    return c["grads_allclose"] or c["grad_max_abs_diff"] <= NOISE_FACTOR * noise


def verdicts(results: dict) -> list[tuple[str, str, str]]:
    """Each remat row with gradients (or an error) as ``(key, name, verdict)``: the verdict is
    ``"eager"``, ``COMPILED``, ``EAGER_OFF`` or ``EAGER_AMP``, the reference its gradients agree
    with (a row run with cuDNN off or under autocast must agree with its own eager row; a
    ``remat.backend`` row may agree with ``COMPILED`` instead of eager), or else the problem, in
    words."""
    out = []
    for key, record in results.get("models", {}).items():
        variants = record.get("variants", {})
        noise = variants.get("eager again", {}).get("grad_max_abs_diff") or 0.0
        for name, v in variants.items():
            if not name.startswith("remat") or not ("error" in v or "grads_allclose" in v):
                continue
            if "error" in v:
                verdict = v["error"][:200]
            elif (own := v.get("vs_own_eager")) is not None and not agrees(own, _noise(variants, own["row"], noise)):
                verdict = f"gradients differ from {own['row']}'s by up to {own['grad_max_abs_diff']:.3g}"
            elif agrees(v, noise):
                verdict = "eager"
            elif own is not None:
                verdict = own["row"]
            elif v.get("vs_compiled") is not None and agrees(v["vs_compiled"], noise):
                verdict = COMPILED  # remat changed nothing that compiling alone does not
            else:
                compiled = v.get("vs_compiled")
                verdict = (f"gradients differ from eager's by up to {v['grad_max_abs_diff']:.3g}"
                           + (f" and from {COMPILED}'s by up to {compiled['grad_max_abs_diff']:.3g}"
                              if compiled is not None else ""))
            out.append((key, name, verdict))
    return out


def _noise(variants: dict, row: str, default: float) -> float:
    """How far eager row ``row`` is from itself: the "eager again" row run its way, compared with
    it (``default``, eager's own noise, where there is none)."""
    again = variants.get("eager again" + row[len("eager"):], {})
    own = again.get("vs_own_eager")
    return own["grad_max_abs_diff"] if own is not None and own["row"] == row else default


def problems(results: dict) -> list[str]:
    """What makes the check fail: a remat variant that raised, or whose gradients agree neither
    with eager's nor, for ``remat.backend``, with PyTorch's compiler's on the same graph
    (fallbacks, skipped variants and peak errors are reported, not failures; PyTorch's own
    variants differing is a finding, not a failure)."""
    found = [f"{key} {name}: {verdict}" for key, name, verdict in verdicts(results)
             if verdict not in ("eager", COMPILED, EAGER_OFF, EAGER_AMP)]
    scaler = results.get(GRADSCALER)
    if scaler is not None and "skipped" not in scaler and not (
            scaler.get("bitwise") and scaler.get("scales_agree") and scaler.get("backed_off")):
        found.append(f"{GRADSCALER}: {_gradscaler_summary(scaler)}")
    return found


def summary(results: dict) -> str:
    """One line: how many remat steps ran planned, how many within the peak tolerance, gradients."""
    runs = [v for r in results.get("models", {}).values() for name, v in r.get("variants", {}).items()
            if name.startswith("remat") and "peak_error" in v]
    if not runs:  # (everything skipped, or only the gradscaler check ran)
        bad = problems(results)
        return "no planned remat step was measured" + ("; PROBLEMS: " + "; ".join(bad) if bad else ".")
    within = sum(1 for v in runs if abs(v["peak_error"]) <= PEAK_TOLERANCE)
    worst = max((abs(v["peak_error"]) for v in runs), default=0.0)
    text = (f"{len(runs)} planned remat steps: measured peak within {PEAK_TOLERANCE:.0%} of the prediction in "
            f"{within} (largest |error| {worst:.2%}); ")
    bad = problems(results)
    if bad:
        return text + "PROBLEMS: " + "; ".join(bad)
    apart: dict[str, list[str]] = {COMPILED: [], EAGER_OFF: [], EAGER_AMP: []}  # rows agreeing with another reference
    for key, name, verdict in verdicts(results):
        if verdict in apart:
            apart[verdict].append(f"{key} {name}")
    if not any(apart.values()):
        return text + "gradients agree with eager's in every remat step."
    why = {COMPILED: f"agree with {COMPILED}'s on the same graph (compiling alone changes them)",
           EAGER_OFF: f"agree with {EAGER_OFF}'s (run as eager runs them)",
           EAGER_AMP: f"agree with {EAGER_AMP}'s (run as eager runs them)"}
    return text + ("gradients agree with eager's in every remat step except "
                   + "; ".join(f"{', '.join(rows)}, which {why[ref]}" for ref, rows in apart.items() if rows) + ".")


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from remat.cli_args import (Parser, UsageError, arg_type, method_name, name_list, results_file, time_limit,
                                 writable_file)

    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="cuda_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None,
                        help=f"comma-separated models, from: {', '.join(MODELS)} and the {GRADSCALER} check (default: "
                             f"all of these; with --quick {', '.join(QUICK_MODELS)} and {GRADSCALER}), or the large "
                             f"{', '.join(LARGE_MODELS)}")
    parser.add_argument("--batch", type=int, default=None,
                        help="one batch size for every model (default: each model's own)")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                        help="remat budgets, fractions (default %(default)s)")
    parser.add_argument("--method", type=arg_type(method_name), default="milp",
                        help="remat method (see `remat methods`; default %(default)s)")
    parser.add_argument("--time-limit-s", type=arg_type(time_limit), default=None,
                        help="solver time limit in seconds (default 10, with --quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per variant (default 5, with --quick 2)")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                        help="start no variant after this many seconds (0: record every variant as skipped; "
                             "default %(default)g)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the same code (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small models and inputs (with --device cpu: dry run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default bench/results/cuda_check.json; with --quick cuda_check_quick.json)")
    parser.add_argument("--fresh", action="store_true", help="ignore what the JSON holds already")
    parser.add_argument("--replot", action="store_true", help="only print the section from the JSON")
    args = parser.parse_args(argv)
    try:
        names = name_list(",".join([*(QUICK_MODELS if args.quick else MODELS), GRADSCALER]) if args.models is None
                          else args.models, [*MODELS, *LARGE_MODELS, GRADSCALER])
    except UsageError as exc:
        parser.error(str(exc))
    if args.quick and any(m not in (*QUICK_CAPABLE, GRADSCALER) for m in names):
        parser.error(f"--quick runs {', '.join(QUICK_CAPABLE)} on small inputs; the other models need their paper input")
    args.models = names
    try:
        args.budgets = [float(b) for b in args.budgets.split(",") if b]
    except ValueError:
        parser.error(f"--budgets {args.budgets!r}: give fractions such as 0.7,0.5")
    if not args.budgets or not all(0 < b <= 1 for b in args.budgets):
        parser.error(f"--budgets: every budget must be a fraction in (0, 1], got {args.budgets}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch {args.batch} must be at least 1")
    if args.time_limit_s is None:
        args.time_limit_s = 3.0 if args.quick else 10.0
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    if not args.deadline_s >= 0:  # (nan too)
        parser.error(f"--deadline-s {args.deadline_s:g} must be 0 or more seconds")
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    if not args.replot:
        try:
            if args.fresh:
                writable_file(args.out, "--out")
            else:
                results_file(args.out, None, of="this check")
        except UsageError as exc:
            parser.error(str(exc))
    return args


def check_device(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise NoCudaError("cuda_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine "
                          "with a CUDA GPU, or try the dry run: python bench/cuda_check.py --device cpu --quick")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:  # no device needed: the section from what the JSON holds
        if not args.out.exists():
            print(f"cuda_check: --replot: {args.out} does not exist; run the check first", file=sys.stderr)
            return 2
        print(markdown(json.loads(args.out.read_text())))
        return 0
    try:
        check_device(args)
    except NoCudaError as exc:
        print(exc, file=sys.stderr)
        return 2
    import torch
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    from remat.sweep import environment, save_json

    started = time.monotonic()
    deadline = started + args.deadline_s
    torch._functorch.config.enable_autograd_cache = False  # every compiled variant reaches its partitioner
    torch._inductor.config.fx_graph_cache = False
    torch._dynamo.config.recompile_limit = 64
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    results = {} if args.fresh or not args.out.exists() else json.loads(args.out.read_text())
    device = torch.device(args.device)
    def measured() -> str:
        return json.dumps([results.get("models", {}), results.get(GRADSCALER)], sort_keys=True)

    stored = measured()
    # (this run's provenance, written with the first variant it records: a run that records
    # nothing leaves the file's as it was)
    meta = {
        "command": "python bench/cuda_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "method": args.method,
        "time_limit_s": args.time_limit_s,
        "rounds": args.rounds,
        "budgets": args.budgets,
        "memory_method": "cuda_allocator" if device.type == "cuda" else "profiler",
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "environment": environment(),
        "measured": time.strftime("%Y-%m-%d %H:%M"),
    }
    results.setdefault("models", {})

    def changed() -> bool:
        return measured() != stored

    def save() -> None:
        if changed():
            results["meta"] = meta
            save_json(results, args.out)

    for spec in specs([m for m in args.models if m != GRADSCALER], args.quick, args.batch):
        print(f"{spec.key}:", flush=True)
        record = results["models"].setdefault(spec.key, {"variants": {}})
        check_model(spec, args, record, save, deadline)
        save()
    if GRADSCALER in args.models:
        check_gradscaler(args, results, save, deadline)
    if changed():
        meta["wall_s"] = round(time.monotonic() - started, 1)
        save()
    print(markdown(results))
    if args.out.resolve() == RESULTS.resolve():
        sys.path.insert(0, str(HERE))
        import report

        report.main()
    bad = problems(results)
    for line in bad:
        print(f"cuda_check: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
