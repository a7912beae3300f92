"""remat under DDP and FSDP2 on CPU: per-rank peak memory and step time with and without remat.

Two ranks (gloo, one intra-op thread each, spawned by this script) train transformers' GPT-2
(random weights, dropout 0.1, tied embeddings) whose forward returns the next-token loss, so
that forward, loss and backward of a step are compiled together. Engines:

* ``ddp``: DistributedDataParallel, the wrapped model compiled: one graph per step
  (``torch._dynamo.config.optimize_ddp = False``: otherwise torch.compile splits the graph at
  DDP's gradient buckets, the first after 1 MiB of parameters, and remat plans each piece alone).
* ``fsdp2``: FSDP2 with one unit (``fully_shard`` on the model), compiled: one graph per step,
  whose inputs are the all-gathered parameters.
* ``fsdp2-blocks``: FSDP2 with a unit per transformer block and one for the root, every block
  compiled on its own: one graph per block (the embeddings, head and loss run eagerly).

Variants of each engine: the engine without remat (eager PyTorch), and ``remat.backend`` at
each budget (fractions of each graph's eager peak, which ``remat.backend`` measures when it
compiles the graph). Measured on
every rank:

* peak: what the compiled region holds, as remat's budget counts it (the same accounting as the
  tests): the profiler's allocation events over one step (forward, loss, backward and the
  engine's communication; all-gathered parameters included) plus the batch and, for DDP, the
  parameters (the graph's inputs). FSDP2's parameter shards, DDP's gradient buckets and the
  optimizer state live outside the step and are the same with and without remat: listed, not
  added;
* step time: median of interleaved rounds of forward + backward (all variants in turn);
* gradients after the first step from the same weights, data and seed: equal to the engine's
  without remat (bitwise on CPU), and whether any graph fell back to PyTorch's partitioner.

Timing hygiene: one thread per rank, glibc's malloc told not to return memory to the system
(``GLIBC_TUNABLES``, set by re-executing this script), medians over interleaved rounds. Peaks
are deterministic; step times need a quiet machine.

    python bench/distributed.py                    # all engines (about 10 minutes on 2 cores)
    python bench/distributed.py --engines ddp --rounds 3
    python bench/distributed.py --quick            # a smaller model, for a smoke test; own JSON

Results go to ``bench/results/distributed.json`` (rewritten after every engine; engines already
there are skipped unless ``--fresh``); ``markdown(results)`` renders the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "distributed.json"
QUICK_RESULTS = HERE / "results" / "distributed_quick.json"
GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
ENGINES = ("ddp", "fsdp2", "fsdp2-blocks")
#: Budgets per engine. A block's graph holds its parameters, input and gradients and its own
#: backward needs most of its activations at once: it cannot go below about 77% here.
BUDGETS = {"ddp": (0.7, 0.5), "fsdp2": (0.7, 0.5), "fsdp2-blocks": (0.8, 0.7)}
WORLD = 2
MIB = 2**20
#: GPT-2 of the full run and of ``--quick``.
CONFIG = {"layers": 4, "width": 128, "heads": 4, "sequence": 256, "batch": 4, "vocab": 4096}
QUICK_CONFIG = {"layers": 2, "width": 64, "heads": 4, "sequence": 128, "batch": 4, "vocab": 512}


def _reexec_with_tunables() -> None:
    """glibc reads GLIBC_TUNABLES at process start only: restart with it set (the ranks inherit it)."""
    if os.environ.get("GLIBC_TUNABLES") != GLIBC_TUNABLES:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": GLIBC_TUNABLES})


# ---------------------------------------------------------------------------- the model
def language_model(config: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    class LanguageModel(nn.Module):
        def __init__(self, gpt2):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids):
            logits = self.gpt2(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    gpt2_config = GPT2Config(vocab_size=config["vocab"], n_positions=config["sequence"], n_embd=config["width"],
                             n_layer=config["layers"], n_head=config["heads"], resid_pdrop=0.1, embd_pdrop=0.1,
                             attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return LanguageModel(GPT2LMHeadModel(gpt2_config)).train()


def engine_model(engine: str, base, backend):
    """A copy of ``base`` under ``engine``, compiled with ``backend`` (None: eager)."""
    import torch

    model = copy.deepcopy(base)
    if engine == "ddp":
        import torch._dynamo.config
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch._dynamo.config.optimize_ddp = False  # one graph per step, not one per gradient bucket
        model = DDP(model)
        return model, (model if backend is None else torch.compile(model, backend=backend))
    from torch.distributed.fsdp import fully_shard

    if engine == "fsdp2-blocks":
        for block in model.gpt2.transformer.h:
            fully_shard(block)
            if backend is not None:
                block.compile(backend=backend)
        fully_shard(model)
        return model, model
    fully_shard(model)
    return model, (model if backend is None else torch.compile(model, backend=backend))


# ---------------------------------------------------------------------------- one rank
def run_rank(rank: int, store: str, out: str, engine: str, args: dict) -> None:
    """Measure every variant of ``engine`` on this rank; write ``out/rank<r>.json``."""
    import torch
    import torch._functorch.config
    import torch._inductor.config
    import torch.distributed as dist

    import remat
    from remat.backend import RematFallbackWarning
    from remat.cost import CostModel
    from remat.memory import MemoryMethod, measure_peak, resident_bytes_of

    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a rank is
    torch.set_num_threads(1)
    torch._functorch.config.enable_autograd_cache = False  # every variant reaches its partitioner
    torch._inductor.config.fx_graph_cache = False
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    config = args["config"]
    base = language_model(config)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, config["vocab"], (config["batch"], config["sequence"]), generator=gen)
    variants = [("none", None)] + [(f"remat {b:.0%}", b) for b in args["budgets"][engine]]
    runs, records = [], {}
    for name, budget in variants:
        backend = None
        if budget is not None:
            options = {"time_limit_s": args["time_limit_s"]} if args["method"] in ("milp", "lp_round") else {}
            backend = remat.backend(budget, method=args["method"], cost_model=CostModel.PROFILE, cache_dir=None,
                                    **options)
        model, step = engine_model(engine, base, backend)
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RematFallbackWarning)
            torch.manual_seed(7 + rank)
            step(ids).backward()
        first_step_s = time.perf_counter() - started
        grads = [_local(p.grad).clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        # DDP rebuilds its gradient buckets in its second step (a parameter's worth of memory,
        # once): measure a later one
        step(ids).backward()
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(8 + rank)
        measured = measure_peak(lambda: step(ids).backward(), method=MemoryMethod.PROFILER)
        for p in model.parameters():
            p.grad = None
        sharded = engine.startswith("fsdp2")
        inputs = [ids] if sharded else [ids, *model.parameters()]
        record = {
            "variant": name,
            "budget": budget,
            "first_step_s": round(first_step_s, 2),
            "peak_bytes": resident_bytes_of(inputs) + measured.dynamic_peak_bytes,
            "outside_bytes": resident_bytes_of([_local(p) for p in model.parameters()]) if sharded else 0,
            "fallback_warnings": [str(w.message)[:300] for w in caught if issubclass(w.category, RematFallbackWarning)],
            "grads": None,
        }
        if backend is not None:
            record["graphs"] = [_report(r) for r in backend.reports]
        records[name] = record
        runs.append((name, model, step, grads))
    reference = runs[0][3]
    for name, _model, _step, grads in runs:
        records[name]["grads_equal"] = all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        records[name]["grad_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(grads, reference))
        del records[name]["grads"]
    times = {name: [] for name, *_ in runs}
    for r in range(args["rounds"]):
        for name, model, step, _grads in runs:
            torch.manual_seed(100 + r)
            dist.barrier()  # every rank starts the variant together
            started = time.perf_counter()
            step(ids).backward()
            times[name].append(time.perf_counter() - started)
            for p in model.parameters():
                p.grad = None
    for name in times:
        records[name]["step_s"] = statistics.median(times[name])
        records[name]["step_s_all"] = [round(t, 4) for t in times[name]]
    Path(out, f"rank{rank}.json").write_text(json.dumps(list(records.values())))
    dist.barrier()
    dist.destroy_process_group()
    # FSDP2's caches keep gloo's threads alive past destroy_process_group(), and their teardown at
    # interpreter exit can abort a rank whose work is done (see examples/distributed.py)
    atexit._run_exitfuncs()  # what a normal exit runs first (multiprocessing's finalizers among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _report(r) -> dict:
    keys = ("graph_name", "method", "fallback", "budget_bytes", "unoptimized_peak_bytes", "predicted_peak_bytes",
            "overhead", "backward_recomputes", "replayed_random_ops", "from_cache", "agreed_ranks", "source_rank",
            "solve_s", "n_nodes", "note")
    return {k: getattr(r, k) for k in keys}


def measure_engine(engine: str, args: dict, tmp: Path) -> list[list[dict]]:
    """Spawn ``WORLD`` ranks for ``engine``; every rank's records."""
    import torch.multiprocessing as mp

    out = tmp / engine
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(run_rank, args=(str(tmp / f"{engine}.store"), str(out), engine, args), nprocs=WORLD,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


# ---------------------------------------------------------------------------- reporting
def markdown(results: dict) -> str:
    """The BENCHMARKS.md section: one table per engine, one row per variant and rank."""
    meta = results.get("meta", {})
    config = meta.get("config", CONFIG)
    lines = [
        "## remat under DDP and FSDP2 (`bench/distributed.py`)",
        "",
        f"Command: `{meta.get('command', 'python bench/distributed.py')}`; {WORLD} ranks on CPU (gloo), "
        f"{meta.get('threads', 1)} thread per rank, measured {meta.get('measured', '?')}. GPT-2 (transformers, random "
        f"weights, dropout 0.1): {config['layers']} layers, width {config['width']}, sequence {config['sequence']}, "
        f"batch {config['batch']} per rank, vocabulary {config['vocab']}; the model returns its loss. remat method "
        f"`{meta.get('method', '?')}`, budgets are fractions of each graph's eager peak (measured when it is "
        f"compiled). Peak: profiler "
        f"allocation events of one step (forward, loss, backward, the engine's communication, all-gathered "
        f"parameters included) plus the batch and, for DDP, the parameters: what remat's budget counts. FSDP2's "
        f"parameter shards (\"outside\") stay between steps and are not added. Step: median forward + backward over "
        f"{meta.get('rounds', '?')} interleaved rounds. Gradients: the first step's, compared with the engine "
        f"without remat.",
        "",
    ]
    for engine, ranks in results.get("engines", {}).items():
        lines += [f"### {engine}", "", ENGINE_TEXT.get(engine, ""), "",
                  "| variant | rank | peak MiB | vs none | remat predicted MiB | budget MiB | step s | vs none | "
                  "gradients | notes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        for rank, records in enumerate(ranks):
            none = next(r for r in records if r["variant"] == "none")
            for r in records:
                graphs = r.get("graphs") or []
                planned = [g for g in graphs if g["fallback"] is None]
                predicted = max((g["predicted_peak_bytes"] for g in planned), default=None)
                budget = max((g["budget_bytes"] for g in planned), default=None)
                notes = []
                if graphs:
                    notes.append(f"{len(graphs)} graph(s)" + (", overhead " if planned else "")
                                 + ", ".join(f"{g['overhead']:.2f}x" for g in planned))
                if r["fallback_warnings"]:
                    notes.append("fell back: " + r["fallback_warnings"][0][:140])
                if r.get("outside_bytes"):
                    notes.append(f"outside: {r['outside_bytes'] / MIB:.2f} MiB of shards")
                grads = "equal" if r["grads_equal"] else f"differ by {r['grad_max_abs_diff']:.3g}"
                lines.append(
                    f"| {r['variant']} | {rank} | {r['peak_bytes'] / MIB:.2f} | {r['peak_bytes'] / none['peak_bytes']:.2f} | "
                    f"{_mib(predicted)} | {_mib(budget)} | {r['step_s']:.3f} | {r['step_s'] / none['step_s']:.2f} | "
                    f"{grads} | {'; '.join(notes)} |")
        lines.append("")
    lines += [f"- {text}" for text in FINDINGS]
    return "\n".join(lines) + "\n"


def _mib(value) -> str:
    return f"{value / MIB:.2f}" if value else ""


ENGINE_TEXT = {
    "ddp": "DistributedDataParallel, the wrapped model compiled as one graph per step (`optimize_ddp = False`; DDP's "
           "all-reduce hooks as usual, after the backward).",
    "fsdp2": "FSDP2, one unit over the model, compiled: one graph per step whose inputs are the all-gathered parameters.",
    "fsdp2-blocks": "FSDP2, a unit per block and one for the root, every block compiled on its own: remat plans each "
                    "block's graph alone (the budget is per block graph, whose own backward needs most of its "
                    "activations at once: 60% is below what it can meet here, so 80% and 70%); embeddings, head and "
                    "loss run eagerly.",
}
#: What the tables alone do not say (from the run of 2026-11-29; check again after a rerun).
FINDINGS: list[str] = [
    "Measured peaks equal remat's predictions to the byte in every planned step of `ddp` and `fsdp2` (one graph "
    "per step), each within its budget; "
    "both ranks ran the same plan, and every gradient equals the engine's without remat, bitwise.",
    "`fsdp2-blocks`: a block's eager peak (32.5 MiB, what its budget is a fraction of) is above what its graph "
    "holds computing every node once (27.6 MiB), so 80% saves 2 MiB per block at 1.03x; 70% (22.8 MiB) costs "
    "1.09x. At 70% the step's peak is 0.74 of the engine's without remat, against 0.48-0.50 when one plan "
    "covers the whole step at 50% (`ddp`, `fsdp2`): with one graph per block, remat cannot trade one block's "
    "activations against another's.",
    "The overhead column is each plan's cost under the costs profiled in that run, with two ranks sharing two "
    "cores, so it moves from run to run with the profile: the run of 2026-11-24 predicted 1.05x at 50% and this "
    "one 1.18x, for plans of 85 recomputations both, while the measured step ratios were 1.22x and 1.09x. It "
    "is not the planner: on the same graph under the estimate cost model with its machine rates pinned, the "
    "planner of 2026-11-24 and today's plan 50% at 1.132x and 1.131x.",
    "Step times are one run's medians on a 2-core machine, two ranks of one thread each; differences of a few "
    "percent (remat at 80% per block measured 9% faster than without it) are noise. Peaks are deterministic.",
]


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    from remat.cli_args import Parser, arg_type, method_name, positive_int, time_limit

    # (remat's parser: a usage error is one line, exit code 2, checked before any work)
    parser = Parser(prog="distributed.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated engines, from: {', '.join(ENGINES)} (default: all of them)")
    parser.add_argument("--budgets", default=None,
                        help="fractions, comma-separated, for every engine (default: 0.7,0.5; 0.8,0.7 per block)")
    parser.add_argument("--method", type=arg_type(method_name), default="milp",
                        help="remat method (see `remat methods`; default %(default)s)")
    parser.add_argument("--time-limit-s", type=arg_type(time_limit), default=60.0,
                        help="solver time limit in seconds (milp, lp_round; default %(default)g)")
    parser.add_argument("--rounds", type=arg_type(positive_int), default=None,
                        help="interleaved timing rounds (default 7, with --quick 2)")
    parser.add_argument("--quick", action="store_true", help="a smaller model, own JSON")
    parser.add_argument("--fresh", action="store_true", help="measure engines already in the JSON again")
    parser.add_argument("--replot", action="store_true", help="only print the section from the JSON")
    args = parser.parse_args(argv)
    out_path = QUICK_RESULTS if args.quick else RESULTS
    if args.replot:
        if not out_path.is_file():
            parser.error(f"--replot prints the section from {out_path}, which does not exist; run the benchmark first")
        print(markdown(json.loads(out_path.read_text())))
        return 0
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        parser.error(f"--engines: unknown engine(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(ENGINES)}")
    budgets = dict(BUDGETS)
    if args.budgets is not None:
        try:
            given = [float(b) for b in args.budgets.split(",") if b]
        except ValueError:
            parser.error(f"--budgets {args.budgets!r}: give fractions such as 0.7,0.5")
        if not given or not all(0 < b <= 1 for b in given):
            parser.error(f"--budgets {args.budgets!r}: every budget must be a fraction in (0, 1]")
        budgets = {engine: tuple(given) for engine in ENGINES}
    import tempfile

    import torch

    from remat.sweep import environment, save_json

    rounds = (2 if args.quick else 7) if args.rounds is None else args.rounds
    run_args = {"config": QUICK_CONFIG if args.quick else CONFIG, "budgets": budgets, "method": args.method,
                "time_limit_s": args.time_limit_s, "rounds": rounds}
    previous = {} if args.fresh or not out_path.exists() else json.loads(out_path.read_text())
    # (this run's provenance, stored with the first engine it measures: a run that measures
    # nothing leaves the file's as it was)
    meta = {**previous.get("meta", {}),
            "command": "python bench/distributed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "config": run_args["config"], "method": args.method, "time_limit_s": args.time_limit_s,
            "budgets": budgets,
            "rounds": rounds, "threads": 1, "world": WORLD, "torch": torch.__version__,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "environment": environment(),
            "measured": time.strftime("%Y-%m-%d %H:%M")}
    results = {"meta": previous.get("meta", {}), "engines": previous.get("engines", {})}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            if engine in results["engines"]:
                print(f"{engine}: measured already (--fresh to measure again)")
                continue
            print(f"{engine}: {WORLD} ranks, variants none + {', '.join(f'{b:.0%}' for b in budgets[engine])}", flush=True)
            started = time.perf_counter()
            results["engines"][engine] = measure_engine(engine, run_args, Path(tmp))
            print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
            results["meta"] = meta
            save_json(results, out_path)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    _reexec_with_tunables()
    sys.exit(main())
