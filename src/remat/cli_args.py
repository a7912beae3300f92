"""The ``remat`` command's arguments: the parser, and the checks that turn what was typed
into budgets, methods and paths, or a ``UsageError`` (one line, exit code 2) before any work.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from remat.graph import Graph
from remat.solvers import methods as registered_methods
from remat.solvers.milp_backends import MilpBackend
from remat.sweep import checkpoint_all_peak
from remat.units import _FORMS as BUDGET_FORMS
from remat.units import check_time_limit, read_budget

EXIT_OK, EXIT_INFEASIBLE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: The order of `remat sweep`'s columns (baselines first, the MILP last); a method not named
#: here comes before lp_round and milp: the default sweeps every method `remat methods` lists.
SWEEP_ORDER = ("checkpoint_all", "recompute_all", "chen_sqrtn", "chen_greedy", "segments", "nested", "chain",
               "griewank", "descent", "lp_round", "milp")
DEMO_METHODS = "checkpoint_all,chen_sqrtn,chen_greedy,segments,lp_round,milp"
DEMO_BUDGETS = "100%,80%,65%,50%"
DEMO_BATCH = 8
DEMO_TIME_LIMIT_S = 20.0
#: `remat bench EXPERIMENT` -> the script bench/<name>.py whose main(argv) it runs.
BENCH_SCRIPTS = {"sweep": "budget_sweep", "max-batch": "max_batch"}


class UsageError(Exception):
    """Bad command-line input: reported and exit code 2."""



# ---------------------------------------------------------------- parsing
class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not the usage block."""

    _parsing: Sequence[str] = ()  # the line being parsed (values that start with '-' joined to their option)

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            # (argparse checks them before it hands back what it did not know: `--bogus` was
            # reported as "required: --budget")
            unknown = self._unknown_options()
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # (subcommands' parsers are this class too, and parse their share of the line here)
        args = list(sys.argv[1:] if args is None else args)
        self._parsing = self._values_with_dashes(args)
        return super().parse_known_args(self._parsing, namespace)

    def _unknown_options(self) -> list[str]:
        """What this parser does not know of the line it is parsing, its required options aside."""
        required = [action for action in self._actions if action.required]
        try:
            for action in required:
                action.required = False
            return super().parse_known_args(list(self._parsing), argparse.Namespace())[1]
        finally:
            for action in required:
                action.required = True

    def _values_with_dashes(self, args: list[str]) -> list[str]:
        """``--budget -10%`` as ``--budget=-10%``: argparse takes a value that starts with '-'
        for an option (it knows only plain negative numbers such as -5), and would report
        "expected one argument" instead of what is wrong with the value."""
        joined: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                return joined + args[i:]
            action = self._option_string_actions.get(arg)
            if (action is not None and action.nargs is None and i + 1 < len(args)
                    and _DASHED_VALUE.match(args[i + 1])):
                joined.append(f"{arg}={args[i + 1]}")
                i += 2
                continue
            joined.append(arg)
            i += 1
        return joined

    def _unknown_before_command(self, args: list[str]) -> list[str]:
        """Options before the command that this parser does not know (``remat --bogus``)."""
        unknown = []
        for arg in args:
            if not arg.startswith("-") or arg in ("-", "--"):
                break  # the command (or a positional) starts here
            name = arg.split("=", 1)[0]
            if name.startswith("--"):
                known = any(option.startswith(name) for option in self._option_string_actions)
            else:
                known = all(f"-{letter}" in self._option_string_actions for letter in name[1:])
            if not known:
                unknown.append(arg)
        return unknown

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        if self._subparsers is not None:
            # argparse would say a required command is missing, not that an option is unknown
            unknown = self._unknown_before_command(args)
            if unknown:
                self.exit(EXIT_USAGE, f"{self.prog}: error: unrecognized arguments: {' '.join(unknown)} "
                                      f"(see `{self.prog} --help`)\n")
        # argparse reports a subcommand's unknown options at the top: name the subcommand's help
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if isinstance(command, str) else self.prog
            self.exit(EXIT_USAGE, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see `{prog} --help`)\n")
        return parsed


#: A value that starts with '-' and a digit or a point: a negative number, budget or size.
_DASHED_VALUE = re.compile(r"^-[0-9.]")


def arg_type(check: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a checker that raises ValueError with the whole message."""

    def parse(text: str) -> object:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = check.__name__.strip("_")  # argparse names the type in some messages
    return parse


def time_limit(text: str) -> float:
    """A time limit in seconds: positive and finite (the option's name is argparse's to add)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"time limit {text!r} is not a number of seconds; e.g. 60") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"time limit {text} s must be a positive, finite number of seconds; e.g. 60 (or leave "
                         f"the option out for its default)")
    return check_time_limit(value)


def budget_text(text: str) -> str:
    read_budget(text)  # the form and range now; the reference peak once the graph is known
    return text


def _forms_only(message: str, forms: str) -> str:
    """A ``BudgetError``'s text with the forms an option accepts in place of every budget form."""
    return message.replace(BUDGET_FORMS, forms)


#: The forms `remat bench sweep --budgets` accepts: fractions of each model's own peak.
FRACTION_FORMS = "a fraction (0.6) or a percentage ('60%') of each model's checkpoint-all peak"
#: The forms a memory size (`remat bench max-batch --memory`) accepts.
SIZE_FORMS = "bytes ('16000000000') or a size with a unit ('16GB', '2GiB')"


def fraction_of_peak(text: str) -> float:
    """One budget of ``remat bench sweep --budgets``: read as ``remat sweep`` reads a budget,
    and a fraction or a percentage (every model has its own peak, so bytes do not apply)."""
    try:
        spec = read_budget(text)
    except ValueError as exc:
        if "which means a fraction" in str(exc):  # 1.5: a fraction above 1, not bytes to write otherwise
            raise ValueError(f"budget {text!r} is above 1; write {FRACTION_FORMS}, at most 1.0 or '100%'") from None
        raise ValueError(_forms_only(str(exc), FRACTION_FORMS)) from None
    if spec.fraction is None:
        raise ValueError(f"budget {text!r} is a size in bytes ({spec.bytes} B); write {FRACTION_FORMS} "
                         f"('1.0' or '100%': the whole peak)")
    return spec.fraction


def size_in_bytes(text: str, option: str) -> int:
    """A memory size (``16GB``, ``2GiB``, ``16000000000``), read as budgets are read, for
    ``option``; a fraction or percentage of a peak is refused."""
    try:
        spec = read_budget(text)
    except ValueError as exc:
        if "which means a fraction" in str(exc):  # 1.5: neither bytes nor a fraction
            raise ValueError(f"{option} {text!r} is not a whole number of bytes; write {SIZE_FORMS}") from None
        message = _forms_only(str(exc), SIZE_FORMS).replace(f"budget {text!r}", f"{option} {text!r}", 1)
        raise ValueError(message) from None
    if spec.bytes is None:
        kind = "a percentage" if text.strip().endswith("%") else "a fraction"
        raise ValueError(f"{option} {text!r} is {kind}, but {option} is a size: write {SIZE_FORMS}")
    return spec.bytes


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def thread_count(minimum: int = 1, why: str = "") -> Callable[[str], object]:
    """The argparse type of every ``--threads`` option (torch's intra-op threads): a whole
    number, at least ``minimum`` (``why``: " (the reason)", when above 1). torch refuses 0 and
    negatives with a traceback once the work has started; this refuses them as bad usage."""

    def threads(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number of threads; e.g. --threads {minimum}") from None
        if value < minimum:
            raise ValueError(f"{value} is not a usable number of threads; give --threads at least {minimum}{why}")
        return value

    return arg_type(threads)


#: ``--graph KIND:SIZE[:SEED]``: each built-in graph, what its SIZE counts, and the largest SIZE
#: taken. Planning time and memory grow with the square of the node count (a plan is an n x n
#: matrix, the MILP has n^2 variables): at about 4,000 nodes every method plans within a minute
#: or two (the MILP and LP stop at their time limits) in under 1 GB, and unet:100000 asked for
#: 149 GiB. chain:N is capped lower: revolve (griewank, also tried as a MILP warm start)
#: measures a schedule per snapshot count tried (chain:800: 92 of them and a bisection, and
#: the revolve table, about 5 s).
GRAPH_SIZES: dict[str, tuple[str, int, tuple[int, int]]] = {  # kind: (SIZE, largest, nodes = a*SIZE + b)
    "chain": ("the layer count N", 800, (2, 1)),
    "unet": ("the depth D", 1000, (4, 3)),
    "random": ("the forward node count N", 2000, (2, 1)),
}
GRAPH_FORMS = (f"chain:N (N up to {GRAPH_SIZES['chain'][1]}), unet:D (D up to {GRAPH_SIZES['unet'][1]}) or "
               f"random:N:SEED (N up to {GRAPH_SIZES['random'][1]}; SEED 0 if left out)")
GRAPH_HELP = (f"a built-in graph: chain:N (N layers), unet:D (depth D) or random:N:SEED (N forward nodes, "
              f"random with SEED); N is at most {GRAPH_SIZES['chain'][1]} for chain and "
              f"{GRAPH_SIZES['random'][1]} for random, D at most {GRAPH_SIZES['unet'][1]}: larger graphs take "
              f"too long or too much memory to plan")


def graph_spec(text: str) -> str:
    """A ``--graph`` spec, checked before any work: a built-in graph, whole numbers, and a size
    from 1 to that graph's largest in ``GRAPH_SIZES``."""
    kind, *parts = text.split(":")
    if kind not in GRAPH_SIZES or not 1 <= len(parts) <= (2 if kind == "random" else 1):
        raise ValueError(f"graph {text!r} is not a built-in graph; use {GRAPH_FORMS}, e.g. chain:32")
    try:
        size = [int(part) for part in parts][0]
    except ValueError:
        raise ValueError(f"graph {text!r}: sizes must be integers; use {GRAPH_FORMS}") from None
    what, most, (a, b) = GRAPH_SIZES[kind]
    if size < 1:
        raise ValueError(f"graph {text!r}: {what} must be at least 1; e.g. {kind}:8")
    if size > most:
        raise ValueError(f"graph {text!r}: {what} must be at most {most} ({a * most + b} nodes; larger graphs "
                         f"take too long or too much memory to plan); e.g. {':'.join([kind, str(most), *parts[1:]])}")
    return text


#: Where a subcommand counts the -v given after it (argparse would overwrite the count of the
#: -v given before it with it); ``CommandParser`` adds it to ``verbose``.
_VERBOSE_AFTER = "verbose_after_command"
#: The verbosity flags `remat bench EXPERIMENT` takes among the benchmark's own options.
_BENCH_VERBOSE = re.compile(r"^(-v+|--verbose)$")


def add_verbosity(p: argparse.ArgumentParser, dest: str = "verbose") -> None:
    p.add_argument("-v", "--verbose", dest=dest, action="count", default=0, help="log progress (-vv for debug)")


class CommandParser(Parser):
    """The ``remat`` parser: ``-v`` counts wherever it is given, before or after the command
    (``remat -v solve -v`` is ``-vv``), and among ``remat bench EXPERIMENT``'s options."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        parsed.verbose += vars(parsed).pop(_VERBOSE_AFTER, 0)
        if getattr(parsed, "command", None) == "bench" and parsed.options:
            flags = [o for o in parsed.options if _BENCH_VERBOSE.match(o)]
            parsed.verbose += sum(1 if o == "--verbose" else len(o) - 1 for o in flags)
            parsed.options = [o for o in parsed.options if not _BENCH_VERBOSE.match(o)]
        return parsed


def _version() -> str:
    from remat import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="remat", description="Optimal tensor rematerialization for PyTorch.")
    parser.add_argument("--version", action="version", version=f"remat {_version()}")
    add_verbosity(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        """A subcommand; it takes -v after its name too (listed after -h in its help)."""
        p = sub.add_parser(name, **kwargs)
        add_verbosity(p, _VERBOSE_AFTER)
        return p

    p = command("solve", help="plan one graph or model with one method under one budget",
                description="Plan one graph or model with one method under one budget; print a table "
                            "(or --json). Exit code 1 when no plan fits (the message gives the smallest "
                            "budget that does).")
    add_target(p)
    p.add_argument("--budget", required=True, type=arg_type(budget_text),
                   help="bytes (1500000, 2GiB, 512MB), a fraction (0.6) or a percentage (60%%) of the "
                        "checkpoint-all peak (required: no default)")
    p.add_argument("--method", default="milp", help="planning method (see `remat methods`; default %(default)s)")
    add_solver_options(p)
    p.add_argument("--run", action="store_true",
                   help="with --model: run the plan once on real tensors, measure its peak and check gradients "
                        "against eager PyTorch")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    p = command("sweep", help="several methods over a range of budgets; JSON and a plot",
                description="Plan one graph with several methods over a range of budgets. Each point is "
                            "written to --out as soon as it is solved; Ctrl-C stops at once and a rerun of "
                            "the same command resumes (points of the same graph, method, options and remat "
                            "version are read back, not solved again).")
    add_target(p, models=False)
    p.add_argument("--methods", default=None,
                   help="comma-separated methods (default: every method `remat methods` lists)")
    p.add_argument("--budgets", default="30%:100%:8",
                   help="comma-separated budgets, or LOW:HIGH:COUNT evenly spaced (default %(default)s)")
    add_solver_options(p)
    p.add_argument("--out", default="sweep.json", help="the JSON results, kept between runs (default %(default)s)")
    p.add_argument("--plot", default=None,
                   help="where to draw the plot, in the format its extension names (.png, .pdf, .svg, or another "
                        "matplotlib writes; default: --out with .png)")

    p = command("demo", help="optimize a real model with six methods; table, JSON and plot",
                description="Trace a real model, plan it with several methods at several budgets, run "
                            "every plan and check its gradients against eager PyTorch.")
    p.add_argument("--model", default="gpt2-tiny",
                   help="built-in model or package.module:function (default %(default)s)")
    p.add_argument("--batch", type=arg_type(positive_int), default=DEMO_BATCH, help="batch size (default %(default)s)")
    p.add_argument("--budgets", default=DEMO_BUDGETS,
                   help="comma-separated budgets (bytes, fractions or %%) or a LOW:HIGH:COUNT range (default "
                        "%(default)s)")
    p.add_argument("--methods", default=DEMO_METHODS,
                   help=f"comma-separated methods (default {DEMO_METHODS.replace(',', ', ')})")
    p.add_argument("--costs", choices=("profile", "estimate"), default="profile",
                   help="node costs: timed on this machine (profile) or from FLOPs and bytes (estimate; "
                        "default %(default)s)")
    add_solver_options(p, time_limit_s=DEMO_TIME_LIMIT_S)
    p.add_argument("--out", default="out/demo.json",
                   help="where to write the JSON (the plot goes next to it, .png; default %(default)s)")

    command("methods", help="list the planning methods", description="List the planning methods.")

    p = command(
        "bench", help="run a paper benchmark from bench/ (sweep, max-batch), then regenerate BENCHMARKS.md",
        description="Run bench/budget_sweep.py (sweep) or bench/max_batch.py (max-batch) with the options "
                    "that follow, then regenerate BENCHMARKS.md (skip with --no-report). Needs a source "
                    "checkout. `remat bench sweep --help` lists the benchmark's options.")
    p.add_argument("experiment", nargs="?", choices=tuple(BENCH_SCRIPTS), help="which benchmark")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="the benchmark's own options (e.g. --models vgg16 --time-limit 30), --no-report, and "
                        "-v/-vv as before the command")
    return parser


def default_sweep_methods() -> str:
    """Every registered method, in ``SWEEP_ORDER`` (others before lp_round and milp)."""
    known = registered_methods()
    ordered = [m for m in SWEEP_ORDER if m in known]
    others = [m for m in known if m not in SWEEP_ORDER]
    cut = next((i for i, m in enumerate(ordered) if m in ("lp_round", "milp")), len(ordered))
    return ",".join(ordered[:cut] + others + ordered[cut:])


def add_target(p: argparse.ArgumentParser, *, models: bool = True) -> None:
    p.add_argument("--graph", type=arg_type(graph_spec),
                   help=GRAPH_HELP + (" (no default: give --graph or --model)" if models else " (no default: required)"))
    if models:
        p.add_argument("--model", help="a built-in model (mlp, cnn, gpt2-tiny, the paper's vgg16 ... segnet, "
                       "gpt2-small, gpt2-medium) or package.module:function, a function of the batch size returning "
                       "remat.models.Workload(name, model, batch, loss_fn) (no default: give --graph or --model)")
        p.add_argument("--batch", type=arg_type(positive_int), default=None, help="batch size for --model (default 8)")
        p.add_argument("--costs", choices=("profile", "estimate"), default=None,
                       help="node costs for --model: timed on this machine (profile, the default), or estimated from "
                            "FLOPs and bytes (estimate: the model is traced on the meta device, nothing is allocated, "
                            "unless --run)")


def resolve_target(args: argparse.Namespace) -> None:
    """``--batch`` and ``--costs`` apply to ``--model`` only (a built-in ``--graph`` has its own
    sizes and costs: given with one, they were ignored); with a model, their defaults."""
    if not hasattr(args, "batch") or not hasattr(args, "model") or getattr(args, "command", None) == "demo":
        return
    if args.model is None and args.graph is not None:
        given = [flag for flag, value in (("--batch", args.batch), ("--costs", args.costs)) if value is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to --model only; "
                             f"--graph {args.graph} has its own sizes and costs: drop {' and '.join(given)}")
    if args.model is not None:
        args.batch = 8 if args.batch is None else args.batch
        args.costs = "profile" if args.costs is None else args.costs


def add_solver_options(p: argparse.ArgumentParser, *, time_limit_s: float | None = None) -> None:
    """--time-limit (default ``time_limit_s``; None: each method's own) and --backend."""
    p.add_argument("--time-limit", type=arg_type(time_limit), default=time_limit_s,
                   help="seconds the MILP / LP search may take (positive; default "
                        + ("%(default)g" if time_limit_s is not None else "each method's own, 60 for milp and lp_round")
                        + "); measuring a large graph's known plans and its lower bound comes first, on top")
    p.add_argument("--backend", default=None, choices=[b.value for b in MilpBackend],
                   help="MILP backend (default highs)")


def add_bench_options(p: argparse.ArgumentParser, *, methods: Sequence[str], time_limit_s: float, out: Path,
                      out_shown: str) -> None:
    """The options the benchmark searches share: methods, time limit, extra solver options, where
    the JSON goes and torch's threads while tracing."""
    p.add_argument("--methods", default=",".join(methods),
                   help=f"comma-separated methods (see `remat methods`; default {', '.join(methods)})")
    p.add_argument("--time-limit", type=arg_type(time_limit), default=time_limit_s,
                   help="seconds per lp_round / milp solve (positive; default %(default)g)")
    p.add_argument("--options", default=None,
                   help="extra solver options as JSON: {method: {option: value}} (default: none)")
    p.add_argument("--out", type=Path, default=out, help=f"the JSON results (default {out_shown})")
    p.add_argument("--threads", type=thread_count(), default=1,
                   help="torch intra-op threads while tracing (default %(default)s)")


def solver_options(method: str, args: argparse.Namespace) -> dict[str, object]:
    opts: dict[str, object] = {}
    if method in ("milp", "lp_round") and args.time_limit is not None:
        opts["time_limit_s"] = args.time_limit
    if method == "milp" and args.backend is not None:
        opts["backend"] = args.backend
    return opts



def budget_of(text: str, graph: Graph) -> int:
    try:
        return read_budget(text).resolve(checkpoint_all_peak(graph))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def budget_list(text: str, graph: Graph | None) -> list[int]:
    """The budgets of --budgets in bytes (with ``graph`` None: only checked), each once (``50%,0.5``
    is one budget: the second would be "read back" from the first's result)."""
    if graph is None:
        _spread(text, check_budget_text, whole=True, ordered=False)
        return []
    return list(dict.fromkeys(_spread(text, lambda part: budget_of(part, graph), whole=True)))


def fraction_list(text: str) -> list[float]:
    """``remat bench sweep --budgets``: what ``remat sweep --budgets`` takes (a list, or
    LOW:HIGH:COUNT), each budget a fraction or a percentage of each model's checkpoint-all peak."""

    def resolve(part: str) -> float:
        try:
            return fraction_of_peak(part)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    return list(dict.fromkeys(_spread(text, resolve, whole=False)))


#: The most budgets a --budgets range takes (a sweep plans each with every method).
MAX_BUDGETS = 500


def _spread(text: str, resolve: Callable[[str], float], *, whole: bool, ordered: bool = True) -> list:
    """The values of a --budgets list or LOW:HIGH:COUNT range, each read by ``resolve``;
    ``whole``: bytes (rounded), else fractions; not ``ordered``: only checked (LOW and HIGH
    are not comparable before the graph is known)."""
    if text.count(":") == 2:
        low, high, count = text.split(":")
        try:
            k = int(count)
        except ValueError:
            raise UsageError(f"--budgets {text!r}: COUNT must be an integer") from None
        lo, hi = resolve(low), resolve(high)
        if k < 2 and (k < 1 or lo != hi):
            raise UsageError(f"--budgets {text!r}: COUNT is how many budgets LOW to HIGH, both included, so at least "
                             f"2; e.g. {low}:{high}:8 (one budget: --budgets {low})")
        if k > MAX_BUDGETS:
            raise UsageError(f"--budgets {text!r}: at most {MAX_BUDGETS} budgets (each is a plan per method); e.g. "
                             f"{low}:{high}:{min(k, 50)}")
        kinds = {part: read_budget(part) for part in (low, high)}
        mixed = len({spec.bytes is None for spec in kinds.values()}) > 1
        if not ordered:  # (only ends alike compare before the graph is known)
            ends = [spec.fraction if spec.bytes is None else spec.bytes for spec in kinds.values()]
            if not mixed and ends[0] > ends[-1]:
                raise UsageError(f"--budgets {text!r}: the range runs from LOW to HIGH, and {low} is above {high}; "
                                 f"write {high}:{low}:{count}")
            return []
        if lo > hi:
            if mixed:  # (0.3:1:3 is 30% of the peak to 1 byte)
                said = " and ".join(f"{part} is {_meaning(spec)}" for part, spec in kinds.items())
                raise UsageError(f"--budgets {text!r}: {said}, so LOW is above HIGH; write both ends alike, e.g. "
                                 f"30%:100%:{count}")
            raise UsageError(f"--budgets {text!r}: the range runs from LOW to HIGH, and {low} is above {high}; "
                             f"write {high}:{low}:{count}")
        if k == 1:
            return [lo]
        values = [lo + (hi - lo) * j / (k - 1) for j in range(k)]
        return [round(v) for v in values] if whole else [round(v, 9) for v in values]
    if ":" in text:
        raise UsageError(f"--budgets {text!r}: a range is LOW:HIGH:COUNT, e.g. 30%:100%:8; or list budgets, "
                         f"e.g. 50%,75%,100%")
    parts = [part for part in text.split(",") if part.strip()]
    if len(parts) > MAX_BUDGETS:
        raise UsageError(f"--budgets lists {len(parts)} budgets; at most {MAX_BUDGETS} (each is a plan per method)")
    budgets = [resolve(part) for part in parts]
    if not budgets:
        raise UsageError(f"--budgets {text!r} lists no budget; e.g. --budgets 50%,75%,100% or 30%:100%:8")
    return budgets


def _meaning(spec) -> str:
    """What a budget's text means, in words: 'a fraction (30% of the peak)' or '1 byte (a whole
    number is bytes; ...)'."""
    if spec.bytes is None:
        return f"a fraction ({spec.fraction:.0%} of the peak)"
    return f"{spec.bytes} byte{'s' if spec.bytes != 1 else ''} (a whole number is bytes; 100% is the whole peak)"


def backend_budget(text: str) -> str:
    """A --budget as ``remat.backend`` reads it: bytes, a fraction of each compiled region's
    eager peak, or 'cuda-free' (the examples' option)."""
    from remat.units import EAGER, check_budget

    if check_budget(text, cuda_free=True, of=EAGER) == "cuda-free":
        import torch

        if not torch.cuda.is_available():  # (remat.backend would refuse it after the model was built)
            raise ValueError(f"budget {text!r} is the CUDA device's free memory, and there is no CUDA device "
                             f"here (torch.cuda.is_available() is False); give bytes or a fraction, e.g. 0.6")
    return text


def check_budget_text(text: str) -> int:
    try:
        read_budget(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return 0


def method_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise UsageError(f"--methods {text!r} lists no method; e.g. --methods chen_greedy,milp (see `remat methods`)")
    check_methods(names)
    twice = sorted({m for m in names if names.count(m) > 1})
    if twice:
        raise UsageError(f"--methods lists {', '.join(map(repr, twice))} more than once; list each method once "
                         f"(e.g. --methods {','.join(dict.fromkeys(names))})")
    return names


def method_name(name: str) -> str:
    """A --method value: a method `remat methods` lists (for ``arg_type``: ``ValueError`` says
    which exist)."""
    try:
        check_methods([name])
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    return name


def name_list(text: str, known: Sequence[str], option: str = "--models", kind: str = "model") -> list[str]:
    """A comma-separated list of ``known`` names (a script's --models), in order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"{option}: unknown {kind}(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(known)}")
    return names


def results_file(path: Path, empty: object, option: str = "--out", of: str = "this benchmark") -> object:
    """What a script's results JSON at ``path`` holds (``empty`` where there is none yet),
    checked before any work: a path that cannot be written, or a file that is not JSON (whose
    results the run would lose), is a usage error."""
    import json

    writable_file(path, option)
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):  # (an empty file: no results yet)
        return empty
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise UsageError(f"{option} {str(path)!r} is not a results file of {of} (not readable JSON: {exc})") from None


def check_methods(names: Sequence[str]) -> None:
    known = registered_methods()
    for name in names:
        if name not in known:
            raise UsageError(f"unknown method {name!r}; choose from {', '.join(known)}")


def json_path(text: str, *, plot_option: bool = True) -> Path:
    """``--out``'s results file, which must end in .json (``plot_option``: the command takes
    ``--plot`` too, as the message then says)."""
    path = Path(text)
    if path.suffix.lower() != ".json":
        # (a folder: a file in it; a name that is only a suffix, '.json' or '.txt': results.json)
        example = (path / "results.json" if path.is_dir() else path.with_name("results.json") if not path.stem
                   or path.stem.startswith(".") else path.with_suffix(".json"))
        raise UsageError(f"--out {text!r}: the results are JSON, so the file must end in .json (the plot is written "
                         f"next to it with .png{', or where --plot says' if plot_option else ''}); e.g. --out {example}")
    return path


def plot_path(text: str | None, out: Path) -> Path:
    if text is None:
        return out.with_suffix(".png")
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(text)
    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    others = ", ".join(f".{kind}" for kind in kinds if kind not in ("png", "pdf", "svg"))
    if path.is_dir():
        raise UsageError(f"--plot {text!r} is a folder; give a file in it, e.g. --plot {path / f'{out.stem}.png'}")
    if not path.suffix:
        example = path.with_name(f"{path.name.rstrip('.')}.png")
        raise UsageError(f"--plot {text!r} has no extension, and the plot's format comes from it; end it in .png, "
                         f".pdf or .svg (or {others}), e.g. --plot {example}")
    if path.suffix.lower().lstrip(".") not in kinds:
        raise UsageError(f"--plot {text!r}: the plot's format comes from its extension, and "
                         f"{path.suffix!r} is not one matplotlib writes; use .png, .pdf or .svg (or {others})")
    if path.suffix.lower() == ".pgf":
        import shutil

        from matplotlib import rcParams

        tex = rcParams["pgf.texsystem"]
        if shutil.which(tex) is None:
            raise UsageError(f"--plot {text!r}: matplotlib writes .pgf through {tex}, which is not installed here; "
                             "use .png, .pdf or .svg")
    if path.resolve() == out.resolve():
        raise UsageError(f"--plot {text!r} is also --out: the plot would overwrite the results; give another path")
    return path


# ---------------------------------------------------------------- output paths
def writable_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` if a file can be written there: its folder exists or can be made, and takes
    new files; checked before any work (a file is tried there, and removed), so a long run
    does not fail when it first saves. Nothing is left behind. Raises ``UsageError``."""
    path = Path(path)
    shown = f"{option} {str(path)!r}"
    if path.is_dir():
        example = path / f"results{path.suffix or '.json'}"
        raise UsageError(f"{shown} is a folder; give a file in it, e.g. {option} {example}")
    _check_folder(path.parent, shown, "a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{shown}: the file exists and cannot be written (permission denied); give another path")
    return path


def writable_folder(path: str | os.PathLike, option: str) -> Path:
    """``path`` if files can be written in it (it exists, or can be made); else ``UsageError``."""
    path = Path(path)
    shown = f"{option} {str(path)!r}"
    if path.exists() and not path.is_dir():
        raise UsageError(f"{shown} is a file, not a folder; give a folder (it is made if missing)")
    _check_folder(path, shown, "files")
    return path


def _check_folder(folder: Path, shown: str, what: str) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UsageError(f"{shown}: {str(existing)!r} is a file, not a folder, so nothing can be written under it; "
                         f"give a path in a folder")
    where = "" if existing == folder else f" (nor the folder {str(folder)!r})"
    try:
        handle, probe = tempfile.mkstemp(prefix=".remat-write-check-", dir=existing)
    except OSError as exc:
        raise UsageError(f"{shown}: cannot create {what} in {str(existing)!r}{where} ({exc.strerror or exc}); "
                         f"give a path in a folder you can write to") from None
    os.close(handle)
    os.unlink(probe)


# ---------------------------------------------------------------- solver options
def check_backend(name: str | None) -> None:
    """A MILP backend that is installed (``--backend gurobi`` without gurobipy is bad usage)."""
    if name is None:
        return
    from remat.errors import SolverError
    from remat.solvers.milp_backends import backend_available

    try:
        backend_available(MilpBackend.parse(name))
    except (SolverError, ValueError) as exc:
        message = str(exc).replace("choose backend='highs'", "use --backend highs (the default)")
        raise UsageError(f"--backend {name}: {message}") from None


def check_solver_options(options: Mapping[str, Mapping[str, object]], flag: str = "--options") -> None:
    """Every method named, and every option of it, before any work (``remat.planning.
    check_method``, as ``optimize`` and ``remat.backend`` check them), so an unknown option (the
    solver lists the method's options) or a value out of range is refused now, not after
    tracing. Raises ``UsageError``."""
    from remat.errors import MethodError
    from remat.planning import check_method

    try:
        check_methods(list(options))
    except UsageError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    for method, opts in options.items():
        try:
            check_method(method, opts)  # (an uninstalled "backend" too)
        except MethodError as exc:
            raise UsageError(f"{flag}: {exc}") from None
