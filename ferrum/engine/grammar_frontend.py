"""The API process's grammar compiles (see `structured_output/manager.py` for why it compiles
too). xgrammar imports torch, which the API process otherwise never loads: the manager is
imported and built on the first structured request, on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferrum.config import EngineConfig, ModelConfig
from ferrum.engine.input_processor import eos_token_ids
from ferrum.engine.tokenizer import Tokenizer
from ferrum.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrum.structured_output.manager import StructuredOutputManager


def tokenizer_info_builder(
    model_config: ModelConfig, load_tokenizer: Callable[[], Tokenizer | None]
) -> Callable[[], Any] | None:
    """What builds xgrammar's view of the model's vocabulary (None without a tokenizer): the
    model's vocab size (logits width) and its EOS ids as the grammar's end tokens."""
    if model_config.skip_tokenizer_init:
        return None

    def build() -> Any:
        from ferrum.structured_output import build_tokenizer_info

        tokenizer = load_tokenizer()
        assert tokenizer is not None
        return build_tokenizer_info(
            tokenizer,
            vocab_size=model_config.vocab_size,
            stop_token_ids=eos_token_ids(model_config, tokenizer),
        )

    return build


class GrammarFrontend:
    """Every method runs on the event loop thread."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._manager: StructuredOutputManager | None = None
        self._loading: asyncio.Future[StructuredOutputManager] | None = None

    def check_compiled(self, params: SamplingParams) -> bool:
        """True if the grammar is compiled already (a cache hit); False if that is not known
        yet (`compile` it). Raises ValueError for a grammar already known to be bad."""
        assert params.structured_outputs is not None
        if self._manager is None:
            return False
        wait = self._manager.submit(params.structured_outputs)
        if not wait.done():
            return False
        wait.result()
        return True

    async def compile(self, params: SamplingParams) -> None:
        """Compiles the grammar within the timeout; raises ValueError naming the field."""
        assert params.structured_outputs is not None
        manager = self._manager or await self._load()
        await asyncio.to_thread(manager.compile, params.structured_outputs)

    async def _load(self) -> StructuredOutputManager:
        if self._loading is None:
            self._loading = asyncio.ensure_future(asyncio.to_thread(self._build))
        self._manager = await asyncio.shield(self._loading)
        return self._manager

    def _build(self) -> StructuredOutputManager:
        from ferrum.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager(
            self._config.structured_outputs_config,
            tokenizer_info_builder(self._config.model_config, lambda: self._tokenizer),
        )

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()
