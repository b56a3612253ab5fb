"""The server's `--lora-modules` flag (vLLM's forms), kept apart from the routes so that building
the CLI imports no web framework."""

from __future__ import annotations

import argparse
import json


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """`name=path` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}` ->
    (name, path, base model name or None)."""
    if not text.lstrip().startswith("{"):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: expected name=path")
        return name, path, None
    try:
        value = json.loads(text)
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        base = value.get("base_model_name")
        return str(value["name"]), str(value["path"]), None if base is None else str(base)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"invalid LoRA module {text!r}: {e}") from None


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served from start-up (PEFT folders; needs --enable-lora): a "
        "request's model field names one; also vLLM's JSON form "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "m"}\' (base_model_name: '
        "the served name /v1/models lists as its parent)",
    )
