"""The real endpoint picker (GIE v1.5.0's EPP, flow control on) queues a request for a pool at zero replicas, and the
gateway reads that queue from the EPP's own pod as ``epp_queue``.

The EPP watches this control plane's API server for its InferencePool and the pool's pods; the request reaches it
over Envoy's ext_proc protocol (e2e/keda/eppclient). The EPP's pod is a Deployment's pod in the API server that the
gateway's static directory places at the EPP's loopback /metrics port (no kubelet runs pods here); the model
server's pod gets its IP from the suite's stand-in for the kubelet, and a fake vLLM serves its metrics page there,
which the EPP reads before it dispatches.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml

from e2e.keda.control_plane import deployment, free_port
from e2e.keda.scenario import Scenario, directory_entry
from e2e.support.epp import Epp, EppRequest, inference_pool, install_crds
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine

POOL = "llm-pool"
MODEL = "m"


async def test_a_request_queued_at_zero_endpoints_is_read_by_the_gateway_and_dispatched_once_a_pod_is_ready(
    scenario: Scenario, tmp_path: Path
) -> None:
    """The EPP's queue for the pool is 0 before any request (the EPP is idle); one request arrives while the pool's
    Deployment has 0 replicas and the EPP holds it (its /metrics and the gateway's ``epp_queue`` both say 1); the
    Deployment goes to 1, its pod becomes Ready with a model server's metrics page, the EPP dispatches the request to
    that pod, the queue is 0 again and ``epp_running`` is 1 until the request's stream ends."""
    plane = scenario.plane
    await asyncio.to_thread(install_crds, plane.kube, lambda what, ready: plane.wait_for(what, ready, []))
    target_port = free_port()
    await scenario.apply(deployment("llm", scenario.namespace, replicas=0))
    await scenario.apply(inference_pool(POOL, scenario.namespace, app="llm", target_port=target_port, epp="epp"))
    await scenario.deployment("epp", replicas=1)
    (epp_pod,) = await scenario.wait_pods("epp", 1)
    assert plane.kubeconfig is not None
    epp = Epp(POOL, scenario.namespace, plane.kubeconfig, tmp_path / "epp.log")
    request = EppRequest()
    engine: FakeEngine | None = None
    try:
        await asyncio.to_thread(epp.start)
        entry = {
            **directory_entry(epp_pod, "epp"),
            "ip": "127.0.0.1",
            "annotations": {"prometheus.io/port": str(epp.metrics_port)},
        }
        pods_file = tmp_path / "pods.yaml"
        pods_file.write_text(yaml.safe_dump({"pods": [entry]}))
        gateway = await scenario.gateway([await scenario.agent("node-1")], pod_directory=pods_file)
        asked = {"metric": "epp_queue", "workload": "epp", "inferencePool": POOL, "namespace": scenario.namespace}
        # Before its first request the real EPP writes no flow-control series at all: its shard's processor, whose
        # dispatch cycle writes the pool's saturation, starts with the first request (GIE v1.5.0
        # pkg/epp/flowcontrol/controller/controller.go:419, getOrStartWorker). Its page is an EPP's (the info
        # series), which shows the queue would be counted: idle, 0, so a fresh or failed-over EPP wakes nothing.
        page = await asyncio.to_thread(epp.metrics_text)
        assert "inference_extension_info{" in page, page
        assert "inference_extension_flow_control_" not in page, page
        await scenario.wait_value(gateway, asked, 0.0)
        scenario.record("real EPP before its first request: gateway epp_queue 0")

        sent = time.monotonic()
        await asyncio.to_thread(request.send, epp, MODEL)
        await asyncio.to_thread(epp.wait_queue, 1.0)
        await scenario.wait_value(gateway, asked, 1.0)
        read = time.monotonic() - sent
        assert not [line for line in request.lines if line != "sent"], request.lines

        await scenario.apply(deployment("llm", scenario.namespace, replicas=1))
        (pod,) = await scenario.wait_pod_ips("llm", 1)
        ip = pod["status"]["podIP"]
        ready = time.monotonic()
        engine = await FakeEngine(Engine.VLLM, {"waiting": 0.0, "running": 0.0, "kv": 0.0}).start(ip, target_port)
        picked = await asyncio.to_thread(request.wait_line, "headers")
        assert picked == f"headers {ip}:{target_port}", request.lines
        dispatched = time.monotonic() - ready
        await asyncio.to_thread(epp.wait_queue, 0.0)
        await scenario.wait_value(gateway, asked, 0.0)
        # Dispatched but unanswered (no model server runs): a running request, which keeps a wake profile active.
        running = {"metric": "epp_running", "workload": "epp", "namespace": scenario.namespace}
        await scenario.wait_value(gateway, running, 1.0)
        await asyncio.to_thread(request.close)
        await scenario.wait_value(gateway, running, 0.0)
        scenario.record(
            f"real EPP (GIE v1.5.0): queued at 0 endpoints, gateway read 1 in {read:.1f} s of sending; "
            f"dispatched to {ip}:{target_port} {dispatched:.1f} s after its model server answered"
        )
    finally:
        request.close()
        await asyncio.to_thread(epp.stop)
        if engine is not None:
            await engine.stop()
