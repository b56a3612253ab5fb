"""The asyncio front end: text in, streams of RequestOutputs out, over a core in another process.

It mirrors `LLMEngine` (same InputProcessor / OutputProcessor), but the EngineCore runs in its own
process behind an `EngineCoreClient`. Every method must be called from the event loop thread that
called `start()`; messages from the core are handed to that loop by the client's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from ferrum.config import EngineConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.core_client import EngineCoreClient
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    EngineCoreOutput,
    FromCore,
    SchedulerStats,
)
from ferrum.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from ferrum.engine.output_processor import OutputProcessor
from ferrum.logger import init_logger
from ferrum.outputs import RequestOutput
from ferrum.request import RequestStatus
from ferrum.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The core process failed or exited; no request can be served any more."""


class EngineNotReadyError(RuntimeError):
    """The core process is still loading."""


class RequestStream:
    """One request's outputs as an async iterator. A reader that falls behind gets one output
    holding all it missed: the latest cumulative output, or the pending DELTA outputs merged. The
    final output is never skipped."""

    def __init__(
        self, request_id: str, on_close: Callable[[str], object], merge_deltas: bool
    ) -> None:
        self.request_id = request_id
        self._on_close = on_close
        self._merge_deltas = merge_deltas
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._done = False

    def put(self, output: RequestOutput) -> None:
        if self._latest is not None and self._merge_deltas:
            self._latest.add(output)
        else:
            self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                await self._event.wait()
                self._event.clear()
                if self._error is not None:
                    raise self._error
                output, self._latest = self._latest, None
                if output is not None:
                    self._done = output.finished
                    yield output
        finally:
            # Runs on normal end, on error, and when the reader is cancelled (client gone).
            self._on_close(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor: InputProcessor | None = None
        self.dead_reason: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._latest_stats: SchedulerStats | None = None
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[CoreInfo] | None = None
        self._client = EngineCoreClient(config, self._on_core_message)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> CoreInfo:
        """Spawns the core process and waits until it is loaded; raises EngineDeadError if the
        core fails to start."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        started = time.perf_counter()
        self._client.start()
        logger.info("engine core process started (pid %s); loading the model", self._client.pid)
        info = await self._ready
        self.input_processor = InputProcessor(
            self.config.model_config, self.tokenizer, info.max_tokens_in_pool
        )
        logger.info(
            "engine core ready in %.2f s (process start + imports %.2f s, engine %.2f s): "
            "%d KV blocks, %d tokens in the pool",
            time.perf_counter() - started,
            info.import_seconds,
            info.engine_seconds,
            info.num_kv_blocks,
            info.max_tokens_in_pool,
        )
        return info

    @property
    def is_ready(self) -> bool:
        return self.input_processor is not None and self.dead_reason is None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def shutdown(self) -> None:
        """Finishes every open stream as aborted, then stops the core process (bounded)."""
        self.abort_all()
        await asyncio.to_thread(self._client.shutdown)

    # -- requests ------------------------------------------------------------------------------

    def check_can_serve(self) -> InputProcessor:
        """The input processor; raises EngineDeadError or EngineNotReadyError if no request can
        be served now."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.input_processor is None:
            raise EngineNotReadyError("the engine is still loading")
        return self.input_processor

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> RequestStream:
        """Validates and queues one request (n completions); on error nothing is queued.

        Iterate the returned stream to get outputs; leaving the iteration early (break, error,
        cancellation) aborts the request in the core.
        """
        prompt, requests = self.check_can_serve().process(request_id, prompt, params)
        self.output_processor.add_request(request_id, prompt, requests)
        merge_deltas = params.output_kind is RequestOutputKind.DELTA
        stream = self._streams[request_id] = RequestStream(request_id, self.abort, merge_deltas)
        self._client.add_requests(requests)
        return stream

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs (as params.output_kind asks) until it finishes."""
        async for output in self.add_request(request_id, prompt, params):
            yield output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request and returns its final output (unknown or finished ids: None); its KV
        blocks return to the pool as soon as the core reads the message."""
        self._streams.pop(request_id, None)
        self._client.finish_requests(
            self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED
        )
        output = self.output_processor.abort(request_id)
        if output is not None:
            self._notify_finished(output)
        return output

    def abort_all(self) -> None:
        """Finishes every open request with finish_reason "abort" (graceful shutdown)."""
        for request_id, stream in list(self._streams.items()):
            output = self.abort(request_id)
            if output is not None:
                stream.put(output)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> SchedulerStats | None:
        """The core's scheduler stats after its latest step (None before the first)."""
        return self._latest_stats

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """`listener(output)` is called once per request when it finishes or is aborted."""
        self._finished_listeners.append(listener)

    # -- messages from the core ----------------------------------------------------------------

    def _on_core_message(self, message: FromCore) -> None:
        """Called on the client's thread: hands the message to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the loop closed since the check; nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._handle_core_message, message)

    def _handle_core_message(self, message: FromCore) -> None:
        match message:
            case CoreOutputs(core_outputs, stats):
                self._latest_stats = stats
                self._process_outputs(core_outputs)
            case CoreInfo():
                assert self._ready is not None
                if not self._ready.done():
                    self._ready.set_result(message)
            case CoreFailed(reason):
                self._on_dead(reason)

    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> None:
        outputs, stopped = self.output_processor.process(core_outputs)
        self._client.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
                self._notify_finished(output)
            if stream is not None:
                stream.put(output)

    def _on_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight request(s)", reason, len(self._streams))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        error = EngineDeadError(reason)
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            self.output_processor.abort(request_id)
            stream.fail(error)

    def _notify_finished(self, output: RequestOutput) -> None:
        for listener in self._finished_listeners:
            try:
                listener(output)
            except Exception:
                logger.exception("finished-request listener failed")
