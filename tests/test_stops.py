"""Stop-string streaming tests, exhaustive over the ways a text can be split into feeds."""
import itertools

import numpy as np
import pytest

from evalrun.engine.stops import StopStringMatcher, split_stop_conditions


def ref_stop(text, stops):
    """(emitted text, stopped) for the whole text at once."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def ref_held(fed, stops):
    """Longest suffix of `fed` that is a proper prefix of some stop string."""
    for n in range(len(fed), 0, -1):
        if any(len(s) > n and s.startswith(fed[-n:]) for s in stops):
            return fed[-n:]
    return ""


def all_splits(text):
    """Every way to cut `text` into non-empty consecutive pieces (2**(len-1) of them)."""
    for mask in range(2 ** max(len(text) - 1, 0)):
        cuts = [i + 1 for i in range(len(text) - 1) if mask >> i & 1]
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(pieces, stops):
    """Feed pieces one by one, checking invariants after each feed; return (emitted, stopped)."""
    m = StopStringMatcher(stops)
    want_emitted, want_stopped = ref_stop("".join(pieces), stops)
    emitted, fed = "", ""
    for piece in pieces:
        out, stopped = m.feed(piece)
        emitted += out
        fed += piece
        assert want_emitted.startswith(emitted), "emitted text that a stop string should have cut"
        if stopped:
            assert m.held == ""
            break
        assert emitted + m.held == fed
        assert m.held == ref_held(fed, stops), "held back too much or too little"
    if not stopped:
        emitted += m.flush()
    return emitted, stopped


# Each text is at most 11 code points, so every one of its <= 1024 splits is tried.
CASES = [
    ("hi STOP yo", ["STOP"]),
    ("abcSTOPSTOP", ["STOP"]),
    ("STOPxyz", ["STOP"]),                   # stop at the very start
    ("xyzSTO", ["STOP"]),                    # partial stop at the end must be flushed
    ("aababcabcd", ["abcd", "bc"]),          # overlapping stops: earliest start wins
    ("xxabcdyy", ["bcd", "abcde", "cd"]),
    ("aaaab", ["aab", "aaaaa"]),             # repeated prefix chars
    ("1\n\nQ\n\nQ:2", ["\n\nQ:", "\n\n\n"]),
    ("no stop", ["zz", "opx"]),
    ("日本語ストップです", ["ストップ"]),    # unicode, multi-code-point stop
    ("ok 👍🏽 done", ["👍🏽", "🏽🏽"]),       # emoji + skin-tone modifier (2 code points)
    ("café\u0301!", ["e\u0301", "\u0301!"]),  # combining accent
]


@pytest.mark.parametrize("text,stops", CASES, ids=[c[0] for c in CASES])
def test_every_split_gives_the_whole_text_answer(text, stops):
    assert len(text) <= 11
    want = ref_stop(text, stops)
    for pieces in all_splits(text):
        assert stream(pieces, stops) == want, pieces


@pytest.mark.parametrize("text,stops,want", [
    ("STOPxyz", ["STOP"], ("", True)),
    ("hello STOP world", ["STOP"], ("hello ", True)),
    ("Q: 1\n\nQuestion: 2", ["\n\nQuestion:"], ("Q: 1", True)),
    ("aababcabcd", ["abcd", "bc"], ("aababcabcd"[:4], True)),
    ("xyzSTO", ["STOP"], ("xyzSTO", False)),
    ("日本語ストップです", ["ストップ"], ("日本語", True)),
])
def test_golden_outputs(text, stops, want):
    assert stream(list(text), stops) == want


def test_holds_only_what_could_become_a_stop_and_flushes_it():
    m = StopStringMatcher(["</s>", "\n\n"])
    assert m.feed("abc<") == ("abc", False)
    assert m.held == "<"
    assert m.feed("/") == ("", False)
    assert m.feed("x\n") == ("</x", False)
    assert m.held == "\n"
    assert m.flush() == "\n"
    assert m.held == "" and m.flush() == ""


def test_after_stop_everything_is_discarded():
    m = StopStringMatcher(["END"])
    assert m.feed("aEN") == ("a", False)
    assert m.feed("Dtail") == ("", True)
    assert m.stopped
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_no_stop_strings_passes_everything_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.held == "" and m.flush() == ""


def test_empty_feed_is_harmless():
    m = StopStringMatcher(["ab"])
    assert m.feed("") == ("", False)
    assert m.feed("a") == ("", False)
    assert m.feed("") == ("", False)
    assert m.feed("b") == ("", True)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [3], "STOP"])
def test_matcher_rejects_bad_stop_strings(bad):
    with pytest.raises(ValueError):
        StopStringMatcher(bad)


def test_random_texts_against_reference():
    alphabet = "ab\n"
    stops = ["aba", "\n\n", "bb\na"]
    for length in range(1, 8):
        for chars in itertools.product(alphabet, repeat=length):
            text = "".join(chars)
            assert stream(list(text), stops) == ref_stop(text, stops)
            assert stream([text], stops) == ref_stop(text, stops)


# ---------------------------------------------------------------- split_stop_conditions

def test_split_stop_conditions():
    assert split_stop_conditions([2, "\n\n", 0, "</s>", 2, "\n\n", np.int64(7)]) == ({0, 2, 7}, ["\n\n", "</s>"])
    assert split_stop_conditions([]) == (set(), [])
    assert split_stop_conditions(None) == (set(), [])


@pytest.mark.parametrize("conds,message", [
    ([True], "bool"),
    ([1, 2.0], "float"),
    ([None], "NoneType"),
    ([b"x"], "bytes"),
    (["ok", ""], "empty"),
    ([-1], ">= 0"),
    ("\n", "single str"),
])
def test_split_stop_conditions_rejects(conds, message):
    with pytest.raises(ValueError, match=message):
        split_stop_conditions(conds)
