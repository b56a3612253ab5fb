"""Limits xgrammar applies to JSON only when told. Whitespace: the JSON inside a structural tag
gets at most a few blanks between tokens (a weak model would otherwise spend its budget on them).
String lengths: xgrammar 0.2.9's `minLength`/`maxLength` strings allow raw control characters
(invalid JSON), and it drops the lengths from a json_schema element with `excludes` (tool calls
exclude their tags); so short bounded strings (`maxLength` <= PATTERN_MAX_LENGTH: names, keys,
ids) become a `pattern` of the same lengths, which xgrammar keeps to valid JSON text (no control
characters, quotes or escapes; no `<` under `excludes`, where every tag starts with it). Longer
ones (file contents, commands) keep their quotes and escapes, their length unenforced there."""

from __future__ import annotations

from typing import Any

# Blanks allowed between JSON tokens: compact (xgrammar needs at least 1 in a structural tag, so
# `{"a": 1}` and `{"a":1}` both pass) and pretty (`disable_any_whitespace` false).
COMPACT_MAX_WHITESPACE = 1
PRETTY_MAX_WHITESPACE = 16
# The longest bounded string made a pattern: a pattern string holds no quote or escape, which
# short identifier-like strings never need and long free text does.
PATTERN_MAX_LENGTH = 256
# Schema keys whose values are data, not subschemas.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def bound_structural_tag(tag: Any, max_whitespace: int) -> Any:
    """A copy of structural tag `tag`: each json_schema element allows at most `max_whitespace`
    blanks between tokens unless it sets its own bound, and keeps its string lengths."""
    if isinstance(tag, list):
        return [bound_structural_tag(item, max_whitespace) for item in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") != "json_schema" or "json_schema" not in tag:
        return {key: bound_structural_tag(value, max_whitespace) for key, value in tag.items()}
    element = dict(tag)
    element.setdefault("max_whitespace_cnt", max_whitespace)
    excluded = bool(element.get("excludes"))
    element["json_schema"] = lengths_as_patterns(element["json_schema"], excluded)
    return element


def lengths_as_patterns(schema: Any, exclude_tags: bool = False) -> Any:
    """A copy of `schema` whose strings with `maxLength` <= PATTERN_MAX_LENGTH (and no pattern,
    format, enum or const) have `pattern: ^.{min,max}$` instead (`[^<]` with `exclude_tags`)."""
    if isinstance(schema, list):
        return [lengths_as_patterns(item, exclude_tags) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in _DATA_KEYS else lengths_as_patterns(value, exclude_tags)
        for key, value in schema.items()
    }
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    free = not any(key in out for key in ("pattern", "format", "enum", "const"))
    low, high = out.get("minLength", 0), out.get("maxLength")
    # Not a count: xgrammar refuses it, naming the schema.
    short = _is_count(low) and _is_count(high) and high <= PATTERN_MAX_LENGTH
    if is_string and free and short:
        out.pop("minLength", None)
        out.pop("maxLength", None)
        char = "[^<]" if exclude_tags else "."
        out["pattern"] = f"^{char}{{{low},{high}}}$"
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
