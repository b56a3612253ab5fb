"""What the API server does when its engine core crashes or stops stepping."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.config_fields import field_error as _fail
from ferrum.config_fields import field_help as _help

ENGINE_FAILURE_POLICIES = ("restart", "exit")


@dataclass(frozen=True)
class EngineRecoveryConfig:
    """What the API server does when its engine core crashes or stops stepping (`ferrum serve`
    only: the offline `LLM` runs its core in-process)."""

    engine_failure_policy: str = field(
        default="restart",
        metadata=_help(
            "on an engine-core crash: restart (a fresh core resumes every in-flight request) or "
            "exit (the server exits non-zero for an outside supervisor)",
            choices=ENGINE_FAILURE_POLICIES,
        ),
    )
    engine_max_restarts: int = field(
        default=5,
        metadata=_help(
            "restarts allowed within --engine-restart-window; one crash more and the server "
            "exits non-zero"
        ),
    )
    engine_restart_window: float = field(
        default=600.0, metadata=_help("seconds over which restarts are counted")
    )
    engine_stall_timeout: float = field(
        default=60.0,
        metadata=_help(
            "seconds an engine core holding requests may go without finishing a step before it "
            "counts as crashed"
        ),
    )

    def __post_init__(self) -> None:
        if self.engine_failure_policy not in ENGINE_FAILURE_POLICIES:
            raise _fail(
                "engine_failure_policy",
                f"must be one of {ENGINE_FAILURE_POLICIES}, got {self.engine_failure_policy!r}",
            )
        if not isinstance(self.engine_max_restarts, int) or self.engine_max_restarts < 0:
            raise _fail(
                "engine_max_restarts", f"must be an integer >= 0, got {self.engine_max_restarts!r}"
            )
        for name in ("engine_restart_window", "engine_stall_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise _fail(name, f"must be a number of seconds > 0, got {value!r}")
