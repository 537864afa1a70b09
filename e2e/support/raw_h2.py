"""Hand-made bytes for the gRPC port: raw HTTP/2 requests with any body, and frames no library would send."""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import h2.config
import h2.connection
import h2.events

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
IS_ACTIVE = "/externalscaler.ExternalScaler/IsActive"


def grpc_frame(message: bytes, *, compressed: bool = False, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message; ``length`` overrides the declared length (to lie about it)."""
    declared = len(message) if length is None else length
    return struct.pack(">?I", compressed, declared) + message


def unknown_frame(frame_type: int = 0xEE, payload: bytes = b"hello") -> bytes:
    """An HTTP/2 frame of an extension type on stream 0; peers must ignore it (RFC 9113 section 4.1)."""
    return struct.pack(">I", len(payload))[1:] + bytes([frame_type, 0]) + struct.pack(">I", 0) + payload


def grpc_call(
    port: int,
    body: bytes,
    *,
    path: str = IS_ACTIVE,
    before_request: bytes = b"",
    extra_headers: Sequence[tuple[str, str]] = (),
    timeout: float = 5.0,
) -> dict[str, str]:
    """POST ``body`` as a gRPC request over a fresh connection; the response headers and trailers merged.

    ``before_request`` is written after the connection preface and before the request's HEADERS.
    An empty result means the server closed (or reset) the connection without answering.
    """
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    connection.initiate_connection()
    start = connection.data_to_send()
    connection.send_headers(
        1,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *extra_headers,
        ],
    )
    connection.send_data(1, body, end_stream=True)
    request = connection.data_to_send()
    answer: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(start + before_request + request)
        except (BrokenPipeError, ConnectionResetError):
            return answer  # closed while we were still writing: no answer
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return answer  # closed with our bytes unread: no answer either
            if not data:
                return answer
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answer.update({str(k): str(v) for k, v in event.headers})
                if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return answer
            pending = connection.data_to_send()
            if pending:
                sock.sendall(pending)


def send_and_wait_for_close(port: int, data: bytes, timeout: float = 5.0) -> bool:
    """Write ``data`` on a fresh connection; True if the server then closes it within ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        try:
            while sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return True
