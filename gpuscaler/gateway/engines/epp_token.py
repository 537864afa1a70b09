"""The EPP's bearer token: a short-lived ServiceAccount token from the TokenRequest API, and who may receive it.

The EPP (GIE v1.5.0, ``--metrics-endpoint-auth`` true by default, ``cmd/epp/runner/runner.go:276-281``) guards
/metrics with controller-runtime's ``filters.WithAuthenticationAndAuthorization`` (v0.23.3,
``pkg/metrics/filters/filters.go:46-58``): a TokenReview with no audiences of its own, so the API server checks
the token against its own audiences, then a SubjectAccessReview for ``get`` on the path ``/metrics``. So the
TokenRequest names no audience (the API server fills in its own, the only one that review accepts), and the
token's power is the ServiceAccount's RBAC: ``get`` on ``nonResourceURLs: /metrics`` alone.

Lifetime: ``TOKEN_SECONDS`` (600 s, the least the API server issues), asked again once half has passed; a
token is asked for only when an EPP read needs one, and by one request at a time. A failed request is not
retried in a loop of ours: the scraper's next read of an EPP asks again, no sooner than ``RETRY_AFTER_SECONDS``
later; meanwhile a token that has not expired is still used, and without one every EPP read fails naming the
failure (the signal is UNAVAILABLE, never 0). The token is never logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.gateway.engines.page_reader import ScrapeFailed
from gpuscaler.model.pods import PodInfo
from gpuscaler.signals.engines.pods import Endpoint
from gpuscaler.signals.engines.source import PodKey

log = structlog.get_logger(__name__)

TOKEN_SECONDS = 600
RETRY_AFTER_SECONDS = 5.0

# Asks the API for a token: (the token, its lifetime in seconds); raises TokenUnavailable naming why not.
RequestToken = Callable[[], Awaitable[tuple[str, float]]]


class TokenUnavailable(Exception):
    """No token could be had: the message says why (RBAC, a missing ServiceAccount, the API unreachable)."""


def token_requester(api_client_factory: Callable[[], client.ApiClient], namespace: str, name: str) -> RequestToken:
    """TokenRequest for ServiceAccount ``namespace/name`` through the Kubernetes API client."""

    async def request() -> tuple[str, float]:
        body = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=TOKEN_SECONDS)
        )
        api = api_client_factory()
        try:
            answer = await client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, body)
        except ApiException as error:
            raise TokenUnavailable(
                f"TokenRequest for ServiceAccount {namespace}/{name}: HTTP {error.status} {error.reason}"
                + (" (the gateway needs 'create' on serviceaccounts/token for it)" if error.status == 403 else "")
            ) from None
        except (OSError, TimeoutError, ValueError) as error:
            raise TokenUnavailable(f"TokenRequest for ServiceAccount {namespace}/{name}: {error!r}") from None
        finally:
            await api.close()
        status = answer.status
        if status is None or not status.token:
            raise TokenUnavailable(f"TokenRequest for ServiceAccount {namespace}/{name}: the answer held no token")
        return status.token, float(answer.spec.expiration_seconds or TOKEN_SECONDS)

    return request


class EppToken:
    """The current token, asked for when a read needs one and half its lifetime has passed."""

    def __init__(self, request: RequestToken, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._request = request
        self._clock = clock
        self._token: str | None = None
        self._expires_at = 0.0
        self._refresh_at = 0.0
        self._failed: str | None = None
        self._retry_at = 0.0
        self._asking: asyncio.Task[None] | None = None
        self.requests = 0  # TokenRequests made, for tests and /metrics

    async def bearer(self) -> str:
        """The token to send; TokenUnavailable when none is valid now."""
        now = self._clock()
        if now >= self._refresh_at and now >= self._retry_at:
            if self._asking is None:
                self._asking = asyncio.get_running_loop().create_task(self._ask(), name="epp-token-request")
            asking = self._asking
            if self._token is None or now >= self._expires_at:
                await asyncio.shield(asking)
        if self._token is not None and self._clock() < self._expires_at:
            return self._token
        raise TokenUnavailable(self._failed or "no token yet")

    async def _ask(self) -> None:
        try:
            self.requests += 1
            asked_at = self._clock()
            token, lifetime = await self._request()
            self._token, self._failed = token, None
            self._expires_at = asked_at + lifetime
            self._refresh_at = asked_at + lifetime / 2
        except TokenUnavailable as error:
            if self._failed != str(error):
                log.warning("epp_token_failed", error=str(error), retry_after=RETRY_AFTER_SECONDS)
            self._failed = str(error)
            self._retry_at = self._clock() + RETRY_AFTER_SECONDS
        finally:
            self._asking = None


class Pods(Protocol):
    """The pod directory, as far as the token needs it."""

    def lookup(self, namespace: str, pod: str) -> PodInfo | None: ...


class Pickers(Protocol):
    """``directory.endpoint_pickers.EndpointPickers``, as far as the token needs it."""

    def problem(self) -> str | None: ...

    def pool_of(self, info: PodInfo) -> str | None: ...


class EppCredentials:
    """``page_reader.Authorize``: the token for a pod an InferencePool's endpointPickerRef names, else none."""

    def __init__(self, token: EppToken, pods: Pods, pickers: Pickers) -> None:
        self.token = token
        self._pods = pods
        self._pickers = pickers

    async def __call__(self, pod: PodKey, endpoint: Endpoint) -> str | None:
        info = self._pods.lookup(*pod)
        # The address read must be the one the API gives this very pod now, on the pod network: never a stale
        # address, nor a node's.
        if info is None or info.host_network or info.ip != endpoint.host:
            return None
        problem = self._pickers.problem()
        if problem is not None:
            raise ScrapeFailed("error", f"cannot tell whether the pod is an InferencePool's endpoint picker: {problem}")
        if self._pickers.pool_of(info) is None:
            return None
        try:
            return await self.token.bearer()
        except TokenUnavailable as error:
            raise ScrapeFailed("error", f"no bearer token for the endpoint picker: {error}") from None
