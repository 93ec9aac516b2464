"""N-gram (prompt-lookup) drafting (evalrun/engine/draft.py) against a brute-force reading of its contract."""
from __future__ import annotations

import random

import pytest

from evalrun.engine.draft import NgramDrafter


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Scan every earlier occurrence of each suffix, longest suffix first, latest occurrence first;
    then look the text up again after each guessed token at the same match (periodic extension)."""
    end = len(tokens)
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        suffix = tokens[end - n:]
        starts = [i for i in range(end - n) if tokens[i:i + n] == suffix]     # occurrences ending before the end
        if starts:
            at = max(starts) + n
            text = list(tokens)
            for _ in range(k):                 # each guess copies the token that followed its copy
                text.append(text[at + len(text) - end])
            return text[end:]
    return []


@pytest.mark.parametrize("vocab,max_ngram,min_ngram", [(3, 4, 1), (5, 3, 2), (20, 4, 1), (2, 1, 1), (8, 6, 3)])
def test_proposals_match_the_brute_force_reading(vocab, max_ngram, min_ngram):
    rng = random.Random(vocab * 31 + max_ngram)
    for trial in range(20):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        d = NgramDrafter(tokens, max_ngram=max_ngram, min_ngram=min_ngram)
        for _ in range(40):
            for k in (1, 4, 9):
                assert d.propose(k) == brute_force(d.tokens, k, max_ngram, min_ngram), (trial, d.tokens, k)
            d.append(rng.randrange(vocab))


def test_repetitive_text_is_continued_and_fresh_text_gets_nothing():
    d = NgramDrafter([1, 2, 3, 4, 1, 2])
    assert d.propose(6) == [3, 4, 1, 2, 3, 4]          # "1 2" seen before: what followed, then the period
    assert d.match() == (2, 2)
    assert NgramDrafter([1, 2, 3, 4, 5]).propose(4) == []             # no suffix occurred before
    assert NgramDrafter([7, 7]).propose(3) == [7, 7, 7]
    assert NgramDrafter([]).propose(3) == [] and NgramDrafter([5]).propose(2) == []
    assert NgramDrafter([1, 2, 1, 2], min_ngram=3).propose(2) == []   # only a 2-gram repeats
    assert NgramDrafter([1, 2, 1]).propose(0) == []


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "9 1" occurred at 0; "1" alone occurred more recently at 3 (followed by 5)
    d = NgramDrafter([9, 1, 4, 1, 5, 9, 1])
    assert d.match() == (2, 2) and d.propose(2) == [4, 1]
    assert NgramDrafter([9, 1, 4, 1, 5, 9, 1], max_ngram=1).propose(2) == [5, 9]


@pytest.mark.parametrize("kwargs", [{"min_ngram": 0}, {"max_ngram": 2, "min_ngram": 3}, {"max_ngram": 1.5}])
def test_bad_ngram_sizes_are_refused(kwargs):
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramDrafter([1, 2], **kwargs)
