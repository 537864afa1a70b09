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
failure (the signal is UNAVAILABLE, never 0). A TokenRequest that takes longer than the scrape timeout
(``--engine-scrape-timeout``: the EPP read waiting for it is a scrape) fails. The token is never logged.

A read path (Explain, a preview of KEDA's calls) changes nothing: it asks for no token (a TokenRequest is an API
write) and counts nothing; it sends a token already held, or reads without one and says there is none yet.

Bound: with the gateway's own pod known (POD_NAME and POD_UID from the downward API), the TokenRequest names it as
``boundObjectRef``, so the API server stops accepting the token once that pod is gone; without (not in a cluster)
the token is asked for unbound, and the log says so once.

Its address: only a pod that is Running and not being deleted, read at the address the API gives it now, off its
node's network. A Failed or Succeeded pod keeps its podIP in the API while the CNI may give that IP to another pod,
and the scraper reads a wanted pod for up to two minutes after it stops being asked.

Trusted: only a pod in one of ``--epp-namespaces`` can receive it. Anyone who can create an InferencePool, a
Service and a pod in a namespace could otherwise aim an endpointPickerRef at their own pod; the namespaces listed
are the ones whose InferencePools the operator trusts to say which pods are EPPs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

import aiohttp
import structlog
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.gateway.engines.page_reader import NOT_A_PICKER, ScrapeFailed, Withheld
from gpuscaler.model.pods import PodInfo
from gpuscaler.signals.engines.pods import Endpoint
from gpuscaler.signals.engines.source import PodKey

log = structlog.get_logger(__name__)

TOKEN_SECONDS = 600
RETRY_AFTER_SECONDS = 5.0
REQUEST_OUTCOMES = ("ok", "failed")
# Why an EPP read went without the token (gpuscaler_gateway_epp_token_withheld_total{reason}).
WITHHELD_REASONS = ("address", "namespace", "not_a_picker", "watch", "no_token")

# Asks the API for a token: (the token, its lifetime in seconds); raises TokenUnavailable naming why not.
RequestToken = Callable[[], Awaitable[tuple[str, float]]]


class TokenUnavailable(Exception):
    """No token could be had: the message says why (RBAC, a missing ServiceAccount, the API unreachable)."""


def bound_to(own_pod: tuple[str, str, str] | None, namespace: str) -> tuple[str, str] | None:
    """The pod (name, uid) to bind the token to: the gateway's own, when it is in the ServiceAccount's namespace
    (the API server looks the bound pod up there); None, logged once, when it cannot be bound."""
    if own_pod is None:
        log.warning(
            "epp_token_unbound",
            detail="POD_NAMESPACE, POD_NAME and POD_UID are not all set (not in a cluster?): the EPP's token is not "
            "bound to the gateway's pod, so it stays valid for its 600 s after this gateway is gone",
        )
        return None
    if own_pod[0] != namespace:
        log.warning(
            "epp_token_unbound",
            detail=f"the gateway's pod is in namespace {own_pod[0]}, the ServiceAccount in {namespace}: a token is "
            "bound only to a pod of its ServiceAccount's namespace, so it is not bound and stays valid for its "
            "600 s after this gateway is gone",
        )
        return None
    return own_pod[1], own_pod[2]


def token_request_body(bound_pod: tuple[str, str] | None) -> client.AuthenticationV1TokenRequest:
    """The TokenRequest: no audience, ``TOKEN_SECONDS``, bound to pod (name, uid) ``bound_pod`` when known."""
    bound = None
    if bound_pod is not None:
        bound = client.V1BoundObjectReference(api_version="v1", kind="Pod", name=bound_pod[0], uid=bound_pod[1])
    return client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=TOKEN_SECONDS, bound_object_ref=bound)
    )


def token_requester(
    api_client_factory: Callable[[], client.ApiClient],
    namespace: str,
    name: str,
    *,
    bound_pod: tuple[str, str] | None = None,
    timeout_seconds: float,
) -> RequestToken:
    """TokenRequest for ServiceAccount ``namespace/name`` through the Kubernetes API client, bound to pod (name,
    uid) ``bound_pod`` of ``namespace`` when given (``bound_to``), failing after ``timeout_seconds``."""

    async def request() -> tuple[str, float]:
        body = token_request_body(bound_pod)
        api = api_client_factory()
        try:
            answer = await client.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, body, _request_timeout=timeout_seconds
            )
        except ApiException as error:
            raise TokenUnavailable(
                f"TokenRequest for ServiceAccount {namespace}/{name}: HTTP {error.status} {error.reason}"
                + (" (the gateway needs 'create' on serviceaccounts/token for it)" if error.status == 403 else "")
            ) from None
        except (OSError, TimeoutError, ValueError, aiohttp.ClientError) as error:
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
        self._refused_at = -RETRY_AFTER_SECONDS
        self._asking: asyncio.Task[None] | None = None
        # TokenRequests made, by outcome (gpuscaler_gateway_epp_token_requests_total).
        self.requests = dict.fromkeys(REQUEST_OUTCOMES, 0)

    async def bearer(self) -> str:
        """The token to send; TokenUnavailable when none is valid now."""
        now = self._clock()
        if now >= self._refresh_at and now >= self._retry_at:
            if self._asking is None:
                self._asking = asyncio.get_running_loop().create_task(self._ask(), name="epp-token-request")
            asking = self._asking
            if self._token is None or now >= self._expires_at:
                await asyncio.shield(asking)
        held = self.held()
        if held is not None:
            return held
        raise TokenUnavailable(self._failed or "no token yet")

    def refused(self, token: str) -> None:
        """The EPP refused ``token``: if it is the one held, ask for another at the next read, at most once every
        RETRY_AFTER_SECONDS (a refusal that a new token does not cure must not make every read a TokenRequest)."""
        now = self._clock()
        if token == self._token and now >= self._refused_at + RETRY_AFTER_SECONDS:
            self._refused_at = now
            self._token, self._expires_at, self._refresh_at = None, 0.0, now

    def held(self) -> str | None:
        """The token held now, if it has not expired; asks for none (a read path's)."""
        if self._token is not None and self._clock() < self._expires_at:
            return self._token
        return None

    async def _ask(self) -> None:
        try:
            asked_at = self._clock()
            token, lifetime = await self._request()
            self.requests["ok"] += 1
            self._token, self._failed = token, None
            self._expires_at = asked_at + lifetime
            self._refresh_at = asked_at + lifetime / 2
        except TokenUnavailable as error:
            self._fail(str(error))
        except Exception as error:  # a bug of ours or the client's: failed alike, never a task's lost exception
            log.exception("epp_token_request_error")
            self._fail(f"TokenRequest: {error!r}")
        finally:
            self._asking = None

    def _fail(self, failure: str) -> None:
        self.requests["failed"] += 1
        if self._failed != failure:
            log.warning("epp_token_failed", error=failure, retry_after=RETRY_AFTER_SECONDS)
        self._failed = failure
        self._retry_at = self._clock() + RETRY_AFTER_SECONDS


class Pods(Protocol):
    """The pod directory, as far as the token needs it."""

    def lookup(self, namespace: str, pod: str) -> PodInfo | None: ...


class Pickers(Protocol):
    """``directory.endpoint_pickers.EndpointPickers``, as far as the token needs it."""

    def problem(self) -> str | None: ...

    def pool_of(self, info: PodInfo) -> str | None: ...


class EppCredentials:
    """``page_reader.Authorize``: the token for a pod an InferencePool of a trusted namespace names, else none."""

    def __init__(self, token: EppToken, pods: Pods, pickers: Pickers, namespaces: Collection[str]) -> None:
        self.token = token
        self._pods = pods
        self._pickers = pickers
        self._namespaces = frozenset(namespaces)
        # EPP reads sent no token, by reason (WITHHELD_REASONS).
        self.withheld = dict.fromkeys(WITHHELD_REASONS, 0)

    def refused(self, token: str) -> None:
        """``page_reader.Authorize.refused``: the token is dropped and another asked for."""
        self.token.refused(token)

    def _withhold(self, reason: str, why: str, count: bool) -> Withheld:
        if count:
            self.withheld[reason] += 1
        return Withheld(reason, why)

    async def __call__(self, pod: PodKey, endpoint: Endpoint, *, ask: bool = True) -> str | Withheld:
        """The token for ``pod`` read at ``endpoint``, or why it is sent none. ``ask`` False (a read path): ask for
        no token and count nothing."""
        info = self._pods.lookup(*pod)
        # The address read must be the one the API gives this very pod now, on the pod network, while it runs: never
        # a stale address, a node's, or one a Failed, Succeeded or terminating pod may have handed on.
        if info is None or info.host_network or info.ip != endpoint.host:
            return self._withhold("address", "the address read is not the pod's own now, so it is sent no token", ask)
        if info.phase != "Running" or info.deleting:
            state = "being deleted" if info.deleting else f"in phase {info.phase or 'unknown'}, not Running"
            why = f"the pod is {state}, so its address may be another pod's now and it is sent no token"
            return self._withhold("address", why, ask)
        if info.namespace not in self._namespaces:
            return self._withhold(
                "namespace",
                f"namespace {info.namespace} is not one of --epp-namespaces (the namespaces whose InferencePools "
                "are trusted to name the EPP), so the pod is sent no token (docs/engines.md)",
                ask,
            )
        problem = self._pickers.problem()
        if problem is not None:
            if ask:
                self.withheld["watch"] += 1
            raise ScrapeFailed("error", f"cannot tell whether the pod is an InferencePool's endpoint picker: {problem}")
        if self._pickers.pool_of(info) is None:
            return self._withhold("not_a_picker", NOT_A_PICKER, ask)
        if not ask:
            held = self.token.held()
            if held is not None:
                return held
            return Withheld("no_token", "no token yet (a read asks for none; the first scrape of a query asks)")
        try:
            return await self.token.bearer()
        except TokenUnavailable as error:
            self.withheld["no_token"] += 1
            raise ScrapeFailed("error", f"no bearer token for the endpoint picker: {error}") from None
