"""Enforces HttpLimits (see `http_limits` for the promises): a body-size middleware, and
uvicorn's h11 protocol with read deadlines and a connection limit."""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from ferrum.entrypoints.openai.http_limits import HttpLimits
from ferrum.entrypoints.openai.protocol import APIError
from ferrum.logger import init_logger

logger = init_logger(__name__)

_REASONS = {408: b"Request Timeout", 413: b"Content Too Large", 503: b"Service Unavailable"}


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


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a connection limit (see the module doc).
    Subclasses made by `limited_protocol` set `limits`."""

    limits: ClassVar[HttpLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_timer_kind = ""
        self._seen_request = False
        self._inner_app = self.app
        self.app = self._app_within_connection_limit

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_reads(new_bytes=False)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_reads(new_bytes=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_reads(new_bytes=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _watch_reads(self, new_bytes: bool) -> None:
        """Arms the deadline of the bytes the client owes now, if any."""
        if self.transport.is_closing():
            self._cancel_read_timer()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._seen_request and not self.conn.trailing_data[0]:
                self._cancel_read_timer()  # idle between requests: timeout_keep_alive's job
            elif self._read_timer_kind != "header":
                self._arm("header", self.limits.timeout_request_header)
        elif state is h11.SEND_BODY:
            self._seen_request = True
            if new_bytes or self._read_timer_kind != "body":
                self._arm("body", self.limits.timeout_request_body)
        else:
            self._seen_request = True
            self._cancel_read_timer()

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
        cycle = self.cycle if kind == "body" else None
        if cycle is None or not cycle.response_started:
            seconds = (
                self.limits.timeout_request_header
                if kind == "header"
                else self.limits.timeout_request_body
            )
            what = "headers" if kind == "header" else "body"
            flag = f"--timeout-request-{kind}"
            message = f"the request's {what} did not arrive within {seconds:g} s ({flag})"
            self.transport.write(_raw_response(408, message))
        if cycle is not None:
            # The route waiting for the body reads a disconnect and answers nothing.
            cycle.disconnected = True
            cycle.message_event.set()
        logger.info("closed a connection whose request %s stalled", kind)
        self.transport.close()

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
