"""The EPP's bearer token reaches only the pods an InferencePool's endpointPickerRef names, against a fake API."""

from __future__ import annotations

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
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.setdefault(request.path, []).append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") is None:
            return web.Response(status=401, text="Unauthorized")
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


@pytest.fixture
async def pickers() -> AsyncIterator[EndpointPickers]:
    """InferencePool ``llm`` in ``serving`` names Service ``llm-epp``; pool ``other`` names a Service not there; a
    tenant's own pool in ``tenant`` names a Service of its own that selects its pods."""
    pools = FakeCollection("/apis/inference.networking.k8s.io/v1/inferencepools", "InferencePoolList")
    services = FakeCollection("/api/v1/services", "ServiceList")
    pools.items = [pool("serving", "llm", "llm-epp"), pool("serving", "other", "gone"), pool("tenant", "own", "own")]
    services.items = [
        service("serving", "llm-epp", EPP_LABELS),
        service("serving", "decoy", {"app": "decoy"}),
        service("tenant", "own", EPP_LABELS),
    ]
    api = FakeKubeApi(pools, services)
    await api.start()
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.port}")
    watched = EndpointPickers(lambda: client.ApiClient(configuration))
    await watched.start()
    await until(lambda: watched.problem() is None)
    yield watched
    await watched.stop()
    await api.stop()


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
        assert pickers.pool_of(pods.by_key[("tenant", "fake-epp")]) == "own"  # its own pool does name it
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
