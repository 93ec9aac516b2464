"""Hugging Face chat templates: finding them in a model directory and rendering them.

Rendering mirrors transformers' `render_jinja_template`: a jinja2
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension, a `{% generation %}` block tag (rendered as its body),
the `raise_exception` / `strftime_now` globals and a `tojson` filter that does
not HTML-escape. Chat templates from the Hub are untrusted code: they only ever
run inside the sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"


def find_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> Optional[str]:
    """Return the model's default chat template source, or None if it has none.

    Looks at tokenizer_config.json's `chat_template` (a string, or a list of
    {"name", "template"} entries of which "default" is used), then at
    `chat_template.jinja` in `model_dir`.
    """
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    path = Path(model_dir) / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    return None


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    # for rendering it is transparent.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Optional[int] = None,
    separators: Optional[tuple[str, str]] = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment HF uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    template: jinja2.Template,
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    **kwargs: Any,
) -> str:
    """Render `messages` with a compiled template.

    `special_tokens` (e.g. bos_token, eos_token) are template variables;
    `kwargs` (tools, documents, enable_thinking, ...) override them, as in HF.
    """
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
    variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **kwargs}
    return template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )
