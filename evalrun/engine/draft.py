"""N-gram (prompt-lookup) drafting for speculative decoding (issue 14): a job's next tokens guessed
from its own prompt and output, with no model.

    drafter = NgramDrafter(prompt_ids, max_ngram=4, min_ngram=1)
    drafter.extend(accepted_ids)            # every token the job keeps, in order
    drafter.propose(4)                      # -> up to 4 ids, [] when nothing matches

The proposal follows the longest suffix of the job's tokens (max_ngram down to min_ngram tokens)
that occurred earlier, at its most recent earlier occurrence: the tokens that followed it there.
Where those run into the end of the text, the text is taken to go on as it did from there (it
repeats with that period), which is what looking up again after each guessed token would give.
No match: no proposal (nothing is padded with guesses).

The index keeps, per n-gram, where its most recent earlier occurrence ended; appending a token
updates one entry per n, so a proposal costs O(max_ngram) whatever the length. Only kept tokens
are appended: a draft's rejected tokens never reach it, so there is nothing to roll back.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class NgramDrafter:
    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = 4, min_ngram: int = 1):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                             f"max_ngram={max_ngram!r}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}     # n-gram -> index right after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, token: int) -> None:
        """The job keeps `token`: every n-gram that ended just before it now has a continuation."""
        toks, end = self.tokens, len(self.tokens)
        for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
            self._after[tuple(toks[end - n:end])] = end
        toks.append(int(token))

    def match(self) -> tuple[int, int]:
        """(n, start of the continuation) of the longest suffix with an earlier occurrence, or (0, -1)."""
        toks, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            at = self._after.get(tuple(toks[end - n:]))
            if at is not None:
                return n, at
        return 0, -1

    def propose(self, k: int) -> list[int]:
        """Up to k guessed next tokens ([] when no suffix of min_ngram tokens or more occurred before)."""
        if k < 1:
            return []
        n, at = self.match()
        if not n:
            return []
        period = len(self.tokens) - at                  # >= 1: the occurrence ends before the suffix does
        return [self.tokens[at + i % period] for i in range(k)]
