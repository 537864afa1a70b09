"""The gateway's cluster view: each listed agent's newest snapshot, composed into one cluster snapshot.

It keeps each node's newest snapshot only; the agents keep the history and reduce the windows a query needs
(``ClusterView`` asks them, ``window_asks.py``). On each agent update, after a short coalescing delay, the view
composes one cluster ``Snapshot`` from the newest snapshot of every fresh node and announces it, which wakes the
evaluator (push streams) within one agent tick. A timer composes too, so that a node that stops sending is seen as
silent after its staleness bound even when no other node sends anything. Freshness is judged on the
gateway's own clock at arrival, because the agents' clocks are not ours.

Unknown is not zero. A node whose agent is still listed by discovery but silent, an agent not heard from
yet, and an agent that claims a node another live agent reports are all ``absent`` from the snapshot,
with since when and why; the evaluation turns them into UNAVAILABLE where they matter. A node leaves
the view only when its agent leaves discovery (the pod is deleted, the node removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, KeysView, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter, itemgetter

import structlog

from gpuscaler.gateway.window_asks import WindowAsks
from gpuscaler.model.columns import Chained, WindowColumn, WindowColumns
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.samples import Absence, GpuSample, Snapshot
from gpuscaler.model.staleness import snapshot_stale_after
from gpuscaler.model.windows import Windowed, WindowKey
from gpuscaler.signals.source import AnnouncedSource, window_column

log = structlog.get_logger(__name__)

# The composed snapshot's node field: it is no node's, so GetSnapshot and WatchSnapshots at a gateway are refused.
CLUSTER_NODE = "cluster"
DEFAULT_COMPOSE_INTERVAL_SECONDS = 0.5
# Updates within this long of the first make one composition: at 2,000 agents, 20 a second instead of 4,000,
# for at most 50 ms of the push budget (one agent poll + 100 ms).
DEFAULT_COALESCE_SECONDS = 0.05
# How long a call waits for its agents to send a window it just asked for: a few of their polls. A read waits at most
# this long in all (within its own deadline) for its turn to ask a one-shot window and for the agents to send it.
PREPARE_TIMEOUT_SECONDS = 3.0


_NODE, _SAMPLES, _SNAPSHOT = attrgetter("node"), attrgetter("samples"), attrgetter("snapshot")
_FIRST = itemgetter(0)


@dataclass(frozen=True, slots=True)
class _Claim:
    """Which listed agent reports a node, and how long its snapshots stay fresh: changes rarely."""

    agent: str
    stale_after: float


@dataclass(frozen=True, slots=True)
class _Newest:
    """A node's newest snapshot, and the gateway's wall clock when it arrived: changes every agent tick."""

    snapshot: Snapshot
    arrived_wall: float

    def fresh(self, claim: _Claim, now: float) -> bool:
        return now - self.snapshot.monotonic <= claim.stale_after


@dataclass(frozen=True, slots=True)
class _Scan:
    """A scan of the agents: the objects it read, the fresh nodes it found in order, and the absences."""

    read_agents: Mapping[str, _Agent]
    read_claims: Mapping[str, _Claim]
    names: list[str]
    absent: tuple[Absence, ...]


@dataclass(frozen=True, slots=True)
class _Agent:
    """A listed agent: the node it reports (once heard), its last trouble, and a refused claim."""

    listed_wall: float
    node: str | None = None
    trouble: str = "not connected yet"
    conflict: str | None = None
    conflict_wall: float = 0.0


@dataclass(frozen=True, slots=True)
class AgentState:
    """A listed agent as /metrics shows it: ``state`` is heard, silent, unheard, refused, or replaced (another
    address reports its node now); ``age`` is how old its node's newest snapshot is, when there is one."""

    agent: str
    node: str
    state: str
    age: float | None


class AgentRefused(Exception):
    """The agent's snapshots cannot go into the view (it claims a node another live agent reports)."""


class ClusterView(AnnouncedSource):
    """The ``SnapshotSource`` of a gateway: composed cluster snapshots, and the windows its agents reduce for it.

    It keeps each node's newest snapshot only: memory grows with nodes x GPUs, not with history. Windows are
    reduced by each agent over its own ring buffer; the view asks for the ones its queries use (``windows``,
    read by every subscriber when it opens its stream) when the evaluator requests them: reading one never does.
    A read of a window no KEDA call uses asks for it only while the read lasts (``windows_for_read``).
    """

    def __init__(
        self,
        *,
        history_seconds: float,
        compose_interval_seconds: float = DEFAULT_COMPOSE_INTERVAL_SECONDS,
        coalesce_seconds: float = DEFAULT_COALESCE_SECONDS,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(history_seconds=history_seconds, interval_seconds=compose_interval_seconds)
        self._clock = clock or asyncio.get_running_loop().time
        self._wall = wall_clock
        self._coalesce = coalesce_seconds
        # What a scan of the agents reads, each replaced whole when it changes, never changed in place: a scan made
        # from these very objects is still right, whatever else happened (a test holds compositions to that).
        self._agents: dict[str, _Agent] = {}
        self._claims: dict[str, _Claim] = {}  # by node
        self._newest: dict[str, _Newest] = {}  # by node; the one thing every tick changes, which no scan reads
        # The last scan: what it read, its nodes in order and its absences, reused while what it read is the same
        # objects and until its first node can go stale (``_fresh_until``).
        self._scanned: _Scan | None = None
        self._fresh_until = -math.inf
        self._order: tuple[object, list[tuple[str, _Agent]]] = (None, [])  # the agents sorted, once per change
        self._latest: Snapshot | None = None
        self._sequence = 0
        self._pending: asyncio.TimerHandle | None = None
        self._heard: tuple[str, ...] = ()
        self._absent: tuple[str, ...] = ()
        self.on_compose: Callable[[float], None] | None = None  # seconds one composition took
        self.asks = WindowAsks(self._clock)

    # The SnapshotSource protocol (with AnnouncedSource)

    cluster = True

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        """The node's newest snapshot only: the gateway keeps no history (its agents do)."""
        newest = self._newest.get(node)
        return iter((newest.snapshot,)) if newest is not None else iter(())

    def windowed(self, sample: GpuSample, window: WindowKey) -> Windowed:
        """The value ``sample``'s agent reduced for ``window``; Unavailable until its agent has sent one."""
        newest = self._newest.get(sample.node)
        values = newest.snapshot.windows.get(window) if newest is not None else None
        if values is None:
            raise Unavailable(
                f"{window.describe()} is being computed by the agent of node {sample.node!r} (the gateway asks its "
                "agents for each window its queries use); ask again in a moment"
            )
        if values.problem is not None:
            raise Unavailable(f"node {sample.node!r} cannot reduce {window.describe()}: {values.problem}")
        return values.by_uuid.get(sample.gpu.uuid, Windowed(None, 0))

    def window_column(self, part: Snapshot, window: WindowKey) -> WindowColumn:
        """``windowed`` for each of ``part``'s GPUs, read from the packed arrays its agent sends where it can."""
        newest = self._newest.get(part.node)
        windows = newest.snapshot.windows if newest is not None else None
        packed = windows.column(window) if isinstance(windows, WindowColumns) else None
        if packed is not None:
            return packed
        # Not reduced (yet), or a snapshot that did not come off the wire (a test's): GPU by GPU, which says why.
        return window_column(self.windowed, part, window)

    def for_read(self) -> ClusterView:
        """The view itself: its windows are its agents' reductions, and a read evaluating over them keeps
        nothing here (what a read asks of the agents is ``windows_for_read``'s)."""
        return self

    @property
    def windows(self) -> tuple[WindowKey, ...]:
        """The windows the agents are asked for (``asks``)."""
        return self.asks.windows

    @property
    def windows_changed(self) -> asyncio.Event:
        """Set (and replaced) whenever ``windows`` change: each subscriber then reopens its stream with them."""
        return self.asks.changed

    def request(self, windows: Iterable[WindowKey]) -> None:
        """Ask every agent for ``windows`` from now on (its subscribers reopen their streams with a new one); each
        is forgotten WINDOW_IDLE_SECONDS after its last request, at the next composition that looks (at most
        WINDOW_SWEEP_SECONDS later), and the subscribers reopen without it. Unsupported past MAX_WINDOWS at once."""
        self.asks.request(windows)

    async def prepare(self, windows: Sequence[WindowKey]) -> None:
        """Ask for ``windows`` and wait (a few polls at most) until every heard node has sent them."""
        self.request(windows)
        await self._sent(windows, asyncio.get_running_loop().time() + PREPARE_TIMEOUT_SECONDS)

    async def _sent(self, windows: Sequence[WindowKey], deadline: float) -> None:
        """Until every heard node has sent ``windows``, or ``deadline`` (the loop's clock)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while True:
                    latest = self._latest
                    if latest is not None and all(
                        window in part.windows for part in latest.parts for window in windows
                    ):
                        return
                    await self.wait_newer(latest.sequence if latest is not None else 0)

    @contextlib.asynccontextmanager
    async def windows_for_read(
        self, windows: Sequence[WindowKey], *, time_left: float | None = None
    ) -> AsyncIterator[None]:
        """While inside, ``windows`` are answerable as far as the agents sent them, and afterwards nothing is asked
        that was not before: a window KEDA's calls use is read as it is (its last use is not moved); another is
        asked of the agents for this read only, waited for as ``prepare`` waits, within ``time_left`` (seconds of
        the caller's deadline) and PREPARE_TIMEOUT_SECONDS, and let go on leaving unless a KEDA call asked for it
        meanwhile. Reads in flight share a one-shot window; one read at a time adds new ones, and a read that
        cannot have its turn in time is Unavailable (``WindowAsks.turn``). Unsupported past MAX_WINDOWS."""
        wanted = list(dict.fromkeys(windows))
        if not wanted:
            yield
            return
        deadline = asyncio.get_running_loop().time() + min(
            PREPARE_TIMEOUT_SECONDS, math.inf if time_left is None else time_left
        )
        async with contextlib.AsyncExitStack() as held:
            if not all(map(self.asks.asked, wanted)):
                await held.enter_async_context(self.asks.turn(deadline))
            held.callback(self.asks.let_go, self.asks.hold(wanted))
            await self._sent(wanted, deadline)
            yield

    # What discovery and the subscribers tell it

    def set_agents(self, agents: Iterable[str]) -> None:
        """The agents discovery lists now. A node whose agent is no longer listed leaves the view."""
        listed = set(agents)
        wall = self._wall()
        kept = {agent: state for agent, state in self._agents.items() if agent in listed}
        self._agents = kept | {agent: _Agent(listed_wall=wall) for agent in listed - kept.keys()}
        claims = dict(self._claims)
        for name, claim in self._claims.items():
            if claim.agent in self._agents:
                continue
            heir = next((a for a, state in sorted(self._agents.items()) if state.node == name), None)
            if heir is not None:  # an older agent of the same node is still listed: it answers for it again
                claims[name] = replace(claim, agent=heir)
            else:
                del claims[name]
                self._newest.pop(name, None)
                log.info("node_left_discovery", node=name, agent=claim.agent)
        self._claims = claims
        self._compose_soon()

    @property
    def agents(self) -> int:
        """How many agents discovery lists."""
        return len(self._agents)

    def trouble(self, agent: str, detail: str) -> None:
        """Why ``agent``'s stream is not delivering (connection refused, ...): named in every answer it blocks."""
        state = self._agents.get(agent)
        if state is not None and state.trouble != detail:
            self._agents = {**self._agents, agent: replace(state, trouble=detail)}

    def update(self, agent: str, snapshot: Snapshot, *, poll_interval_seconds: float) -> None:
        """``agent``'s snapshot, stamped with the gateway's clock; composes the view shortly after.

        Raises AgentRefused when another listed agent that is still sending reports the same node: two
        machines with one NODE_NAME would otherwise be merged into one node.
        """
        state = self._agents.get(agent)
        if state is None:
            return  # discovery dropped it while this snapshot was on its way
        name = snapshot.node
        claim = self._claims.get(name)
        if claim is not None and claim.agent != agent:
            if claim.agent in self._agents and self._newest[name].fresh(claim, self._clock()):
                if state.conflict is None:
                    state = replace(state, conflict_wall=self._wall())
                    log.error("agent_node_conflict", agent=agent, node=name, reported_by=claim.agent)
                conflict = (
                    f"it reports node {name!r}, which agent {claim.agent} reports too; two agents need two node "
                    "names (the chart sets NODE_NAME from spec.nodeName)"
                )
                self._agents = {**self._agents, agent: replace(state, conflict=conflict, node=None)}
                self._compose_soon()
                raise AgentRefused(conflict)
            log.info("node_changed_agent", node=name, before=claim.agent, after=agent)
        if state.node is not None and state.node != name:
            old = self._claims.get(state.node)
            if old is not None and old.agent == agent:
                log.warning("agent_node_renamed", agent=agent, before=state.node, after=name)
                self._claims = {node: c for node, c in self._claims.items() if node != state.node}
                del self._newest[state.node]
        if state.node != name or state.conflict is not None or state.trouble != "sending":
            self._agents = {**self._agents, agent: replace(state, node=name, conflict=None, trouble="sending")}
        stale_after = snapshot_stale_after(poll_interval_seconds)
        if claim is None or claim.agent != agent or claim.stale_after != stale_after:
            self._claims = {**self._claims, name: _Claim(agent, stale_after)}
        self._newest[name] = _Newest(snapshot, self._wall())
        # A newer snapshot only moves a node's staleness later; a shorter poll interval is a new claim, so a scan.
        self._fresh_until = min(self._fresh_until, snapshot.monotonic + stale_after)
        self._compose_soon()

    def _compose_soon(self) -> None:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self._coalesce, self._compose_pending)

    def _compose_pending(self) -> None:
        self._pending = None
        self.compose()

    def compose(self) -> Snapshot:
        """Announce the cluster snapshot as of now: every fresh node, and every listed agent it cannot hear."""
        started = time.perf_counter()
        self.asks.forget_idle()  # a comparison; a pass over the windows once every WINDOW_SWEEP_SECONDS
        now = self._clock()
        wall = self._wall()
        scanned = self._scanned
        if (
            scanned is not None
            and scanned.read_agents is self._agents
            and scanned.read_claims is self._claims
            and now < self._fresh_until
        ):
            # The same nodes, each fresh: their newest snapshots, in C (thousands of nodes, 20 times a second).
            parts = list(map(_SNAPSHOT, map(self._newest.__getitem__, scanned.names)))
            absent = scanned.absent
        else:
            parts, absent = self._scan(now)
        self._sequence += 1
        snapshot = Snapshot(
            sequence=self._sequence,
            taken_at=wall,
            monotonic=now,
            node=CLUSTER_NODE,
            samples=Chained(parts, _SAMPLES),  # each node's records made only as they are read
            parts=tuple(parts),
            absent=tuple(absent),
            cluster=self.cluster,
        )
        self._log_changes(snapshot)
        self._latest = snapshot
        self._announcer.announce(snapshot)
        if self.on_compose is not None:
            self.on_compose(time.perf_counter() - started)  # the evaluator's re-evaluation included
        return snapshot

    def _scan(self, now: float) -> tuple[list[Snapshot], tuple[Absence, ...]]:
        """Every fresh node's newest snapshot (by node), and every listed agent it cannot hear; kept for
        ``compose`` to reuse when no absence's words depend on the time (no node is silent)."""
        fresh: list[tuple[str, Snapshot, float]] = []
        absent: list[Absence] = []
        silent = False
        agents, claims = self._agents, self._claims
        if self._order[0] is not agents:
            self._order = (agents, sorted(agents.items()))
        for agent, state in self._order[1]:
            if state.conflict is not None:
                absent.append(Absence(agent, None, state.conflict_wall, state.conflict))
                continue
            if state.node is None:
                absent.append(Absence(agent, None, state.listed_wall, f"no snapshot yet ({state.trouble})"))
                continue
            claim = claims.get(state.node)
            if claim is None or claim.agent != agent:
                continue  # another listed agent reports this node now (a restarted agent's new address)
            newest = self._newest[state.node]
            latest = newest.snapshot
            if now - latest.monotonic <= claim.stale_after:  # newest.fresh(claim, now), inlined: thousands a time
                fresh.append((state.node, latest, claim.stale_after))
            else:
                reason = f"silent for {now - latest.monotonic:.1f}s ({state.trouble})"
                absent.append(Absence(agent, state.node, newest.arrived_wall, reason, last=latest))
                silent = True
        fresh.sort(key=_FIRST)
        # Kept with what it read: those objects are replaced, never changed, when anything it read changes.
        self._scanned = None if silent else _Scan(agents, claims, [name for name, _, _ in fresh], tuple(absent))
        if not silent:
            self._fresh_until = min((snap.monotonic + stale_after for _, snap, stale_after in fresh), default=math.inf)
        return [latest for _, latest, _ in fresh], tuple(absent)

    def agent_states(self) -> list[AgentState]:
        """Every listed agent's state now."""
        now = self._clock()
        states = []
        for agent, state in sorted(self._agents.items()):
            claim = self._claims.get(state.node) if state.node is not None else None
            newest = self._newest.get(state.node) if state.node is not None else None
            age = now - newest.snapshot.monotonic if newest is not None else None
            if state.conflict is not None:
                kind = "refused"
            elif claim is None:
                kind = "unheard"
            elif claim.agent != agent:
                kind, age = "replaced", None
            else:
                kind = "heard" if newest is not None and newest.fresh(claim, now) else "silent"
            states.append(AgentState(agent, state.node or "", kind, age))
        return states

    def _log_changes(self, snapshot: Snapshot) -> None:
        heard = tuple(map(_NODE, snapshot.parts))
        absent = tuple(a.node or a.agent for a in snapshot.absent)
        if (heard, absent) == (self._heard, self._absent):
            return
        joined = sorted(set(heard) - set(self._heard))
        silent = sorted(set(absent) - set(self._absent))
        left = sorted(set(self._heard) - set(heard) - set(absent))
        self._heard, self._absent = heard, absent
        (log.warning if silent else log.info)(
            "view_changed",
            nodes=len(heard),
            nodes_known=snapshot.known_nodes,
            gpus=len(snapshot.samples),
            joined=joined,
            not_heard=[a.describe(snapshot.taken_at) for a in snapshot.absent if (a.node or a.agent) in silent],
            left=left,
        )

    @property
    def node_names(self) -> KeysView[str]:
        """The nodes in the view now, fresh or not (nothing is copied: read it again for a later moment)."""
        return self._claims.keys()

    async def run(self) -> None:
        """Compose on a timer too, so silent nodes are seen while nobody sends; until cancelled."""
        try:
            while True:
                await asyncio.sleep(self._interval_seconds)
                self.compose()
        finally:
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None
