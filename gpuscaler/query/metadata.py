"""Trigger metadata (``ScaledObjectRef.scalerMetadata``) to a ``Query``, or an error that names the key.

Precedence, lowest first: the metric's defaults, the profile, then each key the trigger sets. A profile's
target and thresholds belong to its metric: when the trigger picks another metric, that metric's
defaults apply instead, so ``profile: training`` with ``metric: power_draw`` does not mean "90 watts".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.durations import format_duration, parse_duration
from gpuscaler.model.engines import ENGINE_SIGNALS, EngineMetric
from gpuscaler.model.errors import InvalidMetadata, Unsupported
from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.query.engine_keys import (
    DEFAULT_MIN_SCRAPE_SECONDS,
    AnyMetric,
    describe_targets,
    parse_any_metric,
    parse_pool,
    parse_scrape_interval,
    parse_signal_targets,
    refuse_gpu_keys,
    refuse_pool_key,
)
from gpuscaler.query.key_values import (
    format_number,
    not_one_of,
    parse_bool,
    parse_enum,
    parse_float,
    parse_max_unreadable,
    parse_metric_name,
    parse_min_nodes,
)
from gpuscaler.query.keys import SELECTOR_KEYS, resolve_keys
from gpuscaler.query.profiles import DEFAULT_METRIC, PROFILE_ALIASES, PROFILES, SIGNAL_PROFILES, SignalProfile
from gpuscaler.query.query import (
    DEFAULT_MAX_UNREADABLE,
    ActivationRule,
    CombinedQuery,
    EngineQuery,
    GpuQuery,
    GpuSelection,
    Query,
    SignalTarget,
    default_metric_name,
    digest_name,
)
from gpuscaler.query.selection import engine_pods, parse_pods, parse_selection, scale_target_selection, selected_pods

MIN_TARGET = 0.001  # KEDA keeps milli precision; a smaller target rounds to 0 and is refused there
# KEDA turns a target into int64 milli-units (resource.NewMilliQuantity): a larger one overflows there.
MAX_TARGET = (2**63 - 1) // 1000


@dataclass(frozen=True, slots=True)
class Limits:
    """What the running agent allows, so that errors can say so (a window longer than the history)."""

    history_seconds: float
    # A gateway answers for every node, where a GPU index names one GPU on each of them.
    cluster: bool = False
    # False on a node agent: engine signals are read by the gateway, which knows the pods and reads their pages.
    reads_engines: bool = True
    # The shortest scrapeInterval the gateway allows (--engine-min-scrape-interval).
    min_scrape_seconds: float = DEFAULT_MIN_SCRAPE_SECONDS


def parse_metadata(metadata: Mapping[str, str], limits: Limits, *, namespace: str = "", name: str = "") -> Query:
    """The query the metadata asks for. Raises InvalidMetadata naming the key, the value and what is allowed.

    ``namespace`` and ``name`` are the ScaledObject's: the default namespace of a pod selection, and with
    ``scaleTargetPods`` the ScaledObject whose scale target's pods the query reads.
    """
    raw = resolve_keys(metadata)
    scale_target_pods = parse_bool("scaleTargetPods", raw["scaleTargetPods"]) if "scaleTargetPods" in raw else False
    explicit = [key for key in SELECTOR_KEYS if key in raw]

    profile = None
    signal_profile = None
    if "profile" in raw:
        profile_name = PROFILE_ALIASES.get(raw["profile"].strip(), raw["profile"].strip())
        profile = PROFILES.get(profile_name)
        signal_profile = SIGNAL_PROFILES.get(profile_name)
        if profile is None and signal_profile is None:
            raise not_one_of("profile", raw["profile"], [*PROFILES, *SIGNAL_PROFILES])

    named = "metric" in raw or "metricType" in raw
    if "signals" in raw or (signal_profile is not None and len(signal_profile.signals) > 1 and not named):
        return _combined_query(raw, limits, namespace, name, signal_profile)
    default = profile.metric if profile else signal_profile.signals[0][0] if signal_profile else DEFAULT_METRIC
    any_metric = _parse_metric(raw, default)
    if isinstance(any_metric, EngineMetric):
        if not limits.reads_engines:
            raise _engine_signal_on_an_agent(any_metric)
        return _engine_query(raw, namespace, name, any_metric, signal_profile, limits)
    metric = any_metric
    refuse_pool_key(raw, f"GPU metric {metric.value}")
    if "scrapeInterval" in raw:
        raise InvalidMetadata(
            f"scrapeInterval is set, but {metric.value} is a GPU metric, read by the agents; it applies to engine "
            "signals only (docs/engines.md)"
        )
    target_from_shorthand = _shorthand_target(raw, metric)
    if target_from_shorthand is not None:
        metric = target_from_shorthand[0]

    if profile is not None and profile.metric == metric:
        aggregation, target = profile.aggregation, profile.target
        activation, deactivation = profile.activation_threshold, profile.deactivation_threshold
    else:
        defaults = METRICS[metric].defaults
        aggregation, target = defaults.aggregation, defaults.target
        activation = deactivation = defaults.activation_threshold
    window_seconds = profile.window_seconds if profile else None
    window_function = profile.window_function if profile else WindowFunction.AVG

    if target_from_shorthand is not None:
        target = target_from_shorthand[1]
    if "targetValue" in raw:
        target = _parse_target(raw)
    if "aggregation" in raw:
        aggregation = parse_enum("aggregation", raw["aggregation"], Aggregation)
    rule = _activation_rule(raw, activation, deactivation)
    if "window" in raw:
        window_seconds = _parse_window(raw["window"], limits)
    elif profile is not None and window_seconds is not None and window_seconds > limits.history_seconds:
        raise InvalidMetadata(
            f"profile {profile.name!r} averages over {format_duration(window_seconds)}, longer than this server's "
            f"--history of {format_duration(limits.history_seconds)}; set a shorter window or {RAISE_HISTORY}"
        )
    if "windowFunction" in raw:
        window_function = parse_enum("windowFunction", raw["windowFunction"], WindowFunction)
        if not METRICS[metric].takes_window_function and window_function is not WindowFunction.AVG:
            raise InvalidMetadata(
                f"windowFunction {raw['windowFunction']!r} does not apply to {metric.value}, which is the average over "
                "the window by definition (the energy used divided by the time); leave windowFunction out, or use "
                "power_draw for the highest reading"
            )
    if "pollIntervalSeconds" in raw:
        # Accepted for ScaledObjects written for the prior art; the agent's own loop sets the pace.
        parse_float("pollIntervalSeconds", raw["pollIntervalSeconds"], minimum=0.0, exclusive=True)

    selection = parse_selection(raw)
    if limits.cluster and selection.indices is not None:
        raise InvalidMetadata(
            f"gpuIndex {raw['gpuIndex']!r} names a GPU by its index on one node, and the gateway answers for "
            "every node, where indices repeat; select by gpuUUID, or by pod, workload or podSelector"
        )
    pods = parse_pods(raw, namespace)
    if scale_target_pods and not explicit:
        pods = scale_target_selection(raw, namespace, name)
    value = GpuQuery(
        metric=metric,
        aggregation=aggregation,
        selection=selection,
        window_seconds=window_seconds,
        window_function=window_function,
        pods=pods,
        min_nodes=parse_min_nodes(raw["minNodes"]) if "minNodes" in raw else None,
        max_unreadable=(
            parse_max_unreadable(raw["maxUnreadable"]) if "maxUnreadable" in raw else DEFAULT_MAX_UNREADABLE
        ),
        scale_target_ignored=scale_target_pods and bool(explicit),
    )
    metric_name = parse_metric_name(raw["metricName"]) if "metricName" in raw else default_metric_name(value)
    return Query(
        value=value, activation=rule, target=target, metric_name=metric_name, profile=profile.name if profile else None
    )


def _parse_target(raw: Mapping[str, str]) -> float:
    return parse_float("targetValue", raw["targetValue"], minimum=MIN_TARGET, maximum=MAX_TARGET)


def _activation_rule(raw: Mapping[str, str], activation: float, deactivation: float) -> ActivationRule:
    if "activationThreshold" in raw:
        activation = parse_float("activationThreshold", raw["activationThreshold"], minimum=0.0)
        # Without its own deactivationThreshold, hysteresis is off: both thresholds are the same.
        deactivation = activation
    if "deactivationThreshold" in raw:
        deactivation = parse_float("deactivationThreshold", raw["deactivationThreshold"], minimum=0.0)
    if deactivation > activation:
        raise InvalidMetadata(
            f"deactivationThreshold {format_number(deactivation)} is above activationThreshold "
            f"{format_number(activation)}; "
            "it must be <= activationThreshold (the value falls below it to deactivate)"
        )
    return ActivationRule(activation, deactivation)


def _engine_signal_on_an_agent(metric: EngineMetric, context: str = "") -> Unsupported:
    """The one refusal of an engine signal at a node agent, at every call (GetMetricSpec first, so that KEDA makes no
    HPA for it): where the signal is read, what the query needs, and the address to ask instead."""
    return Unsupported(
        f"{metric.value} is an engine signal{f' ({context})' if context else ''}: the gateway reads it from the "
        "metrics pages of the workload's own pods, and this server is a node agent, which reads its node's GPUs "
        "only. Set scalerAddress to the gateway, the chart's Service gpuscaler.<namespace>.svc.cluster.local:6000 "
        "(gpuscaler.gpuscaler.svc.cluster.local:6000 as installed in the README), and select the pods with "
        "workload, podSelector or pod, or scaleTargetPods: 'true' (docs/engines.md)"
    )


def _engine_query(
    raw: Mapping[str, str],
    namespace: str,
    name: str,
    metric: EngineMetric,
    profile: SignalProfile | None,
    limits: Limits,
) -> Query:
    """An engine signal's query (``query.EngineQuery``): the signal's defaults, its profile's, then the keys."""
    refuse_gpu_keys(raw, f"engine signal {metric.value}")
    signal = ENGINE_SIGNALS[metric]
    target, activation, deactivation = signal.target, signal.activation_threshold, signal.activation_threshold
    if profile is not None and profile.signals[0][0] == metric:
        target, activation, deactivation = (
            profile.signals[0][1],
            profile.activation_threshold,
            profile.deactivation_threshold,
        )
    if "targetValue" in raw:
        target = _parse_target(raw)
    aggregation = (
        parse_enum("aggregation", raw["aggregation"], Aggregation) if "aggregation" in raw else signal.aggregation
    )
    if signal.pods is not None and aggregation is Aggregation.SUM:
        raise InvalidMetadata(
            f"aggregation 'sum' is not allowed for {metric.value}: every EPP pod reports the same pool's value, and "
            f"a sum would count the pool once per pod; use {signal.pods.value} (its default) or avg"
        )
    value = EngineQuery(
        metric=metric,
        pods=engine_pods(raw, namespace, name, f"engine signal {metric.value}"),
        aggregation=aggregation,
        interval_seconds=parse_scrape_interval(raw, limits.min_scrape_seconds),
        pool=parse_pool(raw, metric),
    )
    return Query(
        value=value,
        activation=_activation_rule(raw, activation, deactivation),
        target=target,
        metric_name=parse_metric_name(raw["metricName"]) if "metricName" in raw else digest_name(value),
        profile=profile.name if profile else None,
    )


def _combined_query(
    raw: Mapping[str, str], limits: Limits, namespace: str, name: str, profile: SignalProfile | None
) -> Query:
    """Several signals, each asking for replicas (``query.CombinedQuery``); the target is 1 replica."""
    for key in (
        "metric",
        "metricType",
        "targetValue",
        "aggregation",
        "targetGpuUtilization",
        "targetMemoryUtilization",
    ):
        if key in raw:
            reason = (
                "each signal carries its own target in signals, and the answer is in replicas (target 1)"
                if key != "metric" and key != "metricType"
                else "signals names the metrics"
            )
            raise InvalidMetadata(f"keys {key!r} and 'signals' are both set; {reason}: leave {key} out")
    pairs = parse_signal_targets(raw["signals"]) if "signals" in raw else profile.signals if profile else ()
    pooled = [m for m, _ in pairs if isinstance(m, EngineMetric) and ENGINE_SIGNALS[m].pool_label is not None]
    if not pooled:
        refuse_pool_key(raw, "signals " + describe_targets(pairs) + ", which reads no pool-labelled signal")
    engine_read = [metric for metric, _ in pairs if isinstance(metric, EngineMetric)]
    if engine_read and not limits.reads_engines:
        raise _engine_signal_on_an_agent(engine_read[0], f"signals {describe_targets(pairs)!r} include it")
    what = "signals " + describe_targets(pairs)
    pods = engine_pods(raw, namespace, name, what) if engine_read else selected_pods(raw, namespace, name)
    interval = parse_scrape_interval(raw, limits.min_scrape_seconds)
    window = _parse_window(raw["window"], limits) if "window" in raw else None
    parts: list[SignalTarget] = []
    for metric, target in pairs:
        part: GpuQuery | EngineQuery
        if isinstance(metric, EngineMetric):
            assert pods is not None
            # inferencePool applies to the EPP's pool-labelled signals; its running requests have no pool label.
            pool = parse_pool(raw, metric) if metric in pooled else None
            part = EngineQuery(
                metric=metric, pods=pods, aggregation=Aggregation.SUM, interval_seconds=interval, pool=pool
            )
        else:
            # Summed over the pods (or GPUs): ready pods x average, the HPA's utilisation rule (docs/hpa.md).
            part = GpuQuery(
                metric=metric,
                aggregation=Aggregation.SUM,
                selection=GpuSelection(),
                window_seconds=window,
                window_function=WindowFunction.AVG,
                pods=pods,
            )
        parts.append(SignalTarget(part, target))
    value = CombinedQuery(tuple(parts))
    activation = profile.activation_threshold if profile else 0.0
    deactivation = profile.deactivation_threshold if profile else 0.0
    return Query(
        value=value,
        activation=_activation_rule(raw, activation, deactivation),
        target=1.0,
        metric_name=parse_metric_name(raw["metricName"]) if "metricName" in raw else digest_name(value),
        profile=profile.name if profile else None,
    )


# How to get a longer window, as a refusal says it: the flag, and the chart values that set it.
RAISE_HISTORY = "raise --history (the chart's agent.history, or gateway.history behind the gateway)"
# The HPA's metric types, which KEDA takes as the trigger's own metricType field beside `metadata:`.
HPA_METRIC_TYPES = ("AverageValue", "Value", "Utilization")


def _parse_metric(raw: Mapping[str, str], default: AnyMetric) -> AnyMetric:
    for key in ("metric", "metricType"):
        if key in raw:
            if key == "metricType" and raw[key].strip() in HPA_METRIC_TYPES:
                raise InvalidMetadata(
                    f"metricType {raw[key]!r} in metadata is not the HPA's metric type: set metricType: "
                    f"{raw[key].strip()} on the trigger itself, beside metadata: (docs/hpa.md). In metadata, "
                    "metricType is an alias of metric: use one of: " + ", ".join(metric.value for metric in Metric)
                )
            return parse_any_metric(key, raw[key])
    return default


_SHORTHANDS = {
    "targetGpuUtilization": Metric.GPU_UTILIZATION,
    "targetMemoryUtilization": Metric.MEMORY_UTILIZATION,
}


def _shorthand_target(raw: Mapping[str, str], chosen: Metric) -> tuple[Metric, float] | None:
    for key, metric in _SHORTHANDS.items():
        if key not in raw:
            continue
        named = "metric" in raw or "metricType" in raw
        if named and chosen != metric:
            raise InvalidMetadata(
                f"{key} sets the metric to {metric.value!r}, but metric is {chosen.value!r}; "
                f"drop one, or use targetValue"
            )
        if "targetValue" in raw:
            raise InvalidMetadata(f"keys {key!r} and 'targetValue' are both set; set one target")
        return metric, parse_float(key, raw[key], minimum=MIN_TARGET, maximum=MAX_TARGET)
    return None


def _parse_window(text: str, limits: Limits) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError as error:
        raise InvalidMetadata(f"window {error}") from None
    if seconds <= 0:
        raise InvalidMetadata(f"window {text!r} must be longer than 0; leave it out to use the latest sample")
    if seconds > limits.history_seconds:
        history = format_duration(limits.history_seconds)
        raise InvalidMetadata(
            # "this server": an agent or the gateway, each with its own --history.
            f"window {text!r} is longer than this server's --history of {history}; use a window of at most {history}, "
            f"or {RAISE_HISTORY}"
        )
    return seconds
