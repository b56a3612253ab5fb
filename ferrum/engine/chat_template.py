"""Chat templates: loading them from a model folder and rendering them with Jinja, as transformers'
`apply_chat_template(..., tokenize=False)`: a sandboxed immutable environment with `trim_blocks`
and `lstrip_blocks`, the `raise_exception` and `strftime_now` globals, a `tojson` filter that does
not escape HTML, the `{% generation %}` block tag, and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) as template variables."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A model has one template (a string) or several named ones ("default", "tool_use", ...).
ChatTemplates = str | dict[str, str]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# Keys a message's reasoning may arrive under; templates read `reasoning_content` (or `thinking`).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def load_chat_templates(
    model_dir: Path, tokenizer_config: Mapping[str, Any]
) -> ChatTemplates | None:
    """The templates of a tokenizer folder; `.jinja` files take precedence over the config's."""
    templates: dict[str, str] = {}
    default_file = model_dir / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates

    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named: dict[str, str] = {}
        for entry in value:
            if not isinstance(entry, Mapping) or not {"name", "template"} <= entry.keys():
                raise ValueError(
                    "tokenizer_config.json chat_template list entries must be "
                    f"{{'name': ..., 'template': ...}}, got {entry!r}"
                )
            named[str(entry["name"])] = str(entry["template"])
        return named
    raise ValueError(
        "tokenizer_config.json chat_template must be a string or a list, "
        f"got {type(value).__name__}"
    )


def select_chat_template(
    templates: ChatTemplates | None, chat_template: str | None, tools: list[dict] | None
) -> str:
    """The template text to render: `chat_template` is a template name, a raw template, or None."""
    if isinstance(templates, dict):
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(
            "chat_template must name one of the model's templates "
            f"{sorted(templates)} because none is called 'default'"
        )
    if chat_template is not None:
        return chat_template
    if templates is None:
        raise ValueError(
            "this model has no chat template (no chat_template in tokenizer_config.json and no "
            f"{CHAT_TEMPLATE_FILE}); pass chat_template explicitly"
        )
    return templates


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace()` refusing underscore attributes, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors Namespace's signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace: {name!r}"
            )


class _DictFactory:
    """The template's `dict(...)`: builds plain dicts without exposing the `dict` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """A deep copy made only of JSON-like types; anything else becomes an inert "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    # Keys set to None are dropped: templates test for missing keys, not for None.
    plain = {k: _plain(v) for k, v in message.items() if v is not None}
    content = plain.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text":
                raise ValueError(
                    f"messages[{index}].content[{j}]: content type {kind!r} is not supported "
                    "(ferrum takes text input only; multimodal checkpoints load their language "
                    "model)"
                )
    reasoning = next((plain[k] for k in _REASONING_KEYS if plain.get(k) is not None), None)
    if reasoning is None:
        return plain
    # Every template reads reasoning under `reasoning_content` or (gpt-oss) `thinking`.
    return {"thinking": reasoning, **plain, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict[str, Any]], field: str, template: str) -> str:
    """Appends the continue tag to the final message's `field`; returns the original text."""
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_KEYS:
        fields = [k for k in _REASONING_KEYS if messages[-1].get(k) == final]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message: the chat template never reads {field!r}")
    if isinstance(final, list):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                original = block["text"]
                block["text"] = original + _CONTINUE_TAG
                return original
        raise ValueError("continue_final_message: the final message has no text block to continue")
    if not isinstance(final, str):
        raise ValueError(f"continue_final_message: the final {field!r} must be text")
    for f in fields:
        messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message: the chat template dropped part of the final message, so it "
            "cannot be continued"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed the message's trailing whitespace (and the tag's).
    return rendered[:at].rstrip()


class ChatTemplateRenderer:
    """Compiles and renders chat templates; compiled templates are cached per renderer."""

    def __init__(self, max_cached_templates: int = 8) -> None:
        if max_cached_templates < 1:
            raise ValueError(f"max_cached_templates must be >= 1, got {max_cached_templates}")
        self._max_cached = max_cached_templates
        self._compiled: dict[str, jinja2.Template] = {}
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _DictFactory()
        env.globals["namespace"] = _SafeNamespace
        self._env = env

    def compile(self, template: str) -> jinja2.Template:
        compiled = self._compiled.get(template)
        if compiled is None:
            try:
                compiled = self._env.from_string(template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat_template is not valid Jinja (line {e.lineno}): {e}") from e
            if len(self._compiled) >= self._max_cached:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[template] = compiled
        return compiled

    def render(
        self,
        template: str,
        messages: list[dict],
        *,
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool | str = False,
        template_vars: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders `messages`; `template_vars` (special tokens, user kwargs) become variables."""
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages must be a non-empty list of dicts")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be set: one "
                "continues the last message, the other starts a new assistant message"
            )
        if tools is not None:
            if not isinstance(tools, list | tuple):
                raise ValueError(
                    f"tools must be a list of JSON schemas, got {type(tools).__name__}"
                )
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ValueError(f"tools[{i}] must be a dict (a JSON schema)")
        if documents is not None:
            for i, document in enumerate(documents):
                if not isinstance(document, Mapping):
                    raise ValueError(f"documents[{i}] must be a dict with 'title' and 'text'")

        compiled = self.compile(template)
        try:
            return self._render(
                compiled,
                template,
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                continue_final_message=continue_final_message,
                template_vars=template_vars,
            )
        except RecursionError:
            # Inputs are copied (and templates may walk them) recursively.
            raise ValueError(
                "chat template input nests too deeply (messages, tools or template kwargs)"
            ) from None

    def _render(
        self,
        compiled: jinja2.Template,
        template: str,
        messages: list[dict],
        *,
        add_generation_prompt: bool,
        tools: list[dict] | None,
        documents: list[dict] | None,
        continue_final_message: bool | str,
        template_vars: Mapping[str, Any] | None,
    ) -> str:
        chat = [_prepare_message(m, i) for i, m in enumerate(messages)]
        final_text = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(chat, field, template)
        try:
            rendered = compiled.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **_plain(dict(template_vars or {})),
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
        if final_text is not None:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered
