"""Which exceptions are the user's input (exit code 2, one clear line) and which are bugs."""
from __future__ import annotations

import json
from typing import Optional


class BadInput(Exception):
    """A problem with what the user passed; the message says what and where."""


def as_bad_input(exc: BaseException) -> Optional[BadInput]:
    from engine.config import ConfigError
    from engine.weights import WeightsError
    from tasks.base import TaskDataError
    from results import NotARunDirError, ResumeMismatchError, RunDirBusyError

    user_errors = (FileNotFoundError, NotADirectoryError, ConfigError, WeightsError, TaskDataError,
                   ResumeMismatchError, NotARunDirError, RunDirBusyError, json.JSONDecodeError)
    if isinstance(exc, user_errors):
        return BadInput(str(exc))
    return None
