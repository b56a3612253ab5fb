"""The synchronous engine: add requests, step, abort. `LLM` and the server drive it."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from ferrum.config import EngineConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.output_processor import OutputProcessor, child_request_id
from ferrum.engine.request import Request, RequestStatus
from ferrum.engine.tokenizer import Tokenizer
from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.logger import init_logger
from ferrum.model_executor.model_runner import ModelRunner
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.scheduler import Scheduler

logger = init_logger(__name__)

# A prompt: text, or {"prompt": text} / {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt).
PromptType = str | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        device = torch.device(config.device_config.device)
        model_config = config.model_config
        self.tokenizer = (
            None if model_config.skip_tokenizer_init else Tokenizer.from_pretrained(model_config.tokenizer)
        )
        self.runner = ModelRunner(config, device)
        loaded = time.perf_counter()
        num_blocks = config.cache_config.num_kv_blocks or self.runner.determine_num_kv_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        kv_cache_manager = KVCacheManager(
            num_blocks, config.cache_config.block_size, config.cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config, kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._eos_token_ids = self._resolve_eos_token_ids()
        self._request_counter = itertools.count()
        logger.info(
            "engine ready in %.2f s (model load %.2f s): %s on %s, %s, %d KV blocks of %d tokens",
            time.perf_counter() - start,
            loaded - start,
            model_config.architecture,
            device,
            model_config.dtype,
            num_blocks - 1,
            config.cache_config.block_size,
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def _resolve_eos_token_ids(self) -> list[int]:
        ids = self.config.model_config.eos_token_ids()
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids = [self.tokenizer.eos_token_id] + [i for i in ids if i != self.tokenizer.eos_token_id]
        return ids

    # -- requests -------------------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validates a prompt and returns (text or None, token ids)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], None
        else:
            raise ValueError(
                "prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                f"got {type(prompt).__name__}"
            )
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init=True)")
            token_ids = self.tokenizer.encode(text)
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not token_ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        vocab_size = self.config.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside [0, {vocab_size})")
        return text, token_ids

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Fills max_tokens=None and the model's EOS ids; validates the length limits."""
        params = params.clone()
        max_model_len = self.config.model_config.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max_model_len - num_prompt_tokens
            if params.max_tokens < 1:
                raise ValueError(
                    f"prompt ({num_prompt_tokens} tokens) leaves no room for output under "
                    f"max_model_len={max_model_len}"
                )
        self.scheduler.check_request_fits(num_prompt_tokens, params.max_tokens)
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids.update(self._eos_token_ids)
        return params

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues one request; on error nothing is queued."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.process_prompt(prompt)
        params = self.resolve_params(params, len(token_ids))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        eos = None if params.ignore_eos or not self._eos_token_ids else self._eos_token_ids[0]
        child_params = {}
        for index in range(params.n):
            child = params.clone()
            if params.seed is not None:
                child.seed = params.seed + index
            child_params[child_request_id(request_id, index, params.n)] = child
        self.output_processor.add_request(request_id, text, token_ids, child_params, arrival_time)
        for child_id, child in child_params.items():
            self.scheduler.add_request(Request(child_id, token_ids, child, eos, arrival_time))

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests (unknown ids are ignored); their KV blocks return to the pool now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules, runs one forward, and returns the outputs of the requests that advanced."""
        scheduler_output = self.scheduler.schedule()
        # An empty step still tells the runner which requests finished.
        runner_output = self.runner.execute_model(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        logprobs = (
            dict(zip(runner_output.req_ids, runner_output.logprobs))
            if runner_output.logprobs is not None
            else {}
        )
        outputs, stopped = self.output_processor.process(updates, logprobs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
