import pytest

from remat.units import format_bytes, parse_budget


@pytest.mark.parametrize(
    "text, ref, expected",
    [("1500", None, 1500), ("2GiB", None, 2 * 2**30), ("512MB", None, 512 * 10**6), ("1.5 KiB", None, 1536),
     ("60%", 1000, 600), ("100%", 12345, 12345), (4096, None, 4096), ("3m", None, 3 * 2**20), ("1e3", None, 1000)],
)
def test_parse_budget(text, ref, expected):
    assert parse_budget(text, ref) == expected


@pytest.mark.parametrize(
    "text, ref, message",
    [("lots", None, "not understood"), ("5 parsecs", None, "unknown unit .parsecs."), ("5 zb", None, "unknown unit 'zb'"),
     ("60%", None, "no reference peak"), (0, None, "must be a positive number"), ("0.0001%", 100, "must be positive"),
     (True, None, "not a size")],
)
def test_parse_budget_errors(text, ref, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(text, ref)


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(5 * 2**40) == "5120.00 GiB"
