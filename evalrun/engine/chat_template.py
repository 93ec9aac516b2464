"""Hugging Face chat templates: which one a model directory has, read safely, and the chat prepared
around it exactly as transformers prepares it. Rendering happens elsewhere: templates are untrusted
Jinja, rendered in a bounded worker process (template_renderer.py, template_worker.py).

Finding (transformers 5 `from_pretrained` on a local directory):
- `chat_template.jinja` is the template "default"; each `additional_chat_templates/NAME.jinja` is
  the template NAME. When any of these files exist they are the model's templates and
  tokenizer_config.json's `chat_template` is ignored (transformers: files take priority).
- Otherwise tokenizer_config.json's `chat_template`: a string (the template "default") or a list of
  {"name", "template"} entries.
- Selecting (transformers' `get_chat_template`): a name picks that template (an unknown name is an
  error listing the names); no name picks "tool_use" when tools are given and the model has it,
  else "default"; a model whose named templates lack a "default" needs a name.

File safety: a template file (`chat_template.jinja`, `additional_chat_templates/*.jinja`, and
tokenizer_config.json when it carries a `chat_template`) is refused when it is a symbolic link, when
it resolves outside the (resolved) model directory, when it is not a regular file, or when it is
larger than MAX_TEMPLATE_BYTES. One exception keeps Hugging Face hub downloads working: in a hub
cache snapshot (`.../models--ORG--NAME/snapshots/REV/`) every file is a link into the repo's
`blobs/` folder, so a link that resolves to a regular file in that same repo's `blobs/` is accepted.
A file is checked when its template is first used, so a model whose template is refused still
serves runs that use no chat template.

Preparing (transformers' `apply_chat_template` / `render_jinja_template`): message keys whose value
is None are dropped; reasoning under any of its names is also given as `reasoning_content` and
`thinking`; `continue_final_message` tags the final message, and the rendered text is cut at the
tag (where the template trimmed the message's trailing whitespace, the cut text is right-stripped).

Every error is a ChatTemplateError: one line, naming the template's file where there is one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import jinja2.exceptions

from .model_files import check_model_file, read_model_file

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20        # real chat templates are a few KiB; the largest known ~30 KiB
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, read or rendered; the message is one line."""


class ChatTemplateRenderError(ChatTemplateError, jinja2.exceptions.TemplateError):
    """The template itself raised (raise_exception, a syntax error, an undefined name, ...)."""


class ChatTemplateSecurityError(ChatTemplateRenderError, jinja2.exceptions.SecurityError):
    """The template tried something the sandbox forbids."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass(frozen=True)
class ChatTemplate:
    """One selected template: its name, the file it came from, its source and that source's sha256."""
    name: str
    path: Path
    source: str
    label: str            # "chat template PATH" (or "chat template 'NAME' in PATH"): errors start with it
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha256", hashlib.sha256(self.source.encode("utf-8")).hexdigest())


@dataclass(frozen=True)
class _Entry:
    path: Path                      # the file that holds the template
    inline: Optional[str] = None    # the text, when it sits inside a JSON file (or GGUF metadata)
    check_file: bool = True         # False for a GGUF file's metadata (the file is the model itself)
    label: str = ""


@dataclass(frozen=True)
class ChatTemplates:
    """Where a model's chat templates are, by name; nothing is read or checked until `load`."""
    model_dir: Path
    entries: Mapping[str, _Entry]

    @classmethod
    def from_source(cls, source: Optional[str], path: Path) -> "ChatTemplates":
        """A single default template already in memory (a GGUF file's metadata)."""
        if not source:
            return cls(path, {})
        return cls(path, {"default": _Entry(path, source, check_file=False, label=f"chat template {path}")})

    def names(self) -> list[str]:
        return sorted(self.entries)

    def select(self, name: Optional[str], has_tools: bool) -> str:
        """The name transformers' get_chat_template picks; ChatTemplateError if it cannot."""
        if not self.entries:
            raise ChatTemplateError(
                f"model {str(self.model_dir)!r} has no chat template (no {TEMPLATE_FILE}, no {TEMPLATE_DIR}/*.jinja "
                f"and no 'chat_template' in {CONFIG_FILE})")
        if name is not None:
            if name not in self.entries:
                raise ChatTemplateError(f"model {str(self.model_dir)!r} has no chat template named {name!r}; "
                                        f"it has: {', '.join(self.names())}")
            return name
        if has_tools and "tool_use" in self.entries:
            return "tool_use"
        if "default" not in self.entries:
            raise ChatTemplateError(f"model {str(self.model_dir)!r} has several chat templates and none named "
                                    f"'default'; choose one of: {', '.join(self.names())}")
        return "default"

    def load(self, name: str) -> ChatTemplate:
        """Read (and check) the template `name`, one of names()."""
        entry = self.entries[name]
        if entry.check_file and entry.inline is not None:
            check_template_file(self.model_dir, entry.path)       # the JSON file it came from
            source = entry.inline
        elif entry.check_file:
            source = _read_template(self.model_dir, entry.path)
        else:
            source = entry.inline
        if not isinstance(source, str):
            raise ChatTemplateError(f"{entry.label}: the template is not a string")
        return ChatTemplate(name, entry.path, source, entry.label)


def find_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplates:
    """The model directory's chat templates as transformers finds them (see the module docstring);
    only file names are looked at here."""
    model_dir = Path(model_dir)
    files: dict[str, _Entry] = {}
    default = model_dir / TEMPLATE_FILE
    if os.path.lexists(default):
        files["default"] = _Entry(default, label=f"chat template {default}")
    extra = model_dir / TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.name[: -len(".jinja")]] = _Entry(path, label=f"chat template {path}")
    if files:
        return ChatTemplates(model_dir, files)
    return ChatTemplates(model_dir, _config_entries(model_dir / CONFIG_FILE, tokenizer_config.get("chat_template")))


def _config_entries(path: Path, value: Any) -> dict[str, _Entry]:
    if isinstance(value, str):
        return {"default": _Entry(path, value, label=f"chat template {path}")} if value else {}
    if isinstance(value, (list, tuple)):
        entries = {}
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                raise ChatTemplateError(f"{path}: 'chat_template' must be a string or a list of "
                                        f"{{\"name\", \"template\"}} entries, got {one_line(repr(item))[:200]}")
            name = item["name"]
            entries[name] = _Entry(path, item.get("template"), label=f"chat template {name!r} in {path}")
        return entries
    return {}


def check_template_file(model_dir: Path, path: Path) -> Path:
    """The real path of template file `path` in `model_dir`; ChatTemplateError naming it when it is a
    symbolic link or lies outside the directory (a hub-cache snapshot's link into its repo's blobs/
    excepted) or is not a regular file: the rule every file of a model is read by (engine/model_files.py)."""
    return check_model_file(model_dir, path, ChatTemplateError, "chat template")


def _read_template(model_dir: Path, path: Path) -> str:
    data = read_model_file(model_dir, path, ChatTemplateError, MAX_TEMPLATE_BYTES, "chat template")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"chat template {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


# --- the chat, prepared as transformers prepares it ---------------------------------------------------
def prepare_chat(messages: list, template: ChatTemplate,
                 continue_final_message: Union[bool, str]) -> tuple[list[dict], Optional[str]]:
    """(chat, final message) for rendering: None-valued keys dropped, reasoning aliased and, with
    continue_final_message, the final message tagged (final message None without it)."""
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    if not continue_final_message:
        return chat, None
    return chat, _tag_final_message(chat, template, continue_final_message)


def _tag_final_message(chat: list[dict], template: ChatTemplate, continue_final_message: Union[bool, str]) -> str:
    # transformers' render_jinja_template, step for step (its messages, one line each)
    if not chat:
        raise ChatTemplateError("continue_final_message is set but the conversation is empty")
    key = continue_final_message if isinstance(continue_final_message, str) else "content"
    final_message = chat[-1].get(key)
    if final_message is None:
        raise ChatTemplateError(f'continue_final_message is set but the final message has no "{key}" to continue')
    fields = [key]
    if key in REASONING_FIELDS:
        fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final_message]
    if not any(name in template.source for name in fields):
        raise ChatTemplateError(f'{template.label}: continue_final_message is set to "{key}" but the template '
                                "never reads that field")
    if isinstance(final_message, (list, tuple)):
        blocks = [dict(block) if isinstance(block, dict) else block for block in final_message]
        for block in reversed(blocks):
            if "text" in block:
                final_message, block["text"] = block["text"], block["text"] + CONTINUE_TAG
                break
        else:
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
        chat[-1] = {**chat[-1], key: blocks}
        return final_message
    chat[-1] = {**chat[-1], **{name: chat[-1][name] + CONTINUE_TAG for name in fields}}
    return final_message


def finish_continuation(rendered: str, final_message: str, template: ChatTemplate) -> str:
    """The rendered chat cut where the final message's tag is, as transformers cuts it."""
    tag = CONTINUE_TAG.strip()
    if final_message.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(f"{template.label}: continue_final_message is set but the final message does not "
                                "appear in the rendered chat (the template drops or changes part of it)")
    at = rendered.rindex(tag)
    if rendered[at: at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]                    # the template kept the message's spacing
    return rendered[:at].rstrip()               # it trimmed trailing whitespace: so must we
