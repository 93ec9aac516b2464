"""Tokenizer: a Hugging Face model directory's tokenizer, with eval-safe defaults.

Wraps `tokenizers.Tokenizer` (tokenizer.json) plus the metadata spread over
tokenizer_config.json, config.json and generation_config.json:

- `encode` never adds special tokens on its own; BOS only with `add_bos=True`.
- Special-token strings inside text (e.g. "<|im_end|>" in eval data) are plain
  text unless `encode_special_tokens=True`.
- `decode` skips special tokens unless `decode_special_tokens=True`.

NOTE: `tokenizers.Tokenizer.encode_special_tokens` has the opposite meaning of
our flag (True there = split special tokens as plain text). The underlying
object is kept with that attribute True; `encode(..., encode_special_tokens=True)`
flips it under a lock and always restores it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import tokenizers

from evalrun.engine.chat_template import (ChatTemplate, ChatTemplateError, ChatTemplates, find_chat_templates,
                                          finish_continuation, prepare_chat)
from evalrun.engine.gguf import is_gguf
from evalrun.engine.gguf_tokenizer import read_gguf_tokenizer
from evalrun.engine.model_files import read_json_object, read_model_file
from evalrun.engine.streaming import StreamingDecoder
from evalrun.engine.template_renderer import RenderLimits, TemplateRenderer

TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 64 << 20     # the largest released tokenizer.json known is ~33 MB (Gemma 3)


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read; the message names the file."""
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(model_dir: Path, name: str) -> dict[str, Any]:
    """The JSON object in the model's file `name` ({} without one), read as engine/model_files.py reads
    a model's files: a link out of the directory, a non-file, malformed JSON or a non-object is a
    TokenizerError naming it."""
    path = model_dir / name
    if not os.path.lexists(path):
        return {}
    return read_json_object(model_dir, path, TokenizerError)


def _read_tokenizer_json(model_dir: Path, path: Path) -> tokenizers.Tokenizer:
    data = read_model_file(model_dir, path, TokenizerError, MAX_TOKENIZER_BYTES)
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise TokenizerError(f"{path}: not a readable Hugging Face tokenizer file "
                             f"({' '.join(str(exc).split())[:300]})") from None


def _token_content(value: Any) -> Optional[str]:
    # tokenizer_config.json stores special tokens as "<s>" or {"content": "<s>", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """A model directory's tokenizer: encode/decode, special ids, chat template."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        model_dir: Path,
        special_tokens: dict[str, str],
        bos_token_id: Optional[int],
        eos_token_ids: list[int],
        chat_templates: ChatTemplates,
        render_limits: RenderLimits = RenderLimits(),
    ) -> None:
        self._hf = hf_tokenizer
        self._hf.encode_special_tokens = True  # default: special strings are plain text
        self._lock = threading.Lock()
        self.model_dir = model_dir
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.bos_token_id = bos_token_id
        self.eos_token_id: Optional[int] = eos_token_ids[0] if eos_token_ids else None
        self.eos_token_ids = eos_token_ids
        self.chat_templates = chat_templates
        self._templates: dict[str, ChatTemplate] = {}       # read and checked once, by name
        self._renderer = TemplateRenderer(render_limits)     # its worker starts on the first render
        ids = hf_tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size: int = max(ids) + 1 if ids else 0

    @classmethod
    def load(cls, model_dir: Union[str, Path], render_limits: RenderLimits = RenderLimits()) -> "Tokenizer":
        """Load from a Hugging Face model directory (needs tokenizer.json), or from a .gguf file's
        metadata (engine/gguf_tokenizer.py: the ids transformers' GGUF tokenizer gives).
        `render_limits` bound each chat-template render (engine/template_renderer.py).

        Raises FileNotFoundError naming the directory if tokenizer.json is missing; TokenizerError naming
        a file that is refused (a link out of the directory, not a regular file: engine/model_files.py),
        malformed, or JSON that is not an object.
        """
        model_dir = Path(model_dir)
        if is_gguf(model_dir):         # a llama.cpp file: the tokenizer its metadata describes
            parts = read_gguf_tokenizer(model_dir)
            return cls(parts.backend, model_dir, parts.special_tokens, parts.bos_token_id, parts.eos_token_ids,
                       ChatTemplates.from_source(parts.chat_template, model_dir), render_limits)
        path = model_dir / TOKENIZER_FILE
        if not os.path.lexists(path):
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in model directory {str(model_dir)!r}: "
                f"expected a Hugging Face tokenizer file at {str(path)!r}"
            )
        hf = _read_tokenizer_json(model_dir, path)
        tok_config = _read_json(model_dir, "tokenizer_config.json")
        model_config = _read_json(model_dir, "config.json")
        gen_config = _read_json(model_dir, "generation_config.json")
        special_tokens = {
            key: content
            for key in _SPECIAL_TOKEN_KEYS
            if (content := _token_content(tok_config.get(key))) is not None
        }
        bos_id = _resolve_id(hf, special_tokens.get("bos_token"), model_config.get("bos_token_id"))
        eos_id = _resolve_id(hf, special_tokens.get("eos_token"), model_config.get("eos_token_id"))
        eos_ids = _dedupe(
            _as_id_list(eos_id)
            + _as_id_list(gen_config.get("eos_token_id"))
            + _as_id_list(model_config.get("eos_token_id"))
        )
        templates = find_chat_templates(model_dir, tok_config)
        return cls(hf, model_dir, special_tokens, bos_id, eos_ids, templates, render_limits)

    def encode(
        self, text: str, add_bos: bool = False, encode_special_tokens: bool = False
    ) -> list[int]:
        """Token ids for `text`.

        `add_bos=True` prepends BOS (ValueError if the model has none).
        `encode_special_tokens=True` maps special-token strings in `text` to their
        ids; by default they are encoded as ordinary text.
        """
        if add_bos and self.bos_token_id is None:
            raise ValueError(f"model {str(self.model_dir)!r} has no BOS token; use add_bos=False")
        # NOTE: both paths take the lock, so no encode ever sees the flipped flag.
        with self._lock:
            self._hf.encode_special_tokens = not encode_special_tokens
            try:
                ids = self._hf.encode(text, add_special_tokens=False).ids
            finally:
                self._hf.encode_special_tokens = True
        return [self.bos_token_id, *ids] if add_bos else list(ids)

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids transformers' tokenizer gives for `text` (`tokenizer.encode(text)`): special-token
        strings are their ids, and add_special_tokens applies the tokenizer's post-processor (a
        Llama 3 or Gemma tokenizer adds its BOS; SmolLM2's adds nothing). lm-eval's HF backend
        tokenizes this way."""
        with self._lock:
            self._hf.encode_special_tokens = False
            try:
                return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)
            finally:
                self._hf.encode_special_tokens = True

    def encode_many_as_transformers(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode_as_transformers of each text, in one call (the tokenizer's threads share the work)."""
        with self._lock:
            self._hf.encode_special_tokens = False
            try:
                return [list(e.ids) for e in self._hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
            finally:
                self._hf.encode_special_tokens = True

    def decode(self, ids: Sequence[int], decode_special_tokens: bool = False) -> str:
        """Text for `ids`; special tokens are skipped unless `decode_special_tokens`."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=not decode_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary string of one id (e.g. "Ġhello"); ValueError if unknown."""
        piece = self._hf.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return piece

    def streaming_decoder(self, decode_special_tokens: bool = False) -> StreamingDecoder:
        """A fresh incremental detokenizer over this tokenizer."""
        return StreamingDecoder(self, decode_special_tokens=decode_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: Union[bool, str] = False, template: Optional[str] = None,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's chat template: the string transformers'
        `apply_chat_template(messages, tokenize=False, add_generation_prompt=..., continue_final_message=...,
        chat_template=<the selected template>, **kwargs)` gives. Extra kwargs are template variables
        (tools=..., documents=..., enable_thinking=False, ...), over the special tokens.
        `template` names one of chat_template_names() (None: the default, or "tool_use" when tools are given).

        The template runs bounded in a worker process (engine/template_renderer.py). Raises
        ChatTemplateError (a ValueError), one line naming the template's file, for a missing, refused,
        failing or runaway template.
        """
        return self.apply_chat_template_many([messages], add_generation_prompt, continue_final_message,
                                             template, **kwargs)[0]

    def apply_chat_template_many(self, conversations: Sequence[list[dict]], add_generation_prompt: bool = True,
                                 continue_final_message: Union[bool, str] = False, template: Optional[str] = None,
                                 **kwargs: Any) -> list[str]:
        """apply_chat_template for each conversation, sent to the render worker in batches (a round trip
        per RENDERS_PER_REQUEST conversations instead of one per conversation)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible: "
                                    "pass add_generation_prompt=False to continue the final message")
        chosen = self._chat_template(template, kwargs.get("tools") is not None)
        tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
        _check_tools_and_documents(tools, documents)
        shared = {**self.special_tokens, **kwargs, "tools": tools, "documents": documents,
                  "add_generation_prompt": add_generation_prompt}
        prepared = [prepare_chat(messages, chosen, continue_final_message) for messages in conversations]
        texts = self._renderer.render_many(chosen, [{**shared, "messages": chat} for chat, _ in prepared])
        return [text if final is None else finish_continuation(text, final, chosen)
                for text, (_, final) in zip(texts, prepared)]

    @property
    def chat_template(self) -> Optional[str]:
        """The source of the model's "default" chat template (None when it has none); read and checked
        as apply_chat_template reads it."""
        if "default" not in self.chat_templates.entries:
            return None
        return self._chat_template("default", has_tools=False).source

    def chat_template_names(self) -> list[str]:
        """The names of the model's chat templates, sorted ("default" among them when it has one)."""
        return self.chat_templates.names()

    def chat_template_source(self, template: Optional[str] = None) -> str:
        """The selected template's source: `template` as in apply_chat_template (None: the default)."""
        return self._chat_template(template, has_tools=False).source

    def chat_template_hash(self, template: Optional[str] = None) -> str:
        """The sha256 (hex) of the selected template's source: `template` as in apply_chat_template
        (None: the default)."""
        return self._chat_template(template, has_tools=False).sha256

    def close(self) -> None:
        """Stop the chat-template render worker (a later render starts a new one)."""
        self._renderer.close()

    def _chat_template(self, name: Optional[str], has_tools: bool) -> ChatTemplate:
        chosen = self.chat_templates.select(name, has_tools)
        if chosen not in self._templates:
            self._templates[chosen] = self.chat_templates.load(chosen)
        return self._templates[chosen]


def _check_tools_and_documents(tools: Any, documents: Any) -> None:
    # transformers takes callables as tools too (it turns them into JSON schemas); we take the schemas
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise TypeError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}")
    for document in documents or ():
        if not isinstance(document, dict):
            raise TypeError("documents must be dicts with 'title' and 'text' keys")


def _resolve_id(hf: tokenizers.Tokenizer, content: Optional[str], fallback: Any) -> Optional[int]:
    # A token string from tokenizer_config.json wins; else config.json's id (first if a list).
    if content is not None:
        token_id = hf.token_to_id(content)
        if token_id is not None:
            return token_id
    fallback_ids = _as_id_list(fallback)
    return fallback_ids[0] if fallback_ids else None


def _dedupe(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))
