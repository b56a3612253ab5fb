"""Enforces HttpLimits (see `http_limits` for the promises): a body-size middleware, and
uvicorn's h11 protocol with read deadlines, a connection limit and a lingering close."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.http_limits import HttpLimits
from ferrum.logger import init_logger

logger = init_logger(__name__)

_REASONS = {408: b"Request Timeout", 413: b"Content Too Large", 503: b"Service Unavailable"}

# A connection closed while its client still sends a body lingers: the answer is flushed, the write
# side shut (FIN), then the client's bytes are dropped until it closes, pauses this long, or the
# linger reaches its cap (nginx's lingering_timeout / lingering_time). Closing at once would reset
# the connection on the client's next bytes, and a reset can destroy the unread answer.
LINGER_IDLE_S = 5.0
LINGER_TOTAL_S = 30.0


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(APIError(status, message, code=code).body()).encode()


async def send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    """An error response that also closes the connection (its body may be left unread)."""
    body = error_bytes(status, message, code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestBodyLimitMiddleware:
    """Reads each request's body up to `max_bytes` (413 past it), then hands it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, declared: int | None = None) -> str:
        size = "" if declared is None else f" ({declared} bytes)"
        return (
            f"the request body{size} exceeds the limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, 413, self.too_large(int(declared)))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody reads an answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, 413, self.too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        first: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()  # then only http.disconnect comes

        await self.app(scope, replay, send)


class _LingeringTransport:
    """The transport uvicorn sees: every call goes to the socket's transport, except that
    close() goes to the protocol, which may linger first; a lingering one is closing."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self._close = close
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        self._close()


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, a connection limit and a lingering close
    (see the module docs). Subclasses made by `limited_protocol` set `limits`."""

    limits: ClassVar[HttpLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_timer_kind = ""
        # The body being received: when it started and its bytes so far (the rate's deadline).
        self._body_started: float | None = None
        self._body_bytes = 0
        self._seen_request = False
        self._inner_app = self.app
        self.app = self._app_within_connection_limit
        self._socket_transport: asyncio.Transport | None = None
        self._uvicorn_transport: _LingeringTransport | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_until: float | None = None
        self._shutting_down = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket_transport = transport
        self._uvicorn_transport = _LingeringTransport(transport, self._close)
        super().connection_made(self._uvicorn_transport)  # type: ignore[arg-type]
        self._watch_reads(new_bytes=False)

    def data_received(self, data: bytes) -> None:
        if self._linger_until is not None:
            self._arm_linger()  # the bytes of a body nobody reads
            return
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)  # with the head that came along, if any
        self._watch_reads(new_bytes=True)

    def shutdown(self) -> None:
        self._shutting_down = True
        if self._linger_until is not None:
            self._close()
        else:
            super().shutdown()

    def _close(self) -> None:
        """Closes the connection, lingering first while the client is sending a body."""
        transport, seen = self._socket_transport, self._uvicorn_transport
        assert transport is not None and seen is not None
        # TLS cannot half-close (no write_eof): it closes after the buffered answer at once.
        if (
            self._linger_until is not None
            or self._shutting_down
            or transport.is_closing()
            or self.conn.their_state is not h11.SEND_BODY
            or not transport.can_write_eof()
        ):
            self._cancel_linger_timer()
            transport.close()
            return
        self._cancel_read_timer()
        self._linger_until = self.loop.time() + LINGER_TOTAL_S
        seen.lingering = True
        transport.write_eof()  # after the buffered answer
        self.flow.resume_reading()
        self._arm_linger()

    def _arm_linger(self) -> None:
        assert self._linger_until is not None
        self._cancel_linger_timer()
        left = self._linger_until - self.loop.time()
        self._linger_timer = self.loop.call_later(min(LINGER_IDLE_S, max(left, 0.0)), self._close)

    def _cancel_linger_timer(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._linger_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reads(new_bytes=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        self._cancel_linger_timer()
        super().connection_lost(exc)

    def _watch_reads(self, new_bytes: bool) -> None:
        """Arms the deadline of the bytes the client owes now, if any."""
        if self.transport.is_closing():
            self._cancel_read_timer()
            return
        state = self.conn.their_state
        if state is not h11.SEND_BODY:
            self._body_started, self._body_bytes = None, 0
        if state is h11.IDLE:
            if self._seen_request and not self.conn.trailing_data[0]:
                self._cancel_read_timer()  # idle between requests: timeout_keep_alive's job
            elif self._read_timer_kind != "header":
                self._arm("header", self.limits.timeout_request_header)
        elif state is h11.SEND_BODY:
            self._seen_request = True
            if self._body_started is None:
                self._body_started = self.loop.time()
            if new_bytes or not self._read_timer_kind.startswith("body"):
                self._arm_body()
        else:
            self._seen_request = True
            self._cancel_read_timer()

    def _arm_body(self) -> None:
        """The body's deadline: the next bytes within timeout_request_body, and on average
        min_request_body_rate bytes/s past its first timeout_request_body seconds."""
        assert self._body_started is not None
        pause = self.limits.timeout_request_body
        left = self.limits.body_deadline(self._body_started, self._body_bytes) - self.loop.time()
        if left < pause:
            self._arm("body_rate", max(left, 0.0))
        else:
            self._arm("body", pause)

    def _arm(self, kind: str, seconds: float) -> None:
        self._cancel_read_timer()
        self._read_timer_kind = kind
        self._read_timer = self.loop.call_later(seconds, self._on_read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = None
        self._read_timer_kind = ""

    def _on_read_timeout(self) -> None:
        kind = self._read_timer_kind
        self._read_timer = None
        self._read_timer_kind = ""
        if self.transport.is_closing():
            return
        cycle = self.cycle if kind.startswith("body") else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_raw_response(408, self._timeout_message(kind)))
        if cycle is not None:
            # The route waiting for the body reads a disconnect and answers nothing.
            cycle.disconnected = True
            cycle.message_event.set()
        logger.info("closed a connection whose request %s stalled", kind)
        self.transport.close()

    def _timeout_message(self, kind: str) -> str:
        limits = self.limits
        if kind == "body_rate":
            return (
                f"the request's body arrived slower than {limits.min_request_body_rate:g} bytes/s "
                f"after {limits.timeout_request_body:g} s (--min-request-body-rate)"
            )
        seconds = limits.timeout_request_header if kind == "header" else limits.timeout_request_body
        what = "headers" if kind == "header" else "body"
        flag = f"--timeout-request-{kind}"
        return f"the request's {what} did not arrive within {seconds:g} s ({flag})"

    async def _app_within_connection_limit(
        self, scope: Scope, receive: Receive, send: Send
    ) -> None:
        limit = self.limits.limit_concurrency
        if scope["type"] == "http" and len(self.connections) > limit:
            message = f"the server is at its limit of {limit} open connections; retry later"
            await send_error(send, 503, message)
            return
        await self._inner_app(scope, receive, send)


def _raw_response(status: int, message: str) -> bytes:
    """A whole response written without h11 (no request, or one whose body never came)."""
    body = error_bytes(status, message)
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body))
    )
    return head + body


def limited_protocol(limits: HttpLimits) -> type[LimitedH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...) for these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
