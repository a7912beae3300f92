"""Budgets and time limits as people give them, read the same way by ``optimize``, the
``remat`` command and ``remat.backend``; sizes printed for people.

A budget is one of:

* bytes: an ``int`` (``1500000``), or text: an integer (``"1500000"``), a size with a unit
  (``"2GiB"``, ``"512MB"``) or a whole number in exponent form (``"2e9"``);
* a fraction of the reference peak (the step's peak with nothing recomputed, checkpoint-all):
  a ``float`` in (0, 1] (``0.6``), the same as text (``"0.6"``), or a percentage in (0%, 100%]
  (``"60%"``);
* ``"cuda-free"``: the free memory of the CUDA device (``remat.backend`` only).

Anything else (``None``, ``True``, ``"150%"``, ``1.5``, ``"1e400"``, ``nan``, ``0``) is a
``BudgetError`` that names the value, the rule and what to write instead.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from remat.errors import RematError, a_type

_UNITS = {
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
_NUMBER_RE = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)
_INTEGER_RE = re.compile(r"^\s*[0-9]+\s*$")
CUDA_FREE = "cuda-free"
_FORMS = "bytes ('1500000', '2GiB', '512MB'), a fraction of the checkpoint-all peak (0.6) or a percentage ('60%')"


def _forms(of: str) -> str:
    """The budget forms, with what a fraction is of for the caller (``CHECKPOINT_ALL``, ``EAGER``)."""
    what = "the checkpoint-all peak" if of.startswith("the unoptimized peak") else of
    return f"bytes ('1500000', '2GiB', '512MB'), a fraction of {what} (0.6) or a percentage ('60%')"


class BudgetError(RematError, ValueError):
    """A budget or time limit that remat cannot use (wrong type, out of range, unknown unit,
    'cuda-free' without CUDA)."""


@dataclass(frozen=True)
class BudgetSpec:
    """A budget as given: exactly one of ``bytes``, ``fraction`` (of a reference peak, in
    (0, 1]) or ``cuda_free``."""

    bytes: int | None = None
    fraction: float | None = None
    cuda_free: bool = False
    text: str = ""  # what the user wrote, for messages

    def resolve(self, reference_bytes: int | None) -> int:
        """The budget in bytes; ``reference_bytes`` is what a fraction is of.

        >>> read_budget("60%").resolve(1000)
        600
        """
        if self.bytes is not None:
            return self.bytes
        if self.cuda_free:
            raise BudgetError(
                f"budget {CUDA_FREE!r} (the CUDA device's free memory) is understood by remat.backend only; "
                f"give {_FORMS}"
            )
        if reference_bytes is None:
            kind = "a percentage" if self.text.rstrip("'\" ").endswith("%") else "a fraction"
            raise BudgetError(
                f"budget {self.text} is {kind} but there is no reference peak to take it of; give bytes "
                f"instead ('2GiB')"
            )
        result = int(self.fraction * reference_bytes)
        if result <= 0:
            raise BudgetError(
                f"budget {self.text} is 0 bytes of the reference peak ({reference_bytes} B); it must be positive: "
                f"give a larger fraction"
            )
        return result

    def canonical(self) -> int | float | str:
        """The budget as a plain value: ``int`` bytes, ``float`` fraction or ``"cuda-free"``."""
        if self.bytes is not None:
            return self.bytes
        return CUDA_FREE if self.cuda_free else self.fraction


#: What a fraction is of, where nothing says otherwise (``optimize``, the command line).
CHECKPOINT_ALL = "the unoptimized peak (checkpoint-all: nothing recomputed)"
#: What a fraction is of in ``remat.backend``.
EAGER = "the eager peak of the compiled region"


#: The most bytes a budget may name: 1 EiB, beyond any memory (and within the 64-bit integers the
#: solvers count bytes in: 2**63 bytes made the LP's bound overflow).
MAX_BUDGET_BYTES = 2**60


def read_budget(value: object, *, cuda_free: bool = False, of: str = CHECKPOINT_ALL) -> BudgetSpec:
    """Check a budget and say what it is, without the reference peak (see the module doc for
    the forms). ``cuda_free`` admits ``"cuda-free"``.

    >>> read_budget(0.6).fraction, read_budget("0.6").fraction, read_budget("60%").fraction
    (0.6, 0.6, 0.6)
    >>> read_budget("2GiB").bytes, read_budget(4096).bytes, read_budget("2e9").bytes
    (2147483648, 4096, 2000000000)
    """
    shown = repr(value)
    if isinstance(value, bool) or value is None:
        raise BudgetError(f"budget {shown} is not a budget; give {_forms(of)}")
    if isinstance(value, numbers.Integral):
        value = int(value)
        if value <= 0:
            raise BudgetError(f"budget {value} B must be a positive number of bytes; give {_forms(of)}")
        return _positive_bytes(value, shown)
    if isinstance(value, numbers.Real):
        return _fraction(float(value), shown, python_float=True, of=of)
    if isinstance(value, str):
        return _read_text(value, cuda_free=cuda_free, of=of)
    raise BudgetError(f"budget {shown} is {a_type(value)}; give {_forms(of)}")


def _fraction(value: float, shown: str, *, python_float: bool, of: str) -> BudgetSpec:
    if not (math.isfinite(value) and 0 < value <= 1):
        hint = (f"give bytes as an int (e.g. budget={int(value) if math.isfinite(value) and value >= 1024 else 2**30})"
                if python_float else "write bytes as an integer ('1500000') or with a unit ('1.5GB')")
        kind = "a float" if python_float else "not a whole number of bytes"
        raise BudgetError(
            f"budget {shown} is {kind}, which means a fraction of {of}, and must be in (0, 1]; {hint}"
        )
    return BudgetSpec(fraction=float(value), text=shown)


def _read_text(text: str, *, cuda_free: bool, of: str) -> BudgetSpec:
    shown = repr(text)
    if text.strip().lower() == CUDA_FREE:
        if not cuda_free:
            raise BudgetError(
                f"budget {shown} (the CUDA device's free memory) is understood by remat.backend only; give {_forms(of)}"
            )
        return BudgetSpec(cuda_free=True, text=shown)
    match = _NUMBER_RE.match(text)
    if text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        raise BudgetError(f"budget {shown} is not a finite number; write {_forms(of)}")
    if match is None:
        if text.strip().endswith("%"):
            raise BudgetError(f"budget {shown} is not a percentage; write e.g. '60%'")
        raise BudgetError(f"budget {shown} is not understood; write {_forms(of)}")
    value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value):
        raise BudgetError(f"budget {shown} is not a finite number; write {_forms(of)}")
    if unit == "%":
        if value <= 0:
            raise BudgetError(f"budget {shown} must be positive; write {_forms(of)}")
        if value > 100:
            raise BudgetError(
                f"budget {shown} must be a percentage in (0%, 100%] of {of}; "
                f"a budget above that peak needs no planning: write '100%'"
            )
        return BudgetSpec(fraction=value / 100.0, text=shown)
    if value <= 0:
        raise BudgetError(f"budget {shown} must be positive; write {_forms(of)}")
    if unit == "":
        if _INTEGER_RE.match(text):
            return _positive_bytes(int(text), shown)
        if value <= 1:
            return _fraction(value, shown, python_float=False, of=of)
        if value.is_integer():
            return _positive_bytes(int(value), shown)
        return _fraction(value, shown, python_float=False, of=of)  # 1.5: neither bytes nor a fraction
    if unit not in _UNITS:
        raise BudgetError(
            f"budget {shown} has unknown unit {unit!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %"
        )
    n = value * _UNITS[unit]
    return _positive_bytes(int(n) if n <= MAX_BUDGET_BYTES else MAX_BUDGET_BYTES + 1, shown)


def _positive_bytes(n: int, shown: str) -> BudgetSpec:
    if n <= 0:
        raise BudgetError(f"budget {shown} must be a positive number of bytes; give {_FORMS}")
    if n > MAX_BUDGET_BYTES:
        raise BudgetError(f"budget {shown} is more bytes than any memory holds (at most 2**60, 1 EiB); to plan "
                          f"without recomputing anything, write '100%'")
    return BudgetSpec(bytes=n, text=shown)


def parse_budget(value: object, reference_bytes: int | None = None) -> int:
    """A budget in bytes: fractions and percentages are of ``reference_bytes`` (usually the
    checkpoint-all peak). Raises ``BudgetError`` (a ``ValueError``).

    >>> parse_budget("2GiB")
    2147483648
    >>> parse_budget("50%", reference_bytes=1000), parse_budget(0.5, reference_bytes=1000)
    (500, 500)
    """
    return read_budget(value).resolve(reference_bytes)


def percent_meant(given: object) -> int | None:
    """The percentage a budget that no plan fits was likely meant as: text that is a bare whole
    number up to 100 (``"60"``) is bytes, as documented, and no training step fits in 100 bytes.
    None for any other budget (an ``int`` is bytes by intent; ``"60B"`` says bytes)."""
    if isinstance(given, str) and _INTEGER_RE.match(given) and int(given) <= 100:
        return int(given)
    return None


def percent_hint(given: object, spelled: str = "budget={!r}") -> str:
    """When ``percent_meant(given)``: that ``given`` was read as bytes and how to ask for the
    percentage, with ``spelled`` how the caller's budget is written (``"budget={!r}"`` for
    ``optimize``, ``"--budget {}"`` on the command line); otherwise ''."""
    percent = percent_meant(given)
    if percent is None:
        return ""
    return (f"{spelled.format(given)} is read as {percent} bytes; for {percent}% of the checkpoint-all peak write "
            f"{spelled.format(f'{percent}%')}")


def check_time_limit(value: object) -> float | None:
    """A solver time limit in seconds: None (the method's default) or a positive finite number.

    >>> check_time_limit(30), check_time_limit(None)
    (30.0, None)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BudgetError(f"time limit {value!r} is not a number; give seconds, e.g. time_limit_s=60")
    if not (math.isfinite(value) and value > 0):
        raise BudgetError(
            f"time limit {value!r} s must be a positive, finite number of seconds; give e.g. time_limit_s=60 "
            f"(leave it out for the method's default)"
        )
    return float(value)


def check_budget(budget: object, *, time_limit_s: object = None, cuda_free: bool = False,
                 of: str = CHECKPOINT_ALL) -> int | float | str:
    """The one check of what a caller plans with (``optimize``, the CLI, ``remat.backend``):
    the budget (see the module doc) and the time limit. Returns the budget as a plain value:
    ``int`` bytes, ``float`` fraction or ``"cuda-free"``; raises ``BudgetError`` with the
    same message everywhere.

    >>> check_budget("60%", time_limit_s=30)
    0.6
    >>> check_budget("150%")
    Traceback (most recent call last):
    ...
    remat.units.BudgetError: budget '150%' must be a percentage in (0%, 100%] of the unoptimized peak (checkpoint-all: nothing recomputed); a budget above that peak needs no planning: write '100%'
    """
    check_time_limit(time_limit_s)
    return read_budget(budget, cuda_free=cuda_free, of=of).canonical()


def format_bytes_exactly(n_bytes: int) -> str:
    """``format_bytes`` with the exact count where it rounds: ``'67.90 KiB (69529 B)'``, ``'139 B'``."""
    shown = format_bytes(n_bytes)
    return shown if shown == f"{int(n_bytes)} B" else f"{shown} ({int(n_bytes)} B)"


def format_bytes(n_bytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")
