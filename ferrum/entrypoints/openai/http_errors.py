"""How the server answers what it refuses: APIError as OpenAI's error JSON, request validation
errors as a 400 naming the field, and an OpenAPI schema without FastAPI's 422 responses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from ferrum.entrypoints.openai.protocol import UNION_TAG, APIError, shorten


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
