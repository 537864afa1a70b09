"""The errors a user can cause or meet, each of which becomes one gRPC status (see ``server/status.py``).

Every message names the field, the value and what is allowed, so that KEDA's event on the
ScaledObject tells the operator what to fix.
"""

from __future__ import annotations


class GpuscalerError(Exception):
    """Base of every error that reaches a client as a gRPC status with our own message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidMetadata(GpuscalerError):
    """Trigger metadata is wrong: a key we do not know, or a value out of range (INVALID_ARGUMENT)."""


class TooManyPods(InvalidMetadata):
    """A pod selection reads more pods than one query may (``--engine-max-pods-per-selection``): the metadata
    that selects them is what to change (INVALID_ARGUMENT); the gateway counts each as its limit acting."""


class InvalidRequest(GpuscalerError):
    """A request field outside the trigger metadata is wrong, e.g. a fake GPU index (INVALID_ARGUMENT)."""


class UnknownMetricName(GpuscalerError):
    """GetMetrics asked for a metric name that the metadata does not produce (NOT_FOUND)."""


class Unsupported(GpuscalerError):
    """This server cannot answer the query as it is set up, and waiting will not help: a metric no selected GPU
    supports, a pod query without attribution or a pod directory, one window too many (FAILED_PRECONDITION)."""


class NotServed(GpuscalerError):
    """A call this server does not serve, and no other state of it would: a node's snapshot asked of a gateway
    (UNIMPLEMENTED, as gRPC answers a method a server lacks)."""


class Unavailable(GpuscalerError):
    """The answer is unknown now: no fresh sample, a node not heard, GPUs not read, a window still being computed.
    Never a 0 (UNAVAILABLE: KEDA retries, then falls back)."""


class StartupError(Exception):
    """The agent cannot start (a port in use, say); the CLI exits 1 with this one line."""


class ConfigError(Exception):
    """A flag, environment variable or scenario file is wrong; the CLI exits 2 with this message."""
