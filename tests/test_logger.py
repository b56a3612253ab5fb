"""The package logger's line format."""

from __future__ import annotations

import logging
import re

from ferrum.logger import DATE_FORMAT, FORMAT, init_logger


def test_log_lines_carry_date_time_and_a_bracketed_name() -> None:
    init_logger("ferrum.engine.core")
    formatter = logging.Formatter(FORMAT, datefmt=DATE_FORMAT)
    record = logging.LogRecord("ferrum.engine.core", logging.INFO, __file__, 1, "ready", (), None)
    line = formatter.format(record)
    assert re.fullmatch(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[ferrum\.engine\.core\] ready", line)
    handler = logging.getLogger("ferrum").handlers[0]
    assert handler.formatter is not None and handler.formatter._fmt == FORMAT
