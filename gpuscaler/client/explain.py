"""What KEDA would see for one trigger: the four ExternalScaler answers, the explanation, the HPA's math.

``gpuscaler query`` collects a Report over the network here, and prints it as JSON or as the tables of
``render.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from gpuscaler.client.hpa import MetricType, desired_replicas
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.server.preview import PREVIEW_METADATA

# The ScaledObject `gpuscaler query` speaks for unless told (--scaled-object): the default namespace's pods.
DEFAULT_SCALED_OBJECT = ("default", "gpuscaler-query")


@dataclass(frozen=True, slots=True)
class Answer:
    """One RPC's outcome: its fields, or the gRPC status KEDA would get."""

    ok: bool
    fields: Mapping[str, Any] = field(default_factory=dict)
    code: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class Report:
    """All ``query`` shows for one trigger: the four answers, Explain's explanation and the HPA's replica counts."""

    metadata: Mapping[str, str]
    get_metric_spec: Answer
    get_metrics: Answer
    is_active: Answer
    stream_is_active: Answer
    explanation: Mapping[str, Any] | None
    replicas: Mapping[str, int] | None
    current_replicas: int
    # The ScaledObject it asked as (namespace, name): its namespace is the selection's unless the metadata names one.
    scaled_object: tuple[str, str] = DEFAULT_SCALED_OBJECT

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(asdict(self), indent=indent)


async def _answer(call: Any) -> Answer:
    try:
        response = await call
    except GRPCError as error:
        return Answer(ok=False, code=error.status.name, message=error.message or "")
    return Answer(ok=True, fields=response.to_dict(include_default_values=True))


async def collect(
    channel: Channel,
    metadata: Mapping[str, str],
    *,
    current_replicas: int = 1,
    stream_wait_seconds: float = 2.0,
    call_timeout: float = 5.0,
    scaled_object: tuple[str, str] = DEFAULT_SCALED_OBJECT,
) -> Report:
    """Ask as KEDA would for the ScaledObject ``scaled_object`` (namespace, name) with this trigger ``metadata``.

    Each call is marked as a preview: the server answers what KEDA would get now, and moves nothing KEDA's own calls
    keep (activation states, the record of selections that match nothing, the per-ScaledObject series)."""
    scaler = keda.ExternalScalerStub(channel, metadata=PREVIEW_METADATA)
    namespace, name = scaled_object
    ref = keda.ScaledObjectRef(name=name, namespace=namespace, scaler_metadata=dict(metadata))
    spec = await _answer(scaler.get_metric_spec(ref, timeout=call_timeout))
    name = spec.fields["metricSpecs"][0]["metricName"] if spec.ok else ""
    metrics = await _answer(
        scaler.get_metrics(keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=name), timeout=call_timeout)
    )
    active = await _answer(scaler.is_active(ref, timeout=call_timeout))
    stream = await _first_stream_message(scaler, ref, stream_wait_seconds)
    explanation = await _answer(
        pb.AgentStub(channel).explain(
            pb.ExplainRequest(scaler_metadata=dict(metadata), name=ref.name, namespace=ref.namespace),
            timeout=call_timeout,
        )
    )

    replicas = None
    if spec.ok and metrics.ok:
        target = float(spec.fields["metricSpecs"][0]["targetSizeFloat"])
        value = float(metrics.fields["metricValues"][0].get("metricValueFloat", 0.0))
        replicas = {
            kind.value: desired_replicas(kind, value=value, target=target, current=current_replicas)
            for kind in MetricType
        }
    return Report(
        metadata=dict(metadata),
        get_metric_spec=spec,
        get_metrics=metrics,
        is_active=active,
        stream_is_active=stream,
        explanation=explanation.fields if explanation.ok else None,
        replicas=replicas,
        current_replicas=current_replicas,
        scaled_object=scaled_object,
    )


async def _first_stream_message(
    scaler: keda.ExternalScalerStub, ref: keda.ScaledObjectRef, wait_seconds: float
) -> Answer:
    stream = scaler.stream_is_active(ref)
    try:
        async with asyncio.timeout(wait_seconds):
            message = await anext(aiter(stream))
    except TimeoutError:
        return Answer(ok=False, code="NO_MESSAGE", message=f"no message within {wait_seconds:g}s")
    except GRPCError as error:
        return Answer(ok=False, code=error.status.name, message=error.message or "")
    except StopAsyncIteration:
        return Answer(ok=False, code="OK", message="stream ended without a message")
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]
    return Answer(ok=True, fields=message.to_dict(include_default_values=True))
