"""Docs that cannot drift from the code: examples parse, tables match the defaults, names and links exist."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
import yaml

from gpuscaler import cli
from gpuscaler.agent.collectors.scenario import parse_value
from gpuscaler.agent.history import History
from gpuscaler.agent.settings import settings_from_args
from gpuscaler.agent.telemetry import AgentTelemetry, AttributionReads
from gpuscaler.flags import DEFAULT_LIMITS
from gpuscaler.gateway.engines.epp_token import EppCredentials, EppToken, Pickers, Pods
from gpuscaler.gateway.engines.limits import DEFAULT_SCRAPE_LIMITS
from gpuscaler.gateway.engines.page_reader import PageReader
from gpuscaler.gateway.engines.scraper import EngineScraper
from gpuscaler.gateway.telemetry import GatewayTelemetry
from gpuscaler.gateway.view import ClusterView
from gpuscaler.model.durations import parse_duration
from gpuscaler.model.errors import ConfigError, InvalidMetadata
from gpuscaler.model.gpu_metrics import METRICS, READINGS, Metric
from gpuscaler.query.engine_keys import metric_names
from gpuscaler.query.keys import FROM_ENV_SUFFIX, KEDA_KEYS, KNOWN_KEYS, QUERY_KEYS
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.profiles import PROFILES
from gpuscaler.server.telemetry import TlsCollector, TransportCollector
from gpuscaler.server.transport.limits import ConnectionGuard

if TYPE_CHECKING:
    from gpuscaler.server.transport.server import ManyStreamsServer
    from gpuscaler.tls import ReloadingServerTLS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "charts" / "gpuscaler" / "examples"
MARKDOWN = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
EXTERNAL_TRIGGERS = frozenset({"external", "external-push"})
LIMITS = Limits(history_seconds=600)  # the agent's default --history of 10m

PROFILE_COLUMNS = (
    "profile",
    "metric",
    "aggregation",
    "targetValue",
    "activationThreshold",
    "deactivationThreshold",
    "window",
    "windowFunction",
    "why",
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_SCALED_OBJECT = re.compile(r"^\s*kind:\s*ScaledObject\s*$", re.M)
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_SERIES = re.compile(r"\bgpuscaler_[a-z0-9_]+")


@dataclass(frozen=True, slots=True)
class YamlSource:
    """YAML that holds at least one ScaledObject: a fenced block of a markdown file, or an example file."""

    path: Path
    block: int | None  # the fenced block's number within the markdown file; None for a .yaml file
    text: str

    @property
    def id(self) -> str:
        where = str(self.path.relative_to(ROOT))
        return where if self.block is None else f"{where}#{self.block}"


def _fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    """(info string, body) of each fenced code block, bodies dedented by their fence's indent."""
    for match in _FENCE.finditer(text):
        indent = len(match["indent"])
        body = "".join(line[indent:] if line[:indent].isspace() else line for line in match["body"].splitlines(True))
        yield match["info"].strip(), body


def _yaml_sources() -> list[YamlSource]:
    sources = []
    for path in MARKDOWN:
        blocks = _fenced_blocks(path.read_text(encoding="utf-8"))
        for number, (info, body) in enumerate(blocks, start=1):
            if info.split()[:1] == ["yaml"] and _SCALED_OBJECT.search(body):
                sources.append(YamlSource(path, number, body))
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        if _SCALED_OBJECT.search(text):
            sources.append(YamlSource(path, None, text))
    return sources


YAML_SOURCES = _yaml_sources()


def _scaled_objects(source: YamlSource) -> list[dict[str, Any]]:
    documents = [document for document in yaml.safe_load_all(source.text) if isinstance(document, dict)]
    return [document for document in documents if document.get("kind") == "ScaledObject"]


def _external_triggers(scaled_object: dict[str, Any]) -> list[dict[str, Any]]:
    triggers = scaled_object.get("spec", {}).get("triggers") or []
    return [trigger for trigger in triggers if trigger.get("type") in EXTERNAL_TRIGGERS]


def _markdown_table(text: str, *columns: str) -> list[dict[str, str]]:
    """The rows, by column name, of the first pipe table whose header has all of ``columns``."""
    lines = text.splitlines()
    for start, line in enumerate(lines[:-1]):
        header = _cells(line)
        if header and set(columns) <= set(header) and set(lines[start + 1]) <= set("|-: "):
            rows = []
            for row in lines[start + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, _cells(row), strict=True)))
            return rows
    raise AssertionError(f"no table with the columns {columns}")


def _cells(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _name(cell: str) -> str:
    """A table cell's code name: `` `gpu_utilization` `` or gpu_utilization."""
    return cell.strip().strip("`")


def _number(cell: str) -> float:
    return float(_name(cell))


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` (a ``## `` line), up to the next heading of that level or higher."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(?P<body>.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match is not None, f"no section '## {heading}'"
    return match["body"]


def _prose(text: str) -> str:
    """Markdown without its fenced blocks and inline code, where links are links."""
    text = _FENCE.sub("", text)
    return _INLINE_CODE.sub("", text)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens, repeats numbered."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def _external_trigger_count(sources: list[YamlSource]) -> int:
    return sum(len(_external_triggers(so)) for source in sources for so in _scaled_objects(source))


def test_docs_have_external_triggers() -> None:
    """The docs hold ScaledObjects with external triggers for the parser to check."""
    assert _external_trigger_count([s for s in YAML_SOURCES if not s.path.is_relative_to(EXAMPLES)]) > 0


def test_chart_examples_have_external_triggers() -> None:
    """The chart's examples hold ScaledObjects with external triggers for the parser to check."""
    if not EXAMPLES.parent.exists():
        pytest.skip("the chart is not in this checkout")
    assert _external_trigger_count([s for s in YAML_SOURCES if s.path.is_relative_to(EXAMPLES)]) > 0


@pytest.mark.parametrize("source", YAML_SOURCES, ids=lambda source: source.id)
def test_scaled_object_metadata_parses(source: YamlSource) -> None:
    """Every external trigger's metadata is all strings (KEDA's rule) and the agent's parser accepts it."""
    scaled_objects = _scaled_objects(source)
    assert scaled_objects, "kind: ScaledObject appears, but no YAML document is one"
    for scaled_object in scaled_objects:
        for trigger in _external_triggers(scaled_object):
            metadata = trigger.get("metadata")
            assert isinstance(metadata, dict), f"trigger {trigger.get('type')} has no metadata mapping"
            not_strings = {key: value for key, value in metadata.items() if not isinstance(value, str)}
            assert not not_strings, f"KEDA requires string values; quote these: {not_strings}"
            # KEDA replaces a <key>FromEnv value with the scale target's environment, which a doc cannot show.
            from_env = [key for key in metadata if key.endswith(FROM_ENV_SUFFIX)]
            assert all(key.removesuffix(FROM_ENV_SUFFIX) in KNOWN_KEYS for key in from_env), from_env
            resolved = {key: value for key, value in metadata.items() if key not in from_env}
            namespace = scaled_object.get("metadata", {}).get("namespace", "default")
            name = scaled_object.get("metadata", {}).get("name", "")  # KEDA sends both with every call
            parse_metadata(resolved, LIMITS, namespace=namespace, name=name)


def test_metadata_doc_lists_every_key() -> None:
    """docs/metadata.md's key table has exactly the query keys, and the text names every KEDA key."""
    text = (DOCS / "metadata.md").read_text(encoding="utf-8")
    documented = [_name(row["key"]) for row in _markdown_table(text, "key", "type", "default")]
    missing, unknown = sorted(set(QUERY_KEYS) - set(documented)), sorted(set(documented) - set(QUERY_KEYS))
    assert not missing, f"keys the agent accepts and the table lacks: {missing}"
    assert not unknown, f"rows for keys the agent refuses: {unknown}"
    assert len(documented) == len(set(documented)), "a key has two rows"
    missing_keda = sorted(key for key in KEDA_KEYS if f"`{key}`" not in text)
    assert not missing_keda


def test_metadata_doc_defaults_match_the_code() -> None:
    """docs/metadata.md's "Defaults per metric" table is the metric table's defaults: aggregation, target, threshold."""
    text = _section((DOCS / "metadata.md").read_text(encoding="utf-8"), "Defaults per metric")
    table = _markdown_table(text, "metric", "aggregation", "targetValue", "activationThreshold")
    rows = {_name(row["metric"]): row for row in table}
    assert sorted(rows) == sorted(metric.value for metric in METRICS)
    for metric, info in METRICS.items():
        defaults = info.defaults
        row = rows[metric.value]
        assert _name(row["aggregation"]) == defaults.aggregation.value, metric
        assert math.isclose(_number(row["targetValue"]), defaults.target), metric
        assert math.isclose(_number(row["activationThreshold"]), defaults.activation_threshold), metric


def test_metrics_doc_table_matches_the_metric_table() -> None:
    """docs/metrics.md's trigger table has one row per metric, with its unit and the NVML call of each reading."""
    text = _section((DOCS / "metrics.md").read_text(encoding="utf-8"), "What a trigger can scale on")
    table = _markdown_table(text, "metric", "unit", "NVML source")
    rows = {_name(row["metric"]): row for row in table}
    assert sorted(rows) == sorted(metric.value for metric in METRICS)
    calls = {reading.field: reading.nvml for reading in READINGS}
    for metric, info in METRICS.items():
        row = rows[metric.value]
        assert row["unit"].strip() == info.unit, metric
        for field in info.fields:
            assert calls[field] in row["NVML source"] or f"`{_other(field)}`" in row["NVML source"], (metric, field)


def _missing_and_unknown(listed: set[str], known: set[str]) -> str:
    """A list's drift from the code's, in words: what the doc misses, and what it names that the code does not."""
    return f"the doc misses {sorted(known - listed)}; it names {sorted(listed - known)}, which the code does not"


def test_metadata_doc_allows_every_metric() -> None:
    """docs/metadata.md's `metric` row lists every metric a trigger can name, GPU metrics and engine signals alike,
    and no other."""
    text = (DOCS / "metadata.md").read_text(encoding="utf-8")
    [row] = [row for row in _markdown_table(text, "key", "type", "default") if _name(row["key"]) == "metric"]
    listed = set(re.findall(r"`([a-z_]+)`", row["allowed"]))
    assert listed == set(metric_names()), _missing_and_unknown(listed, set(metric_names()))


def test_migration_doc_names_every_gpu_metric() -> None:
    """docs/migration.md's "metric values" row: the prior art's five are ours, and with the ones it adds they are
    every GPU metric."""
    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    table = _markdown_table(text, "key", "keda-gpu-scaler", "gpuscaler")
    [row] = [row for row in table if row["key"] == "metric values"]
    theirs = set(re.findall(r"`([a-z_]+)`", row["keda-gpu-scaler"]))
    added = set(re.findall(r"`([a-z_]+)`", row["gpuscaler"]))
    gpu_metrics = {metric.value for metric in Metric}
    assert theirs <= gpu_metrics, sorted(theirs - gpu_metrics)
    assert not theirs & added, f"named as added but the prior art had them: {sorted(theirs & added)}"
    assert theirs | added == gpu_metrics, _missing_and_unknown(theirs | added, gpu_metrics)


def test_migration_doc_maps_every_gpu_metric_from_dcgm() -> None:
    """docs/migration.md's DCGM table gives each GPU metric its DCGM field, and names no metric that does not exist."""
    text = _section((DOCS / "migration.md").read_text(encoding="utf-8"), "From dcgm-exporter + Prometheus + KEDA")
    table = _markdown_table(text, "DCGM field (dcgm-exporter series)", "gpuscaler `metric`")
    mapped = {name for row in table for name in re.findall(r"`([a-z_]+)`", row["gpuscaler `metric`"])}
    assert mapped == {metric.value for metric in Metric}, _missing_and_unknown(mapped, {m.value for m in Metric})
    for row in table:
        assert re.search(r"\bDCGM_FI_[A-Z_]+", row["DCGM field (dcgm-exporter series)"]), row


# A quoted message that lists what a key or argument allows, as the code writes it.
_ALLOWED_LIST = re.compile(r"`(?P<quote>[^`\n]*?use one of: [^`\n]*)`")


def _allowed_list_quotes() -> list[Any]:
    """Every message README.md and docs/ quote with a "use one of:" list, with its file and line."""
    cases = []
    for path in MARKDOWN:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in _ALLOWED_LIST.finditer(line):
                cases.append(pytest.param(match["quote"], id=f"{path.relative_to(ROOT)}:{number}"))
    return cases


def _what_the_code_says(quote: str) -> str:
    """The message the code gives for the input ``quote`` shows: a trigger key's value, or `gpuscaler fake set`'s."""
    fake = re.fullmatch(r"gpuscaler fake set: INVALID_ARGUMENT: METRIC: '(?P<name>[^']*)' is not a metric; .*", quote)
    if fake is not None:
        with pytest.raises(ConfigError) as refused:
            parse_value(fake["name"], "1")
        return f"gpuscaler fake set: INVALID_ARGUMENT: {refused.value}"
    key = re.fullmatch(r"(?P<key>\w+) '(?P<value>[^']*)' is not allowed; .*", quote)
    assert key is not None, f"{quote!r}: a list this test cannot check; say here where the message comes from"
    metadata = {key["key"]: key["value"]}
    if key["key"] == "podAggregation":
        metadata["namespace"] = "ml"  # it needs a pod selection
    with pytest.raises(InvalidMetadata) as invalid:
        parse_metadata(metadata, LIMITS)
    return str(invalid.value)


def _allowed(message: str) -> set[str]:
    return {name.strip() for name in message.partition("use one of: ")[2].split(",")}


def test_the_docs_quote_lists_of_allowed_values() -> None:
    """There are quoted lists for the next test to check (the metric lists of docs/troubleshooting.md at least)."""
    assert len(_allowed_list_quotes()) >= 2


@pytest.mark.parametrize("quote", _allowed_list_quotes())
def test_a_quoted_list_of_allowed_values_is_what_the_code_says(quote: str) -> None:
    """A message the docs quote with a "use one of:" list is the code's message for that input, every name in it:
    when a metric, profile or value is added, the quote fails naming what it misses."""
    said = _what_the_code_says(quote)
    assert _allowed(quote) == _allowed(said), _missing_and_unknown(_allowed(quote), _allowed(said))
    assert quote == said


# A quoted refusal of a duration, as a trigger's window or the --history flag says it.
_DURATION_REFUSAL = re.compile(
    r"`(?P<quote>(?P<name>window|--history) '(?P<value>[^'`]*)' (?:has|is|repeats) [^`\n]*)`"
)


def _duration_refusal_quotes() -> list[Any]:
    """Every refusal of a duration README.md and docs/ quote (metadata.md's and migration.md's tables)."""
    cases = []
    for path in MARKDOWN:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in _DURATION_REFUSAL.finditer(line):
                quote = (match["quote"], match["name"], match["value"])
                cases.append(pytest.param(*quote, id=f"{path.relative_to(ROOT)}:{number}"))
    return cases


def test_the_docs_quote_refusals_of_durations() -> None:
    """There are quoted refusals for the next test to check: metadata.md's table and migration.md's upgrade note."""
    files = {case.id.partition(":")[0] for case in _duration_refusal_quotes()}
    assert {"docs/metadata.md", "docs/migration.md"} <= files


@pytest.mark.parametrize(("quote", "name", "value"), _duration_refusal_quotes())
def test_a_quoted_refusal_of_a_duration_is_what_the_code_says(quote: str, name: str, value: str) -> None:
    """A refusal of a window or of --history that the docs quote is the code's message for that value, word for
    word up to where the quote stops (a quote may end early, with "..." or "…")."""
    if name == "window":
        with pytest.raises(InvalidMetadata) as invalid:
            parse_metadata({"window": value}, LIMITS)
        said = str(invalid.value)
    else:
        environ: dict[str, str] = {}
        with pytest.raises(ConfigError) as refused:
            settings_from_args(cli.build_parser(environ).parse_args(["serve", "--history", value]), environ)
        said = str(refused.value)
    assert said.startswith(re.sub(r"[;,]? ?(?:\.\.\.|…)$", "", quote)), said


def test_metrics_doc_series_table_has_each_reading_with_its_type() -> None:
    """Each reading's Prometheus series is a row of docs/metrics.md's table, as a gauge or (energy) a counter."""
    text = _section(
        (DOCS / "metrics.md").read_text(encoding="utf-8"),
        "Prometheus (`--metrics-listen`, default `0.0.0.0:9402`, path `/metrics`)",
    )
    rows = {_name(row["series"]): row for row in _markdown_table(text, "series", "type", "unit")}
    for reading in READINGS:
        name = reading.series + ("_total" if reading.counter else "")
        assert name in rows, name
        assert rows[name]["type"] == ("counter" if reading.counter else "gauge"), name


def test_mig_doc_says_what_every_metric_is_on_a_mig_instance() -> None:
    """docs/mig.md's MIG table names every metric: a new metric must say what it reads on a MIG instance."""
    text = _section((DOCS / "mig.md").read_text(encoding="utf-8"), "MIG (Multi-Instance GPU)")
    fields = " ".join(row["field"] for row in _markdown_table(text, "field", "on a MIG instance"))
    assert sorted(metric.value for metric in Metric if f"`{metric.value}`" not in fields) == []


def _other(field: str) -> str:
    """The metric a reading is documented through (power_percent's source names power_draw)."""
    return next(metric.value for metric, info in METRICS.items() if info.fields == (field,))


def test_profiles_doc_matches_the_code() -> None:
    """docs/profiles.md's profile table is PROFILES, column by column."""
    text = (DOCS / "profiles.md").read_text(encoding="utf-8")
    table = _markdown_table(text, *PROFILE_COLUMNS)
    rows = {_name(row["profile"]): row for row in table}
    assert sorted(rows) == sorted(PROFILES)
    for name, profile in PROFILES.items():
        row = rows[name]
        assert _name(row["metric"]) == profile.metric.value, name
        assert _name(row["aggregation"]) == profile.aggregation.value, name
        assert math.isclose(_number(row["targetValue"]), profile.target), name
        assert math.isclose(_number(row["activationThreshold"]), profile.activation_threshold), name
        assert math.isclose(_number(row["deactivationThreshold"]), profile.deactivation_threshold), name
        window = _name(row["window"])
        if profile.window_seconds is None:
            assert window in {"", "-", "—", "none"}, name
        else:
            assert math.isclose(parse_duration(window), profile.window_seconds), name
        assert _name(row["windowFunction"]) == profile.window_function.value, name


def test_migration_doc_profiles_match_the_code() -> None:
    """docs/migration.md's profile table shows each profile's metric, aggregation, target and threshold."""
    text = (DOCS / "migration.md").read_text(encoding="utf-8")
    table = _markdown_table(text, "profile", "metric", "aggregation", "targetValue", "activationThreshold")
    rows = {_name(row["profile"]): row for row in table}
    assert sorted(rows) == sorted(PROFILES)
    for name, profile in PROFILES.items():
        row = rows[name]
        assert _name(row["metric"]) == profile.metric.value, name
        assert _name(row["aggregation"]) == profile.aggregation.value, name
        assert math.isclose(_number(row["targetValue"]), profile.target), name
        assert math.isclose(_number(row["activationThreshold"]), profile.activation_threshold), name


def _series_names() -> set[str]:
    """Every series name the agent and the gateway export, as Prometheus shows it (counters with ``_total``)."""
    agent_telemetry = AgentTelemetry(History(history_seconds=60, poll_interval_seconds=0.5))
    reads = SimpleNamespace(last_read_ok=None, last_success_unix=None, unplaced_now=None)
    agent_telemetry.watch_attribution(cast("AttributionReads", reads))  # an agent with attribution on
    agent = agent_telemetry.registry
    view = ClusterView(history_seconds=60, clock=lambda: 0.0)
    # A gateway with the EPP's token on (--epp-metrics-token-service-account), which adds its series.
    token = EppToken(cast("Any", None))
    epp = EppCredentials(token, cast("Pods", SimpleNamespace()), cast("Pickers", SimpleNamespace()), ())
    engines = EngineScraper(reader=PageReader(DEFAULT_SCRAPE_LIMITS, authorize=epp))
    gateway = GatewayTelemetry(view, dict, lambda: (0, 0, 0), engines=engines).registry
    server = SimpleNamespace(guard=ConnectionGuard(DEFAULT_LIMITS), open_streams=0, handler_tasks=0)
    transport = TransportCollector(cast("ManyStreamsServer", server)).collect()
    tls = TlsCollector(cast("ReloadingServerTLS", SimpleNamespace(expiry=0.0))).collect()  # with TLS on
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for family in [*agent.collect(), *gateway.collect(), *transport, *tls]
    }


def test_metrics_doc_names_every_metric_and_series() -> None:
    """docs/metrics.md names every trigger metric and every Prometheus series the agent exports."""
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    missing_metrics = sorted(metric.value for metric in Metric if f"`{metric.value}`" not in text)
    assert not missing_metrics
    series = _series_names()
    assert series, "the registry exported nothing"
    missing_series = sorted(name for name in series if f"`{name}`" not in text)
    assert not missing_series


def test_metrics_doc_names_no_series_that_does_not_exist() -> None:
    """Every ``gpuscaler_...`` series docs/metrics.md names is exported (a histogram's suffixes included)."""
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    series = _series_names()
    suffixed = {name + suffix for name in series for suffix in ("_bucket", "_sum", "_count", "_created")}
    unknown = sorted(set(_SERIES.findall(text)) - series - suffixed)
    assert not unknown


@pytest.mark.parametrize("path", [p for p in MARKDOWN if p.parent in (ROOT, DOCS)], ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link in README.md and docs/*.md names a file that exists, and an anchor it has."""
    broken = []
    for match in _LINK.finditer(_prose(path.read_text(encoding="utf-8"))):
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        missing_anchor = (
            linked.is_file()
            and linked.suffix == ".md"
            and bool(anchor)
            and anchor not in _anchors(linked.read_text(encoding="utf-8"))
        )
        if not linked.exists() or missing_anchor:
            broken.append(target)
    assert not broken


def test_values_yaml_refs_name_a_docs_section() -> None:
    """Every ``# Ref:`` line in the chart's values.yaml names a page from the repository root, and a heading it has."""
    values = EXAMPLES.parent / "values.yaml"
    if not values.exists():
        pytest.skip("the chart is not in this checkout")
    targets = re.findall(r"^ *# Ref: (\S+)$", values.read_text(encoding="utf-8"), re.M)
    assert targets, "values.yaml points to no docs page"
    broken = []
    for target in targets:
        page, _, anchor = target.partition("#")
        linked = ROOT / page
        if not linked.is_file() or (anchor and anchor not in _anchors(linked.read_text(encoding="utf-8"))):
            broken.append(target)
    assert not broken


def test_metadata_doc_names_every_profile() -> None:
    """The `profile` row of docs/metadata.md's key table names every profile, each GPM variant as its suffix."""
    text = (DOCS / "metadata.md").read_text(encoding="utf-8")
    [row] = [row for row in _markdown_table(text, "key", "type", "default") if _name(row["key"]) == "profile"]
    named = set(re.findall(r"`([a-z-]+)`", row["allowed"]))
    expanded = named | {f"{name}-gpm" for name in named if "`-gpm`" in row["allowed"]}
    assert set(PROFILES) <= expanded
