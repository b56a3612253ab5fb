"""StructuredOutputManager: one process's grammar compiles and each request's grammar state.
xgrammar's vocabulary view takes seconds to build, so it is built on its own thread at the first
structured request (compile deadlines start once it exists). The offline `LLMEngine` and its core
share one manager; with the core in its own process each side compiles: the front end to answer a
bad grammar with a 400, the core again from the spec (cache hits for repeated schemas). Shipping
the compiled grammar would cost as much (~100-170 ms and ~0.5-0.8 MB per tool-call schema)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import xgrammar as xgr

from ferrum.config import StructuredOutputsConfig
from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output.compiler import (
    CompiledGrammar,
    GrammarCompilerService,
    PendingGrammar,
)
from ferrum.structured_output.matcher import StructuredOutputMatcher
from ferrum.structured_output.spec import GrammarSpec


class StructuredOutputManager:
    """Thread-safe. `build_tokenizer_info` is None when the engine has no tokenizer."""

    def __init__(
        self,
        config: StructuredOutputsConfig,
        build_tokenizer_info: Callable[[], xgr.TokenizerInfo] | None,
    ) -> None:
        self.config = config
        self._build_tokenizer_info = build_tokenizer_info
        self._lock = threading.Lock()
        self._service: Future[GrammarCompilerService] | None = None

    def submit(self, params: StructuredOutputsParams) -> GrammarWait:
        """Starts (or joins, or finds cached) the compile of `params`' grammar; never blocks on
        it. Raises ValueError when the engine has no tokenizer."""
        if self._build_tokenizer_info is None:
            raise ValueError(
                "structured_outputs: grammars need a tokenizer (skip_tokenizer_init=True)"
            )
        spec = GrammarSpec.from_params(params)
        service = self._service_future()
        if service.done():
            return GrammarWait(spec, service.result().submit(spec), None)
        return GrammarWait(spec, None, service)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """`submit(params).result()`: blocks at most the build of the service + the timeout."""
        return self.submit(params).result()

    def shutdown(self) -> None:
        with self._lock:
            service, self._service = self._service, None
        if service is not None and service.done() and service.exception() is None:
            service.result().shutdown(wait=False)

    def _service_future(self) -> Future[GrammarCompilerService]:
        with self._lock:
            if self._service is None:
                self._service = Future()
                threading.Thread(
                    target=self._build_service,
                    args=(self._service,),
                    name="ferrum-grammar-setup",
                    daemon=True,
                ).start()
            return self._service

    def _build_service(self, future: Future[GrammarCompilerService]) -> None:
        assert self._build_tokenizer_info is not None
        try:
            info = self._build_tokenizer_info()
            future.set_result(GrammarCompilerService.from_config(info, self.config))
        except BaseException as e:
            future.set_exception(e)


class GrammarWait:
    """One request's wait for its grammar: the compile, or first the service it will run on.
    Used by one thread at a time."""

    __slots__ = ("spec", "_pending", "_service")

    def __init__(
        self,
        spec: GrammarSpec,
        pending: PendingGrammar | None,
        service: Future[GrammarCompilerService] | None,
    ) -> None:
        self.spec = spec
        self._pending = pending
        self._service = service

    def done(self) -> bool:
        """True when `result()` returns or raises at once."""
        pending = self._started()
        return pending is not None and pending.done()

    def result(self) -> CompiledGrammar:
        """The compiled grammar, waiting for the service, then at most its compile timeout.
        Raises ValueError naming the field for an invalid grammar or one that timed out."""
        if self._pending is None:
            assert self._service is not None
            self._service.result()
        pending = self._started()
        assert pending is not None
        return pending.result()

    def _started(self) -> PendingGrammar | None:
        if self._pending is None and self._service is not None and self._service.done():
            self._pending = self._service.result().submit(self.spec)
        return self._pending


class RequestGrammar:
    """A request's grammar: compiling, then a matcher over its output tokens. With `max_tokens`
    (the request's) the matcher closes the grammar within that many tokens when it can."""

    __slots__ = ("_wait", "_max_tokens", "matcher")

    def __init__(self, wait: GrammarWait, max_tokens: int | None = None) -> None:
        self._wait = wait
        self._max_tokens = max_tokens
        self.matcher: StructuredOutputMatcher | None = None

    @property
    def field_name(self) -> str:
        return self._wait.spec.field_name

    def poll(self, output_token_ids: Sequence[int]) -> bool:
        """True once the grammar is compiled (the matcher exists), False while it compiles.
        The new matcher accepts `output_token_ids`, the tokens a resumed request already has.
        Raises ValueError if the compile failed or timed out, or those tokens do not match."""
        if self.matcher is None:
            if not self._wait.done():
                return False
            matcher = self._wait.result().new_matcher(self._max_tokens)
            if not matcher.accept_tokens(output_token_ids):
                raise ValueError(
                    f"{self.field_name}: the {len(output_token_ids)} tokens already generated "
                    "do not match the grammar"
                )
            self.matcher = matcher
        return True
