"""Windows: a GPU's readings reduced over the last seconds, by the agent that holds its history.

A gateway keeps no history: it asks each agent for the distinct windows its queries use (``WindowKey``), and
every snapshot carries each GPU's value over each (``WindowValues``). The agent reduces them over its ring
buffer (``agent/history.py``), the wire carries them packed (``server/wire.py``, ``gateway/decoding.py``), and
the gateway's view asks for them (``gateway/view.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.durations import format_duration
from gpuscaler.model.gpu_metrics import METRICS, Metric

# Distinct windows a gateway asks its agents for, and an agent serves one subscriber: each costs every agent a
# pass over its history per tick. A gateway's queries use a handful.
MAX_WINDOWS = 32
# One-shot windows a gateway's reads (Explain, previews) may ask for on top of KEDA's MAX_WINDOWS, so that a read
# never costs KEDA's calls a window: a combined query's parts at most (MAX_SIGNALS). An agent serves up to
# MAX_WINDOWS + READ_WINDOWS_RESERVE to one subscriber.
READ_WINDOWS_RESERVE = 4


# The shares of a window on a GPU that one pod or none holds: shared, never written.
EMPTY_SHARES: Mapping[str, Windowed] = MappingProxyType({})


class WindowKey(NamedTuple):
    """One GPU-level window reduction: ``function`` of ``metric`` over the last ``seconds``.

    A rate (``power_average``) is the counter's increase over the window; ``seconds`` 0 is the rate between
    the newest two samples, a rate's window when a query names none.
    """

    metric: Metric
    seconds: float
    function: WindowFunction

    def describe(self) -> str:
        if not METRICS[self.metric].takes_window_function:
            return f"{self.metric.value} {self.describe_span()}"
        return f"{self.function.value} of {self.metric.value} {self.describe_span()}"

    def describe_span(self) -> str:
        """The samples it reads, in words."""
        return "between the newest two samples" if self.seconds == 0 else f"over {format_duration(self.seconds)}"


class Windowed(NamedTuple):
    """One GPU's value over a window, from ``sample_count`` readable samples; None when none was readable.

    ``reason`` says more than "nothing readable" where there is more to say (a counter that restarted).
    ``shares`` are, on a GPU several pods hold, each pod's own share over the window, by pod UID key
    (``model.pods.uid_key``), where the agent read processes. ``covered_seconds`` is how much of the window
    the readings cover where that is less than all of it (``covered``); None: the whole window.
    """

    value: float | None
    sample_count: int
    reason: str | None = None
    shares: Mapping[str, Windowed] = EMPTY_SHARES
    covered_seconds: float | None = None


def covered(
    oldest: float, newest: float, *, window_seconds: float, interval_seconds: float, reading_covers_interval: bool
) -> float | None:
    """How many seconds of a window of ``window_seconds`` readings taken from ``oldest`` to ``newest`` (the
    window's end) cover; None when they cover all of it.

    An agent's history starts when the agent does, so for one window length after a start or a restart (every
    DaemonSet rollout) its windows hold less than they say. A reading stands for the poll interval that ends at
    it (GPM's readings are rates over exactly that), so one reading covers one interval
    (``reading_covers_interval``); a counter's rate covers the span between its first and last reading. Within
    half a poll interval of the whole counts as the whole: ticks jitter. A window of 0 seconds (a rate between the
    newest two samples) has no length to cover.
    """
    if window_seconds == 0:
        return None
    seconds = newest - oldest + (interval_seconds if reading_covers_interval else 0.0)
    if seconds >= window_seconds - interval_seconds / 2:
        return None
    return max(seconds, 0.0)


class WindowValues(NamedTuple):
    """A window as an agent reduced it for a gateway: each GPU's value by UUID, or why it could not."""

    by_uuid: Mapping[str, Windowed]
    problem: str | None = None
