"""Two independent clients of KEDA's ExternalScaler behind one interface: ours (grpclib) and Google's (grpcio).

Each client holds ONE channel, as KEDA holds one connection per scaler address; every call and every
stream of a client goes over it. Failures of either library become ``RpcFailure(code, message)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.v1.health_pb2 import HealthCheckRequest

from e2e.support.agent import CONSOLE_SCRIPT, HEALTH_CHECK_METHOD, AgentProcess
from e2e.support.certs import SERVER_NAME, grpcio_credentials
from e2e.support.keda_grpcio import KedaProto
from gpuscaler.client.channels import ClientOptions, client_address, open_channel
from gpuscaler.generated import externalscaler as keda

ClientKind = Literal["grpclib", "grpcio"]
CLIENT_KINDS: tuple[ClientKind, ...] = ("grpclib", "grpcio")
CALL_TIMEOUT_SECONDS = 10.0
Metadata = dict[str, str]
T = TypeVar("T")


class RpcFailure(Exception):
    """A call ended with a gRPC status other than OK."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Spec:
    """One metric spec GetMetricSpec answered, the same whichever client library asked."""

    metric_name: str
    target_size: int
    target_size_float: float


@dataclass(frozen=True, slots=True)
class Value:
    """One metric value GetMetrics answered, the same whichever client library asked."""

    metric_name: str
    metric_value: int
    metric_value_float: float


@dataclass(eq=False)
class ActiveStream:
    """One open StreamIsActive. Messages queue up as they arrive, stamped with ``time.monotonic()``."""

    received: list[tuple[float, bool]] = field(default_factory=list)
    status: tuple[str, str] | None = None
    _queue: asyncio.Queue[bool | None] = field(default_factory=asyncio.Queue)
    _task: asyncio.Task[None] | None = None
    _cancel: Callable[[], None] = lambda: None

    def _start(self, consume: Callable[[Callable[[bool], None]], Awaitable[tuple[str, str]]]) -> None:
        async def run() -> None:
            try:
                self.status = await consume(self._put)
            finally:
                self._queue.put_nowait(None)

        self._task = asyncio.create_task(run())

    def _put(self, active: bool) -> None:
        self.received.append((time.monotonic(), active))
        self._queue.put_nowait(active)

    async def next(self, timeout: float = CALL_TIMEOUT_SECONDS) -> bool:
        """The next message; RpcFailure if the stream ended first (OK included), TimeoutError if none came."""
        async with asyncio.timeout(timeout):
            item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # stay ended for later calls
            code, message = self.status or ("CANCELLED", "stream task was cancelled")
            raise RpcFailure(code, message or "the stream ended without a message")
        return item

    async def no_message(self, seconds: float) -> None:
        """Fail if a message arrives (or the stream ends) within ``seconds``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                item = await self._queue.get()
                raise AssertionError(f"expected no message for {seconds:g}s, got {item!r} (status {self.status})")

    async def ended(self, timeout: float = CALL_TIMEOUT_SECONDS) -> tuple[str, str]:
        """Wait for the stream's end; its status code name and message."""
        assert self._task is not None
        async with asyncio.timeout(timeout):
            await asyncio.shield(self._task)
        assert self.status is not None
        return self.status

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def close(self) -> None:
        self._cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class ScalerClient(ABC):
    """The four ExternalScaler calls as KEDA makes them, over one channel."""

    kind: ClientKind

    @abstractmethod
    async def is_active(self, metadata: Metadata, *, timeout: float = CALL_TIMEOUT_SECONDS) -> bool: ...

    @abstractmethod
    async def get_metric_spec(self, metadata: Metadata, *, timeout: float = CALL_TIMEOUT_SECONDS) -> list[Spec]: ...

    @abstractmethod
    async def get_metrics(
        self, metadata: Metadata, metric_name: str, *, timeout: float = CALL_TIMEOUT_SECONDS
    ) -> list[Value]: ...

    @abstractmethod
    def stream_is_active(self, metadata: Metadata, *, name: str = "app", namespace: str = "ml") -> ActiveStream: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def metric_value(self, metadata: Metadata) -> float:
        """GetMetricSpec, then GetMetrics with the name the spec gave: the float KEDA would read."""
        [spec] = await self.get_metric_spec(metadata)
        [value] = await self.get_metrics(metadata, spec.metric_name)
        return value.metric_value_float


class GrpclibScaler(ScalerClient):
    """Our own client: betterproto2 stubs over a grpclib channel from ``gpuscaler.client.channels``."""

    kind: ClientKind = "grpclib"

    def __init__(self, channel: Any, exit_stack: contextlib.AsyncExitStack) -> None:
        self.channel = channel
        self._stub = keda.ExternalScalerStub(channel)
        self._exit_stack = exit_stack

    @classmethod
    async def connect(cls, agent: AgentProcess, *, client_cert: bool | None = None) -> GrpclibScaler:
        tls = agent.tls
        with_cert = agent.mtls if client_cert is None else client_cert
        options = ClientOptions(
            address=client_address(agent.address),
            tls_ca=tls.ca if tls else None,
            tls_cert=tls.client_cert if tls and with_cert else None,
            tls_key=tls.client_key if tls and with_cert else None,
            server_name=SERVER_NAME if tls else None,
        )
        stack = contextlib.AsyncExitStack()
        channel = await stack.enter_async_context(open_channel(options))
        return cls(channel, stack)

    @staticmethod
    def _ref(metadata: Metadata, name: str = "app", namespace: str = "ml") -> keda.ScaledObjectRef:
        return keda.ScaledObjectRef(name=name, namespace=namespace, scaler_metadata=metadata)

    @staticmethod
    @contextlib.contextmanager
    def _failures() -> Any:
        try:
            yield
        except GRPCError as error:
            raise RpcFailure(error.status.name, error.message or "") from None
        except TimeoutError:  # grpclib's deadline (TimeoutError is also an OSError: keep this first)
            raise RpcFailure("DEADLINE_EXCEEDED", "the client's deadline passed") from None
        except (StreamTerminatedError, OSError) as error:  # grpcio says UNAVAILABLE for a failed connection
            raise RpcFailure("UNAVAILABLE", f"{type(error).__name__}: {error}") from None

    async def is_active(self, metadata: Metadata, *, timeout: float = CALL_TIMEOUT_SECONDS) -> bool:
        with self._failures():
            return (await self._stub.is_active(self._ref(metadata), timeout=timeout)).result

    async def get_metric_spec(self, metadata: Metadata, *, timeout: float = CALL_TIMEOUT_SECONDS) -> list[Spec]:
        with self._failures():
            answer = await self._stub.get_metric_spec(self._ref(metadata), timeout=timeout)
        return [Spec(s.metric_name, s.target_size, s.target_size_float) for s in answer.metric_specs]

    async def get_metrics(
        self, metadata: Metadata, metric_name: str, *, timeout: float = CALL_TIMEOUT_SECONDS
    ) -> list[Value]:
        request = keda.GetMetricsRequest(scaled_object_ref=self._ref(metadata), metric_name=metric_name)
        with self._failures():
            answer = await self._stub.get_metrics(request, timeout=timeout)
        return [Value(v.metric_name, v.metric_value, v.metric_value_float) for v in answer.metric_values]

    def stream_is_active(self, metadata: Metadata, *, name: str = "app", namespace: str = "ml") -> ActiveStream:
        stream = ActiveStream()
        ref = self._ref(metadata, name, namespace)

        async def consume(put: Callable[[bool], None]) -> tuple[str, str]:
            try:
                async for response in self._stub.stream_is_active(ref):
                    put(response.result)
            except GRPCError as error:
                return error.status.name, error.message or ""
            except StreamTerminatedError as error:
                return "TERMINATED", str(error)
            except ConnectionError as error:
                return "UNAVAILABLE", repr(error)
            return "OK", ""

        stream._start(consume)
        return stream

    async def close(self) -> None:
        await self._exit_stack.aclose()


class GrpcioScaler(ScalerClient):
    """Google's client: stubs generated from KEDA's proto, on one ``grpc.aio`` channel."""

    kind: ClientKind = "grpcio"

    def __init__(self, channel: Any, proto: KedaProto) -> None:
        self.channel = channel
        self.proto = proto
        self._stub = proto.stub(channel)

    @classmethod
    async def connect(
        cls,
        agent: AgentProcess,
        proto: KedaProto,
        *,
        client_cert: bool | None = None,
        options: list[tuple[str, Any]] | None = None,
    ) -> GrpcioScaler:
        extra = list(options or [])
        if agent.tls is None:
            channel = grpc.aio.insecure_channel(agent.address, options=extra)
        else:
            with_cert = agent.mtls if client_cert is None else client_cert
            credentials = grpcio_credentials(agent.tls, client_cert=with_cert)
            channel = grpc.aio.secure_channel(agent.address, credentials, options=agent.tls.grpcio_options + extra)
        return cls(channel, proto)

    @staticmethod
    @contextlib.asynccontextmanager
    async def _failures() -> AsyncIterator[None]:
        try:
            yield
        except grpc.aio.AioRpcError as error:
            raise RpcFailure(error.code().name, error.details() or "") from None

    async def is_active(self, metadata: Metadata, *, timeout: float = CALL_TIMEOUT_SECONDS) -> bool:
        async with self._failures():
            answer = await self._stub.IsActive(self.proto.ref(metadata), timeout=timeout)
        return bool(answer.result)

    async def get_metric_spec(self, metadata: Metadata, *, timeout: float = CALL_TIMEOUT_SECONDS) -> list[Spec]:
        async with self._failures():
            answer = await self._stub.GetMetricSpec(self.proto.ref(metadata), timeout=timeout)
        return [Spec(s.metricName, s.targetSize, s.targetSizeFloat) for s in answer.metricSpecs]

    async def get_metrics(
        self, metadata: Metadata, metric_name: str, *, timeout: float = CALL_TIMEOUT_SECONDS
    ) -> list[Value]:
        async with self._failures():
            answer = await self._stub.GetMetrics(self.proto.metrics_request(metadata, metric_name), timeout=timeout)
        return [Value(v.metricName, v.metricValue, v.metricValueFloat) for v in answer.metricValues]

    def stream_is_active(self, metadata: Metadata, *, name: str = "app", namespace: str = "ml") -> ActiveStream:
        call = self._stub.StreamIsActive(self.proto.ref(metadata, name=name, namespace=namespace))
        stream = ActiveStream(_cancel=call.cancel)

        async def consume(put: Callable[[bool], None]) -> tuple[str, str]:
            try:
                async for response in call:
                    put(bool(response.result))
            except grpc.aio.AioRpcError as error:
                return error.code().name, error.details() or ""
            code = await call.code()
            return code.name, (await call.details()) or ""

        stream._start(consume)
        return stream

    async def close(self) -> None:
        await self.channel.close()


async def connect(kind: ClientKind, agent: AgentProcess, proto: KedaProto) -> ScalerClient:
    """A client of ``agent``'s ExternalScaler over the library ``kind`` names: grpclib, or grpcio (``proto``)."""
    if kind == "grpclib":
        return await GrpclibScaler.connect(agent)
    return await GrpcioScaler.connect(agent, proto)


async def refusal(call: Awaitable[object]) -> RpcFailure:
    """The error status ``call`` ends with; AssertionError if it answers instead."""
    try:
        answer = await call
    except RpcFailure as failure:
        return failure
    raise AssertionError(f"expected an error status, got {answer!r}")


async def outcome(call: Awaitable[T]) -> T | RpcFailure:
    """What ``call`` answered, or the error status it ended with."""
    try:
        return await call
    except RpcFailure as failure:
        return failure


async def query_json(
    address: str, metadata: Mapping[str, str], *, scaled_object: str | None = None, flags: Sequence[str] = ()
) -> dict[str, Any]:
    """``gpuscaler query --output json`` against ``address`` (with ``flags``: TLS files): the four RPCs as KEDA
    makes them (for ``scaled_object``, NAMESPACE/NAME, when given), and the explanation."""
    argv = [str(CONSOLE_SCRIPT), "query", "--address", address, "--output", "json", *flags]
    if scaled_object is not None:
        argv += ["--scaled-object", scaled_object]
    argv += [f"{key}={value}" for key, value in metadata.items()]
    result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)
    try:
        answer: dict[str, Any] = json.loads(result.stdout)
    except ValueError:
        raise AssertionError(f"gpuscaler query printed no JSON:\n{result.stdout}\n{result.stderr}") from None
    return answer


def http_probe(port: int, *, source: str = "127.0.0.1", timeout: float = 3.0) -> bool:
    """The kubelet's HTTP probe (GET /healthz on 127.0.0.1 from ``source``, the node's address): whether it got 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def grpc_probe(address: str, *, timeout: float = 3.0) -> bool:
    """The kubelet's gRPC probe (plaintext grpc.health.v1 Check) on a connection of its own: whether it was answered."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        check = channel.unary_unary(HEALTH_CHECK_METHOD, request_serializer=HealthCheckRequest.SerializeToString)
        check(HealthCheckRequest(), timeout=timeout)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()
