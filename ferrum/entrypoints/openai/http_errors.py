"""How the server answers what it refuses: APIError in OpenAI's error envelope, request validation
errors as a 400 naming the field, an OpenAPI schema without FastAPI's 422 responses, and the
responses each route documents."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from ferrum.entrypoints.openai.protocol import UNION_TAG, OpenAIModel


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the server answers in OpenAI's envelope with this HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(
            message=encodable(shorten(message)),
            type=type or ("invalid_request_error" if status_code < 500 else "server_error"),
            param=None if param is None else encodable(shorten(param, 100)),
            code=code,
        )

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()


def encodable(text: str) -> str:
    """`text` with lone surrogates (valid in JSON, not in UTF-8) written as `\\udXXX` escapes,
    so that an error echoing user input can always be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shorten(text: str, limit: int = 500) -> str:
    """Error messages stay short: a huge input never comes back in full."""
    return text if len(text) <= limit else text[: limit - 15] + "... (truncated)"


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code)


def openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """The generated schema, minus FastAPI's 422 responses: invalid requests get 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def validation_api_error(error: RequestValidationError) -> APIError:
    errors = error.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    location = [
        str(part)
        for part in first.get("loc", ())
        if part != "body" and not str(part).startswith(UNION_TAG)
    ]
    if first.get("type") == "json_invalid":
        return APIError(400, f"invalid JSON: {first.get('msg', '')}")
    param = ".".join(location) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, shorten(message, 300), param=param)


# The documented answers of the API's routes (FastAPI's `responses=`).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (503, "Engine loading or dead"),
    )
}
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response, or with stream=true a server-sent event stream",
        # Each server-sent event: `data` holds one JSON chunk, or "[DONE]" at the end.
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {"type": "string"},
                        "event": {"type": "string"},
                        "id": {"type": "string"},
                    },
                }
            }
        },
    }
}
