"""Built-in workloads (model, example batch, loss function) and loading a user's own.

A workload factory is a function ``factory(batch_size: int) -> Workload``. Built-ins are
named: ``mlp``, ``cnn``, ``gpt2-tiny``; the Checkmate paper's networks ``vgg16``, ``vgg19``,
``resnet50``, ``mobilenet``, ``vgg-unet``, ``fcn8``, ``segnet``; and ``gpt2-small``,
``gpt2-medium``. A user's factory is named ``"package.module:function"``.

Factories put the model and batch on the default device, so the paper-scale workloads are
built without allocating on the meta device (``with torch.device("meta"): get_workload(...)``)
and traced with ``CostModel.ESTIMATE``.

>>> w = get_workload("mlp", batch_size=4)
>>> w.loss_fn(w.model, *w.batch).ndim
0
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from remat.errors import TraceError, a_type, user_line


class WorkloadError(TraceError):
    """A workload name or factory spec cannot be resolved into a ``Workload``."""


@dataclass(frozen=True, eq=False)
class Workload:
    """What ``optimize`` and the benchmarks need: a model, one example batch and
    ``loss_fn(model, *batch) -> scalar loss``."""

    name: str
    model: torch.nn.Module
    batch: tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor]


Factory = Callable[[int], Workload]


def _builtins() -> dict[str, Factory]:
    from remat.models import cnn, gpt2, mlp
    from remat.models import paper_workloads as paper

    return {
        "mlp": mlp.mlp,
        "cnn": cnn.cnn,
        "gpt2-tiny": gpt2.gpt2_tiny,
        "gpt2-small": gpt2.gpt2_small,
        "gpt2-medium": gpt2.gpt2_medium,
        **{name: functools.partial(paper.paper_workload, name) for name in paper.PAPER_WORKLOADS},
    }


def names() -> tuple[str, ...]:
    """The built-in workload names."""
    return tuple(sorted(_builtins()))


#: Where a factory's module is looked for, as a missing one's message says.
ON_SYS_PATH = "on sys.path (PYTHONPATH)"


def load_factory(spec: str, *, searched: str = ON_SYS_PATH) -> Factory:
    """Import a factory from ``"package.module:function"``.

    Raises ``WorkloadError`` naming what is missing: the colon, the module or the function
    (``searched``: where the module was looked for, in words, for a caller that looks in more
    places than ``sys.path``, as the ``remat`` command looks in the current directory).
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise WorkloadError(
            f"factory spec {spec!r} is not of the form 'package.module:function' (e.g. "
            f"'mypkg.models:make_workload'); built-in workloads are {', '.join(names())}"
        )
    module_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise WorkloadError(
            f"factory spec {spec!r}: module {module_name!r} cannot be imported ({exc}); check the "
            f"spelling and that it is {searched}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the module itself failed: say where
        raise WorkloadError(
            f"factory spec {spec!r}: importing module {module_name!r} failed{user_line(exc)} "
            f"({type(exc).__name__}: {exc}); fix the module and try again"
        ) from exc
    factory = getattr(module, func_name, None)
    if factory is None:
        raise WorkloadError(
            f"factory spec {spec!r}: module {module_name!r} has no attribute {func_name!r}; define "
            f"`def {func_name}(batch_size: int) -> remat.models.Workload` there"
        )
    if not callable(factory):
        raise WorkloadError(f"factory spec {spec!r}: {func_name!r} is {a_type(factory)}, not a function")
    return factory


def get_workload(name: str, batch_size: int = 8, *, seed: int = 0, searched: str = ON_SYS_PATH) -> Workload:
    """Build a workload by built-in name or ``"package.module:function"`` spec, with weights
    and batch drawn from ``seed`` (``searched``: ``load_factory``'s)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise WorkloadError(f"batch_size={batch_size!r} must be a positive int")
    builtins = _builtins()
    if name in builtins:
        factory = builtins[name]
    elif ":" in name:
        factory = load_factory(name, searched=searched)
    else:
        raise WorkloadError(
            f"unknown workload {name!r}; use one of {', '.join(sorted(builtins))} or a factory "
            f"spec 'package.module:function'"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        workload = factory(batch_size)
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"factory for {name!r} returned {a_type(workload)}; it must return a "
            f"remat.models.Workload(name, model, batch, loss_fn)"
        )
    return workload


__all__ = ["Factory", "Workload", "WorkloadError", "get_workload", "load_factory", "names"]
