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

import json
import threading
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import tokenizers

from evalrun.engine.chat_template import compile_chat_template, find_chat_template, render_chat_template
from evalrun.engine.gguf import is_gguf
from evalrun.engine.gguf_tokenizer import read_gguf_tokenizer
from evalrun.engine.streaming import StreamingDecoder

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read; the message names the file."""
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


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
        chat_template: Optional[str],
    ) -> None:
        self._hf = hf_tokenizer
        self._hf.encode_special_tokens = True  # default: special strings are plain text
        self._lock = threading.Lock()
        self.model_dir = model_dir
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.bos_token_id = bos_token_id
        self.eos_token_id: Optional[int] = eos_token_ids[0] if eos_token_ids else None
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self._compiled_template: Optional[jinja2.Template] = None
        ids = hf_tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size: int = max(ids) + 1 if ids else 0

    @classmethod
    def load(cls, model_dir: Union[str, Path]) -> "Tokenizer":
        """Load from a Hugging Face model directory (needs tokenizer.json), or from a .gguf file's
        metadata (engine/gguf_tokenizer.py: the ids transformers' GGUF tokenizer gives).

        Raises FileNotFoundError naming the directory if tokenizer.json is missing.
        """
        model_dir = Path(model_dir)
        if is_gguf(model_dir):         # a llama.cpp file: the tokenizer its metadata describes
            parts = read_gguf_tokenizer(model_dir)
            return cls(parts.backend, model_dir, parts.special_tokens, parts.bos_token_id, parts.eos_token_ids,
                       parts.chat_template)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in model directory {str(model_dir)!r}: "
                f"expected a Hugging Face tokenizer file at {str(path)!r}"
            )
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            raise TokenizerError(f"{path}: not a readable Hugging Face tokenizer file ({exc})") from None
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        model_config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
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
        template = find_chat_template(model_dir, tok_config)
        return cls(hf, model_dir, special_tokens, bos_id, eos_ids, template)

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

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (extra kwargs become
        template variables, e.g. tools=..., enable_thinking=False).

        Raises ValueError if the model directory has no chat template.
        """
        if self._compiled_template is None:
            if self.chat_template is None:
                raise ValueError(
                    f"model {str(self.model_dir)!r} has no chat template "
                    "(no tokenizer_config.json 'chat_template' and no chat_template.jinja)"
                )
            self._compiled_template = compile_chat_template(self.chat_template)
        return render_chat_template(
            self._compiled_template, messages, add_generation_prompt, self.special_tokens, **kwargs
        )


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
