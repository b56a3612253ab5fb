"""What both front ends (`LLMEngine`, `AsyncLLM`) do around their core client: the tokenizer,
the input processor (following each core's KV pool), the output processor, aborts, and the
client's events, handed to the subclass's `_deliver`, `_fail_request` and `_die`."""

from __future__ import annotations

from ferrum.config import EngineConfig
from ferrum.engine.core_client import ClientEvent, CoreClient, EngineDied, RequestsFailed
from ferrum.engine.core_messages import CoreInfo, CoreOutputs
from ferrum.engine.input_processor import InputProcessor, load_tokenizer
from ferrum.engine.lora_frontend import LoRAFrontEnd
from ferrum.engine.output_processor import OutputProcessor
from ferrum.outputs import RequestOutput
from ferrum.request import RequestStatus


class FrontEnd:
    client: CoreClient

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.loras = LoRAFrontEnd(config)
        # Built once a core is loaded, again after a restart (its pool may differ).
        self.input_processor: InputProcessor | None = None
        self.dead_reason: str | None = None

    def _abort(self, request_id: str) -> RequestOutput | None:
        """Finishes a request as aborted in its core and here; its final output (None for an
        unknown or finished id)."""
        child_ids = self.output_processor.child_ids(request_id)
        self.client.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def _on_event(self, event: ClientEvent) -> None:
        match event:
            case CoreOutputs(core_outputs, _):
                outputs, stopped = self.output_processor.process(core_outputs)
                if stopped:
                    self.client.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
                self._deliver(outputs)
            case CoreInfo(max_tokens_in_pool=pool_tokens):
                model_config = self.config.model_config
                self.input_processor = InputProcessor(model_config, self.tokenizer, pool_tokens)
                self._on_ready(event)
            case RequestsFailed(req_ids, error):
                for req_id in req_ids:
                    request_id = self.output_processor.parent_id(req_id)
                    if request_id is not None:
                        self._fail_request(request_id, error)
            case EngineDied(reason):
                self._die(reason)

    def _on_ready(self, info: CoreInfo) -> None:
        """The core(s) are loaded (again, after a restart)."""

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        raise NotImplementedError

    def _die(self, reason: str) -> None:
        raise NotImplementedError
