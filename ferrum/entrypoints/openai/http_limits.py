"""What one HTTP client may cost the server (the flags; `http_guard` enforces them): a body over
`max_request_body_bytes` gets 413 before any route sees it; a client gets `timeout_request_header`
seconds for a header block and `timeout_request_body` between body reads, and past its first
`timeout_request_body` seconds a body must average `min_request_body_rate` bytes/s, else 408
(nothing once its response started); a connection beyond `limit_concurrency` gets 503. Every
refusal is OpenAI's error envelope and closes the connection, lingering to drain a body."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

from ferrum.logger import init_logger

logger = init_logger(__name__)

# Descriptors the process keeps besides client connections (engine pipes, model files, logs).
_SPARE_FILES = 256


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_request_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata={"help": "largest request body; larger ones get 413 before they are parsed"},
    )
    timeout_request_header: float = field(
        default=10.0,
        metadata={"help": "seconds a client has to send a request's headers, else 408"},
    )
    timeout_request_body: float = field(
        default=30.0,
        metadata={"help": "seconds a client may pause while sending a request body, else 408"},
    )
    min_request_body_rate: float = field(
        default=1024.0,
        metadata={
            "help": "bytes/s a request body must average once it has taken "
            "--timeout-request-body seconds, else 408 (a body dripped byte by byte cannot hold a "
            "connection; nginx's client_body_timeout, Apache's MinRate)"
        },
    )
    limit_concurrency: int = field(
        default=2048,
        metadata={"help": "most open connections; requests on connections beyond it get 503"},
    )

    def body_deadline(self, started: float, num_bytes: int) -> float:
        """When a body that started at `started` and has sent `num_bytes` falls below the rate."""
        return started + self.timeout_request_body + num_bytes / self.min_request_body_rate

    def __post_init__(self) -> None:
        for name in (
            "max_request_body_bytes",
            "timeout_request_header",
            "timeout_request_body",
            "min_request_body_rate",
            "limit_concurrency",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")


def raise_open_files_limit(limits: HttpLimits) -> None:
    """Lifts the soft descriptor limit so that limit_concurrency connections can be open."""
    needed = limits.limit_concurrency + _SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        logger.warning(
            "only %d open files allowed (hard limit): fewer than limit_concurrency=%d "
            "connections plus %d spare; lower --limit-concurrency or raise `ulimit -n`",
            target,
            limits.limit_concurrency,
            _SPARE_FILES,
        )
