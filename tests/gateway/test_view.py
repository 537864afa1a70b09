"""The gateway's cluster view on its own: the windows it asks its agents for, and what it keeps of each node."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

import pytest

from gpuscaler.gateway.view import AgentRefused, ClusterView
from gpuscaler.gateway.window_asks import WINDOW_IDLE_SECONDS
from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.errors import Unavailable, Unsupported
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import Absence, Snapshot
from gpuscaler.model.windows import MAX_WINDOWS, Windowed, WindowKey, WindowValues
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.signals.evaluator import Evaluator
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
    view.request([window(30)])
    assert changed.is_set()
    assert view.windows == (window(30),)
    again = view.windows_changed
    view.request([window(30)])
    assert not again.is_set()


async def test_too_many_windows_are_refused_and_idle_ones_expire() -> None:
    """Past MAX_WINDOWS a new window is FAILED_PRECONDITION naming the limit, until an old one goes idle."""
    clock = Clock()
    view = ClusterView(history_seconds=3600, clock=clock)
    for seconds in range(1, MAX_WINDOWS + 1):
        view.request([window(seconds)])
    with pytest.raises(Unsupported, match=f"at most {MAX_WINDOWS} distinct windows"):
        view.request([window(999)])
    clock.now += WINDOW_IDLE_SECONDS + 1
    view.request([window(1)])  # still used: kept, and the others expire when a new one comes
    view.request([window(999)])
    assert set(view.windows) == {window(1), window(999)}


async def test_an_open_push_streams_window_stays_asked_for_while_polled_ones_expire() -> None:
    """Reads do not ask for windows, so a push stream's window is requested by the evaluator at each composition:
    it outlives WINDOW_IDLE_SECONDS without a poll, while a window only a poll used once expires."""
    clock = Clock()
    view = ClusterView(history_seconds=3600, clock=clock)
    evaluator = Evaluator(view, clock=clock)
    view.add_listener(evaluator.on_snapshot)
    streamed = parse_metadata({"window": "30s", "windowFunction": "max"}, Limits(3600, cluster=True))
    polled = parse_metadata({"window": "45s"}, Limits(3600, cluster=True))
    await evaluator.prepare(polled)
    with evaluator.subscribe(streamed):
        await evaluator.prepare(streamed)
        for _ in range(3):
            clock.now += WINDOW_IDLE_SECONDS / 2
            view.compose()
        view.request([window(999)])  # a new window: the idle ones are let go as it comes
    assert set(view.windows) == {streamed.value.window, window(999)}


async def test_a_window_is_read_from_the_nodes_newest_snapshot() -> None:
    """windowed() gives the agent's value; before the agent sent the window it is UNAVAILABLE. Reading a window does
    not ask for it: a request does."""
    view = ClusterView(history_seconds=120, clock=Clock())
    view.set_agents(["10.0.0.1:6000"])
    sample = gpu_sample(0, util=50.0, node="node-a")
    plain = snapshot(1, 100.0, (sample,), node="node-a")
    view.update("10.0.0.1:6000", plain, poll_interval_seconds=0.5)
    with pytest.raises(Unavailable, match="being computed by the agent of node 'node-a'"):
        view.windowed(sample, window(30))
    assert not view.windows
    view.request([window(30)])
    assert view.windows == (window(30),)
    with pytest.raises(Unavailable, match="being computed by the agent of node 'node-a'"):
        view.windowed(sample, window(30))
    reduced = replace(
        snapshot(2, 100.5, (sample,), node="node-a"),
        windows={window(30): WindowValues({sample.gpu.uuid: Windowed(80.0, 60)})},
    )
    view.update("10.0.0.1:6000", reduced, poll_interval_seconds=0.5)
    assert view.windowed(sample, window(30)) == Windowed(80.0, 60)
    assert [s.sequence for s in view.newest_first("node-a")] == [2]  # the newest only: no history kept


async def test_a_composition_reused_from_the_last_scan_equals_a_full_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A composition reuses the last scan of the agents while only nodes' newest snapshots changed and none can
    have gone stale. Over 600 random events (snapshots at two poll intervals, time passing beyond staleness,
    agents listed and dropped, troubles, an agent claiming another's node) every composition equals a full
    scan of the agents at that moment, nodes and absences alike."""
    rng = random.Random(5)
    clock = Clock()
    view = ClusterView(history_seconds=120, clock=clock)
    agents = [f"10.0.0.{n}:6000" for n in range(8)]
    listed = agents[:6]
    view.set_agents(listed)
    full_scan, scans = view._scan, 0

    def counted(now: float) -> tuple[list[Snapshot], tuple[Absence, ...]]:
        nonlocal scans
        scans += 1
        return full_scan(now)

    monkeypatch.setattr(view, "_scan", counted)
    for step in range(600):
        event = rng.random()
        if event < 0.6:
            agent = rng.choice(listed)
            node = f"node-{agents.index(agent)}" if rng.random() > 0.03 else "node-0"  # now and then a claim
            sample = gpu_sample(0, util=1.0, node=node)
            with contextlib.suppress(AgentRefused):  # two live agents cannot report one node
                view.update(
                    agent, snapshot(step, clock.now, (sample,), node=node), poll_interval_seconds=rng.choice([0.5, 1.0])
                )
        elif event < 0.8:
            clock.now += rng.choice([0.05, 0.1, 0.5, 2.5])
        elif event < 0.9:
            view.trouble(rng.choice(listed), rng.choice(["connection refused", "sending"]))
        else:
            listed = sorted(rng.sample(agents, rng.randint(4, 8)))
            view.set_agents(listed)
        composed = view.compose()
        kept = view._scanned, view._fresh_until  # a scan keeps itself for the next composition: not this one
        parts, absent = full_scan(clock.now)
        view._scanned, view._fresh_until = kept
        assert (composed.parts, composed.absent) == (tuple(parts), absent), step
    assert 600 - scans > 100  # the shortcut was taken (and checked) often


async def test_a_node_whose_poll_interval_shortens_goes_stale_on_its_new_bound() -> None:
    """A node that moves from a 1 s to a 0.5 s poll is stale after 2 s of silence, not 3 s, even though the
    other nodes keep every composition on the reused scan."""
    clock = Clock()
    view = ClusterView(history_seconds=120, clock=clock)
    view.set_agents(["a:6000", "b:6000"])

    def send(agent: str, node: str, poll: float) -> None:
        sample = gpu_sample(0, util=1.0, node=node)
        view.update(agent, snapshot(int(clock.now * 10), clock.now, (sample,), node=node), poll_interval_seconds=poll)

    send("a:6000", "node-a", 1.0)
    send("b:6000", "node-b", 1.0)
    view.compose()
    send("a:6000", "node-a", 0.5)  # its last snapshot: stale 2 s from now
    silent_from = clock.now
    while clock.now - silent_from < 2.4:
        clock.now += 0.2
        send("b:6000", "node-b", 1.0)
        composed = view.compose()
        heard = [part.node for part in composed.parts]
        assert heard == (["node-a", "node-b"] if clock.now - silent_from <= 2.0 else ["node-b"]), clock.now
    assert [absence.node for absence in composed.absent] == ["node-a"]
