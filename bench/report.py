"""Regenerate BENCHMARKS.md from the JSON the benchmark scripts wrote.

Each benchmark script in this folder writes ``bench/results/<name>.json`` and exposes
``markdown(results) -> str``; this script stitches the sections together in a fixed order.
Run it after any benchmark: ``python bench/report.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTIONS = ("demo_gpt2", "budget_sweep", "max_batch", "spot_checks", "holdout", "zoo", "solver_scaling", "floor_anatomy",
            "vs_pytorch", "step_overhead", "busy_cpu", "distributed", "cuda_check")

HEADER = """# Benchmarks

Every number here is regenerated from the JSON under `bench/results/` by
`python bench/report.py`; each section names the script and command that produced its JSON.
Machine for CPU results: 2 cores, no GPU, PyTorch 2.13.0 CPU build, unless a section says
otherwise.
"""


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file loads
    spec.loader.exec_module(module)
    return module


def render() -> str:
    parts = [HEADER]
    for name in SECTIONS:
        result_path = HERE / "results" / f"{name}.json"
        if not result_path.exists() or not (HERE / f"{name}.py").exists():
            continue
        results = json.loads(result_path.read_text())
        parts.append(_load(name).markdown(results).strip() + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Write BENCHMARKS.md; ``argv`` is the command line's arguments (none: just write it)."""
    from remat.cli_args import Parser  # (a usage error is one line, exit code 2)
    parser = Parser(
        prog="report.py", description="Regenerate BENCHMARKS.md (and nothing else) from the JSON under bench/results/ that the "
                    "benchmark scripts wrote.")
    parser.parse_args([] if argv is None else argv)
    (ROOT / "BENCHMARKS.md").write_text(render())
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
