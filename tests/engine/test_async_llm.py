"""AsyncLLM over a scripted engine core: resuming open completions on a restarted core, stall
detection, health, metrics of a core that is gone, poison-request isolation and giving up."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine import process_client as process_client_module
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    FromCore,
    SchedulerStats,
)
from ferrum.engine.errors import EngineDeadError, RequestCrashedEngineError
from ferrum.outputs import RequestOutput
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.request import RequestStatus
from ferrum.sampling_params import RequestOutputKind, SamplingParams

INFO = CoreInfo(num_kv_blocks=64, max_tokens_in_pool=1024, import_seconds=0, engine_seconds=0)


def stats(num_running: int, hits: int = 0) -> SchedulerStats:
    return SchedulerStats(num_running, 0, 0.5, 10, hits, 1)


class FakeCoreClient:
    """Records what the front end sends; `deliver` plays a message from the core."""

    def __init__(
        self, config: object, on_message: Callable[[FromCore], None], core_index: int = 0
    ) -> None:
        self.on_message = on_message
        self.core_index = core_index
        self.started = False
        self.killed = False
        self.added: list[EngineCoreRequest] = []
        self.finished: list[tuple[list[str], RequestStatus]] = []
        self.pid = 1000 + core_index
        self.pids: tuple[int, ...] = ()  # no process: it spends no CPU time

    def start(self) -> None:
        self.started = True

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.added.extend(requests)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        if req_ids:
            self.finished.append((req_ids, status))

    def kill(self) -> None:
        self.killed = True

    def shutdown(self) -> None:
        pass

    async def deliver(self, *messages: FromCore) -> None:
        for message in messages:
            self.on_message(message)
        # Lets the loop run the handler, then the stream readers it woke.
        for _ in range(5):
            await asyncio.sleep(0)

    @property
    def added_ids(self) -> list[str]:
        return [r.req_id for r in self.added]


class Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, **recovery: Any) -> None:
        self.cores: list[FakeCoreClient] = []

        def make_client(*args: Any, **kwargs: Any) -> FakeCoreClient:
            self.cores.append(FakeCoreClient(*args, **kwargs))
            return self.cores[-1]

        monkeypatch.setattr(process_client_module, "CoreProcess", make_client)
        config = EngineArgs(DEFAULT_MODEL_DIR, device="cpu", dtype="float32").create_engine_config()
        self.engine = AsyncLLM(config, EngineRecoveryConfig(**recovery))

    @property
    def core(self) -> FakeCoreClient:
        return self.cores[-1]

    async def start(self) -> None:
        starting = asyncio.ensure_future(self.engine.start())
        await asyncio.sleep(0)
        await self.core.deliver(INFO)
        await starting

    def add(self, request_id: str, n: int = 1, seed: int | None = None) -> Collector:
        params = SamplingParams(
            n=n,
            max_tokens=20,
            temperature=0.0 if seed is None else 1.0,
            seed=seed,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        stream = self.engine.add_request(request_id, {"prompt_token_ids": [5, 6, 7]}, params)
        return Collector(stream)

    async def tokens(self, core: FakeCoreClient, updates: dict[str, list[int]], **kw: Any) -> None:
        outputs = [EngineCoreOutput(req_id, ids) for req_id, ids in updates.items()]
        await core.deliver(CoreOutputs(outputs, kw.get("stats", stats(len(outputs)))))


class Collector:
    """Reads a request's stream in the background: its token ids per completion, its error."""

    def __init__(self, stream: Any) -> None:
        self.token_ids: dict[int, list[int]] = {}
        self.error: BaseException | None = None
        self.finished = False
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: Any) -> None:
        try:
            async for output in stream:
                assert isinstance(output, RequestOutput)
                for c in output.outputs:
                    self.token_ids.setdefault(c.index, []).extend(c.token_ids)
                self.finished = output.finished
        except Exception as e:
            self.error = e


def run(test: Callable[[Harness], Coroutine[Any, Any, None]], harness: Harness) -> None:
    async def main() -> None:
        try:
            await test(harness)
        finally:
            await harness.engine.shutdown()

    asyncio.run(main())


def test_open_completions_resume_on_a_fresh_core(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)

    async def scenario(h: Harness) -> None:
        await h.start()
        first = h.core
        a, b = h.add("a"), h.add("b", n=2, seed=3)
        await h.tokens(first, {"a": [11], "0#b": [21], "1#b": [31]}, stats=stats(3, hits=4))
        await h.tokens(first, {"a": [12], "0#b": [22]}, stats=stats(3, hits=4))
        assert h.engine.stats() == stats(3, hits=4)
        await first.deliver(CoreFailed("engine core failed: boom"))  # cause unknown
        assert first.killed and h.core is not first and h.core.core_index == 1
        code, message = h.engine.health_problem() or ("", "")
        assert code == "engine_restarting" and "boom" in message
        # Gauges of a core that is gone are not reported; counters keep counting.
        assert h.engine.stats() == SchedulerStats(0, 0, 0.0, 10, 4, 1)
        c = h.add("c")  # waits for the new core
        # A late message of the failed core is ignored.
        await h.tokens(first, {"a": [99]})
        await h.core.deliver(INFO)
        assert h.engine.health_problem() is None
        resumed = {r.req_id: r for r in h.core.added}
        assert list(resumed) == ["a", "0#b", "1#b", "c"]
        assert resumed["a"].output_token_ids == [11, 12]
        assert resumed["0#b"].output_token_ids == [21, 22]
        assert resumed["1#b"].output_token_ids == [31]
        assert resumed["c"].output_token_ids == []
        assert resumed["a"].prompt_token_ids == [5, 6, 7]
        assert resumed["1#b"].sampling_params.seed == 4
        assert resumed["1#b"].sampling_params.max_tokens == 20
        await h.tokens(h.core, {"a": [13], "0#b": [23], "1#b": [32], "c": [41]})
        assert a.token_ids == {0: [11, 12, 13]}
        assert b.token_ids == {0: [21, 22, 23], 1: [31, 32]}
        assert c.token_ids == {0: [41]} and a.error is b.error is c.error is None
        assert h.engine.stats() == SchedulerStats(4, 0, 0.5, 20, 4, 2)

    run(scenario, h)


def test_a_core_that_stops_stepping_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, engine_stall_timeout=0.2)

    async def scenario(h: Harness) -> None:
        await h.start()
        first = h.core
        await asyncio.sleep(0.5)  # idle: no request, no stall
        assert h.core is first
        a = h.add("a")
        await h.tokens(first, {"a": [11]})

        async def until_replaced() -> None:
            while h.core is first:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(until_replaced(), 10)
        assert first.killed
        code, message = h.engine.health_problem() or ("", "")
        assert code == "engine_restarting"
        assert "engine core (pid 1000) finished no step and spent no CPU time for" in message
        assert "holding 1 completion(s)" in message
        assert h.engine.stats() is not None and h.engine.stats().num_running == 0
        second = h.core  # itself replaced in turn if the test stalls past 0.2 s from here
        await second.deliver(INFO)
        assert [(r.req_id, r.output_token_ids) for r in second.added] == [("a", [11])]
        assert a.error is None

    run(scenario, h)


def test_a_request_that_crashes_the_core_twice_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)

    async def scenario(h: Harness) -> None:
        await h.start()
        a, b, c = h.add("a"), h.add("b"), h.add("c")
        await h.tokens(h.core, {"a": [11], "b": [21], "c": [31]})
        await h.core.deliver(CoreFailed("engine core failed: boom", ["a", "b"]))
        await h.core.deliver(INFO)
        # a, then b, run alone for one token each; c (not in the failing step) waits.
        (trial,) = h.core.added
        assert trial.req_id == "a" and trial.output_token_ids == [11]
        assert trial.sampling_params.max_tokens == 2
        # The one-token run ends in "length" in the core: not the completion's end.
        await h.core.deliver(
            CoreOutputs([EngineCoreOutput("a", [12], finish_reason="length")], stats(1))
        )
        assert not a.finished and a.token_ids == {0: [11, 12]}
        assert h.core.added_ids == ["a", "b"]
        await h.core.deliver(CoreFailed("engine core failed: boom again", ["b"]))
        assert isinstance(b.error, RequestCrashedEngineError)
        await h.core.deliver(INFO)
        assert {r.req_id: r.output_token_ids for r in h.core.added} == {"a": [11, 12], "c": [31]}
        await h.tokens(h.core, {"a": [13], "c": [32]})
        assert a.token_ids == {0: [11, 12, 13]} and c.token_ids == {0: [31, 32]}
        assert a.error is None and c.error is None

    run(scenario, h)


def test_a_crash_loop_kills_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, engine_max_restarts=1)

    async def scenario(h: Harness) -> None:
        await h.start()
        a = h.add("a")
        await h.core.deliver(CoreFailed("engine core failed: one"))
        await h.core.deliver(INFO)
        await h.core.deliver(CoreFailed("engine core failed: two"))
        reason = await asyncio.wait_for(h.engine.wait_dead(), 5)
        assert "two; giving up after 2 engine-core crashes within 600 s" in reason
        assert len(h.cores) == 2 and h.cores[1].killed
        await asyncio.sleep(0)
        assert isinstance(a.error, EngineDeadError)
        assert h.engine.health_problem() == ("engine_dead", f"the engine is dead: {reason}")
        with pytest.raises(EngineDeadError):
            h.add("b")

    run(scenario, h)


def test_exit_policy_kills_the_engine_at_the_first_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, engine_failure_policy="exit")

    async def scenario(h: Harness) -> None:
        await h.start()
        a = h.add("a")
        await h.core.deliver(CoreFailed("engine core failed: boom", ["a"]))
        assert await asyncio.wait_for(h.engine.wait_dead(), 5) == "engine core failed: boom"
        assert len(h.cores) == 1
        await asyncio.sleep(0)
        assert isinstance(a.error, EngineDeadError)

    run(scenario, h)


def test_a_restarted_core_that_fails_to_load_kills_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(monkeypatch)

    async def scenario(h: Harness) -> None:
        await h.start()
        h.add("a")
        await h.core.deliver(CoreFailed("engine core failed: one"))
        await h.core.deliver(CoreFailed("engine core failed: CUDA error"))
        reason = await asyncio.wait_for(h.engine.wait_dead(), 5)
        assert reason.startswith("a restarted engine core failed before it was ready")

    run(scenario, h)


def test_a_restarted_core_with_a_smaller_pool_fails_only_what_no_longer_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(monkeypatch)

    async def scenario(h: Harness) -> None:
        await h.start()
        first = h.core
        a = h.add("a")  # 3 prompt tokens + max_tokens 20 = 23 tokens
        params = SamplingParams(max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        small = Collector(h.engine.add_request("small", {"prompt_token_ids": [5, 6, 7]}, params))
        await h.tokens(first, {"a": [11], "small": [21]})
        await first.deliver(CoreFailed("engine core failed: boom"))
        smaller = CoreInfo(
            num_kv_blocks=1, max_tokens_in_pool=16, import_seconds=0, engine_seconds=0
        )
        await h.core.deliver(smaller)
        # Only the request that fits the new pool is resent; the other fails alone.
        assert h.core.added_ids == ["small"]
        await asyncio.sleep(0)
        assert isinstance(a.error, ValueError) and "cannot hold it" in str(a.error)
        await h.tokens(h.core, {"small": [22]})
        assert small.token_ids == {0: [21, 22]} and small.error is None

    run(scenario, h)
