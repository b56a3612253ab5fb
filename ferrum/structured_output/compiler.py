"""GrammarCompilerService: grammars compiled off the engine loop, cached, each with a deadline.
Compiles run on threads, at most `max_workers` at once; equal GrammarSpecs share one compile and
one cached result (LRU, successes only). `PendingGrammar.done()` never blocks; `result()` blocks
until `timeout_s` after the ask, then raises GrammarCompileTimeoutError (a ValueError). xgrammar
cannot stop a compile: an overdue one runs on (its result cached) but frees its worker slot, so it
delays no other; past `max_overdue` overdue ones keep their slots (threads stay bounded)."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass

import xgrammar as xgr

from ferrum.config import StructuredOutputsConfig
from ferrum.structured_output.closing import BudgetGuard, Closer, ClosingVocab, tag_exits
from ferrum.structured_output.json_limits import (
    COMPACT_MAX_WHITESPACE,
    PRETTY_MAX_WHITESPACE,
    bound_structural_tag,
    lengths_as_patterns,
)
from ferrum.structured_output.matcher import StructuredOutputMatcher
from ferrum.structured_output.spec import JSON_OBJECT_SCHEMA, GrammarKind, GrammarSpec

_WHAT_IS_INVALID = {
    GrammarKind.JSON: "JSON schema",
    GrammarKind.JSON_OBJECT: "JSON object grammar",
    GrammarKind.REGEX: "regex",
    GrammarKind.CHOICE: "choice",
    GrammarKind.GRAMMAR: "EBNF grammar",
    GrammarKind.STRUCTURAL_TAG: "structural tag",
}
# xgrammar prefixes its errors with "[time] /path/file.cc:line: " (and sometimes a failed check).
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


class GrammarCompileTimeoutError(ValueError):
    """The grammar did not compile within the limit."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled grammar: immutable, shared by every request with an equal spec."""

    spec: GrammarSpec
    grammar: xgr.CompiledGrammar
    closer: Closer | None = None  # what closes it within a token budget

    def new_matcher(self, max_tokens: int | None = None) -> StructuredOutputMatcher:
        """A matcher at the grammar's start; with `max_tokens`, one that closes the grammar
        before that many tokens when it can."""
        if max_tokens is None or self.closer is None:
            return StructuredOutputMatcher(self.grammar)
        return StructuredOutputMatcher(self.grammar, BudgetGuard(self.closer, max_tokens))

    @property
    def memory_size_bytes(self) -> int:
        return self.grammar.memory_size_bytes


class PendingGrammar:
    """One request's wait for its grammar."""

    __slots__ = ("spec", "deadline", "_future", "_timeout_s")

    def __init__(
        self, spec: GrammarSpec, future: Future[CompiledGrammar], deadline: float, timeout_s: float
    ) -> None:
        self.spec = spec
        self.deadline = deadline  # time.monotonic() seconds
        self._future = future
        self._timeout_s = timeout_s

    def done(self) -> bool:
        """Whether `result()` returns or raises at once: compiled, failed, or past the deadline."""
        return self._future.done() or time.monotonic() >= self.deadline

    def result(self) -> CompiledGrammar:
        """The compiled grammar, waiting at most until the deadline. Raises ValueError naming the
        field for an invalid spec, GrammarCompileTimeoutError past the deadline."""
        try:
            return self._future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            raise _timeout_error(self.spec, self._timeout_s) from None


@dataclass(eq=False, slots=True)
class _Job:
    spec: GrammarSpec
    future: Future[CompiledGrammar]
    wanted_until: float  # the latest deadline of the requests waiting for it
    slot_until: float = math.inf  # set when it starts: it holds a worker slot until then
    thread: threading.Thread | None = None


class GrammarCompilerService:
    """Compiles GrammarSpecs for one model's vocabulary. Thread-safe."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        timeout_s: float = 10.0,
        cache_size: int = 256,
        max_workers: int = 4,
        any_whitespace: bool = False,
        max_overdue: int | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if cache_size < 1 or max_workers < 1:
            raise ValueError(
                f"cache_size and max_workers must be >= 1, got {cache_size}, {max_workers}"
            )
        self.timeout_s = float(timeout_s)
        self.cache_size = cache_size
        self.max_workers = max_workers
        self.max_overdue = 4 * max_workers if max_overdue is None else max_overdue
        self.any_whitespace = any_whitespace
        # Our cache replaces xgrammar's: it is keyed by spec and bounded by entries.
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=max_workers, cache_enabled=False
        )
        self._closing_vocab = ClosingVocab(tokenizer_info)
        self._cond = threading.Condition()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._jobs: dict[GrammarSpec, _Job] = {}  # queued or running, by spec
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._closed = False
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="ferrum-grammar-dispatch", daemon=True
        )
        self._dispatcher.start()

    @classmethod
    def from_config(
        cls, tokenizer_info: xgr.TokenizerInfo, config: StructuredOutputsConfig
    ) -> GrammarCompilerService:
        return cls(
            tokenizer_info,
            timeout_s=config.compile_timeout_s,
            cache_size=config.compile_cache_size,
            max_workers=config.compile_max_workers,
            any_whitespace=not config.disable_any_whitespace,
        )

    def submit(self, spec: GrammarSpec) -> PendingGrammar:
        """Starts (or joins, or finds cached) the compile of `spec`; never blocks on it."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                future: Future[CompiledGrammar] = Future()
                future.set_result(compiled)
                return PendingGrammar(spec, future, deadline, self.timeout_s)
            job = self._jobs.get(spec)
            if job is None:
                job = _Job(spec, Future(), deadline)
                self._jobs[spec] = job
                self._queue.append(job)
                self._cond.notify_all()
            else:
                job.wanted_until = max(job.wanted_until, deadline)
            return PendingGrammar(spec, job.future, deadline, self.timeout_s)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """`submit(spec).result()`: blocks at most `timeout_s`."""
        return self.submit(spec).result()

    @property
    def num_running(self) -> int:
        """Compiles running now, overdue ones included."""
        with self._cond:
            return len(self._running)

    @property
    def num_cached(self) -> int:
        with self._cond:
            return len(self._cache)

    def shutdown(self, wait: bool = True) -> None:
        """Fails the queued compiles; with `wait`, also waits for the running ones to end."""
        with self._cond:
            self._closed = True
            for job in self._queue:
                del self._jobs[job.spec]
                job.future.set_exception(RuntimeError("the grammar compiler is shut down"))
            self._queue.clear()
            running = list(self._running)
            self._cond.notify_all()
        self._dispatcher.join()
        if wait:
            for job in running:
                assert job.thread is not None
                job.thread.join()

    def _dispatch_loop(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                self._drop_unwanted(now)
                live = [job for job in self._running if job.slot_until > now]
                num_overdue = len(self._running) - len(live)
                busy = len(live) if num_overdue < self.max_overdue else len(self._running)
                while self._queue and busy < self.max_workers:
                    job = self._queue.popleft()
                    self._start(job, now)
                    live.append(job)
                    busy += 1
                # Wake when a running compile turns overdue (its slot frees) or on notify.
                wake = min((job.slot_until for job in live), default=None)
                self._cond.wait(None if wake is None else max(0.0, wake - now))

    def _drop_unwanted(self, now: float) -> None:
        """Queued jobs whose every requester has passed its deadline are not compiled."""
        if not any(job.wanted_until <= now for job in self._queue):
            return
        kept: deque[_Job] = deque()
        for job in self._queue:
            if job.wanted_until <= now:
                del self._jobs[job.spec]
                job.future.set_exception(_timeout_error(job.spec, self.timeout_s))
            else:
                kept.append(job)
        self._queue = kept

    def _start(self, job: _Job, now: float) -> None:
        job.slot_until = now + self.timeout_s
        job.thread = threading.Thread(
            target=self._run, args=(job,), name="ferrum-grammar-compile", daemon=True
        )
        self._running.add(job)
        job.thread.start()

    def _run(self, job: _Job) -> None:
        compiled: CompiledGrammar | None = None
        error: BaseException | None = None
        try:
            compiled = CompiledGrammar(
                job.spec, self._compile_now(job.spec), self._closer(job.spec)
            )
        except Exception as e:
            error = e
        with self._cond:
            self._running.discard(job)
            del self._jobs[job.spec]
            if compiled is not None:
                self._cache[job.spec] = compiled
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cond.notify_all()
        if compiled is not None:
            job.future.set_result(compiled)
        else:
            assert error is not None
            job.future.set_exception(error)

    def _closer(self, spec: GrammarSpec) -> Closer:
        if spec.kind is not GrammarKind.STRUCTURAL_TAG:
            return Closer(self._closing_vocab)
        return Closer(self._closing_vocab, *tag_exits(json.loads(spec.text)))

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compiles on the calling thread; an invalid spec raises ValueError naming the field."""
        compiler = self._compiler
        try:
            if spec.kind in (GrammarKind.JSON, GrammarKind.JSON_OBJECT):
                schema = JSON_OBJECT_SCHEMA
                if spec.kind is GrammarKind.JSON:
                    schema = json.dumps(lengths_as_patterns(json.loads(spec.text)))
                if not self.any_whitespace:  # one line: xgrammar's `, ` and `: ` separators
                    return compiler.compile_json_schema(schema, any_whitespace=False)
                return compiler.compile_json_schema(
                    schema, any_whitespace=True, max_whitespace_cnt=PRETTY_MAX_WHITESPACE
                )
            if spec.kind is GrammarKind.REGEX:
                return compiler.compile_regex(spec.text)
            if spec.kind is GrammarKind.CHOICE:
                return compiler.compile_grammar(spec.choice_ebnf())
            if spec.kind is GrammarKind.STRUCTURAL_TAG:
                blanks = PRETTY_MAX_WHITESPACE if self.any_whitespace else COMPACT_MAX_WHITESPACE
                tag = bound_structural_tag(json.loads(spec.text), blanks)
                return compiler.compile_structural_tag(json.dumps(tag, ensure_ascii=False))
            return compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as e:
            problem = _XGRAMMAR_ERROR_PREFIX.sub("", str(e)).strip()
            raise ValueError(
                f"{spec.field_name}: invalid {_WHAT_IS_INVALID[spec.kind]}: {problem}"
            ) from None


def _timeout_error(spec: GrammarSpec, timeout_s: float) -> GrammarCompileTimeoutError:
    return GrammarCompileTimeoutError(
        f"{spec.field_name}: the grammar did not compile within the {timeout_s:g} s limit "
        "(structured outputs compile_timeout_s)"
    )
