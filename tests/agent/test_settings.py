"""`gpuscaler serve` flags and GPUSCALER_* variables to ServeSettings, or a ConfigError naming the flag."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpuscaler import cli
from gpuscaler.agent.settings import ServeSettings, settings_from_args
from gpuscaler.flags import Address
from gpuscaler.model.errors import ConfigError


def settings(*flags: str, environ: dict[str, str] | None = None) -> ServeSettings:
    """What `gpuscaler serve FLAGS...` builds under ``environ`` (empty by default: no host variables leak in)."""
    env = environ if environ is not None else {}
    args = cli.build_parser(env).parse_args(["serve", *flags])
    return settings_from_args(args, env)


def refusal(*flags: str, environ: dict[str, str] | None = None) -> str:
    """The ConfigError message that ``gpuscaler serve FLAGS...`` is refused with."""
    with pytest.raises(ConfigError) as caught:
        settings(*flags, environ=environ)
    return str(caught.value)


def test_defaults() -> None:
    """With no flags and no variables: NVML, all interfaces on 6000, a 0.5 s poll, 10 min of history."""
    built = settings("--log-format", "json")
    assert built.collector == "nvml"
    assert built.server.listen == Address("0.0.0.0", 6000)
    assert built.poll_interval_seconds == 0.5
    assert built.history_seconds == 600.0
    assert built.fake_gpus == 4
    assert built.fake_scenario is None
    assert (built.server.tls_cert, built.server.tls_key, built.server.tls_client_ca) == (None, None, None)
    assert built.server.log_level == "info"
    assert built.server.drain_timeout_seconds == 5.0
    assert built.node_name == socket.gethostname()
    assert built.processes is False
    assert built.dra_drivers == ("gpu.nvidia.com",)


def field_of(built: ServeSettings, name: str) -> object:
    """A setting by name, whether the agent's own or one of the flags both servers share."""
    return getattr(built.server, name) if hasattr(built.server, name) else getattr(built, name)


@pytest.mark.parametrize(
    ("flags", "field", "expected"),
    [
        pytest.param(["--collector", "fake"], "collector", "fake", id="collector"),
        pytest.param(["--listen", "127.0.0.1:7000"], "listen", Address("127.0.0.1", 7000), id="listen"),
        pytest.param(["--listen", "[::1]:6000"], "listen", Address("::1", 6000), id="listen-ipv6"),
        pytest.param(["--listen", "127.0.0.1:0"], "listen", Address("127.0.0.1", 0), id="listen-ephemeral"),
        pytest.param(["--poll-interval", "0.05"], "poll_interval_seconds", 0.05, id="poll-min"),
        pytest.param(["--poll-interval", "60"], "poll_interval_seconds", 60.0, id="poll-max"),
        pytest.param(["--history", "30s"], "history_seconds", 30.0, id="history"),
        pytest.param(["--history", "24h"], "history_seconds", 86400.0, id="history-max"),
        pytest.param(["--fake-gpus", "0"], "fake_gpus", 0, id="no-fake-gpus"),
        pytest.param(["--fake-gpus", "1024"], "fake_gpus", 1024, id="fake-gpus-max"),
        pytest.param(
            ["--collector", "fake", "--fake-scenario", "s.yaml"], "fake_scenario", Path("s.yaml"), id="scenario"
        ),
        pytest.param(["--tls-cert", "c.pem", "--tls-key", "k.pem"], "tls_key", Path("k.pem"), id="tls"),
        pytest.param(
            ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem"],
            "tls_client_ca",
            Path("ca.pem"),
            id="mtls",
        ),
        pytest.param(["--log-format", "console"], "log_format", "console", id="log-format"),
        pytest.param(["--log-level", "debug"], "log_level", "debug", id="log-level"),
        pytest.param(["--drain-timeout", "300"], "drain_timeout_seconds", 300.0, id="drain-max"),
        pytest.param(["--processes", "true"], "processes", True, id="processes"),
        pytest.param(["--processes", "FALSE"], "processes", False, id="processes-off"),
        pytest.param(
            ["--dra-drivers", "gpu.nvidia.com, gpu.example.com"],
            "dra_drivers",
            ("gpu.nvidia.com", "gpu.example.com"),
            id="dra-drivers",
        ),
        pytest.param(["--dra-drivers", ""], "dra_drivers", (), id="dra-drivers-none"),
    ],
)
def test_each_flag_sets_its_field(flags: list[str], field: str, expected: object) -> None:
    """Each flag's value lands, parsed, in its settings field."""
    assert field_of(settings("--log-format", "json", *flags), field) == expected


def test_ipv6_address_prints_with_brackets() -> None:
    """An IPv6 listen address prints as [host]:port, as it was written."""
    assert str(settings("--listen", "[::]:6000", "--log-format", "json").server.listen) == "[::]:6000"


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        pytest.param("GPUSCALER_POLL_INTERVAL", "2", "poll_interval_seconds", 2.0, id="poll"),
        pytest.param("GPUSCALER_COLLECTOR", "fake", "collector", "fake", id="collector"),
        pytest.param("GPUSCALER_LISTEN", "127.0.0.1:7001", "listen", Address("127.0.0.1", 7001), id="listen"),
        pytest.param("GPUSCALER_HISTORY", "1h", "history_seconds", 3600.0, id="history"),
        pytest.param("GPUSCALER_FAKE_GPUS", "8", "fake_gpus", 8, id="fake-gpus"),
        pytest.param("GPUSCALER_LOG_FORMAT", "console", "log_format", "console", id="log-format"),
        pytest.param("GPUSCALER_LOG_LEVEL", "warning", "log_level", "warning", id="log-level"),
        pytest.param("GPUSCALER_DRAIN_TIMEOUT", "1.5", "drain_timeout_seconds", 1.5, id="drain"),
        pytest.param("NODE_NAME", "gpu-node-7", "node_name", "gpu-node-7", id="node-name"),
        pytest.param("GPUSCALER_PROCESSES", "true", "processes", True, id="processes"),
        pytest.param("GPUSCALER_DRA_DRIVERS", "gpu.example.com", "dra_drivers", ("gpu.example.com",), id="dra"),
    ],
)
def test_environment_variables_set_the_defaults(variable: str, value: str, field: str, expected: object) -> None:
    """Every flag has a GPUSCALER_* variable (and the chart's NODE_NAME names the node)."""
    environ = {"GPUSCALER_LOG_FORMAT": "json", variable: value}
    assert field_of(settings(environ=environ), field) == expected


def test_a_flag_wins_over_its_variable() -> None:
    """A flag given on the command line overrides the variable."""
    built = settings("--poll-interval", "1", environ={"GPUSCALER_POLL_INTERVAL": "2", "GPUSCALER_LOG_FORMAT": "json"})
    assert built.poll_interval_seconds == 1.0


BAD_FLAGS: list[tuple[list[str], str]] = [
    # (flags, the start of the message: the flag and the value, then what is allowed)
    (["--collector", "gpu"], "--collector 'gpu': use nvml or fake"),
    (["--listen", "6000"], "--listen '6000': use HOST:PORT"),
    (["--listen", ":6000"], "--listen ':6000': use HOST:PORT"),
    (["--listen", "host:70000"], "--listen 'host:70000': the port must be a number from 0 to 65535"),
    (["--listen", "host:http"], "--listen 'host:http': the port must be a number"),
    (["--listen", "host:"], "--listen 'host:': the port must be a number"),
    (["--poll-interval", "0.01"], "--poll-interval '0.01': must be between 0.05 and 60 seconds"),
    (["--poll-interval", "0"], "--poll-interval '0': must be between 0.05 and 60 seconds"),
    (["--poll-interval", "61"], "--poll-interval '61': must be between 0.05 and 60 seconds"),
    (["--poll-interval", "-1"], "--poll-interval '-1': must be between"),
    (["--poll-interval", "fast"], "--poll-interval 'fast': must be a number of seconds"),
    (["--poll-interval", "nan"], "--poll-interval 'nan': must be a finite number of seconds"),
    (["--poll-interval", "inf"], "--poll-interval 'inf': must be a finite number of seconds"),
    (["--history", "forever"], "--history 'forever' is not a duration; write a number and a unit"),
    (["--history", "600"], "--history '600' has no unit; write '600s' for seconds, or another unit (ms, m, h)"),
    (["--history", "10M"], "--history '10M' has an upper-case unit; write '10m'"),
    (["--history", "0.1s"], "--history '0.1s': must be between one poll interval (0.5s) and 24h"),
    (["--history", "25h"], "--history '25h': must be between one poll interval (0.5s) and 24h"),
    (["--fake-gpus", "-1"], "--fake-gpus '-1': must be between 0 and 1024"),
    (["--fake-gpus", "1025"], "--fake-gpus '1025': must be between 0 and 1024"),
    (["--fake-gpus", "1.5"], "--fake-gpus '1.5': must be a whole number"),
    (["--fake-gpus", "four"], "--fake-gpus 'four': must be a whole number"),
    (["--fake-scenario", "s.yaml"], "--fake-scenario 's.yaml': needs --collector fake"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
    (["--log-format", "xml"], "--log-format 'xml': use json or console"),
    (["--log-level", "loud"], "--log-level 'loud': use one of debug, info, warning, error"),
    (["--drain-timeout", "0"], "--drain-timeout '0': must be above 0 and at most 300 seconds"),
    (["--drain-timeout", "301"], "--drain-timeout '301': must be above 0 and at most 300 seconds"),
    (["--drain-timeout", "soon"], "--drain-timeout 'soon': must be a number of seconds"),
    (["--metrics-listen", "9402"], "--metrics-listen '9402': use HOST:PORT"),
    (["--tls-reload-interval", "0.01"], "--tls-reload-interval '0.01': must be between 0.1 and 3600 seconds"),
    (["--processes", "yes"], "--processes 'yes': use true or false"),
    (
        ["--dra-drivers", "gpu.nvidia.com,GPU.example"],
        "--dra-drivers 'gpu.nvidia.com,GPU.example': 'GPU.example' is not a DRA driver name",
    ),
    (["--dra-drivers", "gpu_nvidia"], "--dra-drivers 'gpu_nvidia': 'gpu_nvidia' is not a DRA driver name"),
    (["--collector", "fake", "--processes", "true"], "--processes 'true': needs --collector nvml"),
]


@pytest.mark.parametrize(("flags", "message"), [pytest.param(f, m, id=" ".join(f)) for f, m in BAD_FLAGS])
def test_bad_flag_names_the_flag_value_and_what_is_allowed(flags: list[str], message: str) -> None:
    """Every bad flag is a ConfigError starting with the flag and its value, then what is allowed."""
    assert refusal("--log-format", "json", *flags).startswith(message)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        pytest.param(
            "GPUSCALER_POLL_INTERVAL",
            "0.01",
            "--poll-interval (from GPUSCALER_POLL_INTERVAL) '0.01': must be between 0.05 and 60 seconds",
            id="poll",
        ),
        pytest.param("GPUSCALER_COLLECTOR", "gpu", "--collector (from GPUSCALER_COLLECTOR) 'gpu'", id="collector"),
        pytest.param("GPUSCALER_LISTEN", "nowhere", "--listen (from GPUSCALER_LISTEN) 'nowhere'", id="listen"),
        pytest.param("GPUSCALER_HISTORY", "25h", "--history (from GPUSCALER_HISTORY) '25h'", id="history"),
        pytest.param(
            "GPUSCALER_HISTORY",
            "600",
            "--history (from GPUSCALER_HISTORY) '600' has no unit; write '600s'",
            id="history-without-a-unit",
        ),
        pytest.param("GPUSCALER_FAKE_GPUS", "-3", "--fake-gpus (from GPUSCALER_FAKE_GPUS) '-3'", id="fake-gpus"),
        pytest.param("GPUSCALER_LOG_LEVEL", "loud", "--log-level (from GPUSCALER_LOG_LEVEL) 'loud'", id="log-level"),
        pytest.param("GPUSCALER_LOG_FORMAT", "xml", "--log-format (from GPUSCALER_LOG_FORMAT) 'xml'", id="log-format"),
        pytest.param(
            "GPUSCALER_DRAIN_TIMEOUT", "0", "--drain-timeout (from GPUSCALER_DRAIN_TIMEOUT) '0'", id="drain-timeout"
        ),
    ],
)
def test_bad_variable_names_the_flag_and_the_variable(variable: str, value: str, message: str) -> None:
    """A bad value from the environment names both the flag and the variable it came from."""
    environ = {"GPUSCALER_LOG_FORMAT": "json", variable: value}
    assert refusal(environ=environ).startswith(message)


def test_bad_flag_beside_a_good_variable_does_not_blame_the_variable() -> None:
    """When the bad value came from the flag, the message does not say it came from the variable."""
    message = refusal("--poll-interval", "0.01", environ={"GPUSCALER_POLL_INTERVAL": "2"})
    assert message.startswith("--poll-interval '0.01': ")
    assert "GPUSCALER_POLL_INTERVAL" not in message


def test_serve_with_a_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuscaler serve --poll-interval 0.01` exits 2 before starting anything, with the flag on stderr."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--collector", "fake", "--poll-interval", "0.01"], environ={})
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "gpuscaler serve: error: --poll-interval '0.01': must be between 0.05 and 60 seconds" in captured.err


def test_serve_with_a_bad_variable_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad GPUSCALER_* variable also exits 2, naming the variable."""
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--collector", "fake"], environ={"GPUSCALER_POLL_INTERVAL": "0"})
    assert caught.value.code == 2
    assert "--poll-interval (from GPUSCALER_POLL_INTERVAL) '0'" in capsys.readouterr().err
