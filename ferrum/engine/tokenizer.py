"""A Hugging Face tokenizer folder read with `tokenizers` alone, giving transformers' ids and text:
the config's named special tokens are special added tokens, tokenizer.json's post-processor alone
decides which specials `encode` adds (as transformers, which then ignores `add_bos_token`), and
`clean_up_tokenization_spaces` applies to non-BPE models only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken

from ferrum.engine.chat_template import (
    ChatTemplateRenderer,
    ChatTemplates,
    load_chat_templates,
    select_chat_template,
)
from ferrum.gguf.reader import is_gguf_path
from ferrum.gguf.tokenizer import read_gguf_tokenizer

_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized")
# Inputs at least this long go through the batch calls of `tokenizers`, which release the GIL,
# so a thread encoding or decoding them leaves the caller's event loop running.
RELEASE_GIL_MIN_CHARS = 4096
RELEASE_GIL_MIN_TOKENS = 1024
_CLEANUP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token from a config: a string or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_added_token(value: Any, special: bool) -> AddedToken:
    if isinstance(value, Mapping):
        flags = {k: bool(value[k]) for k in _ADDED_TOKEN_FIELDS if k in value}
        flags.setdefault("normalized", False)
        return AddedToken(value["content"], special=special, **flags)
    return AddedToken(value, special=special, normalized=False)


def _collect_special_tokens(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Named tokens (every `*_token` key: `bos_token`, `eos_token`, ..., model-specific ones)
    and extra tokens."""
    named = {
        k: v for k, v in config.items() if k.endswith("_token") and _token_content(v) is not None
    }
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, Mapping):
        named.update({k: v for k, v in extra.items() if _token_content(v) is not None})
        extra = []
    return named, [t for t in extra if _token_content(t) is not None]


class Tokenizer:
    """Text <-> token ids for one model, plus its chat templates."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_templates: ChatTemplates | None = None,
    ) -> None:
        """`config` is the parsed tokenizer_config.json (merged with special_tokens_map.json)."""
        config = dict(config or {})
        self.backend = backend
        self.chat_templates = chat_templates
        self._renderer = ChatTemplateRenderer()
        named, extra = _collect_special_tokens(config)
        self._register_added_tokens(config.get("added_tokens_decoder"), named, extra)
        # Template variables: every named special token as its string.
        self.special_tokens_map: dict[str, str] = {
            key: content for key, value in named.items() if (content := _token_content(value))
        }
        self.bos_token_id = self._id_of(named.get("bos_token"))
        self.eos_token_id = self._id_of(named.get("eos_token"))
        self.pad_token_id = self._id_of(named.get("pad_token"))
        self.unk_token_id = self._id_of(named.get("unk_token"))

        special_ids = {self._id_of(v) for v in [*named.values(), *extra]}
        special_ids.update(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.all_special_ids: set[int] = {i for i in special_ids if i is not None}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # Each input character becomes at least one character of a token's string (a byte-level
        # BPE byte, a piece's character), so no token covers more input characters than this.
        self.max_token_chars: int = max(
            (len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1
        )
        # WordPiece-era cleanup ("hello ." -> "hello."); it corrupts BPE text, so BPE never gets it.
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Loads `tokenizer.json` (+ `tokenizer_config.json`, `special_tokens_map.json`, chat
        template files) from a local folder, or the tokenizer of a GGUF file."""
        if is_gguf_path(str(path)):
            backend, config, templates = read_gguf_tokenizer(str(path))
            return cls(backend, config, templates)
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"tokenizer path {str(path)!r} has no tokenizer.json "
                "(only fast tokenizers are supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise ValueError(f"{tokenizer_file} could not be loaded: {e}") from e

        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        map_file = model_dir / "special_tokens_map.json"
        if map_file.is_file() and "added_tokens_decoder" not in config:
            # Older folders keep their special tokens here; they override the config's.
            config.update(_read_json(map_file))
        return cls(backend, config, load_chat_templates(model_dir, config))

    def _id_of(self, value: Any) -> int | None:
        content = _token_content(value)
        return None if content is None else self.backend.token_to_id(content)

    def _register_added_tokens(
        self, added_tokens_decoder: Any, named: dict[str, Any], extra: list[Any]
    ) -> None:
        added = {t.content: t for t in self.backend.get_added_tokens_decoder().values()}
        if isinstance(added_tokens_decoder, Mapping):
            for value in added_tokens_decoder.values():
                content = _token_content(value)
                if content is not None and content not in added:
                    special = (
                        bool(value.get("special", False)) if isinstance(value, Mapping) else True
                    )
                    self.backend.add_tokens([_as_added_token(value, special=special)])
        added = {t.content: t for t in self.backend.get_added_tokens_decoder().values()}
        missing = []
        for value in [*named.values(), *extra]:
            content = _token_content(value)
            if content is not None and not (content in added and added[content].special):
                missing.append(_as_added_token(value, special=True))
        if missing:
            self.backend.add_special_tokens(missing)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            if len(text) >= RELEASE_GIL_MIN_CHARS:
                return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[
                    0
                ].ids
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except (TypeError, UnicodeEncodeError) as e:
            # e.g. a lone surrogate such as "\udcff", which JSON allows and UTF-8 does not.
            raise ValueError(f"text is not valid Unicode text: {e}") from e

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        token_ids = list(token_ids)
        if len(token_ids) >= RELEASE_GIL_MIN_TOKENS:
            (text,) = self.backend.decode_batch(
                [token_ids], skip_special_tokens=skip_special_tokens
            )
        else:
            text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for old, new in _CLEANUP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> str:
        """Renders a conversation to prompt text; `kwargs` become template variables
        (e.g. `enable_thinking=False`) and override the special tokens of the same name."""
        template = select_chat_template(self.chat_templates, chat_template, tools)
        return self._renderer.render(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=continue_final_message,
            template_vars={**self.special_tokens_map, **kwargs},
        )

    def __len__(self) -> int:
        return self.vocab_size
