"""parse_metadata: trigger metadata to a Query, or INVALID_ARGUMENT naming the key, the value and what is allowed."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.keys import asks_in_scaled_object_namespace
from gpuscaler.query.metadata import MAX_TARGET, Limits, parse_metadata
from gpuscaler.query.query import DEFAULT_MAX_UNREADABLE, ActivationRule, GpuSelection, UnreadableTolerance
from tests.builders import GpuTrigger, gpu_trigger

LIMITS = Limits(history_seconds=600.0)  # the agent's default --history 10m
URL_SAFE_LOWERCASE = re.compile(r"^[a-z0-9][a-z0-9._-]*[a-z0-9]$")


def parse(metadata: dict[str, str]) -> GpuTrigger:
    """Parse ``metadata`` as an agent does, with its default --history of 10m."""
    return gpu_trigger(parse_metadata(metadata, LIMITS))


def refusal(metadata: dict[str, str]) -> str:
    """The message of the InvalidMetadata that ``metadata`` is refused with."""
    with pytest.raises(InvalidMetadata) as caught:
        parse(metadata)
    return caught.value.message


def test_no_keys_give_the_documented_defaults() -> None:
    """No metadata means the sum of gpu_utilization over every GPU, target 70, active above 5, latest sample."""
    query = parse({})
    assert query.value.metric is Metric.GPU_UTILIZATION
    assert query.value.aggregation is Aggregation.SUM
    assert query.value.selection == GpuSelection()
    assert query.value.selection.everything
    assert query.value.window_seconds is None
    assert query.value.window_function is WindowFunction.AVG
    assert query.target == 70.0
    assert query.activation == ActivationRule(5.0, 5.0)
    assert query.profile is None
    assert query.metric_name == "gpuscaler-gpu_utilization-sum"
    assert query.value.max_unreadable == DEFAULT_MAX_UNREADABLE == UnreadableTolerance(fraction=0.05)


@pytest.mark.parametrize(
    ("metric", "aggregation", "target", "activation"),
    [
        pytest.param("gpu_utilization", Aggregation.SUM, 70.0, 5.0, id="gpu_utilization"),
        pytest.param("memory_utilization", Aggregation.SUM, 60.0, 5.0, id="memory_utilization"),
        pytest.param("memory_used_percent", Aggregation.SUM, 80.0, 1.0, id="memory_used_percent"),
        pytest.param("temperature", Aggregation.MAX, 80.0, 0.0, id="temperature"),
        pytest.param("power_draw", Aggregation.SUM, 300.0, 0.0, id="power_draw"),
        pytest.param("power_percent", Aggregation.SUM, 70.0, 0.0, id="power_percent"),
        pytest.param("pcie_tx", Aggregation.SUM, 10000.0, 1000.0, id="pcie_tx"),
        pytest.param("pcie_rx", Aggregation.SUM, 10000.0, 1000.0, id="pcie_rx"),
        pytest.param("nvlink_tx", Aggregation.SUM, 50000.0, 5000.0, id="nvlink_tx"),
        pytest.param("nvlink_rx", Aggregation.SUM, 50000.0, 5000.0, id="nvlink_rx"),
    ],
)
def test_each_metric_has_its_own_defaults(
    metric: str, aggregation: Aggregation, target: float, activation: float
) -> None:
    """Naming only a metric gives that metric's aggregation, target and (equal) thresholds."""
    for key in ("metric", "metricType"):
        query = parse({key: metric})
        assert query.value.metric == Metric(metric)
        assert query.value.aggregation is aggregation
        assert query.target == target
        assert query.activation == ActivationRule(activation, activation)


Check = Callable[[GpuTrigger], object]

EVERY_KEY: list[tuple[dict[str, str], Check, object]] = [
    ({"metric": "temperature"}, lambda q: q.value.metric, Metric.TEMPERATURE),
    ({"metricType": "power_draw"}, lambda q: q.value.metric, Metric.POWER_DRAW),
    ({"metric": " power_percent "}, lambda q: q.value.metric, Metric.POWER_PERCENT),
    ({"targetValue": "50"}, lambda q: q.target, 50.0),
    ({"targetValue": " 42.5 "}, lambda q: q.target, 42.5),
    ({"targetValue": "0.001"}, lambda q: q.target, 0.001),
    ({"targetValue": "1e3"}, lambda q: q.target, 1000.0),
    (
        {"targetGpuUtilization": "80"},
        lambda q: (q.value.metric, q.target, q.value.aggregation),
        (Metric.GPU_UTILIZATION, 80.0, Aggregation.SUM),
    ),
    (
        {"targetMemoryUtilization": "50"},
        lambda q: (q.value.metric, q.target, q.value.aggregation, q.activation),
        (Metric.MEMORY_UTILIZATION, 50.0, Aggregation.SUM, ActivationRule(5.0, 5.0)),
    ),
    ({"metric": "gpu_utilization", "targetGpuUtilization": "80"}, lambda q: q.target, 80.0),
    ({"metricType": "memory_utilization", "targetMemoryUtilization": "40"}, lambda q: q.target, 40.0),
    ({"activationThreshold": "20"}, lambda q: q.activation, ActivationRule(20.0, 20.0)),
    ({"activationThreshold": "0"}, lambda q: q.activation, ActivationRule(0.0, 0.0)),
    ({"activationThreshold": "20", "deactivationThreshold": "10"}, lambda q: q.activation, ActivationRule(20.0, 10.0)),
    ({"activationThreshold": "20", "deactivationThreshold": "20"}, lambda q: q.activation, ActivationRule(20.0, 20.0)),
    ({"deactivationThreshold": "2"}, lambda q: q.activation, ActivationRule(5.0, 2.0)),
    ({"deactivationThreshold": "0"}, lambda q: q.activation, ActivationRule(5.0, 0.0)),
    ({"gpuIndex": "2"}, lambda q: q.value.selection, GpuSelection(indices=(2,))),
    ({"gpuIndex": "3,0,3"}, lambda q: q.value.selection, GpuSelection(indices=(0, 3))),
    ({"gpuIndex": " 0 , 1 "}, lambda q: q.value.selection, GpuSelection(indices=(0, 1))),
    ({"gpuIndex": "-1"}, lambda q: q.value.selection, GpuSelection()),
    ({"gpuUUID": "GPU-aaa"}, lambda q: q.value.selection, GpuSelection(uuids=("GPU-aaa",))),
    ({"gpuUUID": "GPU-bbb, GPU-aaa"}, lambda q: q.value.selection, GpuSelection(uuids=("GPU-aaa", "GPU-bbb"))),
    ({"gpuUUID": "GPU-aaa,gpu-AAA"}, lambda q: q.value.selection, GpuSelection(uuids=("GPU-aaa",))),
    ({"window": "30s"}, lambda q: (q.value.window_seconds, q.value.window_function), (30.0, WindowFunction.AVG)),
    ({"window": "2m"}, lambda q: q.value.window_seconds, 120.0),
    ({"window": "500ms"}, lambda q: q.value.window_seconds, 0.5),
    ({"window": "10m"}, lambda q: q.value.window_seconds, 600.0),
    ({"window": "1m30s"}, lambda q: q.value.window_seconds, 90.0),
    ({"window": "30s", "windowFunction": "max"}, lambda q: q.value.window_function, WindowFunction.MAX),
    ({"window": "30s", "windowFunction": "last"}, lambda q: q.value.window_function, WindowFunction.LAST),
    ({"metricName": "my-gpu.util_1"}, lambda q: q.metric_name, "my-gpu.util_1"),
    ({"metricName": "a"}, lambda q: q.metric_name, "a"),
    ({"metricName": "a" * 100}, lambda q: q.metric_name, "a" * 100),
    ({"profile": "training"}, lambda q: q.profile, "training"),
    ({"profile": " batch "}, lambda q: q.profile, "batch"),
    ({"maxUnreadable": "0"}, lambda q: q.value.max_unreadable, UnreadableTolerance(count=0)),
    ({"maxUnreadable": " 2 "}, lambda q: q.value.max_unreadable, UnreadableTolerance(count=2)),
    ({"maxUnreadable": "5%"}, lambda q: q.value.max_unreadable, UnreadableTolerance(fraction=0.05)),
    ({"maxUnreadable": "0%"}, lambda q: q.value.max_unreadable, UnreadableTolerance(fraction=0.0)),
    ({"maxUnreadable": "100%"}, lambda q: q.value.max_unreadable, UnreadableTolerance(fraction=1.0)),
    ({"maxUnreadable": "2", "namespace": "ml"}, lambda q: q.value.max_unreadable, UnreadableTolerance(count=2)),
    ({"maxUnreadable": "1"}, lambda q: q.metric_name, "gpuscaler-gpu_utilization-sum"),
    ({"pollIntervalSeconds": "15"}, lambda q: q, gpu_trigger(parse_metadata({}, LIMITS))),
    ({"pollIntervalSeconds": "0.5"}, lambda q: q, gpu_trigger(parse_metadata({}, LIMITS))),
]


@pytest.mark.parametrize(
    ("metadata", "check", "expected"),
    [pytest.param(m, c, e, id=",".join(f"{k}={v}" for k, v in m.items())) for m, c, e in EVERY_KEY],
)
def test_every_key_sets_what_it_names(metadata: dict[str, str], check: Check, expected: object) -> None:
    """Each key (and its accepted spellings) sets the part of the query it names."""
    assert check(parse(metadata)) == expected


@pytest.mark.parametrize("aggregation", list(Aggregation), ids=str)
def test_every_aggregation_is_accepted(aggregation: Aggregation) -> None:
    """Each documented aggregation, percentiles included, is accepted by its name."""
    assert parse({"aggregation": aggregation.value}).value.aggregation is aggregation


@pytest.mark.parametrize(
    ("metadata", "check", "expected"),
    [
        pytest.param({"targetValueFromEnv": "50"}, lambda q: q.target, 50.0, id="targetValueFromEnv"),
        pytest.param({"metricFromEnv": "temperature"}, lambda q: q.value.metric, Metric.TEMPERATURE, id="metric"),
        pytest.param({"metricTypeFromEnv": "power_draw"}, lambda q: q.value.metric, Metric.POWER_DRAW, id="alias"),
        pytest.param({"profileFromEnv": "batch"}, lambda q: q.profile, "batch", id="profileFromEnv"),
        pytest.param(
            {"gpuIndexFromEnv": "1"}, lambda q: q.value.selection, GpuSelection(indices=(1,)), id="gpuIndexFromEnv"
        ),
        pytest.param({"windowFromEnv": "1m"}, lambda q: q.value.window_seconds, 60.0, id="windowFromEnv"),
        pytest.param({"targetGpuUtilizationFromEnv": "85"}, lambda q: q.target, 85.0, id="targetGpuUtilizationFromEnv"),
        pytest.param({"metricNameFromEnv": "from-env"}, lambda q: q.metric_name, "from-env", id="metricNameFromEnv"),
    ],
)
def test_from_env_keys_are_read_as_the_key(metadata: dict[str, str], check: Check, expected: object) -> None:
    """`<key>FromEnv` (resolved by KEDA from the workload's env) means exactly `<key>`."""
    assert check(parse(metadata)) == expected


def test_from_env_values_are_checked_under_the_key_name() -> None:
    """A bad `<key>FromEnv` value is refused like a bad `<key>` value."""
    message = refusal({"targetValueFromEnv": "abc"})
    assert "targetValue" in message
    assert "'abc'" in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        pytest.param("scalerAddress", "gpuscaler.gpuscaler.svc:6000", id="scalerAddress"),
        pytest.param("enableTLS", "true", id="enableTLS"),
        pytest.param("unsafeSsl", "false", id="unsafeSsl"),
        pytest.param("caCert", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----", id="caCert"),
        pytest.param("tlsClientCert", "-----BEGIN CERTIFICATE-----", id="tlsClientCert"),
        pytest.param("tlsClientKey", "-----BEGIN PRIVATE KEY-----", id="tlsClientKey"),
        pytest.param("tlsCertFile", "/etc/tls/tls.crt", id="tlsCertFile"),
        pytest.param("enableTLS", "banana", id="enableTLS-not-ours-to-check"),
        pytest.param("scalerAddressFromEnv", "x:1", id="scalerAddressFromEnv"),
    ],
)
def test_keda_keys_are_accepted_and_ignored(key: str, value: str) -> None:
    """KEDA's own trigger keys reach the scaler; they change nothing in the query and are never refused."""
    assert parse({key: value}) == parse({})
    assert parse({key: value, "metric": "temperature"}) == parse({"metric": "temperature"})


@pytest.mark.parametrize(
    ("key", "message"),
    [
        pytest.param(
            "activationTreshold", "unknown key 'activationTreshold'; did you mean 'activationThreshold'?", id="typo"
        ),
        pytest.param("targetvalue", "unknown key 'targetvalue'; did you mean 'targetValue'?", id="case"),
        pytest.param("gpuIndx", "unknown key 'gpuIndx'; did you mean 'gpuIndex'?", id="gpuIndx"),
        pytest.param("gpuUuid", "unknown key 'gpuUuid'; did you mean 'gpuUUID'?", id="gpuUuid"),
        pytest.param("metricname", "unknown key 'metricname'; did you mean 'metricName'?", id="metricname"),
        pytest.param(
            "deactivationThresold",
            "unknown key 'deactivationThresold'; did you mean 'deactivationThreshold'?",
            id="deactivation",
        ),
        pytest.param("windowFunc", "unknown key 'windowFunc'; did you mean 'windowFunction'?", id="windowFunc"),
        pytest.param("agregation", "unknown key 'agregation'; did you mean 'aggregation'?", id="agregation"),
    ],
)
def test_unknown_key_names_the_closest_known_one(key: str, message: str) -> None:
    """A misspelt key is INVALID_ARGUMENT naming it and the key that was meant."""
    assert refusal({key: "1"}) == message


@pytest.mark.parametrize("key", ["zzz", "fooFromEnv", "query"])
def test_unknown_key_without_a_close_one_lists_the_known_keys(key: str) -> None:
    """A key like no known one is refused with the list of keys that are known."""
    message = refusal({key: "1"})
    assert message.startswith(f"unknown key {key!r}; known keys: ")
    for known in ("profile", "metric", "targetValue", "activationThreshold", "gpuUUID", "window", "metricName"):
        assert known in message


def test_unknown_key_is_refused_even_beside_valid_ones() -> None:
    """One unknown key fails the whole trigger, so a typo is never silently ignored."""
    assert "activationTreshold" in refusal({"metric": "gpu_utilization", "activationTreshold": "10"})


@pytest.mark.parametrize(
    ("metadata", "fragments"),
    [
        pytest.param({"metric": "temperature", "metricType": "temperature"}, ["'metric'", "'metricType'"], id="alias"),
        pytest.param({"metricFromEnv": "temperature", "metricType": "temperature"}, ["'metricType'"], id="alias-env"),
        pytest.param(
            {"targetValue": "1", "targetValueFromEnv": "2"}, ["'targetValue'", "'targetValueFromEnv'"], id="from-env"
        ),
        pytest.param(
            {"metric": "temperature", "targetGpuUtilization": "80"},
            ["targetGpuUtilization", "'gpu_utilization'", "'temperature'"],
            id="shorthand-vs-metric",
        ),
        pytest.param(
            {"metricType": "gpu_utilization", "targetMemoryUtilization": "80"},
            ["targetMemoryUtilization", "'memory_utilization'", "'gpu_utilization'"],
            id="shorthand-vs-metricType",
        ),
        pytest.param(
            {"targetGpuUtilization": "80", "targetValue": "70"},
            ["'targetGpuUtilization'", "'targetValue'"],
            id="shorthand-vs-targetValue",
        ),
        pytest.param(
            {"targetGpuUtilization": "80", "targetMemoryUtilization": "70"},
            ["'targetGpuUtilization'", "'targetMemoryUtilization'"],
            id="two-shorthands",
        ),
        pytest.param({"gpuIndex": "0", "gpuUUID": "GPU-a"}, ["'gpuIndex'", "'gpuUUID'"], id="index-and-uuid"),
        pytest.param(
            {"gpuUUID": "GPU-a", "maxUnreadable": "1"},
            ["'maxUnreadable'", "'gpuUUID'", "must all be readable"],
            id="tolerance-and-uuid",
        ),
        pytest.param(
            {"gpuIndex": "0", "maxUnreadable": "0"}, ["'maxUnreadable'", "'gpuIndex'"], id="tolerance-and-index"
        ),
    ],
)
def test_conflicting_keys_are_refused(metadata: dict[str, str], fragments: list[str]) -> None:
    """Two keys that set the same thing are refused, naming both."""
    message = refusal(metadata)
    for fragment in fragments:
        assert fragment in message


BAD_VALUES: list[tuple[str, str, str]] = [
    # (key, value, what the message says is allowed)
    ("targetValue", "nan", "finite"),
    ("targetValue", "inf", "finite"),
    ("targetValue", "-inf", "finite"),
    ("targetValue", "-1", ">= 0.001"),
    ("targetValue", "0", ">= 0.001"),
    ("targetValue", "0.0001", ">= 0.001"),
    ("targetValue", "", "use a decimal"),
    ("targetValue", "abc", "use a decimal"),
    ("targetValue", "70%", "use a decimal"),
    ("targetGpuUtilization", "0", ">= 0.001"),
    ("targetGpuUtilization", "nan", "finite"),
    ("targetGpuUtilization", "abc", "use a decimal"),
    ("targetMemoryUtilization", "-5", ">= 0.001"),
    ("activationThreshold", "-1", ">= 0"),
    ("activationThreshold", "nan", "finite"),
    ("activationThreshold", "inf", "finite"),
    ("activationThreshold", "abc", "use a decimal"),
    ("activationThreshold", "", "use a decimal"),
    ("deactivationThreshold", "-0.5", ">= 0"),
    ("deactivationThreshold", "x", "use a decimal"),
    ("pollIntervalSeconds", "0", "> 0"),
    ("pollIntervalSeconds", "-1", "> 0"),
    ("pollIntervalSeconds", "nan", "finite"),
    ("pollIntervalSeconds", "abc", "use a decimal"),
    ("profile", "vllm", "vllm-inference, triton-inference, training, batch"),
    ("profile", "", "vllm-inference, triton-inference, training, batch"),
    ("metric", "gpu", "gpu_utilization, memory_utilization, memory_used_percent, temperature, power_draw"),
    ("metric", "", "gpu_utilization"),
    ("metricType", "AverageValue", "gpu_utilization, memory_utilization"),
    ("aggregation", "mean", "max, min, avg, sum, median, p90, p95, p99"),
    ("aggregation", "p50", "max, min, avg, sum, median, p90, p95, p99"),
    ("aggregation", "", "max, min, avg, sum"),
    ("windowFunction", "median", "avg, max, min, last"),
    ("window", "", "ms, s, m or h"),
    ("window", "abc", "ms, s, m or h"),
    ("window", "-5s", "window '-5s' is negative; a duration must be positive, like '5s'"),
    ("window", "1d", "ms, s, m or h"),
    ("window", "30", "window '30' has no unit; write '30s' for seconds"),
    ("window", "30 s", "window '30 s' has a space in it; write '30s'"),
    ("window", "30S", "window '30S' has an upper-case unit; write '30s'"),
    ("window", "1e9s", "window '1e9s' has an exponent; write the number out"),
    ("window", "0s", "longer than 0"),
    ("window", "11m", "history of 10m; use a window of at most 10m, or raise --history"),
    ("window", "99999h", "history of 10m"),
    ("window", "1000000000s", "use a window of at most 10m"),
    ("gpuIndex", "-2", "integer >= 0, or -1 for all GPUs"),
    ("gpuIndex", "abc", "integer >= 0, or -1 for all GPUs"),
    ("gpuIndex", "1.5", "integer >= 0, or -1 for all GPUs"),
    ("gpuIndex", "0;1", "integer >= 0, or -1 for all GPUs"),
    ("gpuIndex", "0,,1", "comma-separated list"),
    ("gpuIndex", "", "comma-separated list"),
    ("gpuIndex", ",", "comma-separated list"),
    ("gpuIndex", "-1,0", "use -1 alone"),
    ("gpuUUID", "", "comma-separated list"),
    ("gpuUUID", " ", "comma-separated list"),
    ("gpuUUID", "GPU-a,,GPU-b", "comma-separated list"),
    ("metricName", "GPU-Util", "lowercase"),
    ("metricName", "gpu/util", "lowercase"),
    ("metricName", "", "lowercase"),
    ("metricName", "-gpu", "starting and ending with a letter or digit"),
    ("metricName", "gpu-", "starting and ending with a letter or digit"),
    ("metricName", "gpu util", "lowercase"),
    ("metricName", "gpu\n", "lowercase"),
    ("metricName", "a" * 101, "1-100"),
    ("maxUnreadable", "-1", "a GPU count like '0' or '2', or a share of the selected GPUs like '5%'"),
    ("maxUnreadable", "two", "a GPU count like '0' or '2', or a share of the selected GPUs like '5%'"),
    ("maxUnreadable", "", "a GPU count like '0' or '2'"),
    ("maxUnreadable", "1.5", "a GPU count like '0' or '2'"),
    ("maxUnreadable", "1000000", "a GPU count like '0' or '2'"),
    ("maxUnreadable", "100001", "a count must be from 0 to 100000"),
    ("maxUnreadable", "x%", "is not a number"),
    ("maxUnreadable", "101%", "a share must be from 0% to 100%"),
    ("maxUnreadable", "-5%", "a share must be from 0% to 100%"),
    ("maxUnreadable", "nan%", "a share must be from 0% to 100%"),
]


@pytest.mark.parametrize(
    ("key", "value", "allowed"), [pytest.param(k, v, a, id=f"{k}={v[:12]!r}") for k, v, a in BAD_VALUES]
)
def test_bad_value_names_key_value_and_what_is_allowed(key: str, value: str, allowed: str) -> None:
    """Every bad value is INVALID_ARGUMENT whose message names the key, the value and what is allowed."""
    message = refusal({key: value})
    assert key in message
    assert repr(value) in message
    assert allowed in message


@pytest.mark.parametrize(
    ("metadata", "activation", "deactivation"),
    [
        pytest.param({"activationThreshold": "5", "deactivationThreshold": "6"}, "5", "6", id="explicit"),
        pytest.param({"deactivationThreshold": "6"}, "5", "6", id="against-default"),
        pytest.param({"profile": "batch", "deactivationThreshold": "2"}, "1", "2", id="against-profile"),
    ],
)
def test_deactivation_above_activation_is_refused(metadata: dict[str, str], activation: str, deactivation: str) -> None:
    """deactivationThreshold must be <= activationThreshold; the message gives both and the rule."""
    message = refusal(metadata)
    assert f"deactivationThreshold {deactivation}" in message
    assert f"activationThreshold {activation}" in message
    assert "<= activationThreshold" in message


@pytest.mark.parametrize(
    ("profile", "target", "activation", "deactivation", "window", "function"),
    [
        pytest.param("vllm-inference", 70.0, 5.0, 1.0, 30.0, WindowFunction.AVG, id="vllm-inference"),
        pytest.param("triton-inference", 75.0, 10.0, 2.0, 15.0, WindowFunction.AVG, id="triton-inference"),
        pytest.param("training", 90.0, 10.0, 1.0, 120.0, WindowFunction.AVG, id="training"),
        pytest.param("batch", 85.0, 1.0, 0.0, 60.0, WindowFunction.MAX, id="batch"),
    ],
)
def test_profile_gives_its_documented_values(
    profile: str, target: float, activation: float, deactivation: float, window: float, function: WindowFunction
) -> None:
    """Each profile is the sum of gpu_utilization with its own target, hysteresis and window."""
    query = parse({"profile": profile})
    assert query.profile == profile
    assert query.value.metric is Metric.GPU_UTILIZATION
    assert query.value.aggregation is Aggregation.SUM
    assert query.value.selection.everything
    assert query.target == target
    assert query.activation == ActivationRule(activation, deactivation)
    assert query.value.window_seconds == window
    assert query.value.window_function is function


def test_distributed_training_sums_nvlink_tx_over_a_minute() -> None:
    """distributed-training is the sum of NVLink TX in MB/s, target 50000, active above 5000 until 500, 60 s avg."""
    query = parse({"profile": "distributed-training"})
    assert query.value.metric is Metric.NVLINK_TX
    assert query.value.aggregation is Aggregation.SUM
    assert query.target == 50000.0
    assert query.activation == ActivationRule(5000.0, 500.0)
    assert (query.value.window_seconds, query.value.window_function) == (60.0, WindowFunction.AVG)


@pytest.mark.parametrize(
    ("name", "metric"), [("nvlink_tx_mbps", Metric.NVLINK_TX), ("nvlink_rx_mbps", Metric.NVLINK_RX)]
)
def test_the_prior_arts_nvlink_names_are_our_nvlink_metrics(name: str, metric: Metric) -> None:
    """The prior art's nvlink_*_mbps (MB/s) mean nvlink_tx and nvlink_rx, same unit, same defaults."""
    for key in ("metric", "metricType"):
        query = parse({key: name, "targetValue": "20000"})
        assert query.value.metric is metric
        assert query.target == 20000.0
        assert query.activation == ActivationRule(5000.0, 5000.0)


@pytest.mark.parametrize(("name", "ours"), [("pcie_tx_kbps", "pcie_tx"), ("pcie_rx_kbps", "pcie_rx")])
def test_the_prior_arts_pcie_kilobyte_names_are_refused_with_the_conversion(name: str, ours: str) -> None:
    """pcie_*_kbps are refused, naming the key and value, and saying to use pcie_tx/pcie_rx in MB/s, target / 1000."""
    message = refusal({"metricType": name, "targetValue": "10000000"})
    assert f"metricType {name!r}" in message
    assert f"use metricType: {ours}, in MB/s" in message
    assert "target divided by 1000" in message


@pytest.mark.parametrize(
    ("metadata", "check", "expected"),
    [
        pytest.param({"targetValue": "50"}, lambda q: q.target, 50.0, id="targetValue"),
        pytest.param({"targetGpuUtilization": "60"}, lambda q: q.target, 60.0, id="targetGpuUtilization"),
        pytest.param({"aggregation": "max"}, lambda q: q.value.aggregation, Aggregation.MAX, id="aggregation"),
        pytest.param({"window": "30s"}, lambda q: q.value.window_seconds, 30.0, id="window"),
        pytest.param({"windowFunction": "max"}, lambda q: q.value.window_function, WindowFunction.MAX, id="wfn"),
        pytest.param({"deactivationThreshold": "5"}, lambda q: q.activation, ActivationRule(10.0, 5.0), id="deact"),
        # Without its own deactivationThreshold, the new activationThreshold is both (hysteresis off), so it
        # can never fall below the profile's deactivation and be refused for a key the user did not set.
        pytest.param({"activationThreshold": "0.5"}, lambda q: q.activation, ActivationRule(0.5, 0.5), id="act"),
        pytest.param(
            {"activationThreshold": "20", "deactivationThreshold": "15"},
            lambda q: q.activation,
            ActivationRule(20.0, 15.0),
            id="both-thresholds",
        ),
        pytest.param({"gpuIndex": "1"}, lambda q: q.value.selection, GpuSelection(indices=(1,)), id="gpuIndex"),
        pytest.param({"metricName": "train"}, lambda q: q.metric_name, "train", id="metricName"),
    ],
)
def test_any_key_overrides_the_profile(metadata: dict[str, str], check: Check, expected: object) -> None:
    """A key set beside a profile wins over the profile's value; the rest of the profile stays."""
    query = parse({"profile": "training", **metadata})
    assert check(query) == expected
    assert query.profile == "training"
    assert query.value.metric is Metric.GPU_UTILIZATION


@pytest.mark.parametrize(
    ("metadata", "metric", "aggregation", "target", "activation"),
    [
        pytest.param(
            {"profile": "training", "metric": "power_draw"}, Metric.POWER_DRAW, Aggregation.SUM, 300.0, 0.0, id="watts"
        ),
        pytest.param(
            {"profile": "vllm-inference", "metricType": "temperature"},
            Metric.TEMPERATURE,
            Aggregation.MAX,
            80.0,
            0.0,
            id="temperature",
        ),
        pytest.param(
            {"profile": "batch", "targetMemoryUtilization": "50"},
            Metric.MEMORY_UTILIZATION,
            Aggregation.SUM,
            50.0,
            5.0,
            id="shorthand",
        ),
        pytest.param(
            {"profile": "triton-inference", "metric": "memory_used_percent"},
            Metric.MEMORY_USED_PERCENT,
            Aggregation.SUM,
            80.0,
            1.0,
            id="memory_used_percent",
        ),
    ],
)
def test_profile_with_another_metric_takes_that_metrics_defaults(
    metadata: dict[str, str], metric: Metric, aggregation: Aggregation, target: float, activation: float
) -> None:
    """A profile's target, thresholds and aggregation belong to its metric, so another metric uses its own."""
    query = parse(metadata)
    assert query.value.metric is metric
    assert query.value.aggregation is aggregation
    assert query.target == target
    assert query.activation == ActivationRule(activation, activation)
    assert query.value.window_seconds == parse({"profile": metadata["profile"]}).value.window_seconds


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="alone"),
        pytest.param({"targetValue": "50"}, id="targetValue"),
        pytest.param({"aggregation": "max"}, id="aggregation"),
        pytest.param({"window": "1m"}, id="window"),
        pytest.param({"gpuIndex": "0"}, id="gpuIndex"),
    ],
)
def test_vllm_inference_never_uses_a_memory_metric(extra: dict[str, str]) -> None:
    """vLLM pre-allocates VRAM, so its profile reads SM busy time, whatever other keys are set."""
    metric = parse({"profile": "vllm-inference", **extra}).value.metric
    assert metric is Metric.GPU_UTILIZATION
    assert metric not in (Metric.MEMORY_UTILIZATION, Metric.MEMORY_USED_PERCENT)


@pytest.mark.parametrize(
    ("metadata", "name"),
    [
        pytest.param({}, "gpuscaler-gpu_utilization-sum", id="defaults"),
        pytest.param({"metric": "temperature"}, "gpuscaler-temperature-max", id="temperature"),
        pytest.param({"aggregation": "p90"}, "gpuscaler-gpu_utilization-p90", id="p90"),
        pytest.param({"gpuIndex": "2,0"}, "gpuscaler-gpu_utilization-sum-gpu0-2", id="indices"),
        pytest.param({"window": "30s"}, "gpuscaler-gpu_utilization-sum-avg30s", id="window"),
        pytest.param({"window": "1.5s"}, "gpuscaler-gpu_utilization-sum-avg1_5s", id="fractional-window"),
        pytest.param({"window": "500ms", "windowFunction": "max"}, "gpuscaler-gpu_utilization-sum-max500ms", id="ms"),
        pytest.param({"profile": "training"}, "gpuscaler-gpu_utilization-sum-avg2m", id="training"),
        pytest.param({"profile": "batch"}, "gpuscaler-gpu_utilization-sum-max1m", id="batch"),
    ],
)
def test_default_metric_names_are_stable(metadata: dict[str, str], name: str) -> None:
    """The default metric name is a fixed function of the value's meaning (KEDA and the HPA store it)."""
    assert parse(metadata).metric_name == name


@pytest.mark.parametrize(
    ("window", "name"),
    [
        pytest.param("1234567ms", "gpuscaler-gpu_utilization-sum-avg1234_57s", id="seconds"),
        pytest.param("0.1234567s", "gpuscaler-gpu_utilization-sum-avg123_457ms", id="sub-ms"),
    ],
)
def test_a_window_of_seven_significant_digits_keeps_its_name_from_before_durations_were_strict(
    window: str, name: str
) -> None:
    """A window that format_duration spells with every digit is named with 6 significant digits, as before."""
    assert gpu_trigger(parse_metadata({"window": window}, Limits(history_seconds=86400))).metric_name == name


NAMED_QUERIES: list[dict[str, str]] = [
    {},
    {"metric": "memory_used_percent"},
    {"metric": "power_percent", "aggregation": "median"},
    {"gpuIndex": "0,1,7"},
    {"gpuUUID": "GPU-5C1F0A2B-AAAA-BBBB-CCCC-0123456789AB,MIG-Deadbeef"},
    {"window": "1.25s"},
    {"window": "90s", "windowFunction": "last"},
    {"window": "10m"},
    {"profile": "vllm-inference"},
    {"profile": "triton-inference"},
    {"profile": "training"},
    {"profile": "batch"},
]


@pytest.mark.parametrize("metadata", NAMED_QUERIES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "{}")
def test_default_metric_names_are_lowercase_and_url_safe(metadata: dict[str, str]) -> None:
    """Default names are lowercase letters, digits, '-', '_' only, as KEDA puts them in a URL path."""
    name = parse(metadata).metric_name
    assert URL_SAFE_LOWERCASE.match(name)
    assert name == name.lower()
    assert "." not in name
    assert "/" not in name


@pytest.mark.parametrize(
    ("left", "right"),
    [
        pytest.param({}, {"metric": "memory_utilization"}, id="metric"),
        pytest.param({}, {"aggregation": "max"}, id="aggregation"),
        pytest.param({"aggregation": "p95"}, {"aggregation": "p99"}, id="percentile"),
        pytest.param({}, {"gpuIndex": "0"}, id="all-vs-one"),
        pytest.param({"gpuIndex": "0"}, {"gpuIndex": "1"}, id="index"),
        pytest.param({"gpuIndex": "0,1"}, {"gpuIndex": "0,1,2"}, id="indices"),
        pytest.param({"gpuIndex": "12"}, {"gpuIndex": "1,2"}, id="index-digits"),
        pytest.param({"gpuUUID": "GPU-a"}, {"gpuUUID": "GPU-b"}, id="uuid"),
        pytest.param({}, {"gpuUUID": "GPU-a"}, id="all-vs-uuid"),
        pytest.param({}, {"window": "30s"}, id="latest-vs-window"),
        pytest.param({"window": "30s"}, {"window": "60s"}, id="window"),
        pytest.param({"window": "30s"}, {"window": "30s", "windowFunction": "max"}, id="window-function"),
        pytest.param({"profile": "vllm-inference"}, {"profile": "triton-inference"}, id="profiles"),
    ],
)
def test_default_metric_names_differ_when_the_value_differs(left: dict[str, str], right: dict[str, str]) -> None:
    """Two triggers whose values mean different things never share a default metric name."""
    assert parse(left).metric_name != parse(right).metric_name


@pytest.mark.parametrize(
    ("left", "right"),
    [
        pytest.param({}, {"gpuIndex": "-1"}, id="all-gpus"),
        pytest.param({"gpuIndex": "0,1"}, {"gpuIndex": "1,0,1"}, id="index-order"),
        pytest.param({"gpuUUID": "GPU-a,GPU-b"}, {"gpuUUID": "GPU-b,GPU-a"}, id="uuid-order"),
        pytest.param({"gpuUUID": "GPU-a"}, {"gpuUUID": "gpu-A"}, id="uuid-case"),
        pytest.param({"window": "60s"}, {"window": "1m"}, id="window-spelling"),
        pytest.param({}, {"metricType": "gpu_utilization"}, id="alias"),
        pytest.param({}, {"targetValue": "10"}, id="target"),
        pytest.param({}, {"activationThreshold": "50", "deactivationThreshold": "1"}, id="thresholds"),
        pytest.param({}, {"windowFunction": "max"}, id="window-function-without-window"),
        pytest.param(
            {"profile": "training"},
            {"window": "2m", "targetValue": "90", "activationThreshold": "10", "deactivationThreshold": "1"},
            id="profile-vs-spelled-out",
        ),
        pytest.param({"metric": "temperature"}, {"metric": "temperature", "aggregation": "max"}, id="default-agg"),
    ],
)
def test_default_metric_names_match_when_the_value_does(left: dict[str, str], right: dict[str, str]) -> None:
    """Triggers whose values mean the same get the same default name, however they were written."""
    assert parse(left).metric_name == parse(right).metric_name


@pytest.mark.parametrize(
    ("metadata", "asks"),
    [
        pytest.param({"workload": "trainer"}, True, id="workload"),
        pytest.param({"pod": "trainer-0"}, True, id="pod"),
        pytest.param({"podSelector": "app=trainer"}, True, id="pod-selector"),
        pytest.param({"workloadFromEnv": "trainer"}, True, id="workload-from-env"),
        pytest.param({"workload": "trainer", "namespace": "ml"}, False, id="namespace"),
        pytest.param({"workload": "trainer", "namespaceFromEnv": "ml"}, False, id="namespace-from-env"),
        pytest.param({"scaleTargetPods": "true"}, False, id="scale-target-pods"),
        pytest.param({"gpuIndex": "0"}, False, id="gpus"),
    ],
)
def test_a_pod_selection_without_a_namespace_asks_in_the_scaled_objects(metadata: dict[str, str], asks: bool) -> None:
    """A pod, workload or label selection, as written or from the environment, without a namespace of either kind,
    takes the ScaledObject's namespace, as the server reads it."""
    assert asks_in_scaled_object_namespace(metadata) is asks
    pods = gpu_trigger(parse_metadata(metadata, LIMITS, namespace="so-ns", name="so")).value.pods
    assert (pods is not None and pods.namespace == "so-ns" and pods.scale_target is None) is asks


def test_equal_selections_are_one_query() -> None:
    """UUIDs in another order or case select the same GPUs, so they share one evaluation."""
    assert parse({"gpuUUID": "GPU-a,GPU-b"}).value == parse({"gpuUUID": "GPU-b,GPU-a"}).value


def test_profile_window_longer_than_history_is_refused() -> None:
    """A profile whose window the agent's history cannot hold is refused, naming the profile and --history."""
    with pytest.raises(InvalidMetadata) as raised:
        gpu_trigger(parse_metadata({"profile": "training"}, Limits(history_seconds=60)))
    assert "profile 'training'" in raised.value.message
    assert "--history" in raised.value.message


@pytest.mark.parametrize("key", ["targetValue", "targetGpuUtilization"])
def test_a_target_keda_cannot_hold_is_refused_naming_the_bound(key: str) -> None:
    """KEDA keeps a target as int64 thousandths: up to MAX_TARGET is taken, above it refused with the bound."""
    assert parse({key: str(MAX_TARGET - 1)}).target == MAX_TARGET - 1  # the bound itself is no float64
    message = refusal({key: "1e308"})
    assert message.startswith(f"{key} '1e308' is out of range")
    assert f"<= {MAX_TARGET:,}" in message


@pytest.mark.parametrize("kind", ["Value", "AverageValue", "Utilization"])
def test_an_hpa_metric_type_in_metadata_points_at_the_trigger_field(kind: str) -> None:
    """metricType: Value put in metadata names the trigger-level field it belongs to, and the alias it is here."""
    message = refusal({"metricType": kind})
    assert f"set metricType: {kind} on the trigger itself, beside metadata:" in message
    assert "alias of metric" in message


def test_a_window_past_the_history_names_the_chart_keys_that_raise_it() -> None:
    """The refusal says which chart value raises --history, on the agent and behind the gateway."""
    message = refusal({"window": "20m"})
    assert "raise --history (the chart's agent.history, or gateway.history behind the gateway)" in message
