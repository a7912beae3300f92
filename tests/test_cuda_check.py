"""bench/cuda_check.py on a machine without a GPU: its usage errors, the one-line "no CUDA" exit,
the report it renders from a recorded GPU run, and a dry run of the whole code path on CPU
(``--device cpu --quick``) that writes, renders and resumes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def load_cuda_check():
    return load_script("bench/cuda_check.py", "bench_cuda_check")


cuda_check = load_cuda_check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_exits_2_with_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_check.py")], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "cuda_check: no CUDA device here (torch.cuda.is_available() is False); run it on a machine with a CUDA GPU, "
        "or try the dry run: python bench/cuda_check.py --device cpu --quick"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "vgg16,alexnet"], "unknown model(s) alexnet; choose from vgg16"),
        (["--budgets", "0.7,x"], "--budgets '0.7,x': give fractions such as 0.7,0.5"),
        (["--budgets", "1.5"], "every budget must be a fraction in (0, 1], got [1.5]"),
        (["--batch", "0"], "--batch 0 must be at least 1"),
        (["--rounds", "-1"], "--rounds -1 must be at least 1"),
        (["--quick", "--models", "segnet"], "--quick runs mobilenet, resnet50, gpt2 on small inputs"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_usage_errors_exit_2_naming_the_problem(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cuda_check.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_blocks_to_checkpoint_are_found_in_every_kind_of_model():
    from remat.models.gpt2 import gpt2_lm
    from remat.models.paper_cnns import mobilenet, resnet50
    from remat.models.paper_segmentation import vgg_unet

    with torch.device("meta"):
        gpt2 = gpt2_lm(1, name="g", layers=3, width=32, heads=4, vocab=64, sequence=8).model
        unet, net, mobile = vgg_unet(), resnet50(), mobilenet()
    assert [i for _, i in cuda_check.block_slots(gpt2)] == [0, 1, 2]  # the transformer's layers
    assert {id(c) for c, _ in cuda_check.block_slots(gpt2)} == {id(gpt2.transformer.h)}
    # U-Net: the encoder's four stages and the decoder's three up-steps; nothing nested twice
    assert [(type(c).__name__, i) for c, i in cuda_check.block_slots(unet)] == [
        ("Stages", 0), ("Stages", 1), ("Stages", 2), ("Stages", 3), ("ModuleList", 0), ("ModuleList", 1),
        ("ModuleList", 2)]
    # plain Sequential models: their children that hold parameters
    slots = cuda_check.block_slots(net)
    assert all(c is net for c, _ in slots) and len(slots) == sum(1 for m in net if any(True for _ in m.parameters()))
    assert len(cuda_check.block_slots(mobile)) > 10


def recorded_gpu_run() -> dict:
    eager = {"variant": "eager", "peak_bytes": 1000 * 2**20, "step_s": 0.1}
    close = {"grad_max_abs_diff": 2e-7, "grad_max_rel_diff": 1e-6, "grads_bitwise": False, "grads_allclose": True}
    bitwise = {"grad_max_abs_diff": 0.0, "grad_max_rel_diff": 0.0, "grads_bitwise": True, "grads_allclose": True}
    apart = {"grad_max_abs_diff": 0.5, "grad_max_rel_diff": 0.25, "grads_bitwise": False, "grads_allclose": False}
    return {
        "meta": {"command": "python bench/cuda_check.py", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
                 "torch": "2.13.0", "cuda": "12.8", "method": "milp", "time_limit_s": 10, "rounds": 5,
                 "memory_method": "cuda_allocator", "measured": "2026-11-24 10:00"},
        "models": {"resnet50@64": {"variants": {
            "eager": eager,
            "eager again": {**eager, "variant": "eager again", **close},
            "torch.compile": {**eager, "variant": "torch.compile", "first_step_s": 5.0, "partitions": 1, **apart},
            "remat.backend 70%": {"variant": "remat.backend 70%", "peak_bytes": 760 * 2**20, "step_s": 0.11,
                                  "first_step_s": 31.2, "predicted_peak_bytes": 700 * 2**20,
                                  "peak_error": 760 / 700 - 1, **apart, "vs_compiled": bitwise, "fell_back": False,
                                  "graphs": [{"method": "milp", "overhead": 1.042, "fallback": None}]},
            "remat.backend 50%": {"variant": "remat.backend 50%", "error": "RuntimeError: CUDA out of memory"},
            "remat.optimize 70%": {"variant": "remat.optimize 70%", "peak_bytes": 990 * 2**20, "step_s": 0.1,
                                   "first_step_s": 12.0, "predicted_peak_bytes": 990 * 2**20, "peak_error": 0.0,
                                   **bitwise, "fell_back": False, "planned_at_bytes": 990 * 2**20,
                                   "infeasible": "budget 700 MiB is infeasible",
                                   "graphs": [{"method": "milp", "overhead": 1.2, "fallback": None}]},
            "checkpoint every block": {"variant": "checkpoint every block", "skipped": "over the time budget; run again"},
            "activation_memory_budget 0.5": {"variant": "activation_memory_budget 0.5", "peak_bytes": 600 * 2**20,
                                             "step_s": 0.12, "first_step_s": 9.6, **apart, "vs_compiled": close,
                                             "partitions": 1},
        }}},
    }


def test_the_report_names_the_device_and_flags_what_is_off():
    text = cuda_check.markdown(recorded_gpu_run())
    assert text.startswith("## CUDA check on NVIDIA H100 80GB HBM3 (`bench/cuda_check.py`)")
    assert "PyTorch 2.13.0, CUDA 12.8" in text
    assert ("| remat.backend 70% | 760.0 | 0.76 | 700.0 | +8.57% ⚠ | 110.0 | 1.10 | DIFFER (0.5; 2.5e-01 rel) | "
            "vs torch.compile: bitwise (0); milp overhead 1.042x; first step 31 s (compile and plan) |") in text
    assert "| eager again | 1000.0 | 1.00 |  |  | 100.0 | 1.00 | allclose (2e-07; 1.0e-06 rel) |  |" in text
    assert ("| activation_memory_budget 0.5 | 600.0 | 0.60 |  |  | 120.0 | 1.20 | DIFFER (0.5; 2.5e-01 rel) | "
            "vs torch.compile: allclose (2e-07; 1.0e-06 rel); first step 10 s (compile and plan) |") in text
    assert ("| remat.optimize 70% | 990.0 | 0.99 | 990.0 | +0.00% | 100.0 | 1.00 | bitwise (0) | budget infeasible, "
            "planned at the smallest stated: 990.0 MiB; milp overhead 1.200x; first step 12 s (trace and plan) |") in text
    assert "| remat.backend 50% | | | | | | | | RuntimeError: CUDA out of memory |" in text
    assert "| checkpoint every block | | | | | | | | over the time budget; run again |" in text
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| eager", "| eager again", "| torch.compile", "| remat.backend 70%", "| remat.backend 50%",
                    "| remat.optimize 70%", "| checkpoint every block", "| activation_memory_budget 0.5"]
    assert text.rstrip().endswith(
        "2 planned remat steps: measured peak within 5% of the prediction in 1 (largest |error| 8.57%); PROBLEMS: "
        "resnet50@64 remat.backend 50%: RuntimeError: CUDA out of memory")


def test_the_check_fails_on_remat_gradients_that_agree_with_no_reference():
    results = recorded_gpu_run()
    variants = results["models"]["resnet50@64"]["variants"]
    assert cuda_check.problems(results) == ["resnet50@64 remat.backend 50%: RuntimeError: CUDA out of memory"]
    del variants["remat.backend 50%"]
    # remat.backend 70% differs from eager as torch.compile does, and is bitwise equal to torch.compile's: no problem;
    # PyTorch's own variants differing is a finding, not a failure
    assert cuda_check.problems(results) == []
    assert cuda_check.summary(results).endswith(
        "gradients agree with eager's in every remat step except resnet50@64 remat.backend 70%, which agree with "
        "torch.compile's on the same graph (compiling alone changes them).")
    variants["remat.backend 70%"]["vs_compiled"] = {**variants["remat.backend 70%"]["vs_compiled"],
                                                    "grads_bitwise": False, "grads_allclose": False,
                                                    "grad_max_abs_diff": 0.125}
    assert cuda_check.problems(results) == [
        "resnet50@64 remat.backend 70%: gradients differ from eager's by up to 0.5 and from torch.compile's by up "
        "to 0.125"]
    # remat.optimize has no compiled reference: it must agree with eager
    variants["remat.backend 70%"]["vs_compiled"]["grads_allclose"] = True
    variants["remat.optimize 70%"].update(grads_bitwise=False, grads_allclose=False, grad_max_abs_diff=0.25)
    assert cuda_check.problems(results) == ["resnet50@64 remat.optimize 70%: gradients differ from eager's by up to 0.25"]
    # ... where a difference within NOISE_FACTOR times eager's own is noise (cuDNN is not deterministic)
    variants["remat.optimize 70%"]["grad_max_abs_diff"] = cuda_check.NOISE_FACTOR * 2e-7
    assert cuda_check.problems(results) == []
    variants["remat.backend 70%"].update(variants["remat.optimize 70%"])
    assert cuda_check.summary(results).endswith("gradients agree with eager's in every remat step.")
    # a row run with cuDNN off must agree with eager run so
    apart = {"grad_max_abs_diff": 0.5, "grad_max_rel_diff": 0.25, "grads_bitwise": False, "grads_allclose": False}
    off = {**variants["remat.optimize 70%"], "variant": "remat.optimize 70%, cuDNN off", **apart,
           "vs_own_eager": {**apart, "row": cuda_check.EAGER_OFF, "grad_max_abs_diff": 0.0625}}
    variants["remat.optimize 70%, cuDNN off"] = off
    assert cuda_check.problems(results) == [
        "resnet50@64 remat.optimize 70%, cuDNN off: gradients differ from eager, cuDNN off's by up to 0.0625"]
    off["vs_own_eager"] = dict(off["vs_own_eager"], grads_allclose=True)
    assert cuda_check.problems(results) == []
    assert cuda_check.summary(results).endswith(
        "except resnet50@64 remat.optimize 70%, cuDNN off, which agree with eager, cuDNN off's (run as eager runs "
        "them).")
    # ... and one under autocast with eager under autocast
    amp = {**off, "variant": "remat.optimize 70%, bf16 autocast", "vs_own_eager": {
        **apart, "row": cuda_check.EAGER_AMP, "grad_max_abs_diff": 0.0625}}
    variants["remat.optimize 70%, bf16 autocast"] = amp
    assert cuda_check.problems(results) == [
        "resnet50@64 remat.optimize 70%, bf16 autocast: gradients differ from eager, bf16 autocast's by up to 0.0625"]
    # ... unless eager under autocast is as far from itself (bfloat16 magnifies nondeterministic kernels)
    variants[cuda_check.EAGER_AMP_AGAIN] = {"variant": cuda_check.EAGER_AMP_AGAIN, **apart, "vs_own_eager": {
        **apart, "row": cuda_check.EAGER_AMP, "grad_max_abs_diff": 0.0625 / cuda_check.NOISE_FACTOR}}
    assert cuda_check.problems(results) == []
    variants[cuda_check.EAGER_AMP_AGAIN]["vs_own_eager"]["grad_max_abs_diff"] = 0.01
    assert len(cuda_check.problems(results)) == 1
    amp["vs_own_eager"] = dict(amp["vs_own_eager"], grads_bitwise=True, grads_allclose=True, grad_max_abs_diff=0.0)
    assert cuda_check.problems(results) == []
    assert cuda_check.summary(results).endswith(
        "remat.optimize 70%, bf16 autocast, which agree with eager, bf16 autocast's (run as eager runs them).")


def test_a_cuda_run_shows_the_time_the_cpu_takes_to_issue_each_step():
    results = recorded_gpu_run()
    results["meta"]["device"] = "cuda"
    results["models"]["resnet50@64"]["variants"]["remat.optimize 70%"]["host_s"] = 0.0615
    row = next(line for line in cuda_check.markdown(results).splitlines() if line.startswith("| remat.optimize 70% |"))
    assert "issued in 61.5 ms" in row


def test_a_cuda_run_shows_the_allocators_calls_to_the_driver_when_a_step_makes_any():
    results = recorded_gpu_run()
    results["meta"]["device"] = "cuda"
    variants = results["models"]["resnet50@64"]["variants"]
    variants["remat.optimize 70%"]["device_allocs_per_step"] = {"num_device_alloc": 2.4, "num_device_free": 1.0,
                                                                "num_alloc_retries": 0.0}
    variants["eager"]["device_allocs_per_step"] = {"num_device_alloc": 0.0, "num_device_free": 0.0}
    rows = {line.split(" | ")[0]: line for line in cuda_check.markdown(results).splitlines() if line.startswith("| ")}
    assert "2.4 cudaMalloc and 1 cudaFree a step" in rows["| remat.optimize 70%"]
    assert "cudaMalloc" not in rows["| eager"]
    assert cuda_check.allocator_calls(torch.device("cpu")) is None  # (counted on CUDA only)


def test_tables_follow_the_models_order_not_the_json_keys():
    results = recorded_gpu_run()
    results["models"] = {"fcn8@8": results["models"]["resnet50@64"], "gpt2@8": {"variants": {}},
                         "resnet50@64": results["models"]["resnet50@64"], "vgg16@64": {"variants": {}}}
    headings = [line for line in cuda_check.markdown(results).splitlines() if line.startswith("### ")]
    assert headings == ["### vgg16@64", "### resnet50@64", "### fcn8@8", "### gpt2@8"]


def test_gradient_comparison_reports_the_relative_difference():
    ref = [torch.tensor([1.0, -4.0]), None, torch.zeros(2)]
    assert cuda_check.compare_grads([t.clone() if t is not None else None for t in ref], ref) == {
        "grad_max_abs_diff": 0.0, "grad_max_rel_diff": 0.0, "grads_bitwise": True, "grads_allclose": True}
    out = cuda_check.compare_grads([torch.tensor([1.0, -3.0]), None, torch.zeros(2)], ref)
    assert out == {"grad_max_abs_diff": 1.0, "grad_max_rel_diff": 0.25, "grads_bitwise": False, "grads_allclose": False}
    # a tensor whose reference gradient is all zeros: any difference is infinitely far
    out = cuda_check.compare_grads([torch.tensor([1.0, -4.0]), None, torch.tensor([0.0, 1e-9])], ref)
    assert out["grad_max_rel_diff"] == math.inf and not out["grads_allclose"]
    # one side missing a gradient
    assert cuda_check.compare_grads([ref[0], torch.ones(1), ref[2]], ref)["grad_max_abs_diff"] == math.inf


@pytest.mark.parametrize("model", ["gpt2", "mobilenet"])  # (one model each: two workers share them)
def test_dry_run_on_cpu_measures_writes_renders_and_resumes(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "check.json"
    key = {"gpt2": "gpt2@8", "mobilenet": "mobilenet@2"}[model]
    argv = ["--device", "cpu", "--quick", "--models", model, "--budgets", "0.7", "--out", str(out),
            "--rounds", "1"]
    names = cuda_check.variant_names([0.7])
    # past the deadline every variant is recorded as skipped ...
    assert cuda_check.main([*argv, "--deadline-s", "0"]) == 0
    skipped = json.loads(out.read_text())["models"][key]["variants"]
    assert sorted(skipped) == sorted(names)
    assert all(v["skipped"] == "over the time budget; run again to resume" for v in skipped.values())
    # ... and the next run measures them
    assert cuda_check.main([*argv, "--deadline-s", "600"]) == 0
    results = json.loads(out.read_text())
    assert results["meta"]["device_name"] == "CPU (dry run)" and results["meta"]["memory_method"] == "profiler"
    assert set(results["models"]) == {key}
    for key, record in results["models"].items():
        variants = record["variants"]
        assert sorted(variants) == sorted(names), key
        for name, v in variants.items():
            assert "error" not in v and "skipped" not in v, (key, name, v)
            assert v["peak_bytes"] > v["resident_bytes"] > 0 and v["step_s"] >= v["host_s"] > 0, (key, name)
            # on CPU eager, compiling, remat and checkpointing give eager's gradients bitwise (PyTorch's
            # min-cut partitioner below budget 1 recomputes dropout with new random numbers: not asserted)
            # (rows under bfloat16 autocast are compared with eager under autocast)
            if name != "eager" and not name.startswith("activation_memory_budget") and cuda_check.AMP not in name:
                assert v["grads_bitwise"] and v["grads_allclose"] and v["grad_max_abs_diff"] == 0, (key, name, v)
            assert "grad_max_abs_diff" in v or name == "eager"
            assert ("vs_compiled" in v) == (name.startswith(("remat.backend", "activation_memory_budget"))), (key, name)
            own = {"remat.optimize 70%, cuDNN off": cuda_check.EAGER_OFF,
                   "remat.optimize 70%, bf16 autocast": cuda_check.EAGER_AMP,
                   cuda_check.EAGER_AMP_AGAIN: cuda_check.EAGER_AMP}.get(name)
            assert v.get("vs_own_eager", {}).get("row") == own, (key, name)
            if own is not None:
                assert v["vs_own_eager"]["grads_bitwise"], (key, name, v)
        # autocast changes the gradients: the check compares such rows with eager under autocast
        assert not variants[cuda_check.EAGER_AMP]["grads_bitwise"]
        assert not variants["remat.optimize 70%, bf16 autocast"]["grads_bitwise"]
        assert variants["checkpoint every block"]["checkpointed_blocks"] >= 2
        assert variants["activation_memory_budget 0.5"]["partitions"] >= 1
    for name in ("remat.backend 70%", "remat.optimize 70%") if model == "gpt2" else ():
        remat = results["models"]["gpt2@8"]["variants"][name]
        assert not remat["fell_back"] and "planned_at_bytes" not in remat, remat
        assert remat["peak_bytes"] < results["models"]["gpt2@8"]["variants"]["eager"]["peak_bytes"]
        assert abs(remat["peak_error"]) <= cuda_check.PEAK_TOLERANCE, remat
        assert remat["vs_compiled"]["grads_bitwise"] if "backend" in name else "vs_compiled" not in remat
    # the small MobileNet cannot fit 70% of its peak: both remat variants plan at the smallest budget they state
    for name in ("remat.backend 70%", "remat.optimize 70%") if model == "mobilenet" else ():
        v = results["models"]["mobilenet@2"]["variants"][name]
        assert "is infeasible" in v["infeasible"] and f"({v['planned_at_bytes']} B)" in v["infeasible"], v
        assert v["planned_at_bytes"] == v["budget_bytes"] and not v["fell_back"], v
        assert v["predicted_peak_bytes"] <= v["planned_at_bytes"] and abs(v["peak_error"]) <= cuda_check.PEAK_TOLERANCE
    shown = capsys.readouterr().out
    assert "## CUDA check on CPU (dry run)" in shown and f"### {key}" in shown
    assert "issued in" not in shown  # the CPU's part of a step is shown for CUDA runs only
    table = shown[shown.index(f"### {key}"):].split("\n\n")[1]
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
        "| eager", "| eager again", "| eager, cuDNN off", "| eager, bf16 autocast",
        "| eager again, bf16 autocast", "| torch.compile",
        "| remat.backend 70%", "| remat.optimize 70%", "| remat.optimize 70%, cuDNN off",
        "| remat.optimize 70%, bf16 autocast", "| checkpoint every block",
        "| activation_memory_budget 0.5"]

    # a third run has nothing left to measure
    def measured_again(*args, **kwargs):
        raise AssertionError("a variant in the JSON was measured again")

    monkeypatch.setattr(cuda_check, "measure_variant", measured_again)
    assert cuda_check.main(argv) == 0
    assert f"{key}: done already" in capsys.readouterr().out


def test_a_rerun_measures_again_the_variants_that_failed(monkeypatch):
    """A variant that failed (on an H200: FCN8's cuDNN-off row refused at its own stated
    smallest budget) is measured again by the next run, once fixed, beside the references it
    is compared with; a rerun kept the error, and the fixed row could only be measured by
    editing the JSON."""
    import time

    names = cuda_check.variant_names([0.7])
    failed = "remat.optimize 70%, cuDNN off"
    record = {"variants": {name: {"variant": name, "peak_bytes": 1} for name in names}}
    record["variants"][failed] = {"variant": failed, "error": "InfeasibleBudgetError: budget 3 B is infeasible"}
    asked = []

    def measure(spec, variant, *args, **kwargs):
        asked.append(variant)
        return {"variant": variant, "peak_bytes": 2, "step_s": 0.1, "_grads": []}

    monkeypatch.setattr(cuda_check, "measure_variant", measure)
    args = cuda_check.parse_args(["--device", "cpu", "--quick", "--budgets", "0.7"])
    spec = cuda_check.specs(["gpt2"], True, None)[0]
    cuda_check.check_model(spec, args, record, lambda: None, time.monotonic() + 600)
    assert asked == ["eager", cuda_check.EAGER_OFF, cuda_check.COMPILED, failed]
    assert record["variants"][failed] == {"variant": failed, "peak_bytes": 2, "step_s": 0.1}
    assert all(record["variants"][name]["peak_bytes"] == 1 for name in names if name != failed)


def test_a_large_model_runs_only_when_named_with_eager_remat_optimize_and_checkpointing(monkeypatch):
    """GPT-2 48L (the solver-scaling workload) is not in the default run; named, it runs eager
    twice, ``remat.optimize`` at each budget and at the smallest, and checkpointing, nothing
    compiled."""
    import time

    assert "gpt2-48l" not in cuda_check.parse_args(["--device", "cpu"]).models
    args = cuda_check.parse_args(["--device", "cpu", "--models", "gpt2-48l", "--budgets", "0.5,0.2"])
    spec = cuda_check.specs(args.models, False, None)[0]
    assert (spec.key, spec.config) == ("gpt2-48l@8", {"layers": 48, "width": 256})
    asked = []

    def measure(spec, variant, *a, **k):
        asked.append(variant)
        return {"variant": variant, "peak_bytes": 2, "step_s": 0.1, "_grads": []}

    monkeypatch.setattr(cuda_check, "measure_variant", measure)
    record = {"variants": {}}
    cuda_check.check_model(spec, args, record, lambda: None, time.monotonic() + 600)
    expected = ["eager", "eager again", "remat.optimize 50%", "remat.optimize 20%", cuda_check.SMALLEST,
                "checkpoint every block"]
    assert asked == expected and list(record["variants"]) == expected
    assert sorted(expected, key=cuda_check._order) == expected  # the smallest budget last among remat's rows


def test_the_smallest_variant_plans_at_the_smallest_budget_remat_states(monkeypatch):
    """``remat.optimize smallest`` asks for one byte, is refused with the smallest feasible
    budget, and plans (and measures) at that budget."""
    import argparse

    spec = cuda_check.specs(["gpt2"], True, None)[0]
    torch.manual_seed(0)
    base, batch, loss_fn = spec.build()
    args = argparse.Namespace(method="milp", time_limit_s=3.0, rounds=1)
    row = cuda_check.measure_variant(spec, cuda_check.SMALLEST, base, batch, loss_fn, {}, args)
    assert "is infeasible" in row["infeasible"] and "smallest budget" in row["infeasible"], row["infeasible"]
    assert row["budget_bytes"] == row["planned_at_bytes"] > 1
    assert row["predicted_peak_bytes"] <= row["planned_at_bytes"]
    assert row["peak_bytes"] == row["predicted_peak_bytes"]  # (on CPU, by the profiler's allocation events)


def test_a_refused_batch_norm_model_runs_with_native_batch_norms_against_the_compiled_row(tmp_path, monkeypatch):
    import importlib

    import remat.trace_errors as te

    monkeypatch.setattr(te, "cudnn_active", lambda device: True)  # as on a CUDA device with cuDNN on
    # batch norms left on the native kernels (as one in eval mode would be): refused by default
    monkeypatch.setattr(importlib.import_module("remat.trace"), "use_eager_batch_norm_kernels", lambda gm, kinds: [])
    # the rows this test reads, not every row of the check
    monkeypatch.setattr(cuda_check, "variant_names",
                        lambda budgets, model=None: ["eager", cuda_check.COMPILED, "remat.optimize 70%"])
    out = tmp_path / "bn.json"
    assert cuda_check.main(["--device", "cpu", "--quick", "--models", "mobilenet", "--budgets", "0.7", "--out",
                            str(out), "--rounds", "1"]) == 0
    variants = json.loads(out.read_text())["models"]["mobilenet@2"]["variants"]
    row = variants["remat.optimize 70%"]
    assert "allow_native_batch_norm=True" in row["refused"] and row["refused"].startswith("module '")
    assert row["grads_bitwise"] and row["vs_compiled"]["grads_bitwise"], row  # on CPU the kernels are eager's
    assert "refused by default (cuDNN batch norm)" in cuda_check.markdown(json.loads(out.read_text()))


def test_a_cudnn_off_row_runs_its_backward_with_cudnn_off_too():
    """The caller of a row's step function calls ``backward()`` after it returns: an eager row
    whose forward alone ran with cuDNN off ran cuDNN's backward kernels (on a GPU its gradients
    and time were neither eager's nor cuDNN-off's)."""
    import argparse

    import torch

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", torch.backends.cudnn.enabled))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", torch.backends.cudnn.enabled))
            return g

    model = torch.nn.Linear(3, 2)
    loss_fn = lambda m, x: Probe.apply(m(x)).sum()  # noqa: E731
    fn = cuda_check.prepare(cuda_check.EAGER_OFF, model, loss_fn, (torch.randn(4, 3),), argparse.Namespace(), {})
    assert torch.backends.cudnn.enabled
    loss = fn(torch.randn(4, 3))
    loss.backward()
    assert seen == [("forward", False), ("backward", False)]
    assert torch.backends.cudnn.enabled and model.weight.grad is not None


def test_replot_prints_the_section_from_the_json_without_a_device(tmp_path, capsys):
    out = tmp_path / "check.json"
    out.write_text(json.dumps(recorded_gpu_run()))
    assert cuda_check.main(["--replot", "--out", str(out)]) == 0
    assert "### resnet50@64" in capsys.readouterr().out
    assert cuda_check.main(["--replot", "--out", str(tmp_path / "missing.json")]) == 2
    assert "does not exist; run the check first" in capsys.readouterr().err


def test_gradscaler_dry_run_is_bitwise_backs_off_renders_and_resumes(tmp_path, capsys):
    """The README's float16 GradScaler recipe (the scale given to the step as a batch tensor)
    against eager's ``scaler.scale(loss).backward()``, on CPU: eight steps, one of them
    overflowing float16 so that both scalers back off and skip it."""
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--quick", "--models", "gradscaler", "--out", str(out)]
    assert cuda_check.main(argv) == 0
    record = json.loads(out.read_text())["gradscaler"]
    assert record["bitwise"] and record["scales_agree"] and record["backed_off"], record
    steps = record["steps"]
    assert len(steps) == cuda_check.GRADSCALER_STEPS and record["batch"] == cuda_check.GRADSCALER_QUICK_BATCH
    over = cuda_check.GRADSCALER_OVERFLOW_STEP
    assert steps[over]["scale_eager"] == steps[over - 1]["scale_eager"] / 2  # (backoff factor 0.5)
    assert all(s["loss_bitwise"] and s["grads_bitwise"] and s["params_bitwise"] for s in steps)
    shown = capsys.readouterr().out
    assert "### gradscaler: float16 autocast with torch.amp.GradScaler" in shown
    assert f"| {over} | {steps[over]['scale_eager']:g} | {steps[over]['scale_remat']:g} | bitwise | bitwise | bitwise |" in shown
    # measured once: a rerun leaves it
    assert cuda_check.main(argv) == 0
    assert "gradscaler: done already" in capsys.readouterr().out


def test_a_gradscaler_record_that_differs_or_never_overflowed_fails_the_check():
    steps = [{"step": i, "scale_eager": 2.0, "scale_remat": 2.0, "loss_bitwise": True, "grads_bitwise": True,
              "params_bitwise": True} for i in range(cuda_check.GRADSCALER_STEPS)]
    good = {"batch": 4, "method": "milp", "overhead": 1.0, "steps": steps, "bitwise": True, "scales_agree": True,
            "backed_off": True}
    assert cuda_check.problems({"gradscaler": good}) == []
    assert cuda_check.problems({"gradscaler": {"skipped": "over the time budget; run again to resume"}}) == []
    for change, shown in (({"bitwise": False}, "NOT BITWISE"), ({"scales_agree": False}, "scales DIFFER"),
                          ({"backed_off": False}, "no overflow backoff at step 3")):
        [problem] = cuda_check.problems({"gradscaler": {**good, **change}})
        assert problem.startswith("gradscaler: 8 steps") and shown in problem
    [problem] = cuda_check.problems({"gradscaler": {"error": "RuntimeError: boom"}})
    assert problem == "gradscaler: ERROR RuntimeError: boom"
    assert "| 0 | 2 | 2 | bitwise | bitwise | bitwise |" in "\n".join(cuda_check.gradscaler_markdown(good))


def test_a_run_that_measured_no_remat_step_does_not_say_they_all_agree():
    """With every variant skipped (--deadline-s 0) it said 'gradients agree with eager's in every
    remat step' after none."""
    skipped = {"models": {"mobilenet@8": {"variants": {"eager": {"variant": "eager", "skipped": "over the time budget"}}}}}
    assert cuda_check.summary(skipped) == "no planned remat step was measured."
    assert cuda_check.summary({}) == "no planned remat step was measured."
