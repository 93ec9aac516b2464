"""Which exceptions are the user's input (exit code 2, one clear line) and which are bugs."""
from __future__ import annotations

import errno
import json
import os
from typing import Optional

from evalrun.engine.chat_template import ChatTemplateError
from evalrun.engine.config import ConfigError
from evalrun.engine.tokenizer import TokenizerError
from evalrun.engine.weights import WeightsError
from evalrun.results import NotARunDirError, ResumeMismatchError, RunDirBusyError
from evalrun.tasks.base import TaskDataError, TaskSettingError


class BadInput(Exception):
    """A problem with what the user passed; the message says what and where."""


class RunFailed(Exception):
    """The run stopped on a fault of the model or the data found while running (exit code 1, one
    clear line); the rows stored before it are kept and a resume goes on from them."""


class NonFiniteLogits(RunFailed):
    """A scored position's logits held a NaN or an Inf (--on-nonfinite error)."""


_WRITE_HINTS = {
    errno.ENOSPC: "free some space and run the same command again (a run resumes from the rows it stored)",
    errno.EDQUOT: "free some of the quota and run the same command again (a run resumes from the rows it stored)",
    errno.EROFS: "that file system is read-only: for a run, give an --output-dir on a writable one",
    errno.EACCES: "check the permissions of that path (for a run: an --output-dir this user may write to)",
    errno.EPERM: "check the permissions of that path (for a run: an --output-dir this user may write to)",
}


def as_bad_input(exc: BaseException) -> Optional[BadInput]:
    user_errors = (FileNotFoundError, NotADirectoryError, ConfigError, WeightsError, TokenizerError, ChatTemplateError,
                   TaskDataError, TaskSettingError, ResumeMismatchError, NotARunDirError, RunDirBusyError,
                   json.JSONDecodeError)
    if isinstance(exc, user_errors):
        return BadInput(str(exc))
    if isinstance(exc, OSError) and exc.errno in _WRITE_HINTS and exc.filename:    # a file the user can act on
        return BadInput(f"{exc.filename}: {exc.strerror or os.strerror(exc.errno)}; {_WRITE_HINTS[exc.errno]}")
    return None


def as_out_of_memory(exc: BaseException) -> Optional[RunFailed]:
    """A memory failure while running (the model and cache were loaded: those map to BadInput where
    they happen), as one line: the rows stored before it are kept and a rerun resumes from them."""
    nomem = isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "DefaultCPUAllocator" in str(exc)))
    if not nomem:
        return None
    first = (str(exc).splitlines() or [""])[0]
    return RunFailed(f"out of memory while running ({type(exc).__name__}: {first}); the rows stored before it are "
                     "kept: run the same command again, with a smaller --max-batch-size or --cache-memory")
