"""A query on an engine signal: each selected pod's value from its own metrics page, then the pods combined.

``pods.py`` says which pods count and where each page is. A pod that counts and cannot be read makes the
answer UNAVAILABLE naming it, never a 0 for its queue; pods left out are listed with why. No pod that counts
(a workload at zero replicas, or all starting) is a true 0: no engine, no queue; except for a signal whose engine
exists at zero (``EngineSignal.absent_unknown``: the EPP holds a pool's demand while the pool has no replica), where
no pod that counts has lost the signal, and the answer is UNAVAILABLE.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuscaler.model.aggregation import aggregate
from gpuscaler.model.engines import ENGINE_SIGNALS, PodScrape
from gpuscaler.model.errors import GpuscalerError, TooManyPods, Unavailable, Unsupported
from gpuscaler.model.pods import PodDirectory, PodInfo
from gpuscaler.model.samples import Snapshot
from gpuscaler.query.query import EngineQuery, PodSelection
from gpuscaler.signals.engines.pods import Endpoint, left_out_because, metrics_endpoint
from gpuscaler.signals.engines.source import EngineSource, PodKey, stale_after
from gpuscaler.signals.engines.values import signal_value
from gpuscaler.signals.outcome import Evaluation, ListedContributions, PodValue, failed
from gpuscaler.signals.scale_targets import resolve as resolve_scale_target

# An error names this many unreadable pods, then counts the rest.
NAMED_PODS = 3


@dataclass(frozen=True, slots=True)
class EngineSelection:
    """The pods an engine query selects, each with its page's address or why it is not read, and whether it
    counts (a pod that counts and has no page it may be read at makes the answer unknown)."""

    pods: PodSelection  # resolved: scaleTargetPods made a selection of the scale target's pods
    rows: tuple[tuple[PodInfo, Endpoint | str, bool], ...]

    def reads(self) -> list[tuple[PodInfo, Endpoint]]:
        """The pods whose pages are read: those that count and declare where their page is."""
        return [(info, endpoint) for info, endpoint, _ in self.rows if isinstance(endpoint, Endpoint)]


def select_engine_pods(
    query: EngineQuery, engines: EngineSource | None, directory: PodDirectory | None
) -> EngineSelection | GpuscalerError:
    """The pods ``query`` reads, or why it can read none: a gateway's pods from its directory, at most
    ``engines.max_pods`` of them. Reads only; both registering interest and evaluating start here."""
    name = query.metric.value
    if engines is None:
        return Unsupported(
            f"{name} is read from the selected pods' own metrics pages by the gateway, which knows the pods; "
            "this server is a node agent: point scalerAddress at the gateway"
        )
    if directory is None:
        return Unsupported(
            f"{name} is read from the selected pods' own metrics pages, and this gateway has no pod directory "
            "to find them in: start it with --pod-directory (the chart's gateway.podDirectory: kubernetes)"
        )
    pods = query.pods
    if pods.scale_target is not None:
        resolved = resolve_scale_target(pods, directory)
        if isinstance(resolved, GpuscalerError):
            return resolved
        pods = resolved
    problem = directory.problem()
    if problem is not None:
        return Unavailable(f"{name} of {pods.describe()} needs the pod directory: {problem}")
    engine = ENGINE_SIGNALS[query.metric].engine
    rows: list[tuple[PodInfo, Endpoint | str, bool]] = []
    for info in sorted(selected_pods(pods, directory), key=lambda p: p.pod):
        left_out = left_out_because(info)
        rows.append((info, metrics_endpoint(info, engine) if left_out is None else left_out, left_out is None))
    selection = EngineSelection(pods, tuple(rows))
    read = len(selection.reads())
    if read > engines.max_pods:
        return TooManyPods(
            f"{query.pods.describe()} selects {read} Ready pods with a metrics page; one query may read at most "
            f"{engines.max_pods} (the gateway's --engine-max-pods-per-selection): select fewer pods with workload "
            "or podSelector, or raise the flag"
        )
    return selection


def evaluate_engine(
    query: EngineQuery,
    engines: EngineSource | None,
    directory: PodDirectory | None,
    snapshot: Snapshot | None,
    *,
    now: float,
    scrapes: Mapping[PodKey, PodScrape] | None = None,
) -> Evaluation:
    """``query`` over the pods it selects, as of the monotonic time ``now`` (the module says how).

    A read: each pod's newest scrape as the source has it, or as ``scrapes`` has it (a read path's one-shot reads
    of pods no one wants); a pod no one has asked to read is "not read yet".
    """
    selection = select_engine_pods(query, engines, directory)
    if isinstance(selection, GpuscalerError):
        return failed(query, snapshot, selection)
    assert engines is not None
    name = query.metric.value
    signal = ENGINE_SIGNALS[query.metric]
    timeout = engines.timeout_seconds
    values: list[PodValue] = []
    unread: list[PodValue] = []
    for info, endpoint, counts in selection.rows:
        if isinstance(endpoint, str):
            row = _row(info, None, endpoint, None)
        else:
            key = (info.namespace, info.pod)
            scrape = engines.scrape(key)
            if scrape is None and scrapes is not None:
                scrape = scrapes.get(key)
            if scrape is not None and scrape.endpoint != endpoint.url:
                scrape = None  # a page of the address the pod had before: not this pod's now
            read = signal_value(
                signal, scrape, now=now, stale_after=stale_after(query.interval_seconds, timeout), pool=query.pool
            )
            age = now - scrape.page.at if scrape is not None and scrape.page is not None else None
            row = _row(info, None if isinstance(read, str) else read, read if isinstance(read, str) else None, age)
        values.append(row)
        if row.value is None and counts:
            unread.append(row)
    pods = selection.pods
    error: GpuscalerError | None = None
    value: float | None = None
    if unread:
        named = "; ".join(f"pod {p.namespace}/{p.pod}: {p.reason}" for p in unread[:NAMED_PODS])
        more = f"; and {len(unread) - NAMED_PODS} more" if len(unread) > NAMED_PODS else ""
        error = Unavailable(
            f"{name} of {pods.describe()} is unknown: {len(unread)} of the Ready pods cannot be read "
            f"({named}{more}); an unread pod never counts as 0"
        )
    elif signal.absent_unknown and not any(counts for _, _, counts in selection.rows):
        left_out = "; ".join(f"pod {p.namespace}/{p.pod}: {p.reason}" for p in values[:NAMED_PODS])
        more = f"; and {len(values) - NAMED_PODS} more" if len(values) > NAMED_PODS else ""
        error = Unavailable(
            f"{name} of {query.describe_selection()} is unknown: no Ready {signal.engine.value} pod is selected "
            f"({left_out + more if values else 'no pod at all'}); the {signal.engine.value} holds this demand while "
            "the workload is at zero, so without one (a failover, a killed or NotReady pod) it is unknown, never 0"
        )
    else:
        included = [p.value for p in values if p.value is not None]
        value = aggregate(query.aggregation, included) if included else 0.0
    return Evaluation(
        query,
        ListedContributions(()),
        value,
        error,
        snapshot,
        tuple(values),
        selection=pods.describe(),
        unmatched=pods if value is not None and not values else None,
    )


def selected_pods(pods: PodSelection, directory: PodDirectory) -> list[PodInfo]:
    """The directory's pods that ``pods`` selects (a resolved selection: no scaleTargetPods)."""
    return [info for info in directory.pods(pods.namespace) if pods.selects(info)]


def _row(info: PodInfo, value: float | None, reason: str | None, age: float | None) -> PodValue:
    return PodValue(
        namespace=info.namespace,
        pod=info.pod,
        node=info.node or "",
        workload=info.workload,
        value=value,
        gpus=0,
        reason=reason,
        age_seconds=age,
    )
