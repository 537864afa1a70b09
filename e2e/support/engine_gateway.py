"""A ``gpuscaler gateway`` over a static pod directory and no agent, for engine-signal tests, and how to ask it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import yaml
from grpclib.client import Channel

from e2e.support.agent import CONSOLE_SCRIPT
from e2e.support.attacks import metrics_port_of, scrape
from e2e.support.process import Process, environment
from gpuscaler.generated import externalscaler as keda

StartGateway = Callable[[list[dict[str, object]], tuple[str, ...]], Process]


class EngineGateways:
    """Starts gateways, each over its own pod directory (as ``--pod-directory`` reads it); ``stop`` ends them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[Process] = []

    def start(self, pods: list[dict[str, object]], flags: tuple[str, ...] = ()) -> Process:
        index = len(self.started)
        directory = self.folder / f"pods-{index}.yaml"
        directory.write_text(yaml.safe_dump({"pods": pods}))
        agents = self.folder / "agents.txt"
        agents.write_text("")  # engine signals need no agent
        argv = [str(CONSOLE_SCRIPT), "gateway", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
        argv += ["--agents-file", str(agents), "--pod-directory", str(directory), "--log-format", "json"]
        argv += ["--drain-timeout", "1", *flags]
        gateway = Process(argv, self.folder / f"gateway-{index}.log", environment(), "gateway_started").start()
        self.started.append(gateway)
        return gateway

    async def stop(self) -> None:
        for gateway in self.started:
            await gateway.terminate()


async def get_metrics(port: int, namespace: str, metadata: Mapping[str, str], *, timeout: float = 5.0) -> float:
    """GetMetricSpec, then GetMetrics with ``timeout`` as its deadline, for ScaledObject ``namespace``/so."""
    channel = Channel("127.0.0.1", port)
    try:
        stub = keda.ExternalScalerStub(channel)
        ref = keda.ScaledObjectRef(name="so", namespace=namespace, scaler_metadata=dict(metadata))
        spec = await stub.get_metric_spec(ref, timeout=5)
        request = keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=spec.metric_specs[0].metric_name)
        return (await stub.get_metrics(request, timeout=timeout)).metric_values[0].metric_value_float
    finally:
        channel.close()


def counts_by(process: Process, name: str, label: str) -> dict[str, float]:
    """``name``'s samples on the process's /metrics, by the value of ``label``."""
    return {labels[label]: value for sample, labels, value in scrape(metrics_port_of(process)) if sample == name}
