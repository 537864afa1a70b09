"""The agent's HTTP/2 transport: flow control, the stream limit and bounded bookkeeping on one connection."""

from __future__ import annotations

import asyncio
import struct
from typing import cast

import grpclib.const
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest
from grpclib.client import Channel

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.flags import DEFAULT_LIMITS
from gpuscaler.generated.externalscaler import (
    ExternalScalerStub,
    GetMetricsRequest,
    GetMetricsResponse,
    MetricValue,
    ScaledObjectRef,
)
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.server.transport import codec as codec_module
from gpuscaler.server.transport import h2 as h2_module
from gpuscaler.server.transport.h2 import BoundedH2Connection
from tests.conftest import StartAgent
from tests.waiting import until, until_result

WATCH_SNAPSHOTS = "/gpuscaler.v1.Agent/WatchSnapshots"
CONNECTION_WINDOW = 65_535  # HTTP/2's initial window, which only a WINDOW_UPDATE raises


def request_headers(path: str) -> list[tuple[str, str]]:
    """The HTTP/2 headers of a gRPC request for ``path``, as a client sends them."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "test"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


async def test_a_stream_held_by_the_connection_window_resumes_when_the_client_opens_it(
    start_agent: StartAgent,
) -> None:
    """Snapshots that fill the connection's flow-control window wait; a WINDOW_UPDATE on stream 0 resumes them."""
    agent: Agent = await start_agent("--poll-interval", "0.05", gpus=64)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    # Only the connection's window may hold the stream back: its own window is as large as allowed.
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.send_headers(1, request_headers(WATCH_SNAPSHOTS))
    client.send_data(1, struct.pack(">?I", False, 0), end_stream=True)
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
    received = 0

    async def read_until(condition: float) -> None:
        nonlocal received
        async with asyncio.timeout(10):
            while received < condition:
                data = await reader.read(65_536)
                assert data, "the agent closed the connection"
                for event in client.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        received += event.flow_controlled_length  # never acknowledged: the window only shrinks
                writer.write(client.data_to_send())

    try:
        writer.write(client.data_to_send())
        snapshot_size = 1024  # a 64-GPU snapshot is larger: the window fills within a few ticks
        await read_until(CONNECTION_WINDOW - snapshot_size)
        await asyncio.sleep(0.3)  # several ticks: anything the window allowed has arrived by now
        while data := await _read_now(reader):
            received += sum(
                e.flow_controlled_length for e in client.receive_data(data) if isinstance(e, h2.events.DataReceived)
            )
        assert received <= CONNECTION_WINDOW
        held = received

        client.increment_flow_control_window(1_000_000)  # stream 0: the whole connection
        writer.write(client.data_to_send())
        await read_until(held + 10 * snapshot_size)
    finally:
        writer.close()


async def _read_now(reader: asyncio.StreamReader) -> bytes:
    try:
        async with asyncio.timeout(0.05):
            return await reader.read(65_536)
    except TimeoutError:
        return b""


def _pair(max_streams: int) -> tuple[h2.connection.H2Connection, BoundedH2Connection]:
    """A client and our server connection, connected in memory, the server allowing ``max_streams`` streams."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    server = BoundedH2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams})
    for _ in range(3):  # prefaces, settings, acknowledgements
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    return client, server


def _call(client: h2.connection.H2Connection, server: BoundedH2Connection, stream_id: int, *, end: bool) -> None:
    """Open a stream (a request); with ``end`` the server answers and both sides close it."""
    client.send_headers(stream_id, request_headers("/x"), end_stream=end)
    server.receive_data(client.data_to_send())
    if end:
        server.send_headers(stream_id, [(":status", "200")], end_stream=True)
        client.receive_data(server.data_to_send())


def test_a_stream_past_the_limit_is_refused_and_the_connection_kept() -> None:
    """Open streams up to MAX_CONCURRENT_STREAMS pass, one more is refused alone, closed ones do not count."""
    client, server = _pair(max_streams=3)
    for stream_id in range(1, 2 * h2_module.SWEEP_EVERY_STREAMS, 2):
        _call(client, server, stream_id, end=True)  # finished calls never count against the limit
    first = 2 * h2_module.SWEEP_EVERY_STREAMS + 1
    for stream_id in (first, first + 2, first + 4):
        _call(client, server, stream_id, end=False)
    assert server.open_inbound_streams == 3
    # A client that ignores the limit has that stream refused (h2's client keeps it: make it forget).
    refused = 0

    def count() -> None:
        nonlocal refused
        refused += 1

    server.on_refused = count
    client.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 1000
    client.remote_settings.acknowledge()
    client.send_headers(first + 6, [*request_headers("/x"), ("x-only-in-this-block", "1")])
    client.send_data(first + 6, b"\0\0\0\0\0", end_stream=True)  # its body comes too, as clients send it
    assert server.receive_data(client.data_to_send()) == []
    events = client.receive_data(server.data_to_send())
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [(first + 6, h2.errors.ErrorCodes.REFUSED_STREAM)]
    assert refused == 1
    # The connection goes on, and HPACK stayed in step: a block that refers to the refused one's entries decodes.
    server.reset_stream(first)  # frees a place
    client.receive_data(server.data_to_send())
    client.send_headers(first + 8, [*request_headers("/x"), ("x-only-in-this-block", "1")], end_stream=True)
    [received, *_] = server.receive_data(client.data_to_send())
    assert isinstance(received, h2.events.RequestReceived)
    assert ("x-only-in-this-block", "1") in cast(list[tuple[str, str]], received.headers)


def test_closed_streams_do_not_pile_up() -> None:
    """Thousands of finished calls on one connection leave at most SWEEP_EVERY_STREAMS closed streams held."""
    client, server = _pair(max_streams=DEFAULT_LIMITS.max_streams)
    for stream_id in range(1, 20_000, 2):
        _call(client, server, stream_id, end=True)
        assert len(server.streams) <= h2_module.SWEEP_EVERY_STREAMS + 1


async def test_finished_calls_leave_the_task_table(start_agent: StartAgent) -> None:
    """Many calls on one connection leave no finished request task in grpclib's table, and never many."""
    agent: Agent = await start_agent()
    channel = Channel("127.0.0.1", agent.port)
    stub = ExternalScalerStub(channel)
    try:
        for _ in range(1_000):
            assert (await stub.is_active(ScaledObjectRef(scaler_metadata={}))).result is False
            [handler] = agent.frontend.server._handlers
            assert len(handler._tasks) <= 1
        await until(lambda: not handler._tasks)
    finally:
        channel.close()


def test_keda_requests_decode_once_per_distinct_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal request bytes give an equal message, decoded once; the kept ones stay bounded in count and size."""
    monkeypatch.setattr(codec_module, "REUSE_ENTRIES", 4)
    codec = codec_module.ReusingCodec()
    ref = ScaledObjectRef(name="app", namespace="ml", scaler_metadata={"gpuIndex": "0"})
    data = bytes(ref)
    first = codec.decode(data, ScaledObjectRef)
    assert first == ref
    assert codec.decode(bytes(bytearray(data)), ScaledObjectRef) is first  # equal bytes, another object
    for index in range(10):
        other = ScaledObjectRef(name=f"app-{index}", namespace="ml", scaler_metadata={"gpuIndex": "0"})
        assert codec.decode(bytes(other), ScaledObjectRef) == other
    assert len(codec._decoded) == 4
    big = ScaledObjectRef(name="app", scaler_metadata={"podSelector": "a" * codec_module.REUSE_MAX_BYTES})
    assert codec.decode(bytes(big), ScaledObjectRef) == big
    assert all(len(key[1]) <= codec_module.REUSE_MAX_BYTES for key in codec._decoded)


def test_a_reused_answer_is_encoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same GetMetrics answer object sends the bytes encoded the first time; another object gets its own."""
    monkeypatch.setattr(codec_module, "REUSE_ENTRIES", 4)
    codec = codec_module.ReusingCodec()
    encoded: list[GetMetricsResponse] = []
    serialize = GetMetricsResponse.SerializeToString

    def counted(self: GetMetricsResponse) -> bytes:
        encoded.append(self)
        return serialize(self)

    monkeypatch.setattr(GetMetricsResponse, "SerializeToString", counted)

    def answer(value: float) -> GetMetricsResponse:
        metric = MetricValue(metric_name="m", metric_value=1, metric_value_float=value)
        return GetMetricsResponse(metric_values=[metric])

    first = answer(0.5)
    assert codec.encode(first, GetMetricsResponse) == bytes(first)
    assert codec.encode(first, GetMetricsResponse) == bytes(first)
    assert encoded == [first]
    moved = answer(0.75)
    assert codec.encode(moved, GetMetricsResponse) == bytes(moved) != bytes(first)
    for index in range(10):
        assert codec.encode(answer(index), GetMetricsResponse) == bytes(answer(index))
    assert len(codec._encoded) == 4


async def test_get_metrics_answers_follow_the_value(start_agent: StartAgent) -> None:
    """A reused GetMetrics answer is given while the value holds, and a new one as soon as it moves."""
    agent = await start_agent("--poll-interval", "0.1")
    assert isinstance(agent.collector, FakeCollector)
    channel = Channel("127.0.0.1", agent.port)
    try:
        scaler = ExternalScalerStub(channel)
        ref = ScaledObjectRef(name="app", namespace="ml", scaler_metadata={"gpuIndex": "0"})
        [spec] = (await scaler.get_metric_spec(ref)).metric_specs
        request = GetMetricsRequest(scaled_object_ref=ref, metric_name=spec.metric_name)

        async def value() -> float:
            return (await scaler.get_metrics(request)).metric_values[0].metric_value_float

        for utilization in (10.0, 90.0, 10.0):
            agent.collector.set_values(0, {Metric.GPU_UTILIZATION: utilization})
            await until_result(value, utilization.__eq__)
            assert await value() == utilization
    finally:
        channel.close()


async def test_an_unknown_method_is_answered_unimplemented_as_grpc_go_expects(start_agent: StartAgent) -> None:
    """A method we lack is answered with a gRPC content-type, so grpc-go (KEDA) reads UNIMPLEMENTED.

    grpclib's own answer lacks the content-type, which grpc-go reports as UNKNOWN "malformed header".
    """
    agent: Agent = await start_agent()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    client.send_headers(1, request_headers("/externalscaler.ExternalScaler/StreamSomethingNew"))
    client.send_data(1, struct.pack(">?I", False, 0), end_stream=True)
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
    headers: dict[str, str] = {}
    try:
        writer.write(client.data_to_send())
        async with asyncio.timeout(10):
            while "grpc-status" not in headers:
                data = await reader.read(65_536)
                assert data, "the agent closed the connection"
                for event in client.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        headers.update((str(k), str(v)) for k, v in event.headers)
                writer.write(client.data_to_send())
    finally:
        writer.close()
    assert headers["content-type"].startswith("application/grpc")
    assert headers["grpc-status"] == str(grpclib.const.Status.UNIMPLEMENTED.value)
    assert "StreamSomethingNew" in headers["grpc-message"]
    assert agent.frontend.tracker.finished[("unknown", "UNIMPLEMENTED")] == 1  # one label for any unknown path
