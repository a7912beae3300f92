"""One command for a CUDA machine: remat's torch.compile backend on the paper's models and GPT-2,
measured by the CUDA allocator against remat's prediction, against eager PyTorch and against
PyTorch's own memory savers.

For every model (the Checkmate paper's VGG16, VGG19, ResNet50, MobileNet, VGG-U-Net, FCN8 and
SegNet, and GPT-2 small; batch sizes below), one training step (forward, loss, backward) runs as

* eager PyTorch (the reference; run twice, so that the reference's own run-to-run noise is known);
* ``remat.backend`` at two budgets, fractions of the step's unoptimized peak as remat simulates
  it (method ``milp`` with a bounded time limit; what it cannot plan falls back, and says so);
* ``torch.utils.checkpoint`` (non-reentrant) on every block: the elements of the model's block
  lists (GPT-2's layers, the segmentation encoders' stages) or, for a plain ``nn.Sequential``,
  its top-level children;
* ``torch.compile`` with PyTorch's min-cut partitioner at ``activation_memory_budget`` 0.5.

Recorded per variant: the peak memory of one step (``torch.cuda.max_memory_allocated`` above
what was allocated before the step, plus the parameters, buffers and batch, as remat counts
them), remat's predicted peak and their relative difference, the median step time over
``--rounds`` steps against eager, and every gradient against eager's: the largest absolute
difference, bitwise equality, and ``torch.allclose(grad, eager_grad, rtol=RTOL, atol=ATOL_SCALE
* max|eager_grad|)`` per tensor (cuDNN's backward kernels are not deterministic, so eager
against itself is recorded too).

The whole run is sized for one H100 in under 10 minutes: batch sizes below, a solver time
limit, and a deadline (``--deadline-s``) after which the remaining variants are recorded as
skipped; results are written after every variant and a second run resumes where the first
stopped.

    python bench/cuda_check.py                         # on a CUDA machine: every model
    python bench/cuda_check.py --models resnet50,gpt2  # a subset
    python bench/cuda_check.py --device cpu --quick    # dry run of the same code path on CPU

Writes ``bench/results/cuda_check.json`` (``--out`` for another file; the dry run writes
``cuda_check_quick.json``) and, for the default file, regenerates BENCHMARKS.md with a section
that names the device. Exit status: 0, or 1 when a remat variant failed or its gradients are
not allclose to eager's; without CUDA (and without ``--device cpu``) 2, with one line.
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
        b = batch or sizes.get(name) or MODELS[name]
        if name == "gpt2":
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
def variant_names(budgets: list[float]) -> list[str]:
    return ["eager", "eager again", *(f"remat {b:.0%}" for b in budgets), "checkpoint every block",
            f"activation_memory_budget {AOT_BUDGET:g}"]


def prepare(variant: str, model, loss_fn, args: argparse.Namespace, facts: dict):
    """The step function of ``variant`` on ``model`` (a fresh copy): ``fn(*batch) -> loss``."""
    import torch

    if variant.startswith("eager"):
        return lambda *b: loss_fn(model, *b)
    torch._dynamo.reset()  # every compiled variant compiles anew, with its own backend
    if variant.startswith("remat"):
        import remat
        from remat.cost import CostModel

        budget = float(variant.split()[1].rstrip("%")) / 100
        options = {"time_limit_s": args.time_limit_s} if args.method in ("milp", "lp_round") else {}
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

    def step(*b):
        with torch._functorch.config.patch(activation_memory_budget=AOT_BUDGET):
            return compiled(*b)

    return step


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


def compare_grads(grads: list, reference: list) -> dict:
    """Largest |difference|, bitwise equality, and the stated allclose, over paired gradients."""
    import torch

    worst, bitwise, close = 0.0, True, True
    for g, ref in zip(grads, reference, strict=True):
        if (g is None) != (ref is None):
            return {"grad_max_abs_diff": math.inf, "grads_bitwise": False, "grads_allclose": False}
        if g is None:
            continue
        worst = max(worst, float((g.float() - ref.float()).abs().max()))
        bitwise = bitwise and torch.equal(g, ref)
        close = close and torch.allclose(g, ref, rtol=RTOL, atol=ATOL_SCALE * float(ref.abs().max()))
    return {"grad_max_abs_diff": worst, "grads_bitwise": bitwise, "grads_allclose": close}


def measure_variant(spec: Spec, variant: str, base, batch, loss_fn, reference: list | None, args) -> dict:
    """Run one variant of one model: first step (compile), gradients, peak memory, step time."""
    from remat.memory import MemoryMethod, measure_peak
    from remat.sweep import seeded_step

    device = batch[0].device
    model = copy.deepcopy(base)
    facts: dict = {}
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = prepare(variant, model, loss_fn, args, facts)
        seeded_step(fn, model, batch, seed=1)
        synchronize(device)
    record: dict = {"variant": variant, "first_step_s": round(time.perf_counter() - started, 2)}
    grads = [p.grad for p in model.parameters()]
    record.update(compare_grads(grads, reference) if reference is not None else {})
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
    if variant.startswith("activation_memory_budget") and not facts.get("partitions"):
        raise RuntimeError(f"{variant}: the min-cut partitioner never ran (a cached graph was reused?)")
    record.update({k: v for k, v in facts.items() if k in ("checkpointed_blocks", "partitions")})
    resident = [*model.parameters(), *model.buffers(), *batch]
    method = MemoryMethod.CUDA_ALLOCATOR if device.type == "cuda" else MemoryMethod.PROFILER
    report = measure_peak(lambda *a: seeded_step(fn, model, batch, seed=2), *resident, method=method)
    record.update(peak_bytes=report.peak_bytes, resident_bytes=report.resident_bytes, memory_method=method.value)
    if record.get("predicted_peak_bytes"):
        record["peak_error"] = report.peak_bytes / record["predicted_peak_bytes"] - 1
    times = []
    for r in range(args.rounds):
        synchronize(device)
        t0 = time.perf_counter()
        seeded_step(fn, model, batch, seed=3 + r)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    record.update(step_s=statistics.median(times), step_s_all=[round(t, 5) for t in times])
    record["_grads"] = grads
    return record


def _report(r) -> dict:
    keys = ("graph_name", "method", "fallback", "note", "budget_bytes", "unoptimized_peak_bytes",
            "predicted_peak_bytes", "overhead", "status", "solve_s", "n_nodes", "backward_recomputes",
            "replayed_random_ops")
    return {k: getattr(r, k) for k in keys}


def check_model(spec: Spec, args, record: dict, save, deadline: float) -> None:
    """Every variant of ``spec`` not measured yet (or skipped for time before), in order, saving
    after each."""
    import torch

    done = {name for name, v in record["variants"].items() if "skipped" not in v}
    pending = [v for v in variant_names(args.budgets) if v not in done]
    if not pending:
        print(f"{spec.key}: done already", flush=True)
        return
    device = torch.device(args.device)
    with torch.device(device):
        torch.manual_seed(0)
        base, batch, loss_fn = spec.build()
    record.setdefault("config", {**spec.config, "batch": spec.batch_size})
    reference = None
    for variant in variant_names(args.budgets):
        if variant not in pending and variant != "eager":
            continue
        if time.monotonic() > deadline and variant in pending:
            record["variants"][variant] = {"variant": variant, "skipped": "over the time budget; run again to resume"}
            print(f"  {spec.key} {variant}: skipped (over the time budget)", flush=True)
            continue
        try:
            result = measure_variant(spec, variant, base, batch, loss_fn, reference, args)
        except Exception as exc:  # one variant failing is a finding, not the end of the run
            result = {"variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        grads = result.pop("_grads", None)
        if variant == "eager":
            reference = grads
            if reference is None:
                raise RuntimeError(f"{spec.key}: eager PyTorch failed: {result.get('error')}")
        if variant in pending:
            record["variants"][variant] = result
            save()
            print(f"  {spec.key} {variant}: {_summary(result)}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _summary(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:200]
    text = f"peak {r['peak_bytes'] / MIB:.1f} MiB, step {r['step_s'] * 1e3:.1f} ms"
    if r.get("predicted_peak_bytes"):
        text += f", predicted {r['predicted_peak_bytes'] / MIB:.1f} MiB ({r['peak_error']:+.2%})"
    if "grads_allclose" in r:
        text += f", grads {'allclose' if r['grads_allclose'] else 'DIFFER'} (max {r['grad_max_abs_diff']:.2g})"
    if r.get("fell_back"):
        text += ", fell back"
    return text


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
        f"{ATOL_SCALE:g} x max|eager gradient| per tensor; \"eager again\" is eager against itself.",
        "",
    ]
    for key, record in results.get("models", {}).items():
        variants = dict(sorted(record.get("variants", {}).items(), key=lambda kv: _order(kv[0])))
        eager = variants.get("eager", {})
        lines += [f"### {key}", "", "| variant | peak MiB | vs eager | predicted MiB | error | step ms | vs eager | "
                  "gradients (max abs diff) | notes |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
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
            grads = ""
            if "grads_allclose" in v:
                verdict = "bitwise" if v["grads_bitwise"] else ("allclose" if v["grads_allclose"] else "DIFFER")
                grads = f"{verdict} ({v['grad_max_abs_diff']:.2g})"
            notes = []
            if v.get("fell_back"):
                notes.append("fell back: " + "; ".join(g["fallback"] for g in v["graphs"] if g["fallback"])[:160])
            for g in v.get("graphs", []):
                if g.get("overhead") is not None:
                    notes.append(f"{g['method']} overhead {g['overhead']:.3f}x")
            if len(v.get("graphs", [])) > 1:
                notes.append(f"{len(v['graphs'])} graphs")
            if v.get("checkpointed_blocks"):
                notes.append(f"{v['checkpointed_blocks']} blocks")
            if v.get("graphs") or v.get("partitions"):
                notes.append(f"first step {v['first_step_s']:.0f} s (compile and plan)")
            lines.append(f"| {name} | {v['peak_bytes'] / MIB:.1f} | {rel_peak} | {predicted} | {error} | "
                         f"{v['step_s'] * 1e3:.1f} | {rel_time} | {grads} | {'; '.join(notes)} |")
        lines.append("")
    lines += [summary(results), ""]
    return "\n".join(lines)


def _order(variant: str) -> tuple:
    """Table order: eager, eager again, remat from the largest budget down, checkpoint, min-cut."""
    if variant.startswith("remat"):
        return 2, -float(variant.split()[1].rstrip("%"))
    kinds = ("eager", "eager again", "", "checkpoint every block")
    return (kinds.index(variant), 0) if variant in kinds else (4, variant)


def problems(results: dict) -> list[str]:
    """What makes the check fail: a remat variant that raised, or whose gradients are not
    allclose to eager's (fallbacks, skipped variants and peak errors are reported, not failures)."""
    found = []
    for key, record in results.get("models", {}).items():
        for name, v in record.get("variants", {}).items():
            if not name.startswith("remat"):
                continue
            if "error" in v:
                found.append(f"{key} {name}: {v['error'][:200]}")
            elif "grads_allclose" in v and not v["grads_allclose"]:
                found.append(f"{key} {name}: gradients differ from eager's by up to {v['grad_max_abs_diff']:.3g}")
    return found


def summary(results: dict) -> str:
    """One line: how many remat steps ran planned, how many within the peak tolerance, gradients."""
    runs = [v for r in results.get("models", {}).values() for name, v in r.get("variants", {}).items()
            if name.startswith("remat") and "peak_error" in v]
    within = sum(1 for v in runs if abs(v["peak_error"]) <= PEAK_TOLERANCE)
    worst = max((abs(v["peak_error"]) for v in runs), default=0.0)
    bad = problems(results)
    return (f"{len(runs)} planned remat steps: measured peak within {PEAK_TOLERANCE:.0%} of the prediction in "
            f"{within} (largest |error| {worst:.2%}); "
            + ("gradients allclose to eager's in every remat step." if not bad else "PROBLEMS: " + "; ".join(bad)))


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, default=None, help="one batch size for every model")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS), help="remat budgets, fractions")
    parser.add_argument("--method", default="milp", help="remat method")
    parser.add_argument("--time-limit-s", type=float, default=None, help="solver time limit (default 10, quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per variant (default 5, quick 2)")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="start no variant after this many seconds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the same code")
    parser.add_argument("--quick", action="store_true", help="small models and inputs (with --device cpu: dry run)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/cuda_check.json)")
    parser.add_argument("--fresh", action="store_true", help="ignore what the JSON holds already")
    parser.add_argument("--replot", action="store_true", help="only print the section from the JSON")
    args = parser.parse_args(argv)
    names = [m for m in (args.models or ",".join(QUICK_MODELS if args.quick else MODELS)).split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.quick and any(m not in QUICK_CAPABLE for m in names):
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
    args.time_limit_s = args.time_limit_s or (3.0 if args.quick else 10.0)
    args.rounds = args.rounds or (2 if args.quick else 5)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    return args


def check_device(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise NoCudaError("cuda_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine "
                          "with a CUDA GPU, or try the dry run: python bench/cuda_check.py --device cpu --quick")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    results["meta"] = {
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

    def save() -> None:
        save_json(results, args.out)

    for spec in specs(args.models, args.quick, args.batch):
        print(f"{spec.key}:", flush=True)
        record = results["models"].setdefault(spec.key, {"variants": {}})
        check_model(spec, args, record, save, deadline)
        save()
    results["meta"]["wall_s"] = round(time.monotonic() - started, 1)
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
