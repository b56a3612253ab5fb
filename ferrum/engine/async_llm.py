"""The asyncio front end: text in, streams of RequestOutputs out, over cores in their own processes
(restarted after a crash as the recovery config says). Every method runs on the loop that called
`start()`. Grammars compile here too, off the loop (`structured_output/manager.py` says why): a
request reaches a core only once compiled; a bad or timed-out grammar fails it with a ValueError.
Dead (a core failed for good): every stream fails and `wait_dead()` returns, to exit non-zero."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from ferrum.config import EngineConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.core_client import FrontEndThread
from ferrum.engine.core_messages import CoreInfo, SchedulerStats
from ferrum.engine.dp_client import core_processes
from ferrum.engine.errors import EngineDeadError, EngineNotReadyError
from ferrum.engine.front_end import FrontEnd
from ferrum.engine.grammar_frontend import GrammarFrontend
from ferrum.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from ferrum.engine.request_stream import RequestStream
from ferrum.logger import init_logger
from ferrum.lora_request import LoRARequest
from ferrum.outputs import RequestOutput
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class AsyncLLM(FrontEnd):
    def __init__(
        self, config: EngineConfig, recovery_config: EngineRecoveryConfig | None = None
    ) -> None:
        super().__init__(config)
        self.recovery_config = recovery_config or EngineRecoveryConfig()
        self.grammars = GrammarFrontend(config, self.tokenizer)
        self.client = core_processes(config, self.recovery_config)
        self._streams: dict[str, RequestStream] = {}
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._ready: asyncio.Future[CoreInfo] | None = None
        self._dead = asyncio.Event()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, recovery_config: EngineRecoveryConfig | None = None
    ) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), recovery_config)

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> CoreInfo:
        """Starts the core process(es) and waits until they are loaded; raises EngineDeadError
        if one fails to start."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.client.start(self._on_event, FrontEndThread(loop))
        return await self._ready

    @property
    def is_ready(self) -> bool:
        return self.input_processor is not None and self.dead_reason is None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_restarts(self) -> int:
        return self.client.num_restarts

    def health_problem(self) -> tuple[str, str] | None:
        """(code, message) of why the engine cannot serve now, or None when it can."""
        if self.dead_reason is not None:
            return "engine_dead", f"the engine is dead: {self.dead_reason}"
        return self.client.health_problem()

    async def wait_dead(self) -> str:
        """Returns (the reason) once the engine is dead: it serves nothing any more."""
        await self._dead.wait()
        assert self.dead_reason is not None
        return self.dead_reason

    async def shutdown(self) -> None:
        """Finishes every open stream as aborted, then stops the core process(es) (bounded)."""
        self.abort_all()
        self.grammars.shutdown()
        self.client.close()
        await asyncio.to_thread(self.client.shutdown)

    # -- requests ------------------------------------------------------------------------------

    def check_can_serve(self) -> InputProcessor:
        """The input processor; raises EngineDeadError or EngineNotReadyError if no request can
        be served now (while a core restarts, requests are served: they wait for it)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.input_processor is None:
            raise EngineNotReadyError("the engine is still loading")
        return self.input_processor

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        default_max_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validates and queues one request (n completions); on error nothing is queued. While a
        core restarts, the request waits for it. Unset `max_tokens`: `default_max_tokens` capped
        by the room the prompt leaves, else all of it. Leaving the iteration of the returned
        stream early (break, error, cancellation) aborts the request in the core."""
        loop = asyncio.get_running_loop()
        request = self.check_can_serve().process(
            request_id,
            prompt,
            params,
            default_max_tokens=default_max_tokens,
            lora_request=self.loras.check(lora_request),
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "admitted %s: %d prompt tokens, n=%d, max_tokens=%d",
                request_id,
                len(request.prompt.token_ids),
                params.n,
                request.core_requests[0].sampling_params.max_tokens,
            )
        compiled = params.structured_outputs is None or self.grammars.check_compiled(params)
        self.output_processor.add_request(request)
        merge_deltas = request.output_kind is RequestOutputKind.DELTA
        stream = self._streams[request_id] = RequestStream(request_id, self.abort, merge_deltas)
        if compiled:
            self.client.add_requests(request.core_requests)
        else:
            loop.create_task(self._add_when_compiled(stream, request))
        return stream

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles `params`' grammar (if any) within the compile timeout; raises ValueError
        naming the field for a bad grammar or one that timed out. Awaited before `add_request`,
        a bad grammar is refused before anything is queued or streamed."""
        if params.structured_outputs is not None and not self.grammars.check_compiled(params):
            await self.grammars.compile(params)

    async def _add_when_compiled(self, stream: RequestStream, request: ProcessedRequest) -> None:
        try:
            await self.grammars.compile(request.params)
        except Exception as e:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self.output_processor.abort(stream.request_id)
                stream.fail(e)
            return
        # Aborted while it compiled: the core never hears of it.
        if self._streams.get(stream.request_id) is stream and self.dead_reason is None:
            self.client.add_requests(request.core_requests)

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs (as params.output_kind asks) until it finishes."""
        async for output in self.add_request(request_id, prompt, params):
            yield output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request and returns its final output (unknown or finished ids: None); its KV
        blocks return to the pool as soon as its core reads the message."""
        self._streams.pop(request_id, None)
        output = self._abort(request_id)
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
        """Scheduler stats of every core added up: counters over every core so far, gauges of
        those serving now. None before the first step."""
        return self.client.stats()

    def replica_stats(self) -> list[SchedulerStats | None]:
        """The stats of each data-parallel replica (one without data parallelism)."""
        return self.client.replica_stats()

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """`listener(output)` is called once per request when it finishes or is aborted."""
        self._finished_listeners.append(listener)

    # -- events from the client ----------------------------------------------------------------

    def _on_ready(self, info: CoreInfo) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(info)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
                self._notify_finished(output)
            if stream is not None:
                stream.put(output)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """Fails the request (all its completions)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self.abort(request_id)
            stream.fail(error)

    def _notify_finished(self, output: RequestOutput) -> None:
        for listener in self._finished_listeners:
            try:
                listener(output)
            except Exception:
                logger.exception("finished-request listener failed")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight request(s)", reason, len(self._streams))
        error = EngineDeadError(reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            self.output_processor.abort(request_id)
            stream.fail(error)
        self._dead.set()
