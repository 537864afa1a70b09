"""What KEDA would see for one trigger: the four ExternalScaler answers, the explanation, the HPA's math.

``gpuscaler query`` collects a Report over the network and prints it as a table or JSON.
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
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.signals.hpa import MetricType, desired_replicas

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
    """Ask as KEDA would for the ScaledObject ``scaled_object`` (namespace, name) with this trigger ``metadata``."""
    scaler = keda.ExternalScalerStub(channel)
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


def report_renderable(report: Report) -> Group:
    """The report for a person: the four answers, the GPUs that went in, what was left out, the HPA's math."""
    parts: list[Table | Text] = [_answers_table(report), _gpus_table(report)]
    parts += [table for table in (_signals_table(report), _pods_table(report)) if table is not None]
    unlisted = unlisted_line(report)
    if unlisted:
        parts.append(Text(unlisted))
    left_out = left_out_lines(report)
    if left_out:
        parts.append(Text("\n".join(left_out), style="yellow"))
    for line in (selection_line(report), idle_energy_line(report)):
        if line:
            parts.append(Text(line))
    parts.append(_replicas_text(report))
    return Group(*parts)


def unlisted_line(report: Report) -> str:
    """How many GPUs the server did not list (a big cluster's answer lists a few hundred), or ""."""
    omitted = int((report.explanation or {}).get("gpusOmitted", 0))
    if not omitted:
        return ""
    return f"{omitted} more GPU(s) are in the answer but not listed: a server lists a few hundred, left-out ones first."


def selection_line(report: Report) -> str:
    """Which GPUs or pods the answer read, as the server resolved the metadata."""
    selection = (report.explanation or {}).get("selection", "")
    return f"Selection: {selection}" if selection else ""


def idle_energy_line(report: Report) -> str:
    """The energy the selected GPUs used while idle (docs/metrics.md defines idle), or "" without a figure."""
    idle = (report.explanation or {}).get("idleEnergy")
    if not idle or not int(idle.get("gpus", 0)):
        return ""
    idle_joules, busy = float(idle.get("idleJoules", 0.0)), float(idle.get("busyJoules", 0.0))
    share = f" ({100 * idle_joules / (idle_joules + busy):.0f}% of the energy)" if idle_joules + busy > 0 else ""
    unknown = float(idle.get("unknownSeconds", 0.0))
    line = (
        f"Energy while idle: {_joules(idle_joules)} of {_joules(idle_joules + busy)}{share} on {idle['gpus']} GPU(s) "
        f"over the last {float(idle.get('seconds', 0.0)):.0f}s"
    )
    return line + (f"; {unknown:.1f} GPU-seconds unknown" if unknown else "")


def _joules(joules: float) -> str:
    for unit, size in (("MJ", 1e6), ("kJ", 1e3)):
        if joules >= size:
            return f"{joules / size:.2f} {unit}"
    return f"{joules:.1f} J"


def left_out_lines(report: Report) -> list[str]:
    """What an answer that KEDA got did not count: unreadable GPUs, and nodes minNodes let it leave out."""
    explanation = report.explanation or {}
    if not report.get_metrics.ok:
        return []
    gpus = [gpu for gpu in explanation.get("gpus", []) if not gpu.get("included")]
    total = len(explanation.get("gpus", [])) + int(explanation.get("gpusOmitted", 0))
    lines = []
    if gpus:
        lines.append(f"The value leaves out {len(gpus)} of {total} GPU(s); their share is not in it:")
        lines += [
            f"  GPU {g.get('index', 0)} ({g.get('uuid', '')}) on {g.get('node', '')}: {g.get('reason', '')}"
            for g in gpus
        ]
    for absent in explanation.get("absent", []):
        who = f"node {absent.get('node')}" if absent.get("node") else "an agent not heard from"
        agent, reason = absent.get("agent", ""), absent.get("reason", "")
        by = f" (agent {agent})" if agent else ""  # a node that is heard, with nothing readable, names no agent
        lines.append(f"The value leaves out {who}{by}, as minNodes allows: {reason}")
    return lines


def render_table(report: Report, console: Console) -> None:
    """Print the report for a person, as tables, on ``console``."""
    console.print(report_renderable(report))


def _answers_table(report: Report) -> Table:
    table = Table(title="What KEDA gets", title_justify="left", show_lines=False)
    table.add_column("RPC")
    table.add_column("answer")
    spec = report.get_metric_spec
    if spec.ok:
        item = spec.fields["metricSpecs"][0]
        spec_text = (
            f"metricName={item['metricName']} "
            f"targetSizeFloat={item['targetSizeFloat']:g} targetSize={item['targetSize']}"
        )
    else:
        spec_text = None
    metrics = report.get_metrics
    if metrics.ok:
        item = metrics.fields["metricValues"][0]
        metrics_text = (
            f"metricValueFloat={float(item.get('metricValueFloat', 0.0)):.3f} metricValue={item.get('metricValue', 0)}"
        )
    else:
        metrics_text = None
    rows = [
        ("GetMetricSpec", spec, spec_text),
        ("GetMetrics", metrics, metrics_text),
        (
            "IsActive",
            report.is_active,
            f"result={report.is_active.fields.get('result')}" if report.is_active.ok else None,
        ),
        (
            "StreamIsActive",
            report.stream_is_active,
            f"first message result={report.stream_is_active.fields.get('result')}"
            if report.stream_is_active.ok
            else None,
        ),
    ]
    for name, answer, text in rows:
        table.add_row(name, text if answer.ok and text else Text(f"{answer.code}: {answer.message}", style="red"))
    return table


def _gpus_table(report: Report) -> Table:
    explanation = report.explanation or {}
    window = float(explanation.get("windowSeconds", 0.0))
    how = f"{explanation.get('windowFunction')} over {window:g}s" if window else "latest sample"
    title = (
        f"GPUs: {explanation.get('metric', '?')} ({how}), then {explanation.get('aggregation', '?')} across GPUs; "
        f"activation > {explanation.get('activationThreshold', 0):g}, deactivation <= "
        f"{explanation.get('deactivationThreshold', 0):g}"
    )
    table = Table(title=title, title_justify="left")
    pods = bool(explanation.get("podAggregation"))
    columns = ["node", "index", "uuid", "value", "samples", "left out because"]
    if pods:  # a pod query: whose GPU it is, and whether the pod's own share or the whole GPU counted
        columns[3:3] = ["pod", "counted as"]
    for column in columns:
        table.add_column(column)
    for gpu in explanation.get("gpus", []):
        value = gpu.get("value")
        cells = [
            gpu.get("node", ""),
            str(gpu.get("index", 0)),
            gpu.get("uuid", ""),
            "" if value is None else f"{float(value):.3f}",
            str(gpu.get("samples", 0)),
            gpu.get("reason", ""),
        ]
        if pods:
            cells[3:3] = [f"{gpu.get('namespace', '')}/{gpu.get('pod', '')}", gpu.get("share", "")]
        table.add_row(*cells)
    return table


def _signals_table(report: Report) -> Table | None:
    """A combined query's signals: each one's value, target and the replicas it asks for; None for one signal."""
    signals = (report.explanation or {}).get("signals") or []
    if not signals:
        return None
    table = Table(title="Signals: the answer is the most replicas any asks for", title_justify="left")
    for column in ("signal", "value", "target", "replicas", "unknown because"):
        table.add_column(column)
    for part in signals:
        value, replicas = part.get("value"), part.get("replicas")
        table.add_row(
            part.get("metric", ""),
            "" if value is None else f"{float(value):.3f}",
            f"{float(part.get('target', 0.0)):g}",
            "" if replicas is None else f"{float(replicas):.3f}",
            part.get("errorMessage", ""),
        )
    return table


def _pods_table(report: Report) -> Table | None:
    """Each selected pod's value, with the signal it counts for (a combined query), its GPUs or the age of its
    metrics page (an engine signal), and why it was left out or unread; None when the query selects no pods."""
    pods = (report.explanation or {}).get("pods") or []
    if not pods:
        return None
    table = Table(title="Pods: each replica's value", title_justify="left")
    combined = any(pod.get("signal") for pod in pods)
    columns = ["pod", "node", "value", "GPUs", "page age", "left out or unread because"]
    for column in (["signal"] if combined else []) + columns:
        table.add_column(column)
    for pod in pods:
        value, age = pod.get("value"), pod.get("ageSeconds")
        cells = [
            f"{pod.get('namespace', '')}/{pod.get('pod', '')}",
            pod.get("node", ""),
            "" if value is None else f"{float(value):.3f}",
            str(pod.get("gpus") or ""),
            "" if age is None else f"{float(age):.1f}s",
            pod.get("reason", ""),
        ]
        table.add_row(*([pod.get("signal", "")] if combined else []), *cells)
    return table


def _replicas_text(report: Report) -> Text:
    if report.replicas is None:
        return Text("HPA: no value, so KEDA keeps the current replicas or applies its fallback", style="yellow")
    return Text(
        f"HPA at {report.current_replicas} current replica(s): AverageValue -> {report.replicas['AverageValue']}, "
        f"Value -> {report.replicas['Value']}"
    )
