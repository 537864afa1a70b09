"""The gateway's cluster view on its own: the windows it asks its agents for, and what it keeps of each node."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuscaler.aggregation import WindowFunction
from gpuscaler.errors import Unavailable, Unsupported
from gpuscaler.gateway.view import MAX_WINDOWS, WINDOW_IDLE_SECONDS, ClusterView
from gpuscaler.gpu_metrics import Metric
from gpuscaler.samples import Windowed, WindowKey, WindowValues
from tests.builders import gpu_sample, snapshot


class Clock:
    """A monotonic clock that only the test moves, starting at 100 s."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def window(seconds: float) -> WindowKey:
    """A window of the max of gpu_utilization over ``seconds``."""
    return WindowKey(Metric.GPU_UTILIZATION, seconds, WindowFunction.MAX)


async def test_a_new_window_is_asked_for_once_and_wakes_the_subscribers() -> None:
    """The first query with a window adds it and sets windows_changed; asking again changes nothing."""
    view = ClusterView(history_seconds=120, clock=Clock())
    changed = view.windows_changed
    view.require(window(30))
    assert changed.is_set()
    assert view.windows == (window(30),)
    again = view.windows_changed
    view.require(window(30))
    assert not again.is_set()


async def test_too_many_windows_are_refused_and_idle_ones_expire() -> None:
    """Past MAX_WINDOWS a new window is FAILED_PRECONDITION naming the limit, until an old one goes idle."""
    clock = Clock()
    view = ClusterView(history_seconds=3600, clock=clock)
    for seconds in range(1, MAX_WINDOWS + 1):
        view.require(window(seconds))
    with pytest.raises(Unsupported, match=f"at most {MAX_WINDOWS} distinct windows"):
        view.require(window(999))
    clock.now += WINDOW_IDLE_SECONDS + 1
    view.require(window(1))  # still used: kept, and the others expire when a new one comes
    view.require(window(999))
    assert set(view.windows) == {window(1), window(999)}


async def test_a_window_is_read_from_the_nodes_newest_snapshot() -> None:
    """windowed() gives the agent's value; before the agent sent the window it is UNAVAILABLE, and asked for."""
    view = ClusterView(history_seconds=120, clock=Clock())
    view.set_agents(["10.0.0.1:6000"])
    sample = gpu_sample(0, util=50.0, node="node-a")
    plain = snapshot(1, 100.0, (sample,), node="node-a")
    view.update("10.0.0.1:6000", plain, poll_interval_seconds=0.5)
    with pytest.raises(Unavailable, match="being computed by the agent of node 'node-a'"):
        view.windowed(sample, window(30))
    assert view.windows == (window(30),)
    reduced = replace(
        snapshot(2, 100.5, (sample,), node="node-a"),
        windows={window(30): WindowValues({sample.gpu.uuid: Windowed(80.0, 60)})},
    )
    view.update("10.0.0.1:6000", reduced, poll_interval_seconds=0.5)
    assert view.windowed(sample, window(30)) == Windowed(80.0, 60)
    assert [s.sequence for s in view.newest_first("node-a")] == [2]  # the newest only: no history kept
