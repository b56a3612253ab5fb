"""The server's API key check: every route but the open ones needs `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.http_guard import send_error

# Routes open without the API key: liveness probes and the version, which do no work and
# reveal no traffic. Every other path (unknown ones too) needs the key.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})


def check_api_key(api_key: str | None) -> str | None:
    """The key, or None for no authentication; an empty or blank key (an unset shell variable in
    `--api-key "$KEY"`) is refused instead of serving without authentication."""
    if api_key is not None and not api_key.strip():
        raise ValueError(
            f"api_key: --api-key is empty ({api_key!r}; an unset variable?): give a key, or drop "
            "--api-key to serve without authentication"
        )
    return api_key


class APIKeyMiddleware:
    """Every route but OPEN_PATHS needs `Authorization: Bearer <api key>` (the scheme in any
    case, RFC 9110)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def authorized(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and route_path(scope) not in OPEN_PATHS
            and not self.authorized(scope)
        ):
            error = APIError(
                401,
                "missing or wrong API key (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )
            # The unread body, if any, is not drained: the connection closes.
            await send_error(send, 401, error.info.message, code="invalid_api_key")
            return
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The request's path without the server's root path (`--root-path`), when it starts with it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
