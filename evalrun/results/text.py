"""Text from outside (a model's output, a dataset's question, a run directory's names and
manifest) made safe to print on a terminal or to open in a spreadsheet.

    terminal_safe   every control character a terminal acts on, shown as the 4 characters \\xNN
                    (C0 but newline and tab, DEL, C1), lone surrogates as \\uXXXX: a completion
                    cannot clear the screen, colour a fake "passed" line or set the window title
    csv_safe        terminal_safe, and a string cell that starts as a formula (= + - @ tab CR,
                    OWASP's CSV-injection list) gets a leading single quote; numbers stay numbers

Every command prints such text through `terminal_safe` (evalrun show, compare, regress, suite,
the CLI's error and warning lines, which escape newlines too). It is for reading, not a round
trip: a literal backslash-x in the text reads the same as an escaped control character.
"""
from __future__ import annotations

import numbers
import re
from typing import Any

# C0 except \t (0x09) and \n (0x0a); DEL and C1 (0x7f-0x9f); lone surrogates (JSON can hold them,
# UTF-8 cannot print them)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xff else f"\\u{code:04x}"


def terminal_safe(value: Any, one_line: bool = False) -> str:
    """`str(value)` with every control character but newline and tab shown as `\\xNN`; with
    `one_line`, newlines too (an error line stays one line, whatever path or text it names)."""
    text = value if isinstance(value, str) else str(value)
    return (_CONTROL_OR_NEWLINE if one_line else _CONTROL).sub(_escape, text)


def csv_safe(value: Any) -> Any:
    """A CSV cell: numbers (and None, bools) unchanged; text escaped as `terminal_safe` does, with a
    leading `'` when it starts with = + - @ or tab, so no spreadsheet reads it as a formula
    ("-2+3" is text and gets the quote; the number -2.5 is a number and does not)."""
    if value is None or isinstance(value, numbers.Number):          # numpy's scalars too
        return value
    text = terminal_safe(value)
    return "'" + text if text.startswith(_FORMULA_START) else text
