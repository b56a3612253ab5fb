"""GrammarSpec: what to compile, in one canonical text per kind (the compile cache's key)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from ferrum.sampling_params import StructuredOutputsParams

# The grammar `json_object` compiles to: any JSON object (an array or a scalar is refused).
JSON_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarKind(Enum):
    """One per StructuredOutputsParams field; the value is that field's name."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    STRUCTURAL_TAG = "structural_tag"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A grammar to compile; equal specs compile to the same grammar. `text` is canonical: a JSON
    schema or structural tag as compact JSON (key order kept: it orders the output's properties),
    choices as a compact JSON list, a regex or EBNF grammar verbatim, "" for `json_object`.
    """

    kind: GrammarKind
    text: str

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> GrammarSpec:
        kind = GrammarKind(params.kind)
        if kind in (GrammarKind.JSON, GrammarKind.STRUCTURAL_TAG):
            value = getattr(params, kind.value)
            value = json.loads(value) if isinstance(value, str) else value
            return cls(kind, _compact_json(value, kind))
        if kind is GrammarKind.CHOICE:
            return cls(kind, _compact_json(params.choice, kind))
        if kind is GrammarKind.JSON_OBJECT:
            return cls(kind, "")
        text = params.regex if kind is GrammarKind.REGEX else params.grammar
        assert text is not None
        return cls(kind, text)

    @property
    def field_name(self) -> str:
        """The StructuredOutputsParams field this spec came from (for error messages)."""
        return f"structured_outputs.{self.kind.value}"

    def choice_ebnf(self) -> str:
        """A CHOICE spec as an EBNF grammar: `root ::= "a" | "b"`."""
        assert self.kind is GrammarKind.CHOICE
        options = json.loads(self.text)
        # A JSON string literal (non-ASCII kept) is also a valid EBNF string literal.
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _compact_json(value: object, kind: GrammarKind) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{kind.value}: not valid JSON data: {e}") from e
