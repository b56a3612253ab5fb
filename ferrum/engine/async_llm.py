"""The asyncio front end: text in, streams of RequestOutputs out, over a core in another process.

It mirrors `LLMEngine` (same InputProcessor / OutputProcessor), but the EngineCore runs in its own
process behind an `EngineCoreClient`. Structured outputs: this process compiles each grammar too
(`structured_output/manager.py` says why), imported and built on the first such request, off the
event loop; a request is sent to the core only once its grammar compiled, and a bad grammar or a
compile past the timeout fails it with a ValueError (`compile_grammar` raises it before the
request is queued; a request added while its grammar compiles gets it from its stream). Every method must be called from the event loop thread that
called `start()`; messages from the core are handed to that loop by the client's thread.

The core can fail: a step raises, the process dies, or it stops stepping while it holds requests
(no message for `engine_stall_timeout` seconds). With `engine_failure_policy="restart"` the front
end then starts a fresh core and resumes every open completion on it from the tokens it has
streamed (its detokenizer and stream stay here, so clients see no seam); `recovery.py` decides
which requests are blamed and when to give up. Dead (given up, or policy "exit"): every stream
fails and `wait_dead()` returns, for the server to exit non-zero. While a core restarts, new
requests are accepted and wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
    EngineCoreRequest,
    FromCore,
    SchedulerStats,
)
from ferrum.engine.core_stats import StatsAcrossCores
from ferrum.engine.grammar_frontend import GrammarFrontend
from ferrum.engine.input_processor import (
    InputProcessor,
    PromptType,
    child_request_id,
    load_tokenizer,
)
from ferrum.engine.output_processor import OutputProcessor
from ferrum.engine.recovery import (
    RecoveryTracker,
    resumed_request,
    trial_request,
    unclip_trial_output,
)
from ferrum.engine.request_stream import RequestStream
from ferrum.logger import init_logger
from ferrum.outputs import RequestOutput
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.request import RequestStatus, check_request_fits
from ferrum.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The core process failed or exited; no request can be served any more."""


class EngineNotReadyError(RuntimeError):
    """The core process is still loading."""


class RequestCrashedEngineError(RuntimeError):
    """The request was in the failing step of two engine-core crashes: it is failed alone so
    that the other requests go on."""


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        recovery_config: EngineRecoveryConfig | None = None,
        share_with: AsyncLLM | None = None,
    ) -> None:
        """`share_with`: a data-parallel sibling whose tokenizer and grammar compiles this one
        uses too (same model)."""
        self.config = config
        self.recovery_config = recovery_config or EngineRecoveryConfig()
        self.tokenizer = (
            share_with.tokenizer if share_with is not None else load_tokenizer(config.model_config)
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor: InputProcessor | None = None
        self.dead_reason: str | None = None
        # Why the current core is being started again (None: the first core, or it is ready).
        self.restart_reason: str | None = None
        self.num_restarts = 0
        self._streams: dict[str, RequestStream] = {}
        # Each open completion's request as validated, in arrival order: resumed from it.
        self._core_requests: dict[str, EngineCoreRequest] = {}
        self._recovery = RecoveryTracker(self.recovery_config)
        self._stats = StatsAcrossCores()
        self._finished_listeners: list[Callable[[RequestOutput], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[CoreInfo] | None = None
        self._dead = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        # Messages of a core count only while their epoch is current: a failed core's late
        # messages are dropped.
        self._epoch = 0
        self._core_ready = False
        self._core_started = 0.0
        # When the current core last finished a step, or last had no request to work on.
        self._last_progress = time.monotonic()
        self._client = self._new_client()
        self.grammars = (
            share_with.grammars
            if share_with is not None
            else GrammarFrontend(config, self.tokenizer)
        )

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, recovery_config: EngineRecoveryConfig | None = None
    ) -> AsyncLLM:
        return cls(engine_args.create_engine_config(), recovery_config)

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> CoreInfo:
        """Spawns the core process and waits until it is loaded; raises EngineDeadError if the
        core fails to start."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._core_started = time.perf_counter()
        self._client.start()
        logger.info("engine core process started (pid %s); loading the model", self._client.pid)
        self._watchdog = self._loop.create_task(self._watch_progress())
        return await self._ready

    @property
    def is_ready(self) -> bool:
        return self.input_processor is not None and self.dead_reason is None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def health_problem(self) -> tuple[str, str] | None:
        """(code, message) of why the engine cannot serve now, or None when it can."""
        if self.dead_reason is not None:
            return "engine_dead", f"the engine is dead: {self.dead_reason}"
        if self.input_processor is None:
            return "engine_loading", "the engine is still loading"
        if self.restart_reason is not None:
            return "engine_restarting", f"the engine core is restarting: {self.restart_reason}"
        return None

    async def wait_dead(self) -> str:
        """Returns (the reason) once the engine is dead: it serves nothing any more."""
        await self._dead.wait()
        assert self.dead_reason is not None
        return self.dead_reason

    async def shutdown(self) -> None:
        """Finishes every open stream as aborted, then stops the core process (bounded)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.abort_all()
        self.grammars.shutdown()
        await asyncio.to_thread(self._client.shutdown)

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
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> RequestStream:
        """Validates and queues one request (n completions); on error nothing is queued. While
        the core restarts, the request waits for it.

        Iterate the returned stream to get outputs; leaving the iteration early (break, error,
        cancellation) aborts the request in the core.
        """
        prompt, requests = self.check_can_serve().process(request_id, prompt, params)
        compiled = params.structured_outputs is None or self.grammars.check_compiled(params)
        self.output_processor.add_request(request_id, prompt, requests)
        merge_deltas = params.output_kind is RequestOutputKind.DELTA
        stream = self._streams[request_id] = RequestStream(request_id, self.abort, merge_deltas)
        if compiled:
            self._queue(requests)
        else:
            assert self._loop is not None
            self._loop.create_task(self._add_when_compiled(stream, params, requests))
        return stream

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles `params`' grammar (if any) within the compile timeout; raises ValueError
        naming the field for a bad grammar or one that timed out. Awaited before `add_request`,
        a bad grammar is refused before anything is queued or streamed."""
        if params.structured_outputs is not None and not self.grammars.check_compiled(params):
            await self.grammars.compile(params)

    async def _add_when_compiled(
        self, stream: RequestStream, params: SamplingParams, requests: list[EngineCoreRequest]
    ) -> None:
        try:
            await self.grammars.compile(params)
        except Exception as e:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self.output_processor.abort(stream.request_id)
                stream.fail(e)
            return
        # Aborted while it compiled: the core never hears of it.
        if self._streams.get(stream.request_id) is stream and self.dead_reason is None:
            self._queue(requests)

    def _queue(self, requests: list[EngineCoreRequest]) -> None:
        """Sends a request's completions to the core (kept for a restarted core to resume);
        while the core restarts, they wait for it."""
        for request in requests:
            self._core_requests[request.req_id] = request
        if self._core_ready and self._recovery.on_trial is None:
            self._client.add_requests(requests)

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
        child_ids = self.output_processor.child_ids(request_id)
        self._client.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        self._forget(child_ids)
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
        """Scheduler stats: the counters summed over every core so far; the gauges of the
        current core's latest step, or 0 while no core is serving (restarting or dead). None
        before the first step."""
        return self._stats.current(serving=self._core_ready and self.dead_reason is None)

    def replica_stats(self) -> list[SchedulerStats | None]:
        """`[stats()]`: the stats of each engine core serving (one here)."""
        return [self.stats()]

    def fail(self, reason: str) -> None:
        """Declares the engine dead for `reason` (a data-parallel sibling died): every open
        stream fails and `wait_dead()` returns; `shutdown()` still stops the core."""
        if self.dead_reason is None:
            self._die(reason)

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        """`listener(output)` is called once per request when it finishes or is aborted."""
        self._finished_listeners.append(listener)

    # -- messages from the core ----------------------------------------------------------------

    def _new_client(self) -> EngineCoreClient:
        on_message = functools.partial(self._on_core_message, self._epoch)
        return EngineCoreClient(self.config, on_message, core_index=self.num_restarts)

    def _on_core_message(self, epoch: int, message: FromCore) -> None:
        """Called on the client's thread: hands the message to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the loop closed since the check; nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._handle_core_message, epoch, message)

    def _handle_core_message(self, epoch: int, message: FromCore) -> None:
        if epoch != self._epoch:
            return
        match message:
            case CoreOutputs(core_outputs, stats):
                self._last_progress = time.monotonic()
                self._stats.update(stats)
                self._process_outputs(core_outputs)
            case CoreInfo():
                self._on_core_ready(message)
            case CoreFailed(reason, req_ids):
                self._on_core_failure(reason, req_ids)

    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> None:
        trial = self._recovery.on_trial
        if trial is not None:
            core_outputs = [self._unclip(o) if o.req_id == trial else o for o in core_outputs]
        outputs, stopped = self.output_processor.process(core_outputs)
        self._client.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
                n = len(output.outputs)
                self._forget(
                    [child_request_id(output.request_id, c.index, n) for c in output.outputs]
                )
                self._notify_finished(output)
            if stream is not None:
                stream.put(output)
        # The trial's one output ends it (unless it finished the completion: then `_forget`
        # moved on already).
        if (
            trial is not None
            and trial == self._recovery.on_trial
            and any(o.req_id == trial for o in core_outputs)
        ):
            self._recovery.pass_trial()
            self._resume()

    def _fail_request(self, child_id: str, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            if child_id in self.output_processor.child_ids(request_id):
                self.abort(request_id)
                stream.fail(error)

    def _notify_finished(self, output: RequestOutput) -> None:
        for listener in self._finished_listeners:
            try:
                listener(output)
            except Exception:
                logger.exception("finished-request listener failed")

    def _forget(self, child_ids: list[str]) -> None:
        """Drops finished or aborted completions; a completion on trial is replaced by the
        next."""
        trial = self._recovery.on_trial
        for child_id in child_ids:
            self._core_requests.pop(child_id, None)
            self._recovery.forget(child_id)
        if trial in child_ids and self._core_ready:
            self._resume()

    # -- failures and restarts -----------------------------------------------------------------

    def _on_core_ready(self, info: CoreInfo) -> None:
        # A restarted core may size its KV pool differently: the length checks follow it.
        self.input_processor = InputProcessor(
            self.config.model_config, self.tokenizer, info.max_tokens_in_pool
        )
        self._fail_unfitting(info.max_tokens_in_pool)
        self._core_ready = True
        self._last_progress = time.monotonic()
        logger.info(
            "engine core ready in %.2f s (process start + imports %.2f s, engine %.2f s): "
            "%d KV blocks, %d tokens in the pool",
            time.perf_counter() - self._core_started,
            info.import_seconds,
            info.engine_seconds,
            info.num_kv_blocks,
            info.max_tokens_in_pool,
        )
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(info)
        if self.restart_reason is not None:
            self.restart_reason = None
            self._resume()

    def _fail_unfitting(self, pool_tokens: int) -> None:
        """Fails alone each open completion that a restarted core's (smaller) KV pool can no
        longer hold; resending it would crash that core too. Runs before the core counts as
        ready, so failing one does not resume the others early."""
        max_model_len = self.config.model_config.max_model_len
        for child_id, request in list(self._core_requests.items()):
            max_tokens = request.sampling_params.max_tokens
            assert max_tokens is not None
            try:
                check_request_fits(
                    len(request.prompt_token_ids), max_tokens, max_model_len, pool_tokens
                )
            except ValueError as e:
                self._fail_request(
                    child_id, ValueError(f"the restarted engine core cannot hold it: {e}")
                )

    def _resume(self) -> None:
        """Sends the open completions to a fresh core: the next one on probation alone, or
        (nobody on probation) all of them, each from the tokens it already has."""
        trial = self._recovery.start_next_trial()
        while trial is not None and self._resumed_request(trial) is None:
            self._recovery.forget(trial)  # finished meanwhile
            trial = self._recovery.start_next_trial()
        if trial is not None:
            request = self._resumed_request(trial)
            assert request is not None
            request = trial_request(request)
            logger.warning(
                "running %s alone: it was in the step that crashed the engine core (%d more "
                "on probation)",
                trial,
                self._recovery.num_on_probation - 1,
            )
            self._client.add_requests([request])
            return
        requests = [r for c in self._core_requests if (r := self._resumed_request(c)) is not None]
        if requests:
            num_tokens = sum(len(r.output_token_ids) for r in requests)
            logger.info(
                "resuming %d completion(s) on the engine core, %d token(s) already generated",
                len(requests),
                num_tokens,
            )
            self._client.add_requests(requests)

    def _resumed_request(self, child_id: str) -> EngineCoreRequest | None:
        """The completion's request with the tokens it has so far; None once it is finished."""
        token_ids = self.output_processor.output_token_ids(child_id)
        request = self._core_requests.get(child_id)
        if token_ids is None or request is None:
            return None
        return resumed_request(request, token_ids)

    def _unclip(self, output: EngineCoreOutput) -> EngineCoreOutput:
        token_ids = self.output_processor.output_token_ids(output.req_id) or []
        request = self._core_requests[output.req_id]
        max_model_len = self.config.model_config.max_model_len
        return unclip_trial_output(output, request, len(token_ids), max_model_len)

    def _on_core_failure(self, reason: str, req_ids: list[str] | None) -> None:
        """The current core failed (`req_ids`: the requests of its failing step, if known):
        restart it, or die."""
        if self.dead_reason is not None:
            return
        was_ready, self._core_ready = self._core_ready, False
        self._retire_client()
        if self.recovery_config.engine_failure_policy == "exit":
            self._die(reason)
            return
        if not was_ready:
            what = "a restarted engine core" if self.num_restarts else "the engine core"
            self._die(f"{what} failed before it was ready: {reason}")
            return
        suspects = None
        if req_ids is not None:
            failed_step = set(req_ids)
            suspects = [c for c in self._core_requests if c in failed_step]
        verdict = self._recovery.record_crash(suspects)
        if verdict.give_up is not None:
            self._die(f"{reason}; giving up after {verdict.give_up}")
            return
        error = RequestCrashedEngineError(
            f"the request was in the failing step of two engine-core crashes, the last: {reason}"
        )
        for child_id in verdict.failed:
            logger.error("failing %s alone: it crashed the engine core twice", child_id)
            self._fail_request(child_id, error)
        self.num_restarts += 1
        self.restart_reason = reason
        logger.warning(
            "%s; starting engine core #%d (crash %d of at most %d within %g s); %d open "
            "request(s) wait for it",
            reason,
            self.num_restarts,
            self._recovery.num_recent_crashes,
            self.recovery_config.engine_max_restarts,
            self.recovery_config.engine_restart_window,
            len(self._streams),
        )
        self._client = self._new_client()
        self._core_started = time.perf_counter()
        self._client.start()

    def _retire_client(self) -> None:
        """Stops listening to the current core and kills its process."""
        self._epoch += 1
        self._stats.retire_core()
        self._client.kill()

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self.restart_reason = None
        logger.error("%s; failing %d in-flight request(s)", reason, len(self._streams))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        error = EngineDeadError(reason)
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            self._forget(self.output_processor.child_ids(request_id))
            self.output_processor.abort(request_id)
            stream.fail(error)
        self._dead.set()

    async def _watch_progress(self) -> None:
        """Counts a core that holds requests and finishes no step for `engine_stall_timeout`
        seconds as failed (it is killed)."""
        timeout = self.recovery_config.engine_stall_timeout
        while self.dead_reason is None:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            if not (self._core_ready and self._core_requests):
                self._last_progress = now
            elif now - self._last_progress > timeout:
                self._on_core_failure(
                    f"the engine core (pid {self._client.pid}) finished no step for "
                    f"{now - self._last_progress:.1f} s while holding "
                    f"{len(self._core_requests)} completion(s)",
                    None,
                )
