"""Durations as people write them (`500ms`, `30s`, `2m`, `1m30s`), strictly, and their shortest spelling back."""

from __future__ import annotations

import pytest

from gpuscaler.model.durations import DurationError, format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        pytest.param("500ms", 0.5, id="ms"),
        pytest.param("30s", 30.0, id="s"),
        pytest.param("2m", 120.0, id="m"),
        pytest.param("1h", 3600.0, id="h"),
        pytest.param("1m30s", 90.0, id="compound"),
        pytest.param("1h2m3s4ms", 3723.004, id="every-unit-largest-first"),
        pytest.param("1.5s", 1.5, id="decimal"),
        pytest.param("0.25m", 15.0, id="decimal-minutes"),
        pytest.param(" 30s ", 30.0, id="padded"),
        pytest.param("0s", 0.0, id="zero"),
        pytest.param("0ms", 0.0, id="zero-ms"),
        pytest.param("9" * 20 + "s", 1e20, id="long-but-finite"),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    """Each accepted form reads as seconds."""
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("30", "'30' has no unit; write '30s' for seconds, or another unit (ms, m, h)", id="bare-number"),
        pytest.param("1.5", "'1.5' has no unit; write '1.5s' for seconds", id="bare-decimal"),
        pytest.param("0", "'0' has no unit; write '0s'", id="bare-zero"),
        pytest.param("30 s", "'30 s' has a space in it; write '30s'", id="space-before-unit"),
        pytest.param("1m 30s", "'1m 30s' has a space in it; write '1m30s'", id="space-between-terms"),
        pytest.param("30S", "'30S' has an upper-case unit; write '30s'", id="upper-case-unit"),
        pytest.param("2M", "'2M' has an upper-case unit; write '2m'", id="upper-case-minutes"),
        pytest.param("-5s", "'-5s' is negative; a duration must be positive, like '5s'", id="negative"),
        pytest.param("1e9s", "'1e9s' has an exponent; write the number out, like '1000000000s'", id="exponent"),
        pytest.param("2.5e-1m", "'2.5e-1m' has an exponent; write the number out, like '0.25m'", id="small-exponent"),
        pytest.param("1e3", "'1e3' has an exponent; write the number out: a number and a unit", id="bare-exponent"),
        pytest.param("1e400s", "'1e400s' has an exponent; write the number out: a number and a unit", id="huge"),
        pytest.param("-x", "'-x' is negative; a duration must be positive", id="negative-word"),
        pytest.param("30s2m", "'30s2m' repeats a unit or puts a smaller one first; write each unit once", id="order"),
        pytest.param("1m1m", "'1m1m' repeats a unit", id="repeated-unit"),
        pytest.param("", "'' is empty; write a number and a unit (ms, s, m or h)", id="empty"),
        pytest.param("abc", "'abc' is not a duration; write a number and a unit (ms, s, m or h)", id="word"),
        pytest.param("1d", "'1d' is not a duration; write a number and a unit (ms, s, m or h)", id="days"),
        pytest.param(".5s", "'.5s' is not a duration", id="no-leading-digit"),
        pytest.param("+5s", "'+5s' is not a duration", id="plus-sign"),
        pytest.param("nan", "'nan' is not a duration", id="nan"),
        pytest.param("inf", "'inf' is not a duration", id="inf"),
        pytest.param("9" * 400 + "h", "is too long to be a duration", id="overflows-a-float"),
    ],
)
def test_a_bad_duration_says_what_is_wrong_and_what_to_write(text: str, message: str) -> None:
    """A text that is not a strict duration raises DurationError quoting it first, then what to write instead,
    and its problem alone is what follows the quoted text, for a caller that names the text its own way."""
    with pytest.raises(DurationError, match=r"^'") as caught:
        parse_duration(text)
    assert message in str(caught.value)
    assert str(caught.value) == f"{text!r} {caught.value.problem}"
    assert repr(text) not in caught.value.problem


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
        pytest.param(123456789.5, "123456789.5s", id="large-without-an-exponent"),
        pytest.param(0.5, "500ms", id="ms"),
        pytest.param(0.0005, "0.5ms", id="sub-ms"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    """format_duration picks the largest whole unit, else seconds, else milliseconds, never with an exponent."""
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [0.05, 0.5, 1.0, 1.25, 15.0, 59.0, 60.0, 61.0, 600.0, 3600.0, 86400.0, 1e12 + 0.5])
def test_format_then_parse_round_trips(seconds: float) -> None:
    """What format_duration writes, parse_duration reads back as the same number of seconds."""
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)
