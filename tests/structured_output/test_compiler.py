"""GrammarCompilerService: cache, shared compiles, invalid specs, deadlines."""

from __future__ import annotations

import threading

import pytest
import xgrammar as xgr

from ferrum.config import StructuredOutputsConfig
from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output import (
    GrammarCompilerService,
    GrammarCompileTimeoutError,
    GrammarKind,
    GrammarSpec,
)


def _spec(**kwargs) -> GrammarSpec:
    return GrammarSpec.from_params(StructuredOutputsParams(**kwargs))


def _slow_ebnf(num_rules: int) -> str:
    """A chain of rules xgrammar compiles in time growing about as num_rules**2
    (3000 rules: about a second on one core)."""
    rules = [f'r{i} ::= [a-z]+ "{i}" r{i + 1}' for i in range(num_rules)]
    return "\n".join(["root ::= r0", *rules, f'r{num_rules} ::= "."'])


def test_equal_specs_share_one_cached_grammar(compiler):
    first = compiler.compile(
        _spec(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    again = compiler.compile(
        _spec(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    )
    assert again is first
    assert compiler.submit(first.spec).done()


def test_cache_drops_least_recently_used(tokenizer_info):
    service = GrammarCompilerService(tokenizer_info, cache_size=2, max_workers=1)
    try:
        a, b, c = (_spec(regex=r) for r in ("a+", "b+", "c+"))
        grammar_a = service.compile(a)
        grammar_b = service.compile(b)
        assert service.compile(a) is grammar_a  # a is now the most recently used
        service.compile(c)  # evicts b
        assert service.num_cached == 2
        assert service.compile(a) is grammar_a
        assert service.compile(b) is not grammar_b  # compiled anew
    finally:
        service.shutdown()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"json": {"type": "foo"}}, r"structured_outputs\.json: invalid JSON schema: .*foo"),
        ({"regex": "a(b"}, r"structured_outputs\.regex: invalid regex: .*parenthesis"),
        (
            {"grammar": "root ::= rule"},
            r"structured_outputs\.grammar: invalid EBNF grammar: .*rule",
        ),
        ({"grammar": "start ::= 'a'"}, r"structured_outputs\.grammar: invalid EBNF grammar"),
        (
            {"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}},
            r"structured_outputs\.structural_tag: invalid structural tag",
        ),
    ],
)
def test_invalid_spec_is_a_value_error_naming_the_field(compiler, params, message):
    pending = compiler.submit(_spec(**params))
    with pytest.raises(ValueError, match=message) as info:
        pending.result()
    assert "[" not in str(info.value).split(":")[0]  # xgrammar's "[time] file.cc:N" is gone
    assert not isinstance(info.value, GrammarCompileTimeoutError)


def test_concurrent_requests_share_one_compile(tokenizer_info):
    service = GrammarCompilerService(tokenizer_info, max_workers=2)
    started = threading.Event()
    release = threading.Event()
    calls: list[GrammarSpec] = []
    real_compile = service._compile_now

    def blocking_compile(spec):
        calls.append(spec)
        started.set()
        release.wait()
        return real_compile(spec)

    service._compile_now = blocking_compile
    try:
        spec = _spec(choice=["x", "y"])
        first, second = service.submit(spec), service.submit(spec)
        started.wait()
        assert not first.done() and not second.done()
        release.set()
        assert first.result() is second.result()
        assert calls == [spec]
    finally:
        release.set()
        service.shutdown()


def test_overdue_compile_fails_its_request_and_frees_its_worker(tokenizer_info):
    """Deterministic: the slow compile blocks until the test releases it."""
    service = GrammarCompilerService(tokenizer_info, timeout_s=0.05, max_workers=1)
    slow_spec = _spec(regex="slow")
    started, release = threading.Event(), threading.Event()
    real_compile = service._compile_now

    def compile_slow_spec_on_release(spec):
        if spec == slow_spec:
            started.set()
            release.wait()
        return real_compile(spec)

    service._compile_now = compile_slow_spec_on_release
    try:
        pending = service.submit(slow_spec)
        started.wait()
        with pytest.raises(
            GrammarCompileTimeoutError,
            match=r"structured_outputs\.regex: the grammar did not compile within the 0\.05 s "
            r"limit",
        ):
            pending.result()
        assert service.num_running == 1  # xgrammar cannot stop it: it runs on
        # Later requests get a generous deadline: what is tested is that they get the slot.
        service.timeout_s = 30.0
        assert service.compile(_spec(regex="fast")).spec.text == "fast"
        assert service.num_running == 1
        release.set()
        # The overdue compile ends and is cached: the same request now succeeds at once.
        while service.num_running:
            release.wait(0.01)
        assert service.submit(slow_spec).done()
        assert service.compile(slow_spec).spec == slow_spec
    finally:
        release.set()
        service.shutdown()


def test_pathological_grammar_times_out_while_other_compiles_work(tokenizer_info):
    service = GrammarCompilerService(tokenizer_info, timeout_s=0.15, max_workers=1)
    try:
        slow = service.submit(GrammarSpec(GrammarKind.GRAMMAR, _slow_ebnf(3000)))
        with pytest.raises(GrammarCompileTimeoutError, match=r"within the 0\.15 s limit"):
            slow.result()
        assert slow.done()
        service.timeout_s = 30.0  # the next compile's deadline is not what this test measures
        # A small grammar still compiles within its own deadline on the one worker.
        assert service.compile(_spec(regex="[ab]{3}")).spec.kind is GrammarKind.REGEX
    finally:
        service.shutdown(wait=True)


def test_shutdown_fails_queued_compiles(tokenizer_info):
    service = GrammarCompilerService(tokenizer_info, max_workers=1)
    started, release = threading.Event(), threading.Event()
    real_compile = service._compile_now

    def blocking_compile(spec):
        started.set()
        release.wait()
        return real_compile(spec)

    service._compile_now = blocking_compile
    running = service.submit(_spec(regex="a"))
    started.wait()
    queued = service.submit(_spec(regex="b"))
    stopper = threading.Thread(target=service.shutdown, kwargs={"wait": True})
    stopper.start()
    with pytest.raises(RuntimeError, match="shut down"):
        queued.result()  # failed by shutdown while "a" still runs
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert running.result().spec.text == "a"
    with pytest.raises(RuntimeError, match="shut down"):
        queued.result()
    with pytest.raises(RuntimeError, match="shut down"):
        service.submit(_spec(regex="c"))


def test_service_from_config(tokenizer_info, tokenizer):
    config = StructuredOutputsConfig(
        compile_timeout_s=3.0,
        compile_cache_size=7,
        compile_max_workers=2,
        disable_any_whitespace=True,
    )
    service = GrammarCompilerService.from_config(tokenizer_info, config)
    try:
        assert (service.timeout_s, service.cache_size, service.max_workers) == (3.0, 7, 2)
        grammar = service.compile(_spec(json={"type": "array", "items": {"type": "integer"}}))
        assert grammar.new_matcher().accept_tokens(tokenizer.encode("[1, 2]"))
        assert not grammar.new_matcher().accept_tokens(tokenizer.encode("[ 1, 2]"))
    finally:
        service.shutdown()


def test_structural_tag_compiles_and_constrains(compiler):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
            "end": "</call>",
        },
    }
    grammar = compiler.compile(_spec(structural_tag=tag))
    assert grammar.spec.kind is GrammarKind.STRUCTURAL_TAG
    matcher = xgr.GrammarMatcher(grammar.grammar)
    assert matcher.accept_string("<call>42</call>")
    assert not xgr.GrammarMatcher(grammar.grammar).accept_string("<call>x")
