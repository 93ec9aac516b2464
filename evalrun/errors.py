"""Which exceptions are the user's input (exit code 2, one clear line) and which are bugs."""
from __future__ import annotations

import json
from typing import Optional


class BadInput(Exception):
    """A problem with what the user passed; the message says what and where."""


class RunFailed(Exception):
    """The run stopped on a fault of the model or the data found while running (exit code 1, one
    clear line); the rows stored before it are kept and a resume goes on from them."""


class NonFiniteLogits(RunFailed):
    """A scored position's logits held a NaN or an Inf (--on-nonfinite error)."""


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
