"""KEDA reaches a TLS agent the three ways docs/tls.md describes, and scales a Deployment through each.

- mTLS: a TriggerAuthentication gives ``caCert``, ``tlsClientCert`` and ``tlsClientKey``; the agent requires a client
  certificate, so any scaling at all proves KEDA presented it.
- TLS with ``caCert`` from a TriggerAuthentication.
- ``enableTLS: "true"`` alone: KEDA verifies against its roots, here the suite's CA given to the operator's
  ``--ca-dir`` (the chart's custom CA), as a cluster with a private CA does.
"""

from __future__ import annotations

import time

import pytest

from e2e.keda.control_plane import secret
from e2e.keda.scenario import Scenario, expected_replicas, scaled_object
from gpuscaler.client.hpa import MetricType

TARGET = 40.0
BUSY = 95.0
MODES = ["mtls-trigger-authentication", "tls-trigger-authentication", "enable-tls"]


@pytest.mark.parametrize("mode", MODES)
async def test_keda_scales_through_tls(scenario: Scenario, mode: str) -> None:
    """Over TLS, a push takes the Deployment 0 -> 1 and the HPA takes it to ceil(value / target)."""
    files = scenario.plane.certificates
    mtls = mode.startswith("mtls")
    agent = await scenario.agent("node-1", tls=files, mtls=mtls)
    metadata = {"scalerAddress": f"127.0.0.1:{agent.port}", "metric": "gpu_utilization", "targetValue": f"{TARGET:g}"}
    authentication = None
    if mode == "enable-tls":
        metadata["enableTLS"] = "true"
    else:
        keys = {"caCert": "ca.crt"}
        contents = {"ca.crt": files.ca.read_bytes()}
        if mtls:
            keys |= {"tlsClientCert": "tls.crt", "tlsClientKey": "tls.key"}
            contents |= {"tls.crt": files.client_cert.read_bytes(), "tls.key": files.client_key.read_bytes()}
        await scenario.apply(secret("gpuscaler-client", scenario.namespace, contents))
        await scenario.apply(
            {
                "apiVersion": "keda.sh/v1alpha1",
                "kind": "TriggerAuthentication",
                "metadata": {"name": "gpuscaler-tls"},
                "spec": {
                    "secretTargetRef": [
                        {"parameter": parameter, "name": "gpuscaler-client", "key": key}
                        for parameter, key in keys.items()
                    ]
                },
            }
        )
        authentication = "gpuscaler-tls"
    history = await scenario.deployment("trainer")
    await scenario.apply(
        scaled_object(
            "trainer", trigger="external-push", metadata=metadata, polling_seconds=30, authentication=authentication
        )
    )
    await scenario.wait_ready("trainer")
    assert history.steps == [0], history.describe()

    invoked = time.monotonic()
    await scenario.fake_set(agent, 0, tls=files, gpu_utilization=BUSY)
    at_one = await history.wait_equal(1, 60, after=invoked)
    value = await scenario.wait_value(agent, metadata, BUSY, tls=files)
    expected = expected_replicas(MetricType.AVERAGE_VALUE, value=value, target=TARGET, current=1, maximum=10)
    await history.wait_equal(expected, 60, after=at_one)
    scenario.record(f"0 -> 1 {at_one - invoked:.2f} s after `gpuscaler fake set` was invoked; {history.describe()}")
