"""A read at a gateway asks its agents for a window no KEDA call uses only while it reads: the windows the gateway
asks for are as before afterwards, KEDA's windows keep their last use, and reads change them one at a time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from gpuscaler.gateway.telemetry import _ViewCollector
from gpuscaler.gateway.view import ClusterView
from gpuscaler.gateway.window_asks import WINDOW_IDLE_SECONDS, WINDOW_SWEEP_SECONDS, WindowAsks
from gpuscaler.model.errors import Unavailable, Unsupported
from gpuscaler.model.windows import MAX_WINDOWS, READ_WINDOWS_RESERVE, Windowed, WindowKey, WindowValues
from gpuscaler.query.engine_keys import MAX_SIGNALS
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import Query
from gpuscaler.signals.evaluator import Evaluator
from tests.builders import gpu_sample, snapshot
from tests.gateway.test_view import Clock, window
from tests.waiting import until

AGENT = "10.0.0.1:6000"
SAMPLE = gpu_sample(0, util=50.0, node="node-a")


class FakeAgent:
    """An agent as the gateway's subscriber sees it: each time the view's windows change, its stream reopens with
    them (``told`` lists each list it was opened with) and it sends a snapshot holding a value for each (80)."""

    def __init__(self, view: ClusterView, clock: Clock) -> None:
        self.view, self.clock = view, clock
        self.told: list[tuple[WindowKey, ...]] = []
        self.sequence = 0
        view.set_agents([AGENT])

    def send(self) -> None:
        """One snapshot, now, with the windows the view asks for."""
        self.sequence += 1
        windows = {w: WindowValues({SAMPLE.gpu.uuid: Windowed(80.0, 60)}) for w in self.view.windows}
        sent = replace(snapshot(self.sequence, self.clock.now, (SAMPLE,), node="node-a"), windows=windows)
        self.view.update(AGENT, sent, poll_interval_seconds=0.5)

    async def run(self) -> None:
        while True:
            changed = self.view.windows_changed
            self.told.append(self.view.windows)
            self.send()
            await changed.wait()


@contextlib.asynccontextmanager
async def gateway() -> AsyncIterator[tuple[ClusterView, Evaluator, Clock, FakeAgent]]:
    """A view with one fake agent that answers every window it is asked for, and its evaluator."""
    clock = Clock()
    view = ClusterView(history_seconds=3600, clock=clock)
    evaluator = Evaluator(view, clock=clock)
    view.add_listener(evaluator.on_snapshot)
    agent = FakeAgent(view, clock)
    task = asyncio.create_task(agent.run())
    try:
        await until(lambda: view.latest is not None)
        yield view, evaluator, clock, agent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def series(view: ClusterView) -> dict[tuple[str, str], float]:
    """The view's /metrics samples about windows, by name and ``asked_by``."""
    samples = (sample for family in _ViewCollector(view, dict, lambda: None).collect() for sample in family.samples)
    return {(s.name, s.labels.get("asked_by", "")): s.value for s in samples if "window" in s.name}


def query(seconds: int) -> Query:
    """The max of gpu_utilization over ``seconds`` across the cluster's GPUs."""
    return parse_metadata({"window": f"{seconds}s", "windowFunction": "max"}, Limits(3600, cluster=True))


async def test_a_read_of_a_window_no_one_asked_for_answers_it_and_then_stops_asking() -> None:
    """Explain's read of a window no KEDA call uses answers the agent's value; afterwards the gateway asks for no
    window, as before, and the agent's stream was reopened with it and then without it."""
    async with gateway() as (view, evaluator, _, agent):
        evaluation = await evaluator.read(query(30))
        assert evaluation.value == 80.0
        assert view.windows == ()
        await until(lambda: len(agent.told) == 3)
        assert agent.told == [(), (window(30),), ()]
        assert view.asks.one_shot == 0


async def test_a_read_of_a_window_keda_uses_leaves_its_last_use_as_it_was() -> None:
    """KEDA asks for a window once; a read of it just before it goes idle does not keep it: it is let go
    WINDOW_IDLE_SECONDS after KEDA's call, as with no read, and the read did not reopen the agent's stream."""
    async with gateway() as (view, evaluator, clock, agent):
        await evaluator.prepare(query(30))
        clock.now += WINDOW_IDLE_SECONDS - 10
        agent.send()
        await until(lambda: view.latest is not None and view.latest.monotonic == clock.now)
        told = list(agent.told)
        assert (await evaluator.read(query(30))).value == 80.0
        assert agent.told == told
        clock.now += 20
        view.request([window(45)])  # a new window: the idle ones are let go as it comes
        assert view.windows == (window(45),)


async def test_concurrent_reads_share_a_one_shot_window_and_the_last_one_lets_it_go() -> None:
    """Two reads of one window no KEDA call uses: the second shares the first's ask (no new stream, no wait for a
    turn), the window stays asked for when the first leaves, and is let go when the second does."""
    async with gateway() as (view, _, _, agent):
        first_in, second_in, first_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with view.windows_for_read([window(30)]):
                first_in.set()
                await second_in.wait()
            first_out.set()

        async def second() -> None:
            await first_in.wait()
            async with view.windows_for_read([window(30)], time_left=0.01):
                second_in.set()
                await first_out.wait()
                assert view.windows == (window(30),)
                assert agent.told == [(), (window(30),)]

        await asyncio.gather(first(), second())
        assert view.windows == ()
        await until(lambda: agent.told == [(), (window(30),), ()])


async def test_a_window_keda_asks_for_during_a_read_stays_asked_for_after_it() -> None:
    """A read asks for a window; KEDA's call asks for the same window while the read lasts: after the read the
    window is KEDA's, still asked for, and the agent's stream is not reopened for it again."""
    async with gateway() as (view, evaluator, _, agent):
        async with view.windows_for_read([window(30)]):
            await evaluator.prepare(query(30))
            changed = view.windows_changed
        assert view.windows == (window(30),)
        assert view.asks.one_shot == 0
        assert view.windows_changed is changed
        assert not changed.is_set()
        assert agent.told == [(), (window(30),)]


async def test_one_read_at_a_time_adds_one_shot_windows_and_one_that_cannot_in_time_is_unavailable() -> None:
    """While a read holds a one-shot window, another read of a new window waits for its turn: past its deadline it
    is UNAVAILABLE saying why, counted in /metrics, and asks for nothing; once the first read is done it is
    answered. Five reads of five new windows at once ask the agent for at most one at a time."""
    async with gateway() as (view, evaluator, _, agent):
        async with view.windows_for_read([window(30)]):
            with pytest.raises(Unavailable, match="held the gateway's one turn"):
                await evaluator.read(query(45), time_left=0.05)
            assert view.windows == (window(30),)
            assert series(view) == {
                ("gpuscaler_gateway_windows", "keda"): 0,
                ("gpuscaler_gateway_windows", "read"): 1,
                ("gpuscaler_gateway_read_windows_refused_total", ""): 1,
            }
        assert (await evaluator.read(query(45))).value == 80.0

        told = len(agent.told)
        values = await asyncio.gather(*(evaluator.read(query(seconds)) for seconds in (1, 2, 3, 4, 5)))
        assert [evaluation.value for evaluation in values] == [80.0] * 5
        await until(lambda: agent.told[-1] == ())
        assert max(len(windows) for windows in agent.told[told:]) == 1
        assert not view.windows


async def test_one_shot_windows_never_cost_keda_a_window() -> None:
    """With MAX_WINDOWS - 1 windows of KEDA's and one a read holds, KEDA's next new window is asked for (the agents
    are asked for MAX_WINDOWS + 1); KEDA's one past MAX_WINDOWS is FAILED_PRECONDITION however few reads hold. Reads
    hold at most READ_WINDOWS_RESERVE one-shot windows: one more is UNAVAILABLE naming the limit, counted in
    /metrics, and leaves the windows as they were."""
    async with gateway() as (view, evaluator, _, agent):
        view.request([window(seconds) for seconds in range(1, MAX_WINDOWS)])
        async with view.windows_for_read([window(999)]):
            view.request([window(998)])
            assert len(view.windows) == MAX_WINDOWS + 1
            await until(lambda: len(agent.told[-1]) == MAX_WINDOWS + 1)
        with pytest.raises(Unsupported, match=f"at most {MAX_WINDOWS} distinct windows for KEDA's calls"):
            view.request([window(997)])

        # Reads that shared another's one-shot windows hold them after it gave the turn back.
        held = view.asks.hold([window(2000 + seconds) for seconds in range(READ_WINDOWS_RESERVE)])
        assert len(view.windows) == MAX_WINDOWS + READ_WINDOWS_RESERVE
        before = view.windows
        with pytest.raises(Unavailable, match=f"of the {READ_WINDOWS_RESERVE} one-shot windows"):
            await evaluator.read(query(999))
        assert view.windows == before
        assert series(view)[("gpuscaler_gateway_read_windows_refused_total", "")] == 1
        view.asks.let_go(held)
        assert len(view.windows) == MAX_WINDOWS


def test_the_reserve_fits_any_one_query() -> None:
    """A combined query's parts, each with at most one window, fit in the reads' reserve of one-shot windows."""
    assert READ_WINDOWS_RESERVE >= MAX_SIGNALS


def test_a_combined_request_one_window_too_many_asks_for_none_of_its_windows() -> None:
    """With MAX_WINDOWS - 1 windows of KEDA's, a request for two new ones (a combined query's) is Unsupported and
    asks for neither: the windows are as before and the agents' streams are not reopened."""
    asks = WindowAsks(Clock())
    asks.request([window(seconds) for seconds in range(1, MAX_WINDOWS)])
    before, changed = asks.windows, asks.changed
    with pytest.raises(Unsupported, match=f"at most {MAX_WINDOWS} distinct windows"):
        asks.request([window(500), window(501)])
    assert asks.windows == before
    assert not changed.is_set()


def test_a_refused_request_that_lets_idle_windows_go_tells_the_agents() -> None:
    """A request refused past MAX_WINDOWS still lets KEDA's idle windows go, and reopens the agents' streams without
    them, as a sweep would."""
    clock = Clock()
    asks = WindowAsks(clock)
    asks.request([window(seconds) for seconds in range(1, MAX_WINDOWS)])
    clock.now += WINDOW_IDLE_SECONDS + 1
    asks.request([window(seconds) for seconds in range(2, MAX_WINDOWS)])  # all but window(1) used again
    changed = asks.changed
    with pytest.raises(Unsupported, match=f"at most {MAX_WINDOWS} distinct windows"):
        asks.request([window(500), window(501), window(502)])
    assert window(1) not in asks.windows
    assert changed.is_set()


async def test_a_window_keda_stopped_using_leaves_once_idle_and_the_agents_are_told() -> None:
    """KEDA asks for a window once: a composition WINDOW_IDLE_SECONDS after that keeps it; one a second later is
    within the sweep interval and looks at nothing; the first one WINDOW_SWEEP_SECONDS on lets it go, with no other
    window added, and the agent's stream reopens without it."""
    async with gateway() as (view, evaluator, clock, agent):
        await evaluator.prepare(query(30))
        used = clock.now
        await until(lambda: agent.told[-1] == (window(30),))
        clock.now = used + WINDOW_IDLE_SECONDS
        view.compose()
        assert view.windows == (window(30),)
        clock.now += 1
        view.compose()
        assert view.windows == (window(30),)  # idle, but looked for at most every WINDOW_SWEEP_SECONDS
        clock.now += WINDOW_SWEEP_SECONDS
        view.compose()
        assert list(view.windows) == []
        await until(lambda: agent.told[-1] == ())
