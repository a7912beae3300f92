"""Tracing a step so that it runs what eager PyTorch runs.

``trace`` records the step with ``make_fx`` under the python dispatcher, which applies PyTorch's
Python decompositions (written for compilers) and turns autocast's cast cache off. Where that
would make the traced step compute something else than eager PyTorch, this module restores
eager's behaviour while tracing:

* **Upsampling** (``upsample_*``): decomposed, it became indexing and, backward, an accumulating
  ``index_put`` (same values on a CPU; on a GPU the two upsampling models, VGG-U-Net and SegNet,
  ran 1.5-1.9x eager with it). Its decompositions are suspended, so it traces as itself.
* **Dropout in half precision off CUDA**: eager PyTorch draws a noise tensor in the input's
  dtype, divides it by ``1 - p`` and multiplies (``at::_dropout``); the decomposition calls
  ``native_dropout``, which scales in float, so a bfloat16 or float16 step rounded differently
  whenever ``1 / (1 - p)`` is not exact there (p = 0.1: about 1e-3 on a gradient). Such a call
  traces to eager's arithmetic; on CUDA (eager's fused ``native_dropout``) and in float32 and
  float64 (bitwise equal) the decomposition stays.
* **Autocast's cast cache**: eager casts a parameter once per autocast region and reuses the
  copy, so the gradients of its uses add up in the low precision before one cast back; traced
  with the cache off, each use cast on its own and the gradients added up in float32. The cache
  is on while the step runs (as the user had it), so the trace shares the cast as eager does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._C import DispatchKey

from remat.scratch import UPSAMPLE_OPS

#: Ops whose Python decompositions are suspended while tracing: they trace as themselves.
EAGER_KERNEL_OPS = UPSAMPLE_OPS
#: The python dispatcher's keys at which PyTorch registers those decompositions.
_DECOMPOSING_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
#: Devices on which eager PyTorch's dropout calls the fused ``native_dropout`` kernel.
_FUSED_DROPOUT_DEVICES = frozenset({"cuda", "xpu", "lazy", "privateuseone"})
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _eager_dropout(decomposed: Callable) -> Callable:
    """``aten.dropout`` as eager PyTorch computes it where that is not ``decomposed``'s
    ``native_dropout``: half precision off the fused devices (``at::_dropout``)."""

    def dropout(x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
        if (train and 0 < p < 1 and x.numel() > 0 and x.dtype in _HALF_DTYPES
                and x.device.type not in _FUSED_DROPOUT_DEVICES):
            noise = torch.empty_like(x).bernoulli_(1 - p)
            noise.div_(1 - p)
            return x * noise
        return decomposed(x, p, train)

    return dropout


@contextlib.contextmanager
def _replaced_py_kernels(replacements: dict[torch._ops.OpOverload, Callable | None]) -> Iterator[None]:
    """While in use, each op's Python kernels at ``_DECOMPOSING_KEYS`` are removed (None) or
    replaced by ``replacement(original)``; restored afterwards, whatever happens."""
    saved = []
    try:
        for op, replacement in replacements.items():
            for key in _DECOMPOSING_KEYS:
                if key in op.py_kernels:
                    original = op.py_kernels.pop(key)
                    saved.append((op, key, original))
                    if replacement is not None:
                        op.py_kernels[key] = replacement(original)
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, original in saved:
            op.py_kernels[key] = original
        for op in replacements:
            op._dispatch_cache.clear()


def tracing_as_eager() -> contextlib.AbstractContextManager:
    """Around ``make_fx`` under the python dispatcher: upsampling traces as itself, half-precision
    dropout off CUDA as eager's arithmetic."""
    replacements: dict[torch._ops.OpOverload, Callable | None] = dict.fromkeys(EAGER_KERNEL_OPS)
    replacements[torch.ops.aten.dropout.default] = _eager_dropout
    return _replaced_py_kernels(replacements)


@contextlib.contextmanager
def autocast_cache(enabled: bool) -> Iterator[None]:
    """Inside the function ``make_fx`` traces (which turns the cache off): autocast's cast cache
    as the user had it (``torch.is_autocast_cache_enabled()`` before tracing)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(enabled)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)
