"""Fake GPU scenario files: each shape, defaults vs per-GPU entries, and errors that name the bad entry's path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.collectors.scenario import GpuScenario, Scenario, load_scenario, parse_scenario, parse_value
from gpuscaler.agent.collectors.shapes import Constant, Ramp, Shape, Sine, Square, Triangle
from gpuscaler.model.errors import ConfigError
from gpuscaler.model.gpu_metrics import Metric


def shape_of(spec: Any, metric: str = "gpu_utilization") -> Shape:
    """The shape a one-GPU scenario gives ``metric``."""
    scenario = parse_scenario({"gpus": {0: {"values": {metric: spec}}}}, gpu_count=1)
    return scenario.gpus[0].values[Metric(metric)]


@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        pytest.param(40, Constant(40.0), id="int"),
        pytest.param(12.5, Constant(12.5), id="float"),
        pytest.param("40", Constant(40.0), id="string"),
        pytest.param(0, Constant(0.0), id="zero"),
        pytest.param(100, Constant(100.0), id="hundred"),
        pytest.param({"shape": "sine", "min": 20, "max": 95, "period": "120s"}, Sine(20, 95, 120), id="sine"),
        pytest.param(
            {"shape": "sine", "min": 0, "max": 10, "period": "1m", "phase": "15s"}, Sine(0, 10, 60, 15), id="sine-phase"
        ),
        pytest.param({"shape": "square", "low": 1, "high": 9, "period": "30s"}, Square(1, 9, 30), id="square"),
        pytest.param({"shape": "triangle", "min": 5, "max": 70, "period": "500ms"}, Triangle(5, 70, 0.5), id="tri"),
        pytest.param({"shape": "ramp", "from": 35, "to": 80, "duration": "5m"}, Ramp(35, 80, 300), id="ramp-up"),
        pytest.param({"shape": "ramp", "from": 80, "to": 35, "duration": "1h"}, Ramp(80, 35, 3600), id="ramp-down"),
    ],
)
def test_each_shape_parses(spec: Any, shape: Shape) -> None:
    """A value is a constant or one of the shapes; durations take the usual units, a bare number is seconds."""
    assert shape_of(spec) == shape


@pytest.mark.parametrize(
    ("shape", "times", "expected"),
    [
        pytest.param(Constant(42.0), [0.0, 1e6], [42.0, 42.0], id="constant"),
        pytest.param(Sine(20, 80, 60), [0.0, 15.0, 30.0, 45.0, 60.0], [50.0, 80.0, 50.0, 20.0, 50.0], id="sine"),
        pytest.param(Sine(20, 80, 60, 15), [0.0, 30.0], [80.0, 20.0], id="sine-phase"),
        pytest.param(Square(10, 90, 10), [0.0, 4.9, 5.0, 9.9, 10.0, 12.0], [90, 90, 10, 10, 90, 90], id="square"),
        pytest.param(Triangle(0, 100, 20), [0.0, 5.0, 10.0, 15.0, 20.0, 25.0], [0, 50, 100, 50, 0, 50], id="triangle"),
        pytest.param(Ramp(35, 80, 300), [-5.0, 0.0, 150.0, 300.0, 1000.0], [35, 35, 57.5, 80, 80], id="ramp-holds"),
        pytest.param(Ramp(80, 30, 10), [5.0, 20.0], [55.0, 30.0], id="ramp-down"),
    ],
)
def test_shape_values_over_time(shape: Shape, times: list[float], expected: list[float]) -> None:
    """Shapes give the documented value at each time since start (ramps hold their end value)."""
    assert [shape.at(t) for t in times] == pytest.approx(expected)


def test_empty_documents_are_idle_scenarios() -> None:
    """An empty file, or one with empty sections, leaves every GPU idle."""
    assert parse_scenario(None, gpu_count=2) == Scenario()
    assert parse_scenario({}, gpu_count=2) == Scenario()
    assert parse_scenario({"defaults": None, "gpus": {}}, gpu_count=2) == Scenario()


def test_defaults_apply_to_every_gpu_and_entries_override_them() -> None:
    """`defaults` shape every GPU; a `gpus` entry overrides only what it sets."""
    document = {
        "defaults": {
            "memory_total_bytes": 1000,
            "power_limit_watts": 400,
            "values": {"gpu_utilization": 10, "memory_used_percent": 50},
        },
        "gpus": {
            1: {"uuid": "GPU-busy-1", "name": "Busy GPU", "values": {"gpu_utilization": 90}},
            "2": {"power_limit_watts": 200, "values": {"power_percent": 50}},
        },
    }
    collector = FakeCollector(node="n", gpu_count=3, scenario=parse_scenario(document, gpu_count=3))
    samples = [collector.read(gpu) for gpu in collector.discover()]
    assert [s.gpu.uuid for s in samples] == ["GPU-fake-n-0", "GPU-busy-1", "GPU-fake-n-2"]
    assert [s.gpu.name for s in samples] == ["Fake GPU", "Busy GPU", "Fake GPU"]
    assert [s.gpu_utilization_percent for s in samples] == [10.0, 90.0, 10.0]
    assert [s.memory_used_bytes for s in samples] == [500, 500, 500]
    assert [s.power_limit_watts for s in samples] == [400.0, 400.0, 200.0]
    assert [s.power_draw_watts for s in samples] == [60.0, 60.0, 100.0]


def test_unset_values_are_an_idle_gpu() -> None:
    """A GPU the scenario does not mention is idle: 0% busy, 30 °C, 60 W of a 700 W limit, 80 GiB, no SM at work."""
    collector = FakeCollector(node="n", gpu_count=1)
    [gpu] = collector.discover()
    collector.read(gpu)  # GPM metrics are rates: the first read has none
    sample = collector.read(gpu)
    assert sample.sm_active_percent == 0.0
    assert sample.tensor_active_percent == 0.0
    assert sample.gpu_utilization_percent == 0.0
    assert sample.memory_utilization_percent == 0.0
    assert sample.memory_used_bytes == 0
    assert sample.memory_total_bytes == 80 * 1024**3
    assert sample.temperature_celsius == 30.0
    assert sample.power_draw_watts == 60.0
    assert sample.power_limit_watts == 700.0
    assert sample.pcie_tx_megabytes_per_second == sample.nvlink_rx_megabytes_per_second == 0.0
    assert sample.errors == ()


def test_the_busy_dev_scenario_moves_nvlink_traffic() -> None:
    """dev/scenarios/busy.yaml loads, and its GPUs send and receive over NVLink and PCIe once GPM has two samples."""
    path = Path(__file__).parents[3] / "dev" / "scenarios" / "busy.yaml"
    collector = FakeCollector(node="n", gpu_count=4, scenario=load_scenario(path, gpu_count=4))
    gpu = collector.discover()[3]
    collector.read(gpu)
    sample = collector.read(gpu)
    assert (sample.value(Metric.NVLINK_TX) or 0.0) >= 8000.0
    assert (sample.value(Metric.NVLINK_RX) or 0.0) >= 8000.0
    assert (sample.value(Metric.PCIE_RX) or 0.0) >= 2000.0


BAD: list[tuple[Any, int, str]] = [
    # (document, --fake-gpus, the message)
    (
        {"gpus": {2: {"values": {"gpu_utilization": 150}}}},
        4,
        "gpus.2.values.gpu_utilization 150 is a percentage; it must be between 0 and 100",
    ),
    ({"gpus": {0: {"values": {"memory_used_percent": 100.5}}}}, 1, "gpus.0.values.memory_used_percent 100.5 is a"),
    ({"gpus": {0: {"values": {"power_percent": 120}}}}, 1, "gpus.0.values.power_percent 120 is a percentage"),
    ({"defaults": {"values": {"memory_utilization": 101}}}, 1, "defaults.values.memory_utilization 101 is a"),
    ({"gpus": {0: {"values": {"temperature": -5}}}}, 1, "gpus.0.values.temperature -5 must be a finite number >= 0"),
    ({"gpus": {0: {"values": {"power_draw": "nan"}}}}, 1, "gpus.0.values.power_draw 'nan' must be a finite number"),
    ({"gpus": {0: {"values": {"power_draw": True}}}}, 1, "gpus.0.values.power_draw True is not a number"),
    ({"gpus": {0: {"values": {"power_draw": "lots"}}}}, 1, "gpus.0.values.power_draw 'lots' is not a number"),
    ({"gpus": {0: {"values": {"power_draw": [1]}}}}, 1, "gpus.0.values.power_draw [1] is not a number"),
    ({"gpus": {4: {}}}, 4, "gpus.4 is out of range; --fake-gpus 4 gives indices 0-3"),
    ({"gpus": {-1: {}}}, 4, "gpus.-1 is out of range; --fake-gpus 4 gives indices 0-3"),
    ({"gpus": {"first": {}}}, 4, "gpus key 'first' is not a GPU index"),
    (
        {"gpus": {1: {"values": {"power_draw": 100, "power_percent": 50}}}},
        2,
        "gpus.1.values sets both power_draw and power_percent; set one",
    ),
    (
        {"defaults": {"values": {"power_draw": 100, "power_percent": 50}}},
        2,
        "defaults.values sets both power_draw and power_percent; set one",
    ),
    ({"gpus": {0: {"values": {"gpu_util": 5}}}}, 1, "gpus.0.values: 'gpu_util' is not a metric; use one of: gpu_"),
    ({"gpus": {0: {"values": {"sm_active": 120}}}}, 1, "gpus.0.values.sm_active 120 is a percentage"),
    (
        {"gpus": {0: {"values": {"power_average": 300}}}},
        1,
        "gpus.0.values: 'power_average' is computed from the energy counter, which a fake GPU counts from its power "
        "draw; set power_draw or power_percent",
    ),
    (
        {"gpus": {0: {"values": {"gpu_utilization": {"shape": "saw"}}}}},
        1,
        "gpus.0.values.gpu_utilization.shape 'saw' is not allowed; use one of: sine, square, triangle, ramp",
    ),
    ({"gpus": {0: {"values": {"gpu_utilization": {"min": 1}}}}}, 1, "gpus.0.values.gpu_utilization.shape None"),
    (
        {"gpus": {0: {"values": {"gpu_utilization": {"shape": "sine", "min": 1}}}}},
        1,
        "gpus.0.values.gpu_utilization (sine) lacks max, period",
    ),
    (
        {"gpus": {0: {"values": {"temperature": {"shape": "ramp", "from": 1, "to": 2, "duration": 1, "period": 3}}}}},
        1,
        "gpus.0.values.temperature has unknown key 'period'; allowed: duration, from, shape, to",
    ),
    (
        {"gpus": {0: {"values": {"gpu_utilization": {"shape": "sine", "min": 0, "max": 150, "period": "1s"}}}}},
        1,
        "gpus.0.values.gpu_utilization.max 150 is a percentage",
    ),
    (
        {"gpus": {0: {"values": {"gpu_utilization": {"shape": "square", "low": 0, "high": 1, "period": "0s"}}}}},
        1,
        "gpus.0.values.gpu_utilization.period '0s' must be longer than 0",
    ),
    (
        {"gpus": {0: {"values": {"gpu_utilization": {"shape": "square", "low": 0, "high": 1, "period": "soon"}}}}},
        1,
        "gpus.0.values.gpu_utilization.period 'soon' is not a duration",
    ),
    (
        {"gpus": {0: {"values": {"gpu_utilization": {"shape": "square", "low": 0, "high": 1, "period": 30}}}}},
        1,
        "gpus.0.values.gpu_utilization.period '30' has no unit; write '30s' for seconds",
    ),
    ([1, 2], 1, "the file must be a mapping, not list"),
    ({"gpu": {}}, 1, "the file has unknown key 'gpu'; allowed: defaults, gpus"),
    ({"gpus": [1]}, 1, "gpus must be a mapping, not list"),
    ({"gpus": {0: {"uuid": ""}}}, 1, "gpus.0.uuid '' must be a non-empty string"),
    ({"gpus": {0: {"name": 7}}}, 1, "gpus.0.name 7 must be a non-empty string"),
    ({"gpus": {0: {"memory_total_bytes": 0}}}, 1, "gpus.0.memory_total_bytes 0 must be a finite number > 0"),
    ({"gpus": {0: {"power_limit_watts": "700"}}}, 1, "gpus.0.power_limit_watts '700' is not a number"),
    ({"defaults": {"uuid": "GPU-x"}}, 1, "defaults has unknown key 'uuid'"),
    ({"gpus": {0: {"minor": -1}}}, 1, "gpus.0.minor -1 must be a whole number from 0 to 254"),
    ({"gpus": {0: {"minor": "3"}}}, 1, "gpus.0.minor '3' must be a whole number from 0 to 254"),
    ({"defaults": {"minor": 1}}, 1, "defaults has unknown key 'minor'"),
    ({"gpus": {0: {"minor": 0}}}, 2, "gpus.1.minor 0 is GPU 0's minor number too"),
    ({"gpus": {0: {"value": {}}}}, 1, "gpus.0 has unknown key 'value'"),
]


@pytest.mark.parametrize(
    ("document", "gpus", "message"),
    [pytest.param(d, g, m, id=m.split(" ")[0] + "-" + str(i)) for i, (d, g, m) in enumerate(BAD)],
)
def test_bad_scenario_names_the_path(document: Any, gpus: int, message: str) -> None:
    """Each mistake is a ConfigError that starts with the path of the bad entry and says what is allowed."""
    with pytest.raises(ConfigError) as caught:
        parse_scenario(document, gpu_count=gpus)
    assert str(caught.value).startswith(message)


def test_load_scenario_reads_yaml_and_json(tmp_path: Path) -> None:
    """Scenario files are YAML, and JSON (a subset of YAML) works too."""
    yaml_file = tmp_path / "scenario.yaml"
    yaml_file.write_text(
        "gpus:\n  1:\n    values:\n      gpu_utilization: {shape: sine, min: 20, max: 95, period: 2m}\n"
    )
    json_file = tmp_path / "scenario.json"
    json_file.write_text(json.dumps({"gpus": {"1": {"values": {"gpu_utilization": 30}}}}))
    assert load_scenario(yaml_file, gpu_count=2).gpus[1] == GpuScenario(
        values={Metric.GPU_UTILIZATION: Sine(20, 95, 120)}
    )
    assert load_scenario(json_file, gpu_count=2).gpus[1] == GpuScenario(values={Metric.GPU_UTILIZATION: Constant(30)})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("gpus: {0: [", "not YAML or JSON", id="not-yaml"),
        pytest.param("gpus:\n  5: {}\n", "gpus.5 is out of range; --fake-gpus 2", id="bad-entry"),
        pytest.param(None, "cannot read", id="missing"),
    ],
)
def test_load_scenario_errors_name_the_flag_and_file(tmp_path: Path, text: str | None, message: str) -> None:
    """A file that cannot be read or used is a ConfigError naming --fake-scenario, the file and the problem."""
    path = tmp_path / "scenario.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_scenario(path, gpu_count=2)
    assert str(caught.value).startswith(f"--fake-scenario {str(path)!r}: ")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        pytest.param("gpu_utilization", "95", (Metric.GPU_UTILIZATION, 95.0), id="percent"),
        pytest.param("power_draw", "650.5", (Metric.POWER_DRAW, 650.5), id="watts"),
        pytest.param("temperature", "0", (Metric.TEMPERATURE, 0.0), id="zero"),
        pytest.param("sm_active", "62.5", (Metric.SM_ACTIVE, 62.5), id="gpm"),
        pytest.param("dram_bandwidth", "80", (Metric.DRAM_BANDWIDTH, 80.0), id="gpm-bandwidth"),
    ],
)
def test_parse_value_from_the_command_line(name: str, text: str, expected: tuple[Metric, float]) -> None:
    """`gpuscaler fake set METRIC=VALUE` values are read as scenario constants."""
    assert parse_value(name, text) == expected


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        pytest.param("gpu_utilization", "150", "gpu_utilization '150' is a percentage", id="over-100"),
        pytest.param("gpu_utilization", "-1", "gpu_utilization '-1' must be a finite number >= 0", id="negative"),
        pytest.param("gpu", "1", "METRIC: 'gpu' is not a metric; use one of", id="unknown-metric"),
        pytest.param("power_draw", "x", "power_draw 'x' is not a number", id="not-a-number"),
        pytest.param("power_average", "300", "METRIC: 'power_average' is computed", id="computed"),
    ],
)
def test_parse_value_errors(name: str, text: str, message: str) -> None:
    """A bad METRIC=VALUE is a ConfigError naming the metric and value."""
    with pytest.raises(ConfigError) as caught:
        parse_value(name, text)
    assert str(caught.value).startswith(message)
