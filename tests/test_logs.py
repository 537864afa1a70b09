"""Log set-up: one JSON event per line, including the stdlib loggers of grpclib and asyncio."""

from __future__ import annotations

import json
import logging

import pytest

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
