"""Interest in engine pods apart from reading them: evaluating wants nothing, preparing wants the query's own pods
and waits for their first reads within the caller's deadline, a push stream keeps its pods wanted while it is open,
and a selection past --engine-max-pods-per-selection is refused, naming the key."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import pytest

from gpuscaler.agent.history import History
from gpuscaler.model.engines import Engine, EnginePage, PodScrape
from gpuscaler.model.errors import TooManyPods, Unavailable
from gpuscaler.model.pods import PodInfo
from gpuscaler.model.windows import WindowKey
from gpuscaler.query.query import Query
from gpuscaler.signals.engines.interest import DEADLINE_MARGIN_SECONDS, FIRST_READ_SLACK_SECONDS
from gpuscaler.signals.engines.pods import Endpoint
from gpuscaler.signals.engines.source import PodKey
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.streams import STREAM_REWANT_SECONDS
from tests.signals.test_evaluation_workloads import Directory


class Engines:
    """A hand-written engine source: it records what is wanted and waited for, and answers the scrapes it is given."""

    timeout_seconds = 2.0
    min_interval_seconds = 1.0

    def __init__(self, max_pods: int = 10) -> None:
        self.max_pods = max_pods
        self.generation = 0  # a test that changes ``scrapes`` after an evaluation moves it, as a landed read does
        self.wanted: dict[PodKey, float] = {}
        self.scrapes: dict[PodKey, PodScrape] = {}
        self.waited: list[tuple[list[PodKey], float]] = []
        self.once: dict[PodKey, PodScrape] = {}  # what a one-shot read of each pod gives
        self.read_once_asked: list[tuple[list[PodKey], float]] = []
        self.limited: list[str] = []
        self.listeners: list[Callable[[], None]] = []

    def want(self, pod: PodKey, engine: Engine, endpoint: Endpoint, interval_seconds: float) -> None:
        self.wanted[pod] = interval_seconds

    def scrape(self, pod: PodKey) -> PodScrape | None:
        return self.scrapes.get(pod)

    async def first_reads(self, pods: Collection[PodKey], within_seconds: float) -> None:
        self.waited.append((sorted(pods), within_seconds))

    async def read_once(
        self, reads: Sequence[tuple[PodKey, Engine, Endpoint]], within_seconds: float
    ) -> dict[PodKey, PodScrape]:
        pods = [pod for pod, _, _ in reads if pod not in self.wanted]
        self.read_once_asked.append((sorted(pods), within_seconds))
        return {pod: self.once[pod] for pod in pods if pod in self.once}

    def note_limited(self, limit: str, **detail: object) -> None:
        self.limited.append(limit)

    def add_listener(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)


def llm(name: str, *, namespace: str = "ml", ready: bool = True) -> PodInfo:
    """A vLLM pod of workload llm that declares its metrics port."""
    return PodInfo(
        namespace=namespace,
        pod=name,
        workload="llm",
        ip="10.0.0.1",
        phase="Running",
        ready=ready,
        ports=(("metrics", 8000),),
    )


DIRECTORY = Directory(llm("llm-0"), llm("llm-1"), llm("llm-2", ready=False), llm("llm-0", namespace="other"))
OWN = [("ml", "llm-0"), ("ml", "llm-1")]


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class GatewayHistory(History):
    """An empty history that says it is a gateway's view: engine signals need no GPU snapshot."""

    cluster = True


def gateway(engines: Engines, clock: Clock | None = None, directory: Directory = DIRECTORY) -> tuple[Evaluator, Query]:
    """A gateway's evaluator over ``directory`` and ``engines``, and the query on ml's workload llm."""
    empty = GatewayHistory(history_seconds=600.0, poll_interval_seconds=1.0)
    evaluator = Evaluator(empty, clock=clock or Clock(), directory=directory, engines=engines)
    return evaluator, evaluator.parse({"metric": "vllm_queue", "workload": "llm"}, "ml", "llm")


async def test_evaluating_wants_nothing_and_preparing_wants_the_querys_own_ready_pods() -> None:
    """An evaluation reads: nothing is wanted, and a pod no one asked for is unknown ("not read yet"), never 0.
    Preparing wants the query's Ready pods at its interval, and waits for those, within the deadline less a margin."""
    engines = Engines()
    evaluator, query = gateway(engines)
    evaluation = evaluator.evaluate(query.value)
    assert engines.wanted == {}
    assert isinstance(evaluation.error, Unavailable)
    assert "not read yet" in str(evaluation.error)
    await evaluator.prepare(query, time_left=1.5)
    assert engines.wanted == dict.fromkeys(OWN, 1.0)
    assert engines.waited == [(OWN, 1.5 - DEADLINE_MARGIN_SECONDS)]
    await evaluator.prepare(query)  # no deadline: one read's timeout and a moment for a slot
    assert engines.waited[-1] == (OWN, engines.timeout_seconds + FIRST_READ_SLACK_SECONDS)


async def test_a_read_wants_nothing_and_reads_a_pod_no_one_wants_once() -> None:
    """A read path's evaluation (Explain, a preview) wants no pod: it reads the pods no one wants once, within the
    deadline as ``prepare`` waits, and answers from those reads; a second read reads them again (nothing was kept)."""
    engines = Engines()
    evaluator, query = gateway(engines)
    page = EnginePage(values={"vllm:num_requests_waiting": 3.0}, at=99.5)
    engines.once = {pod: PodScrape("http://10.0.0.1:8000/metrics", page) for pod in OWN}
    evaluation = await evaluator.read(query, time_left=1.5)
    assert evaluation.value == 6.0
    assert engines.wanted == {}
    assert engines.read_once_asked == [(OWN, 1.5 - DEADLINE_MARGIN_SECONDS)]
    assert engines.waited == [(OWN, 1.5 - DEADLINE_MARGIN_SECONDS)]  # pods wanted by others: their first reads
    assert evaluator.evaluate(query.value).value is None  # the one-shot reads were for that answer only
    await evaluator.read(query)
    assert engines.read_once_asked[-1] == (OWN, engines.timeout_seconds + FIRST_READ_SLACK_SECONDS)


async def test_a_scrape_lands_and_the_evaluation_reads_it_without_wanting() -> None:
    """With both pods' pages read, the answer is their sum; reading it registers nothing."""
    engines = Engines()
    evaluator, query = gateway(engines)
    page = EnginePage(values={"vllm:num_requests_waiting": 3.0}, at=99.5)
    engines.scrapes = {pod: PodScrape("http://10.0.0.1:8000/metrics", page) for pod in OWN}
    assert evaluator.evaluate(query.value).value == 6.0
    assert engines.wanted == {}


async def test_an_engine_evaluation_is_kept_until_a_scrape_lands_a_pod_joins_or_a_page_goes_stale() -> None:
    """Two evaluations between scrapes are one result; a new scrape (the source's generation), a pod joining the
    selection and the oldest page going stale each give a new one, as a GPU evaluation is kept per snapshot."""
    engines = Engines()
    clock = Clock()
    directory = Directory(llm("llm-0"), llm("llm-1"))
    evaluator, query = gateway(engines, clock, directory)
    page = EnginePage(values={"vllm:num_requests_waiting": 3.0}, at=99.5)
    engines.scrapes = {pod: PodScrape("http://10.0.0.1:8000/metrics", page) for pod in OWN}
    first = evaluator.evaluate(query.value)
    clock.now += 0.5
    assert evaluator.evaluate(query.value) is first
    later = EnginePage(values={"vllm:num_requests_waiting": 4.0}, at=100.5)
    engines.scrapes[OWN[0]] = PodScrape("http://10.0.0.1:8000/metrics", later, page)
    engines.generation += 1
    landed = evaluator.evaluate(query.value)
    assert (first.value, landed.value) == (6.0, 7.0)
    directory.add(llm("llm-3"))
    joined = evaluator.evaluate(query.value)
    assert joined is not landed
    assert joined.value is None  # llm-3 is not read yet: unknown, never the others' sum
    engines.scrapes[("ml", "llm-3")] = PodScrape("http://10.0.0.1:8000/metrics", later)
    engines.generation += 1
    assert evaluator.evaluate(query.value).value == 11.0
    # The oldest page (llm-1's, read at 99.5) goes stale 2 intervals and a timeout after it was read.
    clock.now = 99.5 + 2 * 1.0 + engines.timeout_seconds + 0.01
    assert evaluator.evaluate(query.value).value is None


async def test_a_page_of_the_pods_old_address_is_not_its_answer() -> None:
    """A scrape of another URL than the pod declares now (it restarted elsewhere) counts as not read yet."""
    engines = Engines()
    evaluator, query = gateway(engines)
    page = EnginePage(values={"vllm:num_requests_waiting": 3.0}, at=99.5)
    engines.scrapes = {pod: PodScrape("http://10.9.9.9:8000/metrics", page) for pod in OWN}
    evaluation = evaluator.evaluate(query.value)
    assert evaluation.value is None
    assert "not read yet" in str(evaluation.error)


async def test_a_selection_past_the_pod_cap_is_refused_naming_the_key_and_wants_nothing() -> None:
    """With --engine-max-pods-per-selection 1, two Ready pods are too many: nothing is wanted, the limit is noted,
    and the answer is INVALID_ARGUMENT naming the selection, the count, the cap and the flag."""
    engines = Engines(max_pods=1)
    evaluator, query = gateway(engines)
    await evaluator.prepare(query, time_left=5.0)
    assert (engines.wanted, engines.waited, engines.limited) == ({}, [], ["max_pods_per_selection"])
    with pytest.raises(TooManyPods) as refused:
        evaluator.value(query)
    assert str(refused.value) == (
        "pods in namespace ml, workload llm selects 2 Ready pods with a metrics page; one query may read at most 1 "
        "(the gateway's --engine-max-pods-per-selection): select fewer pods with workload or podSelector, or raise "
        "the flag"
    )


async def test_a_push_stream_keeps_its_pods_wanted_while_it_is_open() -> None:
    """While a stream is open its pods are wanted again every STREAM_REWANT_SECONDS, so the scraper does not forget
    pods no poll asks for; a pod that joins its selection is wanted within a second; once it closes, nothing is
    wanted on its behalf."""
    engines, clock, directory = Engines(), Clock(), Directory(llm("llm-0"), llm("llm-1"))
    evaluator, query = gateway(engines, clock, directory)
    (listener,) = engines.listeners
    with evaluator.subscribe(query):
        listener()
        assert engines.wanted == dict.fromkeys(OWN, 1.0)
        engines.wanted.clear()
        listener()
        assert engines.wanted == {}  # within the second: not again
        clock.now += STREAM_REWANT_SECONDS
        listener()
        assert engines.wanted == dict.fromkeys(OWN, 1.0)
        engines.wanted.clear()
        clock.now += 1.0
        directory.add(llm("llm-3"))
        listener()
        assert engines.wanted == dict.fromkeys([*OWN, ("ml", "llm-3")], 1.0)
    engines.wanted.clear()
    clock.now += STREAM_REWANT_SECONDS
    listener()
    assert engines.wanted == {}


async def test_a_push_streams_selection_is_resolved_again_only_when_the_directory_moves() -> None:
    """Scrapes every second on a quiet directory resolve no stream's selection again for its interest (its cap,
    counted at each resolution, is counted once); once the directory moves, it is resolved, and counted, again."""
    engines, clock = Engines(max_pods=2), Clock()
    directory = Directory(llm("llm-0"), llm("llm-1"), llm("llm-2"))  # three pods: past the cap of two
    evaluator, query = gateway(engines, clock, directory)
    (listener,) = engines.listeners
    with evaluator.subscribe(query):
        for _ in range(10):
            listener()
            clock.now += 1.0
        assert engines.limited == ["max_pods_per_selection"]
        directory.add(llm("llm-3"))
        listener()
        assert engines.limited == ["max_pods_per_selection"] * 2
        assert engines.wanted == {}


class SlowWindows(GatewayHistory):
    """A gateway's source whose wait for its agents' windows takes ``seconds`` of the test's clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__(history_seconds=600.0, poll_interval_seconds=1.0)
        self.clock, self.seconds = clock, seconds
        self.prepared: list[Sequence[WindowKey]] = []

    async def prepare(self, windows: Sequence[WindowKey]) -> None:
        self.prepared.append(windows)
        self.clock.now += self.seconds


async def test_preparing_gives_the_engine_wait_what_the_windows_wait_left_of_the_deadline() -> None:
    """A combined query with a GPU window and an engine signal: the windows' wait takes 1.25 s of a 2 s deadline, and
    the engine pods' first reads are waited for within the 0.75 s left, less the margin, not within the whole 2 s."""
    engines, clock = Engines(), Clock()
    source = SlowWindows(clock, 1.25)
    evaluator = Evaluator(source, clock=clock, directory=DIRECTORY, engines=engines)
    query = evaluator.parse({"signals": "gpu_utilization:80,vllm_queue:8", "window": "30s", "workload": "llm"}, "ml")
    await evaluator.prepare(query, time_left=2.0)
    assert len(source.prepared) == 1
    assert engines.waited == [(OWN, 0.75 - DEADLINE_MARGIN_SECONDS)]
