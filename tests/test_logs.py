"""Log set-up: one JSON event per line, including the stdlib loggers of grpclib and asyncio."""

from __future__ import annotations

import json
import logging

import pytest
from h2.exceptions import StreamClosedError

from gpuscaler import logs


def test_stdlib_exceptions_keep_their_traceback_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    """An exception logged by a library through the stdlib is one JSON line with its traceback as text."""
    logs.configure(log_format="json", level="info")
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("grpclib.server").exception("Application error")
        [line] = capsys.readouterr().err.strip().splitlines()
        event = json.loads(line)
        assert event["event"] == "Application error"
        assert event["level"] == "error"
        assert "ValueError: boom" in event["exception"]
        assert "Traceback (most recent call last)" in event["exception"]
    finally:
        with capsys.disabled():  # the real stderr: the captured one closes with this test
            logs.configure(log_format="console", level="debug")


def test_a_client_reset_while_we_answer_is_not_logged_as_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """grpclib's "Application error" for h2's StreamClosedError is dropped; any other error still shows."""
    logs.configure(log_format="json", level="info")
    try:
        for error in (StreamClosedError(3), RuntimeError("ours")):
            try:
                raise error
            except Exception:
                logging.getLogger("grpclib.server").exception("Application error")
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "RuntimeError: ours" in json.loads(line)["exception"]
    finally:
        with capsys.disabled():
            logs.configure(log_format="console", level="debug")
