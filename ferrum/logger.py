"""The package logger: `ferrum` and its children, level from FERRUM_LOGGING_LEVEL."""

from __future__ import annotations

import logging

from ferrum import envs

_FORMAT = "%(levelname)s %(asctime)s %(name)s] %(message)s"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("ferrum")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.logging_level())
        root.propagate = False
    return logging.getLogger(name)
