"""Byte quantities: parsing budgets given by people and printing sizes for people."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)


def parse_budget(text: str | int | float, reference_bytes: int | None = None) -> int:
    """Parse a budget: plain bytes (``"123456"``), a unit (``"2GiB"``, ``"512MB"``) or a
    percentage of ``reference_bytes`` (``"60%"``, usually the checkpoint-all peak).

    >>> parse_budget("2GiB")
    2147483648
    >>> parse_budget("50%", reference_bytes=1000)
    500
    """
    if isinstance(text, bool):
        raise ValueError(f"budget {text!r} is not a size; give bytes, e.g. '2GiB' or '60%'")
    if isinstance(text, (int, float)):
        if not math.isfinite(text) or text <= 0:
            raise ValueError(f"budget {text!r} must be a positive number of bytes")
        return int(text)
    match = _BUDGET_RE.match(text)
    if match is None:
        raise ValueError(
            f"budget {text!r} is not understood; write bytes ('1500000'), a unit ('2GiB', "
            f"'512MB') or a percentage of the checkpoint-all peak ('60%')"
        )
    value, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if reference_bytes is None:
            raise ValueError(
                f"budget {text!r} is a percentage but there is no reference peak to take it of; "
                f"give bytes instead"
            )
        result = int(value / 100.0 * reference_bytes)
    elif unit in _UNITS:
        result = int(value * _UNITS[unit])
    else:
        raise ValueError(
            f"budget {text!r} has unknown unit {unit!r}; use one of B, KB, MB, GB, KiB, MiB, "
            f"GiB, TiB or %"
        )
    if result <= 0:
        raise ValueError(f"budget {text!r} must be positive")
    return result


def format_bytes(n_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")
