"""Durations as people write them (`500ms`, `30s`, `2m`, `1h`) and their shortest spelling back."""

from __future__ import annotations

import pytest

from gpuscaler.model.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("500ms", 0.5, id="ms"),
        pytest.param("30s", 30.0, id="s"),
        pytest.param("2m", 120.0, id="m"),
        pytest.param("1h", 3600.0, id="h"),
        pytest.param("45", 45.0, id="bare-number-is-seconds"),
        pytest.param("1.5", 1.5, id="bare-decimal"),
        pytest.param("0.25m", 15.0, id="decimal-minutes"),
        pytest.param(" 30s ", 30.0, id="padded"),
        pytest.param("30 s", 30.0, id="space-before-unit"),
        pytest.param("0", 0.0, id="zero"),
        pytest.param("0ms", 0.0, id="zero-ms"),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    """Each accepted form reads as seconds."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("abc", id="word"),
        pytest.param("-1s", id="negative"),
        pytest.param("1d", id="days"),
        pytest.param("1e3", id="exponent"),
        pytest.param("30S", id="upper-case-unit"),
        pytest.param("1m30s", id="compound"),
        pytest.param(".5s", id="no-leading-digit"),
        pytest.param("nan", id="nan"),
        pytest.param("inf", id="inf"),
    ],
)
def test_bad_duration_says_what_is_allowed(text: str) -> None:
    """A text that is not a duration raises ValueError quoting it and the allowed units."""
    with pytest.raises(ValueError, match="use a number with ms, s, m or h") as caught:
        parse_duration(text)
    assert repr(text) in str(caught.value)


def test_duration_too_large_for_a_float_is_refused() -> None:
    """A number of digits that overflows to infinity is not a duration."""
    with pytest.raises(ValueError, match="not a finite duration"):
        parse_duration("9" * 400 + "h")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(3600.0, "1h", id="hour"),
        pytest.param(7200.0, "2h", id="hours"),
        pytest.param(120.0, "2m", id="minutes"),
        pytest.param(90.0, "90s", id="not-whole-minutes"),
        pytest.param(5400.0, "90m", id="not-whole-hours"),
        pytest.param(30.0, "30s", id="seconds"),
        pytest.param(1.0, "1s", id="one-second"),
        pytest.param(1.5, "1.5s", id="fractional-seconds"),
        pytest.param(0.5, "500ms", id="ms"),
        pytest.param(0.0005, "0.5ms", id="sub-ms"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    """format_duration picks the largest whole unit, else seconds, else milliseconds."""
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [0.05, 0.5, 1.0, 1.25, 15.0, 59.0, 60.0, 61.0, 600.0, 3600.0, 86400.0])
def test_format_then_parse_round_trips(seconds: float) -> None:
    """What format_duration writes, parse_duration reads back as the same number of seconds."""
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)
