"""HTTP limits on an in-process uvicorn (loopback, no model): body size (413), header and body
read deadlines (408), the connection limit (503), through raw sockets."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from ferrum.entrypoints.openai.http_guard import RequestBodyLimitMiddleware, limited_protocol
from ferrum.entrypoints.openai.http_limits import HttpLimits

MAX_BODY = 1000


async def body_size_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 200 with the size of the body it received in its first message."""
    if scope["type"] != "http":
        return
    message = await receive()
    assert not message.get("more_body", False)
    body = json.dumps({"size": len(message["body"])}).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def guarded_server(**limits: float) -> Iterator[int]:
    """A uvicorn with the guard over `body_size_app`, in a thread; yields its port."""
    config = uvicorn.Config(
        RequestBodyLimitMiddleware(body_size_app, MAX_BODY),
        http=limited_protocol(HttpLimits(max_request_body_bytes=MAX_BODY, **limits)),
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        assert server.started
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(30)
    return conn


def read_response(conn: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one response; then the server has closed the connection."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def post_head(length: int | None = None, chunked: bool = False) -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return f"POST /x HTTP/1.1\r\nHost: t\r\n{framing}\r\n\r\n".encode()


def test_limits_are_checked() -> None:
    names = ("max_request_body_bytes", "timeout_request_body", "min_request_body_rate")
    for name in (*names, "limit_concurrency"):
        with pytest.raises(ValueError, match=name):
            HttpLimits(**{name: 0})


def test_body_over_the_limit_is_413_and_at_the_limit_is_served() -> None:
    with guarded_server() as port:
        conn = connect(port)
        conn.sendall(post_head(MAX_BODY) + b"x" * MAX_BODY + b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
        data = b""
        while not data.endswith(b'{"size": 0}'):
            chunk = conn.recv(65536)
            assert chunk, data
            data += chunk
        assert data.count(b"HTTP/1.1 200") == 2 and b'{"size": 1000}' in data
        conn.close()
        # Announced: refused before a byte of the body is sent.
        conn = connect(port)
        conn.sendall(post_head(MAX_BODY + 1))
        status, body = read_response(conn)
        assert status == 413
        assert "(1001 bytes) exceeds the limit of 1000 bytes" in body["error"]["message"]
        # Chunked: refused once the bytes read pass the limit.
        conn = connect(port)
        chunk = b"%x\r\n%s\r\n" % (600, b"y" * 600)
        conn.sendall(post_head(chunked=True) + chunk + chunk)
        status, body = read_response(conn)
        assert status == 413 and "--max-request-body-bytes" in body["error"]["message"]


def test_refused_body_is_read_and_dropped_until_the_client_closes() -> None:
    """A client that writes its whole body before reading gets the 413 intact: the server
    keeps reading after answering, so the client's later bytes are not answered by a reset."""
    with guarded_server() as port:
        conn = connect(port)
        conn.sendall(post_head(100 * MAX_BODY))
        status, _ = read_response(conn)
        assert status == 413
        conn.sendall(b"x" * (100 * MAX_BODY))
        for _ in range(20):  # still read and dropped a while later
            time.sleep(0.01)
            conn.sendall(b"x" * MAX_BODY)
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(1) == b""  # the server closes after the client: no reset
        conn.close()


def test_slow_body_and_slow_headers_get_408() -> None:
    with guarded_server(timeout_request_header=0.5, timeout_request_body=0.5) as port:
        slow_body = connect(port)
        slow_body.sendall(post_head(1000) + b"z" * 30)
        stalled_headers = connect(port)
        stalled_headers.sendall(b"GET /x HTTP/1.1\r\nHost")
        silent = connect(port)
        for conn, flag in (
            (slow_body, "--timeout-request-body"),
            (stalled_headers, "--timeout-request-header"),
            (silent, "--timeout-request-header"),
        ):
            status, body = read_response(conn)
            assert status == 408 and flag in body["error"]["message"]


def drip(conn: socket.socket, data: bytes, interval: float) -> bytes:
    """Sends `data` a byte every `interval` s until the server answers; returns the answer."""
    conn.settimeout(interval)
    for byte in data:
        try:
            return conn.recv(65536)  # the answer, or b"" once closed
        except TimeoutError:
            pass
        except ConnectionResetError:
            return b""
        try:
            conn.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return b""
    conn.settimeout(30)
    return conn.recv(65536)


def test_a_dripped_body_is_cut_by_the_minimum_rate() -> None:
    """Each byte comes well within the pause deadline; the average rate is what fails."""
    limits = {"timeout_request_body": 0.5, "min_request_body_rate": 100.0}
    with guarded_server(**limits) as port:
        conn = connect(port)
        conn.sendall(post_head(MAX_BODY))
        # Dripping all of it would take 50 s and be answered 200: the 408 comes first.
        answer = drip(conn, b"d" * MAX_BODY, 0.05)
        assert answer.startswith(b"HTTP/1.1 408") and b"--min-request-body-rate" in answer
        # A body sent steadily above the rate is served, however long it takes past 0.5 s.
        conn = connect(port)
        conn.sendall(post_head(MAX_BODY))
        for _ in range(10):
            conn.sendall(b"s" * (MAX_BODY // 10))
            time.sleep(0.1)
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")


def test_header_deadline_is_not_reset_by_trickled_bytes() -> None:
    with guarded_server(timeout_request_header=0.5) as port:
        conn = connect(port)
        conn.settimeout(0.05)
        request = b"GET /x HTTP/1.1\r\nHost: t\r\nX-Padding: " + b"p" * 1000
        # One byte every 50 ms would take 50 s; the deadline is 0.5 s from the first byte.
        answer, closed_by_server = b"", False
        for byte in request:
            try:
                answer = conn.recv(65536)  # the 408, or b"" once closed
                closed_by_server = True
                break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed_by_server = True
                break
            try:
                conn.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_by_server = True
                break
        assert closed_by_server
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer


def test_connections_above_the_limit_get_503() -> None:
    with guarded_server(limit_concurrency=3, timeout_request_header=60) as port:
        holders = [connect(port) for _ in range(3)]
        conn = connect(port)
        conn.sendall(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
        status, body = read_response(conn)
        assert status == 503 and "limit of 3 open connections" in body["error"]["message"]
        holders.pop().close()
        # Once the server has seen the close, a fourth connection is served again.
        for _ in range(500):
            conn = connect(port)
            conn.sendall(b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            data = conn.recv(65536)
            conn.close()
            if data.startswith(b"HTTP/1.1 200"):
                break
            assert data.startswith(b"HTTP/1.1 503"), data
            time.sleep(0.01)
        assert data.startswith(b"HTTP/1.1 200")
        for holder in holders:
            holder.close()
