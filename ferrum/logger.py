"""The package logger: `ferrum` and its children, level from FERRUM_LOGGING_LEVEL (an invalid
value: INFO and a warning naming it; the `ferrum` command refuses to start instead)."""

from __future__ import annotations

import logging

from ferrum import envs

# vLLM's shape: `INFO 11-22 12:39:40 [ferrum.engine.core] message`.
FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("ferrum")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt=DATE_FORMAT))
        root.addHandler(handler)
        root.propagate = False
        try:
            root.setLevel(envs.logging_level())
        except ValueError as e:
            root.setLevel(logging.INFO)
            root.warning("%s; logging at INFO", e)
    return logging.getLogger(name)
