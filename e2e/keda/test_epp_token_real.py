"""The real endpoint picker (GIE v1.5.0's EPP) with ``--metrics-endpoint-auth=true`` refuses a gateway that sends
no token and accepts the token the gateway asks the TokenRequest API for (``--epp-metrics-token-service-account``).

With auth on, the EPP's /metrics runs controller-runtime v0.23.3's filter: a TokenReview of the bearer token (no
audiences: the API server's own) and a SubjectAccessReview for ``get`` on ``/metrics``. Both go to this control
plane's API server, which issues and checks ServiceAccount tokens (``--service-account-issuer``) but authorizes
everything (``--authorization-mode=AlwaysAllow``): what this test proves is the authentication side, a token
asked for with no audience and unbound (the gateway runs outside a pod) passing the EPP's TokenReview. The
ClusterRole and bindings the chart renders for the token's ServiceAccount are created all the same (so the objects
apply as rendered), but AlwaysAllow would allow the SubjectAccessReview without them: the RBAC side is not proven here.

The EPP's pod is a Deployment's pod that the suite's stand-in for the kubelet gives an address on loopback
(127.1.x.y); the EPP listens on every address, so the gateway's pod watch reads it there, as it would a pod's IP.
Whether a pod that is not the picker gets no token is not tested here: the fake pages (tests/fakes) do not record
the headers they receive; tests/gateway/directory/test_epp_token.py covers it in-process.

A ``gpuscaler query`` is a preview and asks for no token (epp_token.py), so the reads that must carry one are
KEDA's own GetMetrics calls (e2e/support/engine_gateway.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from e2e.keda.control_plane import Json, deployment, free_port
from e2e.keda.scenario import Scenario
from e2e.support.engine_gateway import counts_by, get_metrics
from e2e.support.epp import Epp, EppRequest, inference_pool, install_crds
from e2e.support.process import Process
from tests.chart import chart_tools
from tests.tools import locate

CHART = Path(__file__).resolve().parents[2] / "charts" / "gpuscaler"
POOL = "llm-pool"
MODEL = "m"


async def _chart_token_objects(scenario: Scenario) -> list[Json]:
    """What the chart renders for ``gateway.epp.metricsToken`` with this scenario's namespace trusted: the
    ServiceAccount, its ClusterRole and ClusterRoleBinding (``get`` on /metrics), and the gateway's Roles."""
    home = scenario.directory / "helm"
    environment = dict(os.environ) | {
        name: str(home / name) for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")
    }
    command = [str(locate(chart_tools.HELM)), "template", "gpuscaler", str(CHART), "-n", scenario.namespace]
    command += ["--show-only", "templates/gateway-epp-token.yaml", "--set", "gateway.podDirectory=kubernetes"]
    command += ["--set", "gateway.epp.metricsToken.enabled=true"]
    command += ["--set", f"gateway.epp.metricsToken.namespaces={{{scenario.namespace}}}"]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, env=environment, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return [document for document in yaml.safe_load_all(done.stdout) if document]


def _status(url: str, bearer: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


async def _keda_value(gateway: Process, namespace: str, asked: dict[str, str], expected: float) -> None:
    """Waits (30 s at most) until KEDA's GetMetrics (not a preview: it wants the pod, and may ask for a token)
    gives ``expected``; fails with the last answer."""
    deadline = time.monotonic() + 30
    last: object = "no answer"
    while time.monotonic() < deadline:
        try:
            if (last := await get_metrics(gateway.port, namespace, asked)) == expected:
                return
        except GRPCError as error:
            last = error
        await asyncio.sleep(0.2)
    raise AssertionError(f"GetMetrics never gave {expected} (last: {last})\n{gateway.tail()}")


async def _keda_refusal(gateway: Process, namespace: str, asked: dict[str, str]) -> GRPCError:
    """KEDA's GetMetrics' error once the gateway has read the EPP's pod (its message names an HTTP status)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            value = await get_metrics(gateway.port, namespace, asked)
            raise AssertionError(f"GetMetrics gave {value}, not an error")
        except GRPCError as error:
            if "HTTP " in str(error.message) or time.monotonic() > deadline:
                return error
        await asyncio.sleep(0.2)


async def test_the_real_epp_refuses_a_read_without_the_token_and_accepts_the_gateways_token(
    scenario: Scenario, tmp_path: Path
) -> None:
    """A gateway without the token flags reads the EPP's pod as UNAVAILABLE naming the EPP's HTTP 401 and that no
    token is sent; a gateway with them asks for a token of the chart's ServiceAccount (unbound, which it logs once) and
    reads the EPP's queue through KEDA's GetMetrics: 0 idle, then 1 once a request is queued at zero endpoints."""
    plane = scenario.plane
    assert plane.kubeconfig is not None
    await asyncio.to_thread(install_crds, plane.kube, lambda what, ready: plane.wait_for(what, ready, []))
    rendered = await _chart_token_objects(scenario)
    (account,) = [document for document in rendered if document["kind"] == "ServiceAccount"]
    account_name = account["metadata"]["name"]
    cluster_wide = [document for document in rendered if document["kind"].startswith("Cluster")]
    assert {document["kind"] for document in rendered} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    }, rendered
    epp: Epp | None = None
    request = EppRequest()
    try:
        for document in rendered:
            await scenario.apply(document)
        # This test's own reads of the EPP's page carry a token of the same ServiceAccount.
        issued = await asyncio.to_thread(
            plane.kube.request,
            "POST",
            f"/api/v1/namespaces/{scenario.namespace}/serviceaccounts/{account_name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600}},
        )
        epp = Epp(POOL, scenario.namespace, plane.kubeconfig, tmp_path / "epp.log", auth=True)
        await scenario.apply(deployment("llm", scenario.namespace, replicas=0))
        await scenario.apply(inference_pool(POOL, scenario.namespace, app="llm", target_port=free_port(), epp="epp"))
        await scenario.apply(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "epp"},
                "spec": {"selector": {"app": "epp"}, "ports": [{"port": 9002}]},
            }
        )
        await scenario.deployment("epp", replicas=1, annotations={"prometheus.io/port": str(epp.metrics_port)})
        (epp_pod,) = await scenario.wait_pod_ips("epp", 1)
        ip = epp_pod["status"]["podIP"]

        epp.bearer = issued["status"]["token"]
        await asyncio.to_thread(epp.start)
        # At the pod's address the EPP answers before any page (its filter runs first): 401 without a token; 500
        # "Authentication failed" with one the TokenReview rejects (k8s.io/apiserver v0.35.3's webhook authenticator
        # turns the review's status.error into an error, which controller-runtime v0.23.3's filters.go:86-90
        # answers 500, not 401); 200 with the ServiceAccount's token.
        url = f"http://{ip}:{epp.metrics_port}/metrics"
        assert await asyncio.to_thread(_status, url) == 401
        assert await asyncio.to_thread(_status, url, "not-a-token") == 500
        assert await asyncio.to_thread(_status, url, epp.bearer) == 200

        agent = await scenario.agent("node-1")
        asked = {"metric": "epp_queue", "workload": "epp", "inferencePool": POOL, "namespace": scenario.namespace}
        plain = await scenario.gateway([agent], pod_directory="kubernetes")
        refusal = await _keda_refusal(plain, scenario.namespace, asked)
        assert refusal.status is Status.UNAVAILABLE, refusal
        assert "HTTP 401 Unauthorized: no token is sent" in str(refusal.message), refusal

        flags = [
            "--epp-metrics-token-service-account",
            f"{scenario.namespace}/{account_name}",
            "--epp-namespaces",
            scenario.namespace,
        ]
        tokened = await scenario.gateway([agent], pod_directory="kubernetes", flags=flags)
        await _keda_value(tokened, scenario.namespace, asked, 0.0)
        await asyncio.to_thread(request.send, epp, MODEL)
        await asyncio.to_thread(epp.wait_queue, 1.0)
        await _keda_value(tokened, scenario.namespace, asked, 1.0)
        requests = await asyncio.to_thread(counts_by, tokened, "gpuscaler_gateway_epp_token_requests_total", "outcome")
        assert requests.get("ok", 0) >= 1, requests
        assert requests.get("failed") == 0, requests
        assert len(tokened.events("epp_token_unbound")) == 1, tokened.tail()
        assert not plain.events("epp_token_unbound"), plain.tail()
        scenario.record(
            f"real EPP (GIE v1.5.0) with --metrics-endpoint-auth=true at {ip}: no token -> HTTP 401, UNAVAILABLE; "
            f"the gateway's unbound token of {scenario.namespace}/{account_name} -> epp_queue 0 then 1 "
            f"({requests['ok']:g} TokenRequest); API server AlwaysAllow: RBAC not proven"
        )
    finally:
        request.close()
        if epp is not None:
            await asyncio.to_thread(epp.stop)
        for document in cluster_wide:
            await asyncio.to_thread(plane.kube.delete, document)
