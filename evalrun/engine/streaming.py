"""Incremental detokenization: turn a stream of token ids into a stream of text.

Decoding token by token and concatenating is wrong twice over: a UTF-8
character can span several byte-level tokens (each alone decodes to U+FFFD),
and SentencePiece-style decoders strip the leading space of whatever sequence
they are given first. So each push decodes a small window of ids that starts
at `prefix_offset`, and emits only what the newest ids add beyond the already
emitted part of the window (the technique of vLLM / HF TextStreamer / TGI):

    ids:   ... | t_p  t_p+1 ... | t_r ... t_n |
               ^prefix_offset   ^read_offset  ^len(ids)
    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    full_text   = decode(ids[prefix_offset:])
    new text    = full_text[len(prefix_text):]              # if it doesn't end in U+FFFD

NOTE: only the window ids[prefix_offset:] is stored, so `_ids[0]` is
`prefix_offset` and each push costs two short decodes regardless of length.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"


class Decodes(Protocol):
    """Anything with the `Tokenizer.decode` signature."""

    def decode(self, ids: Sequence[int], decode_special_tokens: bool = False) -> str: ...


class StreamingDecoder:
    """Feeds token ids one at a time and returns text as soon as it is certain.

    Concatenating every `push` result and a final `flush` equals
    `tokenizer.decode(all_ids, decode_special_tokens)`.
    """

    def __init__(self, tokenizer: Decodes, decode_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._decode_special_tokens = decode_special_tokens
        self._ids: list[int] = []  # the window ids[prefix_offset:]
        self._read_offset = 0  # relative to the window start

    def push(self, token_id: int) -> str:
        """Add one token id; return the text that is now certain (maybe "")."""
        self._ids.append(int(token_id))
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or the tail is half a character
        return self._advance(full_text[len(prefix_text) :])

    def flush(self) -> str:
        """Return whatever is still held back (e.g. an incomplete character)."""
        prefix_text, full_text = self._decode_window()
        return self._advance(full_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        special = self._decode_special_tokens
        prefix_text = decode(self._ids[: self._read_offset], decode_special_tokens=special)
        full_text = decode(self._ids, decode_special_tokens=special)
        return prefix_text, full_text

    def _advance(self, new_text: str) -> str:
        # The emitted ids become the next window's prefix.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        return new_text
