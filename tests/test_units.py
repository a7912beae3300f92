import math

import numpy as np
import pytest

from remat.units import BudgetError, check_budget, check_time_limit, format_bytes, parse_budget, read_budget


@pytest.mark.parametrize(
    "text, ref, expected",
    [("1500", None, 1500), ("2GiB", None, 2 * 2**30), ("512MB", None, 512 * 10**6), ("1.5 KiB", None, 1536),
     ("60%", 1000, 600), ("100%", 12345, 12345), (4096, None, 4096), ("3m", None, 3 * 2**20), ("1e3", None, 1000),
     ("2e9", None, 2 * 10**9), (np.int64(77), None, 77)],
)
def test_parse_budget(text, ref, expected):
    assert parse_budget(text, ref) == expected


@pytest.mark.parametrize("value", [0.6, "0.6", " .6 ", "60%", np.float64(0.6)])
def test_a_fraction_is_a_fraction_in_every_form(value):
    assert parse_budget(value, reference_bytes=1000) == 600
    assert check_budget(value) == 0.6


@pytest.mark.parametrize("value", [1.0, "1.0", "100%"])
def test_the_whole_peak(value):
    assert parse_budget(value, reference_bytes=999) == 999


@pytest.mark.parametrize(
    "text, ref, message",
    [("lots", None, "not understood"), ("5 parsecs", None, "unknown unit .parsecs."), ("5 zb", None, "unknown unit 'zb'"),
     ("60%", None, "is a percentage but there is no reference peak"), (0.6, None, "is a fraction but there is no reference peak"), (0, None, "must be a positive number"),
     ("0.0001%", 100, "must be positive"), (True, None, "not a budget"), (None, None, "None is not a budget"),
     ("150%", 100, r"percentage in \(0%, 100%\]"), ("0%", 100, "budget '0%' must be positive"), ("-10%", 100, "budget '-10%' must be positive"),
     ("abc%", 100, "is not a percentage"), ("1e400", None, "'1e400' is not a finite number"),
     ("nan", 100, "'nan' is not a finite number"), ("inf", 100, "not a finite number"),
     (float("nan"), 100, r"is a float, which means a fraction of the unoptimized peak .*must be in \(0, 1\]"),
     (1e400, 100, "must be in"), (1.5, 100, r"give bytes as an int \(e.g. budget=1073741824\)"),
     (2e9, None, r"give bytes as an int \(e.g. budget=2000000000\)"),
     ("1.5", 100, r"'1.5' is not a whole number of bytes.*write bytes as an integer"),
     ("-5", 100, "'-5' must be positive"), ("0", 100, "'0' must be positive"), (-5, 100, "must be a positive number"),
     ([1], 100, "is a list"), ("cuda-free", 100, "understood by remat.backend only"),
     # beyond any memory (2**63 B overflowed the LP bound's int64 arithmetic, 1e300TB a float)
     (2**63, None, r"more bytes than any memory holds \(at most 2\*\*60, 1 EiB\).*write '100%'"),
     ("99999999999999999999999999", None, "more bytes than any memory holds"),
     ("1e300", None, "more bytes than any memory holds"), ("1e300TB", None, "more bytes than any memory holds"),
     ("1e308GB", None, "more bytes than any memory holds")],
)
def test_parse_budget_errors(text, ref, message):
    with pytest.raises(BudgetError, match=message) as info:
        parse_budget(text, ref)
    assert isinstance(info.value, ValueError)


def test_read_budget_says_what_it_is():
    assert read_budget("cuda-free", cuda_free=True).cuda_free
    assert check_budget("cuda-free", cuda_free=True) == "cuda-free"
    assert check_budget("2GiB") == 2**31 and check_budget(4096) == 4096


@pytest.mark.parametrize("value, want", [(None, None), (30, 30.0), (0.5, 0.5)])
def test_time_limits(value, want):
    assert check_time_limit(value) == want


@pytest.mark.parametrize("value, message", [(0, "time limit 0 s must be a positive"), (-5, "-5 s must be a positive"),
                                            (math.nan, "nan s must be"), (math.inf, "finite"), ("60", "not a number"),
                                            (True, "not a number")])
def test_time_limit_errors(value, message):
    with pytest.raises(BudgetError, match=message):
        check_time_limit(value)
    with pytest.raises(BudgetError, match=message):
        check_budget("60%", time_limit_s=value)


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(5 * 2**40) == "5120.00 GiB"


def test_exact_byte_counts_are_shown_only_where_the_size_is_rounded():
    from remat.units import format_bytes_exactly

    assert format_bytes_exactly(139) == "139 B"  # (the backend wrote "139 B (139 B)")
    assert format_bytes_exactly(69529) == "67.90 KiB (69529 B)"
    assert format_bytes_exactly(3 * 2**20) == "3.00 MiB (3145728 B)"


def test_a_bare_whole_number_up_to_100_is_taken_as_a_percentage_meant():
    """The rule optimize and the remat command share for their 'for 60% write ...' hint."""
    from remat.units import percent_hint, percent_meant

    assert [percent_meant(v) for v in ("60", " 60 ", "100", "1")] == [60, 60, 100, 1]
    assert [percent_meant(v) for v in ("101", "60B", "60%", "0.6", "6e1", 60, None)] == [None] * 7
    assert percent_hint("60") == "budget='60' is read as 60 bytes; for 60% of the checkpoint-all peak write budget='60%'"
    assert percent_hint("60", "--budget {}").endswith("write --budget 60%") and percent_hint("60B") == ""
