"""Stop conditions: token ids and stop strings that end a job's generation.

A stop string may span several tokens' text, so streamed text is held back
while its tail could still grow into a stop string:

    fed so far:  "The answer is 4\\n\\nQu"      stop strings: ["\\n\\nQuestion:"]
                  |--- emitted ----||held|
                                    "\\n\\nQu" is a prefix of a stop string

Strings are compared as Python `str` (code points); the caller feeds text that
is already decoded (incomplete UTF-8 sequences are the detokenizer's concern).
"""
from __future__ import annotations

from numbers import Integral
from typing import Iterable, Optional, Union


class StopStringMatcher:
    """Streams text for one job, never letting any part of a stop string out."""

    def __init__(self, stop_strings: Iterable[str]):
        if isinstance(stop_strings, str):
            raise ValueError(f"stop_strings must be a list of strings, not the single string {stop_strings!r}")
        stops = list(stop_strings)
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stops))
        # Proper prefixes only: a whole stop string is a match, not something to hold.
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        self._max_held = max((len(stop) - 1 for stop in self._stops), default=0)
        self._held = ""
        self._stopped = False

    @property
    def held(self) -> str:
        return self._held

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Append newly decoded text; return (text safe to emit now, stopped).

        Holds back the longest suffix that is a prefix of some stop string.
        When a stop string occurs, returns the text before the earliest
        occurrence and True; everything after is discarded. Once stopped,
        every later call returns ("", True).
        """
        if self._stopped:
            return "", True
        buffer = self._held + text
        hit = self._earliest_stop(buffer)
        if hit is not None:
            self._held = ""
            self._stopped = True
            return buffer[:hit], True
        keep = self._held_length(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of generation (no stop hit): the held-back text, which is now safe."""
        held, self._held = self._held, ""
        return held

    def _earliest_stop(self, buffer: str) -> Optional[int]:
        # NOTE: the held text never contains a whole stop string, and any occurrence
        # that started in already emitted text would have been held, so searching
        # the buffer alone finds every new occurrence.
        starts = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        return min(starts, default=None)

    def _held_length(self, buffer: str) -> int:
        for n in range(min(len(buffer), self._max_held), 0, -1):
            if buffer[-n:] in self._prefixes:
                return n
        return 0


def split_stop_conditions(conds: Optional[Iterable[Union[int, str]]]) -> tuple[set[int], list[str]]:
    """Split a mixed list of stop conditions into (token ids, stop strings).

    Ints (not bools) are token ids and must be >= 0; strings must be non-empty.
    Strings keep their order, without duplicates. `None` means no conditions.
    Anything else raises ValueError.
    """
    if conds is None:
        return set(), []
    if isinstance(conds, (str, bytes)):
        kind = type(conds).__name__
        raise ValueError(f"stop conditions must be a list of token ids and strings, not a single {kind} {conds!r}")
    token_ids: set[int] = set()
    strings: list[str] = []
    for cond in conds:
        if isinstance(cond, bool) or not isinstance(cond, (Integral, str)):
            kind = type(cond).__name__
            raise ValueError(f"a stop condition must be a token id (int) or a string, got {kind} {cond!r}")
        if isinstance(cond, str):
            if not cond:
                raise ValueError("a stop string must not be empty")
            if cond not in strings:
                strings.append(cond)
        elif cond < 0:
            raise ValueError(f"a stop token id must be >= 0, got {cond}")
        else:
            token_ids.add(int(cond))
    return token_ids, strings
