"""Every ScaledObject the docs and the chart's examples show is accepted by the real API server and made Ready by KEDA.

The objects come from the same extraction as tests/test_docs.py (fenced YAML in README.md and docs/, and the chart's
examples). Each is applied as written, with strict field validation against KEDA's CRD, except for two things a
loopback cluster needs: its own namespace, and ``scalerAddress`` pointing at a running gateway (or, for a trigger
that asks for TLS, a TLS agent, with the documented TriggerAuthentication applied as written too). Another scaler's
trigger that the docs show for comparison (KEDA's ``prometheus`` trigger in docs/migration.md) gets a stand-in of
its server on loopback instead, in ``serverAddress``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from e2e.keda.control_plane import ApiError, Json, secret
from e2e.keda.scenario import Scenario, scaled_object
from e2e.support.certs import TlsFiles
from e2e.support.process import Process
from gpuscaler.model.engines import ENGINE_SIGNALS, Engine
from gpuscaler.query.keys import asks_in_scaled_object_namespace
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import CombinedQuery, EngineQuery
from tests.test_docs import EXTERNAL_TRIGGERS, YAML_SOURCES, YamlSource

# TriggerAuthentication parameters -> which of the suite's PEM files their Secret key holds.
TLS_PARAMETERS = {"caCert": "ca", "tlsClientCert": "client_cert", "tlsClientKey": "client_key"}


def documented() -> list[Any]:
    """One case per ScaledObject the docs' and the chart examples' YAML shows, its id naming source and name."""
    cases = []
    for source in YAML_SOURCES:
        documents = [doc for doc in yaml.safe_load_all(source.text) if isinstance(doc, dict)]
        for document in documents:
            if document.get("kind") == "ScaledObject":
                case_id = f"{source.id}:{document['metadata']['name']}"
                cases.append(pytest.param(source, document, id=case_id))
    return cases


def _pem(files: TlsFiles, parameter: str) -> bytes:
    path: Path = getattr(files, TLS_PARAMETERS[parameter])
    return path.read_bytes()


def _uses_tls(manifest: Json) -> bool:
    return any(
        trigger.get("authenticationRef") or trigger.get("metadata", {}).get("enableTLS") == "true"
        for trigger in manifest["spec"]["triggers"]
    )


async def _tls_agent(scenario: Scenario, source: YamlSource) -> Process:
    """Starts a TLS agent (mTLS when the documented TriggerAuthentication carries a client certificate), creates the
    Secrets it names from the suite's certificates, and applies the TriggerAuthentication as documented."""
    files = scenario.plane.certificates
    authentications = [
        d for d in yaml.safe_load_all(source.text) if isinstance(d, dict) and d.get("kind") == "TriggerAuthentication"
    ]
    secrets: dict[str, dict[str, bytes]] = {}
    parameters: set[str] = set()
    for authentication in authentications:
        for reference in authentication["spec"].get("secretTargetRef", []):
            parameters.add(reference["parameter"])
            pem = _pem(files, reference["parameter"])
            secrets.setdefault(reference["name"], {})[reference["key"]] = pem
        await scenario.apply(authentication)
    for name, contents in secrets.items():
        await scenario.apply(secret(name, scenario.namespace, contents))
    return await scenario.agent("node-1", tls=files, mtls="tlsClientCert" in parameters)


@contextlib.asynccontextmanager
async def _prometheus_stand_in() -> AsyncIterator[str]:
    """Prometheus' instant-query API on loopback, answering every query with one sample of 0, as a real Prometheus
    answers a query over idle GPUs: what KEDA's prometheus scaler reads. Yields its URL, for ``serverAddress``."""

    async def query(_request: web.Request) -> web.Response:
        sample = {"metric": {}, "value": [time.time(), "0"]}
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": [sample]}})

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("source", "document"), documented())
async def test_documented_scaled_object_becomes_ready(
    scenario: Scenario, tmp_path: Path, source: YamlSource, document: Json
) -> None:
    """The documented ScaledObject passes KEDA's CRD schema, and KEDA makes it Ready with an HPA."""
    manifest = copy.deepcopy(document)
    others = [trigger for trigger in manifest["spec"]["triggers"] if trigger["type"] not in EXTERNAL_TRIGGERS]
    assert {trigger["type"] for trigger in others} <= {"prometheus"}, f"{source.id}: no stand-in for {others}"
    async with contextlib.AsyncExitStack() as stand_ins:
        for trigger in others:
            trigger["metadata"]["serverAddress"] = await stand_ins.enter_async_context(_prometheus_stand_in())
        await _becomes_ready(scenario, tmp_path, source, manifest)


async def _becomes_ready(scenario: Scenario, tmp_path: Path, source: YamlSource, manifest: Json) -> None:
    tls = _uses_tls(manifest)
    if tls:
        scaler = await _tls_agent(scenario, source)
    else:
        pods = tmp_path / "pods.yaml"
        # Workload queries need a pod directory (no pod holds a GPU yet); scaleTargetPods needs the ScaledObject in it.
        target_ref = json.dumps(manifest["spec"]["scaleTargetRef"])
        name = manifest["metadata"]["name"]
        pods.write_text(
            "pods: []\n"
            f"scaledObjects:\n  - {{namespace: {scenario.namespace}, name: {name}, scaleTargetRef: {target_ref}}}\n"
        )
        # ... and an agent with pod attribution (a fake kubelet that reports no pods).
        agent = await scenario.agent("node-1", kubelet=await scenario.kubelet())
        scaler = await scenario.gateway([agent], pod_directory=pods)
    triggers = [trigger for trigger in manifest["spec"]["triggers"] if trigger["type"] in EXTERNAL_TRIGGERS]
    for trigger in triggers:
        trigger["metadata"]["scalerAddress"] = f"127.0.0.1:{scaler.port}"
    target = manifest["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment", target
    await scenario.deployment(target["name"])
    await scenario.apply(manifest)
    ready = await scenario.wait_ready(manifest["metadata"]["name"])
    hpa_name = f"keda-hpa-{manifest['metadata']['name']}"
    hpa = await scenario.get(
        f"/apis/autoscaling/v2/namespaces/{scenario.namespace}/horizontalpodautoscalers/{hpa_name}"
    )
    assert hpa is not None, f"KEDA made no HPA for {source.id}; status: {ready.get('status')}"
    # Ready says KEDA built the scaler; the answers say the documented metadata works: ask as KEDA asks.
    for trigger in triggers:
        metadata = dict(trigger["metadata"])
        if asks_in_scaled_object_namespace(metadata):
            metadata.setdefault("namespace", scenario.namespace)  # what KEDA's ScaledObjectRef implies
        scaled_object = f"{scenario.namespace}/{manifest['metadata']['name']}"  # what KEDA's calls name
        answer = await scenario.query(
            scaler, metadata, scenario.plane.certificates if tls else None, scaled_object=scaled_object
        )
        assert answer["get_metric_spec"]["ok"], f"{source.id}: get_metric_spec failed: {answer['get_metric_spec']}"
        if _reads_the_epp(metadata, manifest):
            # No inference gateway here: its EPP's demand is unknown, never 0 (e2e/keda/test_epp_real.py reads a
            # real one). The answers say so, which shows the documented metadata parsed and was evaluated.
            for call in ("get_metrics", "is_active"):
                assert answer[call]["code"] == "UNAVAILABLE", f"{source.id}: {call}: {answer[call]}"
                assert "no Ready epp pod is selected" in answer[call]["message"], f"{source.id}: {answer[call]}"
            continue
        for call in ("get_metrics", "is_active", "stream_is_active"):
            assert answer[call]["ok"], f"{source.id}: {call} failed: {answer[call]}"


def _reads_the_epp(metadata: dict[str, str], manifest: Json) -> bool:
    """Whether a trigger reads the inference gateway EPP's signals (``epp_*``, alone or among ``signals``)."""
    query = parse_metadata(
        metadata,
        Limits(history_seconds=600, cluster=True),
        namespace=manifest["metadata"].get("namespace", "default"),
        name=manifest["metadata"]["name"],
    ).value
    parts = [part.query for part in query.signals] if isinstance(query, CombinedQuery) else [query]
    return any(isinstance(part, EngineQuery) and ENGINE_SIGNALS[part.metric].engine is Engine.EPP for part in parts)


async def test_a_misspelt_field_is_refused_by_the_crd_schema(scenario: Scenario) -> None:
    """The documented objects' check can fail: a field KEDA's CRD does not have is refused, naming it."""
    await scenario.deployment("trainer")
    document = scaled_object("trainer", trigger="external", metadata={"scalerAddress": "127.0.0.1:6000"})
    document["spec"]["minReplicaCont"] = 0
    with pytest.raises(ApiError) as refused:
        await scenario.apply(document)
    # Server-side apply reports a field outside the schema as 500 "field not declared in schema".
    assert "minReplicaCont: field not declared in schema" in refused.value.body, refused.value.body


async def test_keda_admission_refuses_a_second_scaled_object_for_one_deployment(scenario: Scenario) -> None:
    """KEDA's admission webhook is in the path: a second ScaledObject for a Deployment is refused, as KEDA words it."""
    agent = await scenario.agent("node-1")
    await scenario.deployment("trainer")
    metadata = {"scalerAddress": f"127.0.0.1:{agent.port}"}
    await scenario.apply(scaled_object("first", trigger="external", metadata=metadata, target="trainer"))
    await scenario.wait_ready("first")
    with pytest.raises(ApiError) as refused:
        await scenario.apply(scaled_object("second", trigger="external", metadata=metadata, target="trainer"))
    message = json.loads(refused.value.body)["message"]
    assert 'admission webhook "vscaledobject.kb.io" denied the request' in message, message
    # KEDA runs its checks in map order: the ScaledObject's or its HPA's ownership of the Deployment may answer first.
    assert re.search(
        r"'trainer' of type 'apps/v1.Deployment' is already managed by the (ScaledObject 'first'|hpa "
        r"'keda-hpa-first')",
        message,
    ), message
