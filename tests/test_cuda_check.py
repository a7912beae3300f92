"""bench/cuda_check.py on a machine without a GPU: its usage errors, the one-line "no CUDA" exit,
the report it renders from a recorded GPU run, and a dry run of the whole code path on CPU
(``--device cpu --quick``) that writes, renders and resumes."""

from __future__ import annotations

import json
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
    return {
        "meta": {"command": "python bench/cuda_check.py", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
                 "torch": "2.13.0", "cuda": "12.8", "method": "milp", "time_limit_s": 10, "rounds": 5,
                 "memory_method": "cuda_allocator", "measured": "2026-11-24 10:00"},
        "models": {"resnet50@64": {"variants": {
            "eager": eager,
            "eager again": {**eager, "variant": "eager again", "grad_max_abs_diff": 2e-7, "grads_bitwise": False,
                            "grads_allclose": True},
            "remat 70%": {"variant": "remat 70%", "peak_bytes": 760 * 2**20, "step_s": 0.11, "first_step_s": 31.2,
                          "predicted_peak_bytes": 700 * 2**20, "peak_error": 760 / 700 - 1, "grad_max_abs_diff": 0.0,
                          "grads_bitwise": True, "grads_allclose": True, "fell_back": False,
                          "graphs": [{"method": "milp", "overhead": 1.042, "fallback": None}]},
            "remat 50%": {"variant": "remat 50%", "error": "RuntimeError: CUDA out of memory"},
            "checkpoint every block": {"variant": "checkpoint every block", "skipped": "over the time budget; run again"},
            "activation_memory_budget 0.5": {"variant": "activation_memory_budget 0.5", "peak_bytes": 600 * 2**20,
                                             "step_s": 0.12, "first_step_s": 9.6, "grad_max_abs_diff": 0.5,
                                             "grads_bitwise": False,
                                             "grads_allclose": False, "partitions": 1},
        }}},
    }


def test_the_report_names_the_device_and_flags_what_is_off():
    text = cuda_check.markdown(recorded_gpu_run())
    assert text.startswith("## CUDA check on NVIDIA H100 80GB HBM3 (`bench/cuda_check.py`)")
    assert "PyTorch 2.13.0, CUDA 12.8" in text
    assert ("| remat 70% | 760.0 | 0.76 | 700.0 | +8.57% ⚠ | 110.0 | 1.10 | bitwise (0) | milp overhead 1.042x; first "
            "step 31 s (compile and plan) |") in text
    assert "| eager again | 1000.0 | 1.00 |  |  | 100.0 | 1.00 | allclose (2e-07) |  |" in text
    assert ("| activation_memory_budget 0.5 | 600.0 | 0.60 |  |  | 120.0 | 1.20 | DIFFER (0.5) | first step 10 s "
            "(compile and plan) |") in text
    assert "| remat 50% | | | | | | | | RuntimeError: CUDA out of memory |" in text
    assert "| checkpoint every block | | | | | | | | over the time budget; run again |" in text
    assert text.rstrip().endswith(
        "1 planned remat steps: measured peak within 5% of the prediction in 0 (largest |error| 8.57%); PROBLEMS: "
        "resnet50@64 remat 50%: RuntimeError: CUDA out of memory")


def test_the_check_fails_on_remat_gradients_that_are_not_allclose():
    results = recorded_gpu_run()
    variants = results["models"]["resnet50@64"]["variants"]
    assert cuda_check.problems(results) == ["resnet50@64 remat 50%: RuntimeError: CUDA out of memory"]
    del variants["remat 50%"]
    assert cuda_check.problems(results) == []  # PyTorch's own variant differing is a finding, not a failure
    variants["remat 70%"].update(grads_allclose=False, grad_max_abs_diff=0.25)
    assert cuda_check.problems(results) == ["resnet50@64 remat 70%: gradients differ from eager's by up to 0.25"]


def test_dry_run_on_cpu_measures_writes_renders_and_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--quick", "--models", "gpt2,mobilenet", "--budgets", "0.7", "--out", str(out),
            "--rounds", "1"]
    names = cuda_check.variant_names([0.7])
    # past the deadline every variant is recorded as skipped ...
    assert cuda_check.main([*argv, "--deadline-s", "0"]) == 0
    skipped = json.loads(out.read_text())["models"]["gpt2@8"]["variants"]
    assert sorted(skipped) == sorted(names)
    assert all(v["skipped"] == "over the time budget; run again to resume" for v in skipped.values())
    # ... and the next run measures them
    assert cuda_check.main([*argv, "--deadline-s", "600"]) == 0
    results = json.loads(out.read_text())
    assert results["meta"]["device_name"] == "CPU (dry run)" and results["meta"]["memory_method"] == "profiler"
    assert set(results["models"]) == {"gpt2@8", "mobilenet@2"}
    for key, record in results["models"].items():
        variants = record["variants"]
        assert sorted(variants) == sorted(names), key
        for name, v in variants.items():
            assert "error" not in v and "skipped" not in v, (key, name, v)
            assert v["peak_bytes"] > v["resident_bytes"] > 0 and v["step_s"] > 0, (key, name)
            # on CPU eager, remat and checkpointing give eager's gradients bitwise (PyTorch's min-cut
            # partitioner below budget 1 recomputes dropout with new random numbers: not asserted)
            if name != "eager" and not name.startswith("activation_memory_budget"):
                assert v["grads_bitwise"] and v["grads_allclose"] and v["grad_max_abs_diff"] == 0, (key, name, v)
            assert "grad_max_abs_diff" in v or name == "eager"
        assert variants["checkpoint every block"]["checkpointed_blocks"] >= 2
        assert variants["activation_memory_budget 0.5"]["partitions"] >= 1
    remat = results["models"]["gpt2@8"]["variants"]["remat 70%"]
    assert not remat["fell_back"] and remat["peak_bytes"] < results["models"]["gpt2@8"]["variants"]["eager"]["peak_bytes"]
    assert abs(remat["peak_error"]) <= cuda_check.PEAK_TOLERANCE, remat
    shown = capsys.readouterr().out
    assert "## CUDA check on CPU (dry run)" in shown and "### gpt2@8" in shown and "### mobilenet@2" in shown
    table = shown[shown.index("### gpt2@8"):].split("\n\n")[1]
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
        "| eager", "| eager again", "| remat 70%", "| checkpoint every block", "| activation_memory_budget 0.5"]

    # a third run has nothing left to measure
    def measured_again(*args, **kwargs):
        raise AssertionError("a variant in the JSON was measured again")

    monkeypatch.setattr(cuda_check, "measure_variant", measured_again)
    assert cuda_check.main(argv) == 0
    assert "gpt2@8: done already" in capsys.readouterr().out
