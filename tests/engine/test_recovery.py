"""RecoveryTracker: strikes, probation order and the crash-loop limit."""

from __future__ import annotations

from ferrum.engine.recovery import RecoveryTracker
from ferrum.recovery_config import EngineRecoveryConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_tracker(max_restarts: int = 5, window: float = 60.0) -> tuple[RecoveryTracker, FakeClock]:
    clock = FakeClock()
    config = EngineRecoveryConfig(engine_max_restarts=max_restarts, engine_restart_window=window)
    return RecoveryTracker(config, clock), clock


def test_suspects_go_on_probation_in_order_and_a_second_strike_fails() -> None:
    tracker, _ = make_tracker()
    verdict = tracker.record_crash(["a", "b", "c"])
    assert verdict.give_up is None and verdict.failed == []
    assert tracker.start_next_trial() == "a"
    assert tracker.pass_trial() == "a"
    assert tracker.start_next_trial() == "b"
    # b crashes the core alone: its second strike.
    verdict = tracker.record_crash(["b"])
    assert verdict.failed == ["b"]
    assert tracker.start_next_trial() == "c"
    assert tracker.pass_trial() == "c"
    assert tracker.start_next_trial() is None
    # Cleared by their trials: a later crash is a first strike again.
    assert tracker.record_crash(["a", "c"]).failed == []


def test_an_unexplained_crash_blames_nobody_and_reruns_the_trial() -> None:
    tracker, _ = make_tracker()
    tracker.record_crash(["a", "b"])
    assert tracker.start_next_trial() == "a"
    verdict = tracker.record_crash(None)
    assert verdict.failed == [] and tracker.on_trial is None
    assert tracker.start_next_trial() == "a"
    assert tracker.num_on_probation == 2


def test_forgotten_completions_leave_probation() -> None:
    tracker, _ = make_tracker()
    tracker.record_crash(["a", "b"])
    tracker.forget("a")
    assert tracker.start_next_trial() == "b"
    tracker.forget("b")
    assert tracker.on_trial is None and tracker.num_on_probation == 0


def test_crash_loop_limit_counts_crashes_within_the_window() -> None:
    tracker, clock = make_tracker(max_restarts=2, window=60.0)
    assert tracker.record_crash(None).give_up is None
    clock.now += 30
    assert tracker.record_crash(None).give_up is None
    clock.now += 31  # the first crash is out of the window
    assert tracker.record_crash(None).give_up is None
    clock.now += 1
    verdict = tracker.record_crash(None)
    assert verdict.give_up == "3 engine-core crashes within 60 s (engine_max_restarts=2)"
