"""The error every layer raises for a bad value a user gave: it names the field."""

from __future__ import annotations


class FieldError(ValueError):
    """`field` (a SamplingParams or config field, "prompt", ...) holds a bad value; the message
    says what is wrong and the limit. Callers map it by `field`, never by parsing the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[type[FieldError], tuple[str, str]]:
        return FieldError, (self.field, str(self))
