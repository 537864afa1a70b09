"""structlog set-up: one key/value event per line, JSON in containers, console on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import Literal

from h2.exceptions import StreamClosedError

# structlog imports rich whenever it is installed (it is, for `gpuscaler query`), to render exceptions
# on a console: 5 MiB and 50 ms of the agent's start. Our processors format exceptions as text before
# any renderer sees them (format_exc_info), so structlog never uses rich here: import it with rich
# hidden. The CLI imports this module before any other of ours that uses structlog.
_rich_was_loaded = "rich" in sys.modules
if not _rich_was_loaded:
    sys.modules["rich"] = None  # type: ignore[assignment]  # makes `import rich` raise ImportError
try:
    import structlog
finally:
    if not _rich_was_loaded:
        del sys.modules["rich"]

LogFormat = Literal["json", "console"]
LOG_LEVELS = ("debug", "info", "warning", "error")


def default_format() -> LogFormat:
    """JSON when stderr is not a terminal (a container's log), console when a person is watching it."""
    return "console" if sys.stderr.isatty() else "json"


def configure(*, log_format: LogFormat, level: str, node: str | None = None) -> None:
    """Route structlog (and the stdlib loggers of grpclib and friends) to stderr."""
    numeric = logging.getLevelNamesMapping()[level.upper()]
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    if node is not None:
        structlog.contextvars.bind_contextvars(node=node)
    # grpclib logs "Request was cancelled" at INFO for every stream KEDA drops; that is our stream_closed.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            # grpclib and asyncio log exceptions through the stdlib: render their tracebacks as text too.
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
            foreign_pre_chain=shared,
        )
    )
    handler.addFilter(drop_client_resets)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))


def drop_client_resets(record: logging.LogRecord) -> bool:
    """False for grpclib's "Application error" when the client reset its stream while we answered it.

    h2 knows the stream is closed a moment before grpclib does, so an answer written in that moment fails with
    StreamClosedError; the client went away, which rpc_tracking counts as CANCELLED. Nothing else is dropped.
    """
    error = record.exc_info[1] if record.exc_info else None
    return not (record.name.startswith("grpclib") and isinstance(error, StreamClosedError))
