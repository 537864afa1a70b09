"""Gateway flags and GPUSCALER_* variables: checked once, each error naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscaler.cli import build_parser, main
from gpuscaler.flags import ENV_PREFIX, Address
from gpuscaler.gateway.discovery import read_agents_file
from gpuscaler.gateway.settings import GATEWAY_FLAGS, GatewaySettings, gateway_settings_from_args
from gpuscaler.model.errors import ConfigError


def settings(*flags: str, environ: dict[str, str] | None = None) -> GatewaySettings:
    """What ``gpuscaler gateway FLAGS...`` builds under ``environ`` (empty by default: no host variables leak in)."""
    environ = environ or {}
    args = build_parser(environ).parse_args(["gateway", *flags])
    return gateway_settings_from_args(args, environ)


def test_a_static_list_and_defaults() -> None:
    """--agents gives the agents in order without repeats; the rest are the documented defaults."""
    got = settings("--agents", "127.0.0.1:6001, 127.0.0.1:6002,127.0.0.1:6001")
    assert got.agents == (Address("127.0.0.1", 6001), Address("127.0.0.1", 6002))
    assert got.server.listen == Address("0.0.0.0", 6000)
    assert got.history_seconds == 120
    assert got.pod_directory is None


def test_every_flag_has_a_variable() -> None:
    """Each flag can come from GPUSCALER_<NAME>, and the error then names the variable too."""
    environ = {ENV_PREFIX + "AGENTS_DNS": "gpuscaler-agents:6000", ENV_PREFIX + "RESOLVE_INTERVAL": "0"}
    with pytest.raises(ConfigError, match="--resolve-interval \\(from GPUSCALER_RESOLVE_INTERVAL\\) '0'"):
        settings(environ=environ)
    assert all(env.isupper() for env, _, _ in GATEWAY_FLAGS.values())


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        ([], "no agents"),
        (["--agents", "a:1", "--agents-dns", "b:2"], "--agents and --agents-dns are both set"),
        (["--agents", "a:1,,b:2"], "--agents 'a:1,,b:2': has an empty entry"),
        (["--agents", "a"], "--agents 'a': use HOST:PORT"),
        (["--agents", "a:0"], "every agent needs its port"),
        (["--agents-dns", "svc:0"], "--agents-dns 'svc:0'"),
        (["--agents", "a:1", "--resolve-interval", "x"], "--resolve-interval 'x': must be a number"),
        (["--agents", "a:1", "--history", "0s"], "--history '0s'"),
        (["--agents", "a:1", "--history", "600"], "--history '600' has no unit; write '600s'"),
        (["--agents", "a:1", "--pod-directory", "/nonexistent/pods.yaml"], "--pod-directory"),
        (["--agents", "a:1", "--agent-tls-cert", "c.pem"], "--agent-tls-cert and --agent-tls-key go together"),
        (["--agents", "a:1", "--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
        (["--agents", "a:1", "--log-level", "loud"], "--log-level 'loud'"),
        (["--agents", "a:1", "--drain-timeout", "0"], "--drain-timeout '0'"),
        (["--agents", "a:1", "--listen", "nope"], "--listen 'nope'"),
    ],
)
def test_bad_flags_are_named(flags: list[str], complaint: str) -> None:
    """A bad value raises ConfigError whose message names the flag."""
    with pytest.raises(ConfigError) as raised:
        settings(*flags)
    assert complaint in str(raised.value)


def test_the_cli_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuscaler gateway` with a bad flag exits 2 and says which flag."""
    with pytest.raises(SystemExit) as raised:
        main(["gateway", "--agents", "a:1", "--resolve-interval", "-1"], environ={})
    assert raised.value.code == 2
    assert "--resolve-interval '-1'" in capsys.readouterr().err


def test_a_static_pod_directory_must_exist(tmp_path: Path) -> None:
    """--pod-directory accepts 'kubernetes' or an existing file."""
    path = tmp_path / "pods.yaml"
    path.write_text("pods: []\n")
    assert settings("--agents", "a:1", "--pod-directory", str(path)).pod_directory == str(path)
    assert settings("--agents", "a:1", "--pod-directory", "kubernetes").pod_directory == "kubernetes"


def test_an_agents_file_is_read_at_start(tmp_path: Path) -> None:
    """--agents-file lists agents one per line with comments; a bad line is refused naming the line."""
    path = tmp_path / "agents.txt"
    path.write_text("# the GPU pool\n10.0.0.1:6000\n\n10.0.0.2:6000  # rack 2\n")
    assert settings("--agents-file", str(path)).agents_file == path
    assert read_agents_file(path) == {Address("10.0.0.1", 6000), Address("10.0.0.2", 6000)}
    with pytest.raises(ConfigError, match="--agents and --agents-file are both set"):
        settings("--agents", "a:1", "--agents-file", str(path))
    path.write_text("10.0.0.1:6000\nnot-an-address\n")
    with pytest.raises(ConfigError, match=r"--agents-file .*: line 2 'not-an-address': use HOST:PORT"):
        settings("--agents-file", str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        settings("--agents-file", str(tmp_path / "missing.txt"))


def test_the_epp_metrics_token_is_off_by_default_and_names_a_service_account() -> None:
    """No ServiceAccount is named by default; a value that is not NAMESPACE/NAME (the namespace a DNS label, the
    name a DNS subdomain), or one without the pod watch, is refused naming the flag."""
    assert settings("--agents", "a:1").epp_metrics_token_service_account is None
    on = settings(
        "--agents", "a:1", "--pod-directory", "kubernetes", "--epp-metrics-token-service-account", "gs/epp",
        "--epp-namespaces", "serving, ml,serving",
    )  # fmt: skip
    assert on.epp_metrics_token_service_account == ("gs", "epp")
    assert on.epp_namespaces == ("serving", "ml")
    for bad in ("epp", "g.s/epp"):  # a namespace is a DNS label: no dot, unlike a ServiceAccount's name
        with pytest.raises(ConfigError, match=rf"--epp-metrics-token-service-account '{bad}': use NAMESPACE/NAME"):
            settings("--agents", "a:1", "--pod-directory", "kubernetes", "--epp-metrics-token-service-account", bad)
    dotted = settings(
        "--agents", "a:1", "--pod-directory", "kubernetes", "--epp-metrics-token-service-account", "gs/epp.metrics",
        "--epp-namespaces", "serving",
    )  # fmt: skip
    assert dotted.epp_metrics_token_service_account == ("gs", "epp.metrics")
    with pytest.raises(ConfigError, match="needs --pod-directory kubernetes"):
        settings("--agents", "a:1", "--epp-metrics-token-service-account", "gs/epp")


def test_the_epp_token_needs_a_namespace_allowlist_of_valid_names() -> None:
    """The token flag without --epp-namespaces is refused saying why; a bad namespace is refused naming the flag,
    the value and what is allowed; --epp-namespaces alone is refused."""
    token = ("--agents", "a:1", "--pod-directory", "kubernetes", "--epp-metrics-token-service-account", "gs/epp")
    with pytest.raises(ConfigError, match="needs --epp-namespaces NS1,NS2: the namespaces whose InferencePools"):
        settings(*token)
    with pytest.raises(ConfigError, match=r"--epp-namespaces 'ml,Bad_NS': 'Bad_NS' is not a namespace name; use"):
        settings(*token, "--epp-namespaces", "ml,Bad_NS")
    with pytest.raises(ConfigError, match=r"--epp-namespaces 'ml,': '' is not a namespace name"):
        settings(*token, "--epp-namespaces", "ml,")
    with pytest.raises(ConfigError, match="--epp-namespaces needs --epp-metrics-token-service-account"):
        settings("--agents", "a:1", "--epp-namespaces", "ml")


def test_the_gateways_own_pod_comes_from_the_downward_api_all_or_nothing() -> None:
    """POD_NAMESPACE, POD_NAME and POD_UID give the pod the EPP's token is bound to; without any one, none."""
    pod = {"POD_NAMESPACE": "gs", "POD_NAME": "gw-0", "POD_UID": "u-1"}
    assert settings("--agents", "a:1", environ=pod).own_pod == ("gs", "gw-0", "u-1")
    assert settings("--agents", "a:1", environ={**pod, "POD_UID": ""}).own_pod is None
    assert settings("--agents", "a:1").own_pod is None
