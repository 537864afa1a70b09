"""Hostile input through the real server: arbitrary metadata, oversized messages, and bytes that are not gRPC.

A ScaledObject is written by any tenant of the cluster, so its metadata is untrusted input. Whatever it
holds, the answer is a status that names the problem (never UNKNOWN or INTERNAL, which mean "our bug"),
the agent does not crash, and the next caller is served. The fixtures' teardown also fails a test whose
agent logged an error or did not exit 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.conftest import StartAgent
from e2e.support.agent import AgentProcess
from e2e.support.clients import RpcFailure, ScalerClient, outcome, refusal
from e2e.support.raw_h2 import PREFACE, grpc_call, grpc_frame, send_and_wait_for_close, unknown_frame
from e2e.support.sizes import FULL, FUZZ_EXAMPLES
from gpuscaler.generated.externalscaler import ScaledObjectRef
from gpuscaler.query.keys import KEDA_KEYS, QUERY_KEYS
from gpuscaler.server.transport.calls import MAX_RECEIVE_MESSAGE_BYTES
from gpuscaler.server.transport.h2 import MAX_HEADER_LIST_BYTES

# RESOURCE_EXHAUSTED: a request over MAX_RECEIVE_MESSAGE_BYTES, refused before it is read.
ANSWERED_CODES = {"INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}
# A status message travels in an HTTP/2 trailer; grpcio refuses trailers over 8 KiB.
MAX_MESSAGE_BYTES = 8 * 1024

KNOWN_KEYS = [*QUERY_KEYS, *sorted(KEDA_KEYS)]
TRICKY_VALUES = [
    *("", " ", "NaN", "nan", "-nan", "Inf", "-Inf", "infinity", "1e309", "-1e309", "1e-400", "4.9e-324"),
    *("-1", "-0", "0", "0.0001", "0.001", "1", "5", "50", "99.5", "100", "101", "1e6", "9" * 400),
    *("0x1F", "1_0", "٣", "½", "５", "5s", "500ms", "10m", "1h", "25h", "0s", "-5s", "1e3s", "nans"),
    *("0,1", "-1,0", ",", "0,,1", "7", "8", "99", "2147483648", "-2", " 3 "),
    *("max", "min", "avg", "sum", "median", "p99", "last", "MAX", "gpu_utilization", "power_draw"),
    *("temperature", "training", "batch", "vllm-inference", "GPU-fake-e2e-node-0", "true", "null"),
    *("\x00", "é", "🙂", "\u202e", "\ud7ff", "a\nb", "s0-gpuscaler"),
]
keys = st.one_of(
    st.sampled_from(KNOWN_KEYS),
    st.sampled_from(KNOWN_KEYS).map(lambda key: key + "FromEnv"),
    st.text(max_size=40),
)
values = st.one_of(
    st.sampled_from(TRICKY_VALUES),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.text(max_size=60),
    st.builds(lambda unit, count: unit * count, st.sampled_from(["9", "x", "é", "🙂", ","]), st.integers(1, 200_000)),
)
metadata_maps = st.dictionaries(keys, values, max_size=6)


@pytest.fixture
async def agent(start_agent: StartAgent) -> AgentProcess:
    """An agent with 8 idle fake GPUs, waiting for a request's message as long as the tests' own clients need.

    The grpclib client sends a call's headers, then spends seconds encoding a 16 MiB message on a busy
    machine, longer than the default --request-timeout; what these tests check is what the agent reads.
    """
    return await start_agent("--request-timeout", "300")


def check_refusal(failure: RpcFailure) -> None:
    """A refusal has an answered code (not UNKNOWN or INTERNAL), a message, and fits in grpcio's trailer limit."""
    assert failure.code in ANSWERED_CODES, failure
    assert failure.message, failure.code
    assert len(failure.message.encode()) <= MAX_MESSAGE_BYTES, (failure.code, len(failure.message))


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(metadata=metadata_maps)
async def test_arbitrary_metadata_gets_a_named_status(client: ScalerClient, metadata: dict[str, str]) -> None:
    """Any metadata map gets an answer or a specific, short, named status on every RPC; the server stays up."""
    name = "gpuscaler-gpu_utilization-sum"
    spec = await outcome(client.get_metric_spec(metadata))
    if isinstance(spec, RpcFailure):
        check_refusal(spec)
    else:
        [only] = spec
        assert only.target_size_float >= 0.001
        assert only.target_size >= 1
        name = only.metric_name

    for answer in (await outcome(client.get_metrics(metadata, name)), await outcome(client.is_active(metadata))):
        if isinstance(answer, RpcFailure):
            check_refusal(answer)

    stream = client.stream_is_active(metadata)
    try:
        await stream.next(timeout=0.5)
    except TimeoutError:
        pass  # a stream may wait for a value it cannot read yet
    except RpcFailure as failure:
        check_refusal(failure)
    finally:
        await stream.close()

    assert await client.is_active({}) is False  # the next caller is served


def sized_metadata(size: int) -> list[dict[str, str]]:
    """Metadata whose request is at most ``size`` bytes (and close to it): a long value, a long key, tiny keys.

    Tiny keys are the costliest to decode per byte, so they are the worst an accepted request can send.
    """
    overhead = len(bytes(ScaledObjectRef(name="app", namespace="ml", scaler_metadata={"": ""})))
    entry = len(bytes(ScaledObjectRef(scaler_metadata={"fffff": ""})))  # every key five hex digits
    return [
        {"targetValue": "9" * (size - overhead - 16)},
        {"é" * ((size - overhead - 16) // 2): "1"},
        {f"{i:05x}": "" for i in range((size - overhead) // entry)},
    ]


@pytest.mark.parametrize(
    ("size", "code"),
    [
        pytest.param(MAX_RECEIVE_MESSAGE_BYTES - 512, "INVALID_ARGUMENT", id="just-under-the-limit"),
        pytest.param(MAX_RECEIVE_MESSAGE_BYTES + 512, "RESOURCE_EXHAUSTED", id="just-over-the-limit"),
        pytest.param(1024 * 1024, "RESOURCE_EXHAUSTED", id="1MiB"),
        pytest.param(16 * 1024 * 1024, "RESOURCE_EXHAUSTED", id="16MiB"),
        *([pytest.param(64 * 1024 * 1024, "RESOURCE_EXHAUSTED", id="64MiB")] if FULL else []),
    ],
)
async def test_oversized_metadata_values_and_keys(
    client: ScalerClient, agent: AgentProcess, size: int, code: str
) -> None:
    """Up to the limit, metadata is read and refused by name; above it, RESOURCE_EXHAUSTED unread; then service."""
    for metadata in sized_metadata(size):
        request = ScaledObjectRef(name="app", namespace="ml", scaler_metadata=metadata)
        assert (len(bytes(request)) <= MAX_RECEIVE_MESSAGE_BYTES) is (code != "RESOURCE_EXHAUSTED")
        failure = await refusal(client.is_active(metadata, timeout=60))
        assert failure.code == code, failure
        assert len(failure.message.encode()) <= MAX_MESSAGE_BYTES
    assert await client.is_active({}) is False
    assert await asyncio.to_thread(agent.health) == "SERVING"


@pytest.mark.parametrize(
    ("headers", "answered"),
    [
        pytest.param(20, True, id="a-few-headers"),
        pytest.param(MAX_HEADER_LIST_BYTES // 32, False, id="over-the-header-limit"),
    ],
)
async def test_a_header_block_over_the_limit_closes_the_connection(
    agent: AgentProcess, client: ScalerClient, headers: int, answered: bool
) -> None:
    """A request with a few extra headers is answered; one whose header block exceeds the limit loses its connection."""
    request = grpc_frame(bytes(ScaledObjectRef(name="app", namespace="ml", scaler_metadata={})))
    extra = [(f"x-padding-{i}", "p" * 8) for i in range(headers)]
    answer = await asyncio.to_thread(grpc_call, agent.port, request, extra_headers=extra)
    assert (answer.get("grpc-status") == "0") is answered, answer
    assert await client.is_active({}) is False


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(os.urandom(4096), id="random"),
        pytest.param(b"\x00" * 4096, id="zeros"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: gpuscaler\r\n\r\n", id="http1"),
        pytest.param(bytes.fromhex("16030100c8010000c40303") + os.urandom(200), id="tls-client-hello"),
        pytest.param(PREFACE + b"\x00\x00\x03\x04\x00\x00\x00\x00\x00abc", id="bad-settings-frame"),
        pytest.param(PREFACE + b"\x00\x00\x04\x01\x05\x00\x00\x00\x01\xff\xff\xff\xff", id="bad-hpack"),
    ],
)
async def test_bytes_that_are_not_grpc_close_the_connection(
    agent: AgentProcess, client: ScalerClient, data: bytes
) -> None:
    """Non-HTTP/2 bytes and broken HTTP/2 frames make the agent close that connection; other callers are served."""
    assert await asyncio.to_thread(send_and_wait_for_close, agent.port, data)
    assert await client.is_active({}) is False


async def test_unknown_frame_types_are_ignored(agent: AgentProcess) -> None:
    """An HTTP/2 extension frame before a request leaves the connection working (RFC 9113 ignores unknown types)."""
    request = grpc_frame(bytes(ScaledObjectRef(name="app", namespace="ml", scaler_metadata={"gpuIndex": "0"})))
    answer = await asyncio.to_thread(grpc_call, agent.port, request, before_request=unknown_frame())
    assert answer.get("grpc-status") == "0", answer


async def test_idle_connections_do_not_block_others(agent: AgentProcess, client: ScalerClient) -> None:
    """Fifty connections that send the preface and then nothing do not stop other callers."""
    idle = []
    try:
        for _ in range(50):
            sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
            sock.sendall(PREFACE)
            idle.append(sock)
        for _ in range(20):
            assert await client.is_active({}) is False
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="no-message"),
        pytest.param(b"\x00\x00", id="short-prefix"),
        pytest.param(grpc_frame(b"", length=2**32 - 1), id="declared-4GiB-sent-0"),
        pytest.param(grpc_frame(b"\x08\x01", compressed=True), id="compressed-flag"),
    ],
)
async def test_broken_grpc_framing_ends_the_call(agent: AgentProcess, client: ScalerClient, body: bytes) -> None:
    """A request whose gRPC framing is broken ends with an error status at once; other callers are served."""
    answer = await asyncio.to_thread(grpc_call, agent.port, body)
    assert answer.get("grpc-status", "0") != "0", answer
    assert await client.is_active({}) is False


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(grpc_frame(b"", length=2**32 - 1), id="declared-4GiB-sent-0"),
        pytest.param(grpc_frame(b"\x08\x01", compressed=True), id="compressed-flag"),
    ],
)
async def test_broken_grpc_framing_is_the_client_s_error(agent: AgentProcess, body: bytes) -> None:
    """Broken framing gets a status that blames the request (not UNKNOWN), and the agent logs no error for it."""
    agent.expect_errors = True  # checked below, by unexpected_errors()
    answer = await asyncio.to_thread(grpc_call, agent.port, body)
    assert answer.get("grpc-status") not in {None, "0", "2", "13"}, answer
    assert not agent.unexpected_errors()
