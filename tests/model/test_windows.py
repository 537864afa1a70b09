"""How much of a window its readings cover: the whole, or the seconds since the agent began reading."""

from __future__ import annotations

import pytest

from gpuscaler.model.windows import covered


@pytest.mark.parametrize(
    ("oldest", "newest", "window", "rate", "expected"),
    [
        pytest.param(0.0, 0.0, 120.0, False, 0.5, id="one-reading-covers-its-poll-interval"),
        pytest.param(0.0, 7.0, 120.0, False, 7.5, id="an-agent-seven-seconds-old"),
        pytest.param(0.0, 7.0, 120.0, True, 7.0, id="a-rate-covers-the-span-between-its-readings"),
        pytest.param(0.0, 119.5, 120.0, False, None, id="a-full-window-of-ticks"),
        pytest.param(0.003, 119.5, 120.0, False, None, id="a-late-oldest-tick-is-jitter"),
        pytest.param(0.0, 119.0, 120.0, False, 119.5, id="a-poll-short-is-short"),
        pytest.param(0.0, 300.0, 120.0, False, None, id="more-than-the-window"),
        pytest.param(5.0, 5.0, 0.0, True, None, id="no-window-no-length"),
    ],
)
def test_a_window_covers_its_readings_span_and_the_interval_the_oldest_stands_for(
    oldest: float, newest: float, window: float, rate: bool, expected: float | None
) -> None:
    """Readings from ``oldest`` to ``newest`` at a 0.5 s poll cover their span plus one interval (a rate: its
    span); within half an interval of the window is the whole window (None)."""
    spans = not rate  # a gauge's reading stands for its poll interval; a rate's readings only for their span
    assert covered(oldest, newest, window_seconds=window, interval_seconds=0.5, reading_covers_interval=spans) == (
        expected
    )
