"""A GGUF file's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2") as a `tokenizers`
backend plus the tokenizer_config.json-like dict and chat templates ferrum's Tokenizer takes.

`tokenizer.ggml.pre` names the pre-tokenizer; each supported one is the split the model's own
tokenizer.json makes (a regex, then byte-level mapping without its own regex).
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ferrum.gguf.reader import GGUFFile, open_gguf

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, None for GPT-2's own; NFC-normalized; BPE ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "gpt-2": (None, False, False),
    "llama-bpe": (_LLAMA3_REGEX, False, True),
    "llama3": (_LLAMA3_REGEX, False, True),
    "llama-v3": (_LLAMA3_REGEX, False, True),
    "qwen2": (_QWEN2_REGEX, True, False),
    "deepseek-r1-qwen": (_QWEN2_REGEX, True, False),
}
# tokenizer.ggml.token_type values
_CONTROL = 3
_USER_DEFINED = 4
# tokenizer_config.json's name -> llama.cpp's (tokenizer.ggml.{name}_token_id)
_SPECIAL_IDS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
_TEMPLATE_KEY = "tokenizer.chat_template"


def _backend(file: GGUFFile, pre: str, tokens: list[str]) -> tokenizers.Tokenizer:
    merges = []
    for merge in file.field("tokenizer.ggml.merges", list):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise ValueError(
                f"GGUF file {file.path}: tokenizer.ggml.merges entry {merge!r:.60} is not two "
                "space-separated tokens"
            )
        merges.append((parts[0], parts[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    regex, nfc, ignore_merges = PRE_TOKENIZERS[pre]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    if nfc:
        backend.normalizer = normalizers.NFC()
    if regex is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_special_tokens(file: GGUFFile, backend: tokenizers.Tokenizer, tokens: list[str]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (both
    match before the BPE, as in the model's tokenizer.json)."""
    types = file.field("tokenizer.ggml.token_type", list, [])
    if types and len(types) != len(tokens):
        raise ValueError(
            f"GGUF file {file.path}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    control = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types)
        if kind == _CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(types)
        if kind == _USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _post_processor(file: GGUFFile, tokens: list[str], bos_id: int | None) -> Any:
    """BOS before each sequence when the file says `add_bos_token` (Llama 3), else nothing."""
    if bos_id is None or not file.field("tokenizer.ggml.add_bos_token", bool, False):
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[bos_id]
    return processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _chat_templates(file: GGUFFile) -> str | dict[str, str] | None:
    """`tokenizer.chat_template`, plus named ones (`tokenizer.chat_template.NAME`)."""
    named = {
        key.removeprefix(f"{_TEMPLATE_KEY}."): file.field(key)
        for key in file.keys_with_prefix(f"{_TEMPLATE_KEY}.")
    }
    default = file.field(_TEMPLATE_KEY, str, None)
    if not named:
        return default
    return {**({"default": default} if default is not None else {}), **named}


def read_gguf_tokenizer(
    path: str,
) -> tuple[tokenizers.Tokenizer, dict[str, Any], str | dict[str, str] | None]:
    """(backend, tokenizer config, chat templates) of GGUF file `path`; other tokenizer models
    (SentencePiece "llama", ...) and pre-tokenizers are refused naming the field."""
    file = open_gguf(path)
    model = file.field("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF file {path}: tokenizer.ggml.model {model!r} is not supported; supported: "
            "'gpt2' (byte-level BPE)"
        )
    pre = file.field("tokenizer.ggml.pre", str, "(missing)")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF file {path}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    tokens = file.field("tokenizer.ggml.tokens", list)
    if not all(isinstance(token, str) for token in tokens):
        raise ValueError(f"GGUF file {path}: tokenizer.ggml.tokens must be strings")
    backend = _backend(file, pre, tokens)
    _add_special_tokens(file, backend, tokens)
    config: dict[str, Any] = {"clean_up_tokenization_spaces": False}
    for name, gguf_name in _SPECIAL_IDS.items():
        token_id = file.field(f"tokenizer.ggml.{gguf_name}_token_id", int, None)
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    bos_id = file.field("tokenizer.ggml.bos_token_id", int, None)
    if bos_id is not None and not 0 <= bos_id < len(tokens):
        bos_id = None
    backend.post_processor = _post_processor(file, tokens, bos_id)
    return backend, config, _chat_templates(file)
