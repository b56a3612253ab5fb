"""Why a front end cannot serve (beside a bad request's FieldError / TypeError): the errors both
front ends raise."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """An engine core failed or exited and was not (or could not be) restarted: the engine
    serves no more."""


class EngineNotReadyError(RuntimeError):
    """The engine core is still loading."""


class RequestCrashedEngineError(RuntimeError):
    """The request was in the failing step of two engine-core crashes: it is failed alone so
    that the other requests go on."""
