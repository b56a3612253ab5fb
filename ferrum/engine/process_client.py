"""An engine core in its own process, restarted after a crash when the recovery policy says so. A
core fails when a step raises, the process dies or (on an event loop) it holds requests without
stepping for `engine_stall_timeout` s. With `engine_failure_policy="restart"` a fresh core resumes
every open completion from its tokens, seamlessly for the front end (`recovery.py` blames and gives
up); otherwise the engine is dead. Everything runs on the front end's thread (`FrontEndThread`)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence

from ferrum.config import EngineConfig
from ferrum.engine.core_client import (
    CoreClient,
    EngineDied,
    EventSink,
    FrontEndThread,
    RequestsFailed,
)
from ferrum.engine.core_liveness import cpu_seconds, is_stopped
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    FromCore,
    SchedulerStats,
)
from ferrum.engine.core_process import CoreProcess
from ferrum.engine.core_stats import StatsAcrossCores
from ferrum.engine.errors import RequestCrashedEngineError
from ferrum.engine.recovery import (
    RecoveryTracker,
    resumed_request,
    trial_request,
    unclip_trial_output,
)
from ferrum.logger import init_logger
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.request import RequestStatus, check_request_fits

logger = init_logger(__name__)


class ProcessClient(CoreClient):
    def __init__(self, config: EngineConfig, recovery_config: EngineRecoveryConfig) -> None:
        self.config = config
        self.recovery_config = recovery_config
        self.num_restarts = 0
        self.dead_reason: str | None = None
        # Why the current core is being started again (None: the first core, or it is ready).
        self.restart_reason: str | None = None
        # Each open completion as first sent, in arrival order, and the tokens it has so far.
        self._requests: dict[str, EngineCoreRequest] = {}
        self._tokens: dict[str, list[int]] = {}
        self._recovery = RecoveryTracker(recovery_config)
        self._stats = StatsAcrossCores()
        self._sink: EventSink | None = None
        self._thread: FrontEndThread | None = None
        self._process: CoreProcess | None = None
        # A core's messages count only while its epoch is current: a failed core's late ones
        # are dropped.
        self._epoch = 0
        self._ever_ready = False
        self._core_ready = False
        self._core_started = 0.0
        self._closed = False
        self._watchdog: asyncio.Task[None] | None = None
        # When the current core last finished a step, spent CPU time on a CPU device, or had no
        # request to work on; and the CPU seconds it had spent then.
        self._last_progress = time.monotonic()
        self._last_cpu_seconds: list[float] = []
        self._cpu_pids: tuple[int, ...] = ()  # the processes that CPU time is of
        # A CPU device's steps run on the host: a slow step still spends CPU time.
        self._counts_cpu_time = config.device_config.device == "cpu"

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, sink: EventSink, thread: FrontEndThread) -> None:
        self._sink, self._thread = sink, thread
        self._start_core()
        if thread.loop is not None:
            self._watchdog = thread.loop.create_task(self._watch_progress())

    def _start_core(self) -> None:
        on_message = functools.partial(self._on_message_thread, self._epoch)
        process = CoreProcess(self.config, on_message, core_index=self.num_restarts)
        self._process = process
        self._core_started = time.perf_counter()
        process.start()
        logger.info("engine core process started (pid %s); loading the model", process.pid)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()

    def shutdown(self) -> None:
        """Stops the current core; `close` must have run (here, or on the front end's thread:
        no restart can start another core behind this call)."""
        self.close()
        if self._process is not None:
            self._process.shutdown()

    def fail(self, reason: str) -> None:
        if self.dead_reason is None:
            self._die(reason)

    def health_problem(self) -> tuple[str, str] | None:
        if self.dead_reason is not None:
            return "engine_dead", f"the engine is dead: {self.dead_reason}"
        if not self._ever_ready:
            return "engine_loading", "the engine is still loading"
        if self.restart_reason is not None:
            return "engine_restarting", f"the engine core is restarting: {self.restart_reason}"
        pid = None if self._process is None else self._process.pid
        if pid is not None and is_stopped(pid):
            return "engine_stopped", f"the engine core (pid {pid}) is stopped (SIGSTOP)"
        return None

    def stats(self) -> SchedulerStats | None:
        """Counters summed over every core so far; gauges of the current core's latest step, or
        0 while none is serving (restarting or dead)."""
        return self._stats.current(serving=self._core_ready and self.dead_reason is None)

    # -- requests ------------------------------------------------------------------------------

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        """Kept for a restarted core to resume; while the core restarts, they wait for it."""
        for request in requests:
            self._requests[request.req_id] = request
            self._tokens[request.req_id] = list(request.output_token_ids)
        if self._core_ready and self._recovery.on_trial is None and self._process is not None:
            self._process.add_requests(list(requests))

    def finish_requests(self, req_ids: Sequence[str], status: RequestStatus) -> None:
        if self._process is not None:
            self._process.finish_requests(list(req_ids), status)
        self._forget(req_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def _forget(self, req_ids: Sequence[str]) -> None:
        """Drops finished or aborted completions; a completion on trial is replaced by the
        next."""
        trial = self._recovery.on_trial
        for req_id in req_ids:
            self._requests.pop(req_id, None)
            self._tokens.pop(req_id, None)
            self._recovery.forget(req_id)
        if trial in req_ids and self._core_ready:
            self._resume()

    # -- messages from the core ----------------------------------------------------------------

    def _on_message_thread(self, epoch: int, message: FromCore) -> None:
        """Called on the core process's receiving thread."""
        assert self._thread is not None
        self._thread.call_soon(self._on_message, epoch, message)

    def _on_message(self, epoch: int, message: FromCore) -> None:
        if epoch != self._epoch or self._closed:
            return
        match message:
            case CoreOutputs(outputs, stats):
                assert stats is not None, "a core process sends its stats with every step"
                self._last_progress = time.monotonic()
                self._stats.update(stats)
                self._on_outputs(outputs, stats)
            case CoreInfo():
                self._on_core_ready(message)
            case CoreFailed(reason, req_ids):
                self._on_core_failure(reason, req_ids)

    def _on_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        trial = self._recovery.on_trial
        if trial is not None:
            outputs = [self._unclip(o) if o.req_id == trial else o for o in outputs]
        for output in outputs:
            tokens = self._tokens.get(output.req_id)
            if tokens is not None:
                tokens.extend(output.new_token_ids)
        self._emit(CoreOutputs(outputs, stats))
        self._forget([o.req_id for o in outputs if o.finish_reason is not None])
        # The trial's one output ends it (unless it finished the completion: then `_forget`
        # moved on already).
        if (
            trial is not None
            and trial == self._recovery.on_trial
            and any(o.req_id == trial for o in outputs)
        ):
            self._recovery.pass_trial()
            self._resume()

    def _unclip(self, output: EngineCoreOutput) -> EngineCoreOutput:
        num_tokens = len(self._tokens.get(output.req_id, ()))
        request = self._requests[output.req_id]
        max_model_len = self.config.model_config.max_model_len
        return unclip_trial_output(output, request, num_tokens, max_model_len)

    def _emit(self, event: CoreInfo | CoreOutputs | RequestsFailed | EngineDied) -> None:
        assert self._sink is not None
        self._sink(event)

    # -- failures and restarts -----------------------------------------------------------------

    def _on_core_ready(self, info: CoreInfo) -> None:
        self._fail_unfitting(info.max_tokens_in_pool)
        self._ever_ready = self._core_ready = True
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
        self._emit(info)
        if self.restart_reason is not None:
            self.restart_reason = None
            self._resume()

    def _fail_unfitting(self, pool_tokens: int) -> None:
        """Fails alone each open completion that a restarted core's (smaller) KV pool can no
        longer hold; resending it would crash that core too. Runs before the core counts as
        ready, so failing one does not resume the others early."""
        max_model_len = self.config.model_config.max_model_len
        for req_id, request in list(self._requests.items()):
            max_tokens = request.sampling_params.max_tokens
            try:
                check_request_fits(
                    len(request.prompt_token_ids), max_tokens, max_model_len, pool_tokens
                )
            except ValueError as e:
                error = ValueError(f"the restarted engine core cannot hold it: {e}")
                self._emit(RequestsFailed([req_id], error))

    def _resume(self) -> None:
        """Sends the open completions to a fresh core: the next one on probation alone, or
        (nobody on probation) all of them, each from the tokens it already has."""
        assert self._process is not None
        trial = self._recovery.start_next_trial()
        while trial is not None and trial not in self._requests:
            self._recovery.forget(trial)  # finished meanwhile
            trial = self._recovery.start_next_trial()
        if trial is not None:
            logger.warning(
                "running %s alone: it was in the step that crashed the engine core (%d more "
                "on probation)",
                trial,
                self._recovery.num_on_probation - 1,
            )
            self._process.add_requests([trial_request(self._resumed_request(trial))])
            return
        requests = [self._resumed_request(req_id) for req_id in self._requests]
        if requests:
            logger.info(
                "resuming %d completion(s) on the engine core, %d token(s) already generated",
                len(requests),
                sum(len(r.output_token_ids) for r in requests),
            )
            self._process.add_requests(requests)

    def _resumed_request(self, req_id: str) -> EngineCoreRequest:
        """The completion's request with a copy of the tokens it has so far (the sending thread
        pickles it while this thread goes on appending to the original)."""
        return resumed_request(self._requests[req_id], list(self._tokens[req_id]))

    def _on_core_failure(self, reason: str, req_ids: list[str] | None) -> None:
        """The current core failed (`req_ids`: the requests of its failing step, if known):
        restart it, or die."""
        if self.dead_reason is not None:
            return
        was_ready, self._core_ready = self._core_ready, False
        self._retire_core()
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
            suspects = [r for r in self._requests if r in failed_step]
        verdict = self._recovery.record_crash(suspects)
        logger.debug(
            "crash blamed on %s; failed alone: %s; on probation: %d; give up: %s",
            suspects,
            verdict.failed,
            self._recovery.num_on_probation,
            verdict.give_up,
        )
        if verdict.give_up is not None:
            self._die(f"{reason}; giving up after {verdict.give_up}")
            return
        error = RequestCrashedEngineError(
            f"the request was in the failing step of two engine-core crashes, the last: {reason}"
        )
        for req_id in verdict.failed:
            logger.error("failing %s alone: it crashed the engine core twice", req_id)
            self._emit(RequestsFailed([req_id], error))
        self.num_restarts += 1
        self.restart_reason = reason
        logger.warning(
            "%s; starting engine core #%d (crash %d of at most %d within %g s); %d open "
            "completion(s) wait for it",
            reason,
            self.num_restarts,
            self._recovery.num_recent_crashes,
            self.recovery_config.engine_max_restarts,
            self.recovery_config.engine_restart_window,
            len(self._requests),
        )
        self._start_core()

    def _retire_core(self) -> None:
        """Stops listening to the current core and kills its process."""
        self._epoch += 1
        self._stats.retire_core()
        process, self._process = self._process, None
        if process is not None:
            process.kill()

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self.restart_reason = None
        self._core_ready = False
        logger.error("%s; failing %d open completion(s)", reason, len(self._requests))
        self._forget(list(self._requests))
        self._emit(EngineDied(reason))

    async def _watch_progress(self) -> None:
        """Counts a core that holds requests and makes no progress for `engine_stall_timeout`
        seconds as failed (it is killed). Progress: a finished step, or on a CPU device CPU time
        spent by the core or its workers (a slow step is not a stalled one)."""
        timeout = self.recovery_config.engine_stall_timeout
        while self.dead_reason is None and not self._closed:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            if not (self._core_ready and self._requests) or self._spent_cpu_time():
                self._last_progress = now
            elif now - self._last_progress > timeout and not self._closed:
                pid = None if self._process is None else self._process.pid
                idle = "finished no step" + (" and spent no CPU time" * self._counts_cpu_time)
                self._on_core_failure(
                    f"the engine core (pid {pid}) {idle} for {now - self._last_progress:.1f} s "
                    f"while holding {len(self._requests)} completion(s)",
                    None,
                )

    def _spent_cpu_time(self) -> bool:
        """On a CPU device: whether each process computing the forward (the workers, else the
        core) spent CPU time since the last progress. Each: one stopped or hung rank stalls the
        step, however busy its peers wait for it."""
        if not self._counts_cpu_time or self._process is None:
            return False
        pids = self._process.pids
        computing = pids[1:] or pids  # the core only waits on its workers
        seconds = cpu_seconds(computing)
        if not seconds:  # no /proc, or no process yet
            return False
        if pids != self._cpu_pids:  # a new core, or its workers named: a new baseline
            self._cpu_pids, self._last_cpu_seconds = pids, seconds
            return False
        spent = [now - before for now, before in zip(seconds, self._last_cpu_seconds)]
        if min(spent) < _MIN_CPU_PROGRESS_S:
            return False
        self._last_cpu_seconds = seconds
        return True


# CPU seconds a core must spend between two checks to count as working (a stopped one spends 0;
# its pipe threads spend microseconds).
_MIN_CPU_PROGRESS_S = 0.05
