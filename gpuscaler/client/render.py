"""What ``gpuscaler query`` prints of a Report: the answers, the HPA's math, and the GPUs, pods and signals behind
them, as tables that fit the console."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpuscaler.client.explain import Report
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.keys import asks_in_scaled_object_namespace

# A query on one of these reads GPUs; any other metric is an engine signal, or a combined query's name.
GPU_METRICS = frozenset(Metric)
# The width a renderable is laid out for when no console says: wide enough for every column of most answers.
WIDE_COLUMNS = 160


def report_renderable(report: Report, *, width: int = WIDE_COLUMNS) -> Group:
    """The report for a person, for a console ``width`` columns wide: the four answers, the GPUs that went in
    (a query on GPUs), the pods, what was left out, windows that are filling, the HPA's math."""
    tables = (_gpus_table(report, width=width), _signals_table(report), _pods_table(report, width=width))
    parts: list[RenderableType] = [_answers_table(report), *(table for table in tables if table is not None)]
    windows = window_line(report)
    if windows:
        parts.append(Text(windows, style="yellow"))
    unlisted = unlisted_line(report)
    if unlisted:
        parts.append(Text(unlisted))
    left_out = left_out_lines(report)
    if left_out:
        parts.append(Text("\n".join(left_out), style="yellow"))
    for line in (selection_line(report), idle_energy_line(report)):
        if line:
            parts.append(Text(line))
    parts += [Text(line, style="yellow") for line in selection_namespace_lines(report)]
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


def selection_namespace_lines(report: Report) -> list[str]:
    """Which namespace a pod selection without ``namespace`` asked in, and what a selection that matched no pod
    was (explanation's emptySelection: a workload at zero, or a name nothing there carries); [] otherwise."""
    lines = []
    namespace, name = report.scaled_object
    if asks_in_scaled_object_namespace(report.metadata):
        lines.append(
            f"Namespace: {namespace}, the namespace of ScaledObject {namespace}/{name}, which the query asks as; "
            "namespace=NAME or --scaled-object NAMESPACE/NAME asks in another"
        )
    empty = (report.explanation or {}).get("emptySelection")
    if empty:
        lines.append(str(empty.get("message", "")))
    return lines


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
    """Print the report for a person, as tables, on ``console``, laid out for its width."""
    console.print(report_renderable(report, width=console.width))


def window_line(report: Report) -> str:
    """How many GPUs' windows are filling and the least one's covered seconds (docs/metadata.md), or ""."""
    explanation = report.explanation or {}
    covered = explanation.get("leastCoveredSeconds")
    if covered is None:
        return ""
    filling = int(explanation.get("gpusFilling", 0))
    total = len(explanation.get("gpus", [])) + int(explanation.get("gpusOmitted", 0))
    node = explanation.get("leastCoveredNode", "")
    where = f", on node {node}" if node else ""
    return (
        f"Windows filling: {filling} of {total} GPU(s); the least covers {_covers(covered, explanation)}{where} "
        "(an agent that started less than a window ago, or a GPU read only lately). The value counts them as they are."
    )


def _covers(covered: float, explanation: Mapping[str, Any]) -> str:
    """``7.5 s of 120 s``: seconds a window covers of its length."""
    return f"{float(covered):.1f} s of {float(explanation.get('windowSeconds', 0.0)):g} s"


def _answers_table(report: Report) -> Table:
    table = Table(title="What KEDA gets", title_justify="left", show_lines=False)
    table.add_column("RPC", no_wrap=True)
    table.add_column("answer", overflow="fold")  # a metric name is one long word: whole, over two lines if need be
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


def _gpus_table(report: Report, *, width: int) -> Group | None:
    """Each GPU's part, for a query on GPUs (an engine signal or a combined query has none), laid out for ``width``
    (``_layout``). A "counted as" that every row shares is said once, under the table."""
    explanation = report.explanation or {}
    gpus = explanation.get("gpus", [])
    if not gpus and explanation.get("metric") not in GPU_METRICS:
        return None
    window = float(explanation.get("windowSeconds", 0.0))
    how = f"{explanation.get('windowFunction')} over {window:g}s" if window else "latest sample"
    pods = bool(explanation.get("podAggregation"))
    if pods:  # the pods table says how the pods' GPUs combine
        title = f"GPUs: {explanation.get('metric', '?')} ({how}) of each selected pod's GPUs"
    else:
        metric, aggregation = explanation.get("metric", "?"), explanation.get("aggregation", "?")
        title = f"GPUs: {metric} ({how}), then {aggregation} across GPUs; {_activation(explanation)}"
    shares = {gpu.get("share", "") for gpu in gpus}
    shared_once = pods and len(shares) == 1
    caption = f"each GPU counted as: {shares.pop()}" if shared_once and gpus else ""
    namespace = _one_namespace(gpus)

    def columns(wide: bool) -> list[_Column]:
        named = (
            [
                _Column("node", [g.get("node", "") for g in gpus]),
                _Column("index", [str(g.get("index", 0)) for g in gpus], right=True),
                _Column("uuid", [g.get("uuid", "") for g in gpus]),
            ]
            if wide
            else [_Column("GPU", [f"{g.get('node', '')}/{g.get('index', 0)}" for g in gpus])]
        )
        if pods:  # whose GPU it is, and whether the pod's own share or the whole GPU counted
            named.append(_Column("pod", [_pod_name(g, None if wide else namespace) for g in gpus]))
            if not shared_once:
                named.append(_Column("counted as", [g.get("share", "") for g in gpus], fold=True))
        named.append(_Column("value", [_value(g, wide) for g in gpus], right=True))
        named.append(_Column("samples", [str(g.get("samples", 0)) for g in gpus], right=True))
        return named + _covers_column(gpus)

    unread = [g for g in gpus if g.get("reason")]
    footnotes = (
        []
        if report.get_metrics.ok  # left_out_lines lists them, under the tables
        else [f"  GPU {g.get('index', 0)} ({g.get('uuid', '')}) on {g.get('node', '')}: {g['reason']}" for g in unread]
    )
    reasons = [g.get("reason", "") for g in gpus]
    return _layout(title, columns, reasons, footnotes, caption=caption, width=width)


def _value(row: Mapping[str, Any], wide: bool) -> str:
    """A row's value; a row left out says so where its reason has no column of its own (a narrow table)."""
    value = row.get("value")
    if value is not None:
        return f"{float(value):.3f}"
    return "" if wide or not row.get("reason") else "left out"


def _covers_column(rows: list[Mapping[str, Any]]) -> list[_Column]:
    """How much of its window each row covers, where any row's window is filling (docs/metadata.md); else none."""
    covered = [row.get("coveredSeconds") for row in rows]
    if all(seconds is None for seconds in covered):
        return []
    return [_Column("covers", ["" if s is None else f"{float(s):.1f} s" for s in covered], right=True)]


@dataclass(frozen=True, slots=True)
class _Column:
    """One column of a table: its header, its cells, and how it lays out."""

    header: str
    cells: list[str]
    right: bool = False
    fold: bool = False  # words that wrap (a reason); every other column keeps each cell on one line

    def width(self) -> int:
        return max([len(self.header), *map(len, self.cells)])


# A reason column narrower than this is one word a line: below it, reasons are listed under the table instead.
REASON_ROOM = 30


def _layout(
    title: str,
    columns: Callable[[bool], list[_Column]],
    reasons: list[str],
    footnotes: list[str],
    *,
    caption: str = "",
    width: int,
) -> Group:
    """The table ``columns(wide)`` makes, wide (every column) where it fits ``width`` with room for the reasons,
    else narrow: fewer, merged columns, and the reasons listed under it (``footnotes``) rather than in a column
    that a narrow table would squeeze to a word a line. Names and numbers are never cut or folded."""
    wide = columns(True)
    has_reasons = any(reasons)
    chosen = wide if _natural_width(wide) + (REASON_ROOM if has_reasons else 0) <= width else columns(False)
    if chosen is wide and has_reasons:
        chosen = [*wide, _Column("left out because", reasons, fold=True)]
        footnotes = []
    table = Table(caption=caption or None, caption_justify="left")
    for column in chosen:
        table.add_column(
            column.header,
            justify="right" if column.right else "left",
            no_wrap=not column.fold,
            overflow="fold" if column.fold else "ellipsis",
        )
    for row in zip(*(column.cells for column in chosen), strict=True):
        table.add_row(*row)
    parts: list[RenderableType] = [Text(title, style="italic"), table]
    if footnotes:
        parts.append(Text("\n".join(footnotes), style="yellow"))
    return Group(*parts)


def _natural_width(columns: list[_Column]) -> int:
    """The width of a table of ``columns`` with no cell wrapped: each column, its padding and its border."""
    return sum(column.width() + 3 for column in columns) + 1


def _activation(explanation: Mapping[str, Any]) -> str:
    return (
        f"activation > {explanation.get('activationThreshold', 0):g}, deactivation <= "
        f"{explanation.get('deactivationThreshold', 0):g}"
    )


def _one_namespace(rows: list[Mapping[str, Any]]) -> str | None:
    """The namespace every row's pod is in, when it is one: a narrow table names pods without it."""
    namespaces = {row.get("namespace", "") for row in rows}
    return namespaces.pop() if len(namespaces) == 1 else None


def _pod_name(row: Mapping[str, Any], namespace: str | None) -> str:
    pod = row.get("pod", "")
    return pod if namespace is not None else f"{row.get('namespace', '')}/{pod}"


def _signals_table(report: Report) -> Table | None:
    """A combined query's signals: each one's value, target and the replicas it asks for; None for one signal."""
    signals = (report.explanation or {}).get("signals") or []
    if not signals:
        return None
    table = Table(title="Signals: the answer is the most replicas any asks for", title_justify="left")
    table.add_column("signal", no_wrap=True)
    for column in ("value", "target", "replicas"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("unknown because", overflow="fold", ratio=1)
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


def _pods_table(report: Report, *, width: int) -> Group | None:
    """Each selected pod's value, with the signal it counts for (a combined query), its GPUs (a query on GPUs) or
    the age of its metrics page (an engine signal), how much of its window it covers where not all, and why it
    was left out or unread; None when the query selects no pods. The title says how the pods make the answer."""
    explanation = report.explanation or {}
    pods = explanation.get("pods") or []
    if not pods:
        return None
    combined = any(pod.get("signal") for pod in pods)
    aggregation = explanation.get("aggregation", "?")
    if explanation.get("signals"):
        title = "Pods: each signal's value per pod, summed across pods signal by signal"
    elif explanation.get("metric") not in GPU_METRICS:  # an engine signal
        title = f"Pods: {explanation.get('metric', '?')} from each pod's metrics page, then {aggregation} across pods; "
        title += _activation(explanation)
    else:
        pod_aggregation = explanation.get("podAggregation") or "avg"
        title = (
            f"Pods: {pod_aggregation} of each pod's GPUs, then {aggregation} across pods; {_activation(explanation)}"
        )
    namespace = _one_namespace(pods)

    def columns(wide: bool) -> list[_Column]:
        chosen = [_Column("signal", [pod.get("signal", "") for pod in pods])] if combined else []
        chosen += [
            _Column("pod", [_pod_name(pod, None if wide else namespace) for pod in pods]),
            _Column("node", [pod.get("node", "") for pod in pods]),
            _Column("value", [_value(pod, wide) for pod in pods], right=True),
        ]
        if any(pod.get("gpus") for pod in pods):
            chosen.append(_Column("GPUs", [str(pod.get("gpus") or "") for pod in pods], right=True))
        ages = [pod.get("ageSeconds") for pod in pods]
        if any(age is not None for age in ages):
            chosen.append(_Column("page age", ["" if a is None else f"{float(a):.1f}s" for a in ages], right=True))
        return chosen + _covers_column(pods)

    reasons = [pod.get("reason", "") for pod in pods]
    footnotes = [f"  {_pod_name(pod, None)}: {pod['reason']}" for pod in pods if pod.get("reason")]
    return _layout(title, columns, reasons, footnotes, width=width)


def _replicas_text(report: Report) -> Text:
    if report.replicas is None:
        return Text("HPA: no value, so KEDA keeps the current replicas or applies its fallback", style="yellow")
    return Text(
        f"HPA at {report.current_replicas} current replica(s): AverageValue -> {report.replicas['AverageValue']}, "
        f"Value -> {report.replicas['Value']}"
    )
