"""scaleTargetPods at a running gateway: KEDA's ScaledObject name picks the pods; `gpuscaler query` says which."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpclib.client import Channel

from gpuscaler.cli import main
from gpuscaler.client.explain import collect
from gpuscaler.client.render import selection_line
from gpuscaler.generated import externalscaler as keda
from tests.fakes.fake_kubelet import Assignment
from tests.gateway.calls import view_has
from tests.gateway.conftest import StartGateway, StartNode
from tests.waiting import until_result

DIRECTORY = """
pods:
  - {namespace: ml, pod: trainer-7c9d-a, workload: trainer, workloadKind: Deployment}
  - {namespace: ml, pod: trainer-7c9d-b, workload: trainer, workloadKind: Deployment}
  - {namespace: ml, pod: web-1, workload: web, workloadKind: Deployment}
scaledObjects:
  - {namespace: ml, name: trainer-so, scaleTargetRef: {name: trainer}}
"""


async def test_keda_calls_for_a_scaled_object_read_its_targets_pods(
    start_node: StartNode, start_gateway: StartGateway, tmp_path: Path
) -> None:
    """KEDA's GetMetrics for ScaledObject ml/trainer-so with scaleTargetPods reads trainer's pods only (40 + 20)."""
    node = await start_node("node-a", gpus=3)
    node.kubelet.assign(
        [
            Assignment("ml", "trainer-7c9d-a", (node.uuid(0),)),
            Assignment("ml", "trainer-7c9d-b", (node.uuid(1),)),
            Assignment("ml", "web-1", (node.uuid(2),)),
        ]
    )
    node.set(40, 20, 90)
    directory = tmp_path / "pods.yaml"
    directory.write_text(DIRECTORY)
    gateway = await start_gateway(node, pod_directory=directory)
    await view_has(gateway, 1)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        stub = keda.ExternalScalerStub(channel)

        async def answer(name: str, metadata: dict[str, str]) -> float:
            ref = keda.ScaledObjectRef(name=name, namespace="ml", scaler_metadata=metadata)
            spec = await stub.get_metric_spec(ref)
            request = keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=spec.metric_specs[0].metric_name)
            return (await stub.get_metrics(request)).metric_values[0].metric_value_float

        async def zero_config() -> float:
            return await answer("trainer-so", {"scaleTargetPods": "true"})

        assert await until_result(zero_config, lambda v: v == pytest.approx(60.0)) == pytest.approx(60.0)
        assert await answer("trainer-so", {}) == pytest.approx(150.0)  # without the key: every GPU, as before

        report = await collect(channel, {"scaleTargetPods": "true"}, scaled_object=("ml", "trainer-so"))
        assert report.get_metrics.ok
        assert selection_line(report) == (
            "Selection: pods in namespace ml, workload Deployment/trainer: the scaleTargetRef of ScaledObject "
            "ml/trainer-so (scaleTargetPods)"
        )
        unknown = await collect(channel, {"scaleTargetPods": "true"}, scaled_object=("ml", "nobody"))
        assert unknown.get_metrics.code == "UNAVAILABLE"
        assert "knows no ScaledObject ml/nobody" in unknown.get_metrics.message
    finally:
        channel.close()


def test_query_refuses_a_scaled_object_that_is_not_namespace_slash_name(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuscaler query --scaled-object` takes NAMESPACE/NAME and says so, exit 2."""
    with pytest.raises(SystemExit) as raised:
        main(["query", "--scaled-object", "trainer", "scaleTargetPods=true"], environ={})
    assert raised.value.code == 2
    assert "--scaled-object 'trainer': use NAMESPACE/NAME" in capsys.readouterr().err
