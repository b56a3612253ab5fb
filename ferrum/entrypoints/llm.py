"""The offline API: `LLM(model).generate(prompts, sampling_params)` with vLLM's names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from ferrum.default_model import DEFAULT_MODEL_NAME
from ferrum.engine.arg_utils import EngineArgs, check_not_supported_yet
from ferrum.engine.input_processor import ProcessedPrompt, PromptType
from ferrum.engine.llm_engine import LLMEngine
from ferrum.errors import FieldError
from ferrum.lora_request import LoRARequest
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]
_ENGINE_ARG_NAMES = frozenset(f.name for f in fields(EngineArgs))
_PROMPT_TYPES = "a string, {'prompt': str}, {'prompt_token_ids': [int, ...]}, or a list of these"


class LLM:
    """An engine for offline batched generation. `model`: a local Hugging Face model folder, or the
    shipped "ferrum-tiny-qwen3" when left out. Keyword arguments are the fields of `EngineArgs`;
    vLLM arguments ferrum lacks raise a ValueError saying so.
    """

    def __init__(self, model: str = DEFAULT_MODEL_NAME, **kwargs: Any) -> None:
        check_not_supported_yet({k: v for k, v in kwargs.items() if k not in _ENGINE_ARG_NAMES})
        kwargs = {k: v for k, v in kwargs.items() if k in _ENGINE_ARG_NAMES}
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args.create_engine_config())
        self._shut_down = False

    def shutdown(self) -> None:
        """Stops the engine now: its worker and engine-core processes (tensor and data
        parallelism) and its threads. Safe to call twice; `generate` and `chat` raise after it.
        (Without it they stop when the LLM is garbage-collected or the interpreter exits.)"""
        self._shut_down = True
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json values (vLLM's default)."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling_kwargs())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in input order.
        A prompt of the wrong type is a TypeError naming the accepted ones. `lora_request`: the
        adapter of every prompt, or one per prompt (None: the base model); needs enable_lora."""
        if self._shut_down:
            raise RuntimeError("LLM: generate after shutdown(); create a new LLM")
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._per_prompt_params(sampling_params, len(prompts))
        loras = _per_prompt_loras(lora_request, len(prompts))
        engine = self.llm_engine
        for p in params:
            engine.start_grammar_compile(p)
        request_ids: list[str] = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            request_id = engine.next_request_id()
            try:
                engine.add_request(
                    request_id,
                    prompt,
                    p,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    lora_request=lora,
                )
            except (TypeError, ValueError) as e:
                # All or nothing: a bad prompt leaves no request of this call in the engine.
                engine.abort_request(request_ids)
                raise _for_prompt(i, e) from e
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates (with
        `lora_request` as in `generate`)."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                list(conversation),
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any BOS token: do not add special tokens again.
            prompts.append(
                {
                    "prompt": text,
                    "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                }
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    @staticmethod
    def _per_prompt_params(
        sampling_params: SamplingParams | Sequence[SamplingParams], num_prompts: int
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt."""
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"sampling_params: got {len(params)} for {num_prompts} prompts (give one, or one "
                "per prompt)"
            )
        return params

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        num_prompt_tokens = num_output_tokens = 0
        with tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        ) as bar:
            try:
                while len(finished) < len(request_ids):
                    for output in engine.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            num_prompt_tokens += len(output.prompt_token_ids)
                            num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(
                                f"est. speed input: {num_prompt_tokens / elapsed:.2f} toks/s, "
                                f"output: {num_output_tokens / elapsed:.2f} toks/s",
                                refresh=False,
                            )
                            bar.update(1)
            except BaseException:
                engine.abort_request([r for r in request_ids if r not in finished])
                raise
        return [finished[r] for r in request_ids]


def _prompt_list(prompts: Any) -> list[PromptType]:
    """One prompt, or a list of them (each is checked when its request is added)."""
    if isinstance(prompts, (str, dict, ProcessedPrompt)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise TypeError(f"prompts must be {_PROMPT_TYPES}; got {type(prompts).__name__}")
    return list(prompts)


def _per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, as vLLM: one for all, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"lora_request: got {len(loras)} for {num_prompts} prompts (give one, or one per "
            "prompt)"
        )
    return loras


def _for_prompt(index: int, error: TypeError | ValueError) -> TypeError | ValueError:
    """`error`, its message saying which prompt it is about."""
    message = f"prompts[{index}]: {error}"
    if isinstance(error, FieldError):
        return FieldError(error.field, message)
    return type(error)(message)
