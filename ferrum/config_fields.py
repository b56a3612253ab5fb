"""What every config dataclass's fields share: the error naming a field, the CLI help metadata."""

from __future__ import annotations

from typing import Any

from ferrum.errors import FieldError


def field_error(field_name: str, message: str) -> FieldError:
    """The error for a bad value: "<field>: <what is wrong>"."""
    return FieldError(field_name, f"{field_name}: {message}")


def field_help(text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: the CLI help of the field's flag (and argparse extras such as choices)."""
    return {"help": text, **extra}
