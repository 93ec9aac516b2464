"""The tokenizer a GGUF file describes (its `tokenizer.ggml.*` and `tokenizer.chat_template` metadata),
built by transformers' GGUF tokenizer converter: the same `tokenizers.Tokenizer`, so the same ids,
as `AutoTokenizer.from_pretrained(dir, gguf_file=name)`. evalrun's Tokenizer wraps it.

Needs transformers (an optional dependency, imported where used) and the gguf package.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import tokenizers

from .gguf import GGUFError, check_gguf_file

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What evalrun's Tokenizer is made of, as the file states it."""
    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]      # e.g. {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    bos_token_id: Optional[int]
    eos_token_ids: list[int]
    chat_template: Optional[str]


def read_gguf_tokenizer(path: "str | Path") -> GGUFTokenizerParts:
    """The tokenizer of the GGUF file at `path` (FileNotFoundError, GGUFError on a bad file)."""
    path = Path(path)
    real = check_gguf_file(path)
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as exc:
        raise GGUFError(f"the tokenizer of {path} is built by transformers' GGUF converter "
                        f"(transformers >= 5.25: pip install 'evalrun[demo]'): {exc}") from None
    try:
        architecture, vocab, config = get_gguf_tokenizer(str(real))
        backend, _ = convert_gguf_tokenizer(architecture, vocab)
    except Exception as exc:  # noqa: BLE001 - a damaged file or an unknown vocabulary fails in many ways
        raise GGUFError(f"{path}: no tokenizer can be built from its metadata ({type(exc).__name__}: {exc})") from None
    special = {key: config[key] for key in SPECIAL_TOKEN_KEYS if isinstance(config.get(key), str)}
    return GGUFTokenizerParts(backend, special, _token_id(vocab.get("bos_token_id")),
                              [i for i in [_token_id(vocab.get("eos_token_id"))] if i is not None],
                              config.get("chat_template"))


def _token_id(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
