"""What the server does with each generation request before the engine sees it: the
--max-logprobs limit (a 400 naming the field), and the request's log line (INFO with
--enable-log-requests, else DEBUG), its body cut to --max-log-len characters."""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel

from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.logger import init_logger

logger = init_logger(__name__)

# The request fields that ask for logprobs per token (chat's `logprobs` is a boolean).
_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")


class RequestLog:
    def __init__(
        self, max_logprobs: int, enable_log_requests: bool = False, max_log_len: int | None = None
    ) -> None:
        self.max_logprobs = max_logprobs
        self.level = logging.INFO if enable_log_requests else logging.DEBUG
        self.max_log_len = max_log_len

    def admit(self, endpoint: str, body: BaseModel) -> None:
        """Raises APIError 400 for a logprobs field over max_logprobs; logs the request."""
        for name in _LOGPROB_FIELDS:
            value = getattr(body, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_logprobs:
                raise APIError(
                    400,
                    f"{name}: {value} exceeds this server's max_logprobs={self.max_logprobs} "
                    "(--max-logprobs)",
                    param=name,
                )
        if logger.isEnabledFor(self.level):
            text = json.dumps(body.model_dump(mode="json", exclude_unset=True), ensure_ascii=False)
            if self.max_log_len is not None and len(text) > self.max_log_len:
                text = text[: self.max_log_len] + f"... ({len(text)} characters)"
            logger.log(self.level, "request to %s: %s", endpoint, text)
