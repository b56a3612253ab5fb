"""The synchronous front end: text in, RequestOutputs out, over a core client (in this thread, or
data-parallel replicas in processes). `add_request` compiles the grammar (an in-process core shares
the manager) and raises ValueError for a bad one before queueing. A failed core is not restarted:
its error raises from `step`, or EngineDeadError from the next call.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable

from ferrum.config import EngineConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.core import EngineCore
from ferrum.engine.core_client import ClientEvent, CoreClient, FrontEndThread
from ferrum.engine.core_messages import SchedulerStats
from ferrum.engine.dp_client import core_processes
from ferrum.engine.errors import EngineDeadError
from ferrum.engine.front_end import FrontEnd
from ferrum.engine.grammar_frontend import tokenizer_info_builder
from ferrum.engine.inprocess_client import InProcessClient
from ferrum.engine.input_processor import PromptType
from ferrum.logger import init_logger
from ferrum.lora_request import LoRARequest
from ferrum.outputs import RequestOutput
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.sampling_params import RequestOutputKind, SamplingParams
from ferrum.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)


class LLMEngine(FrontEnd):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        tokenizer = self.tokenizer
        self.grammars = StructuredOutputManager(
            config.structured_outputs_config,
            tokenizer_info_builder(config.model_config, lambda: tokenizer),
        )
        self._request_counter = itertools.count()
        self._thread = FrontEndThread()
        self._outputs: list[RequestOutput] = []
        self.client: CoreClient = (
            InProcessClient(config, self.grammars)
            if config.parallel_config.data_parallel_size == 1
            else core_processes(config, EngineRecoveryConfig(engine_failure_policy="exit"))
        )
        # The core(s) stop when this engine is collected or the interpreter exits: the client
        # only holds a weak reference back to it.
        self._finalizer = weakref.finalize(self, _shut_down, self.client, self.grammars)
        try:
            self.client.start(_weak_sink(self), self._thread)
            while self.input_processor is None:
                self._check_alive()
                self.client.poll(self._thread)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    @property
    def core(self) -> EngineCore:
        """The engine core, when it runs in this thread (no data parallelism)."""
        if not isinstance(self.client, InProcessClient) or self.client.core is None:
            raise AttributeError("the engine core runs in other processes")
        return self.client.core

    def shutdown(self) -> None:
        """Stops the core(s) (their worker processes, bounded) and the grammar compiler threads;
        the engine serves no more. Safe to call twice."""
        self.dead_reason = self.dead_reason or "the engine was shut down"
        self._finalizer()

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def start_grammar_compile(self, params: SamplingParams) -> None:
        """Starts compiling `params`' grammar (if any) without waiting: callers adding many
        requests start every compile first, so the compiles run in parallel. Errors are left
        for `add_request` to raise."""
        if params.structured_outputs is not None and self.tokenizer is not None:
            with contextlib.suppress(ValueError):
                self.grammars.submit(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues one request (n completions); on error nothing is queued.
        `output_kind` (default: the params') says what `step` returns of it; `lora_request`:
        the adapter it runs with (None: the base model)."""
        self._check_alive()
        assert self.input_processor is not None
        request = self.input_processor.process(
            request_id,
            prompt,
            params,
            arrival_time,
            output_kind=output_kind,
            lora_request=self.loras.check(lora_request),
        )
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        self.output_processor.add_request(request)
        self.client.add_requests(request.core_requests)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests (unknown ids are ignored); their KV blocks return to the pool as soon
        as their core reads it."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = [self._abort(request_id) for request_id in request_ids]
        return [output for output in outputs if output is not None]

    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.client.stats() or SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def replica_stats(self) -> list[SchedulerStats | None]:
        return self.client.replica_stats()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step (in process), or waits for the next outputs of any core (none
        when no request is open); returns the outputs of the requests that advanced (as their
        SamplingParams.output_kind asks)."""
        self._check_alive()
        if not self.client.has_unfinished_requests():
            return []
        self.client.poll(self._thread)
        self._check_alive()
        outputs, self._outputs = self._outputs, []
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._outputs.extend(outputs)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        logger.error("request %s failed: %s", request_id, error)
        output = self._abort(request_id)
        if output is not None:
            self._outputs.append(output)

    def _die(self, reason: str) -> None:
        self.dead_reason = reason

    def _check_alive(self) -> None:
        """Raises EngineDeadError once a core died (its siblings are stopped first)."""
        if self.dead_reason is not None:
            self._finalizer()
            raise EngineDeadError(self.dead_reason)


def _weak_sink(engine: LLMEngine) -> Callable[[ClientEvent], None]:
    """`engine._on_event`, without keeping the engine alive."""
    ref = weakref.ref(engine)

    def sink(event: ClientEvent) -> None:
        target = ref()
        if target is not None:
            target._on_event(event)

    return sink


def _shut_down(client: CoreClient, grammars: StructuredOutputManager) -> None:
    client.shutdown()
    grammars.shutdown()
