"""Evaluator.parse keeps parsed queries: same answers and same refusals as parsing afresh, in bounded memory."""

from __future__ import annotations

import pytest

import gpuscaler.signals.evaluator as evaluator_module
from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.query.metadata import parse_metadata
from gpuscaler.signals.evaluator import Evaluator
from tests.builders import gpu_trigger, history_of


@pytest.fixture
def evaluator() -> Evaluator:
    """An evaluator over an empty history; parsing needs no samples."""
    return Evaluator(history_of(poll_interval_seconds=1.0), clock=lambda: 0.0)


def test_same_metadata_gives_the_query_parsing_gives(evaluator: Evaluator) -> None:
    """A repeated call answers the query a fresh parse gives, for its own namespace."""
    metadata = {"workload": "trainer", "activationThreshold": "20"}
    first = evaluator.parse(metadata, "ml")
    assert evaluator.parse(dict(metadata), "ml") == first == parse_metadata(metadata, evaluator.limits, namespace="ml")
    assert gpu_trigger(evaluator.parse(metadata, "other")).value.pods != gpu_trigger(first).value.pods


def test_a_refusal_is_raised_each_time_with_the_same_message(evaluator: Evaluator) -> None:
    """Bad metadata is refused on every call with the message a fresh parse gives."""
    messages = set()
    for _ in range(3):
        with pytest.raises(InvalidMetadata) as refused:
            evaluator.parse({"activationTreshold": "5"})
        messages.add(str(refused.value))
    assert messages == {"unknown key 'activationTreshold'; did you mean 'activationThreshold'?"}


def test_the_order_of_keys_still_decides_which_unknown_key_is_named(evaluator: Evaluator) -> None:
    """The first unknown key in the request is the one named, as without the cache."""
    evaluator.parse({"gpuIndex": "0"})
    with pytest.raises(InvalidMetadata, match="'foo'"):
        evaluator.parse({"foo": "1", "bar": "2"})
    with pytest.raises(InvalidMetadata, match="'bar'"):
        evaluator.parse({"bar": "2", "foo": "1"})


def test_distinct_metadata_do_not_grow_memory_without_limit(
    evaluator: Evaluator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client sending ever new metadata leaves at most the bounded number of entries."""
    monkeypatch.setattr(evaluator_module, "PARSE_CACHE_ENTRIES", 8)
    for threshold in range(100):
        assert evaluator.parse({"activationThreshold": str(threshold)}).activation.activation_threshold == threshold
    assert len(evaluator._parsed) == 8


def test_large_metadata_is_parsed_but_not_kept(evaluator: Evaluator) -> None:
    """Metadata longer than the bounds is answered as usual and not kept."""
    uuids = ",".join(f"GPU-{i:08d}" for i in range(evaluator_module.PARSE_CACHE_MAX_CHARS // 10))
    query = gpu_trigger(evaluator.parse({"gpuUUID": uuids}))
    assert query.value.selection.uuids is not None
    assert len(query.value.selection.uuids) == evaluator_module.PARSE_CACHE_MAX_CHARS // 10
    assert evaluator._parsed == {}
    with pytest.raises(InvalidMetadata, match="unknown key 'key0'"):
        evaluator.parse({f"key{i}": "1" for i in range(evaluator_module.PARSE_CACHE_MAX_KEYS + 1)})
    assert evaluator._parsed == {}
