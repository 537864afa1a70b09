"""A failed DNS lookup as the gateway's reasons say it: the name, what went wrong in words, and that it was DNS."""

from __future__ import annotations

import socket

import pytest

from gpuscaler.gateway.discovery import lookup_failure


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        pytest.param(
            socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
            "cannot resolve gpu-node-b: name not known (DNS)",
            id="no-such-name",
        ),
        pytest.param(
            socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
            "cannot resolve gpu-node-b: no answer yet, a temporary failure (DNS)",
            id="temporary",
        ),
        pytest.param(
            socket.gaierror(socket.EAI_FAIL, "Non-recoverable failure in name resolution"),
            "cannot resolve gpu-node-b: the DNS server failed (DNS)",
            id="server-failed",
        ),
        pytest.param(
            socket.gaierror(-12345, "Something Else Went Wrong"),
            "cannot resolve gpu-node-b: something else went wrong (DNS)",
            id="another-code-in-libc-s-words",
        ),
        pytest.param(socket.gaierror(), "cannot resolve gpu-node-b: lookup failed (DNS)", id="no-details"),
    ],
)
def test_a_failed_lookup_reads_in_words(error: socket.gaierror, reason: str) -> None:
    """Each getaddrinfo failure becomes one phrase naming the host, never the exception's repr."""
    assert lookup_failure("gpu-node-b", error) == reason
