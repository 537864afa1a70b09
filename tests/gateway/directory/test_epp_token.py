"""The EPP's bearer token reaches only the pods an InferencePool's endpointPickerRef names, against a fake API."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
from aiohttp import web
from kubernetes_asyncio import client
from prometheus_client import CollectorRegistry, generate_latest

from gpuscaler.gateway.directory.endpoint_pickers import EndpointPickers
from gpuscaler.gateway.engines import telemetry as engine_telemetry
from gpuscaler.gateway.engines.epp_token import (
    EppCredentials,
    EppToken,
    TokenUnavailable,
    bound_to,
    token_request_body,
    token_requester,
)
from gpuscaler.gateway.engines.limits import DEFAULT_SCRAPE_LIMITS
from gpuscaler.gateway.engines.page_reader import PageReader, ScrapeFailed
from gpuscaler.gateway.engines.scraper import EngineScraper
from gpuscaler.model.engines import Engine
from gpuscaler.model.pods import PodInfo
from gpuscaler.signals.engines.pods import Endpoint
from tests.fakes.fake_kube_api import FakeCollection, FakeKubeApi
from tests.waiting import until

EPP_LABELS = {"app": "llm-epp"}
TRUSTED = ("serving",)  # --epp-namespaces


def pool(namespace: str, name: str, service: str) -> dict[str, Any]:
    """An InferencePool whose endpointPickerRef names ``service``."""
    ref = {"name": service, "kind": "Service", "port": {"number": 9002}}
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"endpointPickerRef": ref}}


def service(namespace: str, name: str, selector: dict[str, str]) -> dict[str, Any]:
    """A Service selecting ``selector``."""
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"selector": selector}}


class Recorder:
    """Metrics pages on loopback that record every Authorization header they receive, by path."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str | None]] = {}
        self.rejected: set[str] = set()  # Authorization headers answered as the EPP answers a rejected token
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.setdefault(request.path, []).append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") is None:
            return web.Response(status=401, text="Unauthorized")
        if request.headers.get("Authorization") in self.rejected:  # the API server's TokenReview said no
            return web.Response(status=500, text="Authentication failed")
        return web.Response(text="# nothing\n")


@pytest.fixture
async def pages() -> AsyncIterator[Recorder]:
    """The recording pages' server."""
    recorder = Recorder()
    app = web.Application()
    app.router.add_get("/{name}", recorder.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    recorder.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield recorder
    await runner.cleanup()


def collections(namespace: str) -> tuple[FakeCollection, FakeCollection]:
    """The InferencePools and the Services of ``namespace``, at their namespaced paths."""
    return (
        FakeCollection(
            f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools", "InferencePoolList"
        ),
        FakeCollection(f"/api/v1/namespaces/{namespace}/services", "ServiceList"),
    )


class Api:
    """The fake API's collections: ``serving`` (trusted) and ``tenant``'s."""

    def __init__(self) -> None:
        self.serving = collections("serving")
        self.tenant = collections("tenant")


@pytest.fixture
async def api() -> AsyncIterator[tuple[Api, int]]:
    """InferencePool ``llm`` in ``serving`` names Service ``llm-epp``; pool ``other`` names a Service not there; a
    tenant's own pool in ``tenant`` names a Service of its own that selects its pods."""
    kube = Api()
    pools, services = kube.serving
    pools.items = [pool("serving", "llm", "llm-epp"), pool("serving", "other", "gone")]
    services.items = [service("serving", "llm-epp", EPP_LABELS), service("serving", "decoy", {"app": "decoy"})]
    kube.tenant[0].items = [pool("tenant", "own", "own")]
    kube.tenant[1].items = [service("tenant", "own", EPP_LABELS)]
    fake = FakeKubeApi(*kube.serving, *kube.tenant)
    await fake.start()
    yield kube, fake.port
    await fake.stop()


@pytest.fixture
async def pickers(api: tuple[Api, int]) -> AsyncIterator[EndpointPickers]:
    """The InferencePools and Services of the trusted namespaces (``TRUSTED``), watched."""
    configuration = client.Configuration(host=f"http://127.0.0.1:{api[1]}")
    watched = EndpointPickers(lambda: client.ApiClient(configuration), TRUSTED)
    await watched.start()
    await until(lambda: watched.problem() is None)
    yield watched
    await watched.stop()


class Pods:
    """A pod directory of fixed pods."""

    def __init__(self, *pods: PodInfo) -> None:
        self.by_key = {(p.namespace, p.pod): p for p in pods}

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        return self.by_key.get((namespace, pod))


class Clock:
    """A clock a test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(*answers: str | Exception) -> tuple[list[int], Any]:
    """A TokenRequest that answers each of ``answers`` in turn (600 s tokens), counting its calls."""
    calls = [0]

    async def request() -> tuple[str, float]:
        answer = answers[min(calls[0], len(answers) - 1)]
        calls[0] += 1
        if isinstance(answer, Exception):
            raise answer
        return answer, 600.0

    return calls, request


async def read(reader: PageReader, pods: Pods, name: str, engine: Engine, port: int) -> str | None:
    """Read pod ``name``'s page; the error, or None when it was read."""
    info = next(p for p in pods.by_key.values() if p.pod == name)
    try:
        await reader.fetch(Endpoint("127.0.0.1", port, f"/{name}"), pod=(info.namespace, name), engine=engine)
    except ScrapeFailed as error:
        return str(error)
    return None


def pod(namespace: str, name: str, labels: dict[str, str]) -> PodInfo:
    """A Running, Ready pod on loopback."""
    return PodInfo(namespace, name, labels=labels, ip="127.0.0.1", phase="Running", ready=True)


async def test_only_the_endpoint_picker_pod_ever_receives_the_token(pickers: EndpointPickers, pages: Recorder) -> None:
    """The pod the pool's Service selects receives the token; a tenant's pod that its own InferencePool names, in a
    namespace not in --epp-namespaces, a pod of a Service no pool names, and a model server's pod read as vLLM
    receive no header, and the EPP reads of the others fail saying why, each counted by reason."""
    pods = Pods(
        pod("serving", "epp", EPP_LABELS),
        pod("tenant", "fake-epp", EPP_LABELS),
        pod("serving", "decoy-epp", {"app": "decoy"}),
        pod("serving", "vllm", EPP_LABELS),
    )
    calls, request = tokens("secret-1")
    credentials = EppCredentials(EppToken(request), pods, pickers, TRUSTED)
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=credentials)
    await reader.start()
    try:
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        assert pickers.pool_of(pods.by_key[("tenant", "fake-epp")]) is None  # its own pool is never even read
        error = await read(reader, pods, "fake-epp", Engine.EPP, pages.port)
        assert error == (
            "HTTP 401 Unauthorized: namespace tenant is not one of --epp-namespaces (the namespaces whose "
            "InferencePools are trusted to name the EPP), so the pod is sent no token (docs/engines.md)"
        )
        error = await read(reader, pods, "decoy-epp", Engine.EPP, pages.port)
        assert error is not None
        assert "not the endpoint picker an InferencePool" in error
        assert await read(reader, pods, "vllm", Engine.VLLM, pages.port) is not None  # 401, and no token sent
    finally:
        await reader.close()
    assert credentials.withheld == {"address": 0, "namespace": 1, "not_a_picker": 1, "watch": 0, "no_token": 0}
    assert credentials.token.requests == {"ok": 1, "failed": 0}
    assert pages.seen == {
        "/epp": ["Bearer secret-1"],
        "/fake-epp": [None],
        "/decoy-epp": [None],
        "/vllm": [None],
    }
    assert calls[0] == 1


async def test_the_token_is_asked_again_after_half_its_life_and_a_failure_names_itself(
    pickers: EndpointPickers, pages: Recorder
) -> None:
    """A token is reused until half its 600 s have passed, then asked again; a failed TokenRequest, once the last
    token has expired, fails the EPP's read naming the failure, and is not asked again within 5 s."""
    pods = Pods(pod("serving", "epp", EPP_LABELS))
    clock = Clock()
    refused = TokenUnavailable("TokenRequest for ServiceAccount gs/epp-metrics: HTTP 403 Forbidden")
    calls, request = tokens("secret-1", "secret-2", refused)
    reader = PageReader(
        DEFAULT_SCRAPE_LIMITS, authorize=EppCredentials(EppToken(request, clock=clock), pods, pickers, TRUSTED)
    )
    await reader.start()
    try:
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        clock.now = 299.0
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        assert calls[0] == 1
        clock.now = 301.0  # still valid: this read keeps secret-1 while secret-2 is asked for beside it
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        clock.now = 302.0
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        assert calls[0] == 2
        clock.now = 301.0 + 601.0  # secret-2 has expired, and the next request is refused
        error = await read(reader, pods, "epp", Engine.EPP, pages.port)
        assert error is not None
        assert "no bearer token for the endpoint picker" in error
        assert "HTTP 403" in error
        clock.now += 1.0
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is not None
        assert calls[0] == 3
    finally:
        await reader.close()
    credentials = reader.authorize
    assert isinstance(credentials, EppCredentials)
    assert credentials.token.requests == {"ok": 2, "failed": 1}
    assert credentials.withheld["no_token"] == 2
    assert pages.seen["/epp"] == ["Bearer secret-1"] * 3 + ["Bearer secret-2"]  # none went out without a token


async def test_metrics_count_token_requests_and_withheld_reads_only_when_the_token_is_on(
    pickers: EndpointPickers, pages: Recorder
) -> None:
    """The gateway's /metrics counts TokenRequests by outcome and EPP reads sent no token by reason, with the
    token on; with it off, neither series is there."""
    pods = Pods(pod("serving", "epp", EPP_LABELS), pod("tenant", "fake-epp", EPP_LABELS))
    _, request = tokens("secret-1")
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=EppCredentials(EppToken(request), pods, pickers, TRUSTED))
    registry = CollectorRegistry()
    engine_telemetry.register(EngineScraper(DEFAULT_SCRAPE_LIMITS, reader=reader), registry)
    off = CollectorRegistry()
    engine_telemetry.register(EngineScraper(DEFAULT_SCRAPE_LIMITS), off)
    await reader.start()
    try:
        for name in ("epp", "fake-epp", "fake-epp"):
            await read(reader, pods, name, Engine.EPP, pages.port)
    finally:
        await reader.close()
    page = generate_latest(registry).decode()
    assert 'gpuscaler_gateway_epp_token_requests_total{outcome="ok"} 1.0' in page
    assert 'gpuscaler_gateway_epp_token_requests_total{outcome="failed"} 0.0' in page
    assert 'gpuscaler_gateway_epp_token_withheld_total{reason="namespace"} 2.0' in page
    assert 'gpuscaler_gateway_epp_token_withheld_total{reason="not_a_picker"} 0.0' in page
    assert "gpuscaler_gateway_epp_token" not in generate_latest(off).decode()


async def test_the_token_is_bound_to_the_gateways_pod_or_says_once_why_not() -> None:
    """The TokenRequest names the gateway's pod as boundObjectRef (kind Pod, name, uid) and no audience; without
    the pod's identity, or with the pod outside the ServiceAccount's namespace, it is unbound and the log says why."""
    async with client.ApiClient() as api:
        body = api.sanitize_for_serialization(token_request_body(bound_to(("gs", "gw-0", "u-1"), "gs")))
        unbound = api.sanitize_for_serialization(token_request_body(None))
    assert body["spec"] == {
        "audiences": [],
        "expirationSeconds": 600,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "gw-0", "uid": "u-1"},
    }
    with structlog.testing.capture_logs() as logged:
        assert bound_to(None, "gs") is None
        assert bound_to(("other", "gw-0", "u-1"), "gs") is None
    assert [entry["event"] for entry in logged] == ["epp_token_unbound"] * 2
    assert "POD_NAMESPACE, POD_NAME and POD_UID are not all set" in logged[0]["detail"]
    assert "the gateway's pod is in namespace other, the ServiceAccount in gs" in logged[1]["detail"]
    assert "boundObjectRef" not in unbound["spec"]


async def test_a_pod_that_is_not_running_or_is_being_deleted_gets_no_token(
    pickers: EndpointPickers, pages: Recorder
) -> None:
    """A Failed or Succeeded EPP pod keeps its podIP in the API while the CNI may give it to another pod: a tenant's
    pod now serving that address receives no token from a read of the old EPP, nor from one of an EPP pod that is
    being deleted or still Pending; each read says why and counts as ``address``."""
    running = pod("serving", "epp", EPP_LABELS)
    gone = (
        dataclasses.replace(running, pod="failed", phase="Failed", ready=False),
        dataclasses.replace(running, pod="succeeded", phase="Succeeded", ready=False),
        dataclasses.replace(running, pod="terminating", deleting=True),
        dataclasses.replace(running, pod="pending", phase="Pending", ready=False),
    )
    pods = Pods(*gone)
    calls, request = tokens("secret-1")
    credentials = EppCredentials(EppToken(request), pods, pickers, TRUSTED)
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=credentials)
    await reader.start()
    try:
        errors = {p.pod: await read(reader, pods, p.pod, Engine.EPP, pages.port) for p in gone}
    finally:
        await reader.close()
    assert errors["failed"] == (
        "HTTP 401 Unauthorized: the pod is in phase Failed, not Running, so its address may be another pod's now "
        "and it is sent no token"
    )
    assert errors["terminating"] is not None
    assert "being deleted" in errors["terminating"]
    assert pages.seen == {f"/{p.pod}": [None] for p in gone}
    assert credentials.withheld["address"] == 4
    assert calls[0] == 0


async def test_a_node_network_pod_or_another_address_gets_no_token(pickers: EndpointPickers, pages: Recorder) -> None:
    """An EPP pod on its node's network, and one whose address in the API is not the address read (a stale
    address), receive no token, each counted as ``address``."""
    host = dataclasses.replace(pod("serving", "host-epp", EPP_LABELS), host_network=True)
    moved = dataclasses.replace(pod("serving", "moved-epp", EPP_LABELS), ip="10.0.0.9")
    pods = Pods(host, moved)
    calls, request = tokens("secret-1")
    credentials = EppCredentials(EppToken(request), pods, pickers, TRUSTED)
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=credentials)
    await reader.start()
    try:
        for name in ("host-epp", "moved-epp"):
            error = await read(reader, pods, name, Engine.EPP, pages.port)
            assert error == "HTTP 401 Unauthorized: the address read is not the pod's own now, so it is sent no token"
    finally:
        await reader.close()
    assert pages.seen == {"/host-epp": [None], "/moved-epp": [None]}
    assert credentials.withheld["address"] == 2
    assert calls[0] == 0


class Unsynced:
    """An InferencePool watch that cannot answer: not synced yet, or stale."""

    def __init__(self, problem: str) -> None:
        self._problem = problem

    def problem(self) -> str | None:
        return self._problem

    def pool_of(self, info: PodInfo) -> str | None:
        return "llm"  # what it last knew: never to be believed while it cannot answer


@pytest.mark.parametrize("problem", ["the InferencePool watch has not synced", "the Service watch is stale"])
async def test_a_watch_that_cannot_answer_sends_no_token_and_fails_the_read(problem: str, pages: Recorder) -> None:
    """While the InferencePool or Service watch is unsynced or stale the EPP's read fails naming it, and nothing
    is sent: the token is not even asked for."""
    pods = Pods(pod("serving", "epp", EPP_LABELS))
    calls, request = tokens("secret-1")
    credentials = EppCredentials(EppToken(request), pods, Unsynced(problem), TRUSTED)
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=credentials)
    await reader.start()
    try:
        error = await read(reader, pods, "epp", Engine.EPP, pages.port)
    finally:
        await reader.close()
    assert error == f"cannot tell whether the pod is an InferencePool's endpoint picker: {problem}"
    assert pages.seen == {}
    assert credentials.withheld["watch"] == 1
    assert calls[0] == 0


async def test_a_read_path_asks_for_no_token_and_counts_nothing(pickers: EndpointPickers, pages: Recorder) -> None:
    """A read path's read (``read_once``: Explain, a preview) makes no TokenRequest and counts nothing: before any
    token it reads without one and says there is none yet; once a scrape got one, it sends that one."""
    pods = Pods(pod("serving", "epp", EPP_LABELS), pod("tenant", "fake-epp", EPP_LABELS))
    calls, request = tokens("secret-1")
    credentials = EppCredentials(EppToken(request), pods, pickers, TRUSTED)
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=credentials)
    scraper = EngineScraper(DEFAULT_SCRAPE_LIMITS, reader=reader)
    reads = [
        (("serving", "epp"), Engine.EPP, Endpoint("127.0.0.1", pages.port, "/epp")),
        (("tenant", "fake-epp"), Engine.EPP, Endpoint("127.0.0.1", pages.port, "/fake-epp")),
    ]
    await scraper.start()
    try:
        first = await scraper.read_once(reads, 5.0)
        assert first[("serving", "epp")].error == (
            "HTTP 401 Unauthorized: no token yet (a read asks for none; the first scrape of a query asks)"
        )
        assert calls[0] == 0
        assert credentials.token.requests == {"ok": 0, "failed": 0}
        assert set(credentials.withheld.values()) == {0}
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None  # a scrape asks
        second = await scraper.read_once(reads, 5.0)
        assert second[("serving", "epp")].error is None
    finally:
        await scraper.stop()
    assert calls[0] == 1
    assert credentials.token.requests == {"ok": 1, "failed": 0}
    assert set(credentials.withheld.values()) == {0}
    assert pages.seen["/epp"] == [None, "Bearer secret-1", "Bearer secret-1"]
    assert pages.seen["/fake-epp"] == [None, None]


async def test_a_refresh_that_raises_is_counted_and_backs_off(pickers: EndpointPickers, pages: Recorder) -> None:
    """A refresh beside a valid token that raises what no TokenRequest should (a bug) is counted as failed, backs
    off and leaves no task exception unretrieved; the valid token is still sent."""
    pods = Pods(pod("serving", "epp", EPP_LABELS))
    clock = Clock()
    calls, request = tokens("secret-1", RuntimeError("boom"))
    token = EppToken(request, clock=clock)
    reader = PageReader(DEFAULT_SCRAPE_LIMITS, authorize=EppCredentials(token, pods, pickers, TRUSTED))
    await reader.start()
    try:
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        clock.now = 301.0
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
        await until(lambda: token.requests["failed"] == 1)
        clock.now = 302.0  # within the 5 s back-off: not asked again
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None
    finally:
        await reader.close()
    assert calls[0] == 2
    assert pages.seen["/epp"] == ["Bearer secret-1"] * 3


async def _disconnect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def test_a_token_request_whose_connection_drops_or_hangs_fails_counted() -> None:
    """A TokenRequest whose connection the API server drops (an aiohttp.ClientError that is no OSError) or that
    gets no answer within its timeout fails as TokenUnavailable naming it, counted, and is not asked again within
    the back-off."""
    hung: list[asyncio.StreamWriter] = []

    async def hang(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)

    for handler, said in ((_disconnect, "ServerDisconnectedError"), (hang, "TimeoutError")):
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        configuration = client.Configuration(host=f"http://127.0.0.1:{port}")
        factory = functools.partial(client.ApiClient, configuration)
        request = token_requester(factory, "gs", "epp-metrics", timeout_seconds=0.5)
        token = EppToken(request)
        try:
            with pytest.raises(TokenUnavailable, match=said):
                await token.bearer()
            with pytest.raises(TokenUnavailable, match=said):
                await token.bearer()  # within the back-off: the same failure, not asked again
        finally:
            for writer in hung:
                writer.close()
            server.close()
            await server.wait_closed()
        assert token.requests == {"ok": 0, "failed": 1}


async def test_only_the_trusted_namespaces_pools_and_services_are_listed_and_watched(
    api: tuple[Api, int], pickers: EndpointPickers
) -> None:
    """The InferencePools and Services of --epp-namespaces are listed and watched in each namespace alone; another
    namespace's are never asked for, so the gateway holds none of them and needs no right to read them."""
    kube, _ = api
    assert [c.lists for c in kube.serving] == [1, 1]
    await until(lambda: all(c.watches for c in kube.serving))
    assert [c.lists for c in kube.tenant] == [0, 0]
    assert [c.watches for c in kube.tenant] == [[], []]
    assert pickers.pool_of(pod("serving", "epp", EPP_LABELS)) == "llm"


async def test_a_refused_token_is_dropped_and_another_asked_for(pickers: EndpointPickers, pages: Recorder) -> None:
    """A token the EPP refuses (a 500 from its TokenReview: expired, its bound pod gone) fails that read saying so,
    and the next read sends a new token instead of the refused one until its half-life; a refusal the new token does
    not cure asks again at most every 5 s."""
    pods = Pods(pod("serving", "epp", EPP_LABELS))
    clock = Clock()
    calls, request = tokens("secret-1", "secret-2", "secret-3")
    reader = PageReader(
        DEFAULT_SCRAPE_LIMITS, authorize=EppCredentials(EppToken(request, clock=clock), pods, pickers, TRUSTED)
    )
    pages.rejected = {"Bearer secret-1", "Bearer secret-2"}
    await reader.start()
    try:
        error = await read(reader, pods, "epp", Engine.EPP, pages.port)
        assert error is not None
        assert "HTTP 500" in error
        assert "the EPP refused the token sent" in error
        clock.now = 1.0
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is not None  # secret-2, refused too
        clock.now = 2.0
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is not None  # within 5 s: secret-2 again
        assert calls[0] == 2
        clock.now = 7.0  # 5 s after secret-1's refusal: secret-2's refusal now drops it
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is not None
        clock.now = 7.5
        assert await read(reader, pods, "epp", Engine.EPP, pages.port) is None  # secret-3
        assert calls[0] == 3
    finally:
        await reader.close()
    assert pages.seen["/epp"] == ["Bearer secret-1"] + ["Bearer secret-2"] * 3 + ["Bearer secret-3"]
