"""`ferrum serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn). This process tokenizes,
detokenizes and speaks HTTP; each engine core runs in its own process behind `AsyncLLM`. The port
opens before the model loads: `/health` answers 503 until the core is ready, while one restarts and
once the engine is dead; a dead engine ends the process with exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrum import __version__
from ferrum.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from ferrum.engine.arg_utils import EngineArgs, config_from_args
from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.errors import EngineDeadError
from ferrum.entrypoints.openai.api_key import APIKeyMiddleware, check_api_key
from ferrum.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from ferrum.entrypoints.openai.disconnect import until_disconnect
from ferrum.entrypoints.openai.frontend_args import FrontendConfig
from ferrum.entrypoints.openai.http_errors import (
    ERROR_RESPONSES,
    STREAM_RESPONSE,
    APIError,
    error_response,
    openapi_without_422,
    validation_api_error,
)
from ferrum.entrypoints.openai.http_guard import (
    RequestBodyLimitMiddleware,
    limited_protocol,
)
from ferrum.entrypoints.openai.http_limits import HttpLimits, raise_open_files_limit
from ferrum.entrypoints.openai.info_routes import add_info_routes
from ferrum.entrypoints.openai.lora_routes import add_lora_routes, register_lora_modules
from ferrum.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from ferrum.entrypoints.openai.protocol import (
    CompletionRequest,
)
from ferrum.entrypoints.openai.request_limits import publish_vocab_size
from ferrum.entrypoints.openai.request_log import RequestLog
from ferrum.entrypoints.openai.responses import (
    CompletionResponse,
    HealthResponse,
    VersionResponse,
)
from ferrum.entrypoints.openai.server_config import ServerConfig
from ferrum.entrypoints.openai.serving_chat import OpenAIServingChat
from ferrum.entrypoints.openai.serving_completion import OpenAIServingCompletion
from ferrum.entrypoints.openai.serving_engine import NOT_UNICODE
from ferrum.entrypoints.openai.stats_logger import start_stats_logging
from ferrum.entrypoints.openai.token_routes import add_token_routes
from ferrum.logger import init_logger
from ferrum.recovery_config import EngineRecoveryConfig

logger = init_logger(__name__)


def build_app(
    engine: AsyncLLM,
    model_names: list[str],
    api_key: str | None = None,
    limits: HttpLimits | None = None,
    frontend: FrontendConfig | None = None,
    server_config: ServerConfig | None = None,
    disable_log_stats: bool = False,
) -> FastAPI:
    """The app; `disable_log_stats`: no periodic stats line (stats_logger.py)."""
    frontend = frontend or FrontendConfig()
    server_config = server_config or ServerConfig()
    api_key = check_api_key(api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.startup_failed = False
        starting = asyncio.create_task(_start_engine(app, engine))
        exiting = asyncio.create_task(_exit_when_dead(app, engine))
        stats = start_stats_logging(engine, disable_log_stats)
        try:
            yield
        finally:
            starting.cancel()
            exiting.cancel()
            if stats is not None:
                stats.cancel()
            await engine.shutdown()
            logger.info("engine core stopped")

    app = FastAPI(
        title="ferrum",
        version=__version__,
        description="OpenAI-compatible API of the ferrum inference engine",
        lifespan=lifespan,
    )
    app.root_path = server_config.root_path  # vLLM's way: routes answer with and without it
    _add_middleware(app, api_key, limits or HttpLimits(), frontend)
    publish_vocab_size(app, engine.config.model_config.vocab_size)  # token ids' bound
    _add_error_handlers(app)
    _add_info_routes(app, engine, model_names)
    chat = OpenAIServingChat(engine, model_names, frontend)
    request_log = RequestLog(
        engine.config.model_config.max_logprobs,
        server_config.enable_log_requests,
        server_config.max_log_len,
    )
    completion = OpenAIServingCompletion(engine, model_names, frontend.return_tokens_as_token_ids)
    _add_generation_routes(app, completion, chat, request_log)
    add_token_routes(app, engine, chat)
    add_lora_routes(app, engine, model_names)
    return app


def _add_middleware(
    app: FastAPI, api_key: str | None, limits: HttpLimits, frontend: FrontendConfig
) -> None:
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if api_key:
        # Outermost: a request without the key is refused before its body is read.
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # Outermost: a browser's preflight carries no API key.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=frontend.allowed_origins,
        allow_methods=frontend.allowed_methods,
        allow_headers=frontend.allowed_headers,
        allow_credentials=frontend.allow_credentials,
    )
    app.openapi = lambda: openapi_without_422(app)  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation_api_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        api_error = APIError(error.status_code, str(error.detail))
        return JSONResponse(api_error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(UnicodeError)
    async def _not_unicode(_: Request, error: UnicodeError) -> JSONResponse:
        # Input text reaches UTF-8 (tokenizer, response) only through a handler: a lone
        # surrogate in any field ends here unless a handler named the field first.
        return error_response(APIError(400, f"the request holds text that is {NOT_UNICODE}"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        api_error = APIError(500, f"internal error: {type(error).__name__}")
        return error_response(api_error)


def _add_info_routes(app: FastAPI, engine: AsyncLLM, model_names: list[str]) -> None:
    lora = engine.config.lora_config
    metrics = ServerMetrics(engine, model_names[0], lora.max_loras if lora.enable_lora else None)
    add_info_routes(app, engine, model_names)

    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD
    @app.get("/health", response_model=HealthResponse, responses=ERROR_RESPONSES)
    async def health() -> HealthResponse:
        problem = engine.health_problem()
        if problem is not None:
            code, message = problem
            raise APIError(503, message, code=code)
        return HealthResponse()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE)


def _add_generation_routes(
    app: FastAPI,
    completion: OpenAIServingCompletion,
    chat: OpenAIServingChat,
    request_log: RequestLog,
) -> None:
    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**ERROR_RESPONSES, **STREAM_RESPONSE},
    )
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        request_log.admit("/v1/completions", body)
        return await _respond(raw, completion.create_completion(body))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERROR_RESPONSES, **STREAM_RESPONSE},
    )
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        request_log.admit("/v1/chat/completions", body)
        return await _respond(raw, chat.create_chat_completion(body))


async def _respond(raw: Request, work: Awaitable[Any]) -> Any:
    result = await until_disconnect(raw, work)
    if result is None:
        # The client is gone; nobody reads this.
        return Response(status_code=499)
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return result


async def _start_engine(app: FastAPI, engine: AsyncLLM) -> None:
    try:
        await engine.start()
    except EngineDeadError as e:
        logger.error("the engine failed to start: %s", e)
        app.state.startup_failed = True
        server = getattr(app.state, "server", None)
        if server is not None:
            server.should_exit = True
        return
    config = getattr(app.state, "server_config", None)
    if config is not None:
        scheme = "https" if config.ssl_certfile else "http"
        root = app.root_path
        logger.info("ready: serving at %s://%s:%d%s/v1", scheme, config.host, config.port, root)


async def _exit_when_dead(app: FastAPI, engine: AsyncLLM) -> None:
    """A dead engine ends the server (exit code 1), so that a supervisor can restart it."""
    reason = await engine.wait_dead()
    logger.error("the engine is dead (%s): shutting the server down", reason)
    server = getattr(app.state, "server", None)
    if server is not None:
        server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn with a graceful SIGTERM/SIGINT: in-flight requests are aborted (their streams end
    with finish_reason "abort"), the core process stops, and the process exits 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
        logger.info(
            "received %s: aborting %d in-flight request(s) and shutting down",
            signal.Signals(sig).name,
            self.engine.num_open_requests,
        )
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.engine.abort_all)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn; ValueError naming the address when it is
    taken or cannot be bound."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"host: cannot listen on {host!r}: {e}") from e
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(
            f"port: cannot listen on {host}:{port} ({e.strerror or e}); is another server "
            "running there? Pick another --port"
        ) from e
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Serves until SIGTERM/SIGINT; returns the process exit code."""
    started = time.perf_counter()
    api_key = check_api_key(args.api_key)
    engine_args = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR)
    frontend = FrontendConfig.from_cli_args(args)
    server_config = config_from_args(ServerConfig, args)
    if not 0 < args.port < 65536:
        raise ValueError(f"port must be in [1, 65535], got {args.port}")
    limits = config_from_args(HttpLimits, args)
    raise_open_files_limit(limits)
    listener = listen_socket(args.host, args.port)  # a busy port fails before the model loads
    config = engine_args.create_engine_config()
    if config.model_config.skip_tokenizer_init:
        raise ValueError("skip_tokenizer_init: the server needs a tokenizer")
    model_names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    engine = AsyncLLM(config, config_from_args(EngineRecoveryConfig, args))
    register_lora_modules(engine, args.lora_modules, model_names)
    logger.info(
        "ferrum %s serving %s as %s; config and tokenizer ready in %.2f s",
        __version__,
        config.model_config.model,
        model_names,
        time.perf_counter() - started,
    )
    for note in server_config.startup_notes():
        logger.info("%s", note)
    app = build_app(
        engine, model_names, api_key, limits, frontend, server_config, args.disable_log_stats
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=10,
        http=limited_protocol(limits),
        **server_config.uvicorn_kwargs(),
    )
    server = _Server(uvicorn_config, engine)
    app.state.server = server
    app.state.server_config = uvicorn_config
    server.run(sockets=[listener])
    if getattr(app.state, "startup_failed", False) or not server.started or engine.is_dead:
        return 1
    return 0
