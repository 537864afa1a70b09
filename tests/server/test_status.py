"""Errors to gRPC statuses: the code table, and messages cut to fit a trailer."""

from __future__ import annotations

import urllib.parse

import pytest

from gpuscaler.model.errors import InvalidMetadata, Unavailable, UnknownMetricName, Unsupported
from gpuscaler.server.status import MAX_MESSAGE_BYTES, shorten, status_for

# What grpc-message keeps as is (RFC 3986 unreserved is not the rule: gRPC keeps printable ASCII but '%').
KEPT = "".join(chr(code) for code in range(0x20, 0x7F) if code != ord("%"))


def on_the_wire(message: str) -> int:
    """Bytes ``message`` takes as grpc-message, where every byte but printable ASCII (and '%') is percent-encoded."""
    return len(urllib.parse.quote(message, safe=KEPT))


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidMetadata("x"), "INVALID_ARGUMENT"),
        (UnknownMetricName("x"), "NOT_FOUND"),
        (Unsupported("x"), "FAILED_PRECONDITION"),
        (Unavailable("x"), "UNAVAILABLE"),
    ],
)
def test_each_error_has_its_status(error: Exception, code: str) -> None:
    """Each error class maps to one gRPC status."""
    assert isinstance(error, InvalidMetadata | UnknownMetricName | Unsupported | Unavailable)
    assert status_for(error).name == code


@pytest.mark.parametrize(
    "message",
    [
        pytest.param("targetValue 'abc' is not a number", id="short"),
        pytest.param("targetValue '" + "9" * 20_000 + "' is not finite", id="ascii"),
        pytest.param("key '" + "é" * 9_000 + "' is unknown", id="two-byte"),
        pytest.param("key '" + "🙂" * 9_000 + "' is unknown", id="four-byte"),
        pytest.param("%" * 9_000, id="percent-signs"),
        pytest.param("a\nb" * 5_000, id="control-characters"),
    ],
)
def test_messages_fit_a_trailer_and_keep_head_and_tail(message: str) -> None:
    """A message is cut in the middle to at most the limit once percent-encoded; a short one is left alone."""
    cut = shorten(message)
    assert on_the_wire(cut) <= MAX_MESSAGE_BYTES
    if on_the_wire(message) <= MAX_MESSAGE_BYTES:
        assert cut == message
    else:
        assert cut.startswith(message[:10])
        assert cut.endswith(message[-5:])
        assert "characters left out" in cut
        assert on_the_wire(cut) > MAX_MESSAGE_BYTES - 200  # it keeps as much as fits, not a token prefix
