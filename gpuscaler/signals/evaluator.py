"""The query evaluator: parses metadata, evaluates over the snapshot source, keeps activation, answers the handlers.

Handlers ask the evaluator; the evaluator never calls a collector. Evaluations are kept per snapshot (a GPU query)
or per scrape (an engine query, the engine source's generation), so unary calls and push streams
(``streams.py``) of one tick share them.

Evaluating reads and keeps nothing of the engine pods it reads. Interest in them is registered apart
(``engines/interest.py``): ``prepare`` (a call KEDA makes) wants the pods a query's engine signals select and waits
for the first reads of those of them never read, its own pods only, within the caller's deadline; a push stream's
pods stay wanted while it is open. A read path (Explain, a preview of KEDA's calls) registers no interest
(``read``): it wants no pod, reads each pod no one wants once for its own answer, and moves no activation state;
at a gateway a window no KEDA call uses is asked of the agents for that read only (``windows_for_read``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import structlog

from gpuscaler.model.engines import PodScrape
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.pods import PodDirectory
from gpuscaler.model.samples import DEVICE_FIELD, Snapshot
from gpuscaler.query.engine_keys import DEFAULT_MIN_SCRAPE_SECONDS
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import CombinedQuery, EngineQuery, GpuQuery, Query, SingleQuery, ValueSpec, windows_of
from gpuscaler.signals.activation import ActivationStates
from gpuscaler.signals.combined import evaluate_combined
from gpuscaler.signals.empty_selection import EmptySelection, find_empty, unmatched_of
from gpuscaler.signals.empty_selection_record import EmptySelectionRecord
from gpuscaler.signals.engines.evaluation import evaluate_engine
from gpuscaler.signals.engines.interest import EngineInterest
from gpuscaler.signals.engines.source import EngineSource, PodKey, stale_after
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.node_memo import NodeMemo
from gpuscaler.signals.outcome import Evaluation
from gpuscaler.signals.per_snapshot import PerSnapshot
from gpuscaler.signals.source import SnapshotSource
from gpuscaler.signals.streams import Streams, Subscription

log = structlog.get_logger(__name__)

# Activation states of queries nobody asked about for this long are forgotten (KEDA polls every 30 s).
ACTIVATION_IDLE_SECONDS = 15 * 60.0
# KEDA sends each ScaledObject's same metadata on every call; parsed queries are kept for that many
# distinct metadata of at most that many keys and characters, so a client sending ever new metadata
# costs at most about PARSE_CACHE_ENTRIES * PARSE_CACHE_MAX_CHARS characters, and a huge request
# costs no more than parsing it did. Every known key fits: see KNOWN_KEYS.
PARSE_CACHE_ENTRIES = 1024
PARSE_CACHE_MAX_KEYS = 32
PARSE_CACHE_MAX_CHARS = 2048
# A preview of StreamIsActive waits at most this long for a known value, and the caller's deadline: a gateway's
# wait for its windows (3 s), then a few of the source's polls. Past it, Unavailable: the gateway's one turn to
# ask one-shot windows (which the wait holds when its windows are new) is never held for good.
FIRST_PUSH_WAIT_SECONDS = 3.0
FIRST_PUSH_POLLS = 3


class Evaluator:
    """Everything the gRPC handlers need, over one snapshot source (an agent's history, a gateway's view)."""

    def __init__(
        self,
        source: SnapshotSource,
        *,
        clock: Callable[[], float] | None = None,
        directory: PodDirectory | None = None,
        engines: EngineSource | None = None,
    ) -> None:
        """``engines``: where engine signals are read (a gateway's scraper); without it they are refused. A gateway's
        view (``source.cluster``) has a gateway's limits and a memo of each node's part of its evaluations."""
        self.source = source
        self.directory = directory
        self.engines = engines
        self.limits = Limits(
            history_seconds=source.history_seconds,
            cluster=source.cluster,
            reads_engines=engines is not None,
            min_scrape_seconds=engines.min_interval_seconds if engines is not None else DEFAULT_MIN_SCRAPE_SECONDS,
        )
        self._parsed: dict[tuple[str, str, tuple[tuple[str, str], ...]], Query] = {}
        self.stale_after = source.stale_after
        self._clock = clock or asyncio.get_running_loop().time
        self._states = ActivationStates(idle_seconds=ACTIVATION_IDLE_SECONDS)
        # GPU evaluations of the newest snapshot; a new one also tells the memo which queries it still serves.
        self._evaluations = PerSnapshot[GpuQuery, Evaluation](on_forget=self._keep_memo_for)
        # Engine evaluations of the scraper's current generation, each with the directory's state for its selection
        # and when its first page goes stale (a page ages without a scrape landing).
        self._engine_evaluations = PerSnapshot[EngineQuery, tuple[Hashable, float, Evaluation]]()
        # Each node's part of a cluster's evaluations, kept between compositions (most nodes send nothing new).
        self.memo = NodeMemo() if source.cluster else None
        self.closing = False
        # Called once by close_streams: streams that hold no subscription (StreamMetricSpec's) end on it too.
        self.on_close: list[Callable[[], None]] = []
        self.on_transition: list[Callable[[bool], None]] = []
        # Called with every answer that left out GPUs or nodes (lost GPUs within maxUnreadable, minNodes).
        self.on_partial: list[Callable[[Evaluation], None]] = []
        # Called with each push evaluation of a streamed query, once per distinct query per tick (unknown included).
        self.on_push: list[Callable[[Query, Evaluation], None]] = []
        self._left_out: dict[ValueSpec, tuple[frozenset[str], float]] = {}
        self._interest = EngineInterest(engines, directory) if engines is not None else None
        self._streams = Streams(
            evaluate=self.evaluate,
            observe=self._observe,
            on_push=self.on_push,
            interest=self._interest,
            clock=self._clock,
        )
        # KEDA's answers of 0 whose selection matches no pod, per ScaledObject: only a pod directory can tell.
        self.empty_selections = EmptySelectionRecord(directory, clock=self._clock) if directory is not None else None
        if engines is not None:
            engines.add_listener(self._on_engine_pages)

    def now(self) -> float:
        return self._clock()

    def parse(self, metadata: Mapping[str, str], namespace: str = "", name: str = "") -> Query:
        """``namespace`` and ``name`` are the ScaledObject's: a pod selection's default namespace, scaleTargetPods'.

        Parsing is a pure function of the metadata (in its order: the first unknown key is the one
        named), the ScaledObject and the limits, and a Query is immutable, so a parsed one is reused.
        Refusals are not kept: each raises afresh, with the same message.
        """
        items = tuple(metadata.items()) if len(metadata) <= PARSE_CACHE_MAX_KEYS else None
        size = len(namespace) + len(name) + sum(len(key) + len(value) for key, value in items or ())
        if items is None or size > PARSE_CACHE_MAX_CHARS:
            return parse_metadata(metadata, self.limits, namespace=namespace, name=name)  # too big to keep
        key = (namespace, name, items)
        query = self._parsed.get(key)
        if query is None:
            query = parse_metadata(metadata, self.limits, namespace=namespace, name=name)
            if len(self._parsed) >= PARSE_CACHE_ENTRIES:
                del self._parsed[next(iter(self._parsed))]  # the oldest entry
            self._parsed[key] = query
        return query

    async def prepare(self, query: Query, *, time_left: float | None = None) -> None:
        """Make the query answerable before it is evaluated, and register its interest: a gateway asks its agents
        for its windows once, and keeps the pods its engine signals select read, waiting for the first read of
        those never read (its own pods, no one else's). ``time_left``: seconds left of the caller's deadline; the
        engine wait has what the windows' wait left of it, less ``engines.interest.DEADLINE_MARGIN_SECONDS``; a pod
        still unread is then named in the answer."""
        started, windows = self._clock(), windows_of(query.value)
        if windows:
            await self.source.prepare(list(windows))
            time_left = self._left_after(time_left, started)
        if self._interest is None:
            return
        pods = self.want_engine_pods(query.value)
        if pods:
            await self._interest.engines.first_reads(pods, self._interest.first_read_within(time_left))

    async def read(self, query: Query, *, time_left: float | None = None) -> Evaluation:
        """The query's evaluation for a read path (Explain, a preview of KEDA's calls), registering no interest.

        No pod is wanted: a pod some query wants is waited for as ``prepare`` would, and a pod no one wants is read
        once for this answer (``EngineSource.read_once``), both within the caller's deadline; nothing read is kept.
        No window is asked for beyond this read: a gateway asks its agents for one no KEDA call uses while the read
        lasts, and moves no window's last use (``SnapshotSource.windows_for_read``)."""
        started, windows = self._clock(), list(windows_of(query.value))
        async with self.source.windows_for_read(windows, time_left=time_left):
            if windows:
                time_left = self._left_after(time_left, started)
            scrapes: Mapping[PodKey, PodScrape] | None = None
            interest = self._interest
            if interest is not None:
                reads = interest.reads(query.value)
                if reads:
                    within = interest.first_read_within(time_left)
                    engines = interest.engines
                    _, scrapes = await asyncio.gather(
                        engines.first_reads([read[0] for read in reads], within),
                        engines.read_once([(pod, engine, endpoint) for pod, engine, endpoint, _ in reads], within),
                    )
            return self.evaluate(query.value, scrapes=scrapes, keep=False)

    def _left_after(self, time_left: float | None, started: float) -> float | None:
        """What the wait since ``started`` (``now``) left of ``time_left``, seconds of the caller's deadline."""
        return None if time_left is None else time_left - (self._clock() - started)

    def want_engine_pods(self, value: ValueSpec) -> list[PodKey]:
        """Keep the pods ``value``'s engine signals read wanted by the scraper, at their intervals; those pods.

        A selection that cannot be read (no directory, too many pods) wants nothing: evaluating says why."""
        if self._interest is None:
            return []
        reads = self._interest.reads(value)
        self._interest.want(reads)
        return [read[0] for read in reads]

    def evaluate(
        self, query: ValueSpec, *, scrapes: Mapping[PodKey, PodScrape] | None = None, keep: bool = True
    ) -> Evaluation:
        """``query`` now; ``scrapes``: a read path's one-shot reads of pods no one wants (``read``). ``keep``: False
        for a read path, which uses an evaluation kept for this snapshot or scrape but keeps none it makes (neither
        here nor in the node memo), so that what is kept is what KEDA's calls and the push streams asked for."""
        single = (
            self._evaluate_single
            if scrapes is None and keep
            else partial(self._evaluate_single, scrapes=scrapes, keep=keep)
        )
        if isinstance(query, CombinedQuery):
            return evaluate_combined(query, single)
        return single(query)

    def _evaluate_single(
        self, query: SingleQuery, *, scrapes: Mapping[PodKey, PodScrape] | None = None, keep: bool = True
    ) -> Evaluation:
        if isinstance(query, EngineQuery):
            return self._evaluate_engine(query, scrapes, keep=keep)
        # A read path evaluates over the source's read view, which keeps nothing of its own (an agent's series).
        source = self.source if keep else self.source.for_read()
        latest = source.latest
        fresh = latest is not None and self._clock() - latest.monotonic <= self.stale_after
        if not fresh or latest is None:
            return evaluate(query, source, now=self._clock(), stale_after=self.stale_after, directory=self.directory)
        cached = (self._evaluations.at(latest.sequence) if keep else self._evaluations.kept(latest.sequence)).get(query)
        if cached is None:
            memo = self.memo if keep or self.memo is None else self.memo.for_read()
            cached = evaluate(
                query,
                source,
                now=latest.monotonic,
                stale_after=self.stale_after,
                directory=self.directory,
                memo=memo,
            )
            if keep:
                self._evaluations.at(latest.sequence)[query] = cached
        return cached

    def _keep_memo_for(self, evaluated: dict[GpuQuery, Evaluation]) -> None:
        """The last snapshot's queries are the ones the memo keeps nodes' parts of, for the newest's nodes."""
        latest = self.source.latest
        if self.memo is not None and latest is not None:
            self.memo.keep_only(evaluated, latest.parts)

    def _evaluate_engine(
        self, query: EngineQuery, scrapes: Mapping[PodKey, PodScrape] | None, *, keep: bool = True
    ) -> Evaluation:
        """Once per scrape (the scraper's generation) and state of the directory, as a GPU query is once per
        snapshot; a read path's one-shot reads are its own answer, and what it evaluates is never kept."""
        now = self._clock()
        interest = self._interest
        if scrapes or interest is None:
            return evaluate_engine(query, self.engines, self.directory, self.source.latest, now=now, scrapes=scrapes)
        engines = interest.engines
        generation = engines.generation
        state = interest.directory_state(query)
        kept = (self._engine_evaluations.at(generation) if keep else self._engine_evaluations.kept(generation)).get(
            query
        )
        if kept is not None and kept[0] == state and now < kept[1]:
            return kept[2]
        evaluation = evaluate_engine(query, engines, self.directory, self.source.latest, now=now)
        if keep:
            fresh_for = stale_after(query.interval_seconds, engines.timeout_seconds)
            ages = [pod.age_seconds for pod in evaluation.pods if pod.age_seconds is not None]
            self._engine_evaluations.at(generation)[query] = (
                state,
                now + fresh_for - max(ages, default=0.0),
                evaluation,
            )
        return evaluation

    def kept(self) -> tuple[frozenset[SingleQuery], dict[GpuQuery, frozenset[str]]]:
        """What is kept now, to compare and not to change: the queries whose evaluations are kept (GPU ones for
        the newest snapshot, engine ones for the current scrape), and the node memo's queries with their nodes."""
        queries: frozenset[SingleQuery] = frozenset(self._evaluations.current) | frozenset(
            self._engine_evaluations.current
        )
        return queries, self.memo.kept() if self.memo is not None else {}

    def value(self, query: Query, scaled_object: tuple[str, str] | None = None) -> float:
        """The query's value now; raises the GpuscalerError KEDA must see instead of a made-up 0.

        ``scaled_object`` (namespace, name): KEDA asks for it, and an answer of 0 whose selection matches no pod
        is recorded for it (``empty_selections``)."""
        evaluation = self.evaluate(query.value)
        if scaled_object is not None and self.empty_selections is not None:
            self.empty_selections.observe((*scaled_object, query.metric_name), evaluation)
        value = evaluation.value_or_raise()
        self._note_left_out(evaluation)
        return value

    async def preview_value(self, query: Query, *, time_left: float | None = None) -> float:
        """``value``'s answer, or its error, with nothing kept: no interest registered (``read``), no record of an
        empty selection, no note (log line, observers) of what the answer left out. For a preview of KEDA's calls
        (``server/preview.py``)."""
        return (await self.read(query, time_left=time_left)).value_or_raise()

    def _note_left_out(self, evaluation: Evaluation) -> None:
        """Make a partial answer visible: every time to the observers, and in the log when what it lacks changes."""
        gpus = evaluation.unread
        if not gpus and not evaluation.absent:
            if self._left_out.pop(evaluation.query, None) is not None:
                log.info("answer_complete_again", selection=evaluation.query.describe_selection())
            return
        for observer in self.on_partial:
            observer(evaluation)
        names = frozenset(
            [f"{c.sample.gpu.describe()} on {c.sample.node}: {c.reason}" for c in gpus]
            + [f"node {a.node or '?'}{f' (agent {a.agent})' if a.agent else ''}: {a.reason}" for a in evaluation.absent]
        )
        seen = self._left_out.get(evaluation.query)
        self._left_out[evaluation.query] = (names, self._clock())
        if seen is None or seen[0] != names:
            log.warning(
                "answer_leaves_out",
                selection=evaluation.query.describe_selection(),
                metric=evaluation.query.name,
                left_out=sorted(names),
                detail=(
                    "the answer leaves out GPUs it cannot read within maxUnreadable, and nodes within minNodes; "
                    "maxUnreadable 0 or naming GPUs makes it strict"
                ),
            )

    def is_active(self, query: Query, scaled_object: tuple[str, str] | None = None) -> bool:
        """IsActive's answer, moving the query's activation state (``value`` says what ``scaled_object`` is for)."""
        return self._observe(query, self.value(query, scaled_object))

    def would_be_active(self, query: Query, value: float) -> bool:
        """What IsActive would answer for ``value`` now, from the state as it is, which this leaves as it is."""
        return self._states.peek(query.activation_key, value, query.activation)

    async def first_push(self, query: Query, *, time_left: float | None = None) -> bool:
        """What a push stream opened now would send first, without opening one or keeping a state: as that stream
        does, it waits for a snapshot with a known value (a preview of StreamIsActive), but only within
        ``time_left`` (seconds of the caller's deadline) and FIRST_PUSH_WAIT_SECONDS plus FIRST_PUSH_POLLS polls;
        past that, Unavailable saying what it waited for. Its windows are held for the whole wait, so that the
        reads in it do not ask for them and let them go again each snapshot."""
        wait = FIRST_PUSH_WAIT_SECONDS + FIRST_PUSH_POLLS * self.source.interval_seconds
        wait = wait if time_left is None else min(wait, time_left)
        evaluation: Evaluation | None = None
        try:
            async with (
                asyncio.timeout(wait),
                self.source.windows_for_read(list(windows_of(query.value)), time_left=wait),
            ):
                while True:
                    evaluation = await self.read(query)
                    if evaluation.value is not None:
                        return self.would_be_active(query, evaluation.value)
                    latest = self.source.latest
                    await self.source.wait_newer(latest.sequence if latest is not None else -1)
        except TimeoutError:
            why = f": {evaluation.error}" if evaluation is not None and evaluation.error is not None else ""
            raise Unavailable(
                f"no known value of {query.metric_name} within {wait:.3g} s (the caller's deadline, or "
                f"{FIRST_PUSH_WAIT_SECONDS:g} s and {FIRST_PUSH_POLLS} polls), so a push stream opened now would "
                f"send nothing yet{why}"
            ) from None

    def empty_selection(self, evaluation: Evaluation) -> EmptySelection | None:
        """Why an answer of 0 selected no pod, if its selection matches none (read only: for Explain)."""
        return find_empty(unmatched_of(evaluation), self.directory)

    def _observe(self, query: Query, value: float) -> bool:
        transition = self._states.observe(query.activation_key, value, query.activation, now=self._clock())
        if transition.changed:
            for observer in self.on_transition:
                observer(transition.active)
            log.info(
                "activation_changed",
                metric_name=query.metric_name,
                active=transition.active,
                value=round(value, 3),
                activation_threshold=query.activation.activation_threshold,
                deactivation_threshold=query.activation.deactivation_threshold,
            )
        return transition.active

    @property
    def distinct_stream_queries(self) -> int:
        return len(self._streams)

    @contextmanager
    def subscribe(self, query: Query, *, event: Callable[[], asyncio.Event] = asyncio.Event) -> Iterator[Subscription]:
        """A push subscription for the lifetime of the ``with`` block; ``active`` is set at once if known.

        ``event`` makes its ``changed``: a server whose many streams should wake a slice a turn gives its own."""
        with self._streams.subscribe(query, event) as subscription:
            yield subscription

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """The source's listener: one evaluation per distinct streamed query, and a wake-up on each change."""
        # A push stream's window stays requested while the stream is open (each was prepared when it opened).
        self.source.request(self._streams.windows())
        self._streams.keep_wanted()
        self._streams.push_gpu_queries()
        self._forget_idle()

    def _on_engine_pages(self) -> None:
        """The engine source's listener: streams on engine signals move within one scrape."""
        self._streams.keep_wanted()
        self._streams.push_engine_queries()
        self._forget_idle()

    def _forget_idle(self) -> None:
        now = self._clock()
        self._states.forget_idle(now=now, keep=self._streams.keys())
        for key in [k for k, (_, used) in self._left_out.items() if now - used > ACTIVATION_IDLE_SECONDS]:
            del self._left_out[key]

    def healthy(self) -> bool:
        """Fresh samples with at least one GPU read: what the health service reports as SERVING."""
        latest = self.source.latest
        if latest is None or self._clock() - latest.monotonic > self.stale_after:
            return False
        return any(all(error.field != DEVICE_FIELD for error in sample.errors) for sample in latest.samples)

    def close_streams(self) -> None:
        """Wake every push stream with ``closing`` set, so each handler returns and its stream ends OK."""
        self.closing = True
        self._streams.close()
        for listener in self.on_close:
            listener()
